"""Plans of whole-document samples made era by era, for a cache whose build is running.

``cache.packed(seq_len)`` and ``cache.documents(seq_len)`` plan every document at once
(:mod:`streampack.samples.packing`), and a packed plan's bins depend on the documents around each one: the
plan of a growing cache would change as it grows. A follower (:mod:`streampack.loader.follow`) instead
cuts the documents into **eras** of consecutive documents, ``[D_e, D_{e+1})`` (sizes doubling from
``first_era`` to ``largest_era``, as :class:`~streampack.order.follow.Eras` says), and plans each era on
its own, from its documents alone, once they are all committed. An era's plan is then final: it is the
same plan whether it was made while the build ran or after it ended, so a sample never changes once
served.

**Era boundaries fall between documents**, never inside one: a document belongs to the era of its index,
and every piece of it (``too_long="split"``) is planned, and so served, with that era. A bin never holds
documents of two eras. The price is a little more padding than one plan of the whole cache (each era's
last bins are packed from what is left of it), which larger eras make smaller.

:func:`era_plan` plans one era (best-fit decreasing within chunks of
:data:`~streampack.samples.packing.CHUNK_DOCS` pieces for ``"packed"``, one piece per sample for
``"documents"``); :func:`joined` lays the plans of consecutive eras end to end as one
:class:`~streampack.samples.layout.Bins` table, the layout a follower reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from streampack.samples.layout import Bins
from streampack.samples.packing import ASSIGNERS, CHUNK_DOCS, NoTarget, Pieces, TooLong, binned

if TYPE_CHECKING:
    from streampack.reader import Cache

__all__ = ["EraPlan", "era_plan", "joined"]


@dataclass(frozen=True)
class EraPlan:
    """The samples of one era's documents: ``starts`` (each sample's first piece, then the number of
    pieces, from 0), and each piece's shard, first token in its shard, and length; what the planner left
    out (``dropped`` documents, pieces with ``no_target``)."""

    starts: np.ndarray
    shards: np.ndarray
    lo: np.ndarray
    lengths: np.ndarray
    dropped: int = 0
    no_target: int = 0

    def __len__(self) -> int:
        """Samples of the era."""
        return len(self.starts) - 1


def era_plan(
    cache: Cache,
    first: int,
    stop: int,
    *,
    kind: str,
    seq_len: int,
    too_long: TooLong,
    no_target: NoTarget,
) -> EraPlan:
    """The plan of documents ``[first, stop)`` of ``cache`` (all committed), on their own.

    Args:
        cache: the cache (the committed part of a running build will do: it holds those documents).
        first: the era's first document (a global index).
        stop: the document after its last.
        kind: ``"packed"`` (best-fit decreasing) or ``"documents"`` (one piece per sample).
        seq_len: tokens per sample.
        too_long: what to do with a document longer than ``seq_len`` (see ``cache.packed``).
        no_target: ``"keep"`` or ``"drop"`` the pieces without a target token.
    """
    pieces = Pieces(cache, None, seq_len, too_long, no_target == "drop")  # type: ignore[arg-type]
    doc_starts = np.asarray(cache.doc_starts, dtype=np.int64)
    parts = []
    for shard in _shards_of(doc_starts, first, stop):
        ends = np.asarray(cache.shard_offsets(shard), dtype=np.int64)
        base = int(doc_starts[shard])
        lo_doc, hi_doc = max(first, base) - base, min(stop, int(doc_starts[shard + 1])) - base
        starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)[lo_doc:hi_doc]
        lengths = ends[lo_doc:hi_doc] - starts
        keep = lengths > 0
        lo, length = pieces._cut(starts[keep], lengths[keep])
        lo, length = pieces._targeted(shard, lo, length)
        parts.append((np.full(len(lo), shard, dtype=np.int64), lo, length))
    empty = np.zeros(0, dtype=np.int64)
    shards = np.concatenate([p[0] for p in parts]) if parts else empty
    lo = np.concatenate([p[1] for p in parts]) if parts else empty
    lengths = np.concatenate([p[2] for p in parts]) if parts else empty
    assign = ASSIGNERS[kind]
    tables = []
    for begin in range(0, len(lengths), CHUNK_DOCS):
        chunk = slice(begin, begin + CHUNK_DOCS)
        bins = assign(lengths[chunk], seq_len)
        tables.append(binned(shards[chunk], lo[chunk], lengths[chunk], bins, begin))
    return EraPlan(
        np.concatenate([*(t["starts"] for t in tables), [len(lengths)]]).astype(np.int64),
        np.concatenate([empty, *(t["shards"] for t in tables)]),
        np.concatenate([empty, *(t["lo"] for t in tables)]),
        np.concatenate([empty, *(t["lengths"] for t in tables)]),
        dropped=pieces.dropped,
        no_target=pieces.no_target,
    )


def _shards_of(doc_starts: np.ndarray, first: int, stop: int) -> range:
    """The shards that hold documents of ``[first, stop)``."""
    if stop <= first:
        return range(0)
    lo = int(np.searchsorted(doc_starts, first, side="right")) - 1
    hi = int(np.searchsorted(doc_starts, stop - 1, side="right")) - 1
    return range(lo, hi + 1)


def joined(plans: Sequence[EraPlan], *, seq_len: int, pad_id: int, settings: dict[str, int | str]) -> Bins:
    """The plans of consecutive eras laid end to end: one :class:`~streampack.samples.layout.Bins`
    (held in memory), whose samples are era 0's, then era 1's, and so on."""
    empty = np.zeros(0, dtype=np.int64)
    pieces = np.cumsum([0, *(len(p.lengths) for p in plans)])
    starts = [plan.starts[:-1] + before for plan, before in zip(plans, pieces[:-1].tolist(), strict=True)]
    return Bins(
        np.concatenate([empty, *starts, [int(pieces[-1])]]).astype(np.int64),
        np.concatenate([empty, *(p.shards for p in plans)]),
        np.concatenate([empty, *(p.lo for p in plans)]),
        np.concatenate([empty, *(p.lengths for p in plans)]),
        seq_len=seq_len,
        pad_id=pad_id,
        settings=settings,
        dropped=sum(p.dropped for p in plans),
        no_target=sum(p.no_target for p in plans),
    )

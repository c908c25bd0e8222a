"""Plans of whole-document samples made era by era, for a cache whose build is running.

A packed plan of the whole cache would change as the build grows it, so a follower plans each era of
consecutive documents from its documents alone, once they are all committed: a sample never changes once
served. The price is a little more padding than one plan of the whole cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from streampack.samples.layout import Bins
from streampack.samples.packing import (
    ASSIGNERS,
    CHUNK_DOCS,
    NoTarget,
    Pieces,
    TooLong,
    bin_chunks,
    document_spans,
)

if TYPE_CHECKING:
    from streampack.reader import Cache

__all__ = ["EraPlan", "era_plan", "joined"]


@dataclass(frozen=True)
class EraPlan:
    """The samples of one era: each sample's first piece (then the number of pieces), each piece's shard,
    first token and length, and what the planner left out (``dropped`` documents, ``no_target`` pieces)."""

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
    cache: Cache, first: int, stop: int, *, kind: str, seq_len: int, too_long: TooLong, no_target: NoTarget
) -> EraPlan:
    """The plan of documents ``[first, stop)`` of ``cache``, all committed, on their own, as
    ``cache.packed`` (``kind="packed"``) or ``cache.documents`` (``"documents"``) plans them with these
    settings."""
    pieces = Pieces(cache, None, seq_len, too_long, no_target == "drop")  # type: ignore[arg-type]
    doc_starts = np.asarray(cache.doc_starts, dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    parts = [(empty, empty, empty)]
    for shard in _shards_of(doc_starts, first, stop):
        starts, lengths = document_spans(cache, shard)
        base = int(doc_starts[shard])
        mine = slice(max(first, base) - base, min(stop, int(doc_starts[shard + 1])) - base)
        keep = lengths[mine] > 0
        parts.append(pieces.of_documents(shard, starts[mine][keep], lengths[mine][keep]))
    shards, lo, lengths = (np.concatenate(column) for column in zip(*parts, strict=True))
    chunks = (slice(begin, begin + CHUNK_DOCS) for begin in range(0, len(lengths), CHUNK_DOCS))
    tables = list(bin_chunks(((shards[c], lo[c], lengths[c]) for c in chunks), ASSIGNERS[kind], seq_len))
    binned = {
        key: np.concatenate([empty, *(t[key] for t in tables[:-1])]) for key in ("shards", "lo", "lengths")
    }
    return EraPlan(
        np.concatenate([t["starts"] for t in tables]).astype(np.int64),
        binned["shards"],
        binned["lo"],
        binned["lengths"],
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
    """The plans of consecutive eras laid end to end, as one :class:`~streampack.samples.layout.Bins`."""
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

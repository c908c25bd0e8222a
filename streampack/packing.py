"""Plans of whole-document samples: best-fit packing, or one document per sample.

A plan is a :class:`~streampack.layout.Bins` table: for each sample, the pieces of documents it holds, in
order, then padding. It is computed from the shards' offset tables alone (no token is read), a chunk of
documents at a time, so planning needs memory for one chunk whatever the size of the cache; the table is
written beside the cache (``CACHE/layouts/KEY/``) and memory-mapped, so that every rank and worker shares
one copy in the page cache and a second run starts at once; it is checked before use and planned again if
damaged (:mod:`streampack.planstore`). Where the cache is read-only the plan is kept in memory instead.

* :func:`plan_packed`: best-fit decreasing, within chunks of :data:`CHUNK_DOCS` documents: pieces in
  decreasing length, each into the open bin with the least room that fits it, else a new bin.
* :func:`plan_documents`: one document per sample (SFT), padded to ``seq_len``.

A document longer than ``seq_len`` follows the ``too_long`` policy: ``"split"`` into pieces of ``seq_len``
tokens and a remainder (each its own piece), ``"truncate"`` to its first ``seq_len`` tokens, or ``"drop"``.
Planning is deterministic: the same cache, documents and settings always give the same table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from streampack.errors import OptionsError
from streampack.format import LAYOUT_DIR
from streampack.layout import Bins
from streampack.planstore import PlanIdentity, stored

if TYPE_CHECKING:
    from streampack.holdout import Chosen
    from streampack.reader import Cache

__all__ = ["CHUNK_DOCS", "TooLong", "plan_documents", "plan_packed"]

TooLong = Literal["split", "truncate", "drop"]

# Documents packed together: larger chunks pack a little tighter, and take more memory to plan.
CHUNK_DOCS = 1 << 16


def plan_packed(
    cache: Cache, chosen: Chosen, seq_len: int, *, too_long: TooLong, pad_id: int, content: str
) -> Bins:
    """Best-fit decreasing packing of the chosen documents into samples of ``seq_len`` tokens."""
    settings: dict[str, int | str] = {"layout": "packed", "strategy": "bfd", "too_long": too_long}
    return _plan(cache, chosen, seq_len, settings, pad_id, content, _best_fit_decreasing)


def plan_documents(
    cache: Cache, chosen: Chosen, seq_len: int, *, too_long: TooLong, pad_id: int, content: str
) -> Bins:
    """One document per sample (each piece of a split one), padded to ``seq_len`` tokens."""
    settings: dict[str, int | str] = {"layout": "documents", "too_long": too_long}
    return _plan(
        cache, chosen, seq_len, settings, pad_id, content, lambda lengths, _: np.arange(len(lengths))
    )


def _plan(
    cache: Cache,
    chosen: Chosen,
    seq_len: int,
    settings: dict[str, int | str],
    pad_id: int,
    content: str,
    assign: Callable[[np.ndarray, int], np.ndarray],
) -> Bins:
    too_long = too_long_policy(settings["too_long"])
    if too_long is None:
        raise OptionsError(f"too_long must be 'split', 'truncate' or 'drop' (got {settings['too_long']!r})")
    settings = {**settings, **chosen.fingerprint()}
    identity = PlanIdentity(content, seq_len, settings)
    pieces = _Pieces(cache, chosen, seq_len, too_long)

    def tables() -> Iterator[dict[str, np.ndarray]]:
        before = 0  # pieces in the chunks before this one
        for shards, lo, lengths in pieces:
            bin_of = assign(lengths, seq_len)
            placed = np.empty(len(lengths), dtype=np.int64)  # the order pieces went into their bins
            placed[np.argsort(-lengths, kind="stable")] = np.arange(len(lengths))
            order = np.lexsort((placed, bin_of))
            counts = np.bincount(bin_of)
            yield {
                "starts": before + np.cumsum(counts) - counts,
                "shards": shards[order],
                "lo": lo[order],
                "lengths": lengths[order],
            }
            before += len(lengths)
        yield {"starts": np.array([before], dtype=np.int64)}

    directory = Path(cache.root) / LAYOUT_DIR / identity.key
    plan = stored(directory, identity, tables, lambda: pieces.dropped, cache.table.num_tokens)
    return Bins(
        plan.arrays["starts"],
        plan.arrays["shards"],
        plan.arrays["lo"],
        plan.arrays["lengths"],
        seq_len=seq_len,
        pad_id=pad_id,
        settings=settings,
        directory=plan.directory,
        dropped=plan.dropped,
        checked=(plan.checksum, plan.identities),
    )


def too_long_policy(value: object) -> TooLong | None:
    """``value`` as a ``too_long`` policy, or None when it is not one."""
    return value if value in ("split", "truncate", "drop") else None


class _Pieces:
    """The pieces of the chosen documents, about :data:`CHUNK_DOCS` documents at a time, in stream order.

    Iterating yields ``(shards, lo, lengths)`` per chunk; documents longer than ``seq_len`` are cut,
    truncated or left out by ``too_long``, and ``dropped`` counts those left out.
    """

    def __init__(self, cache: Cache, chosen: Chosen, seq_len: int, too_long: TooLong) -> None:
        self.cache, self.chosen, self.seq_len, self.too_long = cache, chosen, seq_len, too_long
        self.dropped = 0

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        held = 0
        for shard in range(self.cache.num_shards):
            ends = np.asarray(self.cache.shard_offsets(shard), dtype=np.int64)
            starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
            keep = self.chosen.in_shard(shard) & (ends > starts)
            starts, lengths = starts[keep], (ends - starts)[keep]
            for begin in range(0, len(starts), CHUNK_DOCS):
                lo, length = self._cut(
                    starts[begin : begin + CHUNK_DOCS], lengths[begin : begin + CHUNK_DOCS]
                )
                parts.append((np.full(len(lo), shard, dtype=np.int64), lo, length))
                held += len(lo)
                if held >= CHUNK_DOCS:
                    yield _joined(parts)
                    parts, held = [], 0
        if parts:
            yield _joined(parts)

    def _cut(self, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Documents ``[starts, starts + lengths)`` as pieces of at most ``seq_len`` tokens."""
        seq_len = self.seq_len
        if self.too_long == "truncate":
            return starts, np.minimum(lengths, seq_len)
        if self.too_long == "drop":
            keep = lengths <= seq_len
            self.dropped += int(len(lengths) - keep.sum())
            return starts[keep], lengths[keep]
        counts = -(-lengths // seq_len)
        k = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        lo = np.repeat(starts, counts) + k * seq_len  # k: the piece's number inside its document
        return lo, np.minimum(np.repeat(starts + lengths, counts) - lo, seq_len)


def _joined(
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (
        np.concatenate([p[0] for p in parts]),
        np.concatenate([p[1] for p in parts]),
        np.concatenate([p[2] for p in parts]),
    )


def _best_fit_decreasing(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """The bin of each item, packed best-fit decreasing into bins of ``capacity``; bins in opening order.

    Open bins are kept by their room left (one stack per room value), so the best fit for an item of
    size ``s`` is the first non-empty stack at or above ``s``: one short numpy scan, not a search of bins.
    """
    by_room: list[list[int]] = [[] for _ in range(capacity + 1)]
    nonempty = np.zeros(capacity + 1, dtype=bool)
    bin_of = np.empty(len(lengths), dtype=np.int64)
    sizes = lengths.tolist()
    opened = 0
    for item in np.argsort(-lengths, kind="stable").tolist():
        size = sizes[item]
        room = size + int(np.argmax(nonempty[size:]))
        if nonempty[room]:
            chosen = by_room[room].pop()
            nonempty[room] = bool(by_room[room])
        else:
            chosen, room, opened = opened, capacity, opened + 1
        left = room - size
        if left:
            by_room[left].append(chosen)
            nonempty[left] = True
        bin_of[item] = chosen
    return bin_of

"""Which documents of a cache samples are made of: all of them, or one side of a held-out split
(:func:`streampack.samples.split.split`), by a hash of each document's index (:func:`doc_hashes`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import numpy as np

from streampack.order import splitmix
from streampack.samples.layout import Runs

if TYPE_CHECKING:
    from streampack.reader import Cache

__all__ = ["Chosen", "Side", "doc_hashes"]

Side = Literal["train", "validation"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class Chosen:
    """The documents a layout uses: all of them (``side=None``), or one side of a held-out split.

    Args:
        threshold: documents whose hash is below it are held out (at most ``2**64``).
        side: ``"train"`` (the rest) or ``"validation"`` (the held-out ones); None for every document.
        seed: the split's seed.
        holdout: how the split was asked for (``"fraction:0.01"``), for the fingerprint.
    """

    def __init__(
        self, cache: Cache, *, threshold: int = 0, side: Side | None = None, seed: int = 0, holdout: str = ""
    ) -> None:
        self.doc_starts = np.asarray(cache.doc_starts, dtype=np.int64)
        self.threshold, self.side, self.seed, self.holdout = threshold, side, seed, holdout

    def fingerprint(self) -> dict[str, int | str]:
        """The split's settings (nothing for every document)."""
        if self.side is None:
            return {}
        return {"split": self.side, "holdout": self.holdout, "split_seed": self.seed}

    def in_shard(self, shard: int) -> np.ndarray:
        """Whether each document of shard ``shard`` is chosen (``bool``, one per document)."""
        first, stop = int(self.doc_starts[shard]), int(self.doc_starts[shard + 1])
        if self.side is None:
            return np.ones(stop - first, dtype=bool)
        hashes = doc_hashes(np.arange(first, stop, dtype=np.uint64), self.seed)
        held = (
            hashes <= np.uint64(self.threshold - 1) if self.threshold else np.zeros(len(hashes), dtype=bool)
        )
        return held if self.side == "validation" else ~held

    def runs(self, cache: Cache) -> Runs:
        """The chosen documents as a token stream: one run per stretch of consecutive chosen documents."""
        if self.side is None:
            return Runs.whole(np.asarray(cache.token_starts, dtype=np.int64))
        shards, offsets, lengths = [], [], []
        for shard in range(cache.num_shards):
            ends = np.asarray(cache.shard_offsets(shard), dtype=np.int64)
            edges = np.flatnonzero(np.diff(np.concatenate([[0], self.in_shard(shard).astype(np.int8), [0]])))
            first, stop = edges[0::2], edges[1::2]  # stretches [first, stop) of chosen documents
            lo = np.where(first > 0, ends[np.maximum(first - 1, 0)], 0)
            hi = ends[stop - 1] if len(stop) else np.zeros(0, dtype=np.int64)
            keep = hi > lo
            shards.append(np.full(int(keep.sum()), shard, dtype=np.int64))
            offsets.append(lo[keep])
            lengths.append((hi - lo)[keep])
        if not shards:
            empty = np.zeros(0, dtype=np.int64)
            return Runs(np.zeros(1, dtype=np.int64), empty, empty)
        length = np.concatenate(lengths)
        starts = np.concatenate([[0], np.cumsum(length)]).astype(np.int64)
        return Runs(starts, np.concatenate(shards), np.concatenate(offsets).astype(np.int64))


def doc_hashes(indices: np.ndarray, seed: int) -> np.ndarray:
    """A 64-bit hash of each document index and the seed, ``uint64``."""
    with np.errstate(over="ignore"):
        return splitmix(indices.astype(np.uint64) + np.uint64(seed % 2**64) * _GOLDEN)

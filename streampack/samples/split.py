"""Which documents samples are made of: all of a cache, or one side of a deterministic held-out split.

``train, validation = cache.split(0.01)`` holds out about 1 % of the documents. Document ``i`` is held out
when a 64-bit hash of ``(i, seed)`` falls below a threshold: by a fraction, the threshold is
``fraction * 2**64``, so a document's side depends on its index alone and stays the same when the cache
grows; by a count, it is the ``count``-th smallest hash of the cache, so exactly ``count`` documents are held
out (and a grown cache may move a few). Each side is a :class:`DocumentSet` that makes samples like the cache
does: ``train.sequences(2048)``, ``validation.packed(2048)``, ``validation.documents(2048)``.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Literal

import numpy as np

from streampack._checks import check_int
from streampack.errors import OptionsError
from streampack.samples.layout import Runs

if TYPE_CHECKING:
    from streampack.reader import Cache
    from streampack.samples.packing import NoTarget, TooLong
    from streampack.samples.sequences import PackedSequences

__all__ = ["Chosen", "DocumentSet", "split"]

Side = Literal["train", "validation"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class Chosen:
    """The documents a layout uses: all of them (``side=None``), or one side of a held-out split.

    Args:
        threshold: documents whose hash is below it are held out (at most ``2**64``).
        side: ``"train"`` (the rest) or ``"validation"`` (the held-out ones); None for every document.
        seed: the split's seed.
        holdout: how the split was asked for (``"fraction:0.01"``, ``"count:1000"``), for the fingerprint.
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
    """A 64-bit hash of each document index and the seed (splitmix64's finaliser), ``uint64``."""
    with np.errstate(over="ignore"):
        x = indices.astype(np.uint64) + (np.uint64(seed % 2**64) + np.uint64(1)) * _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class DocumentSet:
    """Some documents of a cache, which make samples as the cache does: one side of ``cache.split``.

    Args:
        cache: the cache.
        chosen: which of its documents.
    """

    def __init__(self, cache: Cache, chosen: Chosen) -> None:
        self.cache, self.chosen = cache, chosen

    def __repr__(self) -> str:
        return f"DocumentSet({self.cache.root}, {self.chosen.fingerprint() or 'every document'})"

    @property
    def num_docs(self) -> int:
        """Documents in the set (counted over every shard's offset table)."""
        return sum(int(self.chosen.in_shard(shard).sum()) for shard in range(self.cache.num_shards))

    def sequences(self, seq_len: int, *, overlap: int = 0) -> PackedSequences:
        """Fixed windows of these documents laid end to end; see :meth:`streampack.reader.Cache.sequences`."""
        from streampack.samples.sequences import PackedSequences

        return PackedSequences(self.cache, seq_len, overlap=overlap, chosen=self.chosen)

    def packed(
        self,
        seq_len: int,
        *,
        too_long: TooLong = "split",
        no_target: NoTarget = "keep",
        pad_id: int | None = None,
    ) -> PackedSequences:
        """Whole documents best-fit packed into samples; see :meth:`streampack.reader.Cache.packed`."""
        from streampack.samples.sequences import whole_documents

        return whole_documents(self.cache, self.chosen, "packed", seq_len, too_long, pad_id, no_target)

    def documents(
        self,
        seq_len: int,
        *,
        too_long: TooLong = "truncate",
        no_target: NoTarget = "keep",
        pad_id: int | None = None,
    ) -> PackedSequences:
        """One document per sample, padded; see :meth:`streampack.reader.Cache.documents`."""
        from streampack.samples.sequences import whole_documents

        return whole_documents(self.cache, self.chosen, "documents", seq_len, too_long, pad_id, no_target)


def split(cache: Cache, holdout: float, *, seed: int = 0) -> tuple[DocumentSet, DocumentSet]:
    """The training and validation sides of ``cache``, holding out ``holdout`` of its documents.

    Args:
        cache: the cache.
        holdout: a fraction in ``(0, 1)`` (stable as the cache grows), or a count of documents (an ``int``,
            at least 1 and at most the cache's documents; exact).
        seed: picks which documents; the same seed always holds out the same ones.

    Raises:
        OptionsError: ``holdout`` is neither a fraction in (0, 1) nor a count in range, or ``seed`` is not
            an integer.
    """
    check_int("seed", seed)
    if isinstance(holdout, numbers.Integral) and not isinstance(holdout, bool):
        hint = f"a number of the cache's {cache.num_docs} documents, or a fraction such as 0.01"
        count = check_int("holdout", holdout, min=1, max=cache.num_docs, hint=hint)
        hashes = doc_hashes(np.arange(cache.num_docs, dtype=np.uint64), int(seed))
        threshold = int(np.partition(hashes, count - 1)[count - 1]) + 1
        described = f"count:{count}"
    elif isinstance(holdout, numbers.Real) and not isinstance(holdout, bool) and 0 < float(holdout) < 1:
        threshold = int(float(holdout) * 2**64)
        described = f"fraction:{float(holdout)!r}"
    else:
        raise OptionsError(
            f"holdout must be a fraction in (0, 1) such as 0.01, or a number of documents such as 1000 "
            f"(got {holdout!r})"
        )
    train, validation = (
        Chosen(cache, threshold=threshold, side=side, seed=int(seed), holdout=described)
        for side in ("train", "validation")
    )
    return DocumentSet(cache, train), DocumentSet(cache, validation)

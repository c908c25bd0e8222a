"""Which documents samples are made of: all of a cache, or one side of a deterministic held-out split.

``train, validation = cache.split(0.01)`` holds out about 1 % of the documents, each side a
:class:`DocumentSet` (``train.sequences(2048)``). Document ``i`` is held out when a 64-bit hash of
``(i, seed)`` falls below ``fraction * 2**64`` (so its side never changes as the cache grows), or below
the ``count``-th smallest hash (so exactly ``count`` documents are held out).
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING

import numpy as np

from streampack._checks import check_int
from streampack.errors import OptionsError
from streampack.samples.chosen import Chosen, doc_hashes
from streampack.samples.packing import NoTarget, TooLong, plan
from streampack.samples.sequences import PackedSequences

if TYPE_CHECKING:
    from streampack.reader import Cache

__all__ = ["Chosen", "DocumentSet", "all_documents", "split"]


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
        """Documents in the set."""
        return sum(int(self.chosen.in_shard(shard).sum()) for shard in range(self.cache.num_shards))

    def sequences(self, seq_len: int, *, overlap: int = 0) -> PackedSequences:
        """Fixed windows of these documents laid end to end (the ``group_texts`` convention): sample ``i``
        is tokens ``[i*seq_len, i*seq_len + seq_len + overlap)``; only the final partial window is dropped.

        Args:
            seq_len: tokens per sample, at least 1.
            overlap: extra tokens at the end of each window, shared with the start of the next one; ``1``
                gives inputs ``window[:-1]`` and next-token targets ``window[1:]``.

        Raises:
            OptionsError: ``seq_len`` or ``overlap`` is not an integer in its allowed range.
        """
        return PackedSequences(self.cache, seq_len, overlap=overlap, chosen=self.chosen)

    def packed(
        self,
        seq_len: int,
        *,
        too_long: TooLong = "split",
        no_target: NoTarget = "keep",
        pad_id: int | None = None,
        pad_multiple: int = 1,
    ) -> PackedSequences:
        """Whole documents packed into samples of ``seq_len`` tokens by best-fit decreasing, then padding.

        The plan is stored in ``CACHE/layouts/`` (:mod:`streampack.samples.packing`); ``samples.layout``
        counts its ``padding`` (a fraction), ``dropped`` documents and ``no_target`` pieces.

        Args:
            seq_len: tokens per sample.
            too_long: a document longer than ``seq_len`` is cut into pieces of ``seq_len`` tokens, each
                packed on its own (``"split"``), cut to its first ``seq_len`` tokens (``"truncate"``), or
                left out (``"drop"``).
            no_target: ``"keep"`` or ``"drop"`` a piece with no target token, whose every
                ``output="dict"`` label would be ``-100`` (in an SFT cache, a prompt cut before its response).
            pad_id: the id that fills padding (masked out of the loss in ``output="dict"``); the cache's
                EOS id by default, else 0.
            pad_multiple: each piece takes its length rounded up to a multiple of this (a divisor of
                ``seq_len``), the rest padding with labels ``-100`` and position ids counting on: ``2 *
                cp_size`` for the loader's ``cp_size`` (context parallelism).

        Raises:
            OptionsError: ``seq_len`` is not a positive integer, ``too_long`` or ``no_target`` is not a
                policy, ``pad_id`` does not fit the cache's token dtype, or ``pad_multiple`` does not
                divide ``seq_len``.
        """
        bins = plan(self.cache, self.chosen, "packed", seq_len, too_long, pad_id, no_target, pad_multiple)
        return PackedSequences.of(self.cache, bins)

    def documents(
        self,
        seq_len: int,
        *,
        too_long: TooLong = "truncate",
        no_target: NoTarget = "keep",
        pad_id: int | None = None,
        pad_multiple: int = 1,
    ) -> PackedSequences:
        """One document per sample, padded to ``seq_len`` tokens: for fine-tuning (SFT) on a masked cache.

        Args:
            seq_len: tokens per sample.
            too_long: a document longer than ``seq_len`` is cut to its first ``seq_len`` tokens
                (``"truncate"``), left out (``"drop"``), or served as several samples (``"split"``).
            no_target: ``"keep"`` or ``"drop"`` the samples with no target token: a batch of only those
                would have a NaN mean loss. ``samples.layout.no_target`` counts them.
            pad_id: as for :meth:`packed`.
            pad_multiple: as for :meth:`packed`.

        Raises:
            OptionsError: as for :meth:`packed`.
        """
        bins = plan(self.cache, self.chosen, "documents", seq_len, too_long, pad_id, no_target, pad_multiple)
        return PackedSequences.of(self.cache, bins)


def all_documents(cache: Cache) -> DocumentSet:
    """Every document of ``cache``: what ``cache.sequences``, ``.packed`` and ``.documents`` are made of."""
    return DocumentSet(cache, Chosen(cache))


def split(cache: Cache, holdout: float, *, seed: int = 0) -> tuple[DocumentSet, DocumentSet]:
    """The training and validation sides of ``cache`` (``cache.split``): they never share a document.

    Args:
        cache: the cache.
        holdout: a fraction in ``(0, 1)``, stable as the cache grows, or an exact count of documents.
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

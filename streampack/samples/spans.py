"""The spans of a token stream that make a batch of samples, and the arithmetic over them.

A layout (:mod:`streampack.samples.layout`) says which spans make each sample; reading them
(:mod:`streampack.samples.copies`) and finding the documents inside them
(:mod:`streampack.samples.boundaries`) are written once over :class:`Spans`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Spans", "ragged_arange"]


@dataclass(frozen=True)
class Spans:
    """The spans of a token stream that make a batch of samples: one entry per span.

    All arrays are integer arrays of equal length. Span ``k`` is tokens ``[lo[k], hi[k])`` of shard
    ``shards[k]``, written to row ``rows[k]`` of the batch from column ``col[k]`` on. A sample may have
    several spans (a window crossing a shard boundary); a column of a row that no span covers is left as
    it is (a layout with padding would fill it).

    Attributes:
        rows: row of the batch (the sample's place among the requested indices).
        shards: shard holding the span.
        lo: first token of the span, local to its shard.
        hi: one past its last token, local to its shard.
        col: column of the row where the span starts.
    """

    rows: np.ndarray
    shards: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    col: np.ndarray

    def head(self, columns: int) -> Spans:
        """The spans cut to the first ``columns`` columns of each row (spans past them dropped)."""
        keep = self.col < columns
        col, lo = self.col[keep], self.lo[keep]
        hi = np.minimum(self.hi[keep], lo + (columns - col))
        return Spans(self.rows[keep], self.shards[keep], lo, hi, col)


def ragged_arange(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(s, s + c)`` per pair, vectorised: ``[5, 6, 7, 2]`` from ``[5, 2], [3, 1]``."""
    offsets = np.cumsum(counts) - counts
    return np.repeat(starts - offsets, counts) + np.arange(int(counts.sum()), dtype=np.int64)

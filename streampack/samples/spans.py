"""The spans of a token stream that make a batch of samples, which every layout produces."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Spans", "ragged_arange"]


@dataclass(frozen=True)
class Spans:
    """The spans of a token stream that make a batch of samples: one entry per span.

    Integer arrays of equal length: span ``k`` is tokens ``[lo[k], hi[k])`` of shard ``shards[k]``
    (local to the shard), written to row ``rows[k]`` of the batch from column ``col[k]`` on. A sample may
    have several spans; a column no span covers is left as it is.
    """

    rows: np.ndarray
    shards: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    col: np.ndarray

    def taken(self, index: np.ndarray) -> Spans:
        """The spans at ``index`` (an integer or boolean array), in its order."""
        return Spans(self.rows[index], self.shards[index], self.lo[index], self.hi[index], self.col[index])

    @classmethod
    def joined(cls, parts: list[Spans]) -> Spans:
        """The spans of ``parts`` laid end to end."""
        return cls(*(np.concatenate([getattr(s, name) for s in parts]) for name in cls.__dataclass_fields__))

    def head(self, columns: int) -> Spans:
        """The spans cut to the first ``columns`` columns of each row."""
        keep = self.col < columns
        col, lo = self.col[keep], self.lo[keep]
        hi = np.minimum(self.hi[keep], lo + (columns - col))
        return Spans(self.rows[keep], self.shards[keep], lo, hi, col)


def ragged_arange(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(s, s + c)`` per pair, vectorised: ``[5, 6, 7, 2]`` from ``[5, 2], [3, 1]``."""
    offsets = np.cumsum(counts) - counts
    return np.repeat(starts - offsets, counts) + np.arange(int(counts.sum()), dtype=np.int64)

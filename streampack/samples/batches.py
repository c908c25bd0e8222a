"""Checks of what a read of samples is asked: the sample indices, the rows they go to, the output array."""

from __future__ import annotations

import functools
import numbers

import numpy as np
import numpy.typing as npt

__all__ = ["Index", "check_out", "holds_every_id", "sample_indices", "target_rows"]

Index = int | np.integer | slice | npt.ArrayLike


def sample_indices(index: Index, n: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """Normalize ``index`` to a flat int64 array of in-range sample numbers (of ``n``), and its shape."""
    if isinstance(index, slice):
        return np.arange(*index.indices(n), dtype=np.int64), (len(range(*index.indices(n))),)
    if isinstance(index, numbers.Integral) and not isinstance(index, bool):
        value = int(index)
        if not -n <= value < n:
            raise IndexError(f"sample {value} out of range for {n} samples (allowed: -{n} <= i < {n})")
        return np.array([value % n], dtype=np.int64), ()
    array = np.asarray(index)
    if array.dtype == np.bool_ or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
        raise TypeError(
            f"sample index must be an int, a slice or an integer array (got {type(index).__name__} "
            f"of dtype {array.dtype})"
        )
    low = high = 0
    if array.size:
        # Checked in the array's own dtype, before the cast: uint64 values >= 2**63 would wrap to
        # negative int64s, which count from the end.
        low, high = int(array.min()), int(array.max())
        if low < -n or high >= n:
            bad = low if low < -n else high
            raise IndexError(f"sample {bad} out of range for {n} samples (allowed: -{n} <= i < {n})")
    flat = array.astype(np.int64).reshape(-1)
    if low < 0:
        flat = np.where(flat < 0, flat + n, flat)
    return flat, array.shape


def target_rows(rows: npt.ArrayLike, count: int, out: np.ndarray | None) -> np.ndarray:
    """``rows`` checked: one integer row of ``out`` per index (``count`` of them), each in range."""
    targets = np.asarray(rows)
    if out is None or targets.shape != (count,) or not np.issubdtype(targets.dtype, np.integer):
        raise ValueError(
            f"rows= needs an out= array and one integer row per index (got {count} indices and rows of "
            f"shape {targets.shape}, dtype {targets.dtype})"
        )
    if count and not 0 <= int(targets.min()) <= int(targets.max()) < len(out):
        raise IndexError(f"rows must be in [0, {len(out)}), the rows of out")
    return targets.astype(np.int64, copy=False)


def check_out(out: object, dtype: np.dtype, width: int, rows: int | None) -> None:
    """Refuse an ``out`` that is not a 2-D array of ``rows`` rows (any, when None) and ``width`` columns, of
    a dtype that holds every id of the token ``dtype``."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy array (got {type(out).__name__})")
    if not holds_every_id(dtype, out.dtype):
        raise ValueError(
            f"out has dtype {out.dtype}, which cannot hold every id of the cache's {dtype} tokens "
            f"(they would be silently changed); use {dtype} or a wider integer type such as int64"
        )
    if out.ndim != 2 or out.shape[1] != width or (rows is not None and out.shape[0] != rows):
        need = f"{(rows, width)}" if rows is not None else f"(rows, {width})"
        raise ValueError(f"out has shape {out.shape}, but windows of {width} tokens need {need}")


@functools.lru_cache(maxsize=64)
def holds_every_id(tokens: np.dtype, out: np.dtype) -> bool:
    """Whether ``out`` is an integer dtype that holds every value of ``tokens``."""
    return out.kind in "iu" and bool(np.can_cast(tokens, out, "safe"))

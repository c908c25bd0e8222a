"""Scans of a token file for an id (an EOS, llm.c's delimiter), in bounded memory: where a format keeps no
index of its documents (nanoGPT, OLMo, llm.c), they are found at the id.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterator

import numpy as np

__all__ = ["SCAN_TOKENS", "count_id", "docs_ending_at", "ends_at", "forget_pages", "id_positions", "scanned"]

#: Tokens a scan for an id compares at a time (its temporary array holds one byte a token).
SCAN_TOKENS = 1 << 22


def scanned(tokens: np.ndarray, step: int = SCAN_TOKENS) -> Iterator[tuple[int, np.ndarray]]:
    """``(start, chunk)`` of ``tokens`` (a memory map), ``step`` at a time; each chunk's pages are let go
    of once the caller is done with it, so that a scan of a large file leaves this process's memory as it
    was (a mapped page read counts towards it until unmapped)."""
    for start in range(0, len(tokens), step):
        chunk = tokens[start : start + step]
        yield start, chunk
        forget_pages(chunk)


def forget_pages(chunk: np.ndarray) -> None:
    """Drop the pages of a memory-mapped ``chunk`` from this process (``MADV_DONTNEED`` on its clean,
    read-only pages: a later read maps them again from the page cache); nothing for an array in memory."""
    mapped = chunk.base
    while mapped is not None and not isinstance(mapped, mmap.mmap):
        mapped = getattr(mapped, "base", None)
    if mapped is None or not hasattr(mapped, "madvise") or not chunk.nbytes:
        return
    origin = np.frombuffer(mapped, dtype=np.uint8).ctypes.data
    first = (chunk.ctypes.data - origin) // mmap.PAGESIZE * mmap.PAGESIZE
    stop = min(chunk.ctypes.data - origin + chunk.nbytes, len(mapped))
    with contextlib.suppress(OSError, ValueError):
        mapped.madvise(mmap.MADV_DONTNEED, first, stop - first)


def count_id(tokens: np.ndarray, token_id: int) -> int:
    """How many times ``token_id`` occurs in ``tokens`` (a memory map), read :data:`SCAN_TOKENS` at a time."""
    return sum(int(np.count_nonzero(chunk == token_id)) for _, chunk in scanned(tokens))


def id_positions(tokens: np.ndarray, token_id: int) -> np.ndarray:
    """Where ``token_id`` occurs in ``tokens`` (int64, ascending), read :data:`SCAN_TOKENS` at a time."""
    parts = [np.flatnonzero(chunk == token_id) + start for start, chunk in scanned(tokens)]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def docs_ending_at(tokens: np.ndarray, eos_id: int) -> int:
    """The documents of a stream in which each ends with ``eos_id``: a tail after the last EOS is one more."""
    return count_id(tokens, eos_id) + int(len(tokens) > 0 and int(tokens[-1]) != eos_id)


def ends_at(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """The end of each document of :func:`docs_ending_at` (uint64): after each EOS, and the stream's end."""
    ends = id_positions(tokens, eos_id) + 1
    if len(tokens) and (not len(ends) or int(ends[-1]) != len(tokens)):
        ends = np.append(ends, len(tokens))
    return ends.astype(np.uint64)

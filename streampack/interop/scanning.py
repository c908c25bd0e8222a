"""Scanning a token stream without an index (nanoGPT's ``train.bin``, OLMo's memmaps, llm.c's shards) for
the id that ends or starts each document, in bounded memory: a file read into one buffer
(:class:`TokenSpan`) or a memory map let go of chunk by chunk (:func:`scanned`); the ends an open found,
kept for the shards' first reads (:class:`KeptEnds`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from streampack.errors import CacheError

#: Tokens a scan for an id compares at a time (its temporary array holds one byte a token; a read of a
#: file's 1 Mi tokens stays in the CPU's cache: 4 Mi at a time scanned 25% slower here).
SCAN_TOKENS = 1 << 20

#: Bytes of document ends (8 a document) that an open which scans for them (nanoGPT, OLMo, llm.c: files
#: without an index) keeps for the shards' first reads, so that reading them (a ``convert``, an export)
#: scans the files once, not twice; a shard past it is scanned again when first read.
KEPT_ENDS_BYTES = 1 << 26


@dataclass(frozen=True)
class TokenSpan:
    """``count`` tokens of ``dtype`` at byte ``offset`` of the file ``path``, as a scan reads them: by plain
    reads into one buffer, which leave no mapped pages to fault in and let go of (a third faster than a
    scan of a memory map here)."""

    path: Path
    dtype: np.dtype
    offset: int
    count: int

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> int:
        """Token ``index`` (one read)."""
        _, chunk = next(self.chunks(1, first=range(self.count)[index]))
        return int(chunk[0])

    def chunks(self, step: int = SCAN_TOKENS, first: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        """``(start, chunk)`` from token ``first`` on, ``step`` at a time; each chunk is the buffer the next
        read overwrites.

        Raises:
            CacheError: the file ends early (it was cut short since it was opened).
        """
        itemsize = self.dtype.itemsize
        buffer = np.empty(min(step, max(self.count - first, 0)), dtype=self.dtype)
        raw = buffer.view(np.uint8).data
        with open(self.path, "rb", buffering=0) as f:
            for start in range(first, self.count, step):
                n = min(step, self.count - start)
                view, got, at = raw[: n * itemsize], 0, self.offset + start * itemsize
                while got < len(view):
                    read = os.preadv(f.fileno(), [view[got:]], at + got)
                    if not read:
                        raise CacheError(
                            f"{self.path}: ended at byte {at + got:,}, before the {self.count:,} tokens it "
                            "held when it was opened: the file was cut short; open it again"
                        )
                    got += read
                yield start, buffer[:n]


def scanned(tokens: np.ndarray | TokenSpan, step: int = SCAN_TOKENS) -> Iterator[tuple[int, np.ndarray]]:
    """``(start, chunk)`` of ``tokens`` (a file's :class:`TokenSpan`, or a memory map), ``step`` at a time;
    a map's chunk's pages are let go of once the caller is done with it, so that a scan of a large file
    leaves this process's memory as it was (a mapped page read counts towards it until unmapped)."""
    if isinstance(tokens, TokenSpan):
        yield from tokens.chunks(step)
        return
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


def id_positions(tokens: np.ndarray | TokenSpan, token_id: int) -> np.ndarray:
    """Where ``token_id`` occurs in ``tokens`` (int64, ascending), read :data:`SCAN_TOKENS` at a time."""
    parts = [np.flatnonzero(chunk == token_id) + start for start, chunk in scanned(tokens)]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def ends_at(tokens: np.ndarray | TokenSpan, eos_id: int) -> np.ndarray:
    """The end of each document of a stream in which each ends with ``eos_id`` (uint64): after each EOS,
    and at the stream's end (a tail after the last EOS is one more document)."""
    ends = id_positions(tokens, eos_id) + 1
    if len(tokens) and (not len(ends) or int(ends[-1]) != len(tokens)):
        ends = np.append(ends, len(tokens))
    return ends.astype(np.uint64)


class KeptEnds:
    """The document ends the scans of one open found, kept up to :data:`KEPT_ENDS_BYTES` in all."""

    def __init__(self) -> None:
        self.left = KEPT_ENDS_BYTES

    def ends(self, found: np.ndarray, rescan: Callable[[], np.ndarray]) -> Callable[[], np.ndarray]:
        """A :attr:`ForeignShard.ends` that gives ``found`` (uint64, read-only) while the budget holds it,
        else ``rescan``."""
        if found.nbytes > self.left:
            return rescan
        self.left -= found.nbytes
        kept = found.astype(np.uint64)
        kept.flags.writeable = False
        return lambda: kept

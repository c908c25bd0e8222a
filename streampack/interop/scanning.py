"""Scanning a token stream without an index (nanoGPT's ``train.bin``, OLMo's memmaps, llm.c's shards) for
the id that ends or starts each document, in bounded memory: a file read into one buffer
(:class:`TokenSpan`) or a memory map let go of chunk by chunk (:func:`scanned`); the ends an open found,
kept for the shards' first reads (:class:`KeptEnds`).

Such a format's reader plans its shards first (:class:`ScanPlan`: each shard's span of a file, found
without reading the files through) and makes its :class:`~streampack.interop.reading.Foreign` from the
ends a scan of each span finds: :func:`open_plan` scans the spans on a few threads (the compare and the
reads release the GIL), and ``streampack convert`` scans them on one thread while the kernel copies them
(:func:`streampack.interop.native.write_scanned`), the CRC-32 of each span computed in the same read.
"""

from __future__ import annotations

import contextlib
import importlib
import mmap
import os
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from streampack.errors import CacheError
from streampack.format.names import MANIFEST, crc32
from streampack.interop.filechecks import check_doc_count
from streampack.interop.identity import ends_digest
from streampack.interop.reading import READERS, Foreign, ForeignOptions, recognise
from streampack.store import is_remote, open_store

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

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` (clipped to the span), in a new array."""
        start, stop = max(start, 0), min(stop, self.count)
        if stop <= start:
            return np.zeros(0, dtype=self.dtype)
        return next(self.chunks(stop - start, first=start))[1]

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


#: Threads an open scans its spans on (at most): each is one core's compares and reads.
SCAN_THREADS = min(4, os.cpu_count() or 1)


@dataclass(frozen=True)
class Boundary:
    """How a stream marks its documents: ``token_id`` after each one (an EOS), or before each one
    (``starts``: llm.c's delimiter); without ``token_id`` a span is one document."""

    token_id: int | None
    starts: bool = False

    def ends(self, tokens: np.ndarray | TokenSpan, *, checksum: bool = False) -> tuple[np.ndarray, int]:
        """The end of each document of ``tokens`` (uint64, from its start) and, with ``checksum``, the
        CRC-32 of their little-endian bytes (0 without), in one read of them. After an EOS a tail with
        none is one more document; with delimiters, what precedes the first one is a document too."""
        count, crc, parts = len(tokens), 0, []
        if self.token_id is not None or checksum:
            for start, chunk in scanned(tokens):
                if self.token_id is not None:
                    parts.append(np.flatnonzero(chunk == self.token_id) + start)
                if checksum:
                    crc = crc32(np.ascontiguousarray(chunk, dtype=chunk.dtype.newbyteorder("<")).data, crc)
        if self.token_id is None:
            return np.array([count] if count else [], dtype=np.uint64), crc
        found = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if self.starts:
            ends = np.append(found[found > 0], count) if count else found
        else:
            ends = found + 1
            if count and (not len(ends) or int(ends[-1]) != count):
                ends = np.append(ends, count)
        return ends.astype(np.uint64), crc


@dataclass(frozen=True)
class Found:
    """What the scan of one span found: its documents, their ends (kept, or found again), and the
    :func:`~streampack.interop.identity.ends_digest` of those it found (b"": none taken)."""

    num_docs: int
    ends: Callable[[], np.ndarray]
    digest: bytes = b""


@dataclass(frozen=True)
class ScanPlan:
    """A foreign cache whose documents are found by scanning its files: the span of each of its shards,
    how its documents are marked, and how its format makes it once each span's are found (``make``
    takes one :class:`Found` a span)."""

    spans: list[TokenSpan]
    boundary: Boundary
    make: Callable[[list[Found]], Foreign]


def open_plan(plan: ScanPlan, *, threads: int = SCAN_THREADS, crcs: list[int] | None = None) -> Foreign:
    """The foreign cache of ``plan``, its spans scanned on ``threads`` threads (a few spans ahead of the
    one kept next, so that memory stays bounded); each span's CRC-32 appended to ``crcs`` where given.
    Each shard's :attr:`~streampack.interop.reading.ForeignShard.ends_digest` is that of the ends its scan
    found, so that the cache's identity never scans a span again (its ends past :data:`KEPT_ENDS_BYTES`)."""
    kept, found = KeptEnds(), []
    scan = partial(plan.boundary.ends, checksum=crcs is not None)
    with ThreadPoolExecutor(max(1, min(threads, len(plan.spans))), "streampack-scan") as pool:
        ahead: deque[Future[tuple[np.ndarray, int]]] = deque()
        for index in range(len(plan.spans)):
            while len(ahead) < 2 * threads and index + len(ahead) < len(plan.spans):
                ahead.append(pool.submit(scan, plan.spans[index + len(ahead)]))
            ends, crc = ahead.popleft().result()
            span = plan.spans[index]
            rescan = partial(_rescan, span, plan.boundary, len(ends))
            found.append(Found(len(ends), kept.ends(ends, rescan), ends_digest(ends)))
            if crcs is not None:
                crcs.append(crc)
    return _with_digests(plan.make(found), found)


def _with_digests(foreign: Foreign, found: list[Found]) -> Foreign:
    """``foreign`` with the digest of each span's ends on its shard: a format makes one shard a span, in
    their order (where one did not, the digests are made from the shards' ends)."""
    shards = foreign.shards
    if len(shards) != len(found) or any(s.num_docs != f.num_docs for s, f in zip(shards, found)):
        return foreign
    return replace(foreign, shards=[replace(s, ends_digest=f.digest) for s, f in zip(shards, found)])


def _rescan(span: TokenSpan, boundary: Boundary, docs: int) -> np.ndarray:
    """The ends of ``span`` found again (past :data:`KEPT_ENDS_BYTES`): the same ``docs`` documents."""
    return check_doc_count(span.path, boundary.ends(span)[0], docs)


def scan_plan(source: str | os.PathLike[str], declared: Mapping[str, Any]) -> ScanPlan | None:
    """The :class:`ScanPlan` of a local foreign cache read by a scan (nanoGPT, OLMo, llm.c) at ``source``
    (``declared`` as :func:`streampack.open` takes it), or None for anything else (a native cache, one in
    object storage, a format with an index, no cache at all: opening it says what it is)."""
    options = ForeignOptions(**{k: v for k, v in declared.items() if v is not None})
    try:
        store = None if is_remote(source) else open_store(source)
        if store is None or (options.format is None and store.exists(MANIFEST)):
            return None
        where = store.root
        chosen = options.format or recognise(where)
    except CacheError:
        return None
    planner = getattr(importlib.import_module(READERS[chosen]), "plan", None)
    return None if planner is None else planner(where, options)

"""Finding the documents of a token stream without an index (nanoGPT, OLMo, llm.c) by scanning it for the
id that ends or starts each one, in bounded memory.

Such a format plans its shards (:class:`ScanPlan`: each one's span of a file), then builds its
:class:`~streampack.reader.foreign.opening.Foreign` from what a scan of each span finds: on a few threads
at an open (:func:`open_plan`; the compares and reads release the GIL), while copying at a convert.
"""

from __future__ import annotations

import importlib
import os
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, overload

import numpy as np

from streampack.errors import CacheError
from streampack.format.names import MANIFEST, crc32
from streampack.reader.foreign.files import map_tokens
from streampack.reader.foreign.identity import ends_digest
from streampack.reader.foreign.opening import READERS, Foreign, ForeignOptions, ForeignShard, recognise
from streampack.store import is_remote, open_store

#: Tokens a scan compares at a time. 1 Mi tokens stay in the CPU's cache; 4 Mi scanned 25% slower.
SCAN_TOKENS = 1 << 20

#: Bytes of document ends (8 a document) an open keeps for the shards' first reads, so that a convert or
#: an export right after it does not scan the files a second time.
KEPT_ENDS_BYTES = 1 << 26

#: Threads an open scans its spans on, at most.
SCAN_THREADS = min(4, os.cpu_count() or 1)


@dataclass(frozen=True)
class TokenSpan:
    """``count`` tokens of ``dtype`` at byte ``offset`` of the file ``path``.

    A scan reads it with plain reads into one buffer: no mapped pages to fault in and let go of (a third
    faster than scanning a memory map).
    """

    path: Path
    dtype: np.dtype
    offset: int
    count: int

    def __len__(self) -> int:
        return self.count

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> np.ndarray: ...
    def __getitem__(self, index: int | slice) -> int | np.ndarray:
        """Token ``index``, or the tokens of a slice (of step 1) in a new array."""
        if not isinstance(index, slice):
            at = range(self.count)[index]
            return int(self[at : at + 1][0])
        start, stop, _ = index.indices(self.count)
        if stop <= start:
            return np.zeros(0, dtype=self.dtype)
        return next(self.chunks(stop - start, first=start))[1]

    def chunks(self, step: int = SCAN_TOKENS, first: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        """``(start, chunk)`` from token ``first`` on, ``step`` tokens at a time, each chunk the buffer
        the next read overwrites.

        Raises:
            CacheError: the file was cut short since it was opened.
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
    """``(start, chunk)`` of a span (read from its file) or an array, ``step`` tokens at a time."""
    if isinstance(tokens, TokenSpan):
        yield from tokens.chunks(step)
        return
    for start in range(0, len(tokens), step):
        yield start, tokens[start : start + step]


@dataclass(frozen=True)
class Boundary:
    """How a stream marks its documents: ``token_id`` after each one (an EOS), or before each one
    (``starts``: llm.c's delimiter). Without ``token_id`` a span is one document."""

    token_id: int | None
    starts: bool = False

    def ends(self, tokens: np.ndarray | TokenSpan, *, checksum: bool = False) -> tuple[np.ndarray, int]:
        """The end of each document of ``tokens`` (uint64) and, with ``checksum``, the CRC-32 of their
        little-endian bytes (else 0), in one read.

        A tail after the last EOS is one more document; so is what precedes the first delimiter.
        """
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
    """What the scan of one span found: its document count, its ends (kept, or scanned again when asked
    for) and the :func:`~streampack.reader.foreign.identity.ends_digest` of them."""

    num_docs: int
    ends: Callable[[], np.ndarray]
    digest: bytes


@dataclass(frozen=True)
class ScanPlan:
    """A foreign cache whose documents are found by a scan: ``foreign`` but its shards, which are one a
    span of ``spans`` (its loss mask file from ``masks``), documents marked as ``boundary`` says; ``check``
    sees what the scans found (one :class:`Found` a span) first."""

    foreign: Foreign
    spans: list[TokenSpan]
    boundary: Boundary
    masks: list[Path] | None = None
    check: Callable[[list[Found]], None] | None = None


def open_plan(plan: ScanPlan, *, threads: int = SCAN_THREADS, crcs: list[int] | None = None) -> Foreign:
    """The foreign cache of ``plan``, its spans scanned on ``threads`` threads, a few ahead of the one in
    hand; each span's CRC-32 is appended to ``crcs`` where given."""
    left = KEPT_ENDS_BYTES
    found: list[Found] = []
    scan = partial(plan.boundary.ends, checksum=crcs is not None)
    with ThreadPoolExecutor(max(1, min(threads, len(plan.spans))), "streampack-scan") as pool:
        ahead: deque[Future[tuple[np.ndarray, int]]] = deque()
        for index, span in enumerate(plan.spans):
            while len(ahead) < 2 * threads and index + len(ahead) < len(plan.spans):
                ahead.append(pool.submit(scan, plan.spans[index + len(ahead)]))
            ends, crc = ahead.popleft().result()
            again: Callable[[], np.ndarray]
            if ends.nbytes <= left:  # kept for the shard's first read
                left -= ends.nbytes
                ends.flags.writeable = False
                again = partial(np.asarray, ends)
            else:
                again = partial(_rescan, span, plan.boundary, len(ends))
            found.append(Found(len(ends), again, ends_digest(ends)))
            if crcs is not None:
                crcs.append(crc)
    if plan.check is not None:
        plan.check(found)
    return replace(plan.foreign, shards=_shards(plan.spans, found, plan.masks))


def _rescan(span: TokenSpan, boundary: Boundary, docs: int) -> np.ndarray:
    """The ends of ``span`` scanned again: the same ``docs`` documents as at the open."""
    ends = boundary.ends(span)[0]
    if len(ends) != docs:
        raise CacheError(
            f"{span.path}: {len(ends):,} documents now, {docs:,} when it was opened: the file changed since; "
            "open it again"
        )
    return ends


def _shards(spans: list[TokenSpan], found: list[Found], mask_files: list[Path] | None) -> list[ForeignShard]:
    """One shard a span, mapped where its tokens lie, with the ends its scan found and their digest (and its
    loss mask file, one byte a token, from ``mask_files``)."""
    shards, before = [], Counter[Path]()
    for index, (span, seen) in enumerate(zip(spans, found, strict=True)):
        mask_file = None if mask_files is None else mask_files[index]
        mask = None if mask_file is None else partial(map_tokens, mask_file, np.dtype("u1"), 0, span.count)
        shards.append(
            ForeignShard(
                span.path,
                seen.num_docs,
                span.count,
                tokens=partial(map_tokens, span.path, span.dtype, span.offset, span.count),
                ends=seen.ends,
                mask=mask,
                token_file=(span.path, span.offset),
                first_doc=before[span.path],
                mask_file=mask_file,
                ends_digest=seen.digest,  # so that the identity never scans a span again
            )
        )
        before[span.path] += seen.num_docs
    return shards


def scan_plan(source: str | os.PathLike[str], declared: Mapping[str, Any]) -> ScanPlan | None:
    """The :class:`ScanPlan` of the local foreign cache at ``source`` whose format is read by a scan, or
    None for anything else (opening that says what it is).

    Args:
        declared: what :func:`streampack.open` was told of the files.
    """
    options = ForeignOptions(**declared)
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

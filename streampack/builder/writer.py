"""Writing a unit's shard: the open unit, its append-only writer with durable commits, and the writer
thread that appends encoded blocks in input order off the reading thread.

Writes, fsyncs and checksums wait for the disk and release the GIL, so the reader need not stop for them
(345 MB x 4 on 2 cores: 1.4 s were on the reader before). The writer thread runs no per-document Python.
A failed write is raised in the reading thread at its next hand-over; after it nothing more is written.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import astuple, dataclass
from pathlib import Path

import numpy as np

from streampack.builder.tasks import UnitResult, UnitTask
from streampack.builder.timings import Stopwatch
from streampack.format.ledger import Counts, LedgerEntry
from streampack.format.names import (
    OFFSET_DTYPE,
    SHARD_DIR,
    checksum_text,
    mask_key,
    offsets_key,
    shard_name,
    tokens_key,
)
from streampack.inputs.records import Position
from streampack.store import AppendFile, LocalStore
from streampack.store.files import commit_entry
from streampack.tokenizer.base import Tokenizer


class ShardWriter:
    """Append-only writer of one shard, opened at the lengths ``progress`` committed (dropping an uncommitted
    tail); ``masked``: also write an SFT build's loss mask."""

    def __init__(
        self, root: Path, name: str, dtype: np.dtype, progress: LedgerEntry, *, masked: bool = False
    ) -> None:
        self.name = name
        self.dtype = np.dtype(dtype)
        self.progress = progress
        self._store = LocalStore(root)
        self._tokens = self._store.append_file(tokens_key(name), progress.tokens * self.dtype.itemsize)
        self._tokens.lock()
        self._created = self._tokens.created
        self._offsets = self._store.append_file(offsets_key(name), progress.docs * OFFSET_DTYPE.itemsize)
        self._mask = self._store.append_file(mask_key(name), progress.tokens) if masked else None
        self.num_tokens = progress.tokens
        self.num_docs = progress.docs
        self._doc_aligned_tokens = progress.tokens

    def append(self, tokens: np.ndarray, ends: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Append tokens (of the shard's dtype), the ends of the documents they complete (relative to
        ``tokens``; none while a long document goes on), and with a masked writer their loss mask."""
        if self._mask is not None:
            assert mask is not None and len(mask) == len(tokens), "a masked shard takes a byte per token"
            self._mask.write(_buffer(mask, np.dtype(np.uint8)))
        self._tokens.write(_buffer(tokens, self.dtype))
        if len(ends):
            self._offsets.write(_buffer(ends + self.num_tokens, OFFSET_DTYPE))
            self._doc_aligned_tokens = self.num_tokens + int(ends[-1])
        self.num_tokens += len(tokens)
        self.num_docs += len(ends)

    def commit(self, counts: Counts, *, done: bool = False) -> LedgerEntry:
        """Fsync everything appended, then record it in the ledger (with ``done``, with its checksums).

        The ledger records tokens up to the last complete document: a resume writes a partial one again.
        """
        for file in self._files():
            file.sync()
        if self._created:  # the new files' directory entries must be durable before a ledger names them
            self._store.sync_dir(SHARD_DIR)
            self._created = False
        checksums = ("", "", "")
        if done:
            mask = "" if self._mask is None else checksum_text(self._mask.crc32())
            checksums = (checksum_text(self._tokens.crc32()), checksum_text(self._offsets.crc32()), mask)
        self.progress = LedgerEntry(
            unit=self.progress.unit,
            records=counts.records,
            docs=self.num_docs,
            tokens=self._doc_aligned_tokens,
            skipped=counts.skipped,
            done=done,
            tokens_checksum=checksums[0],
            offsets_checksum=checksums[1],
            empty_docs=counts.empty_docs,
            inexact_cuts=counts.inexact_cuts,
            mask_checksum=checksums[2],
        )
        commit_entry(self._store, self.name, self.progress)
        return self.progress

    def close(self) -> None:
        """Close the files (without committing)."""
        for file in self._files():
            file.close()

    def _files(self) -> list[AppendFile]:
        return [self._tokens, self._offsets] + ([] if self._mask is None else [self._mask])


def _buffer(array: np.ndarray, dtype: np.dtype) -> memoryview:
    """``array``'s bytes as ``dtype``, without a copy where it already is one, contiguous."""
    return np.ascontiguousarray(array, dtype=dtype).view(np.uint8).data


class OpenUnit:
    """A unit whose shard is open: its writer, where its reading is, when it last committed, its counts."""

    def __init__(self, task: UnitTask, progress: LedgerEntry, tokenizer: Tokenizer) -> None:
        self.task, self.spec, self.tokenizer = task, task.spec, tokenizer
        self.dtype = np.dtype(task.spec.dtype)
        root, name = Path(task.spec.root), shard_name(task.unit.index)
        self.writer = ShardWriter(root, name, self.dtype, progress, masked=task.spec.read.sft)
        self.eos = task.spec.eos.id if task.spec.eos.append else None
        self.id_limit = task.spec.vocab_size or int(np.iinfo(self.dtype).max) + 1
        self.bos = task.spec.bos.id if task.spec.bos.prepend else None
        self.position = Position()
        self.reported_bytes = 0
        self.tokens = self.writer.num_tokens  # framed so far (the writer thread appends them after)
        self.counts = progress.counts  # the records of those tokens
        self.last_commit = (time.monotonic(), self.tokens)

    def add(self, counts: Counts) -> None:
        """Add a block's own counts to the unit's."""
        self.counts = Counts(*(a + b for a, b in zip(astuple(self.counts), astuple(counts))))

    def bytes_read_delta(self) -> int:
        """Input bytes read since the last call."""
        now = max(self.position.bytes_read() - self.task.unit.start, 0)
        delta, self.reported_bytes = now - self.reported_bytes, now
        return max(delta, 0)

    def commit_due(self) -> bool:
        """Whether the unit commits after its tokens so far: ``commit_bytes`` or ``commit_seconds`` on."""
        started, tokens = self.last_commit
        new_bytes = (self.tokens - tokens) * self.dtype.itemsize
        run = self.spec.run
        if new_bytes < run.commit_bytes and time.monotonic() - started < run.commit_seconds:
            return False
        self.last_commit = (time.monotonic(), self.tokens)
        return True


@dataclass
class Framed:
    """A batch's tokens, ready to append, and whether the unit commits after them."""

    unit: OpenUnit
    tokens: np.ndarray  # in the cache's dtype
    doc_ends: np.ndarray  # the completed documents' ends, relative to the first token
    mask: np.ndarray | None  # SFT builds: the loss mask
    counts: Counts  # what a commit after this batch records
    commit: bool = False  # commit after appending
    last: bool = False  # the unit's last batch: commit it as done, then close the shard


class WriterThread:
    """Appends and commits handed batches in order on a thread of its own; at most ``capacity`` wait."""

    def __init__(self, capacity: int) -> None:
        self._queue: queue.Queue[Framed | None] = queue.Queue(capacity)
        self._error: BaseException | None = None
        self._finished: deque[UnitResult] = deque()
        self._thread = threading.Thread(target=self._run, name="streampack-write", daemon=True)
        self._thread.start()

    def put(self, framed: Framed) -> None:
        """Hand over ``framed`` (waits while ``capacity`` wait); raises the writer's error, if any."""
        self.raise_error()
        self._queue.put(framed)

    def drain(self) -> None:
        """Wait until every batch handed over is written; raises the writer's error, if any."""
        self._queue.join()
        self.raise_error()

    def raise_error(self) -> None:
        """Raise the error that stopped the writer, if one did."""
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        """End the thread; what it was handed and has not written is dropped."""
        if self._error is None:
            self._error = _Stopped()
        self._queue.put(None)
        self._thread.join()

    def take_finished(self) -> list[UnitResult]:
        """The results of the units completed since the last call (their timings: the writer's own)."""
        return [self._finished.popleft() for _ in range(len(self._finished))]

    def _run(self) -> None:
        watch = Stopwatch("write wait")
        while (framed := self._queue.get()) is not None:
            try:
                if self._error is None:
                    watch.measure_cpu(framed.unit.spec.run.profile)
                    with watch.timing("write"):
                        self._write(framed, watch)
            except BaseException as e:  # raised in the reading thread; nothing more is written
                self._error = e
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, framed: Framed, watch: Stopwatch) -> None:
        writer = framed.unit.writer
        if len(framed.tokens):
            writer.append(framed.tokens, framed.doc_ends, framed.mask)
        if framed.last:
            final = writer.commit(framed.counts, done=True)
            writer.close()
            self._finished.append(UnitResult(framed.unit.task.unit.index, final, watch.take(process=False)))
        elif framed.commit:
            writer.commit(framed.counts)


class _Stopped(Exception):
    """The writer was stopped (the reading thread is leaving on an error of its own)."""

"""One work unit's pipeline: records -> pieces -> batches -> tokens -> shard, with commits.

Every engine runs :func:`run_unit` on a :class:`UnitTask`. The unit streams its records, cuts long
documents into pieces, groups the pieces into batches of about ``batch_chars`` characters, encodes the
batches on helper threads and appends their tokens to the unit's shard in input order, committing every
``commit_bytes`` or ``commit_seconds``.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from streampack import ledger
from streampack.errors import BadRecordError, StreampackError, WriteError
from streampack.format import shard_name
from streampack.ledger import UnitProgress
from streampack.sources import Position, TextStream, WorkUnit, read_unit
from streampack.tokenize import EosPolicy, Tokenizer, load_tokenizer, split_text, stream_pieces
from streampack.writer import ShardWriter

if TYPE_CHECKING:
    from streampack.build import BuildOptions

ProgressFn = Callable[[dict[str, int]], None]

# Batches encoded at once, each on a helper thread of its own: while one batch ends on a long document that
# holds a single tokenizer thread, the other keeps the remaining cores busy.
ENCODING_THREADS = 2
# Batches submitted and not yet written. A batch waits here when one before it is still encoding (a long
# document); encoded batches hold only their token arrays, a few bytes per token.
MAX_QUEUED_BATCHES = 8


@dataclass(frozen=True)
class UnitTask:
    """Everything a worker needs to build one unit (picklable)."""

    root: str
    unit: WorkUnit
    options: BuildOptions
    eos: EosPolicy
    dtype: str


@dataclass(frozen=True)
class UnitResult:
    """A finished unit's final progress."""

    unit_index: int
    progress: UnitProgress


def run_unit(task: UnitTask, report: ProgressFn) -> UnitResult:
    """Build (or finish building) the shard of one work unit; the function every engine runs."""
    root, unit, opts = Path(task.root), task.unit, task.options
    name = shard_name(unit.index)
    progress = ledger.read_progress(root, name, unit.describe())
    if progress.done:
        return UnitResult(unit.index, progress)
    tokenizer = process_tokenizer(opts.tokenizer)
    with ShardWriter(root, name, np.dtype(task.dtype), progress) as writer:
        final = _UnitPipeline(task, tokenizer, writer, report).run()
    return UnitResult(unit.index, final)


# ------------------------------------------------------------------------------------- per-process setup

_threads = 1
_tokenizers: dict[tuple[str, int], Tokenizer] = {}


def set_process_threads(threads: int) -> None:
    """Set the tokenizer threads of this process; 0 means every core of the machine it runs on.

    Called once per process before its first unit (the engines' worker initializer). Hugging Face
    ``tokenizers`` sizes its thread pool from ``RAYON_NUM_THREADS`` when the pool first starts, so the
    variable is the only way to set it.
    """
    global _threads
    _threads = threads or os.cpu_count() or 1
    os.environ["RAYON_NUM_THREADS"] = str(_threads)


def process_tokenizer(spec: str) -> Tokenizer:
    """This process's tokenizer for ``spec``, loaded once (a tokenizer.json takes ~0.5 s to load)."""
    key = (spec, _threads)
    if key not in _tokenizers:
        _tokenizers[key] = load_tokenizer(spec, threads=_threads)
    return _tokenizers[key]


# ---------------------------------------------------------------------------------------------- pipeline


@dataclass
class _Batch:
    """A batch being encoded, with what a commit after it may record."""

    encoded: Future[list[np.ndarray]]
    ends_doc: list[bool]  # per piece: the piece is the last of its document
    records: int  # input records consumed by this batch and the ones before it
    skipped: int


class _UnitPipeline:
    """Records -> pieces -> batches -> tokens -> shard, committing at document boundaries.

    This thread reads and parses records and writes encoded batches in input order; the batches encode on
    ``ENCODING_THREADS`` helper threads (tokenizers release the GIL while they encode), with one more
    waiting, so that a helper never idles while the reader catches up. Batches that finish while an earlier
    one still encodes wait in the queue; the reader blocks only when ``MAX_QUEUED_BATCHES`` are queued.
    A commit records the records and tokens of the batches written so far: the pipeline never drains to
    commit.
    """

    def __init__(self, task: UnitTask, tokenizer: Tokenizer, writer: ShardWriter, report: ProgressFn) -> None:
        self.task, self.opts, self.tokenizer, self.writer = task, task.options, tokenizer, writer
        self.report = report
        self.records = writer.progress.records
        self.skipped = writer.progress.skipped
        self.texts: list[str] = []
        self.ends_doc: list[bool] = []
        self.batch_chars = 0
        self.eos = None if not task.eos.append else np.array([task.eos.id], dtype=np.uint32)
        self.position = Position()
        self.reported_bytes = 0
        self.last_commit = (time.monotonic(), writer.num_tokens)
        self.queue: deque[_Batch] = deque()
        assert self.opts.max_piece_chars is not None, "build() resolves the piece size"
        self.max_piece_chars = self.opts.max_piece_chars

    def run(self) -> UnitProgress:
        items = read_unit(self.task.unit, self.opts.read_options, skip=self.records, position=self.position)
        with ThreadPoolExecutor(ENCODING_THREADS, thread_name_prefix="streampack-encode") as self.encoder:
            try:
                for item in items:
                    if isinstance(item, BadRecordError):
                        self._bad_record(item)
                    elif item is not None:
                        self._add_document(item)
                    self.records += 1
                    if self.batch_chars >= self.opts.batch_chars:
                        self._flush()
            except WriteError:
                raise  # the disk state past the last commit is unknown: write nothing more
            except StreampackError:  # a bad record or input: keep everything read before it
                self._drain()
                self.writer.commit(records=self.records, skipped=self.skipped)
                raise
            self._drain()
        return self.writer.commit(records=self.records, skipped=self.skipped, done=True)

    def _bad_record(self, error: BadRecordError) -> None:
        if self.opts.on_bad_record == "error":
            raise error
        self.skipped += 1

    def _add_document(self, text: str | TextStream) -> None:
        pieces = (
            stream_pieces(text, self.max_piece_chars)
            if isinstance(text, TextStream)
            else split_text(text, self.max_piece_chars)
        )
        for piece in pieces:
            if self.batch_chars >= self.opts.batch_chars:
                self._flush()  # mid-document: its records count starts with the next batch
            self.texts.append(piece)
            self.ends_doc.append(False)
            self.batch_chars += len(piece)
        self.ends_doc[-1] = True

    def _flush(self) -> None:
        """Submit the current batch for encoding; write the batches that are encoded."""
        if not self.texts:
            return
        encoded = self.encoder.submit(self.tokenizer.encode_batch, self.texts)
        self.queue.append(_Batch(encoded, self.ends_doc, self.records, self.skipped))
        self.texts, self.ends_doc, self.batch_chars = [], [], 0
        self._write_encoded()
        while len(self.queue) >= MAX_QUEUED_BATCHES or self._encoding() > ENCODING_THREADS:
            wait([b.encoded for b in self.queue if not b.encoded.done()], return_when=FIRST_COMPLETED)
            self._write_encoded()

    def _encoding(self) -> int:
        return sum(not b.encoded.done() for b in self.queue)

    def _write_encoded(self) -> None:
        """Write the batches at the head of the queue that are encoded."""
        while self.queue and self.queue[0].encoded.done():
            self._write(self.queue.popleft())

    def _drain(self) -> None:
        """Encode and write everything read so far."""
        self._flush()
        while self.queue:
            self._write(self.queue.popleft())  # waits for the batch to be encoded

    def _write(self, batch: _Batch) -> None:
        encoded = batch.encoded.result()
        parts: list[np.ndarray] = []
        lengths = np.empty(len(encoded), dtype=np.int64)
        for i, (ids, ends) in enumerate(zip(encoded, batch.ends_doc)):
            parts.append(ids)
            lengths[i] = len(ids)
            if ends and self.eos is not None:
                parts.append(self.eos)
                lengths[i] += 1
        tokens = np.concatenate(parts, dtype=self.writer.dtype, casting="unsafe")
        doc_ends = np.cumsum(lengths)[np.asarray(batch.ends_doc)]
        self.writer.append(tokens, doc_ends)
        event = {"unit": self.task.unit.index, "docs": len(doc_ends), "tokens": len(tokens)}
        self.report({**event, "bytes": self._bytes_read_delta()})
        self._maybe_commit(batch)

    def _bytes_read_delta(self) -> int:
        now = max(self.position.bytes_read() - self.task.unit.start, 0)
        delta, self.reported_bytes = now - self.reported_bytes, now
        return max(delta, 0)

    def _maybe_commit(self, written: _Batch) -> None:
        started, tokens = self.last_commit
        new_bytes = (self.writer.num_tokens - tokens) * self.writer.dtype.itemsize
        if new_bytes >= self.opts.commit_bytes or time.monotonic() - started >= self.opts.commit_seconds:
            self.writer.commit(records=written.records, skipped=written.skipped)
            self.last_commit = (time.monotonic(), self.writer.num_tokens)

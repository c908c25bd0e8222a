"""Work units' pipeline: records -> pieces -> batches -> tokens -> shards, with commits.

Every engine runs :func:`run_units` on a sequence of :class:`UnitTask`. The units stream their records in
order through one pipeline: long documents (and each segment of an SFT document) are cut into pieces, the
pieces grouped into batches of about ``batch_chars`` characters, the batches encoded on helper threads and
their tokens (and an SFT build's loss mask) appended to their unit's shard in input order, committing every
``commit_bytes`` or ``commit_seconds``. The next unit starts reading while the last batches of the one
before it still encode, so the cores never wait at a unit's end.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import TracebackType

import numpy as np

from streampack.builder.options import OnBadRecord, VerifyTokens
from streampack.builder.stagetimes import Stopwatch
from streampack.builder.writer import ShardWriter
from streampack.errors import BadRecordError, StreampackError, TokenizerError, WriteError
from streampack.format.ledger import Counts, UnitProgress
from streampack.format.names import shard_name
from streampack.inputs.records import Position, ReadOptions, TextStream, WorkUnit
from streampack.inputs.sft import Sft
from streampack.inputs.units import read_unit, records_before
from streampack.store.files import read_progress
from streampack.tokenizer.base import Tokenizer
from streampack.tokenizer.choices import SpecialTokens, TokenizerEngine
from streampack.tokenizer.load import load_tokenizer
from streampack.tokenizer.pieces import CutCount, PieceRule
from streampack.tokenizer.specials import BosPolicy, EosPolicy

ProgressFn = Callable[[dict[str, int]], None]
NO_BOS = BosPolicy(False, None)

# Batches encoded at once, each on a helper thread of its own: while one batch ends on a long document that
# holds a single tokenizer thread, the other keeps the remaining cores busy.
ENCODING_THREADS = 2
# Batches submitted and not yet written. A batch waits here when one before it is still encoding (a long
# document); encoded batches hold only their token arrays, a few bytes per token.
MAX_QUEUED_BATCHES = 8

# verify_tokens="sample": the records re-encoded with the reference engine are the build's first
# VERIFY_FIRST (those of unit 0) and a VERIFY_RATE share of every unit's, chosen by a hash of the record's
# place (unit index, record index): the same records on every run and with any number of workers.
# The reference engine is 20-40x slower than fastokens: re-encoding the first 1,000 records and 0.5 % of the
# rest (the first rule) took longer than the whole build with fastokens (345 MB: 11.9 s against 4.2 s); the
# first 100 records alone were 1.6 MB there. The first 20 and 0.1 % (~1 record in 1,000 at any scale) are
# ~0.7 MB of the 345 MB.
VERIFY_FIRST = 20
VERIFY_RATE = 0.001
_VERIFY_BELOW = round(VERIFY_RATE * (1 << 32))


@dataclass(frozen=True)
class TokenizerRef:
    """The tokenizer of a build as a worker loads it: its SPEC, special-token mode and definition hash.

    The hash lets a worker refuse a tokenizer file that changed after the build started, and keys the
    worker's tokenizer cache, so an edited file is never served from an old load.
    """

    spec: str
    special_tokens: SpecialTokens
    sha256: str
    engine: TokenizerEngine = "auto"  # the engine the build's own tokenizer runs, so that workers run it too


@dataclass(frozen=True)
class UnitSpec:
    """What every unit of one build shares (picklable): the resolved cache spec and the run's policies."""

    root: str
    tokenizer: TokenizerRef
    read: ReadOptions
    eos: EosPolicy
    dtype: str
    pieces: PieceRule  # resolved for the tokenizer (see :func:`streampack.tokenizer.pieces.piece_rule`)
    bos: BosPolicy = NO_BOS
    # The manifest's vocab_size: every id written is below it, checked per batch before it is written
    # (None: below the dtype's limit only).
    vocab_size: int | None = None
    verify: VerifyTokens = "none"  # re-encode records with the reference engine (see VERIFY_FIRST)
    on_bad_record: OnBadRecord = "error"
    batch_chars: int = 1 << 20
    commit_bytes: int = 64 << 20
    commit_seconds: float = 10.0
    profile: bool = False  # measure each stage's CPU time too (see streampack.builder.stagetimes)


@dataclass(frozen=True)
class UnitTask:
    """Everything a worker needs to build one unit (picklable)."""

    spec: UnitSpec
    unit: WorkUnit


@dataclass(frozen=True)
class UnitResult:
    """A finished unit's final progress, and the seconds per stage its process spent since its last result
    (summed over results, a process's whole time: see :mod:`streampack.builder.stagetimes`)."""

    unit_index: int
    progress: UnitProgress
    stages: dict[str, list[float]] = dataclasses.field(default_factory=dict)


def run_units(
    tasks: Iterable[UnitTask], report: ProgressFn, tokenizer: Tokenizer | None = None
) -> Iterator[UnitResult]:
    """Build (or finish building) the shards of ``tasks``, in order; the function every engine runs.

    Yields each unit's result once its shard is complete. Units finished by an earlier run are yielded
    as they are, without reading their input again. ``tokenizer`` is the build's own (units run in the
    coordinating process); worker processes load theirs with :func:`worker_tokenizer`.
    """
    with _Pipeline(report) as pipeline:
        for task in tasks:
            name = shard_name(task.unit.index)
            progress = read_progress(Path(task.spec.root), name, task.unit.describe())
            if progress.done:
                yield UnitResult(task.unit.index, progress)
                continue
            pipeline.watch.measure_cpu(task.spec.profile)
            if tokenizer is None:
                with pipeline.watch.stage("load tokenizer"):
                    tokenizer = worker_tokenizer(task.spec.tokenizer)
            pipeline.read(task, progress, tokenizer)
            yield from pipeline.take_finished()
        pipeline.drain()
        yield from pipeline.take_finished()


# ----------------------------------------------------------------------------- worker processes only

# Set and read only in spawned worker processes and Ray tasks, never in the process that calls build():
# a worker serves the units of builds whose tokenizer it loads once (a tokenizer.json takes ~0.5 s).
_worker_threads = 0
_worker_tokenizers: dict[tuple[TokenizerRef, int], Tokenizer] = {}


def init_worker(threads: int) -> None:
    """Worker-process initializer: encode with ``threads`` threads.

    Hugging Face ``tokenizers`` sizes its thread pool from ``RAYON_NUM_THREADS`` when the pool first
    starts, so in a worker of its own the variable is the way to set it.
    """
    global _worker_threads
    _worker_threads = threads
    os.environ["RAYON_NUM_THREADS"] = str(threads)


def worker_tokenizer(ref: TokenizerRef) -> Tokenizer:
    """This worker's tokenizer for ``ref``, loaded once, and checked to be the one the build started with.

    Raises:
        TokenizerError: the tokenizer's files changed since the build started.
    """
    key = (ref, _worker_threads)
    if key not in _worker_tokenizers:
        tokenizer = load_tokenizer(
            ref.spec, threads=_worker_threads or None, special_tokens=ref.special_tokens, engine=ref.engine
        )
        found = tokenizer.fingerprint()["sha256"]
        if found != ref.sha256:
            raise TokenizerError(
                f"tokenizer {ref.spec!r} changed since the build started (sha256 {ref.sha256[:12]}... "
                f"then, {found[:12]}... now); rerun the build to use one tokenizer throughout"
            )
        _worker_tokenizers[key] = tokenizer
    return _worker_tokenizers[key]


# ---------------------------------------------------------------------------------------------- pipeline


def verified(unit_index: int, record: int, mode: VerifyTokens) -> bool:
    """Whether record ``record`` of unit ``unit_index`` is re-encoded with the reference engine."""
    if mode != "sample":
        return mode == "all"
    if unit_index == 0 and record < VERIFY_FIRST:
        return True
    mixed = ((unit_index << 40) ^ record) * 0x9E3779B97F4A7C15  # Fibonacci hashing of the record's place
    return (mixed >> 32) & 0xFFFFFFFF < _VERIFY_BELOW


class _OpenUnit:
    """A unit whose shard is open: its writer, and what the next commit and progress event need."""

    def __init__(self, task: UnitTask, progress: UnitProgress, tokenizer: Tokenizer) -> None:
        self.task, self.spec, self.tokenizer = task, task.spec, tokenizer
        name = shard_name(task.unit.index)
        dtype = np.dtype(task.spec.dtype)
        self.writer = ShardWriter(Path(task.spec.root), name, dtype, progress, masked=task.spec.read.sft)
        self.eos = np.array([task.spec.eos.id], dtype=np.uint32) if task.spec.eos.append else None
        self.id_limit = task.spec.vocab_size or int(np.iinfo(dtype).max) + 1
        self.bos = np.array([task.spec.bos.id], dtype=np.uint32) if task.spec.bos.prepend else None
        self.position = Position()
        self.reported_bytes = 0
        self.last_commit = (time.monotonic(), self.writer.num_tokens)

    def bytes_read_delta(self) -> int:
        now = max(self.position.bytes_read() - self.task.unit.start, 0)
        delta, self.reported_bytes = now - self.reported_bytes, now
        return max(delta, 0)


@dataclass
class _Tally:
    """The counts of the unit being read, updated per record (a :class:`Counts` is made per batch)."""

    records: int
    skipped: int
    empty_docs: int
    inexact_cuts: int

    def counts(self) -> Counts:
        return Counts(self.records, self.skipped, self.empty_docs, self.inexact_cuts)


@dataclass
class _Batch:
    """A batch being encoded, with what a commit after it may record."""

    unit: _OpenUnit
    encoded: Future[_Encoded]
    ends_doc: list[bool]  # per piece: the piece is the last of its document
    opens_doc: bool  # the first piece is the first of its document (a later one is when the one before ends)
    targets: list[bool] | None  # SFT builds: per piece, its tokens carry the loss
    checks: list[tuple[int, int]]  # (piece, record) of the pieces re-encoded with the reference engine
    records: list[int]  # per piece, the unit's record it is from (for errors)
    counts: Counts  # the unit's records consumed by this batch and the ones before it, and what they held
    last: bool = False  # the unit's last batch (possibly empty): writing it completes the unit


class _Pipeline:
    """Records -> pieces -> batches -> tokens -> shards, committing at document boundaries.

    This thread reads and parses records and writes encoded batches in input order; the batches encode on
    ``ENCODING_THREADS`` helper threads (tokenizers release the GIL while they encode), with one more
    waiting, so that a helper never idles while the reader catches up. Batches that finish while an earlier
    one still encodes wait in the queue; the reader blocks only when ``MAX_QUEUED_BATCHES`` are queued.
    A commit records the records and tokens of the batches written so far: the pipeline never drains to
    commit, nor to start the next unit.
    """

    unit: _OpenUnit  # the unit being read
    tally: _Tally  # its records read so far (of documents complete), and what they held

    def __init__(self, report: ProgressFn) -> None:
        self.report = report
        self.queue: deque[_Batch] = deque()
        self.open_units: list[_OpenUnit] = []
        self.finished: list[UnitResult] = []
        self.encoder = ThreadPoolExecutor(ENCODING_THREADS, thread_name_prefix="streampack-encode")
        self.watch = Stopwatch()
        self._start_batch()

    def __enter__(self) -> _Pipeline:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.encoder.shutdown(wait=True, cancel_futures=True)
        for unit in self.open_units:  # units cut short by an error keep only what they committed
            unit.writer.close()

    def read(self, task: UnitTask, progress: UnitProgress, tokenizer: Tokenizer) -> None:
        """Read all of a unit's records into batches; its last batches may still encode on return."""
        unit = _OpenUnit(task, progress, tokenizer)
        self.open_units.append(unit)
        self.unit, self.tally = unit, _Tally(*dataclasses.astuple(progress.counts))
        items = read_unit(task.unit, task.spec.read, skip=self.tally.records, position=unit.position)
        outside = self.watch.switch("pieces")  # the loop's own work; reading and flushing switch away
        try:
            for item in self.watch.timed(items, "read"):
                if isinstance(item, BadRecordError):
                    self._bad_record(item)
                elif item is not None:
                    self._add_document(item)
                self.tally.records += 1
                if self.batch_chars >= unit.spec.batch_chars:
                    self._flush()
        except (WriteError, TokenizerError):
            raise  # the disk state past the last commit is unknown, or its ids are wrong: write nothing more
        except StreampackError:  # a bad record or input: keep everything read before it
            self.drain()
            unit.writer.commit(self.tally.counts())
            raise
        self._flush(last=True)
        self.watch.switch(outside)

    def drain(self) -> None:
        """Encode and write everything read so far."""
        self._flush()
        while self.queue:
            self._write(self.queue.popleft())  # waits for the batch to be encoded

    def take_finished(self) -> list[UnitResult]:
        """The results of the units completed since the last call."""
        finished, self.finished = self.finished, []
        return finished

    def _start_batch(self) -> None:
        self.texts: list[str] = []
        self.ends_doc: list[bool] = []
        self.opens_doc = True  # until a document's pieces are flushed partway
        self.batch_chars = 0
        self.targets: list[bool] = []  # SFT builds only: per piece, as in _Batch
        self.templated: list[bool] = []  # SFT builds only: per piece, written by a chat template
        self.checks: list[tuple[int, int]] = []  # as in _Batch
        self.records: list[int] = []  # as in _Batch

    def _bad_record(self, error: BadRecordError) -> None:
        if self.unit.spec.on_bad_record == "error":
            raise error
        self.tally.skipped += 1

    def _add_document(self, text: str | TextStream | Sft) -> None:
        if isinstance(text, tuple):
            self._add_segments(text)
            return
        if isinstance(text, str) and (not text or text.isspace()):
            self.tally.empty_docs += 1  # no document is empty or only whitespace
            return
        rule, batch_chars = self.unit.spec.pieces, self.unit.spec.batch_chars
        cuts = CutCount()
        pieces = rule.stream(text, cuts) if isinstance(text, TextStream) else rule.split(text, cuts)
        record = self.tally.records
        verify = self.unit.spec.verify
        checked = verify != "none" and verified(self.unit.task.unit.index, record, verify)
        for i, piece in enumerate(pieces):
            if self.batch_chars >= batch_chars:
                self._flush()  # mid-document: its counts start with the next batch
                self.opens_doc = i == 0
            if checked:
                self.checks.append((len(self.texts), record))
            self.texts.append(piece)
            self.ends_doc.append(False)
            self.records.append(record)
            self.batch_chars += len(piece)
        self.ends_doc[-1] = True
        self.tally.inexact_cuts += cuts.inexact

    def _add_segments(self, segments: Sft) -> None:
        """An SFT document: each segment cut into pieces of its own, each piece a target or not."""
        if all(not s.text or s.text.isspace() for s in segments):
            self.tally.empty_docs += 1
            return
        rule, batch_chars = self.unit.spec.pieces, self.unit.spec.batch_chars
        cuts = CutCount()
        first = True
        record = self.tally.records
        verify = self.unit.spec.verify
        checked = verify != "none" and verified(self.unit.task.unit.index, record, verify)
        for segment in segments:
            for piece in rule.split(segment.text, cuts) if segment.text else ():
                if self.batch_chars >= batch_chars:
                    self._flush()  # mid-document: its counts start with the next batch
                    self.opens_doc = first
                if checked and not segment.template:  # a template's pieces are the reference's own
                    self.checks.append((len(self.texts), record))
                self.texts.append(piece)
                self.ends_doc.append(False)
                self.records.append(record)
                self.targets.append(segment.target)
                self.templated.append(segment.template)
                self.batch_chars += len(piece)
                first = False
        self.ends_doc[-1] = True
        self.tally.inexact_cuts += cuts.inexact

    def _flush(self, last: bool = False) -> None:
        """Submit the current batch for encoding; write the batches that are encoded."""
        if not self.texts and not last:
            return
        encoded: Future[_Encoded]
        tokenizer = self.unit.tokenizer
        encode: Callable[[], list[np.ndarray]] = partial(tokenizer.encode_batch, self.texts)
        if any(self.templated):
            encode = partial(_encode_with_templates, tokenizer, self.texts, self.templated)
        if self.texts:
            encoded = self.encoder.submit(_encode_and_check, encode, tokenizer, self.texts, self.checks)
        else:
            encoded = Future()
            encoded.set_result(([], 0.0, 0.0))
        targets = self.targets if self.unit.spec.read.sft else None
        self.queue.append(
            _Batch(
                self.unit,
                encoded,
                self.ends_doc,
                self.opens_doc,
                targets,
                self.checks,
                self.records,
                self.tally.counts(),
                last,
            )
        )
        self._start_batch()
        self._write_encoded()
        while len(self.queue) >= MAX_QUEUED_BATCHES or self._encoding() > ENCODING_THREADS:
            with self.watch.stage("wait"):
                wait([b.encoded for b in self.queue if not b.encoded.done()], return_when=FIRST_COMPLETED)
            self._write_encoded()

    def _encoding(self) -> int:
        return sum(not b.encoded.done() for b in self.queue)

    def _write_encoded(self) -> None:
        """Write the batches at the head of the queue that are encoded."""
        while self.queue and self.queue[0].encoded.done():
            self._write(self.queue.popleft())

    def _write(self, batch: _Batch) -> None:
        unit, watch = batch.unit, self.watch
        try:
            with watch.stage("wait"):
                encoded, encode_seconds, verify_seconds = batch.encoded.result()
        except _Mismatch as e:
            raise _mismatch_error(unit, e) from None
        watch.add("encode", encode_seconds)
        if verify_seconds:
            watch.add("verify", verify_seconds)
        if encoded:
            with watch.stage("frame"):
                tokens, doc_ends, piece_ends = _frame(
                    encoded, batch.ends_doc, batch.opens_doc, unit.bos, unit.eos
                )
                top = int(tokens.max()) if len(tokens) else 0
                if top >= unit.id_limit:
                    raise _id_error(unit, batch, tokens, piece_ends, top)
                tokens = tokens.astype(unit.writer.dtype, copy=False)
                mask = None
                if batch.targets is not None:
                    mask = _loss_mask(batch, piece_ends, unit.bos is not None, unit.eos is not None)
            with watch.stage("write"):
                unit.writer.append(tokens, doc_ends, mask)
            event = {"unit": unit.task.unit.index, "docs": len(doc_ends), "tokens": len(tokens)}
            self.report({**event, "bytes": unit.bytes_read_delta()})
        with watch.stage("write"):
            if batch.last:
                self._finish(unit, batch)
            else:
                self._maybe_commit(unit, batch)

    def _maybe_commit(self, unit: _OpenUnit, written: _Batch) -> None:
        started, tokens = unit.last_commit
        new_bytes = (unit.writer.num_tokens - tokens) * unit.writer.dtype.itemsize
        spec = unit.spec
        if new_bytes >= spec.commit_bytes or time.monotonic() - started >= spec.commit_seconds:
            unit.writer.commit(written.counts)
            unit.last_commit = (time.monotonic(), unit.writer.num_tokens)

    def _finish(self, unit: _OpenUnit, last: _Batch) -> None:
        final = unit.writer.commit(last.counts, done=True)
        unit.writer.close()
        self.open_units.remove(unit)
        self.finished.append(UnitResult(unit.task.unit.index, final, self.watch.take()))


def _frame(
    encoded: list[np.ndarray],
    ends_doc: list[bool],
    opens_doc: bool,
    bos: np.ndarray | None,
    eos: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A batch's tokens (uint32, as the engine gave them: the caller checks them before they are narrowed to
    the cache's dtype) with BOS before each document begun and EOS after each document completed; the
    completed documents' end offsets; and every piece's end offset (BOS and EOS included).

    A document cut into pieces gets one BOS, before its first piece: a piece begins a document when it is
    the batch's first and ``opens_doc``, or when the piece before it ends one.
    """
    parts: list[np.ndarray] = []
    lengths = np.empty(len(encoded), dtype=np.int64)
    opens = opens_doc
    for i, (ids, ends) in enumerate(zip(encoded, ends_doc)):
        n = len(ids)
        if opens and bos is not None:
            parts.append(bos)
            n += 1
        parts.append(ids)
        if ends and eos is not None:
            parts.append(eos)
            n += 1
        lengths[i] = n
        opens = ends
    tokens = np.concatenate(parts, dtype=np.uint32)
    piece_ends = np.cumsum(lengths)
    return tokens, piece_ends[np.asarray(ends_doc)], piece_ends


def _loss_mask(batch: _Batch, piece_ends: np.ndarray, bos: bool, eos: bool) -> np.ndarray:
    """The loss mask of a framed SFT batch: each piece's tokens as its segment says, a BOS 0, an EOS 1."""
    assert batch.targets is not None, "SFT batches only"
    lengths = np.diff(piece_ends, prepend=0)
    mask = np.repeat(np.asarray(batch.targets, dtype=np.uint8), lengths)
    ends = np.asarray(batch.ends_doc, dtype=bool)
    if bos:
        opens = np.concatenate([[batch.opens_doc], ends[:-1]])
        mask[(piece_ends - lengths)[opens]] = 0
    if eos:
        mask[piece_ends[ends] - 1] = 1
    return mask


def _encode_with_templates(tokenizer: Tokenizer, texts: list[str], templated: list[bool]) -> list[np.ndarray]:
    """Encode a batch whose chat-template pieces parse special-token strings and whose others do not."""
    plain = iter(tokenizer.encode_batch([t for t, special in zip(texts, templated) if not special]))
    special = iter(tokenizer.encode_specials([t for t, special in zip(texts, templated) if special]))
    return [next(special) if is_template else next(plain) for is_template in templated]


class _Mismatch(Exception):
    """An engine's ids differ from the reference engine's for a piece (raised on an encoding thread)."""

    def __init__(self, record: int, engine: list[int], reference: list[int], piece: str) -> None:
        super().__init__(record)
        self.record, self.engine, self.reference, self.piece = record, engine, reference, piece


# A batch's ids per piece, and the seconds its encoder thread spent encoding and verifying them.
_Encoded = tuple[list[np.ndarray], float, float]


def _encode_and_check(
    encode: Callable[[], list[np.ndarray]],
    tokenizer: Tokenizer,
    texts: list[str],
    checks: list[tuple[int, int]],
) -> _Encoded:
    """A batch's ids, ``encode()``, once its sampled pieces (``checks``) have the reference engine's ids;
    else raises :class:`_Mismatch`."""
    started = time.perf_counter()
    ids = encode()
    encoded = time.perf_counter()
    if checks:
        reference = tokenizer.reference_engine().encode_batch([texts[i] for i, _ in checks])
        for (piece, record), expected in zip(checks, reference):
            if not np.array_equal(ids[piece], expected):
                raise _Mismatch(record, ids[piece].tolist(), expected.tolist(), texts[piece])
    return ids, encoded - started, time.perf_counter() - encoded if checks else 0.0


def _id_error(
    unit: _OpenUnit, batch: _Batch, tokens: np.ndarray, piece_ends: np.ndarray, top: int
) -> TokenizerError:
    """The error naming the record whose tokens hold an id at or above the cache's vocab size."""
    piece = int(np.searchsorted(piece_ends, int(np.argmax(tokens)), side="right"))
    tokenizer = unit.tokenizer
    engine, reference = tokenizer.engine.name, tokenizer.reference_engine().name
    if engine != reference:
        todo = (
            f"Rebuild with tokenizer_engine='{reference}' (overwrite=True), and report the tokenizer: "
            f"streampack chose {engine} as exact for it"
        )
    else:
        todo = (
            "The tokenizer's own library gave an id outside the vocabulary it reports: report the tokenizer"
        )
    return TokenizerError(
        f"{record_location(unit.task.unit, unit.spec.read, batch.records[piece])}: the {engine} engine gave "
        f"token id {top}, not below the vocab size {unit.id_limit:,} of this cache (tokenizer "
        f"{tokenizer.spec!r}). The build stopped before writing the batch; the cache keeps only what was "
        f"committed before it. {todo}"
    )


def _mismatch_error(unit: _OpenUnit, mismatch: _Mismatch) -> TokenizerError:
    """The error naming the record whose ids the engine got wrong, and where they first differ."""
    engine, reference = mismatch.engine, mismatch.reference
    shorter = min(len(engine), len(reference))
    at = next((i for i, (a, b) in enumerate(zip(engine, reference)) if a != b), shorter)
    tokenizer = unit.tokenizer
    got, expected = engine[at : at + 5], reference[at : at + 5]
    return TokenizerError(
        f"{record_location(unit.task.unit, unit.spec.read, mismatch.record)}: the {tokenizer.engine.name} "
        f"engine's token ids differ from the reference engine's ({tokenizer.reference_engine().name}) for "
        f"tokenizer {tokenizer.spec!r}, from token {at} on ({got} vs {expected}, "
        f"text {mismatch.piece[:60]!r}...). The build stopped; its committed part may hold such ids: rebuild "
        f"with overwrite=True and tokenizer_engine='{tokenizer.reference_engine().name}', and report the text"
    )


def record_location(unit: WorkUnit, read: ReadOptions, record: int) -> str:
    """Where record ``record`` of ``unit`` is: ``path:line``, ``path row N``, or a whole file's path.

    Reads the unit's inputs up to the record for a run of small files; meant for error messages.
    """
    file = unit.file
    if file is None:
        return f"python:{type(unit.items).__name__} row {records_before(unit) + record}"
    if unit.rest:  # a run of whole files: find the file holding the record
        for one in unit.files:
            count = sum(1 for _ in read_unit(WorkUnit(unit.index, one), read))
            if record < count:
                return record_location(WorkUnit(unit.index, one), read, record)
            record -= count
        return unit.describe()
    if file.format == "parquet":
        return f"{file.path} row {records_before(unit) + record}"
    if file.format == "text" and not read.split_lines:
        return file.path
    return f"{file.path}:{records_before(unit) + record + 1}"

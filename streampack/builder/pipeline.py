"""Work units' pipeline: records -> pieces -> batches -> tokens -> shards, with commits.

Every engine runs :func:`run_units` on a sequence of :class:`UnitTask`. The units stream their records in
order through one pipeline: long documents (and each segment of an SFT document) are cut into pieces, the
pieces grouped into batches of about ``batch_chars`` characters, the batches encoded on helper threads and
their tokens (and an SFT build's loss mask) appended to their unit's shard in input order, committing every
``commit_bytes`` or ``commit_seconds``. The next unit starts reading while the last batches of the one
before it still encode, so the cores never wait at a unit's end.

What a unit's worker is given and gives back is in :mod:`~streampack.builder.tasks`; a unit's open shard and
the counts its commits record in :mod:`~streampack.builder.commits`; encoding a batch and framing its ids
into the cache's tokens in :mod:`~streampack.builder.framing`; the thread that writes them in
:mod:`~streampack.builder.writerthread`. Their names still import from here.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from functools import partial
from pathlib import Path
from types import TracebackType

import numpy as np

from streampack.builder.commits import OpenUnit, Tally
from streampack.builder.framing import (
    Batch,
    Encoded,
    Mismatch,
    OutOfVocabulary,
    encode_and_frame,
    encode_with_templates,
)
from streampack.builder.options import OnBadRecord as OnBadRecord
from streampack.builder.options import VerifyTokens
from streampack.builder.tasks import NO_BOS as NO_BOS
from streampack.builder.tasks import TokenizerRef as TokenizerRef
from streampack.builder.tasks import UnitResult, UnitTask, worker_tokenizer
from streampack.builder.tasks import UnitSpec as UnitSpec
from streampack.builder.tasks import init_worker as init_worker
from streampack.builder.timings import Stopwatch, add_up
from streampack.builder.writer import ShardWriter as ShardWriter
from streampack.builder.writerthread import Framed, WriterThread
from streampack.errors import BadRecordError, StreampackError, TokenizerError, WriteError
from streampack.format.ledger import Counts as Counts
from streampack.format.ledger import LedgerEntry
from streampack.format.names import shard_name
from streampack.inputs.records import Position as Position
from streampack.inputs.records import TextStream
from streampack.inputs.sft import Sft
from streampack.inputs.units import read_unit, record_location
from streampack.store.files import read_entry
from streampack.tokenizer.base import Tokenizer
from streampack.tokenizer.choices import SpecialTokens as SpecialTokens
from streampack.tokenizer.choices import TokenizerEngine as TokenizerEngine
from streampack.tokenizer.engines import FASTOKENS_CALLS, FlatIds
from streampack.tokenizer.load import load_tokenizer as load_tokenizer
from streampack.tokenizer.pieces import CutCount
from streampack.tokenizer.pieces import PieceRule as PieceRule
from streampack.tokenizer.specials import BosPolicy as BosPolicy
from streampack.tokenizer.specials import EosPolicy as EosPolicy

ProgressFn = Callable[[dict[str, int]], None]

_NOTHING = Encoded(np.zeros(0, dtype=np.uint32), np.zeros(0, dtype=np.uint64), None)  # an empty last batch


# Batches encoded at once, each on a helper thread of its own: while one batch ends on a long document that
# holds a single tokenizer thread, the other keeps the remaining cores busy. The fast engine divides its
# threads among these calls (streampack.tokenizer.engines.fastokens_call_threads).
ENCODING_THREADS = FASTOKENS_CALLS
# Batches submitted and not yet written: the encoder threads' next work, ready while the reader is busy, and
# batches that wait for one before them that still encodes (a long document). A batch holds ~1 MiB of text
# until it is encoded, then only its token arrays, a few bytes per token.
MAX_QUEUED_BATCHES = 32

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
            progress = read_entry(Path(task.spec.root), name, task.unit.describe())
            if progress.done:
                yield UnitResult(task.unit.index, progress)
                continue
            pipeline.watch.measure_cpu(task.spec.profile)
            pipeline.watch.charge_start()
            if tokenizer is None:
                with pipeline.watch.timing("load tokenizer"):
                    tokenizer = worker_tokenizer(task.spec.tokenizer)
            pipeline.read(task, progress, tokenizer)
            yield from pipeline.take_finished()
        pipeline.drain()
        yield from pipeline.take_finished()


# ---------------------------------------------------------------------------------------------- pipeline


def verified(unit_index: int, record: int, mode: VerifyTokens) -> bool:
    """Whether record ``record`` of unit ``unit_index`` is re-encoded with the reference engine."""
    if mode != "sample":
        return mode == "all"
    if unit_index == 0 and record < VERIFY_FIRST:
        return True
    mixed = ((unit_index << 40) ^ record) * 0x9E3779B97F4A7C15  # Fibonacci hashing of the record's place
    return (mixed >> 32) & 0xFFFFFFFF < _VERIFY_BELOW


class _Pipeline:
    """Records -> pieces -> batches -> tokens -> shards, committing at document boundaries.

    This thread reads and parses records, cuts them into pieces and groups the pieces into batches; the
    batches encode, and their ids are framed, on ``ENCODING_THREADS`` helper threads (tokenizers release
    the GIL while they encode); this thread hands them in input order to a writer thread
    (:mod:`~streampack.builder.writerthread`), which appends and commits them. Batches that finish while
    an earlier one still encodes wait in the queue; the reader blocks only when ``MAX_QUEUED_BATCHES`` are
    queued, when more than ``ENCODING_THREADS`` are ready to encode, or when the writer is that far behind.
    A commit records the records and tokens of the batches written so far: the pipeline never drains to
    commit, nor to start the next unit.
    """

    unit: OpenUnit  # the unit being read
    tally: Tally  # its records read so far (of documents complete), and what they held

    def __init__(self, report: ProgressFn) -> None:
        self.report = report
        self.queue: deque[Batch] = deque()
        self.open_units: list[OpenUnit] = []
        self.encoder = ThreadPoolExecutor(ENCODING_THREADS, thread_name_prefix="streampack-encode")
        self.writer = WriterThread(MAX_QUEUED_BATCHES)
        self.watch = Stopwatch()
        self._start_batch()

    def __enter__(self) -> _Pipeline:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.encoder.shutdown(wait=True, cancel_futures=True)
        self.writer.stop()
        for unit in self.open_units:  # units cut short by an error keep only what they committed
            unit.writer.close()

    def read(self, task: UnitTask, progress: LedgerEntry, tokenizer: Tokenizer) -> None:
        """Read all of a unit's records into batches; its last batches may still encode on return."""
        unit = OpenUnit(task, progress, tokenizer)
        self.open_units.append(unit)
        self.unit, self.tally = unit, Tally(*dataclasses.astuple(progress.counts))
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
        with self.watch.timing("wait"):
            self.writer.drain()

    def take_finished(self) -> list[UnitResult]:
        """The results of the units completed since the last call, with this thread's timings since then."""
        finished = self.writer.take_finished()
        if not finished:
            return []
        done = {r.unit_index for r in finished}
        self.open_units = [u for u in self.open_units if u.task.unit.index not in done]
        first = finished[0]
        finished[0] = UnitResult(first.unit_index, first.entry, add_up([first.timings, self.watch.take()]))
        return finished

    def _start_batch(self) -> None:
        self.texts: list[str] = []
        self.ends_doc: list[bool] = []
        self.opens_doc = True  # until a document's pieces are flushed partway
        self.batch_chars = 0
        self.targets: list[bool] = []  # SFT builds only: per piece, as in Batch
        self.templated: list[bool] = []  # SFT builds only: per piece, written by a chat template
        self.checks: list[tuple[int, int]] = []  # as in Batch
        self.records: list[int] = []  # as in Batch

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
        """Submit the current batch for encoding; hand the batches that are encoded to the writer."""
        if not self.texts and not last:
            return
        tokenizer = self.unit.tokenizer
        encode: Callable[[], FlatIds] = partial(tokenizer.encode_flat, self.texts)
        if any(self.templated):
            encode = partial(encode_with_templates, tokenizer, self.texts, self.templated)
        targets = self.targets if self.unit.spec.read.sft else None
        batch = Batch(
            self.unit,
            Future(),
            self.ends_doc,
            self.opens_doc,
            targets,
            self.checks,
            self.records,
            self.tally.counts(),
            last,
        )
        if self.texts:
            batch.encoded = self.encoder.submit(encode_and_frame, encode, self.texts, batch)
        else:
            batch.encoded.set_result(_NOTHING)
        self.queue.append(batch)
        self._start_batch()
        self._write_encoded()
        while len(self.queue) >= MAX_QUEUED_BATCHES or self._encoding() > ENCODING_THREADS:
            with self.watch.timing("wait"):
                wait([b.encoded for b in self.queue if not b.encoded.done()], return_when=FIRST_COMPLETED)
            self._write_encoded()

    def _encoding(self) -> int:
        return sum(not b.encoded.done() for b in self.queue)

    def _write_encoded(self) -> None:
        """Write the batches at the head of the queue that are encoded."""
        while self.queue and self.queue[0].encoded.done():
            self._write(self.queue.popleft())

    def _write(self, batch: Batch) -> None:
        unit, watch = batch.unit, self.watch
        try:
            with watch.timing("wait"):
                encoded = batch.encoded.result()
        except Mismatch as e:
            raise _mismatch_error(unit, e) from None
        except OutOfVocabulary as e:
            raise _id_error(unit, batch, e) from None
        watch.add("encode", encoded.encode_seconds)
        if encoded.verify_seconds:
            watch.add("verify", encoded.verify_seconds)
        watch.add("frame", encoded.frame_seconds)
        tokens = encoded.tokens
        if len(tokens):
            event = {"unit": unit.task.unit.index, "docs": len(encoded.doc_ends), "tokens": len(tokens)}
            self.report({**event, "bytes": unit.bytes_read_delta()})
        unit.tokens += len(tokens)
        framed = Framed(
            unit, tokens, encoded.doc_ends, encoded.mask, batch.counts, self._commits(unit), batch.last
        )
        with watch.timing("wait"):
            self.writer.put(framed)

    def _commits(self, unit: OpenUnit) -> bool:
        """Whether the unit commits after its tokens so far: ``commit_bytes`` or ``commit_seconds`` on."""
        started, tokens = unit.last_commit
        new_bytes = (unit.tokens - tokens) * unit.writer.dtype.itemsize
        if new_bytes < unit.spec.commit_bytes and time.monotonic() - started < unit.spec.commit_seconds:
            return False
        unit.last_commit = (time.monotonic(), unit.tokens)
        return True


def _id_error(unit: OpenUnit, batch: Batch, error: OutOfVocabulary) -> TokenizerError:
    """The error naming the record whose tokens hold an id at or above the cache's vocab size."""
    top, piece = error.top, error.piece
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


def _mismatch_error(unit: OpenUnit, mismatch: Mismatch) -> TokenizerError:
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

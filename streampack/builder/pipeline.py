"""Work units' pipeline: records -> blocks -> tokens -> shards, with commits.

This thread reads each unit's records; helper threads parse, cut, encode and frame them in blocks
(:mod:`~streampack.builder.blocks`); a writer thread appends the blocks' tokens to their shard in input order
(:mod:`~streampack.builder.writer`), committing every ``commit_bytes`` or ``commit_seconds``. The next
unit starts reading while the last blocks of the one before it still encode, so the cores never wait.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from streampack.builder.blocks import (
    NO_ENDS,
    NO_TOKENS,
    Block,
    EncodedBlock,
    Mismatch,
    OutOfVocabulary,
    encode_block,
    long_record_blocks,
    stream_blocks,
)
from streampack.builder.tasks import UnitResult, UnitTask, steady_allocator, worker_tokenizer
from streampack.builder.timings import Stopwatch, add_up
from streampack.builder.writer import Framed, OpenUnit, WriterThread
from streampack.errors import StreampackError, TokenizerError, WriteError
from streampack.format.ledger import LedgerEntry
from streampack.format.names import shard_name
from streampack.inputs.parts import Part, StreamPart
from streampack.inputs.units import read_unit_parts, record_location
from streampack.store.files import read_entry
from streampack.tokenizer.base import Tokenizer
from streampack.tokenizer.engines import FASTOKENS_CALLS

ProgressFn = Callable[[dict[str, int]], None]

_NOTHING = EncodedBlock(NO_TOKENS, NO_ENDS, None)

# Blocks encoded at once: while one thread parses its block (holding the GIL), the other runs the engine
# (which lets go of it). The fast engine divides its threads among these calls.
ENCODING_THREADS = FASTOKENS_CALLS
# Blocks handed over and not yet written: ~1 MiB of input each until encoded, then only its tokens.
MAX_QUEUED_BLOCKS = 32
# Blocks handed over and not yet encoded: the reader waits for the GIL after each read, so the encoder
# threads keep a few blocks in hand.
READ_AHEAD = 4 * ENCODING_THREADS


def run_units(
    tasks: Iterable[UnitTask], report: ProgressFn, tokenizer: Tokenizer | None = None
) -> Iterator[UnitResult]:
    """Build (or finish building) the shards of ``tasks`` in order, yielding each unit's result when done.

    Units an earlier run finished are yielded without reading their input. ``tokenizer`` is the build's
    own (units run in the coordinating process); worker processes load theirs.
    """
    steady_allocator()
    pipeline = _Pipeline(report)
    try:
        for task in tasks:
            name = shard_name(task.unit.index)
            progress = read_entry(Path(task.spec.root), name, task.unit.describe())
            if progress.done:
                yield UnitResult(task.unit.index, progress)
                continue
            pipeline.watch.measure_cpu(task.spec.run.profile)
            pipeline.watch.charge_start()
            if tokenizer is None:
                with pipeline.watch.timing("load tokenizer"):
                    tokenizer = worker_tokenizer(task.spec.tokenizer)
            pipeline.read(task, progress, tokenizer)
            yield from pipeline.take_finished()
        pipeline.drain()
        yield from pipeline.take_finished()
    finally:
        pipeline.close()


@dataclass
class _Queued:
    """A block handed to an encoder thread, in input order."""

    unit: OpenUnit
    encoded: Future[EncodedBlock]
    last: bool


class _Pipeline:
    """Records -> blocks -> tokens -> shards, committing at document boundaries without draining.

    The reader waits only when ``MAX_QUEUED_BLOCKS`` are queued, when more than ``READ_AHEAD`` are not yet
    encoded, or when the writer is that far behind.
    """

    def __init__(self, report: ProgressFn) -> None:
        self.report = report
        self.queue: deque[_Queued] = deque()
        self.open_units: list[OpenUnit] = []
        self.encoder = ThreadPoolExecutor(ENCODING_THREADS, thread_name_prefix="streampack-encode")
        self.writer = WriterThread(MAX_QUEUED_BLOCKS)
        self.watch = Stopwatch()
        self.failed = False  # a block's error was raised, after what came before it was committed

    def close(self) -> None:
        """Stop the threads; units cut short by an error keep only what they committed."""
        self.encoder.shutdown(wait=True, cancel_futures=True)
        self.writer.stop()
        for unit in self.open_units:
            unit.writer.close()

    def read(self, task: UnitTask, progress: LedgerEntry, tokenizer: Tokenizer) -> None:
        """Read all of a unit's records into blocks; its last blocks may still encode on return."""
        unit = OpenUnit(task, progress, tokenizer)
        self.open_units.append(unit)
        size, record = task.spec.run.batch_chars, unit.counts.records
        parts = read_unit_parts(task.unit, task.spec.read, skip=record, position=unit.position, size=size)
        held = _Held(unit)
        outside = self.watch.switch("blocks")  # the loop's own work; reading and handing over switch away
        try:
            for part in self.watch.timed(parts, "read"):
                if isinstance(part, StreamPart) or (part.records == 1 and part.size > size):
                    self._hand_over(held.block())
                    record = held.next_record
                    if isinstance(part, StreamPart):
                        blocks = stream_blocks(unit, record, part.stream)
                    else:
                        blocks = long_record_blocks(unit, record, part)
                    for block in blocks:
                        self._hand_over(block)
                    held.skip_over(part)
                elif held.add(part) >= size:
                    self._hand_over(held.block())
            self._hand_over(held.block())
            self._hand_over(Block(unit, held.next_record, last=True))
        except (WriteError, TokenizerError):
            raise  # the disk state past the last commit is unknown, or its ids are wrong: write nothing more
        except StreampackError:  # an input that cannot be read: keep everything read before it
            if not self.failed:
                self.drain()
                unit.writer.commit(unit.counts)
            raise
        self.watch.switch(outside)

    def drain(self) -> None:
        """Encode and write everything read so far."""
        while self.queue:
            self._write(self.queue.popleft())  # waits for the block to be encoded
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

    def _hand_over(self, block: Block | None) -> None:
        """Submit a block for encoding; hand the blocks that are encoded to the writer."""
        if block is None:
            return
        encoded: Future[EncodedBlock]
        if block.parts or block.pieces is not None:
            encoded = self.encoder.submit(encode_block, block)
        else:
            encoded = Future()
            encoded.set_result(_NOTHING)
        self.queue.append(_Queued(block.unit, encoded, block.last))
        self._write_encoded()
        while (
            len(self.queue) >= MAX_QUEUED_BLOCKS or sum(not q.encoded.done() for q in self.queue) > READ_AHEAD
        ):
            with self.watch.timing("wait"):
                wait([q.encoded for q in self.queue if not q.encoded.done()], return_when=FIRST_COMPLETED)
            self._write_encoded()

    def _write_encoded(self) -> None:
        """Write the blocks at the head of the queue that are encoded."""
        while self.queue and self.queue[0].encoded.done():
            self._write(self.queue.popleft())

    def _write(self, queued: _Queued) -> None:
        unit, watch = queued.unit, self.watch
        try:
            with watch.timing("wait"):
                encoded = queued.encoded.result()
        except Mismatch as e:
            raise _mismatch_error(unit, e) from None
        except OutOfVocabulary as e:
            raise _id_error(unit, e) from None
        except StreampackError:  # the block's records cannot be read: keep every block before it
            self._stop(unit, commit=True)
            raise
        for name, seconds in zip(("parse", "encode", "verify", "frame"), encoded.seconds):
            if seconds:
                watch.add(name, seconds)
        tokens = encoded.tokens
        if len(tokens):
            event = {"unit": unit.task.unit.index, "docs": len(encoded.doc_ends), "tokens": len(tokens)}
            self.report({**event, "bytes": unit.bytes_read_delta()})
        unit.tokens += len(tokens)
        unit.add(encoded.counts)
        commit = unit.commit_due() or encoded.error is not None
        framed = Framed(unit, tokens, encoded.doc_ends, encoded.mask, unit.counts, commit, queued.last)
        with watch.timing("wait"):
            self.writer.put(framed)
        if encoded.error is not None:  # a bad record stops the build: keep every record before it
            self._stop(unit, commit=False)
            raise encoded.error

    def _stop(self, unit: OpenUnit, *, commit: bool) -> None:
        """Stop after a block that failed: what came before it written (and with ``commit``, committed)."""
        self.failed = True
        self.writer.drain()
        if commit:
            unit.writer.commit(unit.counts)


class _Held:
    """The parts read and not yet handed over as a block, and the index of the record after them."""

    def __init__(self, unit: OpenUnit) -> None:
        self.unit = unit
        self.parts: list[Part] = []
        self.size = 0
        self.next_record = unit.counts.records

    def add(self, part: Part) -> int:
        """Hold ``part``; the size held."""
        self.parts.append(part)
        self.size += part.size
        self.next_record += part.records
        return self.size

    def skip_over(self, part: Part) -> None:
        """Count ``part``'s records, handed over otherwise (a streamed document)."""
        self.next_record += part.records

    def block(self) -> Block | None:
        """The parts held as a block (none if none is held); nothing is held after."""
        if not self.parts:
            return None
        held = tuple(self.parts)
        first = self.next_record - sum(p.records for p in held)
        self.parts, self.size = [], 0
        return Block(self.unit, first, held)


def _id_error(unit: OpenUnit, error: OutOfVocabulary) -> TokenizerError:
    """The error naming the record whose tokens hold an id at or above the cache's vocab size."""
    top = error.top
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
        f"{record_location(unit.task.unit, unit.spec.read, error.record)}: the {engine} engine gave "
        f"token id {top}, not below the vocab size {unit.id_limit:,} of this cache (tokenizer "
        f"{tokenizer.spec!r}). The build stopped before writing the block; the cache keeps only what was "
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

"""A block: one encoder thread's work, from about ``batch_chars`` of records as read to the cache's tokens.

An encoder thread parses a block's records, cuts them into pieces, encodes, checks and frames them; parsing
holds the GIL and encoding lets go of it, so parsing runs on as many cores as encoding does. A streamed
document, or one record longer than a block, is cut on the reading thread into blocks of pieces, so that
both encoder threads share it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from streampack.builder.framing import Batch, Encoded, encode_and_frame
from streampack.builder.options import VerifyTokens
from streampack.builder.writer import OpenUnit
from streampack.errors import BadRecordError
from streampack.format.ledger import Counts
from streampack.inputs.parts import ItemsPart, Part
from streampack.inputs.records import Item, TextStream, makes_document
from streampack.inputs.sft import Sft
from streampack.tokenizer.pieces import CutCount

# verify_tokens="sample" re-encodes unit 0's first VERIFY_FIRST records and a VERIFY_RATE share of every
# unit's, chosen by a hash of (unit, record): the same records for any number of workers. The reference
# engine is 20-40x slower than fastokens: 20 records and 0.1 % are ~0.7 MB of a 345 MB build.
VERIFY_FIRST = 20
VERIFY_RATE = 0.001
_VERIFY_BELOW = round(VERIFY_RATE * (1 << 32))

_NO_COUNTS = Counts()


def verified(unit_index: int, record: int, mode: VerifyTokens) -> bool:
    """Whether record ``record`` of unit ``unit_index`` is re-encoded with the reference engine."""
    if mode != "sample":
        return mode == "all"
    if unit_index == 0 and record < VERIFY_FIRST:
        return True
    mixed = ((unit_index << 40) ^ record) * 0x9E3779B97F4A7C15  # Fibonacci hashing of the record's place
    return (mixed >> 32) & 0xFFFFFFFF < _VERIFY_BELOW


@dataclass(frozen=True)
class Block:
    """Consecutive records of a unit to encode as one call's work, or pieces of one streamed document."""

    unit: OpenUnit
    first_record: int  # the unit's index of its first record
    parts: tuple[Part, ...] = ()
    pieces: Batch | None = None  # a long or streamed document's pieces, cut on the reading thread
    counts: Counts = _NO_COUNTS  # with ``pieces``: what they count (records: 1 at the document's end)
    last: bool = False  # the unit's last block (possibly empty): writing it completes the unit

    @staticmethod
    def of_pieces(unit: OpenUnit, record: int, pieces: Batch, ends: bool, inexact_cuts: int) -> Block:
        """A block of pieces of record ``record``, a long or streamed document; ``ends``: its last ones."""
        return Block(unit, record, pieces=pieces, counts=Counts(int(ends), 0, 0, inexact_cuts))


@dataclass(frozen=True)
class EncodedBlock:
    """A block's tokens as the cache stores them, what its records counted, and its encoder's seconds."""

    tokens: np.ndarray  # in the cache's dtype, BOS and EOS included
    doc_ends: np.ndarray  # the completed documents' ends, relative to the first token
    mask: np.ndarray | None  # SFT builds: the loss mask
    counts: Counts  # the block's own: its records consumed (up to ``error``), and what they held
    error: BadRecordError | None = None  # a bad record that stops the build (on_bad_record="error")
    seconds: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # parse, encode, verify, frame


def encode_block(block: Block) -> EncodedBlock:
    """Parse, cut, encode, check and frame a block (on an encoder thread)."""
    unit = block.unit
    if block.pieces is not None:
        encoded = [encode_and_frame(unit, block.pieces)]
        return _joined(encoded, block.counts, None, parse_seconds=0.0)
    started = time.perf_counter()
    cutter = _Cutter(unit, block.first_record)
    encoded = []
    for batch in cutter.batches(block.parts):
        encoded.append(encode_and_frame(unit, batch))
    busy = sum(e.encode_seconds + e.verify_seconds + e.frame_seconds for e in encoded)
    parse_seconds = time.perf_counter() - started - busy
    return _joined(encoded, cutter.counts(), cutter.error, parse_seconds)


def stream_blocks(unit: OpenUnit, record: int, stream: TextStream) -> Iterator[Block]:
    """The blocks of a streamed document (record ``record``): its pieces, cut here as its chunks are read."""
    cuts = CutCount()
    return _document_blocks(unit, record, unit.spec.pieces.stream(stream, cuts), cuts)


def long_record_blocks(unit: OpenUnit, record: int, part: Part) -> Iterator[Block]:
    """The blocks of a part holding one long record: a document's pieces cut here into blocks of about
    ``batch_chars``, so that both encoder threads share them; any other item a block of its own."""
    (item,) = part.items()
    if isinstance(item, str) and makes_document(item):
        cuts = CutCount()
        yield from _document_blocks(unit, record, unit.spec.pieces.split(item, cuts), cuts)
    else:
        yield Block(unit, record, (ItemsPart((item,), 0),))


def _document_blocks(unit: OpenUnit, record: int, pieces: Iterable[str], cuts: CutCount) -> Iterator[Block]:
    """One document's pieces in blocks of about ``batch_chars``; ``cuts`` counts the memory cuts made."""
    spec = unit.spec
    checked = spec.verify != "none" and verified(unit.task.unit.index, record, spec.verify)
    batch = Batch()
    for piece in pieces:
        if batch.chars >= spec.batch_chars:
            yield Block.of_pieces(unit, record, batch, ends=False, inexact_cuts=0)
            batch = Batch(opens_doc=False)
        batch.add(piece, record, checked)
    batch.ends_doc[-1] = True
    yield Block.of_pieces(unit, record, batch, ends=True, inexact_cuts=cuts.inexact)


class _Cutter:
    """A block's records cut into batches of pieces of about ``batch_chars``, and what they counted."""

    def __init__(self, unit: OpenUnit, first_record: int) -> None:
        self.unit, self.spec = unit, unit.spec
        self.record = first_record  # the record being cut
        self.first_record = first_record
        self.skipped = self.empty_docs = 0
        self.cuts = CutCount()
        self.error: BadRecordError | None = None
        self.batch = Batch()

    def counts(self) -> Counts:
        """The records cut (up to a bad record the build stops on), and what they held."""
        records = self.record - self.first_record
        return Counts(records, self.skipped, self.empty_docs, self.cuts.inexact)

    def batches(self, parts: tuple[Part, ...]) -> Iterator[Batch]:
        """The batches of pieces of the parts' records, each made as the one before it is encoded."""
        for part in parts:
            for item in part.items():
                if isinstance(item, BadRecordError):
                    if self.spec.on_bad_record == "error":
                        self.error = item
                        break
                    self.skipped += 1
                elif makes_document(item):
                    yield from self._add(item)
                elif item is not None:  # (None: a blank line)
                    self.empty_docs += 1  # no document is empty or only whitespace
                self.record += 1
            if self.error is not None:
                break
        if self.batch.texts:
            yield self.batch

    def _add(self, item: Item) -> Iterator[Batch]:
        """Cut a document into pieces; a batch whenever one is full."""
        if isinstance(item, tuple):
            yield from self._add_segments(item)
            return
        assert isinstance(item, str), "a streamed document is cut on the reading thread"
        checked = self._checked()
        for i, piece in enumerate(self.spec.pieces.split(item, self.cuts)):
            if self.batch.chars >= self.spec.batch_chars:
                yield self.batch  # mid-document: its counts start with the next batch
                self.batch = Batch(opens_doc=i == 0)
            self.batch.add(piece, self.record, checked)
        self.batch.ends_doc[-1] = True

    def _add_segments(self, segments: Sft) -> Iterator[Batch]:
        """An SFT document: each segment cut into pieces of its own, each piece a target or not."""
        checked, first = self._checked(), True
        split, batch_chars = self.spec.pieces.split, self.spec.batch_chars
        texts, targets, templates = zip(*segments)
        lengths = list(map(len, texts))
        whole = all(lengths) and max(lengths) <= self.spec.pieces.whole_chars
        if whole and self.batch.chars + sum(lengths) - lengths[-1] < batch_chars:
            # each segment one piece, none of them starting a new batch: as the loop below, at once
            self.batch.add_sft_document(texts, self.record, checked, targets, templates)
            return
        for text, target, template in segments:
            for piece in split(text, self.cuts) if text else ():
                if self.batch.chars >= batch_chars:
                    yield self.batch
                    self.batch = Batch(opens_doc=first)
                # a template's pieces are the reference's own
                self.batch.add_sft(piece, self.record, checked and not template, target, template)
                first = False
        self.batch.ends_doc[-1] = True

    def _checked(self) -> bool:
        verify = self.spec.verify
        return verify != "none" and verified(self.unit.task.unit.index, self.record, verify)


def _joined(
    encoded: list[Encoded], counts: Counts, error: BadRecordError | None, parse_seconds: float
) -> EncodedBlock:
    """One block's tokens from its batches' (most blocks have one batch)."""
    seconds = (
        parse_seconds,
        sum(e.encode_seconds for e in encoded),
        sum(e.verify_seconds for e in encoded),
        sum(e.frame_seconds for e in encoded),
    )
    if not encoded:
        return EncodedBlock(_NO_TOKENS, _NO_ENDS, None, counts, error, seconds)
    if len(encoded) == 1:
        (one,) = encoded
        return EncodedBlock(one.tokens, one.doc_ends, one.mask, counts, error, seconds)
    starts = np.cumsum([0] + [len(e.tokens) for e in encoded[:-1]])
    tokens = np.concatenate([e.tokens for e in encoded])
    doc_ends = np.concatenate([e.doc_ends + start for e, start in zip(encoded, starts)])
    masks = [e.mask for e in encoded if e.mask is not None]
    mask = np.concatenate(masks) if masks else None
    return EncodedBlock(tokens, doc_ends, mask, counts, error, seconds)


_NO_TOKENS = np.zeros(0, dtype=np.uint32)
_NO_ENDS = np.zeros(0, dtype=np.uint64)

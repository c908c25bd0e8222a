"""A block: one encoder thread's work, from about ``batch_chars`` of records as read to the cache's tokens.

An encoder thread parses a block's records, cuts them into batches of pieces, encodes each batch in one
call, checks it (sampled pieces against the reference engine, every id against the vocab size) and frames
it into the cache's tokens: BOS/EOS, document ends, an SFT loss mask. Parsing holds the GIL and encoding
lets go of it, so parsing runs on as many cores as encoding does. A streamed document, or one record longer
than a block, is cut on the reading thread into blocks of pieces, so that both encoder threads share it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from streampack.builder.options import VerifyTokens
from streampack.builder.writer import OpenUnit
from streampack.errors import BadRecordError
from streampack.format.ledger import Counts
from streampack.inputs.parts import ItemsPart, Part
from streampack.inputs.records import Item, TextStream, makes_document
from streampack.inputs.sft import Sft
from streampack.tokenizer.base import Tokenizer
from streampack.tokenizer.engines import FlatIds, joined
from streampack.tokenizer.pieces import CutCount

# verify_tokens="sample" re-encodes unit 0's first VERIFY_FIRST records and a VERIFY_RATE share of every
# unit's, chosen by a hash of (unit, record): the same records for any number of workers. The reference
# engine is 20-40x slower than fastokens: 20 records and 0.1 % are ~0.7 MB of a 345 MB build.
VERIFY_FIRST = 20
VERIFY_RATE = 0.001
_VERIFY_BELOW = round(VERIFY_RATE * (1 << 32))

_NO_COUNTS = Counts()
NO_TOKENS = np.zeros(0, dtype=np.uint32)
NO_ENDS = np.zeros(0, dtype=np.uint64)


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
    """A block's (or a batch's) tokens as the cache stores them, what its records counted, and its encoder's
    seconds."""

    tokens: np.ndarray  # in the cache's dtype, BOS and EOS included
    doc_ends: np.ndarray  # the completed documents' ends, relative to the first token
    mask: np.ndarray | None  # SFT builds: the loss mask
    counts: Counts = _NO_COUNTS  # the block's own: its records consumed (up to ``error``), and what they held
    error: BadRecordError | None = None  # a bad record that stops the build (on_bad_record="error")
    seconds: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)  # parse, encode, verify, frame


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
    busy = sum(sum(e.seconds) for e in encoded)
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
    run = unit.spec.run
    checked = verified(unit.task.unit.index, record, run.verify_tokens)
    batch = Batch()
    for piece in pieces:
        if batch.chars >= run.batch_chars:
            yield Block.of_pieces(unit, record, batch, ends=False, inexact_cuts=0)
            batch = Batch(opens_doc=False)
        batch.add(piece, record, checked)
    batch.ends_doc[-1] = True
    yield Block.of_pieces(unit, record, batch, ends=True, inexact_cuts=cuts.inexact)


class _Cutter:
    """A block's records cut into batches of pieces of about ``batch_chars``, and what they counted."""

    def __init__(self, unit: OpenUnit, first_record: int) -> None:
        self.unit, self.spec, self.run = unit, unit.spec, unit.spec.run
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
                    if self.run.on_bad_record == "error":
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
        checked = verified(self.unit.task.unit.index, self.record, self.run.verify_tokens)
        for i, piece in enumerate(self.spec.pieces.split(item, self.cuts)):
            if self.batch.chars >= self.run.batch_chars:
                yield self.batch  # mid-document: its counts start with the next batch
                self.batch = Batch(opens_doc=i == 0)
            self.batch.add(piece, self.record, checked)
        self.batch.ends_doc[-1] = True

    def _add_segments(self, segments: Sft) -> Iterator[Batch]:
        """An SFT document: each segment cut into pieces of its own, each piece a target or not."""
        checked, first = verified(self.unit.task.unit.index, self.record, self.run.verify_tokens), True
        split, batch_chars = self.spec.pieces.split, self.run.batch_chars
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


def _joined(
    encoded: list[EncodedBlock], counts: Counts, error: BadRecordError | None, parse_seconds: float
) -> EncodedBlock:
    """One block's tokens from its batches' (most blocks have one batch)."""
    seconds = (parse_seconds, *(sum(e.seconds[step] for e in encoded) for step in (1, 2, 3)))
    if not encoded:
        return EncodedBlock(NO_TOKENS, NO_ENDS, None, counts, error, seconds)
    if len(encoded) == 1:
        (one,) = encoded
        return EncodedBlock(one.tokens, one.doc_ends, one.mask, counts, error, seconds)
    starts = np.cumsum([0] + [len(e.tokens) for e in encoded[:-1]])
    tokens = np.concatenate([e.tokens for e in encoded])
    doc_ends = np.concatenate([e.doc_ends + start for e, start in zip(encoded, starts)])
    masks = [e.mask for e in encoded if e.mask is not None]
    mask = np.concatenate(masks) if masks else None
    return EncodedBlock(tokens, doc_ends, mask, counts, error, seconds)


@dataclass
class Batch:
    """Pieces to encode in one call, and per piece what framing its ids needs."""

    opens_doc: bool = True  # the first piece begins a document (a later one does when the one before ends)
    texts: list[str] = field(default_factory=list)
    ends_doc: list[bool] = field(default_factory=list)  # the piece is the last of its document
    records: list[int] = field(default_factory=list)  # the unit's record each piece is from (for errors)
    checks: list[tuple[int, int]] = field(default_factory=list)  # (piece, record) the reference re-encodes
    targets: list[bool] = field(default_factory=list)  # SFT builds only: the piece's tokens carry the loss
    templated: list[bool] = field(default_factory=list)  # SFT builds only: the piece is a chat template's
    chars: int = 0

    def add(self, piece: str, record: int, checked: bool) -> None:
        """Add a piece of record ``record`` (``checked``: the reference engine re-encodes it)."""
        if checked:
            self.checks.append((len(self.texts), record))
        self.texts.append(piece)
        self.ends_doc.append(False)
        self.records.append(record)
        self.chars += len(piece)

    def add_sft(self, piece: str, record: int, checked: bool, target: bool, template: bool) -> None:
        """:meth:`add` a piece of an SFT document: a target or not, a chat template's or not."""
        self.add(piece, record, checked)
        self.targets.append(target)
        self.templated.append(template)

    def add_sft_document(
        self,
        pieces: Sequence[str],
        record: int,
        checked: bool,
        targets: Sequence[bool],
        templates: Sequence[bool],
    ) -> None:
        """:meth:`add_sft` each of a whole SFT document's pieces, and end the document."""
        first = len(self.texts)
        if checked:  # a template's pieces are the reference's own
            self.checks.extend((first + i, record) for i, template in enumerate(templates) if not template)
        self.texts.extend(pieces)
        self.ends_doc.extend([False] * (len(pieces) - 1))
        self.ends_doc.append(True)
        self.records.extend([record] * len(pieces))
        self.chars += sum(map(len, pieces))
        self.targets.extend(targets)
        self.templated.extend(templates)


def frame(
    ids: FlatIds,
    ends_doc: list[bool],
    opens_doc: bool,
    bos: int | None,
    eos: int | None,
    dtype: np.dtype,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A batch's tokens in ``dtype`` with BOS and EOS around its documents; the completed documents' ends;
    and every piece's end (BOS and EOS included).

    A piece begins a document when it is the batch's first and ``opens_doc``, or when the one before it
    ends one.
    """
    flat, offsets = ids
    ends = np.asarray(ends_doc, dtype=bool)
    opens = np.concatenate([[opens_doc], ends[:-1]])
    added = np.zeros(len(ends), dtype=np.intp)  # per piece: its BOS and EOS
    order, where, values = [], [], []  # piece i's BOS sorts as 2i, its EOS as 2i + 1
    if eos is not None:
        added += ends
        (pieces,) = np.nonzero(ends)
        order.append(2 * pieces + 1)
        where.append(offsets[1:][pieces])
        values.append(np.full(len(pieces), eos, dtype=dtype))
    if bos is not None:
        added += opens
        (pieces,) = np.nonzero(opens)
        order.append(2 * pieces)
        where.append(offsets[:-1][pieces])
        values.append(np.full(len(pieces), bos, dtype=dtype))
    piece_ends = offsets[1:] + np.cumsum(added)
    if not where:
        return flat.astype(dtype), piece_ends[ends], piece_ends
    sort = np.argsort(np.concatenate(order))
    at, value = np.concatenate(where)[sort], np.concatenate(values)[sort]
    return _inserted(flat, at, value, dtype), piece_ends[ends], piece_ends


# Up to this many BOS/EOS ids a batch, one slice of the ids per run between them is joined (345 MB of GPT-2
# documents: ~130 a batch, 2.5x faster than np.insert's boolean mask); past it, np.insert is.
_JOINED_RUNS = 512


def _inserted(flat: np.ndarray, at: np.ndarray, values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``flat`` in ``dtype`` with ``values[j]`` before ``flat[at[j]]`` (``at`` sorted; ties in order)."""
    if len(at) > _JOINED_RUNS:
        return np.insert(flat.astype(dtype), at, values)
    parts: list[np.ndarray] = []
    start = 0
    for j, stop in enumerate(at.tolist()):
        parts.append(flat[start:stop])
        parts.append(values[j : j + 1])
        start = stop
    parts.append(flat[start:])
    return np.concatenate(parts, dtype=dtype, casting="unsafe")


def loss_mask(batch: Batch, piece_ends: np.ndarray, bos: bool, eos: bool) -> np.ndarray:
    """The loss mask of a framed SFT batch: each piece's tokens as its segment says, a BOS 0, an EOS 1."""
    lengths = np.diff(piece_ends, prepend=0)
    mask = np.repeat(np.asarray(batch.targets, dtype=np.uint8), lengths)
    ends = np.asarray(batch.ends_doc, dtype=bool)
    if bos:
        opens = np.concatenate([[batch.opens_doc], ends[:-1]])
        mask[(piece_ends - lengths)[opens]] = 0
    if eos:
        mask[piece_ends[ends] - 1] = 1
    return mask


def encode_with_templates(tokenizer: Tokenizer, texts: list[str], templated: list[bool]) -> FlatIds:
    """Encode a batch whose chat-template pieces parse special-token strings and whose others do not,
    interleaving the two kinds' ids back into the pieces' order."""
    is_template = np.array(templated, dtype=bool)
    plain, plain_offsets = tokenizer.encode_flat([t for t, special in zip(texts, templated) if not special])
    special, special_offsets = _recurring_ids(tokenizer, [t for t, s in zip(texts, templated) if s])
    lengths = np.empty(len(texts), dtype=np.intp)
    lengths[~is_template] = np.diff(plain_offsets)
    lengths[is_template] = np.diff(special_offsets)
    offsets = np.zeros(len(texts) + 1, dtype=np.intp)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.empty(offsets[-1], dtype=np.result_type(plain, special))
    token_is_template = np.repeat(is_template, lengths)
    ids[token_is_template] = special
    ids[~token_is_template] = plain
    return ids, offsets


def _recurring_ids(tokenizer: Tokenizer, texts: list[str]) -> FlatIds:
    """The ids of a chat template's pieces: its few distinct texts encoded once each, then gathered."""
    distinct = list(dict.fromkeys(texts))
    ids, offsets = joined(tokenizer.encode_specials(distinct))
    codes = np.fromiter(map({t: i for i, t in enumerate(distinct)}.__getitem__, texts), np.intp, len(texts))
    starts, lengths = offsets[codes], np.diff(offsets)[codes]
    gathered = np.zeros(len(texts) + 1, dtype=np.intp)
    np.cumsum(lengths, out=gathered[1:])
    return ids[np.arange(gathered[-1]) + np.repeat(starts - gathered[:-1], lengths)], gathered


class Mismatch(Exception):
    """An engine's ids differ from the reference engine's for a piece (raised on an encoding thread)."""

    def __init__(self, record: int, engine: list[int], reference: list[int], piece: str) -> None:
        super().__init__(record)
        self.record, self.engine, self.reference, self.piece = record, engine, reference, piece


class OutOfVocabulary(Exception):
    """An engine gave an id at or above the cache's vocab size (raised on an encoding thread)."""

    def __init__(self, top: int, record: int) -> None:
        super().__init__(top)
        self.top, self.record = top, record


def encode_and_frame(unit: OpenUnit, batch: Batch) -> EncodedBlock:
    """A batch's framed tokens; :class:`Mismatch` or :class:`OutOfVocabulary` when a check fails."""
    started = time.perf_counter()
    tokenizer, texts = unit.tokenizer, batch.texts
    if any(batch.templated):
        ids = encode_with_templates(tokenizer, texts, batch.templated)
    else:
        ids = tokenizer.encode_flat(texts)
    encoded = time.perf_counter()
    if batch.checks:
        _check(ids, texts, batch.checks, tokenizer)
    verified = time.perf_counter()
    flat, offsets = ids
    top = int(flat.max()) if len(flat) else 0
    if top >= unit.id_limit:
        piece = int(np.searchsorted(offsets, int(np.argmax(flat)), side="right")) - 1
        raise OutOfVocabulary(top, batch.records[piece])
    tokens, doc_ends, piece_ends = frame(ids, batch.ends_doc, batch.opens_doc, unit.bos, unit.eos, unit.dtype)
    mask = None
    if unit.spec.read.sft:
        mask = loss_mask(batch, piece_ends, unit.bos is not None, unit.eos is not None)
    seconds = (0.0, encoded - started, verified - encoded, time.perf_counter() - verified)
    return EncodedBlock(tokens, doc_ends, mask, seconds=seconds)


def _check(ids: FlatIds, texts: list[str], checks: list[tuple[int, int]], tokenizer: Tokenizer) -> None:
    """Raise :class:`Mismatch` unless each checked piece's ids are the reference engine's."""
    flat, offsets = ids
    reference = tokenizer.reference_engine().encode_batch([texts[i] for i, _ in checks])
    for (piece, record), expected in zip(checks, reference):
        got = flat[offsets[piece] : offsets[piece + 1]]
        if not np.array_equal(got, expected):
            raise Mismatch(record, got.tolist(), expected.tolist(), texts[piece])

"""A batch of pieces encoded in one call, checked (sampled pieces against the reference engine, every id
against the vocab size) and framed into the cache's tokens: BOS/EOS, document ends, an SFT loss mask."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from streampack.builder.writer import OpenUnit
from streampack.tokenizer.base import Tokenizer
from streampack.tokenizer.engines import FlatIds, joined


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


@dataclass(frozen=True)
class Encoded:
    """A batch's tokens as the cache stores them, and its encoder thread's seconds per step."""

    tokens: np.ndarray  # in the cache's dtype, BOS and EOS included
    doc_ends: np.ndarray  # the completed documents' ends, relative to the first token
    mask: np.ndarray | None  # SFT builds: the loss mask
    encode_seconds: float = 0.0
    verify_seconds: float = 0.0
    frame_seconds: float = 0.0


def encode_and_frame(unit: OpenUnit, batch: Batch) -> Encoded:
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
    return Encoded(
        tokens, doc_ends, mask, encoded - started, verified - encoded, time.perf_counter() - verified
    )


def _check(ids: FlatIds, texts: list[str], checks: list[tuple[int, int]], tokenizer: Tokenizer) -> None:
    """Raise :class:`Mismatch` unless each checked piece's ids are the reference engine's."""
    flat, offsets = ids
    reference = tokenizer.reference_engine().encode_batch([texts[i] for i, _ in checks])
    for (piece, record), expected in zip(checks, reference):
        got = flat[offsets[piece] : offsets[piece + 1]]
        if not np.array_equal(got, expected):
            raise Mismatch(record, got.tolist(), expected.tolist(), texts[piece])

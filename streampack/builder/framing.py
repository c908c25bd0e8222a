"""A batch of pieces: encoded on a helper thread (its sampled pieces checked against the reference engine),
then framed into the cache's tokens: BOS and EOS around its documents, their end offsets, an SFT loss mask.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from streampack.builder.commits import OpenUnit
from streampack.format.ledger import Counts
from streampack.tokenizer.base import Tokenizer


@dataclass
class Batch:
    """A batch being encoded, with what a commit after it may record."""

    unit: OpenUnit
    encoded: Future[Encoded]
    ends_doc: list[bool]  # per piece: the piece is the last of its document
    opens_doc: bool  # the first piece is the first of its document (a later one is when the one before ends)
    targets: list[bool] | None  # SFT builds: per piece, its tokens carry the loss
    checks: list[tuple[int, int]]  # (piece, record) of the pieces re-encoded with the reference engine
    records: list[int]  # per piece, the unit's record it is from (for errors)
    counts: Counts  # the unit's records consumed by this batch and the ones before it, and what they held
    last: bool = False  # the unit's last batch (possibly empty): writing it completes the unit


def frame(
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


def loss_mask(batch: Batch, piece_ends: np.ndarray, bos: bool, eos: bool) -> np.ndarray:
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


def encode_with_templates(tokenizer: Tokenizer, texts: list[str], templated: list[bool]) -> list[np.ndarray]:
    """Encode a batch whose chat-template pieces parse special-token strings and whose others do not."""
    plain = iter(tokenizer.encode_batch([t for t, special in zip(texts, templated) if not special]))
    special = iter(tokenizer.encode_specials([t for t, special in zip(texts, templated) if special]))
    return [next(special) if is_template else next(plain) for is_template in templated]


class Mismatch(Exception):
    """An engine's ids differ from the reference engine's for a piece (raised on an encoding thread)."""

    def __init__(self, record: int, engine: list[int], reference: list[int], piece: str) -> None:
        super().__init__(record)
        self.record, self.engine, self.reference, self.piece = record, engine, reference, piece


# A batch's ids per piece, and the seconds its encoder thread spent encoding and verifying them.
Encoded = tuple[list[np.ndarray], float, float]


def encode_and_check(
    encode: Callable[[], list[np.ndarray]],
    tokenizer: Tokenizer,
    texts: list[str],
    checks: list[tuple[int, int]],
) -> Encoded:
    """A batch's ids, ``encode()``, once its sampled pieces (``checks``) have the reference engine's ids;
    else raises :class:`Mismatch`."""
    started = time.perf_counter()
    ids = encode()
    encoded = time.perf_counter()
    if checks:
        reference = tokenizer.reference_engine().encode_batch([texts[i] for i, _ in checks])
        for (piece, record), expected in zip(checks, reference):
            if not np.array_equal(ids[piece], expected):
                raise Mismatch(record, ids[piece].tolist(), expected.tolist(), texts[piece])
    return ids, encoded - started, time.perf_counter() - encoded if checks else 0.0

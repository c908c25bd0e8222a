"""A reference model of what a streampack run serves, written to be obviously right rather than fast.

It says which tokens, labels and position ids every rank is served at every step of a run, from the
cache's documents (``cache.doc(i)``, ``cache.doc_loss_mask(i)``) and the public permutation
(:class:`streampack.order.permutation.Permutation`, whose laws ``tests/test_permutation.py`` checks on its
own). Nothing else of the package is used: every rule is restated here in plain Python loops over
documents, tokens and positions, so that a change in the package that serves other data than these rules
say is caught by ``tests/test_reference_model.py``, which runs the real ``Loader`` beside this model.

The rules, in the words of the documentation they come from:

* **Samples** (``cache.sequences``, ``cache.packed``, ``cache.documents``). A sample is a list of pieces
  ``(document, first token, tokens)`` and then padding:
  - windows: sample ``i`` is tokens ``[i*L, i*L + L + overlap)`` of all documents laid end to end; only the
    final partial window is dropped;
  - packed: documents cut by ``too_long`` into pieces of at most ``L`` tokens, pieces without a target
    token left out when ``no_target="drop"``, then best-fit decreasing: pieces in decreasing length
    (ties in document order), each into the open bin with the least room that fits it (ties: the bin
    that reached that room last), else a new bin; bins in the order they were opened, each holding its
    pieces in the order they went in, then padding with ``pad_id`` (the EOS id by default, else 0);
  - documents: one piece per sample, padded the same way;
  - with ``pad_multiple=N``, every piece takes its length rounded up to a multiple of ``N`` (best-fit
    counts that size, and orders pieces by it): its *fill* of ``pad_id`` belongs to its segment (position
    ids count on through it) and is no target.
* **Order**: position ``p`` of a run over ``N`` samples is sample ``Permutation(N, seed, epoch)(p mod N)``
  of epoch ``p // N`` (``p mod N`` without shuffle); ``epochs=E`` ends the run at ``E * N``.
* **Batches**: the global batch at ``p`` is positions ``[p, p + B)``; at a run's end a partial one,
  dropped with ``drop_last``. Rank ``r`` of ``W`` takes positions ``[p + r*rows//W, p + (r+1)*rows//W)``.
* **Exclusions**: a skip exclusion in force from ``at`` serves, at position ``q >= at``, the ``(q - at)``-th
  position ``>= at`` of the stream before it whose sample touches no excluded document (its overlap
  included) and that lies in no excluded range of that stream's positions. A mask exclusion labels -100
  every token of an excluded document in a row at a position ``>= at``, and every token of a row at an
  excluded position.
* **Dict outputs**: ``labels`` are the tokens, except -100 at the first token of every segment (the start
  of a row, of a document in it, of a piece, of the padding), on padding, on tokens an SFT cache marks as
  prompt, and where an exclusion masks; ``position_ids`` count from 0 in every segment; ``cu_seqlens`` are
  the segments' starts in the flattened batch, then its size.
* **Lengths**: a run's samples are *units*, windows of ``U`` tokens. A unit served at ``l`` (a divisor of
  ``U``) is its ``U / l`` consecutive sub-windows, rows of the same batch, which are windows ``u*k + j`` of
  the same stream at ``l``; at a multiple ``l = m*U`` (a resume at a longer length), rows of ``m``
  consecutive units of the rank's slice, each unit a segment of its own; joining units whose windows
  overlap, or in ``output="numpy"`` (no labels mask a join), is refused. A schedule's length for the
  batch at ``p`` is the one in force at token ``p * U``.
* **Parallel** (``cp_size``, ``balance``; the section at the end). ``balance="attention"``: a global
  batch's rows go to the ranks longest-processing-time first by cost (the squared lengths of a row's
  document segments, fills included), each rank keeping its even count of rows. ``cp_size=C``: CP rank
  ``c`` is served, of every row, chunks ``c`` and ``2C-1-c`` of each segment cut in ``2C``, with their
  labels, position ids and ``shift_labels`` (the next column's label), and its own ``cu_seqlens``.
* **Sources of a mixture's dict batches** (the section at the end): ``source_ids`` is each row's source;
  with loss weights, ``loss_weights`` is the row's source's weight (1.0 for a source not named) on each
  token whose label is not -100, else 0.
* **Follow** (training while the build runs; the section at the end). A build's units lie in the stream
  in unit order; its *committed prefix* is every document of the units before the first unfinished one,
  then the documents that one has committed. A Follow serves the samples of the *finished* cache (the
  windows of ``cache.sequences``, or the eras' plans of whole documents) in **eras**: era sizes are
  ``first_era``, then each twice the one before but at most ``largest_era``. Windows:
  era ``e`` is windows ``[W_e, W_{e+1})``; whole documents: documents ``[D_e, D_{e+1})``, planned on their
  own (packed or one piece per sample, as above), and era ``e``'s samples follow those of the eras before.
  Position ``p`` of era ``e`` (whose samples are positions ``[S_e, S_{e+1})``) is sample ``S_e +
  Permutation(S_{e+1} - S_e, seed, epoch=e)(p - S_e)``. An era is served once the committed prefix holds
  it (windows: its last window, overlap included; documents: its last document), the last one once the
  build is complete. After the last era (``T`` samples in all): ``then="epochs"`` serves position ``T + q``
  as position ``q`` of a run over the ``T`` samples with the same seed, ``then="end"`` ends the run at
  ``T``. A Follow reads the ledger when it is made and when a batch reaches past the positions it knows;
  a batch waits until its global batch is known; once a read finds the build complete, the end is
  checked (``then="epochs"`` with no global batch of samples, ``drop_last=False`` with a last batch that
  leaves some rank none, from the current position) before the next batch. In a mixture, a followed
  source serves at its cursor ``c`` position ``c`` of its follow run (its own seed, then epochs), whatever
  the mixture's shuffle, and a batch waits until the build holds the samples that cursor reaches by the
  batch's end (the weights are kept: no other source takes its rows).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from streampack.order.permutation import Permutation

IGNORE = -100


class Refused(Exception):
    """The model's verdict that the real Loader must refuse a configuration (with the reason)."""


# --- the corpus ---------------------------------------------------------------------------------------


class Corpus:
    """A cache's documents as Python lists of ints, its loss marks (SFT) and its EOS id."""

    def __init__(
        self, docs: tuple[tuple[int, ...], ...], marks: tuple[tuple[bool, ...], ...] | None, eos: int | None
    ) -> None:
        self.docs, self.marks, self.eos = docs, marks, eos
        self.records: dict[str, int | None] = {}  # input record -> the document it made (record_documents)

    @classmethod
    def read(cls, cache: Any) -> Corpus:
        """Every document of ``cache``, through ``cache.doc`` and ``cache.doc_loss_mask`` only."""
        docs = tuple(tuple(int(t) for t in cache.doc(i)) for i in range(cache.num_docs))
        marks = None
        if cache.has_loss_mask:
            marks = tuple(tuple(bool(m) for m in cache.doc_loss_mask(i)) for i in range(cache.num_docs))
        return cls(docs, marks, cache.eos_id)

    def __repr__(self) -> str:
        return f"Corpus({len(self.docs)} documents{', SFT' if self.marks is not None else ''})"

    def mark(self, doc: int, token: int) -> bool:
        """Whether token ``token`` of document ``doc`` is a training target (always, without marks)."""
        return True if self.marks is None else self.marks[doc][token]


def record_documents(paths: Sequence[str], corpus: Corpus, fields: Sequence[str]) -> dict[str, int | None]:
    """Each input record, named as ``streampack which`` names it (``path:line`` for JSON Lines, lines
    from 1; ``path[row]`` for Parquet), with the document it made (None: it made none).

    Read with ``json`` and ``pyarrow`` alone, for a cache built with the bytes tokenizer: a record makes
    the next document when its fields' UTF-8 bytes and the EOS are that document's tokens.
    """
    import json

    import pyarrow.parquet as pq

    records: list[tuple[str, dict[str, Any]]] = []
    for path in paths:
        if path.endswith(".parquet"):
            rows = pq.read_table(path).to_pylist()
            records += [(f"{path}[{row}]", record) for row, record in enumerate(rows)]
        else:
            with open(path, encoding="utf-8") as file:
                records += [(f"{path}:{n}", json.loads(line)) for n, line in enumerate(file, 1)]
    out: dict[str, int | None] = {}
    doc = 0
    for name, record in records:
        tokens = [b for f in fields for b in str(record.get(f) or "").encode()] + [corpus.eos]
        made = doc < len(corpus.docs) and list(corpus.docs[doc]) == tokens and len(tokens) > 1
        out[name] = doc if made else None
        doc += made
    assert doc == len(corpus.docs), "every document is a record's"
    return out


# --- samples ------------------------------------------------------------------------------------------


Piece = tuple[int, int, int]  # (document, first token, tokens)


@dataclass(frozen=True)
class Sample:
    """Some documents' tokens, piece after piece (each followed by its fill of ``pad_id`` up to a multiple
    of ``multiple``), then ``pad`` tokens of ``pad_id``."""

    pieces: tuple[Piece, ...]
    pad: int = 0
    pad_id: int = 0
    multiple: int = 1

    def tokens(self, corpus: Corpus) -> list[int]:
        out = []
        for doc, first, count in self.pieces:
            out += corpus.docs[doc][first : first + count]
            out += [self.pad_id] * (padded(count, self.multiple) - count)
        return out + [self.pad_id] * self.pad

    def documents(self) -> set[int]:
        return {doc for doc, _, count in self.pieces if count}


@dataclass(frozen=True)
class Windows:
    """``cache.sequences(seq_len, overlap=overlap)``."""

    seq_len: int
    overlap: int = 0

    def samples(self, corpus: Corpus) -> list[Sample]:
        stream = [(doc, t) for doc, tokens in enumerate(corpus.docs) for t in range(len(tokens))]
        count = max(0, (len(stream) - self.overlap) // self.seq_len)
        return [
            Sample(_pieces(stream[i * self.seq_len : i * self.seq_len + self.seq_len + self.overlap]))
            for i in range(count)
        ]

    @property
    def width(self) -> int:
        return self.seq_len + self.overlap


def _pieces(tokens: list[tuple[int, int]]) -> tuple[Piece, ...]:
    """Consecutive ``(document, token)`` pairs as pieces, one per run of one document."""
    pieces: list[list[int]] = []
    for doc, t in tokens:
        if pieces and pieces[-1][0] == doc and pieces[-1][1] + pieces[-1][2] == t:
            pieces[-1][2] += 1
        else:
            pieces.append([doc, t, 1])
    return tuple((doc, first, count) for doc, first, count in pieces)


@dataclass(frozen=True)
class Whole:
    """``cache.packed(...)`` (``packed=True``) or ``cache.documents(...)``."""

    seq_len: int
    packed: bool
    too_long: str
    no_target: str = "keep"
    pad_id: int | None = None
    pad_multiple: int = 1

    overlap = 0

    @property
    def width(self) -> int:
        return self.seq_len

    def pieces(self, corpus: Corpus) -> list[Piece]:
        """Every document cut by ``too_long``, without the targetless pieces when ``no_target="drop"``."""
        out = []
        for doc, tokens in enumerate(corpus.docs):
            n, length = len(tokens), self.seq_len
            if n == 0:
                continue
            if self.too_long == "truncate":
                cut = [(doc, 0, min(n, length))]
            elif self.too_long == "drop":
                cut = [(doc, 0, n)] if n <= length else []
            else:
                cut = [(doc, k, min(length, n - k)) for k in range(0, n, length)]
            for piece in cut:
                if self.no_target == "drop" and not _has_target(corpus, piece):
                    continue
                out.append(piece)
        return out

    def samples(self, corpus: Corpus) -> list[Sample]:
        pieces = self.pieces(corpus)
        pad_id = self.pad_id if self.pad_id is not None else (corpus.eos if corpus.eos is not None else 0)
        m = self.pad_multiple
        bins = _best_fit_decreasing(pieces, self.seq_len, m) if self.packed else [[p] for p in pieces]
        return [
            Sample(tuple(content), self.seq_len - sum(padded(c, m) for _, _, c in content), pad_id, m)
            for content in bins
        ]


def _has_target(corpus: Corpus, piece: Piece) -> bool:
    """A piece has a target token after its first one (which starts a segment), marked as a target."""
    doc, first, count = piece
    return any(corpus.mark(doc, t) for t in range(first + 1, first + count))


def _best_fit_decreasing(pieces: list[Piece], capacity: int, multiple: int = 1) -> list[list[Piece]]:
    """Best-fit decreasing of the pieces at their sizes: lengths rounded up to a multiple of ``multiple``."""
    assert len(pieces) < 1 << 16, "the model packs one chunk of pieces"
    bins: list[dict[str, Any]] = []
    clock = 0
    for index in sorted(range(len(pieces)), key=lambda i: -padded(pieces[i][2], multiple)):
        size = padded(pieces[index][2], multiple)
        fits = [b for b in bins if b["room"] > 0 and size <= b["room"]]
        if fits:
            least = min(b["room"] for b in fits)
            chosen = max((b for b in fits if b["room"] == least), key=lambda b: b["when"])
        else:
            chosen = {"room": capacity, "content": [], "when": -1}
            bins.append(chosen)
        chosen["content"].append(pieces[index])
        chosen["room"] -= size
        chosen["when"], clock = clock, clock + 1
    return [b["content"] for b in bins]


# --- the order and the served stream -------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _permutation(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    return tuple(int(x) for x in Permutation(n, seed=seed, epoch=epoch)(np.arange(n, dtype=np.int64)))


class Stream:
    """A run's positions -> ``(source, sample)``; ``end`` None for an endless run."""

    end: int | None

    def __call__(self, position: int) -> tuple[int, int]:
        raise NotImplementedError


class Shuffled(Stream):
    """One source of ``n`` samples, epoch after epoch."""

    def __init__(self, n: int, seed: int, shuffle: bool, epochs: int | None) -> None:
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.end = None if epochs is None else epochs * n

    def __call__(self, position: int) -> tuple[int, int]:
        epoch, offset = divmod(position, self.n)
        return 0, (_permutation(self.n, self.seed, epoch)[offset] if self.shuffle else offset)


@dataclass
class Exclusion:
    """One exclusion in force: from ``at``, ``mode``, the documents it names (by source) and the position
    ranges ``[start, stop)`` it takes out (of the stream before it, for skip; of the served run, for mask)."""

    at: int
    mode: str
    documents: dict[int, set[int]] = field(default_factory=dict)
    ranges: list[tuple[int, int]] = field(default_factory=list)
    steps: list[tuple[int, int]] = field(default_factory=list)  # the trainer's, first and last included
    counted: list[tuple[int, int]] = field(default_factory=list)  # the positions of ``steps``
    records: dict[int, list[str]] = field(default_factory=dict)  # input records, by source
    made: dict[int, set[int]] = field(default_factory=dict)  # the documents ``records`` made

    def named(self, source: int) -> set[int]:
        """The documents it names in ``source``: by index, and by the records that made them."""
        return self.documents.get(source, set()) | self.made.get(source, set())

    def in_ranges(self, position: int) -> bool:
        return any(start <= position < stop for start, stop in [*self.ranges, *self.counted])


def step_positions(legs: Sequence[tuple[int, int, int]], first: int, last: int) -> list[tuple[int, int]]:
    """The positions of the trainer's steps ``first`` to ``last``: step ``s`` is in the leg ``(first step,
    position, positions a step)`` that starts at or before it and before any later leg starts (a resume
    from an earlier step trains those steps again); the last leg runs on, and steps before the first
    leg's are counted back from it, down to position 0."""
    out: list[tuple[int, int]] = []
    for step in range(first, last + 1):
        for i, (start, position, stride) in enumerate(legs):
            later = [other for other, _, _ in legs[i + 1 :]]
            if (i == 0 or start <= step) and all(step < other for other in later):
                lo = position + (step - start) * stride
                if lo + stride > 0:
                    out.append((max(0, lo), lo + stride))
    return out


class Skipping(Stream):
    """``base`` without, from ``at`` on, the positions a skip exclusion takes out."""

    def __init__(self, base: Stream, entry: Exclusion, touches: Callable[[int, int], set[int]]) -> None:
        self.base, self.entry, self.touches = base, entry, touches
        self.kept: list[int] = []  # positions >= at of base that are served, in order
        self.next = entry.at
        self.end = None
        if base.end is not None:
            self._walk_until(lambda: self.next >= base.end)  # type: ignore[operator]
            self.end = entry.at + len(self.kept) if base.end > entry.at else base.end

    def _excluded(self, position: int) -> bool:
        source, sample = self.base(position)
        return bool(self.entry.named(source) & self.touches(source, sample)) or self.entry.in_ranges(position)

    def _walk_until(self, done: Callable[[], bool]) -> None:
        while not done():
            if self.base.end is not None and self.next >= self.base.end:
                return
            if not self._excluded(self.next):
                self.kept.append(self.next)
            self.next += 1
            if self.next - self.entry.at > 10**6:
                raise AssertionError("the model walked a million positions: everything excluded?")

    def __call__(self, position: int) -> tuple[int, int]:
        if position < self.entry.at:
            return self.base(position)
        index = position - self.entry.at
        self._walk_until(lambda: len(self.kept) > index)
        return self.base(self.kept[index])


def derived_seed(seed: int, tag: str) -> int:
    """A mixture's seed for one use (``"blocks"``, ``"source:NAME"``): 8 bytes of BLAKE2b, little-endian."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{tag}".encode(), digest_size=8).digest(), "little")


def block_counts(weights: dict[str, float], names: Sequence[str], block_size: int) -> tuple[int, ...]:
    """Positions of each source in a block: weight x block size, rounded by largest remainder (ties to
    the earlier source).

    Raises:
        Refused: a positive weight gets no position in a block.
    """
    exact = [Fraction(float(weights.get(name, 0))) for name in names]
    quotas = [w * block_size / sum(exact) for w in exact]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(names)), key=lambda j: (-(quotas[j] - counts[j]), j))
    for j in by_remainder[: block_size - sum(counts)]:
        counts[j] += 1
    if any(w and not c for w, c in zip(exact, counts)):
        raise Refused("a weight below one position per block")
    return tuple(counts)


Schedule = list[tuple[int, tuple[int, ...]]]  # (first block, counts), from block 0


def stage_schedule(
    stages: Sequence[tuple[int, dict[str, float]]], names: Sequence[str], block_size: int
) -> Schedule:
    """Each stage from the first block starting at or after its position."""
    return [(-(-position // block_size), block_counts(w, names, block_size)) for position, w in stages]


class Mixed(Stream):
    """Sources of ``sizes`` samples mixed by blocks (see the mixture's docs): position ``p`` is offset
    ``o`` of block ``b``; the block's ``counts`` (the schedule's in force) laid out source after source,
    its slots permuted (when shuffled and more than one source is in it); the source at ``o`` serves its
    sample at its *cursor*, the positions of it in earlier blocks plus those before ``o`` in this one."""

    def __init__(
        self,
        sizes: Sequence[int],
        seeds: Sequence[int],
        *,
        seed: int,
        shuffle: bool,
        block_size: int,
        schedule: Schedule,
        stop: str,
    ) -> None:
        self.sizes, self.seeds, self.shuffle, self.block_size = list(sizes), list(seeds), shuffle, block_size
        self.blocks_seed = derived_seed(seed, "blocks")
        self.schedule = schedule
        self.end = None
        if stop == "first_exhausted":
            block, cursors = 0, [0] * len(sizes)
            while all(c + k <= n for c, k, n in zip(cursors, self.counts(block), sizes) if k):
                cursors = [c + k for c, k in zip(cursors, self.counts(block))]
                block += 1
            self.end = block * block_size
            if self.end == 0:
                raise Refused("the mixture stops before its first block")

    def counts(self, block: int) -> tuple[int, ...]:
        return [counts for first, counts in self.schedule if first <= block][-1]

    def labels(self, block: int) -> list[int]:
        counts = self.counts(block)
        labels = [j for j, count in enumerate(counts) for _ in range(count)]
        if self.shuffle and sum(1 for c in counts if c) > 1:
            slots = _permutation(self.block_size, self.blocks_seed, block)
            labels = [labels[slots[i]] for i in range(self.block_size)]
        return labels

    def place(self, position: int) -> tuple[int, int]:
        """The source at ``position`` and its cursor there."""
        block, offset = divmod(position, self.block_size)
        labels = self.labels(block)
        source = labels[offset]
        return source, sum(self.counts(b)[source] for b in range(block)) + labels[:offset].count(source)

    def __call__(self, position: int) -> tuple[int, int]:
        source, cursor = self.place(position)
        epoch, index = divmod(cursor, self.sizes[source])
        if self.shuffle:
            index = _permutation(self.sizes[source], self.seeds[source], epoch)[index]
        return source, index


def cursor(stream: Stream, position: int) -> int:
    """The position of the stream under every skip exclusion reached once ``position`` are served."""
    while isinstance(stream, Skipping):
        entry = stream.entry
        if position > entry.at:
            if stream.end is not None and position >= stream.end:
                position = stream.base.end  # type: ignore[assignment]
            else:
                stream(position - 1)
                position = stream.kept[position - 1 - entry.at] + 1
        stream = stream.base
    return position


# --- batches ------------------------------------------------------------------------------------------


def global_rows(position: int, batch_size: int, end: int | None, drop_last: bool) -> int:
    """Rows of the global batch at ``position``: ``B``, the partial last one, or 0 past the run."""
    if end is None or end - position >= batch_size:
        return batch_size
    if drop_last or position >= end:
        return 0
    return end - position


def rank_slice(position: int, rows: int, rank: int, world_size: int) -> range:
    return range(position + rank * rows // world_size, position + (rank + 1) * rows // world_size)


def _check_last_batch(end: int | None, position: int, batch_size: int, world_size: int) -> None:
    """A partial last batch with fewer rows than ranks is refused (some rank would get none)."""
    if end is not None and end > position:
        remainder = (end - position) % batch_size
        if 0 < remainder < world_size:
            raise Refused("an empty last batch for some rank")


# (document or -1, first column, columns, the document's token at the first column, position, source)
Segment = tuple[int, int, int, int, int, int]


@dataclass
class Row:
    """One row of a batch: its tokens, whether each is a target, and its segments, each with the
    position and source of the sample it comes from (for mask exclusions)."""

    tokens: list[int]
    segments: list[Segment]
    marks: list[bool]


def row_of(corpus: Corpus, sample: Sample, width: int, position: int, source: int) -> Row:
    tokens = sample.tokens(corpus)
    assert len(tokens) == width, (len(tokens), width)
    segments: list[Segment] = []
    marks: list[bool] = []
    column = 0
    for doc, first, count in sample.pieces:
        size = padded(count, sample.multiple)  # its fill belongs to its segment, and is no target
        segments.append((doc, column, size, first, position, source))
        marks += [corpus.mark(doc, t) for t in range(first, first + count)] + [False] * (size - count)
        column += size
    if sample.pad:
        segments.append((-1, column, sample.pad, 0, position, source))
        marks += [False] * sample.pad
    return Row(tokens, segments, marks)


def joined(rows: Sequence[Row]) -> Row:
    """Rows of consecutive units served as one row: each keeps its segments (a unit is not its
    predecessor's continuation)."""
    tokens: list[int] = []
    segments: list[Segment] = []
    marks: list[bool] = []
    for row in rows:
        segments += [(doc, len(tokens) + start, *rest) for doc, start, *rest in row.segments]
        tokens += row.tokens
        marks += row.marks
    return Row(tokens, segments, marks)


def as_dict(rows: Sequence[Row], masks: Sequence[Exclusion], output: str, columns: int) -> dict[str, Any]:
    """The ``output="dict"`` (``"varlen"``) batch of ``rows``."""
    labels, positions, starts = [], [], []
    for index, row in enumerate(rows):
        label = list(row.tokens[:columns])
        position_ids = [0] * columns
        for doc, start, count, _, position, source in row.segments:
            if start >= columns:
                continue
            count = min(count, columns - start)
            starts.append(index * columns + start)
            position_ids[start : start + count] = range(count)
            label[start] = IGNORE
            masked = doc < 0 or any(
                position >= e.at and (doc in e.named(source) or e.in_ranges(position)) for e in masks
            )
            for column in range(start, start + count):
                if masked or not row.marks[column]:
                    label[column] = IGNORE
        labels.append(label)
        positions.append(position_ids)
    batch: dict[str, Any] = {
        "input_ids": [row.tokens[:columns] for row in rows],
        "labels": labels,
        "position_ids": positions,
    }
    if output == "varlen":
        cu = [*starts, len(rows) * columns]
        batch["cu_seqlens"] = cu
        batch["max_seqlen"] = max((b - a for a, b in itertools.pairwise(cu)), default=0)
    return batch


# --- a run --------------------------------------------------------------------------------------------


@dataclass
class Leg:
    """One stretch of a run between resumes, as its Loader is made.

    ``samples`` is what the Loader reads (``Windows`` or ``Whole``); ``schedule`` its seq_len schedule;
    ``skip``/``mask`` the exclusions it adds; ``batches`` how many batches each rank takes.
    """

    samples: Windows | Whole
    batch_size: int
    world_size: int
    batches: int
    schedule: tuple[tuple[int, int], ...] | None = None
    exclusions: list[Exclusion] = field(default_factory=list)
    mixture: MixLeg | None = None
    ga: int = 1  # global batches a trainer step takes (gradient accumulation: batches_per_step)
    loss_weights: dict[str, float] | None = None  # a mixture leg's loss weights by source name


@dataclass(frozen=True)
class MixLeg:
    """The Mixture a leg is given: its sources (names of the run's ``sources``) and stages."""

    names: tuple[str, ...]
    stages: tuple[tuple[int, dict[str, float]], ...]


@dataclass(frozen=True)
class MixSpec:
    """A mixture's settings that a run keeps."""

    seed: int
    shuffle: bool
    block_size: int
    stop: str


@dataclass
class Run:
    """What a run is made of: the cache (or a mixture's sources), the order's settings, the output and its
    legs. A mixture run names its sources ``sources`` (name -> corpus and samples) and ``mix``; its legs'
    ``samples`` is the first source's (they have one width)."""

    corpus: Corpus
    seed: int
    shuffle: bool
    epochs: int | None
    drop_last: bool
    output: str
    legs: list[Leg]
    sources: dict[str, tuple[Corpus, Windows | Whole]] = field(default_factory=dict)
    mix: MixSpec | None = None
    fim: FimSpec | None = None  # fill-in-the-middle of every row (see the section at the end)


class Model:
    """Replays a :class:`Run` in plain Python: per leg, per rank, the batches served."""

    def __init__(self, run: Run) -> None:
        self.run = run
        first = run.legs[0].samples
        self.units = first  # what positions count: the first leg's samples
        self.unit_samples = _samples(run.corpus, first)
        # Per source id: its corpus and samples (one for a single dataset).
        self.parts: list[tuple[Corpus, list[Sample]]] = [(run.corpus, self.unit_samples)]
        self.names: tuple[str, ...] = ()
        self.seeds: list[int] = []
        n = len(self.unit_samples)
        self.stream: Stream = (
            Shuffled(n, run.seed, run.shuffle, run.epochs) if n else Shuffled(1, 0, False, 0)
        )
        self.masks: list[Exclusion] = []
        self.given: list[Exclusion] = []  # every exclusion in force, in the order given
        self.position = 0
        self.step_legs: list[tuple[int, int, int]] = []  # (first step, position, positions a step)

    def touches(self, source: int, sample: int) -> set[int]:
        return self.parts[source][1][sample].documents()

    def mix(self, leg: MixLeg) -> None:
        """Read ``leg``'s mixture from the current position: blocks begun keep their counts (those of the
        schedule so far), the rest take the new stages; sources keep their seeds, new ones derive theirs."""
        spec = self.run.mix
        assert spec is not None
        own = stage_schedule(leg.stages, leg.names, spec.block_size)
        if self.names:
            old = dict(zip(self.names, range(len(self.names))))
            widened = [
                (first, tuple(counts[old[n]] if n in old else 0 for n in leg.names))
                for first, counts in self.base().schedule  # type: ignore[attr-defined]
            ]
            started = -(-cursor(self.stream, self.position) // spec.block_size)
            in_force = [counts for first, counts in own if first <= started][-1]
            own = [
                *(seg for seg in widened if seg[0] < started),
                (started, in_force),
                *(seg for seg in own if seg[0] > started),
            ]
            seeds = [
                self.seeds[old[n]] if n in old else derived_seed(spec.seed, f"source:{n}") for n in leg.names
            ]
        else:
            seeds = [derived_seed(spec.seed, f"source:{n}") for n in leg.names]
        self.names, self.seeds = leg.names, seeds
        self.parts = [(self.run.sources[n][0], _samples(*self.run.sources[n])) for n in leg.names]
        sizes = [len(samples) for _, samples in self.parts]
        if spec.stop == "first_exhausted":  # the Mixture given is made on its own stages first: refused if
            fresh = stage_schedule(leg.stages, leg.names, spec.block_size)  # they stop before a block
            Mixed(
                sizes,
                seeds,
                seed=spec.seed,
                shuffle=False,
                block_size=spec.block_size,
                schedule=fresh,
                stop=spec.stop,
            )
        base = Mixed(
            sizes,
            seeds,
            seed=spec.seed,
            shuffle=spec.shuffle,
            block_size=spec.block_size,
            schedule=own,
            stop=spec.stop,
        )
        self.stream = self.relayered(base)

    def base(self) -> Stream:
        stream = self.stream
        while isinstance(stream, Skipping):
            stream = stream.base
        return stream

    def relayered(self, base: Stream) -> Stream:
        """The skip exclusions in force, over a new base."""
        for entry in self.given:
            if entry.mode == "skip":
                base = Skipping(base, entry, self.touches)
        return base

    def unit_batch(self, leg: Leg) -> int:
        """Units a global batch of ``leg`` holds."""
        if leg.samples == self.units:
            return leg.batch_size
        return leg.batch_size * leg.samples.seq_len // self.units.seq_len  # type: ignore[union-attr]

    def length(self, leg: Leg, position: int) -> int:
        """The length the batch at ``position`` is served at."""
        if leg.schedule is None:
            return leg.samples.seq_len
        token = position * self.units.seq_len
        return [length for first, length in leg.schedule if first <= token][-1]

    def check(self, leg: Leg, index: int) -> None:
        """Raise :class:`Refused` where the real Loader must refuse ``leg`` (the model's refusals).

        A Loader refuses a dataset smaller than a batch when it is made, a checkpoint of units it cannot
        serve when it resumes, and, before its first batch (from the position the resume put it at), a
        last batch that leaves some rank none.
        """
        run, unit = self.run, self.units
        if run.mix is not None:
            if not run.drop_last:
                _check_last_batch(self.stream_after(leg).end, self.position, leg.batch_size, leg.world_size)
            return
        own = _samples(run.corpus, leg.samples)
        if not own or (run.drop_last and len(own) < leg.batch_size):
            raise Refused("fewer samples than one global batch")
        if leg.samples != unit:
            if not (isinstance(unit, Windows) and isinstance(leg.samples, Windows)):
                raise Refused("another layout")
            if leg.samples.overlap != unit.overlap:
                raise Refused("another overlap")
            lengths = [leg.samples.seq_len, *(length for _, length in leg.schedule or ())]
            if not all(unit.seq_len % length == 0 or length % unit.seq_len == 0 for length in lengths):
                raise Refused("a length that neither divides nor is a multiple of the units'")
            if max(lengths) > unit.seq_len and not run.drop_last:
                raise Refused("joins with drop_last=False")
            tokens = leg.batch_size * leg.samples.seq_len
            if tokens % unit.seq_len or (tokens // unit.seq_len) % leg.world_size:
                raise Refused("not whole units per rank")
            per_rank = tokens // unit.seq_len // leg.world_size
            if any(length > unit.seq_len and per_rank % (length // unit.seq_len) for length in lengths):
                raise Refused("units per rank not a multiple of the join")
            if max(lengths) > unit.seq_len and (unit.overlap or run.output == "numpy"):
                raise Refused("joining units whose windows overlap, or with no labels to mask the joins")
            if run.drop_last and len(self.unit_samples) < tokens // unit.seq_len:
                raise Refused("fewer units than one global batch")
        if not run.drop_last:  # before the first batch
            _check_last_batch(self.stream_after(leg).end, self.position, self.unit_batch(leg), leg.world_size)

    def stream_after(self, leg: Leg) -> Stream:
        """The served stream once ``leg``'s skip exclusions are in force."""
        stream = self.stream
        for entry in leg.exclusions:
            if entry.mode == "skip":
                stream = Skipping(stream, entry, self.touches)
        return stream

    def start_leg(self, leg: Leg, index: int, step: int = 0) -> None:
        """Put the leg's exclusions in force (in the order given) before its first batch; the trainer is
        at ``step``.

        Steps name the trainer's steps: counted through the run's legs so far (each leg's steps take
        ``batch_size * batches_per_step`` positions), the current one running on.

        Raises:
            Refused: the real Loader must refuse the leg (see :meth:`check`), or a range of an exclusion
                lies wholly before the position it takes effect at.
        """
        if leg.mixture is not None:
            self.mix(leg.mixture)
        self.step_legs.append((step, self.position, self.unit_batch(leg) * leg.ga))
        for entry in leg.exclusions:
            for source, names in entry.records.items():
                made = [self.parts[source][0].records[name] for name in names]
                if None in made:
                    raise Refused("a record that made no document")
                entry.made[source] = {doc for doc in made if doc is not None}
            counted = [step_positions(self.step_legs, first, last) for first, last in entry.steps]
            entry.counted = [piece for pieces in counted for piece in pieces]
            stops = [stop for _, stop in entry.ranges] + [
                max((s for _, s in pieces), default=0) for pieces in counted
            ]
            if index and any(stop <= entry.at for stop in stops):
                raise Refused("a range wholly before the position the exclusion takes effect at")
        self.check(leg, index)
        self.stream = self.stream_after(leg)
        self.masks += [entry for entry in leg.exclusions if entry.mode == "mask"]
        self.given += leg.exclusions

    def batches(self, leg: Leg, rank: int) -> list[Any]:
        """The batches rank ``rank`` is served in ``leg`` from the current position (not moving it)."""
        return [
            self.batch(leg, position, rank_slice(position, rows, rank, leg.world_size))
            for position, rows in self.positions(leg)
        ]

    def advance(self, leg: Leg) -> None:
        for position, rows in self.positions(leg):
            self.position = position + rows

    def batch(self, leg: Leg, position: int, positions: range) -> Any:
        """The formatted batch of ``positions`` (a rank's slice of the global batch at ``position``)."""
        rows, columns = self.rows(leg, position, positions)
        if self.run.output == "numpy":
            return np.asarray([row.tokens for row in rows], dtype=np.int64).reshape(len(rows), -1)
        batch = as_dict(rows, self.masks, self.run.output, columns)
        return batch if self.run.mix is None else sourced(batch, rows, self.names, leg.loss_weights)

    def rows(self, leg: Leg, position: int, positions: range) -> tuple[list[Row], int]:
        """The rows of ``positions`` as served, and their input columns (a window's overlap is not)."""
        corpus, unit = self.run.corpus, self.units
        length = self.length(leg, position)
        rows: list[Row] = []
        for p in positions:
            source, sample = self.stream(p)
            if self.run.mix is not None:
                part_corpus, part_samples = self.parts[source]
                rows.append(row_of(part_corpus, part_samples[sample], unit.width, p, source))
            elif length == unit.seq_len or not isinstance(unit, Windows):
                row = row_of(corpus, self.unit_samples[sample], unit.width, p, source)
                rows.append(row if self.run.fim is None else fim_row(row, sample, self.run.fim, corpus))
            elif length < unit.seq_len:
                k = unit.seq_len // length
                finer = _samples(corpus, Windows(length, unit.overlap))
                rows += [
                    row_of(corpus, finer[sample * k + j], length + unit.overlap, p, source) for j in range(k)
                ]
            else:
                rows.append(row_of(corpus, self.unit_samples[sample], unit.width, p, source))
        if isinstance(unit, Windows) and length > unit.seq_len:
            m = length // unit.seq_len
            inputs = [Row(r.tokens[: unit.seq_len], r.segments, r.marks[: unit.seq_len]) for r in rows]
            rows = [joined(inputs[i : i + m]) for i in range(0, len(inputs), m)]
        columns = length if isinstance(unit, Windows) else unit.seq_len
        return rows, columns

    def positions(self, leg: Leg) -> list[tuple[int, int]]:
        """``(position, rows)`` of each global batch ``leg`` serves from the current position."""
        out, position = [], self.position
        for _ in range(leg.batches):
            rows = global_rows(position, self.unit_batch(leg), self.stream.end, self.run.drop_last)
            if rows == 0:
                break
            out.append((position, rows))
            position += rows
        return out

    def placements(self, leg: Leg, position: int, rows: int) -> dict[tuple[int, int], list[tuple]]:
        """Per ``(source, document)`` of the global batch at ``position``, where its tokens sit among the
        rows' input columns: ``(rank, row, (first column, stop), (first token, stop))``, in batch order."""
        found: dict[tuple[int, int], list[tuple]] = {}
        for rank in range(leg.world_size):
            served, columns = self.rows(leg, position, rank_slice(position, rows, rank, leg.world_size))
            for index, row in enumerate(served):
                for doc, start, count, first, _, source in row.segments:
                    count = min(count, columns - start)
                    if doc >= 0 and count > 0:
                        where = (rank, index, (start, start + count), (first, first + count))
                        found.setdefault((source, doc), []).append(where)
        return found


@functools.lru_cache(maxsize=32)
def _cached_samples(corpus_id: int, samples: Windows | Whole) -> list[Sample]:
    return samples.samples(_CORPORA[corpus_id])


_CORPORA: dict[int, Corpus] = {}


def _samples(corpus: Corpus, samples: Windows | Whole) -> list[Sample]:
    _CORPORA[id(corpus)] = corpus
    return _cached_samples(id(corpus), samples)


# --- follow: training while the build runs -------------------------------------------------------------


def era_sizes(first: int, largest: int) -> Iterator[int]:
    """The eras' sizes: ``first``, then each twice the one before but at most ``largest``."""
    size = first
    while True:
        yield size
        size = min(2 * size, largest)


def committed(unit_docs: Sequence[int], progress: Sequence[int]) -> tuple[int, bool]:
    """A build's committed prefix, ``(documents, complete)``, where unit ``k`` of ``unit_docs[k]``
    documents has committed its first ``progress[k]``: the documents of the units before the first one
    not done, then those that one committed (what later units committed is not in it yet); complete once
    every unit is done."""
    docs = 0
    for made, total in zip(progress, unit_docs, strict=True):
        docs += made
        if made < total:
            return docs, False
    return docs, True


@dataclass(frozen=True)
class FollowSpec:
    """What a Follow serves: its samples (``Windows`` for ``layout="sequences"``, ``Whole`` for
    ``"packed"`` and ``"documents"``), its seed and its eras."""

    samples: Windows | Whole
    seed: int
    first_era: int
    largest_era: int


@dataclass(frozen=True)
class Era:
    """Era ``index``: its samples are positions ``[first, stop)``; it is served once the committed prefix
    holds ``needs`` windows (or documents): where it ends in the finished build."""

    index: int
    needs: int
    first: int
    stop: int


class Following(Stream):
    """A follow run's positions -> samples of the finished build (``samples``), era by era, then epochs
    of them all (``then="epochs"``) or the end (``then="end"``)."""

    def __init__(self, corpus: Corpus, spec: FollowSpec, then: str) -> None:
        self.corpus, self.spec = corpus, spec
        self.samples: list[Sample] = []
        self.eras: list[Era] = []
        if isinstance(spec.samples, Windows):
            self.samples = _samples(corpus, spec.samples)
            sizes = era_sizes(spec.first_era, spec.largest_era)
            start = 0
            while start < len(self.samples):
                stop = start + next(sizes)
                self.eras.append(Era(len(self.eras), stop, start, min(stop, len(self.samples))))
                start = stop
        else:
            pieces = spec.samples.pieces(corpus)
            sizes = era_sizes(spec.first_era, spec.largest_era)
            first = 0
            while first < len(corpus.docs):
                stop = first + next(sizes)
                plan = era_plan(corpus, spec.samples, [p for p in pieces if first <= p[0] < stop])
                self.eras.append(Era(len(self.eras), stop, len(self.samples), len(self.samples) + len(plan)))
                self.samples += plan
                first = stop
        self.total = len(self.samples)
        self.end = self.total if then == "end" else None

    def __call__(self, position: int) -> tuple[int, int]:
        if position < self.total:
            era = next(e for e in self.eras if e.first <= position < e.stop)
            within = _permutation(era.stop - era.first, self.spec.seed, era.index)
            return 0, era.first + within[position - era.first]
        epoch, offset = divmod(position - self.total, self.total)
        return 0, _permutation(self.total, self.spec.seed, epoch)[offset]

    def known(self, docs: int, complete: bool) -> int | None:
        """Positions served with the first ``docs`` documents committed: those of the eras it holds; every
        position (None) once the build is complete."""
        if complete:
            return None
        samples = self.spec.samples
        holds = docs
        if isinstance(samples, Windows):
            tokens = sum(len(doc) for doc in self.corpus.docs[:docs])
            holds = max(0, (tokens - samples.overlap) // samples.seq_len)
        return max([e.stop for e in self.eras if e.needs <= holds], default=0)


def era_plan(corpus: Corpus, whole: Whole, pieces: list[Piece]) -> list[Sample]:
    """The samples of one era's ``pieces`` (its documents cut as ``whole`` cuts them), planned on their
    own: best-fit decreasing (packed), or one piece per sample; padded as ``whole`` pads."""
    pad_id = whole.pad_id if whole.pad_id is not None else (corpus.eos if corpus.eos is not None else 0)
    bins = _best_fit_decreasing(pieces, whole.seq_len) if whole.packed else [[p] for p in pieces]
    return [Sample(tuple(content), whole.seq_len - sum(c for _, _, c in content), pad_id) for content in bins]


@dataclass
class FollowLeg:
    """One stretch of a follow run between resumes: its Follows' batch size, ranks, batches read (per
    rank), what follows the eras, and the mask exclusions it adds (a mixture's)."""

    batch_size: int
    world_size: int
    batches: int
    then: str = "epochs"
    exclusions: list[Exclusion] = field(default_factory=list)
    stages: tuple[tuple[int, dict[str, float]], ...] | None = None  # a mixture's new stages, if any


@dataclass
class FollowRun:
    """A follow run: the finished build's corpus and its units' documents, the Follow's settings, the
    output, ``drop_last`` and the legs."""

    corpus: Corpus
    unit_docs: tuple[int, ...]
    spec: FollowSpec
    output: str
    drop_last: bool
    legs: list[FollowLeg]


class FollowModel:
    """Replays a :class:`FollowRun` as its Follows read a build whose progress the caller gives: per
    batch, whether it is served yet, and what each rank is served."""

    def __init__(self, run: FollowRun) -> None:
        self.run = run
        self.streams = {then: Following(run.corpus, run.spec, then) for then in ("end", "epochs")}
        self.position = 0
        self.known: int | None = 0  # positions the current leg's Follows know (None: every one)

    def stream(self, leg: FollowLeg) -> Following:
        return self.streams[leg.then]

    def start_leg(self, leg: FollowLeg, progress: Sequence[int]) -> None:
        """The leg's Follows are made (and resumed at the position) with the build at ``progress``: they
        read the ledger.

        Raises:
            Refused: the build is complete and its end refused (see :meth:`read`).
        """
        self.known = 0
        self.read(leg, progress)

    def read(self, leg: FollowLeg, progress: Sequence[int]) -> None:
        """The leg's Follows read the ledger: they know the eras committed, and every position once the
        build is complete, after checking its end.

        Raises:
            Refused: ``then="epochs"`` over fewer samples than one global batch (none at all, with
                ``drop_last=False``); ``drop_last=False`` and ``then="end"`` with a last batch, from the
                position, that leaves some rank none.
        """
        docs, complete = committed(self.run.unit_docs, progress)
        stream = self.stream(leg)
        if complete and self.known is not None:
            little = stream.total < leg.batch_size if self.run.drop_last else stream.total == 0
            if leg.then == "epochs" and little:
                raise Refused("then='epochs' has nothing to repeat")
            if not self.run.drop_last:
                _check_last_batch(stream.end, self.position, leg.batch_size, leg.world_size)
        self.known = stream.known(docs, complete)

    def next_rows(self, leg: FollowLeg, progress: Sequence[int]) -> int | None:
        """Rows of the leg's next global batch with the build at ``progress`` (0: the run has ended), or
        None while it waits for the build. A batch past the positions known reads the ledger first.

        Raises:
            Refused: the read found the build complete and refused its end (see :meth:`read`).
        """
        if self.known is not None and self.position + leg.batch_size > self.known:
            self.read(leg, progress)
        if self.known is None:
            return global_rows(self.position, leg.batch_size, self.stream(leg).end, self.run.drop_last)
        return leg.batch_size if self.position + leg.batch_size <= self.known else None

    def rows(self, leg: FollowLeg, position: int, rows: int, rank: int) -> list[Row]:
        """Rank ``rank``'s rows of the global batch of ``rows`` rows at ``position``."""
        stream, width = self.stream(leg), self.run.spec.samples.width
        return [
            row_of(self.run.corpus, stream.samples[stream(p)[1]], width, p, 0)
            for p in rank_slice(position, rows, rank, leg.world_size)
        ]

    def batch(self, leg: FollowLeg, rows: int, rank: int) -> Any:
        """Rank ``rank``'s share of the global batch of ``rows`` rows at the position."""
        served, samples = self.rows(leg, self.position, rows, rank), self.run.spec.samples
        if self.run.output == "numpy":
            tokens = [row.tokens for row in served]
            return np.asarray(tokens, dtype=np.int64).reshape(len(served), samples.width)
        return as_dict(served, [], self.run.output, samples.seq_len)

    def placements(self, leg: FollowLeg, position: int, rows: int) -> dict[tuple[int, int], list[tuple]]:
        """Per ``(source, document)`` of the global batch at ``position``, where its tokens sit among the
        rows' input columns, as :meth:`Model.placements` says."""
        found: dict[tuple[int, int], list[tuple]] = {}
        columns = self.run.spec.samples.seq_len
        for rank in range(leg.world_size):
            for index, row in enumerate(self.rows(leg, position, rows, rank)):
                for doc, start, count, first, _, source in row.segments:
                    count = min(count, columns - start)
                    if doc >= 0 and count > 0:
                        where = (rank, index, (start, start + count), (first, first + count))
                        found.setdefault((source, doc), []).append(where)
        return found


class FollowMixed(Mixed):
    """A mixture whose sources in ``following`` are followed (their builds run): such a source serves at
    its cursor ``c`` position ``c`` of its follow run (its own seed, eras then epochs), whatever the
    mixture's shuffle; the others as in :class:`Mixed`."""

    def __init__(self, *args: Any, following: dict[int, Following], **settings: Any) -> None:
        super().__init__(*args, **settings)
        self.following = following

    def __call__(self, position: int) -> tuple[int, int]:
        source, cursor = self.place(position)
        if source in self.following:
            return source, self.following[source](cursor)[1]
        return super().__call__(position)

    def consumed(self, stop: int, source: int) -> int:
        """Samples of ``source`` that positions ``[0, stop)`` serve: its cursor at ``stop``."""
        block, offset = divmod(stop, self.block_size)
        return sum(self.counts(b)[source] for b in range(block)) + self.labels(block)[:offset].count(source)


@dataclass
class FollowMixRun:
    """A mixture of a finished cache (``web``: its corpus and samples) and a followed build (``fresh``:
    its finished corpus and units' documents, and the Follow's settings), by ``stages``, with its legs (each
    leg's ``then`` unused: the fresh source goes on with epochs after its eras)."""

    web: tuple[Corpus, Windows | Whole]
    fresh: FollowRun
    stages: tuple[tuple[int, dict[str, float]], ...]
    mix: MixSpec
    output: str
    legs: list[FollowLeg]


class FollowMixModel:
    """Replays a :class:`FollowMixRun`: a batch waits until the followed build holds the samples the fresh
    source's cursor reaches by its end (the weights are kept exactly: no other source takes its rows)."""

    NAMES = ("web", "fresh")

    def __init__(self, run: FollowMixRun) -> None:
        self.run = run
        web_corpus, web_samples = run.web
        self.following = Following(run.fresh.corpus, run.fresh.spec, "epochs")
        self.parts = [
            (web_corpus, _samples(web_corpus, web_samples)),
            (run.fresh.corpus, self.following.samples),
        ]
        spec = run.mix
        self.stream = FollowMixed(
            [len(self.parts[0][1]), 1],
            [derived_seed(spec.seed, f"source:{n}") for n in self.NAMES],
            seed=spec.seed,
            shuffle=spec.shuffle,
            block_size=spec.block_size,
            schedule=stage_schedule(run.stages, self.NAMES, spec.block_size),
            stop="never",
            following={1: self.following},
        )
        self.position = 0
        self.known: int | None = 0  # samples of the fresh source its Follow knows (None: all)
        self.masks: list[Exclusion] = []  # the mask exclusions in force, in the order given

    def start_leg(self, leg: FollowLeg, progress: Sequence[int]) -> None:
        """The leg's loaders are made with the build at ``progress`` (its Follows read the ledger), with
        its new stages, if any (blocks begun keep their counts, the rest take them), and its exclusions
        put in force."""
        if leg.stages is not None:
            block = self.run.mix.block_size
            own = stage_schedule(leg.stages, self.NAMES, block)
            started = -(-self.position // block)
            in_force = [counts for first, counts in own if first <= started][-1]
            self.stream.schedule = [
                *(segment for segment in self.stream.schedule if segment[0] < started),
                (started, in_force),
                *(segment for segment in own if segment[0] > started),
            ]
        self.read(progress)
        self.masks += leg.exclusions

    def read(self, progress: Sequence[int]) -> None:
        docs, complete = committed(self.run.fresh.unit_docs, progress)
        self.known = self.following.known(docs, complete)

    def next_rows(self, leg: FollowLeg, progress: Sequence[int]) -> int | None:
        """Rows of the next global batch (a full one: the mixture never stops), or None while it waits."""
        needs = self.stream.consumed(self.position + leg.batch_size, 1)
        if self.known is not None and needs > self.known:
            self.read(progress)
        return leg.batch_size if self.known is None or needs <= self.known else None

    def batch(self, leg: FollowLeg, rows: int, rank: int) -> Any:
        """Rank ``rank``'s share of the global batch at the position."""
        width = self.run.web[1].width
        served = []
        for p in rank_slice(self.position, rows, rank, leg.world_size):
            source, sample = self.stream(p)
            corpus, samples = self.parts[source]
            served.append(row_of(corpus, samples[sample], width, p, source))
        if self.run.output == "numpy":
            return np.asarray([row.tokens for row in served], dtype=np.int64).reshape(len(served), width)
        return sourced(
            as_dict(served, self.masks, self.run.output, self.run.web[1].seq_len), served, self.NAMES
        )


# --- parallel: padding to a multiple, context parallelism, balance by attention cost --------------------


def padded(count: int, multiple: int) -> int:
    """``count`` rounded up to a multiple of ``multiple``."""
    return -(-count // multiple) * multiple


def attention_cost(row: Row) -> int:
    """The sum of the squared lengths of a row's document segments (fills included, padding not)."""
    return sum(count * count for doc, _, count, *_ in row.segments if doc >= 0)


def balanced(costs: Sequence[int], world_size: int) -> list[int]:
    """The rank of each row (``costs`` in position order): rows by decreasing cost, ties by position, each
    to the rank with the least cost so far among those with rows left (ties: the lowest rank); rank ``r``
    takes ``(r+1)*n//W - r*n//W`` rows."""
    n = len(costs)
    room = [(r + 1) * n // world_size - r * n // world_size for r in range(world_size)]
    load = [0] * world_size
    ranks = [-1] * n
    for row in sorted(range(n), key=lambda i: (-costs[i], i)):
        rank = min((r for r in range(world_size) if room[r]), key=lambda r: (load[r], r))
        ranks[row], room[rank], load[rank] = rank, room[rank] - 1, load[rank] + costs[row]
    return ranks


def cp_part(batch: dict[str, Any], rows: Sequence[Row], cp_size: int, cp_rank: int) -> dict[str, Any]:
    """CP rank ``cp_rank``'s part of a dict batch of whole ``rows``: of every segment cut in ``2*cp_size``
    chunks, chunks ``cp_rank`` and ``2*cp_size-1-cp_rank``."""
    parts = 2 * cp_size
    out = dict(batch)
    shift = [[*label[1:], IGNORE] for label in batch["labels"]]
    taken: list[list[int]] = []
    lengths: list[int] = []
    for row in rows:
        columns: list[int] = []
        for _, start, count, *_ in row.segments:
            assert count % parts == 0, "every segment is a multiple of 2 * cp_size"
            chunk = count // parts
            for k in (cp_rank, parts - 1 - cp_rank):
                columns += range(start + k * chunk, start + (k + 1) * chunk)
            lengths.append(count // cp_size)
        taken.append(columns)
    for key, value in (*batch.items(), ("shift_labels", shift)):
        if key in ("input_ids", "labels", "position_ids", "shift_labels"):
            out[key] = [[row[c] for c in columns] for row, columns in zip(value, taken)]
    if "cu_seqlens" in out:
        out["cu_seqlens"] = [0, *itertools.accumulate(lengths)]
        out["max_seqlen"] = max(lengths, default=0)
    return out


@dataclass
class ParallelLeg(Leg):
    """A leg whose Loader is given ``cp_size`` and ``balance`` (``world_size`` counts data-parallel ranks)."""

    cp_size: int = 1
    balance: str = "rows"


class ParallelModel(Model):
    """:class:`Model` with the data-parallel ranks' rows chosen by ``balance``, and each split for CP."""

    def rank_positions(self, leg: Leg, position: int, rows: int, rank: int) -> list[int]:
        """The positions of rank ``rank``'s rows of the global batch at ``position``, ascending."""
        if getattr(leg, "balance", "rows") == "rows":
            return list(rank_slice(position, rows, rank, leg.world_size))
        served, _ = self.rows(leg, position, range(position, position + rows))
        ranks = balanced([attention_cost(row) for row in served], leg.world_size)
        return [position + k for k in range(rows) if ranks[k] == rank]

    def batches(self, leg: Leg, rank: int, cp_rank: int = 0) -> list[Any]:  # type: ignore[override]
        """The batches DP rank ``rank``, CP rank ``cp_rank`` is served in ``leg`` from the position."""
        out = []
        for position, rows in self.positions(leg):
            mine = self.rank_positions(leg, position, rows, rank)
            batch = self.batch(leg, position, mine)  # type: ignore[arg-type]
            cp_size = getattr(leg, "cp_size", 1)
            if cp_size > 1:
                batch = cp_part(batch, self.rows(leg, position, mine)[0], cp_size, cp_rank)  # type: ignore[arg-type]
            out.append(batch)
        return out

    def placements(self, leg: Leg, position: int, rows: int) -> dict[tuple[int, int], list[tuple]]:
        """As :meth:`Model.placements`, at the rows each rank is served under ``balance``, each document's
        columns without its fill (the rows before the CP split)."""
        found: dict[tuple[int, int], list[tuple]] = {}
        for rank in range(leg.world_size):
            mine = self.rank_positions(leg, position, rows, rank)
            for index, p in enumerate(mine):
                source, sample = self.stream(p)
                column = 0
                chosen = self.unit_samples[sample]
                for doc, first, count in chosen.pieces:
                    where = (rank, index, (column, column + count), (first, first + count))
                    found.setdefault((source, doc), []).append((p, column, where))
                    column += padded(count, chosen.multiple)
        return {key: [where for *_, where in sorted(runs)] for key, runs in found.items()}  # batch order


# --- sources of a mixture's dict batches (per-domain loss) -----------------------------------------------


def sourced(
    batch: dict[str, Any],
    rows: Sequence[Row],
    names: Sequence[str],
    loss_weights: dict[str, float] | None = None,
) -> dict[str, Any]:
    """A mixture's dict ``batch`` of ``rows`` with ``source_ids`` (each row's source: every segment of a row
    records the source of the row's sample) and, given ``loss_weights`` by name, ``loss_weights``: the
    row's source's weight (1.0 for one not named, as a float32) where the label is not -100, else 0."""
    sources = [row.segments[0][5] for row in rows]
    out = {**batch, "source_ids": sources}
    if loss_weights is not None:
        out["loss_weights"] = [
            [
                float(np.float32(loss_weights.get(names[source], 1.0))) if label != IGNORE else 0.0
                for label in labels
            ]
            for source, labels in zip(sources, batch["labels"], strict=True)
        ]
    return out


# --- fill-in-the-middle for code ------------------------------------------------------------------------
#
# ``samples.fim(rate, spm_rate, seed, min_length, sentinels=(P, M, S))``: in every row, each segment of a
# document (``Row.segments``) is taken in turn, numbered 0, 1, ... from the row's first. Its *body* is its
# tokens, less its last one when the segment holds its document's end and the cache appends an EOS (that
# EOS stays last). A body of at least ``min_length`` tokens draws four 64-bit words ``h0..h3`` from the
# seed, the sample's index and the segment's number (SplitMix64, below); it is FIM'd when
# ``u(h0) < rate`` (``u``: the top 53 bits as a fraction), SPM when ``u(h1) < spm_rate``, else PSM. Of its
# ``n`` body tokens the first ``m = n - 3`` are cut at ``a <= b``, ``h2 % (m + 1)`` and ``h3 % (m + 1)``
# sorted, into prefix, middle and suffix; the last 3 are not served (the sentinels take their columns):
#
#     PSM: P prefix S suffix M middle (EOS)        SPM: P S suffix M prefix middle (EOS)
#
# Every token keeps its loss mark where it moves; the sentinels are targets. Segments, position ids and
# padding are those of the row before.

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class FimSpec:
    """The FIM settings of a run's samples: ``ids`` are the prefix, middle and suffix sentinels."""

    rate: float
    spm_rate: float
    seed: int
    min_length: int
    ids: tuple[int, int, int]


def splitmix(x: int) -> int:
    """SplitMix64's step on a 64-bit word."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def fim_draws(seed: int, sample: int, segment: int) -> list[int]:
    """``h0..h3`` of segment ``segment`` of sample ``sample``."""
    key = derived_seed(seed, "fim")
    base = splitmix((splitmix((key + sample) & _MASK64) + segment) & _MASK64)
    return [splitmix((base + k) & _MASK64) for k in range(4)]


def fim_row(row: Row, sample: int, spec: FimSpec, corpus: Corpus) -> Row:
    """``row`` (of sample ``sample``) with its segments FIM'd as the rule above says."""
    tokens, marks = list(row.tokens), list(row.marks)
    prefix_id, middle_id, suffix_id = spec.ids
    number = 0
    for doc, start, count, first, _, _ in row.segments:
        if doc < 0:
            continue
        number += 1
        holds_end = first + count == len(corpus.docs[doc]) and corpus.eos is not None
        n = count - (1 if holds_end else 0)
        if n < spec.min_length:
            continue
        h = fim_draws(spec.seed, sample, number - 1)
        if (h[0] >> 11) * 2.0**-53 >= spec.rate:
            continue
        m = n - 3
        a, b = sorted((h[2] % (m + 1), h[3] % (m + 1)))
        body = list(zip(tokens[start : start + n], marks[start : start + n]))
        end = list(zip(tokens[start + n : start + count], marks[start + n : start + count]))
        prefix, middle, suffix = body[:a], body[a:b], body[b:m]
        p, mid, suf = [(prefix_id, True)], [(middle_id, True)], [(suffix_id, True)]
        if (h[1] >> 11) * 2.0**-53 < spec.spm_rate:
            new = p + suf + suffix + mid + prefix + middle + end
        else:
            new = p + prefix + suf + suffix + mid + middle + end
        assert len(new) == count
        tokens[start : start + count] = [t for t, _ in new]
        marks[start : start + count] = [k for _, k in new]
    return Row(tokens, row.segments, marks)

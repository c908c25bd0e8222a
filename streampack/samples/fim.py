"""Fill-in-the-middle (FIM) for code: a sample's documents rearranged at load time, as
``cache.sequences(L).fim(rate=0.5)`` serves them.

A row of samples holds pieces of documents (a window's parts, a packed row's documents). Each piece of at
least ``min_length`` tokens is, with probability ``rate``, cut at two points into prefix, middle and
suffix and served in FIM order, with the tokenizer's three sentinels:

* PSM: ``<prefix> prefix <suffix> suffix <middle> middle``;
* SPM (with probability ``spm_rate``): ``<prefix> <suffix> suffix <middle> prefix middle`` (the variant of
  the FIM paper that StarCoder and Megatron-LM use).

**Length.** A FIM'd piece keeps its columns: the three sentinels take the place of its last three tokens,
which are not served (as Megatron-LM cuts them off the suffix). A piece that holds its document's end
keeps its EOS last, and is cut before it. No token of another piece moves, so a row's document
boundaries, position ids and padding are those of the plain samples.

**Targets.** Every token of a FIM'd piece, sentinels included, is a target; in a cache with a loss mask
(SFT) each token keeps its mark where it moves, and the sentinels are targets.

**Determinism.** Each decision is a counter-based hash of the FIM seed, the sample's index and the
piece's place in its row: a resume, any rank, worker or batch size reads the same rows.

**Reading.** Where numba is installed (:mod:`streampack.samples.compiled`), the decisions of a plan are
made by a compiled pass over its spans, and each batch is copied from the shard maps in FIM order by a
compiled loop (:func:`moved_copy`): each token is copied once, so a FIM'd batch costs what a plain one does.
Without it, numpy's path is the reference the loops are tested against: a batch is read as plain rows,
then rearranged in place (:meth:`Moves.apply`), one gather of the FIM'd pieces' tokens and one scatter of
their sentinels for the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from streampack._checks import check_int, is_int
from streampack.errors import OptionsError, TokenizerError
from streampack.order import derive, groups, splitmix
from streampack.samples.compiled import compiled
from streampack.samples.spans import Spans, ragged_arange

if TYPE_CHECKING:
    from streampack.reader import Cache

__all__ = ["SLOTS", "SPELLINGS", "Fim", "Moves", "fim_moves", "moved_copy", "sentinel_ids"]

#: The sentinels' spellings looked for in a tokenizer, (prefix, middle, suffix), in this order.
SPELLINGS = (
    ("<fim_prefix>", "<fim_middle>", "<fim_suffix>"),  # StarCoder, SantaCoder
    ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"),  # Qwen2.5-Coder, OpenAI's cl100k_base
    ("<｜fim▁begin｜>", "<｜fim▁end｜>", "<｜fim▁hole｜>"),  # DeepSeek-Coder
)
_NAMES = ("prefix", "middle", "suffix")


@dataclass(frozen=True)
class Fim:
    """FIM's settings, checked (see the module docstring).

    Attributes:
        rate: the probability that a piece long enough is FIM'd.
        spm_rate: the probability that a FIM'd piece is in SPM order (else PSM).
        seed: what the decisions are drawn from, with each sample's index.
        min_length: pieces with fewer tokens (a document's EOS not counted) are served as they are.
        ids: the prefix, middle and suffix sentinels' ids.
        keeps_last: the cache appends an EOS: a piece that holds its document's end keeps it last.
    """

    rate: float
    spm_rate: float
    seed: int
    min_length: int
    ids: tuple[int, int, int]
    keeps_last: bool

    def fingerprint(self) -> str:
        """The settings as one string, for the samples' fingerprint (a checkpoint is checked against it)."""
        ids = ",".join(map(str, self.ids))
        return (
            f"rate={self.rate!r} spm_rate={self.spm_rate!r} seed={self.seed} min_length={self.min_length} "
            f"ids={ids}"
        )


def check_rate(name: str, value: object) -> float:
    """``value`` as a probability; an ``OptionsError`` unless it is a number in ``[0, 1]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise OptionsError(f"{name} must be a probability, a number from 0 to 1 (got {value!r}), e.g. 0.5")
    return float(value)


def make_fim(
    cache: Cache,
    *,
    rate: float,
    spm_rate: float,
    seed: int,
    min_length: int,
    sentinels: Sequence[int] | Sequence[str] | None,
    tokenizer: str | None,
) -> Fim:
    """The checked settings of ``samples.fim(...)`` for the samples of ``cache``.

    Raises:
        OptionsError: an option is out of its range, a sentinel id does not fit the cache, or the cache puts
            a BOS before every document.
        TokenizerError: the sentinels are to come from a tokenizer that cannot be read or has none.
    """
    if cache.bos_id is not None:
        # A document's BOS would move inside it (into the prefix served after the suffix, in SPM).
        raise OptionsError(
            f"{cache.root}: fim() of a cache that puts a BOS ({cache.bos_id}) before every document is not "
            "supported: the FIM order would serve the BOS inside the document. Build the code cache "
            "without --bos (an EOS alone ends each document) to train fill-in-the-middle on it"
        )
    rate, spm_rate = check_rate("rate", rate), check_rate("spm_rate", spm_rate)
    seed = check_int("seed", seed, min=0, below=2**64, hint="the FIM decisions' seed")
    min_length = check_int(
        "min_length", min_length, min=4, hint="the 3 sentinels replace 3 tokens: at least 4, e.g. 16"
    )
    if sentinels is not None and all(is_int(s) for s in sentinels) and len(sentinels) == 3:
        ids = tuple(int(s) for s in sentinels)
        where = "sentinels"
    else:
        ids = sentinel_ids(cache, sentinels, tokenizer)  # type: ignore[arg-type]
        where = "the tokenizer's sentinels"
    below = min(cache.vocab_size, int(np.iinfo(cache.dtype).max) + 1)
    for name, token in zip(_NAMES, ids, strict=True):
        check_int(f"{where}' {name} id", token, min=0, below=below, hint="an id of the cache's vocabulary")
    return Fim(rate, spm_rate, seed, min_length, ids, cache.eos_id is not None)  # type: ignore[arg-type]


def sentinel_ids(
    cache: Cache, spellings: Sequence[str] | None, tokenizer: str | None
) -> tuple[int, int, int]:
    """The ids of the FIM sentinels ``spellings`` (prefix, middle, suffix; by default the first of
    :data:`SPELLINGS` it has) in the tokenizer SPEC ``tokenizer``, else in the one that built ``cache``
    (refused if its file changed since: its ids could differ).

    Raises:
        OptionsError: ``spellings`` is not three strings.
        TokenizerError: no tokenizer to read, or it lacks the sentinels; the message names them.
    """
    if spellings is not None and (
        isinstance(spellings, str) or len(spellings) != 3 or not all(isinstance(s, str) for s in spellings)
    ):
        raise OptionsError(
            "sentinels takes the (prefix, middle, suffix) sentinels as 3 ids or 3 spellings, e.g. "
            f"('<fim_prefix>', '<fim_middle>', '<fim_suffix>') (got {spellings!r})"
        )
    from streampack.tokenizer import load_tokenizer

    spec = tokenizer or _built_with(cache)
    found = load_tokenizer(spec)
    expected, actual = cache.manifest.tokenizer.sha256, found.fingerprint().get("sha256")
    if tokenizer is None and expected and actual != expected:
        raise TokenizerError(
            f"the cache was built with tokenizer {spec!r} of sha256 {expected}, which now has sha256 "
            f"{actual}: its sentinels' ids may have changed. Pass tokenizer=SPEC (the one the cache's ids "
            "are of) or sentinels=(prefix_id, middle_id, suffix_id)"
        )
    candidates = [tuple(spellings)] if spellings is not None else list(SPELLINGS)
    missing: list[str] = []
    for names in candidates:
        encoded = found.encode_specials(list(names))
        ids = [int(e[0]) if len(e) == 1 else None for e in encoded]
        if all(i is not None for i in ids):
            return ids[0], ids[1], ids[2]  # type: ignore[return-value]
        missing += [repr(n) for n, i in zip(names, ids, strict=True) if i is None]
    raise TokenizerError(
        f"tokenizer {spec!r} has no FIM sentinel token {', '.join(missing)} (a sentinel is one token of the "
        "tokenizer's own). Use a tokenizer that has them, name its spellings with sentinels=(prefix, "
        "middle, suffix), or give their ids: sentinels=(prefix_id, middle_id, suffix_id)"
    )


def _built_with(cache: Cache) -> str:
    """The SPEC of the tokenizer that built ``cache``; a ``TokenizerError`` if it records none, or its file
    is not here."""
    built_with = cache.manifest.tokenizer
    spec = built_with.spec or ("bytes" if built_with.kind == "bytes" else None)
    if spec is None:
        raise TokenizerError(
            f"{cache.root}: the cache records no tokenizer to find the FIM sentinels in (tokenizer "
            f"{built_with.kind}:{built_with.name}): pass tokenizer=SPEC, or sentinels=(prefix_id, middle_id, "
            "suffix_id)"
        )
    path = spec.removeprefix("tiktoken:")
    if spec != "bytes" and not Path(path).exists():
        raise TokenizerError(
            f"the cache was built with tokenizer {spec!r}, which does not exist here: pass tokenizer=PATH "
            "to find the FIM sentinels in, or sentinels=(prefix_id, middle_id, suffix_id)"
        )
    return spec


def piece_words(seed: int, samples: np.ndarray, places: np.ndarray) -> np.ndarray:
    """Each piece's word ``mix(mix(key + sample) + place)``, with ``key = derive(seed, "fim")``: its draws
    are :func:`draw` of it."""
    key = np.uint64(derive(seed, "fim"))
    return splitmix(splitmix(samples.astype(np.uint64) + key) + places.astype(np.uint64))


def draw(words: np.ndarray, k: int) -> np.ndarray:
    """Draw ``k`` of pieces of ``words``, ``mix(word + k)``: 0 whether it is FIM'd, 1 whether SPM, 2 and 3
    its split points."""
    return splitmix(words + np.uint64(k))


def _unit(draw: np.ndarray) -> np.ndarray:
    """A draw as a float in ``[0, 1)``: its top 53 bits."""
    return (draw >> np.uint64(11)).astype(np.float64) * 2.0**-53


def by_document(spans: Spans, offsets_of: Callable[[int], np.ndarray]) -> tuple[Spans, np.ndarray]:
    """``spans`` cut at document ends (``offsets_of(shard)``), in (row, column) order, and whether each piece
    ends its document."""
    spans = _in_order(spans)
    lo, hi = spans.lo, spans.hi
    # Document j of a shard is [offsets[j-1], offsets[j]): the first holds lo, the last holds hi - 1.
    first, last = np.empty_like(lo), np.empty_like(lo)
    by_shard = list(groups(spans.shards))
    for shard, mine in by_shard:
        offsets = offsets_of(shard)
        first[mine] = np.searchsorted(offsets, lo[mine].astype(np.uint64), side="right")
        last[mine] = np.searchsorted(offsets, (hi[mine] - 1).astype(np.uint64), side="right")
    counts = last - first + 1
    docs = ragged_arange(first, counts)
    at = np.cumsum(counts) - counts
    starts, ends = np.empty_like(docs), np.empty_like(docs)
    for shard, mine in by_shard:
        offsets = offsets_of(shard)
        held = ragged_arange(at[mine], counts[mine])  # the pieces of the shard's spans
        doc = docs[held]
        ends[held] = offsets[doc]
        starts[held] = np.where(doc > 0, offsets[np.maximum(doc - 1, 0)], 0)
    span = np.repeat(np.arange(len(lo)), counts)
    piece_lo, piece_hi = np.maximum(lo[span], starts), np.minimum(hi[span], ends)
    keep = piece_hi > piece_lo  # empty documents
    span, piece_lo, piece_hi = span[keep], piece_lo[keep], piece_hi[keep]
    pieces = Spans(
        spans.rows[span], spans.shards[span], piece_lo, piece_hi, spans.col[span] + piece_lo - lo[span]
    )
    return pieces, piece_hi == ends[keep]


_FIELDS = ("first", "cuts", "spm", "ids")
# The slots of the prefix, middle and suffix in served order, PSM then SPM (see Moves.source).
SLOTS = {"PSM": {"prefix": 1, "suffix": 3, "middle": 5}, "SPM": {"suffix": 2, "prefix": 4, "middle": 5}}


@dataclass(frozen=True)
class Moves:
    """How FIM rearranges some rows of ``width`` columns, FIM'd piece ``k`` from flat position ``first[k]``
    on (ascending; row ``r``, column ``c`` at ``r * width + c``), cut at ``cuts[k] = a, b, m``:

        PSM: P prefix S suffix M middle        SPM: P S suffix M prefix middle

    (prefix ``[0, a)``, middle ``[a, b)``, suffix ``[b, m)`` of the piece; its tokens from ``m + 3`` on
    stay), in SPM order where ``spm[k]``, with the sentinels ``ids[k]`` (P, S, M). A piece keeps its
    columns, so no move crosses a row.

    Laid as six slots end to end (:data:`SLOTS` names them): slot ``j`` is the ``size[k, j]`` tokens from
    ``first[k] + source[k, j]`` on, and sentinel ``i`` sits at ``first[k] + spots[k, i]`` (a sentinel's
    slot, one token, is read from its own place and then overwritten).
    """

    width: int
    first: np.ndarray
    cuts: np.ndarray
    spm: np.ndarray
    ids: np.ndarray

    @classmethod
    def joined(cls, width: int, parts: Sequence[Moves]) -> Moves:
        """The moves of ``parts``, of disjoint rows, as one."""
        fields = [np.concatenate([getattr(p, f) for p in parts]) for f in _FIELDS]
        if (np.diff(fields[0]) > 0).all():  # in order already (one source's rows, in their order)
            return cls(width, *fields)
        order = np.argsort(fields[0], kind="stable")
        return cls(width, *(field[order] for field in fields))

    def renumbered(self, rows: np.ndarray) -> Moves:
        """These moves with row ``r`` moved to row ``rows[r]``."""
        first = rows[self.first // self.width] * self.width + self.first % self.width
        return Moves.joined(self.width, [replace(self, first=first)])

    @property
    def length(self) -> np.ndarray:
        """The tokens each piece rewrites."""
        return self.cuts[:, 2] + 3

    @property
    def source(self) -> np.ndarray:
        """``(pieces, 6)``: where each slot's tokens start in its piece."""
        return self._slots[0]

    @property
    def size(self) -> np.ndarray:
        """``(pieces, 6)``: each slot's tokens."""
        return self._slots[1]

    @property
    def spots(self) -> np.ndarray:
        """``(pieces, 3)``: where the P, S and M sentinels sit in their piece."""
        return self._slots[2]

    @cached_property
    def _slots(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        a, b, m = self.cuts.T
        zero, one, spm = np.zeros_like(a), np.ones_like(a), self.spm
        suffix = m - b
        # The sentinels' places: P at 0, then S and M.
        s_at = np.where(spm, 1, a + 1)
        m_at = np.where(spm, suffix + 2, a + suffix + 2)
        # The six slots in served order; a sentinel's slot reads its own place, overwritten after.
        psm = [(zero, one), (zero, a), (s_at, one), (b, suffix), (m_at, one), (a, b - a)]
        spm_slots = [(zero, one), (s_at, one), (b, suffix), (m_at, one), (zero, a), (a, b - a)]
        both = list(zip(spm_slots, psm, strict=True))
        source = np.stack([np.where(spm, x[0], y[0]) for x, y in both], axis=1)
        size = np.stack([np.where(spm, x[1], y[1]) for x, y in both], axis=1)
        return source, size, np.stack([zero, s_at, m_at], axis=1)

    @cached_property
    def _laid(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where each piece and sentinel lies in the moved pieces laid end to end, and each slot's source
        less its place there (laid once: each batch of a plan reads its part)."""
        at = np.cumsum(self.length) - self.length
        sizes = self.size.reshape(-1)
        shifts = (self.first[:, None] + self.source).reshape(-1) - (np.cumsum(sizes) - sizes)
        return at, shifts, (at[:, None] + self.spots).reshape(-1)

    @cached_property
    def table(self) -> np.ndarray:
        """The moves as one ``(pieces, 8)`` int64 array, what :func:`moved_copy` reads: per piece ``first``,
        ``cuts``, ``spm`` and ``ids``."""
        return np.concatenate(
            [self.first[:, None], self.cuts, self.spm[:, None], self.ids], axis=1, dtype=np.int64
        )

    def apply(self, out: np.ndarray, row: int = 0, sentinel: int | None = None) -> None:
        """Rearrange the rows of ``out``, rows ``row, row + 1, ...`` of these moves: the FIM'd pieces'
        tokens gathered in their new order, the sentinels set, then written back through a mask of the
        pieces' columns (a scatter by index costs several times a gather).

        Args:
            out: the plain rows, 2-D, ``width`` columns.
            row: the row of these moves that is ``out``'s first.
            sentinel: the value written at each sentinel's place instead of its id (e.g. a loss mark).
        """
        base = row * self.width
        lo, hi = np.searchsorted(self.first, [base, base + len(out) * self.width]).tolist()
        if lo == hi:
            return
        if not out.flags.c_contiguous:
            whole = np.ascontiguousarray(out)
            self.apply(whole, row, sentinel)
            out[...] = whole
            return
        at, shifts, spots = self._laid
        start, sizes = int(at[lo]), self.size.reshape(-1)[6 * lo : 6 * hi]
        flat = out.reshape(-1)
        sources = np.repeat(shifts[6 * lo : 6 * hi] + (start - base), sizes)
        sources += _counting(len(sources))
        moved = flat.take(sources, mode="clip")  # in range by construction: no check
        ids = self.ids.reshape(-1)[3 * lo : 3 * hi] if sentinel is None else sentinel
        moved[spots[3 * lo : 3 * hi] - start] = ids
        starts, lengths = self.first[lo:hi] - base, self.length[lo:hi]
        runs = np.empty(2 * len(starts), dtype=np.int64)  # untouched columns, then a piece's, in turn
        runs[0::2] = starts - np.concatenate(([0], (starts + lengths)[:-1]))
        runs[1::2] = lengths
        inside = np.zeros(len(runs), dtype=bool)
        inside[1::2] = True
        inside = np.repeat(inside, runs)
        flat[: len(inside)][inside] = moved


@compiled
def moved_copy(
    out: np.ndarray, tokens: np.ndarray, spans: np.ndarray, moves: np.ndarray, base: int, sentinel: int
) -> None:
    """Copy spans of ``tokens`` into the rows of ``out`` in FIM order, each token once, straight from the
    map: what a plain copy then :meth:`Moves.apply` give, without the second pass over the moved tokens.

    Args:
        out: the rows, 2-D.
        tokens: one shard's tokens.
        spans: ``(n, 4)`` int64, per span ``row, lo, hi, col``: tokens ``[lo, hi)`` to row ``row`` of ``out``
            from column ``col`` on.
        moves: the rows of :attr:`Moves.table` of the pieces in ``out``'s rows, by flat position.
        base: the flat position of ``out``'s first token in the moves.
        sentinel: the value written at each sentinel's place, or -1 for its id.
    """
    width, count = out.shape[1], moves.shape[0]
    for i in range(spans.shape[0]):
        row, lo, hi, col = spans[i, 0], spans[i, 1], spans[i, 2], spans[i, 3]
        start = base + row * width + col
        j = np.searchsorted(moves[:, 0], start)  # the first piece at or after the span's start
        line, piece = out[row, col : col + hi - lo], tokens[lo:hi]
        at, end = 0, hi - lo  # the next token of the span to copy, and the span's end, in the span
        while at < end:
            stop = end if j == count or moves[j, 0] >= start + end else moves[j, 0] - start
            # Each copy loops over slices from 0: indices known >= 0 let it vectorise (10x faster than
            # line[at + t] = piece[at + t], measured).
            into, source = line[at:stop], piece[at:stop]
            for t in range(stop - at):
                into[t] = source[t]
            if stop == end:
                break
            a, b, m = moves[j, 1], moves[j, 2], moves[j, 3]
            cut = 0 if moves[j, 4] else a  # SPM serves the prefix last, before the middle: one part
            # P, prefix, S, suffix, M, middle (PSM) or P, -, S, suffix, M, prefix and middle (SPM).
            into, column = line[stop : stop + m + 3], 0
            for k in range(3):
                into[column] = moves[j, 5 + k] if sentinel < 0 else sentinel
                first, size = (0, cut) if k == 0 else (b, m - b) if k == 1 else (cut, b - cut)
                part, source = into[column + 1 : column + 1 + size], piece[stop + first : stop + first + size]
                for t in range(size):
                    part[t] = source[t]
                column += 1 + size
            at = stop + m + 3
            j += 1


_COUNTING = np.arange(0)


def _counting(n: int) -> np.ndarray:
    """``0, 1, ..., n - 1``, a view of an array kept (a batch's gather adds it to its sources)."""
    global _COUNTING
    if len(_COUNTING) < n:
        counting = np.arange(max(n, 2 * len(_COUNTING)))
        counting.flags.writeable = False
        _COUNTING = counting
    return _COUNTING[:n]


def fim_moves(
    spans: Spans, samples: np.ndarray, fim: Fim, offsets_of: Callable[[int], np.ndarray], width: int
) -> Moves:
    """How ``fim`` rearranges a batch's rows of ``width`` columns, row ``k`` sample ``samples[k]`` made of the
    layout's ``spans`` (see the module docstring): decided by the compiled loops where numba is installed,
    else by numpy (the reference)."""
    count, decide = _counted(), _decided()
    if count is None or decide is None:
        return _numpy_moves(spans, samples, fim, offsets_of, width)
    spans = _in_order(spans)
    lo, hi = spans.lo.astype(np.int64), spans.hi.astype(np.int64)
    docs, pieces = np.empty_like(lo), np.empty_like(lo)
    by_shard = [(offsets_of(shard), mine) for shard, mine in groups(spans.shards)]
    for offsets, mine in by_shard:
        count(offsets, lo, hi, mine, docs, pieces)
    # Piece k of span i is the (slots[i] + k)-th of the spans' pieces, the (places[i] + k)-th of its row's.
    slots = np.cumsum(pieces) - pieces
    heads = np.flatnonzero(np.diff(spans.rows, prepend=-1))
    places = slots - np.repeat(slots[heads], np.diff(heads, append=len(slots)))
    total = int(pieces.sum())
    first, cuts, spm = (
        np.full(total, -1, dtype=np.int64),
        np.empty((total, 3), dtype=np.int64),
        np.empty(total, dtype=bool),
    )
    row_words = splitmix(samples.astype(np.uint64) + np.uint64(derive(fim.seed, "fim")))
    rows_at = (spans.rows * width + spans.col - lo).astype(np.int64)  # a token's column, less its place
    for offsets, mine in by_shard:
        decide(
            offsets,
            lo,
            hi,
            mine,
            docs,
            slots,
            places,
            rows_at,
            row_words[spans.rows],
            fim.rate,
            fim.spm_rate,
            fim.min_length,
            fim.keeps_last,
            first,
            cuts,
            spm,
        )
    which = np.flatnonzero(first >= 0)
    a, b, m = cuts[which].T
    return _moves(first[which], spm[which], a, b, m, fim.ids, width)


@compiled
def _counted(
    offsets: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    mine: np.ndarray,
    docs: np.ndarray,
    pieces: np.ndarray,
) -> None:
    """For each span ``i`` of ``mine`` (of the shard of document ends ``offsets``): ``docs[i]``, the document
    that holds its first token, and ``pieces[i]``, how many documents hold some of its tokens."""
    for i in mine:
        low = np.searchsorted(offsets, np.uint64(lo[i]), side="right")  # the first document ending after it
        docs[i], count, at = low, 0, lo[i]
        while at < hi[i]:
            end = min(np.int64(offsets[low]), hi[i])
            count += end > at  # an empty document holds none
            at, low = max(at, end), low + 1
        pieces[i] = count


@compiled
def _decided(
    offsets: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    mine: np.ndarray,
    docs: np.ndarray,
    slots: np.ndarray,
    places: np.ndarray,
    rows_at: np.ndarray,
    words: np.ndarray,
    rate: float,
    spm_rate: float,
    min_length: int,
    keeps_last: bool,
    first: np.ndarray,
    cuts: np.ndarray,
    spm: np.ndarray,
) -> None:
    """:func:`fim_moves`'s decisions for the spans ``mine`` of one shard (see :func:`_counted`), as numpy's
    path makes them: FIM'd piece ``k`` (the ``slots[i]``-th of span ``i``) gets its flat position
    ``first[k]``, its ``cuts[k] = a, b, m`` and ``spm[k]``; ``first`` stays -1 at the pieces left as they
    are. ``words``: the first SplitMix64 step of each span's sample (see :func:`piece_words`)."""

    def mix(x: np.uint64) -> np.uint64:  # order.splitmix, of one word
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    def unit(x: np.uint64) -> float:  # _unit
        return np.float64(x >> np.uint64(11)) * 2.0**-53

    for i in mine:
        doc, at, slot, place = docs[i], lo[i], slots[i], places[i]
        while at < hi[i]:
            end = np.int64(offsets[doc])
            stop = min(end, hi[i])
            if stop > at:
                body = stop - at - (1 if keeps_last and end <= hi[i] else 0)
                if body >= min_length:
                    word = mix(words[i] + np.uint64(place))
                    if unit(mix(word)) < rate:
                        m = body - 3
                        points = np.uint64(m + 1)
                        a = np.int64(mix(word + np.uint64(2)) % points)
                        b = np.int64(mix(word + np.uint64(3)) % points)
                        first[slot], spm[slot] = rows_at[i] + at, unit(mix(word + np.uint64(1))) < spm_rate
                        cuts[slot, 0], cuts[slot, 1], cuts[slot, 2] = min(a, b), max(a, b), m
                slot, place = slot + 1, place + 1
            at, doc = max(at, stop), doc + 1


def _in_order(spans: Spans) -> Spans:
    """``spans`` in (row, column) order (the layouts give them so; sorting pieces would cost more)."""
    key = spans.rows * (int(spans.col.max(initial=0)) + 1) + spans.col
    return spans if (np.diff(key) > 0).all() else spans.taken(np.argsort(key, kind="stable"))


def _numpy_moves(
    spans: Spans, samples: np.ndarray, fim: Fim, offsets_of: Callable[[int], np.ndarray], width: int
) -> Moves:
    """:func:`fim_moves` by numpy."""
    pieces, ended = by_document(spans, offsets_of)
    rows = pieces.rows
    # Each piece's place in its row: 0 for a row's first (the pieces are in row order).
    heads = np.flatnonzero(np.diff(rows, prepend=-1))
    places = np.arange(len(rows)) - np.repeat(heads, np.diff(heads, append=len(rows)))
    body = pieces.hi - pieces.lo - (ended & fim.keeps_last)
    which = np.flatnonzero(body >= fim.min_length)
    words = piece_words(fim.seed, samples[rows[which]], places[which])
    chosen = _unit(draw(words, 0)) < fim.rate
    which, words = which[chosen], words[chosen]  # the other draws only of the pieces FIM'd
    spm = _unit(draw(words, 1)) < fim.spm_rate
    m = body[which] - 3  # the body without the 3 tokens the sentinels replace
    points = (m + 1).astype(np.uint64)
    a = (draw(words, 2) % points).astype(np.int64)
    b = (draw(words, 3) % points).astype(np.int64)
    a, b = np.minimum(a, b), np.maximum(a, b)
    return _moves(rows[which] * width + pieces.col[which], spm, a, b, m, fim.ids, width)


def _moves(
    first: np.ndarray,
    spm: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    m: np.ndarray,
    ids: tuple[int, int, int],
    width: int,
) -> Moves:
    """The moves of FIM'd pieces from flat position ``first`` on, cut at ``a <= b <= m``."""
    prefix_id, middle_id, suffix_id = ids
    sentinels = np.tile(np.array([prefix_id, suffix_id, middle_id], dtype=np.int64), (len(first), 1))
    return Moves(width, first, np.stack([a, b, m], axis=1), spm, sentinels)

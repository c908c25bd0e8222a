"""Fill-in-the-middle (FIM) for code: a sample's documents rearranged at load time, as
``cache.sequences(L).fim(rate=0.5)`` serves them.

A row of samples holds pieces of documents (a window's parts, a packed row's documents). Each piece of at
least ``min_length`` tokens is, with probability ``rate``, cut at two points into prefix, middle and
suffix and served in FIM order, with the tokenizer's three sentinels:

* PSM: ``<prefix> prefix <suffix> suffix <middle> middle``;
* SPM (with probability ``spm_rate``): ``<prefix> <suffix> suffix <middle> prefix middle`` (the variant of
  the FIM paper that StarCoder and Megatron-LM use).

**Length.** A FIM'd piece keeps its columns: the three sentinels take the place of its last three tokens,
which are not served (Megatron-LM cuts them off the suffix the same way). A piece that holds its
document's end keeps that last token, the EOS, last; the cut and the split points are of the tokens
before it. No token of another piece moves, so a row's document boundaries, position ids and padding are
those of the plain samples.

**Targets.** Every token of a FIM'd piece, sentinels included, is a target as the plain one's tokens are;
in a cache with a loss mask (SFT) each token keeps its mark where it moves, and the sentinels are targets.

**Determinism.** Whether a piece is FIM'd, PSM or SPM, and its two split points are a pure function of the
FIM seed, the sample's index and the piece's place in its row (a counter-based hash, no generator state):
a resume, any rank, worker or batch size reads the same rows.

The rearrangement is one of spans: a FIM'd piece is up to six spans of the cache's tokens and of a
three-token *sentinel shard*, so a batch is still a copy of planned spans (:mod:`.copies`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from streampack._checks import check_int, is_int
from streampack.errors import OptionsError, TokenizerError
from streampack.order import derive
from streampack.samples.spans import Spans, ragged_arange

if TYPE_CHECKING:
    from streampack.reader import Cache

__all__ = ["SPELLINGS", "Fim", "fim_spans", "sentinel_ids"]

#: The sentinels' spellings looked for in a tokenizer, (prefix, middle, suffix), in this order.
SPELLINGS = (
    ("<fim_prefix>", "<fim_middle>", "<fim_suffix>"),  # StarCoder, SantaCoder
    ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"),  # Qwen2.5-Coder, OpenAI's cl100k_base
    ("<｜fim▁begin｜>", "<｜fim▁end｜>", "<｜fim▁hole｜>"),  # DeepSeek-Coder
)
_NAMES = ("prefix", "middle", "suffix")
# The sentinel shard's tokens: the prefix, middle and suffix sentinels at 0, 1, 2.
_PREFIX, _MIDDLE, _SUFFIX = 0, 1, 2
_MASK = (1 << 64) - 1


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

    def tokens(self, dtype: np.dtype) -> np.ndarray:
        """The sentinel shard: the prefix, middle and suffix ids, in ``dtype``."""
        return np.array(self.ids, dtype=dtype)


def check_rate(name: str, value: object) -> float:
    """``value`` as a probability.

    Raises:
        OptionsError: it is not a number in ``[0, 1]``.
    """
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
        OptionsError: an option is out of its range, or a sentinel id does not fit the cache.
        TokenizerError: the sentinels are to come from a tokenizer that cannot be read or has none.
    """
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
    """The ids of the FIM sentinels in the tokenizer ``tokenizer`` (a SPEC), else the one that built
    ``cache`` (refused if its file changed since: its ids could differ): the ``spellings`` given
    (prefix, middle, suffix), else the first of :data:`SPELLINGS` whose three tokens it has.

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
    """The SPEC of the tokenizer that built ``cache``, where it can be read here.

    Raises:
        TokenizerError: the cache records none, or its file is not here.
    """
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


# --- the decisions --------------------------------------------------------------------------------------

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's step: a bijection of 64-bit words whose outputs look independent (wraps, by design)."""
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def draws(seed: int, samples: np.ndarray, places: np.ndarray) -> list[np.ndarray]:
    """Four 64-bit draws for each piece: ``mix(mix(mix(key + sample) + place) + k)`` for ``k`` 0 to 3, with
    ``key = derive(seed, "fim")``: whether it is FIM'd, SPM, and its two split points."""
    key = np.uint64(derive(seed, "fim"))
    base = _mix(_mix(samples.astype(np.uint64) + key) + places.astype(np.uint64))
    return [_mix(base + np.uint64(k)) for k in range(4)]


def _unit(draw: np.ndarray) -> np.ndarray:
    """A draw as a float in ``[0, 1)``: its top 53 bits."""
    return (draw >> np.uint64(11)).astype(np.float64) * 2.0**-53


# --- the spans ------------------------------------------------------------------------------------------


def by_document(spans: Spans, offsets_of: Callable[[int], np.ndarray]) -> tuple[Spans, np.ndarray]:
    """``spans`` cut at document ends, in (row, column) order, and whether each piece ends its document.

    Args:
        spans: a batch's spans.
        offsets_of: a shard's offset table (each document's end, local to the shard).
    """
    parts: list[tuple[np.ndarray, ...]] = []
    for shard in np.unique(spans.shards).tolist():
        mine = np.flatnonzero(spans.shards == shard)
        lo, hi = spans.lo[mine], spans.hi[mine]
        offsets = offsets_of(shard)
        # Document j is [offsets[j-1], offsets[j]): the first holds lo, the last holds hi - 1.
        first = np.searchsorted(offsets, lo.astype(np.uint64), side="right").astype(np.int64)
        last = np.searchsorted(offsets, (hi - 1).astype(np.uint64), side="right").astype(np.int64)
        counts = last - first + 1
        docs = ragged_arange(first, counts)
        span = np.repeat(np.arange(len(mine)), counts)
        ends = offsets[docs].astype(np.int64)
        starts = np.where(docs > 0, offsets[np.maximum(docs - 1, 0)].astype(np.int64), 0)
        piece_lo = np.maximum(lo[span], starts)
        piece_hi = np.minimum(hi[span], ends)
        keep = piece_hi > piece_lo  # empty documents
        span, piece_lo, piece_hi = span[keep], piece_lo[keep], piece_hi[keep]
        parts.append(
            (
                spans.rows[mine][span],
                np.full(len(span), shard, dtype=np.int64),
                piece_lo,
                piece_hi,
                spans.col[mine][span] + piece_lo - lo[span],
                piece_hi == ends[keep],
            )
        )
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return Spans(empty, empty, empty, empty, empty), np.zeros(0, dtype=bool)
    rows, shards, lo, hi, col, ended = (np.concatenate(p) for p in zip(*parts))
    order = np.lexsort((col, rows))
    return Spans(rows[order], shards[order], lo[order], hi[order], col[order]), ended[order]


def fim_spans(
    spans: Spans,
    samples: np.ndarray,
    fim: Fim,
    offsets_of: Callable[[int], np.ndarray],
    sentinel_shard: int,
) -> Spans:
    """The spans of a batch's rows with their pieces FIM'd as ``fim`` decides (see the module docstring).

    Args:
        spans: the layout's spans of the batch; row ``k`` is sample ``samples[k]``.
        samples: each row's sample index.
        fim: the settings.
        offsets_of: a shard's offset table.
        sentinel_shard: the shard number the sentinels are read from (:meth:`Fim.tokens`).
    """
    pieces, ended = by_document(spans, offsets_of)
    rows = pieces.rows
    # Each piece's place in its row: 0 for a row's first (the pieces are in row order).
    heads = np.flatnonzero(np.diff(rows, prepend=-1))
    places = np.arange(len(rows)) - np.repeat(heads, np.diff(heads, append=len(rows)))
    length = pieces.hi - pieces.lo
    last = (ended & fim.keeps_last).astype(np.int64)
    body = length - last
    long_enough = np.flatnonzero(body >= fim.min_length)
    fimmed = np.zeros(len(rows), dtype=bool)
    if len(long_enough) and fim.rate > 0:
        chosen_draw, spm_draw, first_draw, second_draw = draws(
            fim.seed, samples[rows[long_enough]], places[long_enough]
        )
        fimmed[long_enough[_unit(chosen_draw) < fim.rate]] = True
        chosen = _unit(chosen_draw) < fim.rate
        spm = (_unit(spm_draw) < fim.spm_rate)[chosen]
        content = (body[long_enough] - 3)[chosen]  # the body without the 3 tokens the sentinels replace
        points = (content + 1).astype(np.uint64)
        a = (first_draw[chosen] % points).astype(np.int64)
        b = (second_draw[chosen] % points).astype(np.int64)
        a, b = np.minimum(a, b), np.maximum(a, b)
        which = long_enough[chosen]
        moved = _rearranged(pieces, which, spm, a, b, content, body[which], sentinel_shard)
    else:
        moved = Spans(*(np.zeros(0, dtype=np.int64) for _ in range(5)))
    kept = ~fimmed
    return Spans(
        *(
            np.concatenate([getattr(pieces, name)[kept], getattr(moved, name)])
            for name in ("rows", "shards", "lo", "hi", "col")
        )
    )


def _rearranged(
    pieces: Spans,
    which: np.ndarray,
    spm: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    content: np.ndarray,
    body: np.ndarray,
    sentinel_shard: int,
) -> Spans:
    """The spans of the FIM'd pieces ``which``: each as seven slots (sentinels, parts, its kept last token)
    in PSM or SPM order, laid from its first column on; empty slots dropped."""
    lo, shard = pieces.lo[which], pieces.shards[which]
    sentinel = np.full(len(which), sentinel_shard, dtype=np.int64)

    def token(k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return sentinel, np.full(len(which), k, dtype=np.int64), np.full(len(which), k + 1, dtype=np.int64)

    prefix, middle = (shard, lo, lo + a), (shard, lo + a, lo + b)
    suffix, tail = (shard, lo + b, lo + content), (shard, lo + body, pieces.hi[which])
    psm = [token(_PREFIX), prefix, token(_SUFFIX), suffix, token(_MIDDLE), middle, tail]
    spm_order = [token(_PREFIX), token(_SUFFIX), suffix, token(_MIDDLE), prefix, middle, tail]
    slots = [tuple(np.where(spm, s, p) for s, p in zip(x, y, strict=True)) for x, y in zip(spm_order, psm)]
    shards = np.stack([s[0] for s in slots])
    starts = np.stack([s[1] for s in slots])
    stops = np.stack([s[2] for s in slots])
    sizes = stops - starts
    cols = pieces.col[which] + np.cumsum(sizes, axis=0) - sizes
    rows = np.broadcast_to(pieces.rows[which], shards.shape)
    keep = sizes.reshape(-1) > 0
    return Spans(*(x.reshape(-1)[keep] for x in (rows, shards, starts, stops, cols)))

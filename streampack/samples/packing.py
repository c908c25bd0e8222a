"""Plans of whole-document samples: best-fit packing, or one document per sample.

A plan is a :class:`~streampack.samples.layout.Bins` table, computed from the shards' offset tables a
chunk of documents at a time (memory for one chunk whatever the size of the cache). It is stored beside
the cache (``CACHE/layouts/KEY/``, :mod:`streampack.store.plans`) and memory-mapped, so every rank and
worker shares one copy and a second run starts at once; where it cannot be written, it is kept in memory.

* ``"packed"``: best-fit decreasing within chunks of :data:`CHUNK_DOCS` documents: pieces by decreasing
  length, each into the open bin with the least room that fits it, else a new bin.
* ``"documents"``: one document per sample (SFT), padded to ``seq_len``.

A document longer than ``seq_len`` is split into pieces of ``seq_len`` tokens and a remainder,
truncated, or dropped (``too_long``). A piece with no target token (every label ``-100``: a prompt cut
before its response, a one-token remainder) is kept or dropped and counted either way (``no_target``);
telling them needs an SFT cache's loss mask, which planning then reads once. Planning is
deterministic: the same cache, documents and settings always give the same table.

With ``pad_multiple=N`` (context parallelism: ``N = 2 * cp_size``), each piece occupies its length rounded
up to a multiple of ``N`` in its sample, and best-fit counts that padded size; the few columns after a
piece are padding of its segment (:mod:`streampack.samples.boundaries`), so every segment of a row,
the row's own padding included, is a multiple of ``N`` long.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

import numpy as np

from streampack._checks import check_choice, check_int
from streampack.errors import OptionsError
from streampack.format.names import LAYOUT_DIR
from streampack.samples.layout import Bins
from streampack.store.plans import PlanIdentity, stored

if TYPE_CHECKING:
    from streampack.reader import Cache
    from streampack.samples.chosen import Chosen

__all__ = ["CHUNK_DOCS", "NO_TARGET", "TOO_LONG", "NoTarget", "TooLong", "plan"]

TooLong = Literal["split", "truncate", "drop"]
NoTarget = Literal["keep", "drop"]
TOO_LONG: tuple[TooLong, ...] = get_args(TooLong)
"""The ``too_long`` policies, in the order messages list them."""
NO_TARGET: tuple[NoTarget, ...] = get_args(NoTarget)
"""The ``no_target`` policies."""

# Documents packed together: larger chunks pack a little tighter, and take more memory to plan.
CHUNK_DOCS = 1 << 16


def plan(
    cache: Cache,
    chosen: Chosen,
    kind: str,
    seq_len: int,
    too_long: TooLong,
    pad_id: int | None,
    no_target: NoTarget,
    pad_multiple: int,
) -> Bins:
    """The chosen documents in samples of ``seq_len`` tokens, ``kind`` ``"packed"`` (best-fit) or
    ``"documents"`` (one per sample): the plan stored beside the cache.

    Raises:
        OptionsError: ``seq_len`` is not a positive integer, ``too_long`` or ``no_target`` is not a policy,
            ``pad_id`` does not fit the cache's token dtype, or ``pad_multiple`` does not divide ``seq_len``.
    """
    seq_len = check_int("seq_len", seq_len, min=1, hint="tokens per sample, e.g. 2048")
    pad_multiple = check_int("pad_multiple", pad_multiple, min=1, hint="e.g. 2 * cp_size, or 1")
    if seq_len % pad_multiple:
        raise OptionsError(
            f"pad_multiple={pad_multiple} must divide seq_len={seq_len}: every piece is padded to a multiple "
            f"of it inside rows of seq_len tokens; use a seq_len that is a multiple of {pad_multiple}"
        )
    check_choice("too_long", too_long, TOO_LONG)
    check_choice("no_target", no_target, NO_TARGET)
    if pad_id is None:
        pad_id = cache.eos_id if cache.eos_id is not None else 0
    hint = f"an id of the cache's {cache.dtype} tokens"
    pad_id = check_int("pad_id", pad_id, min=0, below=int(np.iinfo(cache.dtype).max) + 1, hint=hint)
    settings: dict[str, int | str] = (
        {"layout": kind, "strategy": "bfd"} if kind == "packed" else {"layout": kind}
    )
    settings["too_long"] = too_long
    if no_target == "drop":  # only then: plans that keep every piece keep the key they had before the option
        settings["no_target"] = "drop"
    if pad_multiple > 1:  # likewise
        settings["pad_multiple"] = pad_multiple
    settings |= chosen.fingerprint()
    identity = PlanIdentity(cache.content_digest, seq_len, settings)
    pieces = Pieces(cache, chosen, seq_len, too_long, no_target == "drop")
    directory = Path(cache.root) / LAYOUT_DIR / identity.key
    tables = lambda: bin_chunks(pieces, ASSIGNERS[kind], seq_len, pad_multiple)  # noqa: E731
    plan = stored(directory, identity, tables, pieces.counts, cache.table.num_tokens)
    return Bins(
        **plan.arrays,  # starts, shards, lo, lengths
        seq_len=seq_len,
        pad_id=pad_id,
        pad_multiple=pad_multiple,
        settings=settings,
        directory=plan.directory,
        dropped=plan.dropped,
        no_target=plan.no_target,
        checked=(plan.checksum, plan.identities),
    )


def bin_chunks(
    chunks: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]],
    assign: Callable[[np.ndarray, int], np.ndarray],
    seq_len: int,
    pad_multiple: int = 1,
) -> Iterator[dict[str, np.ndarray]]:
    """The plan's tables: each chunk's ``(shards, lo, lengths)`` pieces placed in bins by ``assign`` (at their
    lengths rounded up to ``pad_multiple``), then a last table of only the number of pieces."""
    before = 0  # pieces in the chunks before this one
    for shards, lo, lengths in chunks:
        sizes = -(-lengths // pad_multiple) * pad_multiple
        yield _binned(shards, lo, lengths, sizes, assign(sizes, seq_len), before)
        before += len(lengths)
    yield {"starts": np.array([before], dtype=np.int64)}


def _binned(
    shards: np.ndarray,
    lo: np.ndarray,
    lengths: np.ndarray,
    sizes: np.ndarray,
    bin_of: np.ndarray,
    before: int,
) -> dict[str, np.ndarray]:
    """One chunk's table: each bin's first piece (after the ``before`` of earlier chunks), and the pieces by
    bin, each bin's in the order they went in (by decreasing ``sizes``)."""
    placed = np.empty(len(lengths), dtype=np.int64)  # the order pieces went into their bins
    placed[np.argsort(-sizes, kind="stable")] = np.arange(len(lengths))
    order = np.lexsort((placed, bin_of))
    counts = np.bincount(bin_of)
    return {
        "starts": before + np.cumsum(counts) - counts,
        "shards": shards[order],
        "lo": lo[order],
        "lengths": lengths[order],
    }


class Pieces:
    """The pieces of the chosen documents, in stream order: ``(shards, lo, lengths)`` per chunk of about
    :data:`CHUNK_DOCS` documents; ``dropped`` and ``no_target`` count what was left out or has no target."""

    def __init__(
        self, cache: Cache, chosen: Chosen, seq_len: int, too_long: TooLong, drop_no_target: bool = False
    ) -> None:
        self.cache, self.chosen, self.seq_len, self.too_long = cache, chosen, seq_len, too_long
        self.drop_no_target = drop_no_target
        self.dropped = 0
        self.no_target = 0

    def counts(self) -> dict[str, int]:
        """What the plan left out, once its pieces are all made: ``dropped`` and ``no_target``."""
        return {"dropped": self.dropped, "no_target": self.no_target}

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        # Counted afresh: a plan that could not be written is made again in memory (store.plans).
        self.dropped = self.no_target = 0
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        held = 0
        for shard in range(self.cache.num_shards):
            starts, lengths = document_spans(self.cache, shard)
            keep = self.chosen.in_shard(shard) & (lengths > 0)
            starts, lengths = starts[keep], lengths[keep]
            for begin in range(0, len(starts), CHUNK_DOCS):
                chunk = slice(begin, begin + CHUNK_DOCS)
                parts.append(self.of_documents(shard, starts[chunk], lengths[chunk]))
                held += len(parts[-1][1])
                if held >= CHUNK_DOCS:
                    yield _joined(parts)
                    parts, held = [], 0
        if parts:
            yield _joined(parts)

    def of_documents(
        self, shard: int, starts: np.ndarray, lengths: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(shards, lo, lengths)``: the pieces of documents ``[starts, starts + lengths)`` of ``shard``."""
        lo, length = self._targeted(shard, *self._cut(starts, lengths))
        return np.full(len(lo), shard, dtype=np.int64), lo, length

    def _targeted(self, shard: int, lo: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The pieces of ``shard``, counting (and maybe leaving out) those with no target token."""
        mask = self.cache.shard_loss_mask(shard) if self.cache.has_loss_mask else None
        targeted = has_target(mask, lo, lengths)
        missing = int(len(lo) - np.count_nonzero(targeted))
        self.no_target += missing
        if missing and self.drop_no_target:
            return lo[targeted], lengths[targeted]
        return lo, lengths

    def _cut(self, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Documents ``[starts, starts + lengths)`` as pieces of at most ``seq_len`` tokens."""
        seq_len = self.seq_len
        if self.too_long == "truncate":
            return starts, np.minimum(lengths, seq_len)
        if self.too_long == "drop":
            keep = lengths <= seq_len
            self.dropped += int(len(lengths) - keep.sum())
            return starts[keep], lengths[keep]
        counts = -(-lengths // seq_len)
        k = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        lo = np.repeat(starts, counts) + k * seq_len  # k: the piece's number inside its document
        return lo, np.minimum(np.repeat(starts + lengths, counts) - lo, seq_len)


def has_target(mask: np.ndarray | None, lo: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Whether each piece ``[lo, lo + lengths)`` holds a target token: one after its first, marked by the
    shard's loss ``mask`` if any. The pieces are sorted and disjoint: one ``np.maximum.reduceat`` does."""
    long_enough = lengths >= 2
    if mask is None or not long_enough.any():
        return long_enough
    first = lo[long_enough] + 1
    end = lo[long_enough] + lengths[long_enough]
    bounds = np.stack([first, end], axis=1).reshape(-1)
    if bounds[-1] >= len(mask):  # the last range runs to the end of the shard: reduceat's last segment does
        bounds = bounds[:-1]
    found = np.maximum.reduceat(mask, bounds)[::2] > 0
    targeted = np.zeros(len(lo), dtype=bool)
    targeted[long_enough] = found
    return targeted


def document_spans(cache: Cache, shard: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each document of ``shard`` starts in it, and its length (``int64``)."""
    ends = np.asarray(cache.shard_offsets(shard), dtype=np.int64)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    return starts, ends - starts


def _joined(
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    shards, lo, lengths = (np.concatenate(column) for column in zip(*parts, strict=True))
    return shards, lo, lengths


def _best_fit_decreasing(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """The bin of each item, packed best-fit decreasing into bins of ``capacity``; bins in opening order.

    Open bins are kept in one stack per room left, so the best fit for an item of size ``s`` is the first
    non-empty stack at or above ``s``: one short numpy scan, not a search of bins.
    """
    by_room: list[list[int]] = [[] for _ in range(capacity + 1)]
    nonempty = np.zeros(capacity + 1, dtype=bool)
    bin_of = np.empty(len(lengths), dtype=np.int64)
    sizes = lengths.tolist()
    opened = 0
    for item in np.argsort(-lengths, kind="stable").tolist():
        size = sizes[item]
        room = size + int(np.argmax(nonempty[size:]))
        if nonempty[room]:
            chosen = by_room[room].pop()
            nonempty[room] = bool(by_room[room])
        else:
            chosen, room, opened = opened, capacity, opened + 1
        left = room - size
        if left:
            by_room[left].append(chosen)
            nonempty[left] = True
        bin_of[item] = chosen
    return bin_of


def _one_per_sample(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    return np.arange(len(lengths))


ASSIGNERS: dict[str, Callable[[np.ndarray, int], np.ndarray]] = {
    "packed": _best_fit_decreasing,
    "documents": _one_per_sample,
}

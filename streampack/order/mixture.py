"""Several datasets read as one stream by weight: exact per block, each source through its own epochs.

Global positions are cut into blocks of ``block_size`` consecutive positions. A block holds ``c_j``
positions of source ``j``: the weights in force, times the block size, rounded by largest remainder, so
every block (and so every prefix, to within one block) follows the weights. Inside a block the
positions are permuted with a seeded :class:`~streampack.order.permutation.Permutation` of the block. Source
``j`` serves its samples in the order of its own :class:`~streampack.order.Shuffled` (a
:class:`~streampack.order.blockshuffle.BlockShuffled` with ``shuffle=BlockShuffle(...)``), through its own
epochs, at a *cursor*: the samples it served in earlier blocks plus its rank in this one.

The cursors before block ``k`` are a sum over the schedule's segments (runs of blocks with the same
counts), so the map from position to sample is pure and O(1) in the position. A checkpoint records the
schedule so far, which is what lets a run resume with new weights or new sources: blocks that had begun
keep the counts they were served with, later blocks take the new ones, and every cursor continues, so no
sample is served twice or skipped within a source's epoch.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

from streampack._checks import check_choice, check_int
from streampack.errors import LoaderStateError, OptionsError
from streampack.order import MAX_POSITION, Shuffled, count_batches, data_fingerprint, groups, mismatch
from streampack.order.blockshuffle import (
    BlockShuffle,
    BlockShuffled,
    check_shuffle,
    shuffle_fingerprint,
    single_order,
)
from streampack.order.permutation import Permutation

__all__ = ["Mixture"]

Stop = Literal["never", "first_exhausted"]
# Block tables kept for reuse (each 16 bytes per position): enough for the blocks a plan of a few
# thousand rows spans in a DataLoader worker of one rank among several.
_CACHED_BLOCKS = 8
Counts = tuple[int, ...]


class Mixture:
    """Datasets mixed by weight into one stream, resumable with changed weights or added sources.

    Give it to :class:`~streampack.loader.Loader` (and so to ``streampack.torch.DataLoader``) in place
    of one dataset; ranks, workers and checkpoints work unchanged. It is the order of its sources and
    holds them (:meth:`sources_and_order`), so ``Loader(mix)`` reads ``mix.sources`` in the order ``mix``.

    Example::

        mix = Mixture(
            {"web": web.sequences(2048), "code": code.sequences(2048)},
            stages=[(0, {"web": 0.9, "code": 0.1}), (5_000_000, {"web": 0.7, "code": 0.3})],
            seed=0,
        )
        loader = Loader(mix, batch_size=32)

    Args:
        sources: name -> dataset (e.g. ``cache.sequences(seq_len)``), all with samples of one width and,
            for caches, one tokenizer. Names identify sources in checkpoints, stages and reports.
        weights: name -> weight (any non-negative numbers; normalised). Sources left out get weight 0.
            The same as ``stages=[(0, weights)]``.
        stages: ``(position, weights)`` pairs, the first at position 0: from the first block starting at
            or after ``position`` (a global position: samples since the run started), the weights change.
        seed: seed of the block order and of each source's order.
        shuffle: permute positions inside a block and samples inside each source's epochs; else both in
            order. A :class:`~streampack.order.blockshuffle.BlockShuffle` permutes positions inside a block
            and reads each source in block-shuffled order (for sources read from object storage).
        block_size: positions per block. Weights are rounded to multiples of ``1 / block_size``; each
            source with a positive weight needs at least one position per block.
        stop: ``"never"`` (each source wraps into its next epoch when exhausted) or
            ``"first_exhausted"`` (the stream ends before the first block that would need a sample of
            some source's second epoch).

    Raises:
        OptionsError: (a ``ValueError``) no sources, a name that is not a string, an empty source,
            sources of different widths or tokenizers, weights naming unknown sources or not
            non-negative numbers, stages that do not start at 0 or are not increasing, a positive weight
            below one position per block (the message gives the block size that fits), or a stream that
            would stop before its first block.
    """

    # A single dataset's checkpoint continues as the source with its data.
    resumes: tuple[str, ...] = ("shuffled", "blocks", "mixture")

    def __init__(
        self,
        sources: Mapping[str, Any],
        weights: Mapping[str, float] | None = None,
        *,
        stages: Sequence[tuple[int, Mapping[str, float]]] | None = None,
        seed: int = 0,
        shuffle: bool | BlockShuffle = True,
        block_size: int = 4096,
        stop: Stop = "never",
    ) -> None:
        seed = check_int("seed", seed, min=0, below=2**64)
        block_size = check_int("block_size", block_size, min=1, max=2**40)
        check_shuffle(shuffle)
        check_choice("stop", stop, get_args(Stop))
        self.sources = _checked_sources(sources)
        self.names = tuple(self.sources)
        self.seed, self.shuffle, self.block_size, self.stop = seed, shuffle, block_size, stop
        self._data = [data_fingerprint(data) for data in self.sources.values()]
        self._seeds = [_derive(self.seed, f"source:{name}") for name in self.names]
        self._blocks_seed = _derive(self.seed, "blocks")
        segments = [
            (_first_block(start, self.block_size), self._counts(w)) for start, w in _stages(weights, stages)
        ]
        self._set_schedule(segments)
        if self.end == 0:
            raise OptionsError(
                "the mixture would stop before its first block: some source has fewer samples than its share "
                f"of a block of {self.block_size}; use a smaller block_size, or stop='never'"
            )

    @classmethod
    def from_config(cls, config: str | Path | Mapping[str, Any]) -> Mixture:
        """The mixture a YAML or JSON config file (or dict) describes; see
        :mod:`streampack.loader.mixconfig`."""
        from streampack.loader.mixconfig import load_mixture

        return load_mixture(config)

    def sources_and_order(self) -> tuple[dict[str, Any], Mixture]:
        """Its sources and itself, their order: what a :class:`~streampack.loader.Loader` given it reads."""
        return self.sources, self

    def __repr__(self) -> str:
        sizes = ", ".join(f"{name}: {len(data)}" for name, data in self.sources.items())
        return f"Mixture({{{sizes}}}, seed={self.seed}, block_size={self.block_size}, stop={self.stop!r})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_orders": None, "_blocks": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._orders = self._make_orders()

    # --- the schedule -----------------------------------------------------------------------------------

    def _counts(self, weights: Mapping[str, float]) -> Counts:
        """Positions per block of each source: the weights times the block size, by largest remainder."""
        unknown = sorted(set(weights) - set(self.names))
        if unknown:
            raise OptionsError(
                f"weights name sources the mixture does not have: {unknown} (it has {list(self.names)})"
            )
        exact: list[Fraction] = []
        for name in self.names:
            weight = weights.get(name, 0)
            if (
                isinstance(weight, bool)
                or not isinstance(weight, numbers.Real)
                or not math.isfinite(weight)
                or weight < 0
            ):
                raise OptionsError(f"the weight of {name!r} must be a non-negative number (got {weight!r})")
            exact.append(Fraction(float(weight)))
        total = sum(exact)
        if total == 0:
            raise OptionsError(
                f"the weights are all zero: {dict(weights)}; give some source a positive weight"
            )
        quotas = [w * self.block_size / total for w in exact]
        counts = [math.floor(q) for q in quotas]
        by_remainder = sorted(range(len(quotas)), key=lambda j: (counts[j] - quotas[j], j))
        for j in by_remainder[: self.block_size - sum(counts)]:
            counts[j] += 1
        for name, share, count in zip(self.names, exact, counts, strict=True):
            if share and not count:
                fits = math.ceil(total / share)
                raise OptionsError(
                    f"the weight of {name!r} ({float(share / total):.3g} of the mixture) is less than one "
                    f"position per block of block_size={self.block_size}; use block_size={fits} or more"
                )
        return tuple(counts)

    def _set_schedule(self, segments: Sequence[tuple[int, Counts]]) -> None:
        """Keep the segments (first block, counts), merging neighbours with equal counts."""
        merged: list[tuple[int, Counts]] = []
        for first, counts in sorted(segments):
            if merged and merged[-1][0] == first:
                raise OptionsError(
                    f"two stages start in the same block ({first}, positions from "
                    f"{first * self.block_size}); stages must be at least block_size={self.block_size} "
                    "positions apart"
                )
            if not merged or merged[-1][1] != counts:
                merged.append((first, counts))
        self._schedule = tuple(merged)
        self._firsts = np.array([first for first, _ in merged], dtype=np.int64)
        self._matrix = np.array([counts for _, counts in merged], dtype=np.int64)
        self._cumulative = np.concatenate([np.zeros((len(merged), 1), np.int64), self._matrix.cumsum(1)], 1)
        lengths = np.diff(self._firsts)
        # Cursor of each source at the first block of each segment, summed in Python ints: a damaged
        # schedule fails to fit int64 here, loudly, rather than wrapping.
        bases = [[0] * len(self.names)]
        for length, counts in zip(lengths.tolist(), self._matrix[:-1].tolist(), strict=True):
            bases.append([b + length * c for b, c in zip(bases[-1], counts, strict=True)])
        self._bases = np.array(bases, dtype=np.int64)
        self._orders = self._make_orders()
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._end = self._find_end()

    def _make_orders(self) -> list[Shuffled | BlockShuffled]:
        return [
            single_order(len(data), seed=seed, shuffle=self.shuffle, name=name)
            for name, data, seed in zip(self.names, self.sources.values(), self._seeds, strict=True)
        ]

    def _find_end(self) -> int | None:
        """With ``stop="first_exhausted"``: the first block some source cannot fill from its first epoch."""
        if self.stop == "never":
            return None
        sizes = [len(data) for data in self.sources.values()]
        nexts = [*self._firsts[1:].tolist(), None]
        for (first, counts), base, following in zip(self._schedule, self._bases.tolist(), nexts, strict=True):
            ends = [
                first + max(0, (size - start) // count)
                for size, start, count in zip(sizes, base, counts, strict=True)
                if count
            ]
            block = min(ends)
            if following is None or block < following:
                return min(block * self.block_size, MAX_POSITION)
        return None  # pragma: no cover - the last segment always ends

    # --- the Order protocol -----------------------------------------------------------------------------

    @property
    def end(self) -> int | None:
        """Where the stream ends (``stop="first_exhausted"``), or ``None``."""
        return self._end

    def __call__(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Source ids and sample ids at ``positions``."""
        blocks, offsets = np.divmod(positions, self.block_size)
        sources = np.empty(len(positions), dtype=np.int64)
        ranks = np.empty(len(positions), dtype=np.int64)
        for block, mine in groups(blocks):
            labels, block_ranks = self._block(block)
            sources[mine] = labels[offsets[mine]]
            ranks[mine] = block_ranks[offsets[mine]]
        segments = np.searchsorted(self._firsts, blocks, side="right") - 1
        cursors = (
            self._bases[segments, sources]
            + (blocks - self._firsts[segments]) * self._matrix[segments, sources]
            + ranks
        )
        samples = np.empty(len(positions), dtype=np.int64)
        for source, mine in groups(sources):
            samples[mine] = self._orders[source].samples(cursors[mine])
        return sources, samples

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """Each offset's source in ``block``, and its rank among that source's offsets there.

        Ranks rise with the offset, so a source's cursor does too: inside a block, as across blocks, a
        source serves its samples in its own order, and never starts its next epoch early.
        """
        cached = self._blocks.get(block)
        if cached is not None:
            return cached
        segment = int(np.searchsorted(self._firsts, block, side="right")) - 1
        counts = self._matrix[segment]
        labels = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        firsts = np.repeat(self._cumulative[segment, :-1], counts)
        ranks = np.arange(self.block_size, dtype=np.int64) - firsts
        if self.shuffle is not False and np.count_nonzero(counts) > 1:
            slots = Permutation(self.block_size, seed=self._blocks_seed, epoch=block)(ranks + firsts)
            labels = labels[slots]
            by_source = np.argsort(labels, kind="stable")
            ranks = np.empty_like(ranks)
            ranks[by_source] = np.arange(self.block_size, dtype=np.int64) - firsts
        if len(self._blocks) >= _CACHED_BLOCKS:
            self._blocks.pop(next(iter(self._blocks)))
        self._blocks[block] = (labels, ranks)
        return labels, ranks

    def consumed(self, position: int) -> list[int]:
        """Samples each source has served once the stream reaches ``position``."""
        block, offset = divmod(position, self.block_size)
        segment = int(np.searchsorted(self._firsts, block, side="right")) - 1
        counts = self._matrix[segment].tolist()
        served = [
            b + (block - int(self._firsts[segment])) * c
            for b, c in zip(self._bases[segment].tolist(), counts, strict=True)
        ]
        if offset:
            labels, _ = self._block(block)
            for source, extra in enumerate(np.bincount(labels[:offset], minlength=len(self.names)).tolist()):
                served[source] += extra
        return [int(count) for count in served]

    def sizes(self) -> list[int]:
        """Samples per epoch of each source."""
        return [len(data) for data in self.sources.values()]

    def weights(self, position: int) -> list[float]:
        """Each source's share of the blocks in force at ``position`` (the rounded weights)."""
        segment = int(np.searchsorted(self._firsts, position // self.block_size, side="right")) - 1
        return [count / self.block_size for count in self._matrix[segment].tolist()]

    def epoch_size(self, what: str) -> int:
        """Refused: each source runs through its own epochs.

        Raises:
            TypeError: always.
        """
        raise TypeError(
            f"{what} is not defined for a mixture: each source runs through its own epochs; "
            "loader.realised() shows where each one stands"
        )

    def batches(self, batch_size: int, drop_last: bool) -> int:
        """Global batches until the stream stops (``stop="first_exhausted"``; see
        :func:`~streampack.order.count_batches`)."""
        return count_batches(self.end, batch_size, drop_last)

    def fingerprint(self) -> dict[str, Any]:
        """Seed, shuffle, block size, each source's seed and data, and the schedule of per-block counts."""
        return {
            "kind": "mixture",
            "seed": self.seed,
            "shuffle": shuffle_fingerprint(self.shuffle),
            "block_size": self.block_size,
            "sources": {
                name: {"seed": seed, "data": data}
                for name, seed, data in zip(self.names, self._seeds, self._data, strict=True)
            },
            "schedule": [
                [first, {name: c for name, c in zip(self.names, counts, strict=True) if c}]
                for first, counts in self._schedule
            ],
        }

    def resumed(self, saved: Mapping[str, Any], position: int) -> Mixture:
        """This mixture continued from a checkpoint: its schedule before ``position``, this one's after.

        Blocks begun before ``position`` keep the counts they were served with; from the next block on,
        this mixture's weights apply. Sources keep the seeds they were read with, so each cursor
        continues its epoch. A checkpoint of a single dataset resumes as the source with the same data.

        Raises:
            LoaderStateError: seed, shuffle or block size differ; a source of the checkpoint is missing
                here or has other data; or the checkpoint is not a loader order.
        """
        history, seeds = self._history(saved)
        for name, (_, data) in seeds.items():
            if name not in self.sources:
                raise LoaderStateError(
                    f"the checkpoint reads source {name!r}, which this mixture does not have (it has "
                    f"{list(self.names)}); keep it in the mixture, with weight 0 to stop reading it"
                )
            here = self._data[self.names.index(name)]
            if data != here:
                raise LoaderStateError(mismatch(f"data of source {name!r}", data, here))
        started = -(-position // self.block_size)  # blocks that had begun
        own = self._schedule
        in_force = own[int(np.searchsorted(self._firsts, started, side="right")) - 1][1]
        segments = [segment for segment in history if segment[0] < started]
        segments += [(started, in_force)] + [segment for segment in own if segment[0] > started]
        resumed = object.__new__(Mixture)
        resumed.__dict__.update(self.__dict__)
        resumed._seeds = [
            seeds[name][0] if name in seeds else seed
            for name, seed in zip(self.names, self._seeds, strict=True)
        ]
        resumed._set_schedule(segments)
        return resumed

    def _history(
        self, saved: Mapping[str, Any]
    ) -> tuple[list[tuple[int, Counts]], dict[str, tuple[int, Any]]]:
        """The checkpoint's schedule (as counts over this mixture's names) and each source's seed and data."""
        kind, shuffle = saved.get("kind"), shuffle_fingerprint(self.shuffle)
        if kind in ("shuffled", "blocks"):
            data = saved.get("data")
            names = [name for name, mine in zip(self.names, self._data, strict=True) if mine == data]
            if not names:
                raise LoaderStateError(
                    f"the checkpoint read one dataset ({_summary(data)}), which is none of this mixture's "
                    f"sources {list(self.names)}; add it to the mixture to continue its epoch"
                )
            saved_shuffle = (
                saved.get("shuffle")
                if kind == "shuffled"
                else {"block": saved.get("block"), "window": saved.get("window")}
            )
            if saved_shuffle != shuffle:
                raise LoaderStateError(mismatch("shuffle", saved_shuffle, shuffle))
            counts = tuple(self.block_size if name == names[0] else 0 for name in self.names)
            try:
                seed = _saved_seed(saved.get("seed"))
            except ValueError as error:
                raise LoaderStateError(f"the checkpoint's order is damaged ({error})") from error
            return [(0, counts)], {names[0]: (seed, data)}
        if kind != "mixture":
            raise LoaderStateError(
                f"the checkpoint's order is not a loader order (kind={kind!r}); it is damaged"
            )
        for key, mine in (("seed", self.seed), ("shuffle", shuffle), ("block_size", self.block_size)):
            if saved.get(key) != mine:
                raise LoaderStateError(mismatch(key, saved.get(key), mine))
        try:
            seeds = {
                name: (_saved_seed(info["seed"]), info["data"]) for name, info in saved["sources"].items()
            }
            history = self._saved_schedule(saved["schedule"], set(seeds))
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise LoaderStateError(f"the checkpoint's mixture schedule is damaged ({error})") from error
        return history, seeds

    def _saved_schedule(self, schedule: object, known: set[str]) -> list[tuple[int, Counts]]:
        """A checkpoint's schedule as counts over this mixture's names, refused unless a mixture saved it.

        Raises:
            ValueError: not a list of ``[first block, {source: count}]`` from block 0 in increasing order,
                counts of sources the checkpoint does not read, or counts that are not non-negative
                integers filling a block.
        """
        if not isinstance(schedule, list) or not schedule:
            raise ValueError(
                f"the schedule is a non-empty list of [first block, counts] (got {_summary(schedule)})"
            )
        history: list[tuple[int, Counts]] = []
        for first, counts in schedule:
            previous = history[-1][0] if history else -1
            if not _is_whole(first) or first <= previous:
                raise ValueError(f"a segment at block {first!r} follows one at block {previous}")
            if not isinstance(counts, Mapping) or not set(counts) <= known:
                raise ValueError(f"counts {_summary(counts)} name sources other than {sorted(known)}")
            whole = all(_is_whole(c) and c >= 0 for c in counts.values())
            if not whole or sum(counts.values()) != self.block_size:
                raise ValueError(f"counts {_summary(counts)} do not fill a block of {self.block_size}")
            history.append((int(first), tuple(int(counts.get(name, 0)) for name in self.names)))
        if history[0][0] != 0:
            raise ValueError(f"the schedule starts at block {history[0][0]}, not 0")
        return history


def _checked_sources(sources: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(sources, Mapping) or not sources:
        raise OptionsError(
            "a Mixture takes a dict of name -> dataset, e.g. {'web': web.sequences(2048)} "
            f"(got {_summary(sources)})"
        )
    widths, tokenizers = {}, {}
    for name, data in sources.items():
        if not isinstance(name, str) or not name:
            raise OptionsError(f"source names must be non-empty strings (got {name!r})")
        if not hasattr(data, "__len__") or not hasattr(data, "__getitem__"):
            raise OptionsError(
                f"source {name!r} is a {type(data).__name__}, not a dataset (len() and [indices])"
            )
        if len(data) == 0:
            raise OptionsError(f"source {name!r} has no samples")
        width = getattr(data, "width", None) or (
            data.shape[1] if isinstance(data, np.ndarray) and data.ndim == 2 else None
        )
        if width is not None:
            widths[name] = int(width)
        cache = getattr(data, "cache", None)
        if cache is not None:
            tokenizer = cache.manifest.tokenizer
            tokenizers[name] = (
                tokenizer["kind"],
                tokenizer.get("sha256") or tokenizer["name"],
                tokenizer["vocab_size"],
            )
    if len(set(widths.values())) > 1:
        raise OptionsError(f"the sources' samples must have one width (seq_len + overlap); got {widths}")
    if len(set(tokenizers.values())) > 1:
        described = {name: f"{kind} {ident[:16]}" for name, (kind, ident, _) in tokenizers.items()}
        raise OptionsError(
            f"the sources were tokenized with different tokenizers ({described}): their ids mean different "
            "tokens. Build every cache with the tokenizer the model uses."
        )
    return dict(sources)


def _stages(
    weights: Mapping[str, float] | None, stages: Sequence[tuple[int, Mapping[str, float]]] | None
) -> list[tuple[int, Mapping[str, float]]]:
    if (weights is None) == (stages is None):
        raise OptionsError("give a Mixture either weights={...} or stages=[(0, {...}), ...], one of the two")
    if weights is not None:
        return [(0, weights)]
    assert stages is not None
    checked: list[tuple[int, Mapping[str, float]]] = []
    for k, stage in enumerate(stages):
        if not (isinstance(stage, (tuple, list)) and len(stage) == 2 and isinstance(stage[1], Mapping)):
            raise OptionsError(
                f"each stage is a (position, weights) pair, e.g. (0, {{'web': 1.0}}) (got {stage!r})"
            )
        position = check_int(f"stages[{k}] position", stage[0], min=0, max=MAX_POSITION)
        if checked and position <= checked[-1][0]:
            raise OptionsError(
                f"stages must be in increasing order of position (got {position} after {checked[-1][0]})"
            )
        checked.append((position, stage[1]))
    if not checked or checked[0][0] != 0:
        raise OptionsError("the first stage must start at position 0, e.g. stages=[(0, {'web': 1.0}), ...]")
    return checked


def _first_block(position: int, block_size: int) -> int:
    """The first block starting at or after ``position``."""
    return -(-position // block_size)


def _derive(seed: int, tag: str) -> int:
    """A 64-bit seed for one use of a mixture's seed (the blocks, or one named source)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{tag}".encode(), digest_size=8).digest(), "little")


def _is_whole(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _saved_seed(value: object) -> int:
    """A checkpoint's source seed, which must be one a Mixture derives: an integer in ``[0, 2**64)``."""
    if not _is_whole(value) or not 0 <= int(value) < 2**64:  # type: ignore[call-overload]
        raise ValueError(f"a source's seed must be an integer in [0, 2**64) (got {_summary(value)})")
    return int(value)  # type: ignore[call-overload]


def _summary(value: object, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

"""Several datasets read as one stream by weight: exact per block, each source through its own epochs.

A block of ``block_size`` positions holds ``c_j`` positions of source ``j`` (the weights times the block
size, rounded by largest remainder), shuffled by a seeded :class:`~streampack.order.permutation.Permutation`.
Source ``j`` serves its samples in its own order, through its own epochs, at a *cursor*: the samples it
served in earlier blocks plus its rank in this one. The cursors before block ``k`` are a sum over the
schedule's segments, so the map is pure and O(1) in the position. A checkpoint records the schedule so far:
a run resumes with new weights or sources, blocks already begun keep their counts, and every cursor
continues, so no sample is served twice or skipped within an epoch.

A source may **grow** while it is read (a :class:`~streampack.follow.Follow` of a running build): a loader
waits before a batch until it knows the samples its cursor reaches (:mod:`streampack.loader.growing`), so
the weights are kept exactly; ``stop="first_exhausted"`` is refused, as the end would depend on the build.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

import numpy as np

from streampack._checks import check_choice, check_int
from streampack.errors import OptionsError
from streampack.format.sections import UNDECLARED
from streampack.order import count_batches, data_fingerprint, derive, groups, kept, schedule
from streampack.order.blockshuffle import BlockShuffle, check_shuffle, shuffle_fingerprint, single_order
from streampack.order.permutation import Permutation
from streampack.order.schedule import Counts, summary

__all__ = ["Mixture"]

Stop = Literal["never", "first_exhausted"]
# Block tables kept for reuse (16 bytes per position): enough for the blocks that a plan of a few
# thousand rows spans in one DataLoader worker.
_CACHED_BLOCKS = 8


class Mixture:
    """Datasets mixed by weight into one stream, resumable with changed weights or added sources.

    Give it to a :class:`~streampack.loader.Loader` in place of one dataset; ranks, workers and
    checkpoints work unchanged. It is both its sources' order and their holder, so ``Loader(mix)`` reads
    ``mix.sources`` in the order ``mix``.

    Example::

        mix = Mixture(
            {"web": web.sequences(2048), "code": code.sequences(2048)},
            stages=[(0, {"web": 0.9, "code": 0.1}), (5_000_000, {"web": 0.7, "code": 0.3})],
            seed=0,
        )
        loader = Loader(mix, batch_size=32)

    Args:
        sources: name -> dataset (e.g. ``cache.sequences(seq_len)``), all of one sample width and one
            tokenizer. Names identify sources in checkpoints, stages and reports.
        weights: name -> non-negative weight, normalised; sources left out get 0. Same as
            ``stages=[(0, weights)]``.
        stages: ``(position, weights)`` pairs, the first at position 0: the weights change from the first
            block starting at or after ``position`` (samples since the run started).
        seed: seed of the block order and of each source's order.
        shuffle: permute positions inside a block and samples inside each source's epochs; else both in
            order. A :class:`~streampack.order.blockshuffle.BlockShuffle` reads each source block-shuffled.
        block_size: positions per block. Weights are rounded to multiples of ``1 / block_size``; each
            source with a positive weight needs at least one position per block.
        stop: ``"never"`` (each source wraps into its next epoch) or ``"first_exhausted"`` (the stream
            ends before the first block that needs a sample of some source's second epoch).

    Raises:
        OptionsError: (a ``ValueError``) the sources, weights, stages or block size are not allowed; the
            message says which and why (for a weight below one position per block, the block size that
            fits).
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
        if (growing := list(growing_sources(self))) and stop != "never":  # its end is not known yet
            end = f"its end is not known, so stop={stop!r} does not apply: use stop='never'"
            raise OptionsError(f"source {growing[0]!r} grows while read (its build runs): {end}")
        self._data = [data_fingerprint(data) for data in self.sources.values()]
        self._seeds = [derive(self.seed, f"source:{name}") for name in self.names]
        self._blocks_seed = derive(self.seed, "blocks")
        self._set_schedule(schedule.segments(weights, stages, self.names, self.block_size))
        if self.end == 0:
            raise OptionsError(
                "the mixture would stop before its first block: some source has fewer samples than its share "
                f"of a block of {self.block_size}; use a smaller block_size, or stop='never'"
            )

    def sources_and_order(self) -> tuple[dict[str, Any], Mixture]:
        """Its sources, and itself as their order."""
        return self.sources, self

    def __repr__(self) -> str:
        sizes = ", ".join(f"{name}: {size}" for name, size in zip(self.names, self.sizes(), strict=True))
        return f"Mixture({{{sizes}}}, seed={self.seed}, block_size={self.block_size}, stop={self.stop!r})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_orders": None, "_blocks": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._orders = self._make_orders()

    # --- the schedule -----------------------------------------------------------------------------------

    def _set_schedule(self, segments: Sequence[tuple[int, Counts]]) -> None:
        """Keep the segments ``(first block, counts)`` and the tables the map reads."""
        self._schedule = schedule.merged(segments, self.block_size)
        self._firsts, self._matrix, self._bases = schedule.tables(self._schedule)
        self._orders = self._make_orders()
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._end = None
        if self.stop == "first_exhausted":
            sizes = [len(data) for data in self.sources.values()]
            self._end = schedule.exhausted(self._schedule, self._bases, sizes, self.block_size)

    def _make_orders(self) -> list[Any]:
        """Each source's order of its samples; a growing source has its own."""
        return [
            data.order if grows(data) else single_order(len(data), seed=seed, shuffle=self.shuffle, name=name)
            for name, data, seed in zip(self.names, self.sources.values(), self._seeds, strict=True)
        ]

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
        """Each offset's source in ``block``, and its rank among that source's offsets there (rising with the
        offset, so within a block too a source serves its own order and never starts its next epoch early)."""
        cached = self._blocks.get(block)
        if cached is not None:
            return cached
        segment = int(np.searchsorted(self._firsts, block, side="right")) - 1
        counts = self._matrix[segment]
        labels = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        firsts = np.repeat(np.cumsum(counts) - counts, counts)
        ranks = np.arange(self.block_size, dtype=np.int64) - firsts
        if self.shuffle is not False and np.count_nonzero(counts) > 1:
            slots = Permutation(self.block_size, seed=self._blocks_seed, epoch=block)(ranks + firsts)
            labels = labels[slots]
            by_source = np.argsort(labels, kind="stable")
            ranks = np.empty_like(ranks)
            ranks[by_source] = np.arange(self.block_size, dtype=np.int64) - firsts
        self._blocks = kept(self._blocks, block, (labels, ranks), keep=_CACHED_BLOCKS - 1)
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
        """Samples per epoch of each source (so far, for a growing source)."""
        return [data.order.sizes()[0] if grows(data) else len(data) for data in self.sources.values()]

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
        """Global batches until the stream stops (``stop="first_exhausted"``)."""
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

        Sources keep the seeds they were read with, so each cursor continues its epoch. A single dataset's
        checkpoint continues as the source with its data.

        Raises:
            LoaderStateError: seed, shuffle or block size differ; a source of the checkpoint is missing
                here or has other data; or the checkpoint is not a loader order.
        """
        history, seeds = schedule.saved_history(
            saved,
            names=self.names,
            data=self._data,
            seed=self.seed,
            shuffle=shuffle_fingerprint(self.shuffle),
            block_size=self.block_size,
        )
        started = -(-position // self.block_size)  # blocks that had begun
        resumed = copy.copy(self)
        resumed._seeds = [
            seeds[name][0] if name in seeds else seed
            for name, seed in zip(self.names, self._seeds, strict=True)
        ]
        resumed._set_schedule(schedule.spliced(history, self._schedule, started))
        return resumed


def _checked_sources(sources: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(sources, Mapping) or not sources:
        raise OptionsError(
            "a Mixture takes a dict of name -> dataset, e.g. {'web': web.sequences(2048)} "
            f"(got {summary(sources)})"
        )
    widths, tokenizers = {}, {}
    checked = {}
    for name, data in sources.items():
        if not isinstance(name, str) or not name:
            raise OptionsError(f"source names must be non-empty strings (got {name!r})")
        if grows(getattr(data, "dataset", None)):  # a Follow: the source that grows it reads
            if data.then == "end":  # its cursor runs on past its last era here: its end is not the run's
                raise OptionsError(
                    f"source {name!r} follows a build with then='end', which a Mixture cannot keep: there it "
                    "serves epochs of the finished cache after its last era. Use then='epochs' (the "
                    "default), or the Mixture's stop= to end the run"
                )
            data = data.dataset
        checked[name] = data
        if grows(data):  # what it holds now says its width and tokenizer
            data = data.view()
        elif not hasattr(data, "__len__") or not hasattr(data, "__getitem__"):
            raise OptionsError(
                f"source {name!r} is a {type(data).__name__}, not a dataset (len() and [indices])"
            )
        elif len(data) == 0:
            raise OptionsError(f"source {name!r} has no samples")
        width = getattr(data, "width", None) or (
            data.shape[1] if isinstance(data, np.ndarray) and data.ndim == 2 else None
        )
        if width is not None:
            widths[name] = int(width)
        cache = getattr(data, "cache", None)
        if cache is not None and cache.manifest.tokenizer.kind != UNDECLARED:
            tokenizer = cache.manifest.tokenizer
            tokenizers[name] = (tokenizer.kind, tokenizer.identity, tokenizer.vocab_size)
    if len(set(widths.values())) > 1:
        raise OptionsError(f"the sources' samples must have one width (seq_len + overlap); got {widths}")
    if len(set(tokenizers.values())) > 1:
        described = {name: f"{kind} {ident[:16]}" for name, (kind, ident, _) in tokenizers.items()}
        raise OptionsError(
            f"the sources were tokenized with different tokenizers ({described}): their ids mean different "
            "tokens. Build every cache with the tokenizer the model uses."
        )
    return checked


def grows(data: object) -> bool:
    """Whether ``data`` grows while it is read (a :class:`~streampack.loader.growing.Growing`)."""
    return all(hasattr(data, name) for name in ("order", "known", "grow", "view"))


def growing_sources(mixture: Mixture) -> dict[str, Any]:
    """The sources of ``mixture`` that grow while they are read, by name."""
    return {name: data for name, data in mixture.sources.items() if grows(data)}


def with_sources(mixture: Mixture, replaced: Mapping[str, Any]) -> Mixture:
    """``mixture`` reading ``replaced`` in place of the sources of those names (a loader's copy reads its
    own copies of the sources that grow)."""
    copied = copy.copy(mixture)
    copied.sources = {**mixture.sources, **replaced}
    copied._orders = copied._make_orders()
    return copied

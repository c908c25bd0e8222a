"""The training loader: global batches of a run's samples, split over ranks, resumable in O(1).

The loader keeps four small jobs and leaves the order to an :class:`~streampack.order.Order`:

* **Order**: a pure map from *global positions* (samples consumed since the run started, over all ranks)
  to samples. One dataset is read by :class:`~streampack.order.Shuffled` (epoch ``e`` is
  ``Permutation(N, seed=seed, epoch=e)``), or by a :class:`~streampack.order.blockshuffle.BlockShuffled`;
  several by a :class:`~streampack.order.mixture.Mixture`.
* **Batching and ranks**: the global batch at position ``p`` is positions ``[p, p + B)``, ``B`` the
  *global* batch size; rank ``r`` of ``W`` takes the contiguous ``r``-th slice of ``B / W`` of them. A
  run that ends (``epochs``, or a mixture that stops) ends with one partial global batch, dropped
  (``drop_last``) or split as evenly as possible over the ranks; one with fewer rows than ranks, which
  would leave some rank an empty batch, is refused up front.
* **State**: the position and the order's fingerprint, a small JSON dict. Resuming computes the next
  batch from it directly; nothing is replayed. Ranks only slice global batches and workers only take
  every n-th of them, so a run may resume with another world size, other DataLoader workers, and
  another global batch size (the next batch starts at the saved position).
* **Reading and output**: each source's rows are read straight into the batch array, which the format
  chosen by ``output=`` (:mod:`streampack.loader.collate`) turns into what a step yields.

Trade-off: the shuffle is global (any sample can follow any other), so reads are random; a memory-mapped
cache on a local disk or in the page cache serves them at memory speed, a network filesystem does not.
``shuffle=BlockShuffle(block=..., window=...)`` bounds them to a window of blocks of consecutive samples
(:mod:`streampack.order.blockshuffle`), for caches read from object storage.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from streampack._checks import check_int
from streampack.errors import LoaderStateError, OptionsError
from streampack.loader import prefetch
from streampack.loader.collate import Format, format_for
from streampack.loader.growing import Growing
from streampack.loader.lookahead import prefetch_steps, shard_files
from streampack.loader.options import (
    LoaderOptions,
    Output,
    SourceProgress,
    unknown_keyword,
    with_keywords,
)
from streampack.loader.state import LOADER_FORMAT, LOADER_VERSION, ORDERS, read_loader_state, read_order
from streampack.order import MAX_POSITION, Order, Ordered, data_fingerprint, groups
from streampack.order.blockshuffle import single_order
from streampack.samples.layout import BatchedSpans
from streampack.samples.sequences import (
    JoinedSequences,
    PackedSequences,
    holds_every_id,
    with_current_digests,
)
from streampack.store.localcopy import CachedStore

__all__ = ["STATE_VERSION", "DataSource", "Loader", "LoaderOptions", "Output", "SourceProgress"]

STATE_VERSION = LOADER_VERSION
"""Version of the dict :meth:`Loader.state_dict` returns; :meth:`Loader.load_state_dict` also reads 1."""

# The order is computed for this many upcoming rows at once: one call costs ~100 numpy dispatches
# whatever its size, which would otherwise dominate a small batch.
_PLAN_ROWS = 4096
_OPTION_NAMES = {field.name for field in dataclasses.fields(LoaderOptions)}


class DataSource(Protocol):
    """What a :class:`Loader` reads: ``len()`` samples, fetched a batch of indices at a time.

    :class:`streampack.samples.sequences.PackedSequences` is the usual one; a 2-D numpy array is one too
    (sample
    ``i`` is row ``i``), a list of arrays is not (it cannot be indexed by an array). A source may also offer
    ``read(indices, out=...)`` (fill the given array: used instead of ``[indices]`` when a batch is read
    from this source alone), ``boundaries(indices)`` (needed for ``output="dict"``), ``fingerprint()``
    (checked against checkpoints), ``dtype`` and ``width`` (tokens per sample).
    """

    def __len__(self) -> int: ...

    def __getitem__(self, indices: np.ndarray) -> np.ndarray: ...


class Loader:
    """Iterate over global batches of samples, this rank's share of each, resumable exactly in O(1).

    Iterating yields one batch per step, starting at the current position, until the run ends (forever
    when it is endless). Each yielded batch advances the position, so :meth:`state_dict` taken after a
    batch resumes at the next one.

    Example::

        loader = Loader(cache.sequences(2048, overlap=1), batch_size=32, seed=1)
        for batch in loader:  # (32, 2049) int64 arrays
            x, y = batch[:, :-1], batch[:, 1:]

    ``len(loader)`` is the number of batches of a run that ends (see :meth:`__len__`).

    Args:
        source: the samples, usually ``cache.sequences(seq_len)``; see :class:`DataSource`. A 2-D numpy
            array also is one; a list of arrays is not (``np.stack`` it). Or a
            :class:`~streampack.order.mixture.Mixture` of several, which comes with its order (seed,
            shuffle, when to stop); or a dict of name -> source, read in the ``order`` given.
        order: the :class:`~streampack.order.Order` to read the source(s) in, one name per source; by
            default the Loader makes one from ``seed``, ``shuffle`` and ``epochs``
            (:class:`~streampack.order.Shuffled`, or :class:`~streampack.order.blockshuffle.BlockShuffled`).
            An order given (or a Mixture's) is used as it is.
        batch_size: the GLOBAL batch size; each rank yields ``batch_size // world_size`` rows per step.
        seed: shuffle seed (default 0; not with an order given or a mixture, which have their own).
        shuffle: seeded random order, a different one every epoch; ``False``, stream order; or a
            :class:`~streampack.order.blockshuffle.BlockShuffle`, a locality-aware order for remote caches
            (default True; not with an order given or a mixture, which takes its own ``shuffle=``).
        rank: this process's rank.
        world_size: the number of ranks.
        drop_last: drop the partial last batch of a run that ends; else split it over the ranks (refused
            when it has fewer rows than ranks, see :class:`LoaderOptions`).
        epochs: epochs to run; ``None`` runs forever (not with an order given; a mixture's is
            ``Mixture(stop=...)``).
        output: ``"numpy"``, ``"dict"`` or ``"varlen"``; see :class:`LoaderOptions`.
        dtype: integer dtype of the token arrays; ``None`` keeps the cache's.
        collate: applied to every batch before it is yielded (e.g. ``torch.from_numpy``).

    Raises:
        TypeError: ``dataset`` is a list or tuple, or has no ``__len__`` or ``__getitem__``.
        OptionsError: (a ``ValueError``) an option is out of range, ``batch_size`` does not divide by
            ``world_size``, the dataset holds less than one global batch (with ``drop_last``),
            ``drop_last=False`` would give some rank an empty last batch (fewer rows than ranks; the
            message names the numbers and the fixes), ``dtype`` cannot hold the cache's ids,
            ``output="dict"`` is asked of samples it does not fit, an order or a mixture is given with
            ``seed``, ``shuffle`` or ``epochs``, an order does not name one source per source given, or a
            dict of sources comes without an order.
    """

    def __init__(
        self,
        source: DataSource | Mapping[str, DataSource] | Ordered | Growing,
        *,
        order: Order | None = None,
        options: LoaderOptions | None = None,
        collate: Callable[[Any], Any] | None = None,
        **keywords: Any,
    ) -> None:
        unknown = sorted(set(keywords) - _OPTION_NAMES)
        if unknown:
            raise unknown_keyword(type(self).__name__, unknown[0], sorted(_OPTION_NAMES))
        # seed=None and shuffle=None say "not given": the defaults, or an order's own.
        keywords = {k: v for k, v in keywords.items() if v is not None or k not in ("seed", "shuffle")}
        parts, order = _sources_and_order(source, order)
        if order is not None:
            _refuse_order_options(order, {k: keywords.get(k) for k in ("seed", "shuffle", "epochs")})
        self.options: LoaderOptions = with_keywords(LoaderOptions, options, keywords)
        self.dataset: Any = source
        self.collate = collate
        self._use([_Source(part) for part in parts])
        if order is None:  # the order of one dataset, from the options
            opts = self.options
            order = single_order(
                len(self.sources[0]),
                seed=opts.seed,
                shuffle=opts.shuffle,
                epochs=opts.epochs,
                data=self.sources[0].fingerprint,
            )
            self._check_size()
        elif len(order.names) != len(parts):
            raise OptionsError(
                f"the order reads {len(order.names)} sources ({', '.join(order.names)}), the Loader was "
                "given one; give a dict of name -> source, one per name of the order"
            )
        self.order: Order = order
        # Every checkpoint resumes against the order given here, never one an earlier load produced.
        self._configured: Order = self.order
        self._position = 0
        # Positions whose samples are known, and those the sources opened can read: all of them, unless
        # the source grows (see streampack.loader.growing).
        self._growing = source if isinstance(source, Growing) else None
        self._known = self._readable = 0 if self._growing is not None else MAX_POSITION
        self._check_sources()
        self.formatter: Format = format_for(self.options.output, [source.data for source in self.sources])
        self._check_last_batch()
        self._clear_caches()
        if self._growing is not None:  # what it knows now, which the view opened above holds
            self._grow(0)
            self._readable = self._known

    def _use(self, sources: list[_Source]) -> None:
        """Read from ``sources`` (joined into one token space when every one is a cache)."""
        self.sources = sources
        parts = [source.data for source in sources]
        joinable = all(isinstance(part, PackedSequences) for part in parts)
        self._joined = JoinedSequences(parts) if joinable else None  # type: ignore[arg-type]
        self._prefetches = prefetch_steps(self._joined) > 0  # decided once: not a check per batch

    @property
    def source_dtype(self) -> np.dtype:
        """The dtype that holds the tokens of every source: the cache dtype, for one cache."""
        dtype = np.result_type(*(source.dtype for source in self.sources))
        # int64 with uint64 promotes to float64, which would round ids: token ids fit int64.
        return dtype if dtype.kind in "iu" else np.dtype(np.int64)

    @functools.cached_property
    def _out_dtype(self) -> np.dtype:
        return np.dtype(self.options.dtype or self.source_dtype)

    @property
    def width(self) -> int:
        """Tokens per sample: ``seq_len + overlap``."""
        return self.sources[0].width

    @property
    def num_samples(self) -> int:
        """Samples per epoch of the dataset (of all sources together, for a mixture; of those known so
        far, for a source that grows)."""
        return sum(self.order.sizes())

    def _check_sources(self) -> None:
        opts = self.options
        for source in self.sources:
            if opts.dtype is not None and not np.can_cast(source.dtype, opts.dtype):
                raise OptionsError(
                    f"dtype={opts.dtype} cannot hold every id of the cache's {source.dtype} tokens; use "
                    "int64 (the default), a wider integer type, or None to keep the cache dtype"
                )

    def _check_size(self) -> None:
        """Refuse a dataset that holds no batch to iterate."""
        opts, n = self.options, len(self.sources[0])
        if n == 0 or (opts.drop_last and n < opts.batch_size):
            raise OptionsError(
                f"the dataset has {n} samples, fewer than one global batch of {opts.batch_size}: nothing "
                "to iterate. Use a smaller batch_size or seq_len, a larger cache"
                + (", or drop_last=False." if n else ".")
            )

    def _check_last_batch(self) -> None:
        """Refuse ``drop_last=False`` when the run's last partial global batch cannot give every rank a row.

        A rank with a 0-row batch computes a NaN mean loss, and DDP's all-reduce spreads the NaN
        gradients to every rank. The remainder is known up front, so this is refused here rather than
        padded with repeated samples: every served row stays a distinct sample, in the same order.
        """
        opts, end = self.options, self.order.end
        if opts.drop_last or end is None or end <= self._position:
            return
        left = end - self._position
        remainder = left % opts.batch_size
        if not 0 < remainder < opts.world_size:
            return
        plural = "s" if remainder > 1 else ""
        fixes = []
        if left >= opts.batch_size:
            fixes.append(f"drop_last=True (the run then skips its last {remainder} sample{plural})")
        other = _batch_size_for_ranks(left, opts.batch_size, opts.world_size)
        if other is not None:
            fixes.append(f"batch_size={other} (it leaves 0 or at least {opts.world_size} samples over)")
        fixes.append("fewer ranks, or more samples (a larger cache or a smaller seq_len)")
        raise OptionsError(
            f"drop_last=False would give {opts.world_size - remainder} of the {opts.world_size} ranks an "
            f"empty last batch: the {left} samples left in global batches of batch_size={opts.batch_size} "
            f"leave {left} mod {opts.batch_size} = {remainder} sample{plural} for the last one, fewer than "
            f"world_size={opts.world_size}. A mean loss over 0 rows is NaN, and DDP spreads it to every "
            f"rank. Use {', or '.join(fixes)}."
        )

    def _clear_caches(self) -> None:
        # The order of a few thousand upcoming rows: (first position, stride, count, sources, samples).
        self._plan: _Plan | None = None
        self._last_request: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickle options, sources, order and position; the planned rows are recomputed where unpickled.

        A copy of a loader over a growing source grows on its own: it gets its own copy of the source
        and of its order, and reopens the source (grown since) before its first read.
        """
        state = self.__dict__ | {"_plan": None, "_last_request": None}
        if self._growing is not None:
            growing = copy.copy(self._growing)
            state |= {"_growing": growing, "order": growing.order, "_configured": growing.order}
            state |= {"dataset": growing if self.dataset is self._growing else self.dataset}
            state["_readable"] = -1
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle; also a loader version 0.1 pickled, whose sources never grew."""
        self.__dict__.update(state)
        if "_growing" not in state:
            self._growing, self._known, self._readable = None, MAX_POSITION, MAX_POSITION

    def __repr__(self) -> str:
        o = self.options
        return (
            f"{type(self).__name__}({self.dataset!r}, batch_size={o.batch_size}, rank={o.rank}, "
            f"world_size={o.world_size}, "
            f"order={self.order!r}, position={self._position})"
        )

    # --- position ---------------------------------------------------------------------------------------

    @property
    def position(self) -> int:
        """Global position of the next batch: samples consumed since the run started, over all ranks."""
        return self._position

    @property
    def epoch(self) -> int:
        """Epoch of the dataset that the next batch starts in (one dataset only).

        Raises:
            TypeError: the loader reads a mixture, whose sources each run through their own epochs
                (see :meth:`realised`).
        """
        return self._position // self._single_size("epoch")

    @property
    def steps_per_epoch(self) -> int:
        """Global batches in one epoch: ``N // B``, or ``ceil(N / B)`` with ``drop_last=False``.

        Batches run on across epochs, so ``E`` epochs give ``len(loader)`` batches, up to ``E - 1`` more
        than ``E * steps_per_epoch``.

        Raises:
            TypeError: the loader reads a mixture, which has no single epoch.
        """
        n, batch = self._single_size("steps_per_epoch"), self.options.batch_size
        return n // batch if self.options.drop_last else -(-n // batch)

    def _single_size(self, what: str) -> int:
        return self.order.epoch_size(what)

    def __len__(self) -> int:
        """Global batches of the whole run, the same on every rank (for LR schedules and progress bars).

        Counted from position 0 at this batch size: ``end // B``, or ``ceil(end / B)`` with
        ``drop_last=False``, where ``end`` is ``epochs * N`` (or where a stopping mixture ends). It is not
        the number of batches still to come.

        Raises:
            TypeError: the run is endless (``epochs=None``, or a mixture that never stops).
        """
        return self.order.batches(self.options.batch_size, self.options.drop_last)

    @property
    def finished(self) -> bool:
        """True once the run has ended: no batch is left at the current position."""
        return self._global_rows(self._position) == 0

    def _global_rows(self, position: int) -> int:
        """Rows of the global batch at ``position``: ``B``, fewer for the last of a run, 0 past it (once
        a growing source knows the batch's samples: it may wait for them)."""
        batch = self.options.batch_size
        if position + batch > self._known and self._growing is not None:
            self._grow(min(position + batch, MAX_POSITION))
        end = self.order.end
        end = MAX_POSITION if end is None else end
        if end - position >= batch:
            return batch
        if self.options.drop_last or position >= end:
            return 0
        return end - position

    def __iter__(self) -> Iterator[Any]:
        """Yield batches from the current position on, advancing it as each batch is handed out.

        The position is read afresh before every batch, so :meth:`load_state_dict` takes effect at the
        next batch even in the middle of a loop.
        """
        while not self.finished:
            position = self._position
            batch = self.batch(position)
            self._position = position + self._global_rows(position)
            yield batch

    def schedule(self, start: int | None = None) -> Iterator[int]:
        """The position of every batch still to come, without changing the state.

        DataLoader workers use it to take every n-th batch (:mod:`streampack.torch`).

        Args:
            start: the position to start from instead of the current one.
        """
        position = self._position if start is None else start
        while rows := self._global_rows(position):
            yield position
            position += rows

    def advance(self, batches: int = 1) -> None:
        """Move the position forward by ``batches`` steps, as if that many batches had been consumed."""
        check_int("batches", batches, min=0, max=2**62)
        batch = self.options.batch_size
        if self._growing is not None:  # a run that ends must know where, to stop there
            self._grow(min(self._position + batches * batch, MAX_POSITION))
        end = self.order.end
        full = batches if end is None else min(batches, max(0, end - self._position) // batch)
        self._position = min(self._position + full * batch, MAX_POSITION)
        if batches > full:  # past the last full batch: the partial one, when it is served
            self._position += self._global_rows(self._position)

    # --- one batch --------------------------------------------------------------------------------------

    def batch(self, position: int, *, out: np.ndarray | None = None) -> Any:
        """This rank's batch at ``position``, formatted; a pure function of the position.

        Args:
            position: the global position of the batch's first sample (see :meth:`schedule`).
            out: an array of shape ``(rows, width)`` and the output dtype to read the tokens into
                (e.g. a view of shared memory); a new one when omitted.

        Returns:
            An array, or a dict of arrays, passed through ``collate`` when one was given.
        """
        sources, samples = self.picks(position)
        result = self.formatter(self._read(position, sources, samples, out), sources, samples)
        if self._prefetches:  # a cache in object storage: fetch the next steps' shards
            prefetch.after_batch(self, position)
        return self.collate(result) if self.collate is not None else result

    def batch_shape(self, position: int) -> tuple[int, int]:
        """Shape ``(rows, width)`` of this rank's token array at ``position``.

        Rows are ``batch_size // world_size`` except in the last, partial batch (``drop_last=False``).
        """
        lo, hi = self._span(position)
        return hi - lo, self.width

    def picks(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """Source ids and sample ids of this rank's rows of the batch at ``position`` (``int64``).

        Raises:
            IndexError: no batch starts at ``position`` (negative, or past the run's end).
        """
        if position + self.options.batch_size > self._readable and self._growing is not None:
            self._global_rows(position)  # waits for the source to hold the batch's samples
            if self._readable < self._known:
                self._reopen()
        if position < 0 or self._global_rows(position) == 0:
            raise IndexError(
                f"no batch at position {position}: positions start at 0 and the run ends at "
                f"{self.order.end}"
                + (" (drop_last drops a partial last batch)" if self.options.drop_last else "")
            )
        if self._global_rows(position) < self.options.batch_size:  # the last partial batch, on its own
            return self.order(np.arange(*self._span(position), dtype=np.int64))
        return self._planned(position)

    def indices(self, position: int) -> np.ndarray:
        """Sample indices of this rank's rows of the batch at ``position`` (one dataset; ``int64``).

        Raises:
            TypeError: the order reads several sources, whose sample ids overlap (see :meth:`picks`).
        """
        if len(self.order.names) > 1:
            raise TypeError(
                f"indices() is not defined for an order of several sources ({', '.join(self.order.names)}): "
                "each numbers its own samples; picks() gives each row's source and sample"
            )
        return self.picks(position)[1]

    def _span(self, position: int) -> tuple[int, int]:
        """This rank's slice ``[lo, hi)`` of the positions of the global batch at ``position``."""
        opts = self.options
        size = self._global_rows(position)
        return position + opts.rank * size // opts.world_size, position + (
            opts.rank + 1
        ) * size // opts.world_size

    def _planned(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """Picks of a full batch, computed together with those of the next few this process will read.

        The next few are at the stride seen between requests: every batch in a plain loop, every n-th in
        a DataLoader worker. Results never depend on it; only how much planned work is used does.
        """
        plan, last = self._plan, self._last_request
        self._last_request = position
        step = plan.step(position) if plan is not None else None
        if plan is None or step is None:
            plan, step = self._make_plan(position, last), 0
        return plan.sources[step], plan.samples[step]

    def _make_plan(self, position: int, last: int | None) -> _Plan:
        opts = self.options
        stride = position - last if last is not None and position > last else opts.batch_size
        end = self._planned_end()
        count = max(1, _PLAN_ROWS // opts.rows)
        if end is not None:
            count = max(1, min(count, (end - position - opts.batch_size) // stride + 1))
        count = min(count, (MAX_POSITION - position - opts.batch_size) // stride + 1)
        firsts = position + stride * np.arange(count, dtype=np.int64) + opts.rank * opts.rows
        sources, samples = self.order((firsts[:, None] + np.arange(opts.rows, dtype=np.int64)).reshape(-1))
        # The windows of the whole plan are split at shard boundaries and sorted by shard once, here.
        joined = self._joined
        spans = None
        if joined is not None:
            pads = joined.pads_of(sources)
            spans = BatchedSpans(joined.spans(sources, samples), opts.rows, count, self.width, pads)
        self._plan = _Plan(
            position, stride, count, sources.reshape(count, -1), samples.reshape(count, -1), spans
        )
        return self._plan

    def _ready(self, position: int) -> bool:
        """Whether the batch at ``position`` can be made now, without waiting for a growing source."""
        batch = self.options.batch_size
        return self._growing is None or position + batch <= min(self._known, self._readable)

    def _planned_end(self) -> int | None:
        """Where planning ahead stops: the run's end, or what a growing source knows so far."""
        end = self.order.end
        if self._growing is None:
            return end
        return self._known if end is None else min(end, self._known)

    # --- a growing source -------------------------------------------------------------------------------

    def _grow(self, stop: int) -> None:
        """Wait until the growing source knows the samples of positions ``[0, stop)``, or is complete (its
        end is then checked as the run's).

        Raises:
            BuildStalledError: (a build) it grew no further for its timeout.
            OptionsError: the source is complete, and its end leaves a rank an empty last batch.
        """
        growing = self._growing
        assert growing is not None
        if stop and stop <= self._known:
            return
        try:
            growing.grow(stop, self._check_last_batch)
        finally:
            self._known = growing.known

    def _reopen(self) -> None:
        """Read from the growing source as it stands now: it holds every sample of the positions known."""
        assert self._growing is not None
        known = self._known
        view = self._growing.view()
        self._use([_Source(view)])
        self.formatter = format_for(self.options.output, [view])
        self._clear_caches()
        self._readable = known

    def _read(
        self, position: int, sources: np.ndarray, samples: np.ndarray, out: np.ndarray | None
    ) -> np.ndarray:
        """The tokens of the batch at ``position``: copied from its planned spans, else split now."""
        plan, joined = self._plan, self._joined
        step = None if plan is None or plan.spans is None else plan.step(position)
        if out is None and step is not None and joined is not None:
            whole = plan.spans.whole(step, joined.rows, self._out_dtype)  # type: ignore[union-attr]
            if whole is not None:
                return whole
        if out is None:
            out = np.empty((len(samples), self.width), dtype=self._out_dtype)
        elif (
            not isinstance(out, np.ndarray)
            or out.shape != (len(samples), self.width)
            or not holds_every_id(self.source_dtype, out.dtype)
        ):
            raise ValueError(
                f"out must be a numpy array of shape {(len(samples), self.width)} and an integer dtype that "
                f"holds every {self.source_dtype} id (got {type(out).__name__} "
                f"{getattr(out, 'shape', '')} {getattr(out, 'dtype', '')})"
            )
        if joined is not None:  # every source is a cache
            if step is not None:
                plan.spans.read(step, out, joined.tokens, joined.rows)  # type: ignore[union-attr]
            else:
                joined.read(sources, samples, out)
            return out
        if len(self.sources) == 1:
            self.sources[0].read(samples, out)
            return out
        for source, rows in groups(sources):
            self.sources[source].read(samples[rows], out, rows)
        return out

    @property
    def prefetch_steps(self) -> int:
        """Steps ahead whose shards are fetched in the background: 0 unless the samples are read from
        object storage (see :func:`streampack.open`'s ``prefetch_steps``)."""
        return prefetch_steps(self._joined)

    def lookahead(
        self, position: int, steps: int, *, stride: int | None = None
    ) -> list[tuple[CachedStore, str]]:
        """The shard files that this process's ``steps`` batches after ``position`` read, nearest step
        first, each once: what :mod:`streampack.loader.prefetch` fetches ahead (the
        :class:`~streampack.loader.lookahead.Lookahead` protocol).

        Only files of caches read through a local copy (object storage) are listed, and only for batches
        that can be made now (a :class:`~streampack.loader.follow.Follow` lists those of the eras known).

        Args:
            position: the position of the batch just read.
            steps: batches ahead.
            stride: positions from one of this process's batches to its next (every n-th batch in a
                DataLoader worker); the global batch size by default.

        Returns:
            ``(store, key)`` pairs: the store of the local copy and the key of a file in it.
        """
        files: list[tuple[CachedStore, str]] = []
        seen: set[tuple[int, int]] = set()
        joined = self._joined  # read once: a growing source replaces it as it grows
        if joined is None:
            return files
        stride = stride or self.options.batch_size
        boundaries = self.options.output != "numpy"
        for step in range(1, steps + 1):
            at = position + step * stride
            if not self._ready(at) or self._global_rows(at) == 0:  # not known yet, or the run ends
                break
            sources, samples = self.order(np.arange(*self._span(at), dtype=np.int64))
            try:
                files += shard_files(joined, sources, samples, boundaries=boundaries, seen=seen)
            except IndexError:
                if self._joined is joined:
                    raise
                return files  # the growing source was reopened meanwhile: start over after the next batch
        return files

    # --- where the run stands ---------------------------------------------------------------------------

    def realised(self, steps: int = 0) -> list[SourceProgress]:
        """Per source: samples served, realised share and epoch, ``steps`` batches after the position.

        Computed from the order alone (nothing is read), so a plan far ahead is as cheap as now.

        Args:
            steps: batches to look ahead at this batch size; 0 reports the current position.
        """
        check_int("steps", steps, min=0, max=2**62)
        position = min(self._position + steps * self.options.batch_size, MAX_POSITION)
        if self.order.end is not None:
            position = min(position, self.order.end)
        served, weights = self.order.consumed(position), self.order.weights(position)
        sizes = [max(size, 1) for size in self.order.sizes()]  # a growing source may know none yet
        return [
            SourceProgress(name, weight, count, count / position if position else 0.0, size, count / size)
            for name, weight, count, size in zip(self.order.names, weights, served, sizes, strict=True)
        ]

    # --- state ------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position of this loader as a small JSON-serializable dict.

        Holds the format version, the position (samples consumed since the run started) and the order's
        fingerprint: what the positions mean (seed, data, and for a mixture its sources, weights and the
        schedule so far). Batch size and world size are recorded for information only: a state may be
        loaded with others.
        """
        return {
            "format": LOADER_FORMAT,
            "version": STATE_VERSION,
            "position": self._position,
            "order": self.order.fingerprint(),
            "batch_size": self.options.batch_size,
            "world_size": self.options.world_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a :meth:`state_dict`: the next batch starts where the saved run stopped.

        O(1): nothing is replayed. The world size, the DataLoader workers and the global batch size may
        differ from the saved run's: the next global batch starts at the saved position. A mixture may
        also come with new stages or sources (see :class:`~streampack.order.mixture.Mixture`). Version 1
        states (from streampack before mixtures) resume at the same place of the same epoch. What follows
        depends on the state and this loader's dataset or mixture only, not on states loaded before.

        Raises:
            LoaderStateError: (a ``ValueError``) the state is not a loader state of a supported version;
                it holds a key its version (or its order's kind) does not have, such as version 1's
                ``epoch`` in a version 2 state, lacks one, or holds a value of the wrong type (the key,
                the version and what it allows are named; see :mod:`streampack.loader.state`); it was saved
                with another seed, shuffle or data (both values are named); or its position is not an
                integer in ``[0, 2**62]``.
        """
        state = read_loader_state(state)
        version = state["version"]
        position, saved = self._upgrade(state) if version == 1 else (int(state["position"]), state["order"])
        # The orders that can continue the saved one read it strictly; the others refuse its kind. An
        # order of a kind of its own (not streampack's) reads its fingerprint itself.
        if saved.get("kind") in self._configured.resumes and saved.get("kind") in ORDERS:
            saved = read_order(saved, version)
        saved = with_current_digests(saved, [source.data for source in self.sources])
        order = self._configured.resumed(saved, position)
        previous = self.order, self._position
        self.order, self._position = order, position
        try:
            self._check_last_batch()
        except OptionsError:
            self.order, self._position = previous
            raise
        if self.dataset is previous[0]:  # a dataset that is its own order (a Mixture) follows it
            self.dataset = order
        self._clear_caches()

    def _upgrade(self, state: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        """A version 1 state (epoch and samples into it, read strictly) as a version 2 position and order:
        the same place of the same epoch."""
        epoch, samples = state["epoch"], state["samples_in_epoch"]
        n = self._single_size("resuming a version 1 state")
        if samples >= n or epoch * n + samples > MAX_POSITION:
            raise LoaderStateError(
                f"version 1 loader state has epoch={epoch!r}, samples_in_epoch={samples!r}: not a place in "
                f"an epoch of {n} samples within 2**62 samples; the state is damaged"
            )
        order = {
            "kind": "shuffled",
            "seed": state["seed"],
            "shuffle": state["shuffle"],
            "data": state["dataset"],
        }
        return epoch * n + samples, order


@dataclass(frozen=True)
class _Plan:
    """The picks of ``count`` full batches at ``first``, ``first + stride``, ...: this rank's rows of each."""

    first: int
    stride: int
    count: int
    sources: np.ndarray  # (count, rows)
    samples: np.ndarray  # (count, rows)
    spans: BatchedSpans | None  # where their tokens are, when every source is a cache

    def step(self, position: int) -> int | None:
        """Which planned batch starts at ``position``, if any."""
        step, offset = divmod(position - self.first, self.stride)
        return step if offset == 0 and 0 <= step < self.count else None


class _Source:
    """A :class:`DataSource` seen through the one contract the loader needs, probed once at creation."""

    def __init__(self, data: DataSource) -> None:
        _check_source(data)
        self.data = data
        self.size = len(data)
        self.fingerprint = data_fingerprint(data)
        width, dtype = getattr(data, "width", None), getattr(data, "dtype", None)
        if isinstance(data, np.ndarray) and data.ndim == 2:
            width = data.shape[1]
        if (width is None or dtype is None) and self.size:
            probe = np.asarray(data[np.zeros(1, dtype=np.int64)])
            width, dtype = (
                probe.shape[-1] if width is None else width,
                probe.dtype if dtype is None else dtype,
            )
        self.width: int = int(width or 0)
        self.dtype = np.dtype(dtype if dtype is not None else np.int64)
        # PackedSequences: read straight into the rows, skipping read()'s checks of the indices and of
        # out, which the loader made itself (in range, int64) and checked once here.
        self._read_rows = data._read if isinstance(data, PackedSequences) else None
        self._read_into = None if self._read_rows is not None else getattr(data, "read", None)

    def __len__(self) -> int:
        return self.size

    def read(self, indices: np.ndarray, out: np.ndarray, rows: np.ndarray | None = None) -> None:
        """Write sample ``indices[k]`` into ``out[rows[k]]`` (into ``out[k]`` when ``rows`` is None)."""
        if self._read_rows is not None:
            self._read_rows(indices, out, rows)
            return
        if self._read_into is not None and rows is None:
            self._read_into(indices, out=out)
            return
        tokens = np.asarray(self.data[indices])
        if rows is None:
            out[...] = tokens
        else:
            out[rows] = tokens


def _sources_and_order(
    source: DataSource | Mapping[str, DataSource] | Ordered | Growing, order: Order | None
) -> tuple[list[DataSource], Order | None]:
    """The sources a Loader reads and the order given with them (None: the Loader makes one)."""
    if isinstance(source, Growing):  # what it holds now, in the order that grows with it
        if order is not None:
            raise OptionsError(
                f"a {type(source).__name__} grows with its own order; give it without order=..."
            )
        return [source.view()], source.order
    if isinstance(source, Ordered):  # a Mixture: its sources, and itself their order
        if order is not None:
            raise OptionsError(
                f"a {type(source).__name__} reads its sources in its own order; give it, or its sources with "
                "order=..., not both"
            )
        sources, order = source.sources_and_order()
        return list(sources.values()), order
    if isinstance(source, Mapping):
        if order is None:
            raise OptionsError(
                f"several sources ({', '.join(map(str, source))}) are read in an order: pass order=..., or "
                "a streampack.order.mixture.Mixture of them"
            )
        if tuple(source) != tuple(order.names):
            raise OptionsError(
                f"the sources must be named as the order names them, in its order: {list(order.names)} "
                f"(got {list(source)})"
            )
        return list(source.values()), order
    return [source], order


def _refuse_order_options(order: Order, given: Mapping[str, object]) -> None:
    """An order given sets seed, shuffle and end itself: refuse the single-dataset order options rather
    than ignore them."""
    kind = type(order).__name__
    for name, value in given.items():
        if value is not None:
            where = f"{kind}(..., {name}=...)"
            if name == "epochs":
                where = "the order's own end, e.g. Mixture(stop='first_exhausted') or Shuffled(n, epochs=...)"
            raise OptionsError(
                f"{name}= sets the order of a single dataset; {kind} is an order of its own: use {where} "
                f"(got {name}={value!r})"
            )


def _check_source(dataset: object) -> None:
    """Refuse at creation what cannot serve ``dataset[index_array]``, rather than at the first batch."""
    missing = [name for name in ("__len__", "__getitem__") if not hasattr(dataset, name)]
    if isinstance(dataset, (list, tuple)):
        got = f"a {type(dataset).__name__} of {len(dataset)} items, which cannot be indexed by an array"
        hint = " (np.stack(samples) makes one of equal-length samples)"
    elif missing:
        got = f"{type(dataset).__name__}, which has no {' or '.join(missing)}"
        hint = ""
    else:
        return
    raise TypeError(
        f"the Loader reads each batch as dataset[index_array], a (rows, width) array (got {got}). Pass "
        f"cache.sequences(seq_len), a 2-D numpy array{hint}, or an object with __len__() and "
        "__getitem__(index array) returning a 2-D array."
    )


def _batch_size_for_ranks(n: int, batch_size: int, world_size: int) -> int | None:
    """The multiple of ``world_size`` nearest ``batch_size`` whose last global batch has a row per rank."""
    for k in range(1, 1000):
        for candidate in (batch_size - k * world_size, batch_size + k * world_size):
            if 0 < candidate <= n and (n % candidate == 0 or n % candidate >= world_size):
                return candidate
    return None

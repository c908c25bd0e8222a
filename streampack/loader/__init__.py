"""The training loader: global batches of a run's samples, split over ranks, resumable in O(1).

A :class:`Loader` composes a source and an order, and keeps four small jobs:

* **Order**: a pure map from *global positions* (samples consumed since the run started, over all ranks)
  to samples, any :class:`~streampack.order.Order` (``order=``). By default one dataset is read by
  :class:`~streampack.order.Shuffled` (epoch ``e`` is ``Permutation(N, seed=seed, epoch=e)``), or by a
  :class:`~streampack.order.blockshuffle.BlockShuffled`; a :class:`~streampack.order.mixture.Mixture`
  brings several sources with their order; a source that grows while it is read (a cache whose build
  runs: :mod:`streampack.loader.follow`) brings its own (:mod:`streampack.loader.growing`). The loader
  asks the order through its protocol only, so no kind of order is a special case here.
* **Batching and ranks**: the global batch at position ``p`` is positions ``[p, p + B)``, ``B`` the
  *global* batch size; rank ``r`` of ``W`` takes the contiguous ``r``-th slice of ``B / W`` of them. A
  run that ends (``epochs``, or a mixture that stops) ends with one partial global batch, dropped
  (``drop_last``) or split as evenly as possible over the ranks; one with fewer rows than ranks, which
  would leave some rank an empty batch, is refused up front.
* **State**: the position and the order's fingerprint, a small JSON dict. Resuming computes the next
  batch from it directly; nothing is replayed. Ranks only slice global batches and workers only take
  every n-th of them, so a run may resume with another world size, other DataLoader workers, and
  another global batch size (the next batch starts at the saved position).
* **Reading and output**: each source's rows are read straight into the batch array
  (:mod:`streampack.loader.reading`), which the format chosen by ``output=``
  (:mod:`streampack.loader.collate`) turns into what a step yields.

The settings are one :class:`~streampack.loader.options.LoaderOptions` (``options=``, or keywords).

Trade-off: the shuffle is global (any sample can follow any other), so reads are random; a memory-mapped
cache on a local disk or in the page cache serves them at memory speed, a network filesystem does not.
``shuffle=BlockShuffle(block=..., window=...)`` bounds them to a window of blocks of consecutive samples
(:mod:`streampack.order.blockshuffle`), for caches read from object storage.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from streampack._aliases import renamed
from streampack._checks import check_int
from streampack.errors import OptionsError
from streampack.loader import prefetch
from streampack.loader.collate import Format, format_for
from streampack.loader.given import given
from streampack.loader.growing import Growing, Reach
from streampack.loader.lookahead import prefetch_steps, shard_files
from streampack.loader.options import (
    LoaderOptions,
    Output,
    SourceShare,
    check_dtype,
    check_last_batch,
    check_size,
    shares,
)
from streampack.loader.reading import DataSource, Rows, _Source
from streampack.loader.state import LOADER_FORMAT, LOADER_VERSION, resume
from streampack.order import MAX_POSITION, Order, Ordered
from streampack.order.blockshuffle import single_order
from streampack.store.localcopy import CachedStore

__all__ = ["STATE_VERSION", "DataSource", "Loader", "LoaderOptions", "Output", "SourceShare"]
__getattr__ = renamed(__name__, {"SourceProgress": "SourceShare"})  # 0.1's name

STATE_VERSION = LOADER_VERSION
"""Version of the dict :meth:`Loader.state_dict` returns; :meth:`Loader.load_state_dict` also reads 1."""


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
        source: the samples, usually ``cache.sequences(seq_len)``; see :class:`DataSource` (a 2-D numpy
            array is one; a list of arrays is not: ``np.stack`` it). Or a
            :class:`~streampack.order.mixture.Mixture` of several, which comes with its order; or a dict of
            name -> source, read in the ``order`` given.
        order: the :class:`~streampack.order.Order` to read them in, one name per source. By default the
            Loader makes one from ``seed``, ``shuffle`` and ``epochs`` (:class:`~streampack.order.Shuffled`
            or :class:`~streampack.order.blockshuffle.BlockShuffled`); an order given (or a Mixture's) has
            its own, and those three keywords are then refused.
        options: a :class:`~streampack.loader.options.LoaderOptions`; keywords given too replace its
            fields.
        collate: applied to every batch before it is yielded (e.g. ``torch.from_numpy``).
        **keywords: the fields of :class:`~streampack.loader.options.LoaderOptions`, which describes them:
            ``batch_size`` (the GLOBAL batch size; required without ``options``), ``seed``, ``shuffle``,
            ``rank``, ``world_size``, ``drop_last``, ``epochs``, ``output``, ``dtype``.

    Raises:
        TypeError: ``source`` is a list or tuple, or has no ``__len__`` or ``__getitem__``; a keyword
            names no option.
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
        self.options, parts, order = given(type(self).__name__, source, order, options, keywords)
        self.dataset: Any = source
        self.collate = collate
        self._rows = Rows([_Source(part) for part in parts])
        if order is None:  # the order of one dataset, from the options
            opts, first = self.options, self.sources[0]
            order = single_order(
                len(first), seed=opts.seed, shuffle=opts.shuffle, epochs=opts.epochs, data=first.fingerprint
            )
            check_size(opts, len(first))
        self.order: Order = order
        # Every checkpoint resumes against the order given here, never one an earlier load produced.
        self._configured: Order = self.order
        self._position = 0
        # How far a growing source is known and opened (streampack.loader.growing); None: it is whole.
        self._reach = Reach(source) if isinstance(source, Growing) else None
        check_dtype(self.options, [source.dtype for source in self.sources])
        self.formatter: Format = format_for(self.options.output, [source.data for source in self.sources])
        self._check_last_batch()
        if self._reach is not None:  # what it knows now, which the view opened above holds
            self._reach.grow(0, self._check_last_batch)
            self._reach.readable = self._reach.known

    @property
    def sources(self) -> list[_Source]:
        """The sources read, in source-id order."""
        return self._rows.sources

    @property
    def source_dtype(self) -> np.dtype:
        """The dtype that holds the tokens of every source: the cache dtype, for one cache."""
        return self._rows.dtype

    @functools.cached_property
    def _out_dtype(self) -> np.dtype:
        return np.dtype(self.options.dtype or self.source_dtype)

    @property
    def width(self) -> int:
        """Tokens per sample: ``seq_len + overlap``."""
        return self._rows.width

    @property
    def num_samples(self) -> int:
        """Samples per epoch of the dataset (of all sources together, for a mixture; of those known so
        far, for a source that grows)."""
        return sum(self.order.sizes())

    def _check_last_batch(self) -> None:
        """Refuse ``drop_last=False`` when the run's last batch cannot give every rank a row (see
        :func:`~streampack.loader.options.check_last_batch`)."""
        check_last_batch(self.options, self.order.end, self._position)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle options, sources, order and position; the planned rows are recomputed where unpickled.

        A copy of a loader over a growing source grows on its own (see
        :class:`~streampack.loader.growing.Reach`), with its own copy of the source and its order.
        """
        state = self.__dict__ | {"_rows": copy.copy(self._rows)}  # without the plan: the copy's options
        if self._reach is not None:
            reach = copy.copy(self._reach)
            source = reach.source
            state |= {"_reach": reach, "order": source.order, "_configured": source.order}
            state |= {"dataset": source if self.dataset is self._reach.source else self.dataset}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle; also a loader version 0.1 pickled: it held its sources itself (now its
        :class:`~streampack.loader.reading.Rows`), and none of them grew (a Follow's conversion says)."""
        if "_rows" not in state:
            state = {"_reach": None} | Rows.of_version_0_1(state)
        self.__dict__.update(state)

    def __repr__(self) -> str:
        o = self.options
        return (
            f"{type(self).__name__}({self.dataset!r}, batch_size={o.batch_size}, rank={o.rank}, "
            f"world_size={o.world_size}, order={self.order!r}, position={self._position})"
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
        reach = self._reach
        if reach is not None and position + batch > reach.known:  # wait for a growing source
            reach.grow(min(position + batch, MAX_POSITION), self._check_last_batch)
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
        if self._reach is not None:  # a run that ends must know where, to stop there
            self._reach.grow(min(self._position + batches * batch, MAX_POSITION), self._check_last_batch)
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
        tokens = self._rows.read(position, sources, samples, out, self._out_dtype)
        result = self.formatter(tokens, sources, samples)
        if self._rows.prefetches:  # a cache in object storage: fetch the next steps' shards
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
        reach = self._reach
        if reach is not None and position + self.options.batch_size > reach.readable:
            self._global_rows(position)  # waits for the source to hold the batch's samples
            if reach.readable < reach.known:
                self._reopen()
        if position < 0 or self._global_rows(position) == 0:
            raise IndexError(
                f"no batch at position {position}: positions start at 0 and the run ends at "
                f"{self.order.end}"
                + (" (drop_last drops a partial last batch)" if self.options.drop_last else "")
            )
        if self._global_rows(position) < self.options.batch_size:  # the last partial batch, on its own
            return self.order(np.arange(*self._span(position), dtype=np.int64))
        return self._rows.picks(position, self.order, self.options, self._planned_end)

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

    def _planned_end(self) -> int | None:
        """Where planning ahead stops: the run's end, or what a growing source knows so far."""
        return self.order.end if self._reach is None else self._reach.end(self.order.end)

    def _reopen(self) -> None:
        """Read from the growing source as it stands now: it holds every sample of the positions known."""
        reach = self._reach
        assert reach is not None
        known, view = reach.known, reach.source.view()
        self._rows = Rows([_Source(view)])
        self.formatter = format_for(self.options.output, [view])
        reach.readable = known

    @property
    def prefetch_steps(self) -> int:
        """Steps ahead whose shards are fetched in the background: 0 unless the samples are read from
        object storage (see :func:`streampack.open`'s ``prefetch_steps``)."""
        return prefetch_steps(self._rows.joined)

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
        joined = self._rows.joined  # read once: a growing source replaces it as it grows
        if joined is None:
            return files
        stride = stride or self.options.batch_size
        boundaries = self.options.output != "numpy"
        for step in range(1, steps + 1):
            at = position + step * stride
            if self._reach is not None and not self._reach.ready(at + self.options.batch_size):
                break  # not known yet
            if self._global_rows(at) == 0:  # the run ends
                break
            sources, samples = self.order(np.arange(*self._span(at), dtype=np.int64))
            try:
                files += shard_files(joined, sources, samples, boundaries=boundaries, seen=seen)
            except IndexError:
                if self._rows.joined is joined:
                    raise
                return files  # the growing source was reopened meanwhile: start over after the next batch
        return files

    # --- where the run stands ---------------------------------------------------------------------------

    def realised(self, steps: int = 0) -> list[SourceShare]:
        """Per source: samples served, realised share and epoch, ``steps`` batches after the position.

        Computed from the order alone (nothing is read), so a plan far ahead is as cheap as now.

        Args:
            steps: batches to look ahead at this batch size; 0 reports the current position.
        """
        check_int("steps", steps, min=0, max=2**62)
        position = min(self._position + steps * self.options.batch_size, MAX_POSITION)
        if self.order.end is not None:
            position = min(position, self.order.end)
        return shares(self.order, position)

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
        position, order = resume(state, self._configured, [source.data for source in self.sources])
        previous = self.order, self._position
        self.order, self._position = order, position
        try:
            self._check_last_batch()
        except OptionsError:
            self.order, self._position = previous
            raise
        if self.dataset is previous[0]:  # a dataset that is its own order (a Mixture) follows it
            self.dataset = order
        self._rows.forget()

"""The training loader: global batches of a run's samples, split over ranks, resumable in O(1).

A :class:`Loader` composes a source and an :class:`~streampack.order.Order`, a pure map from *global
positions* (samples consumed since the run started, over all ranks) to samples. The global batch at
position ``p`` is positions ``[p, p + B)`` (:mod:`.batches`); rank ``r`` takes the ``r``-th slice. The
state is the position and the order's fingerprint (:mod:`.run`, :mod:`.state`), so a resume computes the
next batch directly, at any world size, worker count or batch size. Rows are read straight into the batch
array (:mod:`.reading`) and formatted as ``output=`` says (:mod:`.collate`).

Trade-off: the shuffle is global, so reads are random: fast from a local disk or the page cache, slow from
a network filesystem. ``shuffle=BlockShuffle(...)`` bounds them to a window of blocks, for object storage.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from streampack._checks import check_int
from streampack.errors import OptionsError
from streampack.loader.collate import format_for
from streampack.loader.exclusions import Exclusions
from streampack.loader.growing import Growing, Reach, growing_mixture
from streampack.loader.lookahead import files_ahead, prefetch_steps
from streampack.loader.metrics import Made, Meter
from streampack.loader.options import LoaderKeywords, LoaderOptions, Output, SourceShare
from streampack.loader.reading import DataSource, Rows, Source
from streampack.loader.run import Run, placed, reaching, resumed, started
from streampack.loader.seqlen import SeqLenSchedule
from streampack.loader.served import formatted
from streampack.loader.state import LOADER_VERSION, saved
from streampack.order import MAX_POSITION, Order, Ordered

if TYPE_CHECKING:
    from typing_extensions import Self, Unpack

    from streampack.loader.collate import Format
    from streampack.loader.prefetch import Prefetcher
    from streampack.store.localcopy import CachedStore

__all__ = [
    "STATE_VERSION",
    "DataSource",
    "Exclusions",
    "Loader",
    "LoaderOptions",
    "Output",
    "SeqLenSchedule",
    "SourceShare",
]

STATE_VERSION = LOADER_VERSION
"""Version of the dict :meth:`Loader.state_dict` returns; :meth:`Loader.load_state_dict` also reads 1."""


class Loader:
    """Iterate over global batches of samples, this rank's share of each, resumable exactly in O(1).

    Iterating yields one batch per step until the run ends (forever when it is endless); each batch
    advances the position, so a :meth:`state_dict` taken after a batch resumes at the next one.

    Example::

        loader = Loader(cache.sequences(2048, overlap=1), batch_size=32, seed=1)
        for batch in loader:  # (32, 2049) int64 arrays
            x, y = batch[:, :-1], batch[:, 1:]

    Over object storage it fetches the next steps' shards on a thread of its own (:mod:`.prefetch`):
    :meth:`close` it, or use ``with Loader(...) as loader:``.

    Args:
        source: a :class:`DataSource` such as ``cache.sequences(seq_len)`` or a 2-D numpy array; a
            :class:`~streampack.order.mixture.Mixture`, which brings its order; or a dict of name -> source.
        order: the :class:`~streampack.order.Order` to read them in, one name per source; by default one
            made of the options ``seed``, ``shuffle`` and ``epochs``.
        options: a :class:`~streampack.loader.options.LoaderOptions`; keywords replace its fields
            (``batch_size``, the GLOBAL batch size, is required).
        collate: applied to every batch before it is yielded (e.g. ``torch.from_numpy``).
        exclude: :class:`~streampack.loader.exclusions.Exclusions`, or a list of them in the run's order.

    Raises:
        TypeError: ``source`` cannot be read a batch of indices at a time, or a keyword names no option.
        OptionsError: (a ``ValueError``) an option does not fit, alone or with the source and order
            (:func:`~streampack.loader.run.started` lists each case).
    """

    _prefetcher: Prefetcher | None = None  # started by the first batch read from object storage

    def __init__(
        self,
        source: DataSource | Mapping[str, DataSource] | Ordered | Growing,
        *,
        order: Order | None = None,
        options: LoaderOptions | None = None,
        collate: Callable[[Any], Any] | None = None,
        exclude: Exclusions | Sequence[Exclusions] | None = None,
        **keywords: Unpack[LoaderKeywords],
    ) -> None:
        source = growing_mixture(source)
        self.meter = Meter()
        self.made: Made | None = None  # what making the last batch in this process took
        self._run = started(type(self).__name__, source, order, options, keywords, exclude)
        self._source = source
        self.collate = collate
        self._position = 0
        self._reach = Reach(source) if isinstance(source, Growing) else None  # None: the source is whole
        self._ahead_checked = False  # see _check_ahead
        if self._reach is not None:  # what it knows now, which the view opened holds
            self._reach.grow(0, lambda: None)
            self._reach.readable = self._reach.known

    # --- what it reads ----------------------------------------------------------------------------------

    @property
    def run(self) -> Run:
        """What it reads and in which order, from its start or last resume on (:class:`~.run.Run`)."""
        return self._run

    @property
    def options(self) -> LoaderOptions:
        """Its settings (:class:`~streampack.loader.options.LoaderOptions`)."""
        return self._run.options

    @options.setter
    def options(self, options: LoaderOptions) -> None:  # e.g. a copy that reads every rank's rows
        self._run = dataclasses.replace(self._run, options=options)

    @property
    def order(self) -> Order:
        """The order served: the one given or made of the options, as resumed, under the skip exclusions."""
        return self._run.order

    @property
    def dataset(self) -> Any:
        """The source given; for a Mixture given, the mixture as the last resume continued it."""
        return self._run.base if self._source is self._run.configured else self._source

    @property
    def sources(self) -> list[Source]:
        """The sources read, in source-id order."""
        return self._run.rows.sources

    @property
    def formatter(self) -> Format:
        """The format of ``output=`` (:mod:`streampack.loader.collate`)."""
        return self._run.formatter

    @property
    def source_dtype(self) -> np.dtype:
        """The dtype that holds the tokens of every source: the cache dtype, for one cache."""
        return self._run.rows.dtype

    @property
    def width(self) -> int:
        """Tokens per sample: ``seq_len + overlap`` (at the loader's own ``seq_len``, with a schedule)."""
        run = self._run
        return run.rows.width if run.served is None else run.served.width

    @property
    def serves_sub_windows(self) -> bool:
        """Whether batches may be served at other lengths than the units' (their shape then varies)."""
        return self._run.served is not None

    @property
    def prefetch_steps(self) -> int:
        """Steps ahead whose shards are fetched in the background (0 unless reading object storage)."""
        return prefetch_steps(self._run.rows.joined)

    # --- where the batches are --------------------------------------------------------------------------

    @property
    def position(self) -> int:
        """Global position of the next batch: samples consumed since the run started, over all ranks."""
        return self._position

    @property
    def num_samples(self) -> int:
        """Samples per epoch of the dataset (of all sources of a mixture; those known, of a growing one)."""
        return sum(self.order.sizes())

    @property
    def epoch(self) -> int:
        """Epoch of the dataset the next batch starts in.

        Raises:
            TypeError: the order reads a mixture, whose sources each have their own (see :meth:`realised`).
        """
        return self._run.batches.epoch(self._position)

    @property
    def steps_per_epoch(self) -> int:
        """Global batches in one epoch: ``N // B``, or ``ceil(N / B)`` with ``drop_last=False``.

        Raises:
            TypeError: the order reads a mixture, which has no single epoch.
        """
        return self._run.batches.steps_per_epoch()

    def __len__(self) -> int:
        """Global batches of the whole run from position 0 at this batch size, the same on every rank.

        Raises:
            TypeError: the run is endless (``epochs=None``, or a mixture that never stops).
        """
        return self._run.batches.count()

    @property
    def finished(self) -> bool:
        """True once the run has ended: no batch is left at the current position."""
        return self._rows_at(self._position) == 0

    def schedule(self, start: int | None = None) -> Iterator[int]:
        """The position of every batch still to come from ``start`` (default: the current position)."""
        position = self._position if start is None else start
        while rows := self._rows_at(position):
            yield position
            position += rows

    def advance(self, batches: int = 1) -> None:
        """Move the position forward by ``batches`` steps, as if that many batches had been consumed."""
        check_int("batches", batches, min=0, max=2**62)
        if self._reach is not None:  # a run that ends must know where, to stop there
            stop = min(self._position + batches * self.options.batch_size, MAX_POSITION)
            self._reach.grow(stop, self._check_last_batch)
        self._position = self._run.batches.advanced(self._position, batches)

    def realised(self, steps: int = 0) -> list[SourceShare]:
        """Per source: samples served, realised share and epoch, ``steps`` batches after the position."""
        check_int("steps", steps, min=0, max=2**62)
        return self._run.batches.realised(min(self._position + steps * self.options.batch_size, MAX_POSITION))

    def served(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Source ids and sample ids (``int64``) served at the global positions ``[start, stop)``."""
        return self._run.batches.served(start, stop)

    def _rows_at(self, position: int) -> int:
        """Rows of the global batch at ``position`` (a growing source may wait to know them)."""
        reach, batch = self._reach, self._run.options.batch_size
        if reach is not None and position + batch > reach.known:
            reach.grow(min(position + batch, MAX_POSITION), self._check_last_batch)
        return self._run.batches.rows(position)

    def _check_last_batch(self) -> None:
        self._run.batches.check_last_batch(self._position)

    # --- one batch --------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        """Yield batches from the current position on, advancing it as each is handed out.

        The position is read afresh before every batch, so :meth:`load_state_dict` takes effect at the
        next one, even inside a loop."""
        while True:
            asked = time.perf_counter()  # the consumer waits from here
            if self.finished:
                return
            position = self._position
            batch = self.batch(position)
            self._position = position + self._rows_at(position)
            self.meter.add(time.perf_counter() - asked, self.made)
            yield batch

    def metrics(self) -> dict[str, float]:
        """What feeding the consumer cost: ``batches`` taken, and of the last one and in total
        (``total_<name>``), each of :data:`~streampack.loader.metrics.METRICS` (see that module)."""
        return self.meter.as_dict()

    def batch(self, position: int, *, out: np.ndarray | None = None) -> Any:
        """This rank's batch at ``position``, formatted and collated; a pure function of the position.

        ``out``: an array of :meth:`batch_shape` and the output dtype to read the tokens into (e.g. a view
        of shared memory); a new one when omitted."""
        started = time.perf_counter()
        if not self._ahead_checked:
            self._check_ahead()
        picks = self.picks(position)
        run = self._run  # read after picks(): a growing source may have been reopened
        span: tuple[int, int] | np.ndarray = run.batches.span(position)
        if run.batches.costs is not None and run.masking is not None:  # balanced rows lie anywhere
            span = run.batches.positions(position)
        stores = run.rows.fetching
        before = [(store.prefetch_hits, store.prefetch_misses) for store in stores]
        if run.served is not None and run.served.splits(position):  # a unit's sub-windows
            units = run.rows.read(position, *picks, None, run.out_dtype)
            result = run.served.batch(position, picks, units, span, out, run.masking)  # type: ignore[arg-type]
        else:
            tokens = run.rows.read(position, *picks, out, run.out_dtype)
            result = formatted(run.formatter, tokens, picks, span, run.masking)
        if run.rows.prefetches:  # a cache in object storage: fetch the next steps' shards
            self._prefetch(position)
        if self.collate is not None:
            result = self.collate(result)
        hits = misses = 0
        for store, (hit, miss) in zip(stores, before, strict=True):  # none for a local cache
            hits += store.prefetch_hits - hit
            misses += store.prefetch_misses - miss
        read = run.rows.bytes_read(position, *picks)
        self.made = Made(time.perf_counter() - started, read, hits, misses)
        return result

    def batch_shape(self, position: int) -> tuple[int, int]:
        """Shape ``(rows, width)`` of this rank's token array at ``position``."""
        run = self._run
        lo, hi = run.batches.span(position)
        return (hi - lo, self.width) if run.served is None else run.served.shape(position, hi - lo)

    def picks(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """Source ids and sample ids of this rank's rows of the batch at ``position`` (``int64``).

        Raises:
            IndexError: no batch starts at ``position`` (negative, or past the run's end).
        """
        reach = self._reach
        if reach is not None and position + self.options.batch_size > reach.readable:
            self._rows_at(position)  # waits until the source holds the batch's samples
            if reach.readable < reach.known:
                self._reopen()
        run = self._run
        if position < 0 or self._rows_at(position) == 0:
            raise run.batches.missing(position)
        return run.rows.picks(position, run.batches, self._planned_end)

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

    def _planned_end(self) -> int | None:
        end = self.order.end
        return end if self._reach is None else self._reach.end(end)

    def _reopen(self) -> None:
        """Read the growing source as it stands now."""
        reach = self._reach
        assert reach is not None
        known, view = reach.known, reach.source.view()
        parts = list(view.values()) if isinstance(view, Mapping) else [view]
        o = self.options
        formatter = format_for(o.output, parts, (o.cp_size, o.cp_rank), domains=self._run.domains)
        self._run = dataclasses.replace(
            self._run, rows=Rows([Source(part) for part in parts]), formatter=formatter
        )
        reach.readable = known

    def _check_ahead(self) -> None:
        """Before the first batch and after an exclusion: refuse a last batch that leaves a rank none, and
        an exclusion whose ranges all lie before the position."""
        self._check_last_batch()
        reaching([entry for entry in self._run.in_force if entry[1] >= self._position])
        self._ahead_checked = True

    # --- state --------------------------------------------------------------------------------------------

    @property
    def history(self) -> list[dict[str, Any]]:
        """The run's history: one entry for its start and one per resume (:mod:`.history`)."""
        return [dict(entry) for entry in self._run.history]

    @property
    def batches_per_step(self) -> int:
        """Global batches the trainer takes per step (its gradient accumulation; default 1).

        The framework adapters set it; the history records it, and the steps of the exclusions put in force
        since the last resume count by it.

        Raises:
            OptionsError: (when set) not an integer >= 1; or it moves the steps of an exclusion in force
                before the position (set it before the first batch), or wholly before where it took effect.
        """
        return self._run.batches_per_step

    @batches_per_step.setter
    def batches_per_step(self, value: int) -> None:
        value = check_int("batches_per_step", value, min=1, hint="the trainer's gradient accumulation steps")
        run = dataclasses.replace(self._run, batches_per_step=value)
        # The exclusions put in force in the current leg count its steps again.
        legs, counting = len(run.history) or 1, run.counting()
        current = [
            i for i, (e, _, steps) in enumerate(run.in_force) if steps.through == legs and e.step_ranges()
        ]
        entries = [
            (e, at, counting if i in current else steps) for i, (e, at, steps) in enumerate(run.in_force)
        ]
        moved = [
            i for i in current if entries[i][0].ranges(counting) != entries[i][0].ranges(run.in_force[i][2])
        ]
        for i in moved:
            entry, at, _ = entries[i]
            if at < self._position:
                raise OptionsError(
                    f"batches_per_step={value} moves the trainer's steps of exclusion {i} "
                    f"(steps {entry.step_ranges()}), in force from position {at:,}, and the loader has "
                    f"served batches up to position {self._position:,} with them where they were: set "
                    "batches_per_step before the first batch (the framework adapters do)"
                )
        # An entry that takes effect past the position of a loader not yet resumed (the checkpoint's own,
        # given again with at=) is counted again by the resume, and checked there.
        reaching([entries[i] for i in current if entries[i][1] <= self._position])
        if moved:
            run = run.enforced(entries)
            self._ahead_checked = False
        self._run = run

    def exclusions_state(self) -> list[dict[str, Any]]:
        """The exclusions in force as the state records them (small and JSON-able)."""
        return self._run.exclusions_state()

    def exclude(self, entry: Exclusions) -> None:
        """Take what ``entry`` names out of the run from its ``at`` (default: the current position) on.

        Raises:
            OptionsError: ``at`` is before the current position (batches already served would change),
                a range of its steps or positions lies wholly before it, or ``entry`` does not fit the
                sources or the output (see :class:`Loader`).
        """
        run = self._run
        added = placed(entry, self._position, run.counting())
        reaching([added])
        run = run.enforced([*run.in_force, added])
        self._run = dataclasses.replace(run, exclusions=(*run.exclusions, entry))
        self._ahead_checked = False

    def state_dict(self) -> dict[str, Any]:
        """The position, order fingerprint, :attr:`history` and exclusions, as a small JSON-able dict."""
        run = self._run
        history = list(run.history)
        if history:  # how this stretch is trained is known by now (an adapter set it)
            history[-1] = history[-1] | {"batches_per_step": run.batches_per_step}
        state = saved(self._position, run.base, run.options, history)
        if run.in_force:
            state["exclusions"] = run.exclusions_state()
        return state

    def load_state_dict(self, state: Mapping[str, Any], *, step: int | None = None) -> None:
        """Resume from a :meth:`state_dict` in O(1): the next batch starts where the saved run stopped.

        The world size, the DataLoader workers and the global batch size may differ from the saved run's,
        and a mixture may come with new stages or sources. ``step``, the trainer's own step (the adapters
        pass it), is recorded in the :attr:`history` entry of this resume.

        Raises:
            LoaderStateError: (a ``ValueError``) not a state this loader continues (of no supported
                version, malformed, or of another seed, shuffle or data; both sides named).
            OptionsError: ``drop_last=False`` would give some rank an empty last batch from there.
        """
        if step is not None:
            step = check_int("step", step, min=0, max=2**62, hint="the trainer's step at this resume")
        position, run = resumed(self._run, state, step)
        if self._reach is not None:  # a growing source grows with the order resumed
            self._reach.resumed(run.base)
        self._run, self._position = run, position

    # --- copies, fetching ahead, closing ------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """Pickle (and copy) without the plan or the prefetch thread; a growing source is copied."""
        run = dataclasses.replace(self._run, rows=copy.copy(self._run.rows))
        state = self.__dict__ | {"_run": run}
        state.pop("_prefetcher", None)
        if self._reach is None:
            return state
        reach = copy.copy(self._reach)
        order = reach.source.order
        return state | {
            "_reach": reach,
            "_source": reach.source,
            "_run": dataclasses.replace(run, configured=order, order=order),
        }

    def __repr__(self) -> str:
        o = self.options
        return (
            f"{type(self).__name__}({self.dataset!r}, batch_size={o.batch_size}, rank={o.rank}, "
            f"world_size={o.world_size}, order={self.order!r}, position={self._position})"
        )

    def lookahead(
        self, position: int, steps: int, *, stride: int | None = None
    ) -> list[tuple[CachedStore, str]]:
        """The ``(store, key)`` of each shard file in object storage that this process's next ``steps``
        batches after ``position``, ``stride`` positions apart, read; nearest first, each once."""
        reach, batches = self._reach, self._run.batches
        stride = stride or batches.options.batch_size

        def picks(at: int) -> tuple[np.ndarray, np.ndarray] | None:  # None: not known yet, or past the end
            if reach is not None and not reach.ready(at + batches.options.batch_size):
                return None
            return batches.picks(at) if batches.rows(at) else None

        ahead = (picks(position + step * stride) for step in range(1, steps + 1))
        return files_ahead(lambda: self._run.rows.joined, ahead, boundaries=self.options.output != "numpy")

    def _prefetch(self, position: int) -> None:
        if self._prefetcher is None or not self._prefetcher.running:  # first use, after close(), in a fork
            from streampack.loader.prefetch import Prefetcher

            self.close()  # what a fork copied of the parent's prefetcher has no thread here
            self._prefetcher = Prefetcher(self, self.prefetch_steps)
        self._prefetcher.announce(position)

    def close(self) -> None:
        """Stop this loader's prefetch thread (joined within 10 s); idempotent: a later batch restarts it."""
        prefetcher, self._prefetcher = self._prefetcher, None
        if prefetcher is not None:
            prefetcher.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from streampack.loader import inforce
from streampack.loader.checkpoint import Checkpointed
from streampack.loader.collate import Format, format_for
from streampack.loader.exclusions import Exclusions
from streampack.loader.given import given
from streampack.loader.growing import Growing, Reach
from streampack.loader.growmix import growing_mixture
from streampack.loader.lookahead import files_ahead, prefetch_steps
from streampack.loader.options import LoaderOptions, Output, SourceShare
from streampack.loader.reading import DataSource, Rows, Source
from streampack.loader.seqlen import SeqLenSchedule
from streampack.loader.served import formatted, served_for
from streampack.loader.state import LOADER_VERSION
from streampack.order import Order, Ordered

if TYPE_CHECKING:
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

_Loader = TypeVar("_Loader", bound="Loader")


class Loader(Checkpointed):
    """Iterate over global batches of samples, this rank's share of each, resumable exactly in O(1).

    Iterating yields one batch per step, starting at the current position, until the run ends (forever
    when it is endless). Each yielded batch advances the position, so :meth:`state_dict` taken after a
    batch resumes at the next one. Where the batches are, ``len()``, epochs and what each source has
    served: :class:`~streampack.loader.steps.Steps`.

    Example::

        loader = Loader(cache.sequences(2048, overlap=1), batch_size=32, seed=1)
        for batch in loader:  # (32, 2049) int64 arrays
            x, y = batch[:, :-1], batch[:, 1:]

    Over object storage it fetches the next steps' shards on a thread of its own (:mod:`.prefetch`):
    :meth:`close` it, or use ``with Loader(...) as loader:``.

    Args:
        source: the samples: a :class:`DataSource` such as ``cache.sequences(seq_len)`` or a 2-D numpy
            array (not a list of arrays: ``np.stack`` it); a :class:`~streampack.order.mixture.Mixture`,
            which comes with its order; or a dict of name -> source, read in the ``order`` given.
        order: the :class:`~streampack.order.Order` to read them in, one name per source; by default one
            made of the options ``seed``, ``shuffle`` and ``epochs`` (refused with an order or Mixture).
        options: a :class:`~streampack.loader.options.LoaderOptions`, which documents each setting;
            keywords given too replace its fields (``batch_size``, the GLOBAL batch size, is required).
        collate: applied to every batch before it is yielded (e.g. ``torch.from_numpy``).
        exclude: :class:`~streampack.loader.exclusions.Exclusions` (or a list of them, in the order they
            were given during the run) taking documents and steps out of the run from a position on
            (:mod:`streampack.loader.exclusions`).

    Raises:
        TypeError: ``source`` cannot be read a batch of indices at a time, or a keyword names no option.
        OptionsError: (a ``ValueError``) an option is not allowed alone or with the source and order
            (:func:`~streampack.loader.given.given` lists each case), ``output="dict"`` does not fit the
            samples. Each message names the fix. Before its first batch (or at a resume): ``drop_last=False``
            would give some rank an empty last batch from its position
            (:func:`~streampack.loader.options.check_last_batch`), or an exclusion's range lies wholly
            before where it takes effect.
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
        **keywords: Any,
    ) -> None:
        source = growing_mixture(source)  # a Mixture with a source that grows, grows with it
        self.options, sources, self.order = given(type(self).__name__, source, order, options, keywords)
        self.dataset: Any = source
        self.collate, self._rows = collate, Rows(sources)
        # Every checkpoint resumes against the order given here, never one an earlier load produced.
        self._configured: Order = self.order
        self._position = 0
        # How far a growing source is known and opened (streampack.loader.growing); None: it is whole.
        self._reach = Reach(source) if isinstance(source, Growing) else None
        self.formatter: Format = format_for(self.options.output, [source.data for source in sources])
        # The units served at other lengths (a seq_len schedule, streampack.loader.served); None: as they are.
        self._served = served_for(self.options, sources, self._reach is not None)
        self._own_order = order is None and not isinstance(source, (Ordered, Growing))
        # Exclusions (streampack.loader.inforce): those given, those in force, the order they filter, and
        # per process the documents each names, by digest.
        self._exclude_given, self._base = inforce.listed(exclude), self.order
        self._excluded_docs: inforce.Found = {}
        if self._exclude_given:  # their ranges are checked once the run's history is known (a resume)
            self._enforce([inforce.placed(e, e.at or 0, self._counting()) for e in self._exclude_given])
        # The run's last batch is checked before the first batch (a resume first moves the position).
        self._ahead_checked = False
        if self._reach is not None:  # what it knows now, which the view opened above holds
            # An end known already is checked before the first batch, from the position a resume gives.
            self._reach.grow(0, lambda: None)
            self._reach.readable = self._reach.known
        self._history = (self._entry(0, None),)

    @property
    def source_dtype(self) -> np.dtype:
        """The dtype that holds the tokens of every source: the cache dtype, for one cache."""
        return self._rows.dtype

    @functools.cached_property
    def _out_dtype(self) -> np.dtype:
        return np.dtype(self.options.dtype or self.source_dtype)

    @property
    def width(self) -> int:
        """Tokens per sample: ``seq_len + overlap`` (at the loader's own ``seq_len``, with a schedule)."""
        return self._rows.width if self._served is None else self._served.width

    def __getstate__(self) -> dict[str, Any]:
        """Pickle options, sources, order and position, not the plan or the prefetch thread (made again
        where unpickled); a copy over a growing source grows on its own (see ``Reach.copied``)."""
        state = self.__dict__ | {"_rows": copy.copy(self._rows)}  # without the plan: the copy's options
        state.pop("_prefetcher", None)
        return state if self._reach is None else state | self._reach.copied(self.dataset)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle."""
        self.__dict__.update(state)
        if "_base" not in self.__dict__:  # pickled before exclusions: its order is unfiltered
            self.__dict__.update(_base=self.__dict__.get("order"), _excluded_docs={})

    def __repr__(self) -> str:
        o = self.options
        return (
            f"{type(self).__name__}({self.dataset!r}, batch_size={o.batch_size}, rank={o.rank}, "
            f"world_size={o.world_size}, order={self.order!r}, position={self._position})"
        )

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
        if not self._ahead_checked:
            self._check_ahead()
        sources, samples = self.picks(position)
        span = self._span(position)
        if self._served is not None and self._served.splits(position):  # a unit's sub-windows
            units = self._rows.read(position, sources, samples, None, self._out_dtype)
            result = self._served.batch(position, (sources, samples), units, span, out, self._masking)
        else:
            tokens = self._rows.read(position, sources, samples, out, self._out_dtype)
            result = formatted(self.formatter, tokens, (sources, samples), span, self._masking)
        if self._rows.prefetches:  # a cache in object storage: fetch the next steps' shards
            self._prefetch(position)
        return self.collate(result) if self.collate is not None else result

    def batch_shape(self, position: int) -> tuple[int, int]:
        """Shape ``(rows, width)`` of this rank's token array at ``position``: ``batch_size //
        world_size`` rows, except in the last, partial batch (``drop_last=False``); with a
        ``seq_len_schedule``, each unit's sub-windows at the length in force."""
        lo, hi = self._span(position)
        return (hi - lo, self.width) if self._served is None else self._served.shape(position, hi - lo)

    def picks(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """Source ids and sample ids of this rank's rows of the batch at ``position`` (``int64``).

        Raises:
            IndexError: no batch starts at ``position`` (negative, or past the run's end).
        """
        if self._reach is not None and self._view_behind(position):
            self._reopen()
        if position < 0 or self._global_rows(position) == 0:
            raise self._missing(position)
        if self._global_rows(position) < self.options.batch_size:  # the last partial batch, on its own
            return self._unplanned_picks(position)
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

    def _reopen(self) -> None:
        """Read from the growing source as it stands now: it holds every sample of the positions known."""
        reach = self._reach
        assert reach is not None
        known, view = reach.known, reach.source.view()
        parts = list(view.values()) if isinstance(view, Mapping) else [view]
        self._rows = Rows([Source(part) for part in parts])
        self.formatter = format_for(self.options.output, parts)
        reach.readable = known

    # --- fetching ahead (object storage) ----------------------------------------------------------------

    @property
    def prefetch_steps(self) -> int:
        """Steps ahead whose shards are fetched in the background: 0 unless the samples are read from
        object storage (see :func:`streampack.open`'s ``prefetch_steps``)."""
        return prefetch_steps(self._rows.joined)

    def lookahead(
        self, position: int, steps: int, *, stride: int | None = None
    ) -> list[tuple[CachedStore, str]]:
        """The ``(store, key)`` of each shard file in object storage that this process's ``steps``
        batches after ``position`` read and that can be made now, nearest first, each once
        (:func:`~streampack.loader.lookahead.files_ahead`).

        Args:
            position: the position of the batch just read.
            steps: batches ahead.
            stride: positions from one of this process's batches to its next (every n-th batch in a
                DataLoader worker); the global batch size by default.
        """
        stride = stride or self.options.batch_size
        ahead = (self._picks_ahead(position + step * stride) for step in range(1, steps + 1))
        return files_ahead(lambda: self._rows.joined, ahead, boundaries=self.options.output != "numpy")

    def _prefetch(self, position: int) -> None:
        if self._prefetcher is None or not self._prefetcher.running:  # first use, after close(), in a fork
            from streampack.loader.prefetch import Prefetcher

            self.close()  # what a fork copied of the parent's prefetcher has no thread here
            self._prefetcher = Prefetcher(self, self.prefetch_steps)
        self._prefetcher.announce(position)

    def close(self) -> None:
        """Stop this loader's background work, its prefetch thread (joined within 10 s); idempotent. The
        loader stays usable: a later batch starts prefetching again, so ``with loader:`` may be entered
        again (e.g. once an epoch). A loader that reads no object storage has nothing to stop."""
        prefetcher, self._prefetcher = self._prefetcher, None
        if prefetcher is not None:
            prefetcher.close()

    def __enter__(self: _Loader) -> _Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

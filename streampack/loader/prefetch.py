"""Fetching ahead the shards a loader over a cache in object storage will read in its next steps.

The order of samples is known in advance: the loader's :class:`~streampack.order.Order` maps positions to
samples, the layouts map samples to spans of shards. After each batch, :func:`after_batch` tells this
process's :class:`Prefetcher` (one per loader, started on first use, in every DataLoader worker) where
the loader stands; its thread computes the shards of the next ``prefetch_steps`` batches of this process
(every n-th batch in a DataLoader worker: the stride seen between batches) and fetches those missing from
the local copy (:mod:`streampack.store.localcopy`), nearest step first.

It stays out of the way of the reads: it fetches within half of ``max_local_bytes``, never evicts what it
fetched for nearer steps, never waits for room (it stops and starts again after the next batch), and
leaves errors to the read that needs the file. Nothing of this runs for a local cache.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from streampack.errors import StreampackError
from streampack.samples.sequences import JoinedSequences
from streampack.store.localcopy import CachedStore

if TYPE_CHECKING:
    from streampack.loader import Loader

_prefetchers: weakref.WeakKeyDictionary[Loader, Prefetcher | None] = weakref.WeakKeyDictionary()


def after_batch(loader: Loader, position: int) -> None:
    """Tell the prefetcher of ``loader`` (made on first call; none for local caches) that the batch at
    ``position`` was read."""
    try:
        prefetcher = _prefetchers[loader]
    except KeyError:
        prefetcher = _prefetchers[loader] = Prefetcher.of(loader)
    if prefetcher is not None:
        prefetcher.announce(position)


def steps_for(joined: JoinedSequences | None) -> int:
    """Steps ahead to prefetch for a loader over ``joined``: 0 unless it reads a cache in object storage."""
    if not isinstance(joined, JoinedSequences):
        return 0
    stores = [part.cache.store for part in joined.parts]
    return max((s.prefetch_steps for s in stores if isinstance(s, CachedStore)), default=0)


class Prefetcher:
    """The background thread that fetches the shards of a loader's next steps (see the module docstring).

    Args:
        loader: the loader (held weakly: the thread ends once it is gone).
        steps: batches ahead to fetch for.
    """

    def __init__(self, loader: Loader, steps: int) -> None:
        self._loader = weakref.ref(loader)
        self._steps = steps
        self._boundaries = loader.options.output != "numpy"
        self._wanted: tuple[int, int] | None = None
        self._last: int | None = None
        self._cond = threading.Condition()
        self.fetched = 0  # files this prefetcher downloaded
        threading.Thread(target=self._run, name="streampack-prefetch", daemon=True).start()

    @classmethod
    def of(cls, loader: Loader) -> Prefetcher | None:
        """A prefetcher for ``loader`` when it reads a cache in object storage that prefetches; else None."""
        joined = getattr(loader, "_joined", None)
        steps = steps_for(joined)
        return cls(loader, steps) if steps and isinstance(joined, JoinedSequences) else None

    def announce(self, position: int) -> None:
        """The batch at ``position`` was read: fetch for the ones after it."""
        with self._cond:
            last, self._last = self._last, position
            stride = position - last if last is not None and position > last else 0
            self._wanted = (position, stride)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._wanted is None:
                    self._cond.wait(timeout=1.0)
                    if self._wanted is None and self._loader() is None:
                        return
                position, stride = self._wanted
                self._wanted = None
            loader = self._loader()
            if loader is None:
                return
            with contextlib.suppress(StreampackError):  # the read that needs the file reports it
                self._fetch(self._files(loader, position, stride or loader.options.batch_size))
            del loader

    def _files(self, loader: Loader, position: int, stride: int) -> list[tuple[CachedStore, str]]:
        """The shard files the next steps of this process read, nearest step first, each once."""
        files: list[tuple[CachedStore, str]] = []
        seen: set[tuple[int, int]] = set()
        joined = loader._joined  # read each time: a Follow replaces it as the cache grows
        if joined is None:
            return files
        for step in range(1, self._steps + 1):
            at = position + step * stride
            if not loader._ready(at) or loader._global_rows(at) == 0:  # not known yet, or the run ends
                break
            lo, hi = loader._span(at)
            sources, samples = loader.order(np.arange(lo, hi, dtype=np.int64))
            try:
                shards = joined.spans(sources, samples).shards
            except IndexError:
                if loader._joined is joined:
                    raise
                return files  # a Follow replaced its view of the growing cache meanwhile: start over
            for shard in dict.fromkeys(shards.tolist()):
                part, local = joined._owners[shard]
                if (part, local) in seen:
                    continue
                seen.add((part, local))
                cache = joined.parts[part].cache
                store = cache.store
                if isinstance(store, CachedStore):
                    files += [(store, key) for key in cache.shard_keys(local, boundaries=self._boundaries)]
        return files

    def _fetch(self, files: list[tuple[CachedStore, str]]) -> None:
        """Fetch ``files`` in order, within half of each store's bound; stop at a newer announcement or
        when there is no room."""
        kept: list[Path] = []
        used = 0
        for store, key in files:
            if self._wanted is not None:
                return
            path = store.path(key)
            if store.max_local_bytes is not None:
                used += store.expected_blocks(key)
                if used > store.max_local_bytes // 2:
                    return
            kept.append(path)
            if path.exists():
                continue
            if store.fetch(key, wait=False, keep=kept) is None:
                return
            self.fetched += 1

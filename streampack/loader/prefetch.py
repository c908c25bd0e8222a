"""Fetching ahead the shards a loader over a cache in object storage will read in its next steps.

The order of samples is known in advance: the loader's :class:`~streampack.order.Order` maps positions to
samples, the layouts map samples to spans of shards. After each batch, :func:`after_batch` tells this
process's :class:`Prefetcher` (one per loader, started on first use, in every DataLoader worker) where
the loader stands; its thread asks the loader's :class:`~streampack.loader.lookahead.Lookahead` for the
shard files of the next ``prefetch_steps`` batches of this process (every n-th batch in a DataLoader
worker: the stride seen between batches) and fetches those missing from the local copy
(:mod:`streampack.store.localcopy`), nearest step first.

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

from streampack.errors import StreampackError

if TYPE_CHECKING:
    from streampack.loader.lookahead import Lookahead
    from streampack.store.localcopy import CachedStore

_prefetchers: weakref.WeakKeyDictionary[Lookahead, Prefetcher | None] = weakref.WeakKeyDictionary()


def after_batch(loader: Lookahead, position: int) -> None:
    """Tell the prefetcher of ``loader`` (made on first call; none when it prefetches no steps) that the
    batch at ``position`` was read."""
    try:
        prefetcher = _prefetchers[loader]
    except KeyError:
        steps = loader.prefetch_steps
        prefetcher = _prefetchers[loader] = Prefetcher(loader, steps) if steps else None
    if prefetcher is not None:
        prefetcher.announce(position)


class Prefetcher:
    """The background thread that fetches the shards of a loader's next steps (see the module docstring).

    Args:
        loader: what it fetches for, asked through :class:`~streampack.loader.lookahead.Lookahead` alone
            (held weakly: the thread ends once it is gone).
        steps: batches ahead to fetch for.
    """

    def __init__(self, loader: Lookahead, steps: int) -> None:
        self._loader = weakref.ref(loader)
        self._steps = steps
        self._wanted: tuple[int, int] | None = None
        self._last: int | None = None
        self._cond = threading.Condition()
        self.fetched = 0  # files this prefetcher downloaded
        threading.Thread(target=self._run, name="streampack-prefetch", daemon=True).start()

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
                self._fetch(loader.lookahead(position, self._steps, stride=stride or None))
            del loader

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

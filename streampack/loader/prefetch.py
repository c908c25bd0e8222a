"""Fetching ahead the shards a loader over a cache in object storage will read in its next steps.

The order of samples is known in advance, so after each batch the loader tells its :class:`Prefetcher`
where it stands (:meth:`Prefetcher.announce`), and the prefetcher's thread asks the loader's
:class:`~streampack.loader.lookahead.Lookahead` for the shard files of this process's next
``prefetch_steps`` batches (at the stride seen between batches) and fetches those missing from the local
copy, nearest step first. It stays out of the way of the reads: it fetches within half of
``max_local_bytes``, never evicts what it fetched for nearer steps, never waits for room, and leaves errors
to the read that needs the file. Nothing of this runs for a local cache.

**Lifecycle.** A prefetcher belongs to the loader that started it (on its first batch from object storage,
in every process that reads). Its daemon thread, ``streampack-prefetch-<n>``, ends when the loader is
closed (:meth:`Loader.close <streampack.loader.Loader.close>`, or the end of ``with loader:``: told to stop
and joined, within a bounded wait), when the loader is garbage-collected unclosed (a
:func:`weakref.finalize`; the thread holds the loader weakly), or with the process.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

from streampack.errors import StreampackError

if TYPE_CHECKING:
    from streampack.loader.lookahead import Lookahead
    from streampack.store.localcopy import CachedStore

__all__ = ["THREAD_PREFIX", "Prefetcher"]

THREAD_PREFIX = "streampack-prefetch-"
"""How every prefetch thread's name starts."""

_numbers = itertools.count(1)


class Prefetcher:
    """The background thread that fetches the shards of a loader's next ``steps`` batches (see the module).

    It runs from its creation until :meth:`close` or :meth:`stop`, or until ``loader`` (held weakly, asked
    through :class:`~streampack.loader.lookahead.Lookahead` alone) is garbage-collected.
    """

    def __init__(self, loader: Lookahead, steps: int) -> None:
        self._loader = weakref.ref(loader)
        self._steps = steps
        self._wanted: tuple[int, int] | None = None
        self._last: int | None = None
        self._stopping = False
        self._cond = threading.Condition()
        self.fetched = 0  # files this prefetcher downloaded
        self._thread = threading.Thread(
            target=self._run, name=f"{THREAD_PREFIX}{next(_numbers)}", daemon=True
        )
        self._finalizer = weakref.finalize(loader, self.stop)
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether its thread runs and was not told to stop (False in a process forked from the one that
        started it: a fork copies no thread but the forking one)."""
        return not self._stopping and self._thread.is_alive()

    @property
    def name(self) -> str:
        """Its thread's name: ``streampack-prefetch-<n>``."""
        return self._thread.name

    def announce(self, position: int) -> None:
        """The batch at ``position`` was read: fetch for the ones after it."""
        with self._cond:
            last, self._last = self._last, position
            stride = position - last if last is not None and position > last else 0
            self._wanted = (position, stride)
            self._cond.notify()

    def stop(self) -> None:
        """Tell the thread to end, without waiting for it: it ends after the file it is fetching, if any."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread and wait at most ``timeout`` seconds for it to end; idempotent. A longer download
        is not cut: the thread, a daemon, ends once it is done."""
        self._finalizer.detach()
        self.stop()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._wanted is None and not self._stopping:
                    self._cond.wait()
                wanted, self._wanted = self._wanted, None
                if self._stopping or wanted is None:
                    return
            position, stride = wanted
            loader = self._loader()
            if loader is None:
                return
            with contextlib.suppress(StreampackError):  # the read that needs the file reports it
                self._fetch(loader.lookahead(position, self._steps, stride=stride or None))
            del loader

    def _fetch(self, files: list[tuple[CachedStore, str]]) -> None:
        """Fetch ``files`` in order, within half of each store's bound; stop at a newer announcement, when
        told to stop, or when there is no room."""
        kept: list[Path] = []
        used = 0
        for store, key in files:
            if self._wanted is not None or self._stopping:
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

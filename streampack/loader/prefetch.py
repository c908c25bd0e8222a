"""Fetching ahead the shards a loader over a cache in object storage will read in its next steps.

After each batch the loader tells its :class:`Prefetcher` where it stands, and the prefetcher's thread
asks the loader's :class:`~streampack.loader.lookahead.Lookahead` for the shard files of the next
``prefetch_steps`` batches and fetches those missing, nearest first. It stays out of the reads' way: it
fetches within half of ``max_local_bytes``, never waits for room, and leaves errors to the read that needs
the file.

**Lifecycle.** The daemon thread, ``streampack-prefetch-<n>``, ends when the loader is closed (told to stop
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
    """The background thread that fetches the shards of a loader's next ``steps`` batches (see the module)."""

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
        """Whether its thread runs and was not told to stop (False in a forked process)."""
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
        """Tell the thread to end after the file it is fetching, without waiting for it."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread and wait at most ``timeout`` seconds for it to end; idempotent."""
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
        """Fetch ``files`` in order, within half of each store's bound, until a newer announcement."""
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

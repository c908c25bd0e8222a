"""Dropping the shard maps a process keeps for reuse when a bounded local copy needs their room.

A mapped file of a local copy (:mod:`streampack.store.localcopy`) cannot be evicted, and readers keep
maps for reuse (the reader's LRU of shard maps, the loader's). When a download finds no room, its process
first drops its own kept maps (:func:`release_maps`), then touches the copy's ``pressure`` file and
waits: every other process that reads the copy with a bound watches that file and drops its kept maps
when it changes, so that an idle process (a DataLoader worker blocked on its queue) does not keep its
files pinned.

Both registries here are per process by nature, so they are process-wide, and documented as such:

* **The releasers**: the bound methods that drop the maps an object keeps (:func:`on_release`), held
  weakly (registering never keeps an object alive); :func:`forget_release` takes one back (a closed
  cache's).
* **The watcher** (:data:`WATCHER`): one thread per process, named :data:`THREAD_NAME`, polls the
  ``pressure`` file of every local copy an open store of the process watches (every
  :data:`POLL_SECONDS`). A store registers its copy on its first map (:meth:`PressureWatcher.watch`, by
  the store's ``id``) and takes it back when closed, or when garbage-collected (a weakref finalizer the
  store holds): :meth:`PressureWatcher.unwatch` stops the thread and joins it (a bounded wait) once no
  copy is watched, and the next registration starts a new one. Why one thread for all copies rather than
  one per copy: a poll of one ``stat`` per copy is the same work either way, and a process that opens
  many caches holds one thread, not one per cache. A forked child (a DataLoader worker) starts with no
  registration and no thread; its stores register again on their first map there.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

POLL_SECONDS = 0.02
"""How often the watcher checks the ``pressure`` files."""

JOIN_SECONDS = 1.0
"""How long :meth:`PressureWatcher.unwatch` waits for the stopped thread to end."""

THREAD_NAME = "streampack-pressure"
"""The watcher thread's name."""

PRESSURE = "pressure"
"""The file of a local copy that a process waiting for room touches."""

# Callbacks that drop the maps this process keeps for reuse (registered by readers and loaders).
releasers: list[weakref.WeakMethod[Callable[[], None]]] = []
releasers_lock = threading.Lock()


def on_release(method: Callable[[], None]) -> None:
    """Register a bound method that drops the shard maps its object keeps for reuse: called when a
    download needs room that only mapped files hold (held weakly: registering never keeps it alive)."""
    with releasers_lock:
        releasers[:] = [ref for ref in releasers if ref() is not None]
        releasers.append(weakref.WeakMethod(method))


def forget_release(method: Callable[[], None]) -> None:
    """Take back a method :func:`on_release` registered (nothing when it is not registered)."""
    with releasers_lock:
        releasers[:] = [ref for ref in releasers if ref() is not None and ref() != method]


def release_maps() -> None:
    """Drop every shard map this process keeps for reuse (maps still in use stay valid)."""
    with releasers_lock:
        methods = [ref() for ref in releasers]
    for method in methods:
        if method is not None:
            method()


def mtime(path: Path) -> int:
    """The modification time of ``path`` in ns; 0 when it does not exist."""
    try:
        return os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return 0


class PressureWatcher:
    """The thread that drops this process's kept maps when another process waits for room in a local
    copy it reads (see the module docstring); :data:`WATCHER` is the process's one instance."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        # An RLock: a store's finalizer (unwatch) may run in a garbage collection that starts while this
        # thread holds the lock (in watch).
        self._lock = threading.RLock()
        self._watched: dict[int, Path] = {}  # the copy's directory, by the key of who watches it
        self._seen: dict[Path, int] = {}  # the last modification time seen, by pressure file
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def thread(self) -> threading.Thread | None:
        """The running thread, or None when no copy is watched."""
        return self._thread

    def watch(self, key: int, root: Path) -> None:
        """Watch the local copy in ``root`` for ``key`` (a store's ``id``: registering it again changes
        nothing), starting the thread if none runs."""
        with self._lock:
            self._watched[key] = root
            pressure = root / PRESSURE
            if pressure not in self._seen:
                self._seen[pressure] = mtime(pressure)  # a touch from now on is seen
            if self._thread is None:
                self._stop = threading.Event()
                self._thread = threading.Thread(
                    target=self._run, args=(self._stop,), name=THREAD_NAME, daemon=True
                )
                self._thread.start()

    def unwatch(self, key: int) -> None:
        """Take back the registration of ``key`` (nothing when there is none); once no copy is watched, stop
        the thread and wait up to :data:`JOIN_SECONDS` for it to end."""
        with self._lock:
            root = self._watched.pop(key, None)
            if root is not None and root not in self._watched.values():
                self._seen.pop(root / PRESSURE, None)
            if self._watched or self._thread is None:
                return
            thread, self._thread = self._thread, None
            self._stop.set()
        if thread is not threading.current_thread():  # a finalizer may run in the thread itself
            thread.join(JOIN_SECONDS)

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(POLL_SECONDS):
            with self._lock:
                seen = dict(self._seen)
            changed = False
            for pressure, before in seen.items():
                now = mtime(pressure)
                if now != before:
                    changed = True
                    with self._lock:
                        if pressure in self._seen:
                            self._seen[pressure] = now
            if changed:
                release_maps()


WATCHER = PressureWatcher()
"""The process's watcher (process-wide: see the module docstring)."""

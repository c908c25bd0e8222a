"""Dropping the shard maps a process keeps for reuse when a bounded local copy needs their room.

A mapped copy cannot be evicted (:mod:`streampack.store.localcopy`), and readers keep maps for reuse. A
download that finds no room first drops its own process's kept maps (:func:`release_maps`), then touches
the copy's ``pressure`` file: every other process reading the copy with a bound runs one watcher thread
(:data:`WATCHER`) that polls the ``pressure`` file of each copy its open stores read, and drops its kept
maps when one changes. One thread per process, not per copy: a poll is one ``stat`` a copy either way.
A forked child starts with no registration and no thread.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

POLL_SECONDS = 0.02  # how often the watcher checks the pressure files
JOIN_SECONDS = 1.0  # how long PressureWatcher.unwatch waits for the stopped thread to end
THREAD_NAME = "streampack-pressure"
PRESSURE = "pressure"  # the file of a local copy that a process waiting for room touches

# Bound methods that drop the maps this process keeps for reuse, held weakly.
releasers: list[weakref.WeakMethod[Callable[[], None]]] = []
releasers_lock = threading.Lock()


def on_release(method: Callable[[], None]) -> None:
    """Register a bound method that drops the shard maps its object keeps, for when a download needs their
    room (held weakly: registering never keeps the object alive)."""
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
    """The thread that drops this process's kept maps when another process waits for room in a copy it
    reads; :data:`WATCHER` is the process's one instance.

    Attributes:
        thread: the running thread, or None when no copy is watched.
    """

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        # An RLock: a store's finalizer (unwatch) may run in a garbage collection started under the lock.
        self._lock = threading.RLock()
        self._watched: dict[int, Path] = {}  # the copy's directory, by the key of who watches it
        self._seen: dict[Path, int] = {}  # the last modification time seen, by pressure file
        self.thread: threading.Thread | None = None
        self._stop = threading.Event()

    def watch(self, key: int, root: Path) -> None:
        """Watch the copy in ``root`` for ``key`` (a store's ``id``), starting the thread if none runs."""
        with self._lock:
            self._watched[key] = root
            pressure = root / PRESSURE
            if pressure not in self._seen:
                self._seen[pressure] = mtime(pressure)  # a touch from now on is seen
            if self.thread is None:
                self._stop = threading.Event()
                self.thread = threading.Thread(
                    target=self._run, args=(self._stop,), name=THREAD_NAME, daemon=True
                )
                self.thread.start()

    def unwatch(self, key: int) -> None:
        """Take back the registration of ``key``; once no copy is watched, stop the thread and wait up to
        :data:`JOIN_SECONDS` for it to end."""
        with self._lock:
            root = self._watched.pop(key, None)
            if root is not None and root not in self._watched.values():
                self._seen.pop(root / PRESSURE, None)
            if self._watched or self.thread is None:
                return
            thread, self.thread = self.thread, None
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


WATCHER = PressureWatcher()  # the process's watcher

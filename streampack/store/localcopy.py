"""Reading a cache in object storage through a bounded local copy shared by the processes of one node.

:class:`CachedStore` is the store :func:`streampack.open` gives a cache under an fsspec URL: the manifest,
ledger and listings are read from object storage, and each shard file is fetched whole on first use into
a local directory, then memory-mapped from there, so the reader and the loader run unchanged::

    shards/NNNNNN.tokens.CRC           a verified copy (CRC: its checksum's hex digits, so a cache
                                       rebuilt under the same URL never serves a stale copy)
    shards/NNNNNN.tokens.CRC.partPID   a download under way, reserved at its full size
    locks/NNNNNN.tokens.CRC            the per-file download lock
    space.lock                         held while the space is counted and files are evicted
    pressure                           touched by a process waiting for room
    layouts/                           the sample plans of ``cache.packed``

The rules that keep several processes (DataLoader workers, ranks) of one node correct:

* **One download per file**, under the file's ``flock``, into a temporary name renamed into place once
  its size and CRC-32 match what the manifest (or the ledger of an unfinished build) records.
* **Bounded disk.** With ``max_local_bytes``, the shard files (counted in 4 KiB blocks) never total more
  than the bound: room is made under ``space.lock`` by evicting the least recently mapped copies.
* **Mapped files are never evicted**: a map holds a shared ``flock`` on its copy, and eviction takes only
  files it can lock exclusively. Without room, a process drops its own kept maps, then touches
  ``pressure`` so that the others drop theirs, and gives up after :data:`WAIT_SECONDS` saying the bound
  is too small. The bound must hold the shards one batch of every process of the node reads at once.
  Every other process reading the copy with a bound runs one watcher thread (:data:`WATCHER`, one per
  process, not per copy: a poll is one ``stat`` a copy either way) that drops its kept maps when the
  ``pressure`` file of a copy it reads changes. A forked child starts with no registration and no thread.
* **A copy is what was verified**: each map checks its size again (a map past a truncated file's end
  would crash the process); one of another size is deleted and fetched again.

Close a store (:meth:`CachedStore.close`) to stop its process's watcher thread once no open store uses
it; the copies stay on disk for the next reader.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import hashlib
import mmap
import os
import tempfile
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np

from streampack._checks import check_int_or_none
from streampack.errors import CacheError, OptionsError
from streampack.format.names import SHARD_DIR, crc32
from streampack.store import Expected, LocalStore
from streampack.store.remote import RemoteStore

DEFAULT_PREFETCH_STEPS = 8
"""Steps ahead whose shards a loader over a remote cache fetches in the background."""
BLOCK = 4096  # files are counted in whole blocks: what they take on disk, not their length
WAIT_SECONDS = 60.0  # how long a download waits for other processes to release mapped files
# How long a process waits when its own maps alone leave no room: another of its threads may be between
# the maps of one read and their release; one batch is read in far less.
OWN_WAIT_SECONDS = 1.0
COPY_CHUNK = 8 << 20  # bytes per ranged GET of a download
POLL_SECONDS = 0.02  # how often the watcher checks the pressure files
JOIN_SECONDS = 1.0  # how long PressureWatcher.unwatch waits for the stopped thread to end
THREAD_NAME = "streampack-pressure"
PRESSURE = "pressure"  # the file of a local copy that a process waiting for room touches

# The copies this process maps, with the number of its live maps of each (each dropped by a weakref
# finalizer of its map): what only it can release.
pinned: dict[Path, int] = {}
pinned_lock = threading.Lock()
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


def default_local_dir(url: str) -> Path:
    """The local copy of the cache at ``url`` when none is given: one per URL, in the temp dir."""
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "streampack-read" / digest


class CachedStore(LocalStore):
    """A remote cache read through a bounded local copy (see the module docstring for the rules).

    Everything but shard files is read from ``remote``; :meth:`map_array` maps a shard file's local copy,
    fetched first when absent. As a :class:`~streampack.store.LocalStore` of the local directory, it holds
    what readers keep there (the plans under ``layouts/``).

    Args:
        remote: the cache in object storage.
        local_dir: the local directory (created), shared by the processes that read the same cache.
        max_local_bytes: the bound on the shard files of ``local_dir``; None: unbounded.
        prefetch_steps: how many steps ahead a loader fetches (0: no prefetching).
        storage_options: what ``remote`` was opened with, for reopening it in another process.

    Close it (:meth:`close`, or a ``with`` block) when done.
    """

    # Class defaults: a store starts open, and one unpickled is not watched here.
    _closed = False
    _watching = 0  # the process whose watcher watches this copy for this store (0: none)
    _unwatch: weakref.finalize | None = None  # takes the registration back (on close, or when garbage)
    opened: str | None = None  # the URL open() was given, where it is not the remote's (a Megatron prefix)

    def __init__(
        self,
        remote: RemoteStore,
        local_dir: str | os.PathLike[str],
        *,
        max_local_bytes: int | None = None,
        prefetch_steps: int = DEFAULT_PREFETCH_STEPS,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(Path(local_dir).absolute())
        self.remote = remote
        self.max_local_bytes = max_local_bytes
        self.prefetch_steps = prefetch_steps
        self.storage_options = dict(storage_options or {})
        self.downloads = 0  # files this process downloaded (a measure for tests and benchmarks)
        # Shard files this process mapped that were local already (fetched ahead, or read before), and those
        # it waited to download: what a loader reports as its prefetch hits and misses.
        self.prefetch_hits = 0
        self.prefetch_misses = 0
        self._expected: dict[str, Expected] = {}
        try:
            (self.root / SHARD_DIR).mkdir(parents=True, exist_ok=True)
            (self.root / "locks").mkdir(exist_ok=True)
        except OSError as e:
            raise CacheError(
                f"cannot create the local copy {self.root} of {remote.url} ({e.strerror or e}); give a "
                "writable local_dir"
            ) from None

    def __repr__(self) -> str:
        return f"CachedStore({self.remote.url!r}, local_dir={str(self.root)!r})"

    def __getstate__(self) -> dict[str, Any]:
        """Pickle (and copy) the store, not its registration with this process's watcher."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_watching", "_unwatch")}

    def close(self) -> None:
        """Stop watching the copy for this store and refuse further reads; the copies stay on disk, and
        maps already made stay valid. Calling it again does nothing."""
        self._closed = True
        if self._unwatch is not None:
            self._unwatch()

    def __enter__(self) -> CachedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    fetches_copies = True

    def on_pressure(self, release: Callable[[], None]) -> None:
        """Have ``release`` called when a download needs room that kept maps hold."""
        on_release(release)

    def forget_pressure(self, release: Callable[[], None]) -> None:
        """Take back what :meth:`on_pressure` registered."""
        forget_release(release)

    def reopen_options(self) -> dict[str, Any]:
        """The arguments of :func:`streampack.open` that reopen this cache through the same local copy."""
        return {
            "local_dir": str(self.root),
            "max_local_bytes": self.max_local_bytes,
            "prefetch_steps": self.prefetch_steps,
            "storage_options": self.storage_options,
        }

    # What is not a shard file is read from object storage.

    @property
    def uri(self) -> str:
        """The cache's URL: what :func:`streampack.open` was given."""
        return self.opened or self.remote.url

    def describe(self, key: str) -> str:
        """The URL of ``key``."""
        return self.remote.describe(key)

    def exists(self, key: str) -> bool:
        """Whether the object ``key`` exists."""
        return self.remote.exists(key)

    def size(self, key: str) -> int:
        """Size of the object ``key``."""
        return self.remote.size(key)

    def read(self, key: str, start: int = 0, stop: int | None = None) -> bytes:
        """Bytes ``[start, stop)`` of the object ``key``."""
        return self.remote.read(key, start, stop)

    def read_json(self, key: str, *, what: str) -> Any:
        """A small JSON object of the remote cache."""
        return self.remote.read_json(key, what=what)

    def list(self, prefix: str) -> builtins.list[str]:
        """The names of the objects under ``prefix``."""
        return self.remote.list(prefix)

    def list_sizes(self, prefix: str) -> dict[str, int]:
        """The sizes of the objects under ``prefix`` (one LIST)."""
        return self.remote.list_sizes(prefix)

    def put_atomic(self, key: str, data: bytes) -> None:
        """Refused (:class:`CacheError`): a cache read through a local copy is read-only."""
        raise CacheError(f"{self.describe(key)}: a cache opened from object storage is read-only")

    def expect(self, files: Mapping[str, Expected]) -> None:
        """Record what each shard file must be, by key, and refuse (:class:`OptionsError`) a
        ``max_local_bytes`` smaller than the largest shard's files."""
        self._expected = dict(files)
        if self.max_local_bytes is None:
            return
        shards: Counter[str] = Counter()
        for key, expected in files.items():
            shards[key.rsplit(".", 1)[0]] += blocks(expected.size)
        largest = max(shards.values(), default=0)
        if self.max_local_bytes < largest:
            raise OptionsError(
                f"max_local_bytes={self.max_local_bytes} is smaller than the largest shard of "
                f"{self.remote.url} ({largest} bytes of tokens and offsets): the local copy must hold the "
                "shards one batch reads in every process of the node at once; give several times that (e.g. "
                f"max_local_bytes={8 * largest})"
            )

    def path(self, key: str) -> Path:
        """The local file of ``key``: a shard file's verified copy (present or not), else ``key`` under
        the local directory."""
        expected = self._expected.get(key)
        if expected is None:
            return super().path(key)
        tag = expected.checksum.rsplit(":", 1)[-1] if expected.checksum else f"n{expected.size}"
        tag += f"-{expected.version}" if expected.version else ""
        # Another format's files are copied into the shard folder too, where the bound counts them.
        name = key if key.startswith(f"{SHARD_DIR}/") else f"{SHARD_DIR}/{quote(key, safe='')}"
        return self.root / f"{name}.{tag}"

    def refuse_outside(self, key: str, *, links_only: bool = False) -> None:
        """Nothing to refuse: shard keys are checked names, mapped to copies this store writes itself."""

    def map_array(self, key: str, dtype: np.dtype, count: int) -> np.ndarray:
        """The first ``count`` items of the shard file ``key``, mapped from its local copy (fetched first
        when absent); the map keeps the copy from eviction while it lives.

        Raises:
            CacheError: the object is missing, damaged (checksum or size), or cannot be fetched; the
                bound leaves no room for it; or the store was closed.
        """
        dtype = np.dtype(dtype)
        if count == 0:
            return np.zeros(0, dtype=dtype)
        nbytes = count * dtype.itemsize
        if self.max_local_bytes is not None and self._watching != os.getpid():
            self._watch_pressure()
        if self.path(key).exists():
            self.prefetch_hits += 1
        else:
            self.prefetch_misses += 1
        for _ in range(8):  # evicted between its download and its map: fetched again
            path = self.fetch(key)
            assert path is not None  # a fetch that may wait returns a path or raises
            mapped = map_pinned(path, nbytes, self._expected[key].size)
            if mapped is not None:
                with contextlib.suppress(OSError):
                    os.utime(path)  # most recently used
                return np.frombuffer(mapped, dtype=dtype, count=count)
        raise CacheError(
            f"{self.describe(key)}: its local copy {path} kept being evicted before it could be mapped; "
            "raise max_local_bytes"
        )

    def expected_blocks(self, key: str) -> int:
        """What the copy of the shard file ``key`` takes, counted as the bound counts it."""
        return blocks(self._expected[key].size)

    def fetch(self, key: str, *, wait: bool = True, keep: Iterable[Path] = ()) -> Path | None:
        """Make sure the verified copy of the shard file ``key`` is local, downloading it if needed.

        Args:
            key: a shard file's key.
            wait: wait for other processes to release the room their maps hold; else give up at once.
            keep: local copies not to evict (what a prefetch fetched for nearer steps).

        Returns:
            The copy's path; None when ``wait`` is false and there was no room.

        Raises:
            CacheError: the object is missing or damaged, a download keeps failing, (``wait``) no room
                was made in time, or the store was closed.
        """
        self._refuse_closed()
        path = self.path(key)
        if path.exists():
            return path
        expected = self._expected.get(key)
        if expected is None:
            raise CacheError(f"{self.describe(key)}: not a shard file of this cache's manifest")
        with flocked(self.root / "locks" / path.name):
            if path.exists():  # another process fetched it while this one waited for the lock
                return path
            part = path.with_name(f"{path.name}.part{os.getpid()}-{threading.get_ident()}")
            fd = self._reserve(part, expected.size, wait=wait, keep=frozenset(keep))
            if fd is None:
                return None
            try:
                download(self.remote, key, expected, fd)
                # Under the space lock: a scan must not miss the file under both its names.
                with flocked(self.root / "space.lock"):
                    os.replace(part, path)
            except BaseException:
                part.unlink(missing_ok=True)
                raise
            finally:
                os.close(fd)  # releases the part's lock: it is the copy now, or gone
        self.downloads += 1
        return path

    def local_bytes(self) -> int:
        """What the shard files of the local directory take, counted as the bound counts them."""
        return sum(size for _, _, size in self._files())

    def _reserve(self, part: Path, size: int, *, wait: bool, keep: frozenset[Path]) -> int | None:
        """Make room for ``size`` bytes and create ``part`` at that size, locked; its descriptor, or None
        when there is no room and ``wait`` is false."""
        deadline = time.monotonic() + WAIT_SECONDS
        released = False
        own_since: float | None = None
        while True:
            with flocked(self.root / "space.lock"):
                if self._make_room(blocks(size), keep):
                    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    os.ftruncate(fd, size)
                    return fd
            if not wait:
                return None
            if not released:
                release_maps()  # this process's kept maps may be what holds the room
                released = True
                continue
            own = self._own_blocks()
            if self.max_local_bytes is not None and own + blocks(size) > self.max_local_bytes:
                own_since = time.monotonic() if own_since is None else own_since
                if time.monotonic() - own_since > OWN_WAIT_SECONDS:
                    raise CacheError(
                        f"{self.root}: no room for {size} more bytes within max_local_bytes="
                        f"{self.max_local_bytes}: this process itself maps {own} bytes of copies there (the "
                        "shards its current reads use), which no other process can free, and the next file "
                        "does not fit beside them. The bound must hold the shards one batch of every process "
                        "of the node reads at once; raise max_local_bytes (this process alone needs at "
                        f"least {own + blocks(size)})"
                    )
            else:
                own_since = None
            (self.root / PRESSURE).touch()  # other processes drop their kept maps (PressureWatcher)
            if time.monotonic() > deadline:
                raise CacheError(
                    f"{self.root}: no room for {size} more bytes within max_local_bytes="
                    f"{self.max_local_bytes} after {WAIT_SECONDS:.0f} s: every file there is mapped by a "
                    "reader. The bound must hold the shards one batch of every process of the node reads "
                    "at once; raise max_local_bytes"
                )
            time.sleep(0.05)

    def _own_blocks(self) -> int:
        """What the copies this process maps take (counted as the bound counts them)."""
        shards = self.root / SHARD_DIR
        with pinned_lock:
            paths = [path for path in pinned if path.parent == shards]
        total = 0
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                total += blocks(path.stat().st_size)
        return total

    def _make_room(self, need: int, keep: frozenset[Path]) -> bool:
        """Evict least recently used copies that no one maps until ``need`` more bytes fit the bound."""
        if self.max_local_bytes is None:
            return True
        files = self._files()
        used = sum(size for _, _, size in files)
        for _, path, size in sorted(files):
            if used + need <= self.max_local_bytes:
                break
            if path not in keep and evict(path):
                used -= size
        return used + need <= self.max_local_bytes

    def _files(self) -> builtins.list[tuple[float, Path, int]]:
        """(modification time, path, blocks) of every file of the shard folder."""
        found = []
        with os.scandir(self.root / SHARD_DIR) as entries:
            for entry in entries:
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat()
                    found.append((st.st_mtime, Path(entry.path), blocks(st.st_size)))
        return found

    def _watch_pressure(self) -> None:
        """Register the copy with this process's watcher: an idle process (a DataLoader worker blocked on
        its queue) would otherwise keep its files pinned."""
        self._refuse_closed()
        # By id (unique while the store lives): two threads of a first read register it once between them.
        WATCHER.watch(id(self), self.root)
        if self._unwatch is None:  # else made before a fork: it takes back the registration here too
            self._unwatch = weakref.finalize(self, WATCHER.unwatch, id(self))
            self._unwatch.atexit = False  # the thread is a daemon: nothing to stop at exit
        self._watching = os.getpid()

    def _refuse_closed(self) -> None:
        if self._closed:
            raise CacheError(f"{self.remote.url}: the cache was closed; open it again to read it")


def cached_store(
    url: str,
    *,
    local_dir: str | os.PathLike[str] | None,
    max_local_bytes: int | None,
    prefetch_steps: int | None,
    storage_options: Mapping[str, Any] | None,
) -> CachedStore:
    """The store of the remote cache at ``url`` read through a local copy (see :func:`streampack.open`).

    Raises:
        OptionsError: ``max_local_bytes`` or ``prefetch_steps`` is not a non-negative integer.
    """
    max_local_bytes = check_int_or_none("max_local_bytes", max_local_bytes, min=0)
    prefetch_steps = check_int_or_none("prefetch_steps", prefetch_steps, min=0)
    remote = RemoteStore(url, storage_options)
    return CachedStore(
        remote,
        local_dir if local_dir is not None else default_local_dir(remote.url),
        max_local_bytes=max_local_bytes,
        prefetch_steps=DEFAULT_PREFETCH_STEPS if prefetch_steps is None else prefetch_steps,
        storage_options=storage_options,
    )


def download(remote: RemoteStore, key: str, expected: Expected, fd: int) -> None:
    """Write the object's first ``expected.size`` bytes at the start of ``fd``; a :class:`CacheError`
    when it is missing, or of another size or checksum than ``expected``."""
    crc = 0
    done = 0
    # A final file's last GET asks for one byte more: an object longer than the manifest says is
    # damaged too (its first bytes may still match the checksum).
    end = expected.size + 1 if expected.checksum else expected.size
    while done < expected.size:
        try:
            chunk = remote.read(key, done, min(end, done + COPY_CHUNK))
        except FileNotFoundError:
            raise CacheError(
                f"{remote.describe(key)}: the object is missing, but the cache's manifest names it; the "
                "cache in object storage is damaged: rebuild it"
            ) from None
        if not chunk:
            break
        if done + len(chunk) > expected.size:
            raise CacheError(
                f"{remote.describe(key)}: the object holds more than the {expected.size} bytes the cache's "
                "manifest says; the cache in object storage is damaged: rebuild it"
            )
        os.pwrite(fd, chunk, done)
        crc = crc32(chunk, crc)
        done += len(chunk)
    if done != expected.size:
        raise CacheError(
            f"{remote.describe(key)}: the object holds {done} bytes, the cache's manifest says "
            f"{expected.size}; the cache in object storage is damaged: rebuild it"
        )
    actual = f"crc32:{crc:08x}"
    if expected.checksum and actual != expected.checksum:
        raise CacheError(
            f"{remote.describe(key)}: the object's checksum is {actual}, the cache's manifest says "
            f"{expected.checksum}; the object was damaged or replaced after the build: rebuild the cache "
            "(nothing was kept locally)"
        )


def blocks(size: int) -> int:
    """``size`` bytes counted in whole :data:`BLOCK` s, as the bound counts a file."""
    return -(-size // BLOCK) * BLOCK


def map_pinned(path: Path, nbytes: int, size: int) -> mmap.mmap | None:
    """A read-only map of ``path`` that holds a shared lock on it while it lives (the map's duplicate of the
    descriptor shares the lock); None when the file was evicted meanwhile, or is not of its verified
    ``size`` (then deleted, to be fetched again)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        st = os.fstat(fd)
        if st.st_nlink == 0:  # evicted between the open and the lock
            return None
        if st.st_size != size:  # a map past its end would crash the process (SIGBUS) at the first read
            path.unlink(missing_ok=True)
            return None
        mapped = mmap.mmap(fd, nbytes, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    with pinned_lock:
        pinned[path] = pinned.get(path, 0) + 1
    weakref.finalize(mapped, unpin, path)
    return mapped


def unpin(path: Path) -> None:
    with pinned_lock:
        left = pinned.get(path, 0) - 1
        if left > 0:
            pinned[path] = left
        else:
            pinned.pop(path, None)


def evict(path: Path) -> bool:
    """Delete ``path`` unless someone maps it (or downloads it): whether its room was freed."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False  # a download renamed into place since the scan: its room is still taken
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    else:
        path.unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)


@contextlib.contextmanager
def flocked(path: Path) -> Iterator[None]:
    """Hold the exclusive ``flock`` of ``path`` (created, never deleted) for a ``with`` block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)

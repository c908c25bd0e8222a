"""Reading a cache in object storage through a bounded local copy shared by the processes of one node.

:class:`CachedStore` is the store :func:`streampack.open` gives a cache under an fsspec URL
(``s3://bucket/prefix``): the manifest, ledger and listings are read from object storage, and each shard
file is fetched whole, on first use, into a local directory, then memory-mapped from there, so that
the reader and the loader run unchanged. The local directory (``local_dir``; by default one per URL
under the temp dir) holds::

    shards/NNNNNN.tokens.CRC    a verified copy of shards/NNNNNN.tokens (CRC: its checksum's hex digits)
    shards/NNNNNN.tokens.CRC.partPID   a download under way (its full size, reserved up front)
    locks/NNNNNN.tokens.CRC     the per-file download lock
    space.lock                  held while the space is counted and files are evicted
    pressure                    touched by a process waiting for room
    layouts/                    the sample plans of ``cache.packed`` (see :mod:`streampack.samples.packing`)

Naming a copy by its checksum means a cache rebuilt under the same URL never serves a stale copy.

The rules that keep several processes (DataLoader workers, ranks) of one node correct:

* **One download per file.** A download holds the file's lock (``flock``), writes to a temporary name,
  verifies the size and the CRC-32 the manifest (or, for an unfinished build, the ledger) records, and
  only then renames it into place. A process that waited for the lock finds the copy and uses it.
* **Bounded disk.** With ``max_local_bytes``, the shard files of the directory (copies and downloads
  under way, each counted in whole 4 KiB blocks) never total more than the bound: room for a download is
  made under ``space.lock`` by evicting the least recently used copies (the oldest modification time;
  a copy is touched each time it is mapped) and reserved by creating the temporary file at its full size.
* **Mapped files are never evicted.** Deleting a mapped file would not free its disk until the map is
  closed, so a map holds a shared ``flock`` on its file for as long as it lives, and eviction takes only
  files it can lock exclusively. When nothing can be evicted, the process first drops the maps it keeps
  for reuse (the reader's, the loader's), then touches ``pressure`` and waits: a thread of every process
  reading the copy with a bound watches that file and drops its process's kept maps when it changes
  (maps in use by a read stay valid). It gives up after a while (:data:`WAIT_SECONDS`) with a message
  saying the bound is too small; at once (within :data:`OWN_WAIT_SECONDS`) when the copies its own
  process maps leave no room, which no other process can free (one batch needs more than the bound).
  The bound must therefore hold the shards that one batch of every process of the node reads at once,
  plus what prefetching keeps ahead; a bound smaller than the largest shard is refused when the cache is
  opened.
* **A copy is what was verified.** A copy is renamed into place only once its size and CRC-32 match;
  each map checks its size again (a copy truncated since would crash the process at the first read past
  its end): one of another size is deleted and fetched again.

Prefetching (:mod:`streampack.loader.prefetch`) fetches the shards of the next steps in a background thread,
within half the bound and without ever waiting for room or evicting what it fetched for nearer steps.
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
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from streampack._checks import check_int_or_none
from streampack.errors import CacheError, OptionsError
from streampack.format.names import SHARD_DIR
from streampack.store import LocalStore
from streampack.store.remote import RemoteStore

DEFAULT_PREFETCH_STEPS = 8
"""Steps ahead whose shards a loader over a remote cache fetches in the background."""

BLOCK = 4096  # files are counted in whole blocks: what they take on disk, not their length
WAIT_SECONDS = 60.0  # how long a download waits for other processes to release mapped files
_CHUNK = 8 << 20  # bytes per ranged GET of a download

# Callbacks that drop the maps this process keeps for reuse (registered by readers and loaders).
_releasers: list[weakref.WeakMethod[Callable[[], None]]] = []
_releasers_lock = threading.Lock()
_watched: dict[Path, int] = {}  # the local copies this process watches for pressure, and by which pid
_POLL_SECONDS = 0.02
# The copies this process maps, with the number of its live maps of each: what only it can release.
_pinned: dict[Path, int] = {}
_pinned_lock = threading.Lock()
# How long a process waits when its own maps alone leave no room: another of its threads may be between
# the maps of one read and their release; one batch is read in far less.
OWN_WAIT_SECONDS = 1.0


def default_local_dir(url: str) -> Path:
    """The local copy of the cache at ``url`` when none is given: one per URL, in the temp dir."""
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "streampack-read" / digest


def on_release(method: Callable[[], None]) -> None:
    """Register a bound method that drops the shard maps its object keeps for reuse: called when a
    download needs room that only mapped files hold (held weakly: registering never keeps it alive)."""
    with _releasers_lock:
        _releasers[:] = [ref for ref in _releasers if ref() is not None]
        _releasers.append(weakref.WeakMethod(method))


def release_maps() -> None:
    """Drop every shard map this process keeps for reuse (maps still in use stay valid)."""
    with _releasers_lock:
        methods = [ref() for ref in _releasers]
    for method in methods:
        if method is not None:
            method()


def _watch_pressure(root: Path) -> None:
    """Start (once per process and local copy) the thread that drops this process's kept maps whenever
    another process waits for room: an idle process (a DataLoader worker blocked on its queue) would
    otherwise keep its files pinned."""
    with _releasers_lock:
        if _watched.get(root) == os.getpid():
            return
        _watched[root] = os.getpid()
    pressure = root / "pressure"
    threading.Thread(target=_watch, args=(pressure,), name="streampack-pressure", daemon=True).start()


def _watch(pressure: Path) -> None:
    seen = _mtime(pressure)
    while True:
        time.sleep(_POLL_SECONDS)
        now = _mtime(pressure)
        if now != seen:
            seen = now
            release_maps()


def _mtime(path: Path) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return 0


@dataclass(frozen=True)
class Expected:
    """What the local copy of a shard file must be: its length, and its checksum (``crc32:…``; empty when
    the cache records none, e.g. a unit an unfinished build has not published whole)."""

    size: int
    checksum: str


class CachedStore(LocalStore):
    """A remote cache read through a bounded local copy (see the module docstring for the rules).

    Everything but shard files is read from ``remote``; :meth:`map_array` fetches a shard file into the
    local directory when it is not there, and maps the copy. It is a :class:`~streampack.store.LocalStore`
    of the local directory for what readers keep locally (the plans under ``layouts/``).

    Args:
        remote: the cache in object storage.
        local_dir: the local directory (created), shared by the processes that read the same cache.
        max_local_bytes: the bound on the shard files of ``local_dir``; None: unbounded.
        prefetch_steps: how many steps ahead a loader fetches (0: no prefetching).
        storage_options: what ``remote`` was opened with, for reopening it in another process.
    """

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

    def reopen_options(self) -> dict[str, Any]:
        """The arguments of :func:`streampack.open` that reopen this cache through the same local copy."""
        return {
            "local_dir": str(self.root),
            "max_local_bytes": self.max_local_bytes,
            "prefetch_steps": self.prefetch_steps,
            "storage_options": self.storage_options,
        }

    # ---------------------------------------------------------------------------- the remote cache's

    @property
    def uri(self) -> str:
        """The cache's URL."""
        return self.remote.url

    def describe(self, key: str) -> str:
        """The URL of ``key``."""
        return self.remote.describe(key)

    def exists(self, key: str) -> bool:
        """Whether the object ``key`` exists in object storage."""
        return self.remote.exists(key)

    def size(self, key: str) -> int:
        """Size of the object ``key``."""
        return self.remote.size(key)

    def read(self, key: str, start: int = 0, stop: int | None = None) -> bytes:
        """Bytes ``[start, stop)`` of the object ``key``."""
        return self.remote.read(key, start, stop)

    def read_json(self, key: str, *, what: str) -> Any:
        """A small JSON object of the remote cache (see :meth:`RemoteStore.read_json`)."""
        return self.remote.read_json(key, what=what)

    def list(self, prefix: str) -> builtins.list[str]:
        """The names of the objects under ``prefix`` in object storage."""
        return self.remote.list(prefix)

    def list_sizes(self, prefix: str) -> dict[str, int]:
        """The sizes of the objects under ``prefix`` in object storage (one LIST)."""
        return self.remote.list_sizes(prefix)

    def put_atomic(self, key: str, data: bytes) -> None:
        """Refused: a cache read through a local copy is read-only.

        Raises:
            CacheError: always.
        """
        raise CacheError(f"{self.describe(key)}: a cache opened from object storage is read-only")

    # ---------------------------------------------------------------------------------- the local copy

    def expect(self, files: Mapping[str, Expected]) -> None:
        """Record what each shard file must be (from the manifest, or the ledger of an unfinished build),
        and refuse a bound that cannot hold the largest shard.

        Args:
            files: by key (``shards/000003.tokens``).

        Raises:
            OptionsError: ``max_local_bytes`` is smaller than the largest shard's files.
        """
        self._expected = dict(files)
        if self.max_local_bytes is None:
            return
        shards: dict[str, int] = {}
        for key, expected in files.items():
            stem = key.rsplit(".", 1)[0]
            shards[stem] = shards.get(stem, 0) + _blocks(expected.size)
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
        return self.root / f"{key}.{tag}"

    def refuse_outside(self, key: str, *, links_only: bool = False) -> None:
        """Nothing to refuse: shard keys come from the manifest, checked names, and map to local copies
        this store writes itself."""

    def map_array(self, key: str, dtype: np.dtype, count: int) -> np.ndarray:
        """The first ``count`` items of the shard file ``key``, mapped from its local copy (fetched first
        when it is not there). The map holds a shared lock on the copy, which keeps it from eviction
        until the map is garbage.

        Raises:
            CacheError: the object is missing, damaged (checksum or size), or cannot be fetched; or the
                bound leaves no room for it.
        """
        dtype = np.dtype(dtype)
        if count == 0:
            return np.zeros(0, dtype=dtype)
        nbytes = count * dtype.itemsize
        if self.max_local_bytes is not None:
            _watch_pressure(self.root)
        for _ in range(8):  # evicted between its download and its map: fetched again
            path = self.fetch(key)
            assert path is not None  # a fetch that may wait returns a path or raises
            mapped = _map_pinned(path, nbytes, self._expected[key].size)
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
        return _blocks(self._expected[key].size)

    def is_local(self, key: str) -> bool:
        """Whether the verified copy of ``key`` is in the local directory."""
        return self.path(key).exists()

    def fetch(self, key: str, *, wait: bool = True, keep: Iterable[Path] = ()) -> Path | None:
        """Make sure the verified copy of the shard file ``key`` is local, downloading it if needed.

        Args:
            key: a shard file's key.
            wait: wait for other processes to release mapped files when only they hold the room needed
                (and drop this process's own kept maps first); else give up at once.
            keep: local copies not to evict to make room (what a prefetch fetched for nearer steps).

        Returns:
            The copy's path; None when ``wait`` is false and there was no room.

        Raises:
            CacheError: the object is missing or damaged, a download keeps failing, or (``wait``) no room
                was made in time.
        """
        path = self.path(key)
        if path.exists():
            return path
        expected = self._expected.get(key)
        if expected is None:
            raise CacheError(f"{self.describe(key)}: not a shard file of this cache's manifest")
        with _flocked(self.root / "locks" / path.name):
            if path.exists():  # another process fetched it while this one waited for the lock
                return path
            part = path.with_name(f"{path.name}.part{os.getpid()}-{threading.get_ident()}")
            fd = self._reserve(part, expected.size, wait=wait, keep=frozenset(keep))
            if fd is None:
                return None
            try:
                self._download(key, expected, fd)
                # Under the space lock: a scan that counts the files must not list the part and then
                # find it gone (renamed), missing the file under both names.
                with _flocked(self.root / "space.lock"):
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
        return sum(size for _, _, size in self._local_files())

    # ---------------------------------------------------------------------------------------- internals

    def _download(self, key: str, expected: Expected, fd: int) -> None:
        """Write the object's first ``expected.size`` bytes at the start of ``fd``, checking the size and
        the checksum."""
        crc = 0
        done = 0
        # A final file's last GET asks for one byte more: an object longer than the manifest says is
        # damaged too (its first bytes may still match the checksum).
        end = expected.size + 1 if expected.checksum else expected.size
        while done < expected.size:
            try:
                chunk = self.remote.read(key, done, min(end, done + _CHUNK))
            except FileNotFoundError:
                raise CacheError(
                    f"{self.describe(key)}: the object is missing, but the cache's manifest names it; the "
                    "cache in object storage is damaged: rebuild it"
                ) from None
            if not chunk:
                break
            if done + len(chunk) > expected.size:
                raise CacheError(
                    f"{self.describe(key)}: the object holds more than the {expected.size} bytes the cache's "
                    "manifest says; the cache in object storage is damaged: rebuild it"
                )
            os.pwrite(fd, chunk, done)
            crc = zlib.crc32(chunk, crc)
            done += len(chunk)
        if done != expected.size:
            raise CacheError(
                f"{self.describe(key)}: the object holds {done} bytes, the cache's manifest says "
                f"{expected.size}; the cache in object storage is damaged: rebuild it"
            )
        actual = f"crc32:{crc:08x}"
        if expected.checksum and actual != expected.checksum:
            raise CacheError(
                f"{self.describe(key)}: the object's checksum is {actual}, the cache's manifest says "
                f"{expected.checksum}; the object was damaged or replaced after the build: rebuild the cache "
                "(nothing was kept locally)"
            )

    def _reserve(self, part: Path, size: int, *, wait: bool, keep: frozenset[Path]) -> int | None:
        """Make room for ``size`` bytes and create ``part`` at that size, locked; its descriptor, or None
        when there is no room and ``wait`` is false."""
        deadline = time.monotonic() + WAIT_SECONDS
        released = False
        own_since: float | None = None
        while True:
            with _flocked(self.root / "space.lock"):
                if self._make_room(_blocks(size), keep):
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
            if self.max_local_bytes is not None and own + _blocks(size) > self.max_local_bytes:
                own_since = time.monotonic() if own_since is None else own_since
                if time.monotonic() - own_since > OWN_WAIT_SECONDS:
                    raise CacheError(
                        f"{self.root}: no room for {size} more bytes within max_local_bytes="
                        f"{self.max_local_bytes}: this process itself maps {own} bytes of copies there (the "
                        "shards its current reads use), which no other process can free, and the next file "
                        "does not fit beside them. The bound must hold the shards one batch of every process "
                        "of the node reads at once; raise max_local_bytes (this process alone needs at "
                        f"least {own + _blocks(size)})"
                    )
            else:
                own_since = None
            (self.root / "pressure").touch()  # other processes drop their kept maps (see _watch_pressure)
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
        with _pinned_lock:
            paths = [path for path in _pinned if path.parent == shards]
        total = 0
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                total += _blocks(path.stat().st_size)
        return total

    def _make_room(self, need: int, keep: frozenset[Path]) -> bool:
        """Evict least recently used copies that no one maps until ``need`` more bytes fit the bound."""
        if self.max_local_bytes is None:
            return True
        files = self._local_files()
        used = sum(size for _, _, size in files)
        for _, path, size in sorted(files):
            if used + need <= self.max_local_bytes:
                break
            if path not in keep and _evict(path):
                used -= size
        return used + need <= self.max_local_bytes

    def _local_files(self) -> builtins.list[tuple[float, Path, int]]:
        """(modification time, path, blocks) of every file of the shard folder."""
        found = []
        with os.scandir(self.root / SHARD_DIR) as entries:
            for entry in entries:
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat()
                    found.append((st.st_mtime, Path(entry.path), _blocks(st.st_size)))
        return found


def _blocks(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def _map_pinned(path: Path, nbytes: int, size: int) -> mmap.mmap | None:
    """A read-only map of ``path`` holding a shared lock on it until the map is closed (the map keeps a
    duplicate of the descriptor, which shares the lock); None when the file was evicted meanwhile, or was
    not of its verified ``size`` (damaged since its download: deleted, to be fetched again)."""
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
    with _pinned_lock:
        _pinned[path] = _pinned.get(path, 0) + 1
    weakref.finalize(mapped, _unpin, path)
    return mapped


def _unpin(path: Path) -> None:
    with _pinned_lock:
        left = _pinned.get(path, 0) - 1
        if left > 0:
            _pinned[path] = left
        else:
            _pinned.pop(path, None)


def _evict(path: Path) -> bool:
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
def _flocked(path: Path) -> Iterator[None]:
    """Hold the exclusive ``flock`` of ``path`` (created, never deleted) for a ``with`` block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


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

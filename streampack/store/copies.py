"""The files of a bounded local copy: verified downloads, the bound (reservation, eviction), pinned maps.

The rules are :mod:`streampack.store.localcopy`'s. The copies this process maps are counted in a
process-wide table (live maps per path, each dropped by a weakref finalizer of its map): what only this
process can release.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import mmap
import os
import threading
import time
import weakref
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from streampack.errors import CacheError
from streampack.format.names import SHARD_DIR
from streampack.store import Expected
from streampack.store.pressure import PRESSURE, release_maps
from streampack.store.remote import RemoteStore

BLOCK = 4096  # files are counted in whole blocks: what they take on disk, not their length
WAIT_SECONDS = 60.0  # how long a download waits for other processes to release mapped files
COPY_CHUNK = 8 << 20  # bytes per ranged GET of a download

# The copies this process maps, with the number of its live maps of each: what only it can release.
pinned: dict[Path, int] = {}
pinned_lock = threading.Lock()
# How long a process waits when its own maps alone leave no room: another of its threads may be between
# the maps of one read and their release; one batch is read in far less.
OWN_WAIT_SECONDS = 1.0


@dataclass(frozen=True)
class LocalCopy:
    """The shard folder of a local copy and its bound: where room for a download is made.

    Args:
        root: the local directory (its ``shards/`` folder holds the copies).
        max_local_bytes: the bound on the shard files there; None: unbounded.
    """

    root: Path
    max_local_bytes: int | None

    def fetch(
        self,
        remote: RemoteStore,
        key: str,
        path: Path,
        expected: Expected,
        *,
        wait: bool,
        keep: frozenset[Path],
    ) -> bool | None:
        """Download the object ``key`` of ``remote`` into its verified copy ``path``, unless another
        process did while this one waited for the file's lock: whether this call downloaded it (None when
        ``wait`` is false and there was no room). Raises as :meth:`CachedStore.fetch` does."""
        with flocked(self.root / "locks" / path.name):
            if path.exists():  # another process fetched it while this one waited for the lock
                return False
            part = path.with_name(f"{path.name}.part{os.getpid()}-{threading.get_ident()}")
            fd = self.reserve(part, expected.size, wait=wait, keep=keep)
            if fd is None:
                return None
            try:
                download(remote, key, expected, fd)
                # Under the space lock: a scan must not miss the file under both its names.
                with flocked(self.root / "space.lock"):
                    os.replace(part, path)
            except BaseException:
                part.unlink(missing_ok=True)
                raise
            finally:
                os.close(fd)  # releases the part's lock: it is the copy now, or gone
        return True

    def reserve(self, part: Path, size: int, *, wait: bool, keep: frozenset[Path]) -> int | None:
        """Make room for ``size`` bytes and create ``part`` at that size, locked; its descriptor, or None
        when there is no room and ``wait`` is false."""
        deadline = time.monotonic() + WAIT_SECONDS
        released = False
        own_since: float | None = None
        while True:
            with flocked(self.root / "space.lock"):
                if self.make_room(blocks(size), keep):
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
            own = self.own_blocks()
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
            (self.root / PRESSURE).touch()  # other processes drop their kept maps (streampack.store.pressure)
            if time.monotonic() > deadline:
                raise CacheError(
                    f"{self.root}: no room for {size} more bytes within max_local_bytes="
                    f"{self.max_local_bytes} after {WAIT_SECONDS:.0f} s: every file there is mapped by a "
                    "reader. The bound must hold the shards one batch of every process of the node reads "
                    "at once; raise max_local_bytes"
                )
            time.sleep(0.05)

    def own_blocks(self) -> int:
        """What the copies this process maps take (counted as the bound counts them)."""
        shards = self.root / SHARD_DIR
        with pinned_lock:
            paths = [path for path in pinned if path.parent == shards]
        total = 0
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                total += blocks(path.stat().st_size)
        return total

    def make_room(self, need: int, keep: frozenset[Path]) -> bool:
        """Evict least recently used copies that no one maps until ``need`` more bytes fit the bound."""
        if self.max_local_bytes is None:
            return True
        files = self.files()
        used = sum(size for _, _, size in files)
        for _, path, size in sorted(files):
            if used + need <= self.max_local_bytes:
                break
            if path not in keep and evict(path):
                used -= size
        return used + need <= self.max_local_bytes

    def files(self) -> builtins.list[tuple[float, Path, int]]:
        """(modification time, path, blocks) of every file of the shard folder."""
        found = []
        with os.scandir(self.root / SHARD_DIR) as entries:
            for entry in entries:
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat()
                    found.append((st.st_mtime, Path(entry.path), blocks(st.st_size)))
        return found


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
        crc = zlib.crc32(chunk, crc)
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

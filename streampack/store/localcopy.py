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
  (maps in use by a read stay valid; :mod:`streampack.store.pressure`: one thread per process, while an
  open store watches a copy). It gives up after a while (:data:`WAIT_SECONDS`) with a message
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

**Lifecycle.** A store registers its copy with the process's watcher on its first map (with a bound);
:meth:`CachedStore.close` (or the end of its ``with`` block) takes the registration back, which stops the
watcher thread once no open store of the process watches a copy, and refuses further reads. A store
garbage-collected unclosed takes it back too (a weakref finalizer). The copies stay on disk for the next
reader.

This module holds the store; :mod:`streampack.store.copies` the files of the copy (downloads, the bound,
eviction, pinning maps) and :mod:`streampack.store.pressure` the release of kept maps (the watcher).
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import os
import tempfile
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np

from streampack._checks import check_int_or_none
from streampack.errors import CacheError, OptionsError
from streampack.format.names import SHARD_DIR
from streampack.store import Expected, LocalStore
from streampack.store.copies import (
    LocalCopy,
    blocks,
    map_pinned,
)
from streampack.store.pressure import WATCHER, forget_release, on_release
from streampack.store.remote import RemoteStore

DEFAULT_PREFETCH_STEPS = 8
"""Steps ahead whose shards a loader over a remote cache fetches in the background."""


def default_local_dir(url: str) -> Path:
    """The local copy of the cache at ``url`` when none is given: one per URL, in the temp dir."""
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "streampack-read" / digest


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

    Close it (:meth:`close`, or a ``with`` block) when done: see the module docstring's lifecycle.
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
        """Take back the copy's registration with the process's watcher (whose thread ends, joined, once
        no open store of the process watches a copy) and refuse further reads; the copies stay on disk,
        and maps already made stay valid. Calling it again does nothing."""
        self._closed = True
        if self._unwatch is not None:
            self._unwatch()

    def __enter__(self) -> CachedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    fetches_copies = True

    def on_pressure(self, release: Callable[[], None]) -> None:
        """Have ``release`` called when a download needs room that kept maps hold
        (:func:`streampack.store.pressure.on_release`)."""
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

    # ---------------------------------------------------------------------------- the remote cache's

    @property
    def uri(self) -> str:
        """The cache's URL: what :func:`streampack.open` was given."""
        return self.opened or self.remote.url

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
            shards[stem] = shards.get(stem, 0) + blocks(expected.size)
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
        """Nothing to refuse: shard keys come from the manifest, checked names, and map to local copies
        this store writes itself."""

    def map_array(self, key: str, dtype: np.dtype, count: int) -> np.ndarray:
        """The first ``count`` items of the shard file ``key``, mapped from its local copy (fetched first
        when it is not there). The map holds a shared lock on the copy, which keeps it from eviction
        until the map is garbage.

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
        copy = LocalCopy(self.root, self.max_local_bytes)
        downloaded = copy.fetch(self.remote, key, path, expected, wait=wait, keep=frozenset(keep))
        if downloaded is None:
            return None
        self.downloads += downloaded
        return path

    def local_bytes(self) -> int:
        """What the shard files of the local directory take, counted as the bound counts them."""
        return sum(size for _, _, size in LocalCopy(self.root, self.max_local_bytes).files())

    def _watch_pressure(self) -> None:
        """Register the copy with this process's watcher (see :mod:`streampack.store.pressure`): an idle
        process (a DataLoader worker blocked on its queue) would otherwise keep its files pinned."""
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

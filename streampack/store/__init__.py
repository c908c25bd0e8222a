"""Where a cache's bytes live and how they become durable: the storage seam.

Everything above this module names a cache's files by *key*, a ``/``-separated path relative to the
cache (``manifest.json``, ``shards/000003.tokens``), and asks a store to read a range, map an array,
publish an object atomically, list, or lock. :class:`Store` is that contract; :class:`LocalStore`, a
directory on a POSIX filesystem, holds every POSIX detail of the package:

* publishing is write to ``KEY.tmp``, ``fsync``, ``rename``, ``fsync`` of the directory;
* a shard is appended in place (:class:`AppendFile`) from its committed length, fsynced before the
  ledger entry that covers it is published, and flocked while written;
* reading maps files with ``mmap``;
* the build lock is an ``flock``ed file, emptied and never deleted.

A cache in object storage is read through a bounded local copy (:mod:`streampack.store.localcopy`).
:class:`CacheRef` is what picklable views of a cache carry to reopen it elsewhere and tell whether it
changed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol
from urllib.parse import unquote, urlparse

import numpy as np
import orjson

from streampack.errors import BuildLockedError, CacheError, WriteError
from streampack.format.names import crc32

MAX_JSON_BYTES = 64 << 20  # a manifest of 100k shards is ~20 MB; refuse anything absurd before parsing
_CHECKSUM_CHUNK = 16 << 20


class Store(Protocol):
    """Where the files of one cache live, addressed by key (``"shards/000003.tokens"``).

    What every kind of store offers: a local directory with POSIX files, an object store with ranged GETs
    and PUTs. Appending to shards is not part of it: only a local store appends in place.
    """

    @property
    def uri(self) -> str:
        """The store's absolute address (``file:///data/cache``), for reopening it in another process."""

    def describe(self, key: str) -> str:
        """How messages name ``key`` (a path for a local store)."""

    def exists(self, key: str) -> bool:
        """Whether an object ``key`` exists."""

    def size(self, key: str) -> int:
        """Size in bytes of ``key``; FileNotFoundError when it does not exist."""

    def read(self, key: str, start: int = 0, stop: int | None = None) -> bytes:
        """Bytes ``[start, stop)`` of ``key`` (to its end when ``stop`` is None)."""

    def read_json(self, key: str, *, what: str) -> Any:
        """A small JSON object; a :class:`CacheError` naming ``what`` when absent, oversized or malformed."""

    def map_array(self, key: str, dtype: np.dtype, count: int) -> np.ndarray:
        """The first ``count`` items of ``key`` as a read-only array (a memory map where possible)."""

    def put_atomic(self, key: str, data: bytes) -> None:
        """Publish ``data`` as ``key`` durably: readers see the old object or the new one, never a part."""

    def list(self, prefix: str) -> list[str]:
        """The names of the objects directly under ``prefix`` (a folder key), sorted."""

    def list_sizes(self, prefix: str) -> dict[str, int]:
        """The size of every object directly under ``prefix``, by name, in one listing."""

    def lock(self, key: str) -> AbstractContextManager[object]:
        """An exclusive lock named ``key`` for a ``with`` block, where the store can lock
        (:class:`BuildLockedError` when another live process holds it)."""


def encode_json(obj: Any) -> bytes:
    """The bytes a cache's JSON files hold: indented, keys sorted, one final newline."""
    return orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"


def parse_json(data: bytes, described: str, what: str) -> Any:
    """Parse the bytes of a small JSON file; a :class:`CacheError` naming ``described`` when oversized or
    malformed."""
    if len(data) > MAX_JSON_BYTES:
        raise CacheError(f"{described}: {what} is over the {MAX_JSON_BYTES} byte limit")
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise CacheError(f"{described}: {what} is not valid JSON ({e})") from None


def is_remote(where: object) -> bool:
    """Whether ``where`` names object storage (an fsspec URL other than ``file://``)."""
    if not isinstance(where, str) or "://" not in where:
        return False
    scheme = urlparse(where).scheme
    return len(scheme) > 1 and scheme not in ("file", "local")  # one letter is a Windows drive


@dataclass(frozen=True)
class Expected:
    """What the local copy of a shard file must be: its length and checksum (``crc32:…``, or empty where
    none is recorded); ``version`` tells apart unchecksummed objects of one key and size (their ETag)."""

    size: int
    checksum: str
    version: str = ""


class LocalStore:
    """A cache directory on a POSIX filesystem (see the module docstring for its protocol).

    Args:
        root: the cache directory, as the caller named it (messages show paths under it unchanged).
    """

    #: Whether its shard files are copies fetched (and checked) from object storage: readers check none.
    fetches_copies = False
    #: Batches ahead a loader fetches the shard files of: none for local files.
    prefetch_steps = 0

    def expect(self, files: Mapping[str, Expected]) -> None:
        """Record what each shard file must be, for a store that fetches copies; nothing here."""

    def on_pressure(self, release: Callable[[], None]) -> None:
        """Have ``release`` called when a bounded local copy needs the room of kept maps; never here."""

    def forget_pressure(self, release: Callable[[], None]) -> None:
        """Take back what :meth:`on_pressure` registered."""

    def reopen_options(self) -> dict[str, Any]:
        """The :func:`streampack.open` keywords that reopen this cache as it was opened: none here."""
        return {}

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._real_root: str | None = None

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    @property
    def uri(self) -> str:
        """``file://`` and the absolute path of the directory (symlinks not resolved)."""
        return Path(os.path.abspath(self.root)).as_uri()

    def path(self, key: str) -> Path:
        """The file of ``key``."""
        return self.root / key if key else self.root

    def describe(self, key: str) -> str:
        """The path of ``key``, as messages show it."""
        return str(self.path(key))

    def exists(self, key: str) -> bool:
        """Whether ``key`` exists (a file or a folder)."""
        return self.path(key).exists()

    def size(self, key: str) -> int:
        """Size of the file ``key``. Raises FileNotFoundError."""
        return self.path(key).stat().st_size

    def read(self, key: str, start: int = 0, stop: int | None = None) -> bytes:
        """Bytes ``[start, stop)`` of the file ``key``."""
        with open(self.path(key), "rb") as f:
            f.seek(start)
            return f.read() if stop is None else f.read(max(0, stop - start))

    def read_json(self, key: str, *, what: str) -> Any:
        """Read a small JSON file; a :class:`CacheError` for an oversized, non-regular or malformed one."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise CacheError(f"{path}: {what} is not a regular file")
                data = f.read(MAX_JSON_BYTES + 1)  # never trust st_size alone (/proc files say 0)
        except FileNotFoundError:
            raise CacheError(f"{path}: {what} not found") from None
        except OSError as e:
            raise CacheError(f"{path}: cannot read the {what} ({e.strerror or e})") from None
        return parse_json(data, str(path), what)

    def map_array(self, key: str, dtype: np.dtype, count: int) -> np.ndarray:
        """A read-only memory map of the first ``count`` items of ``key``, as a plain ndarray view."""
        if count == 0:
            return np.zeros(0, dtype=dtype)
        # A plain ndarray view: slicing an np.memmap costs a subclass round trip per slice.
        return np.memmap(self.path(key), dtype=dtype, mode="r", shape=(count,)).view(np.ndarray)

    def put_atomic(self, key: str, data: bytes) -> None:
        """Write ``data`` to ``key`` atomically and durably: temp file, fsync, rename, fsync dir."""
        path = self.path(key)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)

    def list(self, prefix: str) -> list[str]:
        """Names in the folder ``prefix`` (none when it does not exist), sorted."""
        folder = self.path(prefix)
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []

    def list_sizes(self, prefix: str) -> dict[str, int]:
        """The size of every file in the folder ``prefix``, by name (one ``scandir``, one ``lstat`` a file).

        A symlink is followed only once it is known to stay inside the cache (else a :class:`CacheError`).
        """
        sizes = {}
        try:
            entries = os.scandir(self.path(prefix))
        except (FileNotFoundError, NotADirectoryError):
            return {}
        with entries:
            for entry in entries:
                if entry.is_symlink():
                    self.refuse_outside(f"{prefix}/{entry.name}")
                    with contextlib.suppress(FileNotFoundError):  # a dangling link: the file is missing
                        sizes[entry.name] = os.stat(entry.path).st_size
                else:
                    sizes[entry.name] = os.lstat(entry.path).st_size
        return sizes

    @contextlib.contextmanager
    def lock(self, key: str) -> Iterator[None]:
        """Hold the exclusive ``flock`` of the file ``key`` (the build lock) for a ``with`` block.

        The file holds the holder's pid and host. It is emptied, never deleted, when released: deleting it
        while locked would let a build that opened it just before lock the deleted file while a third locks
        a new one. The kernel releases an ``flock`` when its process dies, so a killed build's lock is free.

        Raises:
            BuildLockedError: another live process holds the lock, or the file cannot be created.
        """
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise BuildLockedError(
                f"cannot write to {path.parent}: {e.strerror}; choose a writable output directory"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise BuildLockedError(
                f"{path.parent} is locked by another build ({holder}); wait for it to finish or stop it, "
                "then rerun (a killed build's lock is released automatically)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            os.close(fd)

    def makedirs(self, key: str = "") -> None:
        """Create the folder ``key`` (the cache directory itself by default) and its parents."""
        self.path(key).mkdir(parents=True, exist_ok=True)

    def delete(self, key: str) -> None:
        """Delete the file or folder ``key`` if it exists."""
        path = self.path(key)
        if path.is_dir() and not path.is_symlink():
            import shutil  # and with it bz2 and lzma: not loaded by a reader of a cache

            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)

    def append_file(self, key: str, length: int) -> AppendFile:
        """Open the file ``key`` for appending at its committed ``length`` (see :class:`AppendFile`)."""
        return AppendFile(self.path(key), length)

    def sync_dir(self, key: str) -> None:
        """Make file creations and renames in the folder ``key`` durable."""
        fsync_dir(self.path(key))

    def crc32(self, key: str, length: int | None = None) -> int:
        """CRC-32 of the first ``length`` bytes of ``key`` (all of it by default)."""
        return crc32_file(self.path(key), length)

    def refuse_outside(self, key: str, *, links_only: bool = False) -> None:
        """Refuse ``key`` (:class:`CacheError`) if it resolves outside the cache directory.

        With ``links_only``, only a symlink is resolved (one ``lstat``, not a ``realpath`` walk, a file).
        """
        path = self.path(key)
        if links_only and not os.path.islink(path):
            return
        if self._real_root is None:
            self._real_root = os.path.realpath(self.root)
        real = os.path.realpath(path)
        if os.path.commonpath([real, self._real_root]) != self._real_root:
            raise CacheError(f"{path} resolves to {real}, outside the cache directory: refusing to read it")


def open_store(where: str | os.PathLike[str] | LocalStore) -> LocalStore:
    """The local store a path or a ``file://`` URI names; a :class:`CacheError` for another scheme."""
    if isinstance(where, LocalStore):
        return where
    if isinstance(where, os.PathLike):
        return LocalStore(where)
    if not isinstance(where, str):
        raise CacheError(f"a cache is named by a path or a file:// URI (got {where!r})")
    parsed = urlparse(where)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise CacheError(f"{where}: a file:// URI of another host ({parsed.netloc}) cannot be opened")
        return LocalStore(unquote(parsed.path))
    if len(parsed.scheme) > 1 and "://" in where:  # a single letter is a Windows drive, not a scheme
        raise CacheError(
            f"{where}: a cache in {parsed.scheme}:// storage is read through a local copy: open it with "
            "streampack.open(url, local_dir=..., max_local_bytes=...)"
        )
    return LocalStore(where)


@dataclass(frozen=True)
class CacheRef:
    """What names one cache wherever it is reopened: its store's URI and the digest of its shard table.

    Picklable views of a cache (``PackedSequences``, ``grain.DocumentSource``) carry this, never the
    open cache; reopening checks that the digest still matches.

    Attributes:
        uri: the store's URI (``file:///abs/path``, or the URL of a cache in object storage).
        content: the digest of the shard table when the view was made.
        allow_incomplete: reopen the committed part of a build that had not finished.
        reading: the :func:`streampack.open` keywords that reopen it as it was (never in its repr: they
            may hold storage credentials).
    """

    uri: str
    content: str
    allow_incomplete: bool = False
    reading: dict[str, Any] | None = field(default=None, repr=False, compare=False, hash=False)

    @property
    def local_path(self) -> str:
        """The absolute local path of the cache; the URL of a cache in object storage."""
        if not self.uri.startswith("file:"):
            return self.uri
        return str(open_store(self.uri).root)


class AppendFile:
    """A shard file of a local store being appended to in place, from its committed length.

    Opening truncates any uncommitted tail a crash left behind; :meth:`sync` is the writer's fsync before
    a ledger entry names the bytes. A write error is a :class:`WriteError` that says what to do.

    Raises:
        CacheError: the file is shorter than its committed length (damaged after it was written).
        WriteError: it cannot be opened or truncated.
    """

    def __init__(self, path: Path, length: int) -> None:
        self.path = path
        self.created = not path.exists()
        try:
            self._file: BinaryIO = open(path, "w+b" if self.created else "r+b")  # noqa: SIM115 - kept open
            size = self._file.seek(0, os.SEEK_END)
            if size < length:
                self._file.close()
                raise CacheError(
                    f"{path} holds {size} bytes but the ledger committed {length}: the shard was damaged "
                    "after it was written; rebuild with overwrite=True"
                )
            self._file.truncate(length)
            self._file.seek(length)
        except OSError as e:
            raise disk_error(e, path) from None
        # The CRC-32 so far, for a file started afresh; None for a resumed one (read back when asked).
        self._crc: int | None = 0 if length == 0 else None

    def lock(self) -> None:
        """Hold an exclusive ``flock`` on the file while writing it (:class:`WriteError` if another holds it):
        it keeps out a worker that outlived a killed build (a Ray task) while the rerun resumes its unit."""
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise WriteError(
                f"{self.path} is being written by another process (a worker of a killed build?); wait for it "
                "to exit, then rerun the same command"
            ) from None

    def write(self, data: bytes | memoryview) -> None:
        """Append ``data``."""
        try:
            self._file.write(data)
        except OSError as e:
            raise disk_error(e, self.path) from None
        if self._crc is not None:
            self._crc = crc32(data, self._crc)

    def crc32(self) -> int:
        """The CRC-32 of the whole file as appended so far."""
        if self._crc is not None:
            return self._crc
        try:
            self._file.flush()
        except OSError as e:
            raise disk_error(e, self.path) from None
        return crc32_file(self.path)

    def sync(self) -> None:
        """Flush and fsync what was appended."""
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as e:
            raise disk_error(e, self.path) from None

    def close(self) -> None:
        """Close the file (what was not synced may be lost in a crash; no ledger entry names it)."""
        self._file.close()


def fsync_dir(path: Path) -> None:
    """Make a rename or file creation in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def crc32_file(path: Path, length: int | None = None) -> int:
    """CRC-32 of the first ``length`` bytes of a file (all of it by default)."""
    crc = 0
    remaining = path.stat().st_size if length is None else length
    with open(path, "rb") as f:
        while remaining > 0:
            chunk = f.read(min(_CHECKSUM_CHUNK, remaining))
            if not chunk:
                break
            crc = crc32(chunk, crc)
            remaining -= len(chunk)
    return crc


def disk_error(error: OSError, path: Path) -> WriteError:
    """A :class:`WriteError` that says what to do about a failed write to ``path``."""
    if error.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        reason = "disk full" if error.errno != errno.EFBIG else "file size limit reached"
        return WriteError(
            f"{reason} while writing {path}: free space (or raise the limit) and rerun the same command to "
            "resume; everything committed so far is kept"
        )
    return WriteError(f"cannot write {path}: {error.strerror or error}")

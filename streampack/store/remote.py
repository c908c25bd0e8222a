"""A cache under an fsspec URL (``s3://bucket/prefix``, ``gs://…``, ``memory://…``): the object-store side
of the :class:`~streampack.store.Store` seam, as far as building needs it.

An object store has no append, rename, fsync, flock or mmap, so a build stages its shards locally and
publishes each object whole (:mod:`streampack.builder.publish`): one PUT is atomic on S3, GCS and Azure;
other filesystems get a temporary key then a move. Every call is retried when it fails for a reason that
may pass (a reset connection, a timeout, a 5xx), never for a missing object or a refusal; the final
error names the URL and says what to do.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar
from urllib.parse import urlparse

import numpy as np

from streampack.errors import CacheError, MissingDependencyError, WriteError
from streampack.store import MAX_JSON_BYTES, parse_json

T = TypeVar("T")

# Filesystems whose PUT of a whole object is atomic (the object appears complete or not at all).
_ATOMIC_PUT = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory"})
# Errors that retrying cannot fix: the object is missing, access is refused, the call itself is wrong.
_PERMANENT: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    ValueError,
    TypeError,
)
_TRANSIENT_MODULES = ("botocore", "aiobotocore", "aiohttp", "requests", "urllib3", "google", "azure")


class RemoteStore:
    """A cache under an fsspec URL, addressed by key like a :class:`~streampack.store.LocalStore`.

    Args:
        url: the cache's URL (``s3://bucket/prefix``).
        storage_options: passed to the fsspec filesystem (``{"client_kwargs": {"endpoint_url": ...}}``);
            credentials usually come from the environment as for any client of the store.
        attempts: tries of each call before giving up on a transient error.
        backoff: seconds before the first retry, doubled after each.

    Raises:
        MissingDependencyError: the filesystem's package (``s3fs``, ``gcsfs``...) is not installed.
        CacheError: the URL names no filesystem fsspec knows.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        attempts: int = 4,
        backoff: float = 0.5,
    ) -> None:
        self.url = url.rstrip("/")
        self.scheme = urlparse(self.url).scheme
        self.attempts = attempts
        self.backoff = backoff
        self._options = dict(storage_options or {})
        self._fs, self.root = self._connect()

    def _connect(self) -> tuple[Any, str]:
        import fsspec

        self._pid = os.getpid()
        try:
            fs, root = fsspec.core.url_to_fs(self.url, **self._options)
        except ImportError as e:
            raise MissingDependencyError(
                f"{self.url}: {self.scheme}:// needs its fsspec filesystem ({e}); for S3: pip install s3fs"
            ) from None
        except ValueError as e:
            raise CacheError(f"{self.url}: not a storage URL fsspec can open ({e})") from None
        return fs, root.rstrip("/")

    @property
    def fs(self) -> Any:
        """The fsspec filesystem; a new one in a forked child (s3fs's clients do not survive a fork)."""
        if self._pid != os.getpid():
            self._fs, _ = self._connect()
        return self._fs

    def __repr__(self) -> str:
        return f"RemoteStore({self.url!r})"

    @property
    def uri(self) -> str:
        """The cache's URL."""
        return self.url

    def describe(self, key: str) -> str:
        """The URL of ``key``."""
        return f"{self.url}/{key}" if key else self.url

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def exists(self, key: str) -> bool:
        """Whether the object ``key`` exists (asked of the store, not of a cached listing)."""
        self.fs.invalidate_cache(self._path(key))
        return bool(self._call("check", key, self.fs.exists, self._path(key)))

    def size(self, key: str) -> int:
        """Size of the object ``key``. Raises FileNotFoundError when it does not exist."""
        return int(self._call("stat", key, self.fs.size, self._path(key)))

    def info(self, key: str) -> dict[str, Any]:
        """fsspec's description of ``key`` (``size``, ``type``, ``ETag``); FileNotFoundError if none."""
        self.fs.invalidate_cache(self._path(key))
        return dict(self._call("stat", key, self.fs.info, self._path(key)))

    def entries(self, prefix: str) -> dict[str, dict[str, Any]]:
        """fsspec's description of each object and folder directly under ``prefix``, by name (one LIST)."""
        return {_name(e): dict(e) for e in self._ls(prefix)}

    def read(self, key: str, start: int = 0, stop: int | None = None) -> bytes:
        """Bytes ``[start, stop)`` of ``key`` (one ranged GET)."""
        return bytes(self._call("read", key, self.fs.cat_file, self._path(key), start=start, end=stop))

    def read_json(self, key: str, *, what: str) -> Any:
        """A small JSON object, refused with a :class:`CacheError` when absent, oversized or malformed."""
        try:
            data = self.read(key, 0, MAX_JSON_BYTES + 1)
        except FileNotFoundError:
            raise CacheError(f"{self.describe(key)}: {what} not found") from None
        return parse_json(data, self.describe(key), what)

    def map_array(self, key: str, dtype: np.dtype, count: int) -> np.ndarray:
        """Refused (:class:`CacheError`): a remote cache is read from a local copy."""
        raise CacheError(
            f"{self.describe(key)}: reading a cache in object storage is not supported yet; copy it to a "
            "local or shared filesystem and open that path"
        )

    def put_atomic(self, key: str, data: bytes) -> None:
        """Publish ``data`` as ``key``: one PUT where that is atomic, else a temporary key then a move."""
        self._publish(key, lambda path: self.fs.pipe_file(path, data))

    def put_file(self, key: str, local_path: str) -> None:
        """Publish the local file ``local_path`` as ``key``, as :meth:`put_atomic` does (a multipart upload
        of a large file becomes visible only when complete)."""
        self._publish(key, lambda path: self.fs.put_file(local_path, path))

    def list(self, prefix: str) -> builtins.list[str]:
        """The names of the objects and folders directly under ``prefix`` (none if there are none), sorted."""
        return sorted(_name(e) for e in self._ls(prefix))

    def list_sizes(self, prefix: str) -> dict[str, int]:
        """The size of every object directly under ``prefix``, by name (one LIST)."""
        return {_name(e): int(e.get("size") or 0) for e in self._ls(prefix) if e.get("type") != "directory"}

    def delete(self, key: str) -> None:
        """Delete the object ``key``, or every object under the folder ``key``, if any."""
        with contextlib.suppress(FileNotFoundError):
            self._call("delete", key, self.fs.rm, self._path(key), recursive=True)
        self.fs.invalidate_cache(self._path(key))

    def lock(self, key: str) -> contextlib.nullcontext[None]:
        """No lock: object stores cannot lock (a remote build holds its staging directory's lock instead,
        which keeps apart the builds of one machine, not of several)."""
        return contextlib.nullcontext()

    def _ls(self, prefix: str) -> builtins.list[dict[str, Any]]:
        path = self._path(prefix)
        self.fs.invalidate_cache(path)
        try:
            return list(self._call("list", prefix, self.fs.ls, path, detail=True))
        except FileNotFoundError:
            return []

    def _publish(self, key: str, put: Callable[[str], object]) -> None:
        path = self._path(key)
        if self.scheme in _ATOMIC_PUT:
            self._call("upload", key, put, path)
            return
        tmp = f"{path}.tmp"
        self._call("upload", key, put, tmp)
        self._call("publish", key, self.fs.mv, tmp, path)

    def _call(self, what: str, key: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, retried on transient errors with exponential backoff. What keeps failing
        is a WriteError (an upload, publish or delete) or a CacheError; FileNotFoundError passes through."""
        delay = self.backoff
        for attempt in range(1, self.attempts + 1):
            try:
                return fn(*args, **kwargs)
            except FileNotFoundError:
                raise
            except Exception as e:
                if _transient(e) and attempt < self.attempts:
                    time.sleep(delay)
                    delay *= 2
                    continue
                kind = WriteError if what in ("upload", "publish", "delete") else CacheError
                tries = f" after {attempt} attempts" if attempt > 1 else ""
                raise kind(
                    f"{self.describe(key)}: cannot {what}{tries} ({type(e).__name__}: {e}); check the URL, "
                    "the storage options and credentials and the network, then rerun the same command (a "
                    "build resumes from what is already up)"
                ) from None
        raise AssertionError("unreachable")  # pragma: no cover


def _name(entry: dict[str, Any]) -> str:
    return str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]


def _transient(error: Exception) -> bool:
    """Whether ``error`` may pass on retry: an OSError that is not a refusal, a timeout or connection
    error, or any error of the storage clients' network stacks."""
    if isinstance(error, _PERMANENT):
        return False
    # fsspec's clients map a request the store refuses as malformed (a range past the end of a cut object,
    # an invalid name) to EINVAL: asking again gives the same answer.
    if isinstance(error, OSError) and error.errno == errno.EINVAL:
        return False
    if isinstance(error, (OSError, TimeoutError, ConnectionError)):
        return True
    return type(error).__module__.split(".")[0] in _TRANSIENT_MODULES

"""A foreign cache's files: where they are read from (:data:`LOCAL`, or :class:`CopiedFiles` for objects
under a URL), and the ``check_*`` refusals of what a reader must not trust, naming the file and field."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from streampack.errors import CacheError, OptionsError
from streampack.store import Expected
from streampack.store.localcopy import CachedStore


def map_tokens(path: Path, dtype: np.dtype, offset: int, count: int) -> np.ndarray:
    """``count`` tokens of ``dtype`` at byte ``offset`` of ``path``, memory-mapped read-only."""
    if count == 0:
        return np.zeros(0, dtype=dtype)
    # A plain ndarray view (which keeps the map alive): slicing an np.memmap costs a subclass round trip per
    # slice, a third of a Loader's time over windows of many shards.
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,)).view(np.ndarray)


class LocalFiles:
    """Files of the local file system, read where they lie (``local``: the paths are the files)."""

    local = True

    def is_file(self, path: Path) -> bool:
        """Whether ``path`` is a file."""
        return path.is_file()

    def is_dir(self, path: Path) -> bool:
        """Whether ``path`` is a folder."""
        return path.is_dir()

    def listdir(self, folder: Path) -> list[Path]:
        """The entries directly in ``folder``."""
        return list(folder.iterdir())

    def size(self, path: Path) -> int:
        """The size of the file ``path`` (FileNotFoundError when there is none, as for :meth:`read`)."""
        return path.stat().st_size

    def read(self, path: Path, start: int = 0, stop: int | None = None) -> bytes:
        """Bytes ``[start, stop)`` of ``path``."""
        with open(path, "rb") as f:
            f.seek(start)
            return f.read() if stop is None else f.read(max(0, stop - start))

    def map(self, path: Path, dtype: np.dtype, offset: int, count: int) -> np.ndarray:
        """``count`` items of ``dtype`` at byte ``offset`` of ``path``, memory-mapped read-only."""
        return map_tokens(path, dtype, offset, count)

    def mtime_ns(self, path: Path) -> int:
        """When ``path`` was last modified."""
        return path.stat().st_mtime_ns

    def name(self, path: Path) -> str:
        """``path`` as messages name it."""
        return str(path)

    def key(self, path: Path) -> str:
        """The store key of ``path``: its path."""
        return str(path)

    def local_path(self, path: Path) -> Path:
        """The local file ``path`` is read from: itself."""
        return path

    def shown(self, message: str) -> str:
        """``message`` with the paths it names as :meth:`name` names them: as it is."""
        return message


#: The local file system.
LOCAL = LocalFiles()


class CopiedFiles:
    """Objects under the URL of ``store``'s remote (the folder of the files), read through its bounded
    local copy; each method does :class:`LocalFiles`'s, for objects.

    An object is fetched whole when first mapped, under its version (its ETag where the store gives one),
    so that an object replaced under the same URL is fetched again.
    """

    local = False

    def __init__(self, store: CachedStore) -> None:
        self.store = store
        self.root = store.root
        self._info: dict[str, dict[str, Any] | None] = {}
        self._expected: dict[str, Expected] = {}

    def __repr__(self) -> str:
        return f"CopiedFiles({self.store.remote.url!r})"

    def is_file(self, path: Path) -> bool:
        """Whether the object exists (and is not a folder)."""
        info = self._stat(path)
        return info is not None and info.get("type") != "directory"

    def is_dir(self, path: Path) -> bool:
        """Whether ``path`` is a folder of objects."""
        info = self._stat(path)
        return info is not None and info.get("type") == "directory"

    def listdir(self, folder: Path) -> list[Path]:
        """The objects and folders directly under ``folder`` (one listing; their sizes kept)."""
        key = self.key(folder)
        found = []
        for name, info in self.store.remote.entries(key).items():
            if info.get("size") is not None or info.get("type") == "directory":  # else asked when needed
                self._info[f"{key}/{name}" if key else name] = info
            found.append(folder / name)
        return found

    def size(self, path: Path) -> int:
        """The object's size, as the store lists it."""
        return int(self._existing(path)["size"])

    def read(self, path: Path, start: int = 0, stop: int | None = None) -> bytes:
        """Bytes of the object, read from the store (no copy kept: headers and small files)."""
        data = self.store.remote.read(self.key(path), start, stop)
        if stop is not None and len(data) > stop - start:  # a server that ignores ranges sends it whole
            data = data[start:stop]
        return data

    def map(self, path: Path, dtype: np.dtype, offset: int, count: int) -> np.ndarray:
        """The items, mapped from the object's verified local copy (fetched whole first if not there)."""
        dtype = np.dtype(dtype)
        if count == 0:
            return np.zeros(0, dtype=dtype)
        key = self._expect(path)
        whole = self.store.map_array(key, np.dtype(np.uint8), self._expected[key].size)
        return whole[offset : offset + count * dtype.itemsize].view(dtype)

    def mtime_ns(self, path: Path) -> int:
        """When the object was last modified, where the store says (else 0)."""
        when: Any = self._existing(path).get("LastModified")
        return int(when.timestamp() * 1e9) if hasattr(when, "timestamp") else 0

    def name(self, path: Path) -> str:
        """The object's URL."""
        return self.store.remote.describe(self.key(path))

    def key(self, path: Path) -> str:
        """The object's key (its path under :attr:`root`)."""
        relative = path.relative_to(self.root).as_posix()
        return "" if relative == "." else relative

    def local_path(self, path: Path) -> Path:
        """The object's verified copy in the local directory (there once it was mapped)."""
        return self.store.path(self._expect(path))

    def shown(self, message: str) -> str:
        """``message`` with the local copy's directory replaced by the remote URL."""
        return message.replace(str(self.root), self.store.remote.url)

    def expected(self) -> dict[str, Expected]:
        """What each object mapped so far must be (its size, and its version where the store gives one)."""
        return dict(self._expected)

    def _stat(self, path: Path) -> dict[str, Any] | None:
        key = self.key(path)
        if key not in self._info:
            try:
                self._info[key] = self.store.remote.info(key)
            except FileNotFoundError:
                self._info[key] = None
        return self._info[key]

    def _existing(self, path: Path) -> dict[str, Any]:
        info = self._stat(path)
        if info is None:
            raise FileNotFoundError(self.name(path))
        return info

    def _expect(self, path: Path) -> str:
        """Record what the copy of ``path`` must be with the store (which refuses a bound too small)."""
        key = self.key(path)
        if key not in self._expected:
            info = self._existing(path)
            # The object's version: a short tag of its ETag (else its modification time), or "" if none.
            given = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime")
            version = hashlib.sha256(str(given).encode()).hexdigest()[:12] if given else ""
            self._expected[key] = Expected(int(info["size"]), "", version)
            self.store.expect(self._expected)
        return key


#: Where a foreign cache's files are read from.
ForeignFiles = LocalFiles | CopiedFiles


def check_size(path: Path, expected: int, what: str, files: ForeignFiles = LOCAL) -> None:
    """Refuse a file that is missing or not ``expected`` bytes long, naming what it should hold."""
    try:
        size = files.size(path)
    except FileNotFoundError:
        raise CacheError(f"{path}: missing; it should hold {what}") from None
    if size != expected:
        raise CacheError(
            f"{path}: {size:,} bytes, but {what} take {expected:,}: the file is truncated or does not "
            "belong to this index"
        )


def check_ends(path: Path, ends: np.ndarray, num_tokens: int) -> np.ndarray:
    """Refuse document ends that go back or past ``num_tokens`` (naming the first bad entry)."""
    if len(ends):
        back = np.flatnonzero(np.diff(ends.astype(np.int64), prepend=0) < 0)
        if len(back):
            i = int(back[0])
            before = int(ends[i - 1]) if i else 0
            raise CacheError(
                f"{path}: document end {i} is {int(ends[i]):,}, before the previous one ({before:,}): the "
                "index must not decrease"
            )
        if int(ends[-1]) > num_tokens:
            raise CacheError(
                f"{path}: the last document ends at token {int(ends[-1]):,}, past the {num_tokens:,} tokens "
                "of its token file"
            )
    return ends


def check_id_fits(path: Path, name: str, token_id: int | None, dtype: np.dtype) -> None:
    """Refuse a declared id that tokens of ``dtype`` cannot hold (it would never be found); None passes."""
    if token_id is not None and token_id >= 1 << (8 * dtype.itemsize):
        raise OptionsError(
            f"{path}: {name}={token_id:,} does not fit its {dtype.name} tokens (at most "
            f"{(1 << (8 * dtype.itemsize)) - 1:,}): the id is wrong, or the files are uint32 (pass dtype=)"
        )

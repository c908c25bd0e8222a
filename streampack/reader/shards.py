"""The shards a :class:`~streampack.reader.Cache` reads: each one's tokens, document ends and loss mask.

:class:`Shards` is the protocol a cache reads through; :class:`ShardFiles` serves it from a native
cache's files, :class:`~streampack.reader.foreign.opening.ForeignShards` from another format's.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

from streampack.errors import CacheError
from streampack.format.manifest import Manifest, ShardTable
from streampack.format.names import (
    OFFSET_DTYPE,
    SHARD_DIR,
    checksum_text,
    crc32,
    mask_key,
    offsets_key,
    shard_name,
    tokens_key,
)
from streampack.store import LocalStore

__all__ = ["MAX_OPEN_MAPS", "ShardFiles", "Shards", "keep"]

# Offsets files this process checked against their checksums, by (path, device, inode, size, mtime, CRC).
_checked_offsets: set[tuple[object, ...]] = set()
_checked_lock = threading.Lock()

# Shard files kept mapped per kind (tokens, offsets, masks): every map holds a file descriptor, and the
# common limit is 1024 per process (three kinds x 128 = 384 of them); remapping a shard costs ~20 us.
MAX_OPEN_MAPS = 128


def keep(
    kept: OrderedDict[int, np.ndarray], index: int, array: np.ndarray, max_bytes: int | None = None
) -> np.ndarray:
    """Keep ``array`` as shard ``index``'s, dropping the least recently used beyond :data:`MAX_OPEN_MAPS`
    (and beyond ``max_bytes`` in all, but the last); return it. Safe from several threads."""
    kept[index] = array
    while len(kept) > MAX_OPEN_MAPS or (
        max_bytes is not None and len(kept) > 1 and sum(a.nbytes for a in list(kept.values())) > max_bytes
    ):
        try:
            kept.popitem(last=False)  # a map is closed once no caller holds a view of it
        except KeyError:  # emptied by another thread
            break
    return array


class Shards(Protocol):
    """The arrays of each shard of a cache, by shard index (negative from the end, as a list's; out of
    range: ``IndexError``).

    Every array is read-only and stays valid while a caller holds it, even once the source stops keeping
    it. Safe to call from several threads.
    """

    def tokens(self, shard: int) -> np.ndarray:
        """The tokens of shard ``shard``, in the manifest's dtype: its documents, end to end."""
        ...

    def offsets(self, shard: int) -> np.ndarray:
        """The end of each document of shard ``shard`` (uint64, cumulative), checked."""
        ...

    def raw_offsets(self, shard: int) -> np.ndarray:
        """:meth:`offsets` unchecked and not kept, for ``verify``, which checks the table itself."""
        ...

    def mask(self, shard: int) -> np.ndarray:
        """The loss mask of shard ``shard`` (uint8, one a token, 1 at a training target).

        Raises:
            CacheError: the cache has no loss mask.
        """
        ...

    def token_file(self, shard: int) -> tuple[Path, int] | None:
        """(path, byte offset) where shard ``shard``'s tokens lie end to end in a local file, or None."""
        ...

    def describe(self, shard: int, kind: str) -> str:
        """The file of shard ``shard``'s ``kind`` (tokens, offsets or mask), as messages name it."""
        ...

    def paths(self, shard: int) -> tuple[Path, ...]:
        """The local files of shard ``shard``'s tokens, then of its document ends, each once."""
        ...

    def keys(self, shard: int, *, boundaries: bool = True) -> list[str]:
        """The store keys of shard ``shard``'s tokens, then (with ``boundaries``) of its document ends and
        loss mask: what a prefetcher fetches."""
        ...

    def mask_path(self, shard: int) -> Path | None:
        """The file of shard ``shard``'s loss mask, or None without one."""
        ...

    def hashes(self, shard: int) -> dict[str, str]:
        """The digests another format records of shard ``shard``'s token file, by algorithm; maybe empty."""
        ...

    def origin(self, shard: int) -> tuple[str, int] | None:
        """Another format's file that holds shard ``shard``'s documents and the index there of its first;
        None for a native cache."""
        ...

    def identity(self) -> str:
        """What identifies another format's files, which record no checksum; "" for a native cache."""
        ...

    def drop(self) -> None:
        """Forget the arrays kept for reuse (those a caller still holds stay valid)."""
        ...

    def close(self) -> None:
        """Let go of what reading holds; reads refuse afterwards. Idempotent."""
        ...


class ShardFiles:
    """The shard files of a native cache, memory-mapped on first use and checked against its manifest.

    Args:
        store: where the cache's files are.
        manifest: the cache's manifest (its dtype, whether it is complete and has a loss mask).
        table: the shard table read (the manifest's, or the committed prefix of an unfinished build's).
    """

    _closed = False

    def __init__(self, store: LocalStore, manifest: Manifest, table: ShardTable) -> None:
        self.store, self.manifest, self.table = store, manifest, table
        # A file in the checked shards folder can only lead out as a symlink, which _check_size refuses.
        store.refuse_outside(SHARD_DIR)
        self.dtype = np.dtype(manifest.dtype).newbyteorder("<")
        self._tokens: OrderedDict[int, np.ndarray] = OrderedDict()
        self._offsets: OrderedDict[int, np.ndarray] = OrderedDict()
        self._masks: OrderedDict[int, np.ndarray] = OrderedDict()
        if store.fetches_copies:
            store.on_pressure(self.drop)

    def __repr__(self) -> str:
        return f"ShardFiles({self.store.describe('')!r}, shards={len(self.table)})"

    def drop(self) -> None:
        """Forget the shard maps kept for reuse (a bounded local copy cannot evict a mapped file)."""
        # Cleared in place: a lookup under way holds the dict itself, and _map is safe against that.
        for maps in (self._tokens, self._offsets, self._masks):
            maps.clear()

    def close(self) -> None:
        """Drop the kept maps and leave a local copy's releases; maps are refused afterwards. Idempotent."""
        self._closed = True
        self.store.forget_pressure(self.drop)
        self.drop()

    def tokens(self, shard: int) -> np.ndarray:
        """The token array of shard ``shard``, memory-mapped on first use.

        Raises:
            CacheError: the file is missing, of another size than the manifest says, or leads out of the
                cache (checked before anything is read from it).
        """
        return self._map(self._tokens, shard, tokens_key, self.dtype, self.table.num_tokens)

    def offsets(self, shard: int) -> np.ndarray:
        """The cumulative document ends of shard ``shard`` (memory-mapped on first use).

        Every reader finds documents through these tables, so each is checked against its checksum when
        this process first maps it (8 bytes a document: about 1 % of the shard). Tokens and masks are only
        size-checked; ``streampack verify`` checks their checksums.

        Raises:
            CacheError: as for :meth:`tokens`, or the table does not match its checksum.
        """
        return self._map(self._offsets, shard, offsets_key, OFFSET_DTYPE, self.table.num_docs)

    def raw_offsets(self, shard: int) -> np.ndarray:
        """:meth:`offsets` size-checked only and not kept, for ``verify``, which checks the table itself."""
        index = self._index(shard)
        key, count = offsets_key(shard_name(index)), int(self.table.num_docs[index])
        self._check_size(key, count, OFFSET_DTYPE.itemsize)
        return self.store.map_array(key, OFFSET_DTYPE, count)

    def mask(self, shard: int) -> np.ndarray:
        """The loss mask of shard ``shard``, mapped on first use (see :meth:`Shards.mask`).

        Raises:
            CacheError: the cache has no loss mask (it was not built with ``fields`` or ``chat``).
        """
        if not self.manifest.loss_mask:
            raise CacheError(
                f"{self.store.root}: the cache has no loss mask (it was built from texts, not with "
                "fields=[...] or chat=...); every token is a training target"
            )
        return self._map(self._masks, shard, mask_key, np.dtype(np.uint8), self.table.num_tokens)

    def token_file(self, shard: int) -> tuple[Path, int]:
        """The shard's ``.tokens`` file (a remote cache's local copy once :meth:`tokens` fetched it)."""
        return self.store.path(tokens_key(shard_name(self._index(shard)))), 0

    def paths(self, shard: int) -> tuple[Path, ...]:
        """The shard's ``.tokens`` and ``.offsets`` files."""
        name = shard_name(self._index(shard))
        return self.store.path(tokens_key(name)), self.store.path(offsets_key(name))

    def keys(self, shard: int, *, boundaries: bool = True) -> list[str]:
        """The keys of its ``.tokens``, then (with ``boundaries``) its ``.offsets`` and ``.mask`` files."""
        name = shard_name(self._index(shard))
        if not boundaries:
            return [tokens_key(name)]
        return [tokens_key(name), offsets_key(name)] + ([mask_key(name)] if self.manifest.loss_mask else [])

    def mask_path(self, shard: int) -> Path | None:
        """The shard's ``.mask`` file, or None when the cache has no loss mask."""
        masked = self.manifest.loss_mask
        return self.store.path(mask_key(shard_name(self._index(shard)))) if masked else None

    def hashes(self, shard: int) -> dict[str, str]:
        """None: a native cache's checksums are its manifest's."""
        return {}

    def origin(self, shard: int) -> None:
        """None: a native cache's documents come from its inputs (see :func:`streampack.which`)."""
        return None

    def identity(self) -> str:
        """Nothing: the manifest's shard table holds each file's CRC-32."""
        return ""

    def describe(self, shard: int, kind: str) -> str:
        """The path of shard ``shard``'s ``.tokens``, ``.offsets`` or ``.mask`` file."""
        key_of = {"tokens": tokens_key, "offsets": offsets_key, "mask": mask_key}[kind]
        return str(self.store.path(key_of(shard_name(self._index(shard)))))

    def _index(self, shard: int) -> int:
        """``shard`` as a non-negative index (IndexError when out of range)."""
        return range(len(self.table))[shard]

    def _check_offsets(self, key: str, index: int, mapped: np.ndarray) -> None:
        """Refuse an offsets table that does not match its checksum; once per process per file version."""
        if self.table.offsets_crc32 is None or self.store.fetches_copies:
            return  # none recorded (an unfinished build); a local copy is verified when it is fetched
        expected = checksum_text(int(self.table.offsets_crc32[index]))
        path = self.store.path(key)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return  # removed since it was mapped: the map holds what was checked at its size
        identity = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, expected)
        with _checked_lock:
            known = identity in _checked_offsets
        if not known:
            actual = checksum_text(crc32(mapped))
            if actual != expected:
                raise CacheError(
                    f"{path}: checksum {actual} does not match the manifest's {expected}: the table of where "
                    "each document ends is damaged; run `streampack verify` on the cache and rebuild it"
                )
            with _checked_lock:
                _checked_offsets.add(identity)

    def _map(
        self,
        maps: OrderedDict[int, np.ndarray],
        shard: int,
        key_of: Callable[[str], str],
        dtype: np.dtype,
        counts: np.ndarray,
    ) -> np.ndarray:
        """The map of one of shard ``shard``'s files, kept or checked and mapped.

        Thread-safe (grain reads from a pool): each OrderedDict call is atomic, and an evicted map stays
        valid for its holder."""
        mapped = maps.get(shard)
        if mapped is not None:
            with contextlib.suppress(KeyError):  # evicted by another thread since the get
                maps.move_to_end(shard)
            return mapped
        if self._closed:
            raise CacheError(f"{self.store.describe('')}: the cache was closed; open it again to read it")
        index = self._index(shard)
        key, count = key_of(shard_name(index)), int(counts[index])
        self._check_size(key, count, dtype.itemsize)
        mapped = self.store.map_array(key, dtype, count)
        if maps is self._offsets:
            self._check_offsets(key, index, mapped)
        return keep(maps, index, mapped)

    def _check_size(self, key: str, count: int, itemsize: int) -> None:
        """Refuse a shard file that is missing, of another size than the manifest says (only shorter, while
        the build runs), or a symlink out of the cache."""
        if count == 0 and not self.manifest.complete:
            return  # a unit of an unfinished build that has not committed yet may have no files at all
        if self.store.fetches_copies:
            return  # its local copies are checked against the size and checksum when they are fetched
        self.store.refuse_outside(key, links_only=True)
        try:
            size = self.store.size(key)
        except FileNotFoundError:
            path = self.store.path(key)
            raise CacheError(f"{path}: shard file missing; the cache is damaged, rebuild it") from None
        expected = count * itemsize
        if size < expected or (self.manifest.complete and size != expected):
            raise CacheError(
                f"{self.store.path(key)}: {size} bytes, but the manifest says {count} items ({expected} "
                "bytes); the cache is damaged or truncated: run `streampack verify` and rebuild it"
            )

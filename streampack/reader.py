"""Reading a token cache: memory-mapped shards, documents, the global token stream, and an SFT build's
loss mask.

:func:`open` reads the manifest, checks every shard's file sizes against it (one ``stat`` per file, no
data read), and maps each shard only when it is first touched. Nothing is read into RAM beyond the
manifest and the offset tables of the shards in use; memory-mapped pages belong to the page cache.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from streampack import ledger
from streampack.errors import CacheError, OptionsError
from streampack.format import (
    OFFSET_DTYPE,
    SHARD_DIR,
    Manifest,
    ShardInfo,
    load_manifest,
    mask_key,
    offsets_key,
    tokens_key,
)
from streampack.localcopy import CachedStore, Expected, cached_store, on_release
from streampack.remote import is_remote
from streampack.store import LocalStore, open_store

if TYPE_CHECKING:
    from streampack.holdout import DocumentSet
    from streampack.packing import TooLong
    from streampack.sequences import PackedSequences


# Shard files kept mapped per kind (tokens, offsets, masks): every map holds a file descriptor, and the
# common limit is 1024 per process (three kinds x 128 = 384 of them); remapping a shard costs ~20 us.
MAX_OPEN_MAPS = 128


@dataclass(frozen=True)
class _ShardFiles:
    info: ShardInfo
    tokens: str  # store keys
    offsets: str
    mask: str | None  # an SFT build's loss mask


class Cache:
    """A token cache opened for reading. Create with :func:`streampack.open`.

    Attributes:
        root: the cache directory.
        store: where its files are (see :mod:`streampack.store`).
        manifest: its parsed manifest.
        dtype: the token dtype (uint16 or uint32).
    """

    def __init__(self, store: LocalStore, manifest: Manifest, shards: list[ShardInfo]) -> None:
        self.store = store
        self.root = store.root
        self.manifest = manifest
        self.dtype = np.dtype(manifest.dtype).newbyteorder("<")
        # The shards folder is checked here; a file in it can only lead out as a symlink, which the listing
        # of sizes (_check_sizes) refuses.
        store.refuse_outside(SHARD_DIR)
        masked = manifest.loss_mask
        self._shards = [_ShardFiles(s, *_keys(s.name, masked)) for s in shards]
        self._doc_starts = np.concatenate([[0], np.cumsum([s.num_docs for s in shards], dtype=np.int64)])
        self._token_starts = np.concatenate([[0], np.cumsum([s.num_tokens for s in shards], dtype=np.int64)])
        self._tokens: OrderedDict[int, np.ndarray] = OrderedDict()
        self._offsets: OrderedDict[int, np.ndarray] = OrderedDict()
        self._masks: OrderedDict[int, np.ndarray] = OrderedDict()
        self._check_sizes()
        if isinstance(store, CachedStore):
            on_release(self.drop_maps)

    def __repr__(self) -> str:
        name = self.store.describe("")
        return f"Cache({name!r}, docs={self.num_docs}, tokens={self.num_tokens}, dtype={self.dtype.name})"

    def drop_maps(self) -> None:
        """Forget the shard maps kept for reuse (they close once no caller holds a view of them): a cache
        read through a bounded local copy cannot evict a mapped file."""
        # Cleared in place: a lookup under way holds the dict itself (and _cached_map is safe against a
        # concurrent clear).
        for maps in (self._tokens, self._offsets, self._masks):
            maps.clear()

    @property
    def num_docs(self) -> int:
        """Number of documents."""
        return int(self._doc_starts[-1])

    @property
    def num_tokens(self) -> int:
        """Number of tokens (documents' tokens and their EOS ids)."""
        return int(self._token_starts[-1])

    @property
    def num_shards(self) -> int:
        """Number of shards."""
        return len(self._shards)

    @property
    def vocab_size(self) -> int:
        """Every token id is below this."""
        return self.manifest.vocab_size

    @property
    def eos_id(self) -> int | None:
        """The EOS id appended after every document, or None."""
        return self.manifest.eos["id"] if self.manifest.eos["append"] else None

    @property
    def bos_id(self) -> int | None:
        """The BOS id put before every document, or None (also for caches written before BOS existed)."""
        return self.manifest.bos["id"] if self.manifest.bos["prepend"] else None

    @functools.cached_property
    def content_digest(self) -> str:
        """A short digest of the shard table: what samples are made of, wherever the cache lives.

        Computed once per open cache (its shard table never changes): every view of the cache and every
        plan key asks for it, and 10^5 shards take a noticeable time to digest.
        """
        table = [
            [s.name, s.num_docs, s.num_tokens, s.tokens_checksum, s.offsets_checksum] for s in self.shards
        ]
        return hashlib.sha256(json.dumps(table).encode()).hexdigest()[:16]

    @property
    def shards(self) -> list[ShardInfo]:
        """The shard table, in stream order."""
        return [s.info for s in self._shards]

    def sequences(self, seq_len: int, *, overlap: int = 0) -> PackedSequences:
        """Packed windows of the stream: sample i is tokens ``[i*seq_len, i*seq_len + seq_len + overlap)``.

        See :class:`streampack.sequences.PackedSequences`.
        """
        from streampack.sequences import PackedSequences

        return PackedSequences(self, seq_len, overlap=overlap)

    def packed(
        self, seq_len: int, *, too_long: TooLong = "split", pad_id: int | None = None
    ) -> PackedSequences:
        """Whole documents packed into samples of ``seq_len`` tokens by best-fit decreasing, then padding.

        Every document is in exactly one sample, unless it is longer than ``seq_len``: ``too_long="split"``
        cuts it into pieces of ``seq_len`` tokens and a remainder, each packed on its own; ``"truncate"``
        keeps its first ``seq_len`` tokens; ``"drop"`` leaves it out (``samples.layout.dropped`` counts
        them). The plan is computed from the offset tables in chunks of
        :data:`~streampack.packing.CHUNK_DOCS` documents and stored in ``CACHE/layouts/`` (see
        :mod:`streampack.packing`). ``samples.layout.padding`` is the fraction of padding.

        Args:
            seq_len: tokens per sample.
            too_long: what to do with a document longer than ``seq_len``.
            pad_id: the id that fills padding (masked out of the loss in ``output="dict"``); the cache's
                EOS id by default, else 0.
        """
        return self.all_documents().packed(seq_len, too_long=too_long, pad_id=pad_id)

    def documents(
        self, seq_len: int, *, too_long: TooLong = "truncate", pad_id: int | None = None
    ) -> PackedSequences:
        """One document per sample, padded to ``seq_len`` tokens: for fine-tuning (SFT) on a masked cache.

        Args:
            seq_len: tokens per sample.
            too_long: a document longer than ``seq_len`` is cut to its first ``seq_len`` tokens
                (``"truncate"``, the default), left out (``"drop"``), or served as several samples of
                consecutive pieces (``"split"``).
            pad_id: as for :meth:`packed`.
        """
        return self.all_documents().documents(seq_len, too_long=too_long, pad_id=pad_id)

    def split(self, holdout: float, *, seed: int = 0) -> tuple[DocumentSet, DocumentSet]:
        """The training and validation documents, holding out ``holdout`` of them by a hash of their index.

        ``train, validation = cache.split(0.01)``; then ``train.sequences(2048)`` and
        ``validation.sequences(2048)`` (or ``.packed``, ``.documents``) never share a document. See
        :func:`streampack.holdout.split`.
        """
        from streampack.holdout import split

        return split(self, holdout, seed=seed)

    def all_documents(self) -> DocumentSet:
        """Every document of the cache, as a :class:`~streampack.holdout.DocumentSet`."""
        from streampack.holdout import Chosen, DocumentSet

        return DocumentSet(self, Chosen(self))

    def doc(self, index: int) -> np.ndarray:
        """Tokens of document ``index`` (including its BOS and EOS), a read-only view of the memory map."""
        shard, start, end = self._doc_span(index)
        return self.shard_tokens(shard)[start:end]

    @property
    def has_loss_mask(self) -> bool:
        """Whether the cache has a loss mask (an SFT build: ``fields`` or ``chat``)."""
        return self.manifest.loss_mask

    def doc_loss_mask(self, index: int) -> np.ndarray:
        """The loss mask of document ``index``, aligned with :meth:`doc` (1: a training target).

        Raises:
            CacheError: the cache has no loss mask.
        """
        shard, start, end = self._doc_span(index)
        return self.shard_loss_mask(shard)[start:end]

    def _doc_span(self, index: int) -> tuple[int, int, int]:
        """The shard of document ``index`` and where the document lies in it."""
        if not -self.num_docs <= index < self.num_docs:
            raise IndexError(f"document {index} out of range for a cache of {self.num_docs} documents")
        index %= self.num_docs
        shard = int(np.searchsorted(self._doc_starts, index, side="right") - 1)
        local = index - int(self._doc_starts[shard])
        offsets = self.shard_offsets(shard)
        start = int(offsets[local - 1]) if local else 0
        return shard, start, int(offsets[local])

    def doc_lengths(self) -> np.ndarray:
        """Length in tokens of every document (reads every offset table)."""
        if not self._shards:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.diff(self.shard_offsets(i), prepend=0) for i in range(self.num_shards)])

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the global stream (all documents, in order), as a new array."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) out of range [0, {self.num_tokens}]")
        out = np.empty(stop - start, dtype=self.dtype)
        first = int(np.searchsorted(self._token_starts, start, side="right") - 1)
        pos = start
        shard = first
        while pos < stop:
            base = int(self._token_starts[shard])
            end = min(stop, int(self._token_starts[shard + 1]))
            out[pos - start : end - start] = self.shard_tokens(shard)[pos - base : end - base]
            pos = end
            shard += 1
        return out

    @property
    def doc_starts(self) -> np.ndarray:
        """Global index of the first document of each shard, plus the total at the end."""
        return self._doc_starts

    def shard_paths(self, shard: int) -> tuple[Path, Path]:
        """The token and offsets files of shard ``shard``."""
        files = self._shards[shard]
        return self.store.path(files.tokens), self.store.path(files.offsets)

    def shard_keys(self, shard: int, *, boundaries: bool = True) -> list[str]:
        """The store keys of shard ``shard``'s files: tokens, then (with ``boundaries``) offsets and the
        loss mask if any."""
        files = self._shards[shard]
        if not boundaries:
            return [files.tokens]
        return [files.tokens, files.offsets] + ([files.mask] if files.mask is not None else [])

    def shard_tokens(self, shard: int) -> np.ndarray:
        """The token array of shard ``shard`` (memory-mapped on first use)."""
        files = self._shards[shard]
        return _cached_map(self._tokens, shard, self.store, files.tokens, self.dtype, files.info.num_tokens)

    def shard_offsets(self, shard: int) -> np.ndarray:
        """The cumulative document end offsets of shard ``shard`` (memory-mapped on first use)."""
        files = self._shards[shard]
        return _cached_map(self._offsets, shard, self.store, files.offsets, OFFSET_DTYPE, files.info.num_docs)

    def shard_loss_mask(self, shard: int) -> np.ndarray:
        """The loss mask of shard ``shard``: uint8, one per token of :meth:`shard_tokens`, 1 where the token
        is a training target (memory-mapped on first use).

        Raises:
            CacheError: the cache has no loss mask (it was not built with ``fields`` or ``chat``).
        """
        files = self._shards[shard]
        if files.mask is None:
            raise CacheError(
                f"{self.root}: the cache has no loss mask (it was built from texts, not with fields=[...] or "
                "chat=...); every token is a training target"
            )
        count = files.info.num_tokens
        return _cached_map(self._masks, shard, self.store, files.mask, np.dtype(np.uint8), count)

    def shard_mask_path(self, shard: int) -> Path | None:
        """The loss mask file of shard ``shard``, or None when the cache has no loss mask."""
        mask = self._shards[shard].mask
        return None if mask is None else self.store.path(mask)

    @property
    def token_starts(self) -> np.ndarray:
        """Global index of the first token of each shard, plus the total at the end."""
        return self._token_starts

    def _check_sizes(self) -> None:
        sizes = self.store.list_sizes(SHARD_DIR)  # one listing, rather than a stat per file
        for files in self._shards:
            checked = [
                (files.tokens, files.info.num_tokens, self.dtype.itemsize),
                (files.offsets, files.info.num_docs, OFFSET_DTYPE.itemsize),
            ]
            if files.mask is not None:
                checked.append((files.mask, files.info.num_tokens, 1))
            for key, count, itemsize in checked:
                size = sizes.get(key[len(SHARD_DIR) + 1 :])
                if size is None:
                    if count == 0 and not self.manifest.complete:
                        continue  # a unit of an unfinished build that has not started (or committed) yet
                    where = self.store.describe(key)
                    raise CacheError(f"{where}: shard file missing; the cache is damaged, rebuild it")
                expected = count * itemsize
                if size < expected or (self.manifest.complete and size != expected):
                    raise CacheError(
                        f"{self.store.describe(key)}: {size} bytes, but the manifest says {count} items "
                        f"({expected} bytes); the cache is damaged or truncated: run `streampack verify` and "
                        "rebuild it"
                    )


def open(
    path: str | os.PathLike[str],
    *,
    allow_incomplete: bool = False,
    local_dir: str | os.PathLike[str] | None = None,
    max_local_bytes: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    prefetch_steps: int | None = None,
) -> Cache:
    """Open a token cache for reading.

    A cache in object storage (``s3://bucket/prefix``, any fsspec URL) is read through a local copy:
    its manifest (and ledger) are read remotely, each shard file is fetched whole on first use, verified
    against its checksum, and memory-mapped from ``local_dir``, which the processes of a node share (one
    download per file) and which never holds more than ``max_local_bytes`` of shard files (least
    recently used ones are evicted; see :mod:`streampack.localcopy`).

    Args:
        path: the cache directory (a path, or a ``file://`` URI), or the URL of a cache in object storage.
        allow_incomplete: read the committed prefix of each unit of a build that has not finished (or is
            still running) instead of refusing it: every document that its unit's ledger entry had
            committed when this was called, in stream order (units not started yet hold none).
        local_dir: (object storage) the local copy's directory; one per URL under the temp dir by default.
        max_local_bytes: (object storage) the bound on the local copy's shard files; unbounded by default.
            It must hold the shards one batch of every process of the node reads at once.
        storage_options: (object storage) passed to the fsspec filesystem (endpoint, credentials...).
        prefetch_steps: (object storage) steps ahead whose shards a :class:`~streampack.Loader` fetches
            in the background (0: none); 8 by default.

    Raises:
        CacheError: the directory is not a cache, its build is incomplete (unless allowed), or its
            manifest and files disagree.
        OptionsError: an object-storage option for a local cache, or a bound smaller than a shard.
    """
    if is_remote(path):
        store: LocalStore = cached_store(
            str(path),
            local_dir=local_dir,
            max_local_bytes=max_local_bytes,
            prefetch_steps=prefetch_steps,
            storage_options=storage_options,
        )
    else:
        reading = {"local_dir": local_dir, "max_local_bytes": max_local_bytes}
        reading["prefetch_steps"] = prefetch_steps
        given = [name for name, value in reading.items() if value is not None]
        if given or storage_options:
            raise OptionsError(
                f"{path}: {', '.join(given or ['storage_options'])} apply to caches in object storage "
                "(s3://...), not to a local cache"
            )
        store = open_store(path)
    manifest = load_manifest(store)
    if manifest.complete:
        shards = manifest.shards
    elif not allow_incomplete:
        raise CacheError(
            f"{store.describe('')}: the build of this cache has not finished; rerun the same build command "
            "to complete it, or open it with allow_incomplete=True to read the committed part"
        )
    else:
        shards = _committed_shards(store, manifest)
    if isinstance(store, CachedStore):
        store.expect(_expected_files(shards, manifest))
    return Cache(store, manifest, shards)


def _committed_shards(store: LocalStore, manifest: Manifest) -> list[ShardInfo]:
    """Each unit's committed prefix from its ledger entry (none: the unit has not committed yet).

    A unit's writer makes its shard files durable before the ledger entry that covers them, so every
    committed byte is on disk; a unit with nothing committed may have no files at all. In object storage
    an entry is published once its unit is done, with the checksums of its files, which a read through a
    local copy verifies.
    """
    shards = []
    remote = isinstance(store, CachedStore)
    for index, unit in enumerate(manifest.units):
        name = f"{index:06d}"
        progress = ledger.read_progress(store, name, unit)
        mask = "" if manifest.loss_mask else None
        if remote and progress.done:
            sums = (progress.tokens_checksum, progress.offsets_checksum, progress.mask_checksum or mask)
            shards.append(ShardInfo(name, unit, progress.docs, progress.tokens, *sums))
        else:
            shards.append(ShardInfo(name, unit, progress.docs, progress.tokens, "", "", mask))
    return shards


def _expected_files(shards: list[ShardInfo], manifest: Manifest) -> dict[str, Expected]:
    """The size and checksum of every shard file, by key (for verifying the local copies)."""
    itemsize = np.dtype(manifest.dtype).itemsize
    files = {}
    for s in shards:
        files[tokens_key(s.name)] = Expected(s.num_tokens * itemsize, s.tokens_checksum)
        files[offsets_key(s.name)] = Expected(s.num_docs * OFFSET_DTYPE.itemsize, s.offsets_checksum)
        if manifest.loss_mask:
            files[mask_key(s.name)] = Expected(s.num_tokens, s.mask_checksum or "")
    return files


def _keys(name: str, masked: bool) -> tuple[str, str, str | None]:
    """The keys of the shard's files: tokens, offsets, and the loss mask if ``masked``."""
    return tokens_key(name), offsets_key(name), mask_key(name) if masked else None


def _cached_map(
    maps: OrderedDict[int, np.ndarray], shard: int, store: LocalStore, key: str, dtype: np.dtype, count: int
) -> np.ndarray:
    """The memory map of a shard file, from a small LRU: each open map holds a file descriptor.

    Safe from several threads (grain reads from a thread pool): each OrderedDict call is atomic, a map
    another thread evicts meanwhile stays valid for whoever holds it, and nothing is looked up twice.
    """
    mapped = maps.get(shard)
    if mapped is not None:
        with contextlib.suppress(KeyError):  # evicted by another thread since the get
            maps.move_to_end(shard)
        return mapped
    mapped = maps[shard] = store.map_array(key, dtype, count)
    while len(maps) > MAX_OPEN_MAPS:
        try:
            maps.popitem(last=False)  # closed once no caller holds a view of it
        except KeyError:  # emptied by another thread
            break
    return mapped

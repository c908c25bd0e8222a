"""Reading a token cache: memory-mapped shards, documents, the global token stream, and an SFT build's
loss mask.

:func:`open` reads the manifest, whose shard table becomes a few numpy arrays (not one object per shard),
and touches no shard file: each is checked against the manifest (its size, one ``stat``, and that it does
not lead out of the cache) when it is first mapped, before anything is read from it. Nothing is read into
RAM beyond the manifest and the offset tables of the shards in use; memory-mapped pages belong to the page
cache.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from streampack.errors import CacheError, OptionsError
from streampack.format.ledger import LedgerEntry
from streampack.format.manifest import Manifest, ShardInfo, ShardTable
from streampack.format.names import (
    OFFSET_DTYPE,
    SHARD_DIR,
    checksum_text,
    mask_key,
    offsets_key,
    shard_name,
    tokens_key,
)
from streampack.store import LocalStore, open_store
from streampack.store.files import load_manifest, read_entry
from streampack.store.localcopy import CachedStore, Expected, cached_store, on_release
from streampack.store.pressure import forget_release
from streampack.store.remote import is_remote

if TYPE_CHECKING:
    from streampack.interop import Exported
    from streampack.samples.packing import NoTarget, TooLong
    from streampack.samples.sequences import PackedSequences
    from streampack.samples.split import DocumentSet


# Offsets files this process checked against their checksums, by (path, device, inode, size, mtime, CRC).
_checked_offsets: set[tuple[object, ...]] = set()
_checked_lock = threading.Lock()

# Shard files kept mapped per kind (tokens, offsets, masks): every map holds a file descriptor, and the
# common limit is 1024 per process (three kinds x 128 = 384 of them); remapping a shard costs ~20 us.
MAX_OPEN_MAPS = 128


class Cache:
    """A token cache opened for reading. Create with :func:`streampack.open`.

    Attributes:
        root: the cache directory.
        store: where its files are (see :mod:`streampack.store`).
        manifest: its parsed manifest.
        table: its shard table (the manifest's, or the committed prefix of an unfinished build's).
        dtype: the token dtype (uint16 or uint32).

    Close it (:meth:`close`, or ``with streampack.open(...) as cache``) when done with it in a long-lived
    process that opens many caches from object storage.
    """

    _closed = False
    _opened_store: CachedStore | None = None  # the store open() made for this cache, closed with it

    def __init__(self, store: LocalStore, manifest: Manifest, table: ShardTable) -> None:
        self.store = store
        self.root = store.root
        self.manifest = manifest
        self.table = table
        self.dtype = np.dtype(manifest.dtype).newbyteorder("<")
        # The shards folder is checked here; a file in it can only lead out as a symlink, which the check at
        # its first map (_check_size) refuses.
        store.refuse_outside(SHARD_DIR)
        self._doc_starts = np.concatenate([[0], np.cumsum(table.num_docs, dtype=np.int64)])
        self._token_starts = np.concatenate([[0], np.cumsum(table.num_tokens, dtype=np.int64)])
        self._tokens: OrderedDict[int, np.ndarray] = OrderedDict()
        self._offsets: OrderedDict[int, np.ndarray] = OrderedDict()
        self._masks: OrderedDict[int, np.ndarray] = OrderedDict()
        if isinstance(store, CachedStore):
            on_release(self.drop_maps)

    def __repr__(self) -> str:
        name = self.store.describe("")
        return f"Cache({name!r}, docs={self.num_docs}, tokens={self.num_tokens}, dtype={self.dtype.name})"

    def close(self) -> None:
        """Drop the shard maps kept for reuse, stop taking part in a local copy's releases, and close the
        store :func:`open` made for this cache (see :meth:`CachedStore.close`); reads refuse afterwards.
        Calling it again does nothing."""
        self._closed = True
        forget_release(self.drop_maps)
        self.drop_maps()
        if self._opened_store is not None:
            self._opened_store.close()

    def __enter__(self) -> Cache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        return len(self.table)

    @property
    def vocab_size(self) -> int:
        """Every token id is below this."""
        return self.manifest.vocab_size

    @property
    def eos_id(self) -> int | None:
        """The EOS id appended after every document, or None."""
        return self.manifest.eos.appended

    @property
    def bos_id(self) -> int | None:
        """The BOS id put before every document, or None (also for caches written before BOS existed)."""
        return self.manifest.bos.prepended

    @functools.cached_property
    def content_digest(self) -> str:
        """A short digest of the shard table: what samples are made of, wherever the cache lives.

        A hash of the table's columns (:meth:`~streampack.format.ShardTable.digest`), computed once per open
        cache: every view of the cache and every plan key asks for it.
        """
        return self.table.digest()

    @functools.cached_property
    def version_1_digest(self) -> str:
        """:attr:`content_digest` as streampack computed it before format version 2 (slow at 10^5 shards:
        only asked for to accept a checkpoint or pickle that holds it)."""
        return self.table.version_1_digest()

    @functools.cached_property
    def shards(self) -> list[ShardInfo]:
        """The shard table as rows, in stream order (built on first use; :meth:`shard_info` makes one)."""
        return [self.shard_info(i) for i in range(self.num_shards)]

    def shard_info(self, shard: int) -> ShardInfo:
        """Row ``shard`` of the shard table, with its work unit's description."""
        return self.table.row(shard, self.manifest.units[shard], self.manifest.loss_mask)

    def sequences(self, seq_len: int, *, overlap: int = 0) -> PackedSequences:
        """Packed windows of the stream: sample i is tokens ``[i*seq_len, i*seq_len + seq_len + overlap)``.

        See :class:`streampack.samples.sequences.PackedSequences`.
        """
        from streampack.samples.sequences import PackedSequences

        return PackedSequences(self, seq_len, overlap=overlap)

    def packed(
        self,
        seq_len: int,
        *,
        too_long: TooLong = "split",
        no_target: NoTarget = "keep",
        pad_id: int | None = None,
    ) -> PackedSequences:
        """Whole documents packed into samples of ``seq_len`` tokens by best-fit decreasing, then padding.

        Every document is in exactly one sample, unless it is longer than ``seq_len``: ``too_long="split"``
        cuts it into pieces of ``seq_len`` tokens and a remainder, each packed on its own; ``"truncate"``
        keeps its first ``seq_len`` tokens; ``"drop"`` leaves it out (``samples.layout.dropped`` counts
        them). The plan is computed from the offset tables in chunks of
        :data:`~streampack.samples.packing.CHUNK_DOCS` documents and stored in ``CACHE/layouts/`` (see
        :mod:`streampack.samples.packing`). ``samples.layout.padding`` is the fraction of padding, and
        ``samples.layout.no_target`` counts the pieces with no target token.

        Args:
            seq_len: tokens per sample.
            too_long: what to do with a document longer than ``seq_len``.
            no_target: what to do with a piece (a document, or a piece of a split one) with no target
                token, whose every ``output="dict"`` label would be ``-100`` (in an SFT cache, a prompt
                truncated before its response): ``"keep"`` it (the default) or ``"drop"`` it.
            pad_id: the id that fills padding (masked out of the loss in ``output="dict"``); the cache's
                EOS id by default, else 0.
        """
        return self.all_documents().packed(seq_len, too_long=too_long, no_target=no_target, pad_id=pad_id)

    def documents(
        self,
        seq_len: int,
        *,
        too_long: TooLong = "truncate",
        no_target: NoTarget = "keep",
        pad_id: int | None = None,
    ) -> PackedSequences:
        """One document per sample, padded to ``seq_len`` tokens: for fine-tuning (SFT) on a masked cache.

        ``no_target="drop"`` leaves out the samples with no target token (a prompt truncated before its
        response would make a sample whose every label is ``-100``, and a batch of such samples a NaN mean
        loss); ``samples.layout.no_target`` counts them either way.

        Args:
            seq_len: tokens per sample.
            too_long: a document longer than ``seq_len`` is cut to its first ``seq_len`` tokens
                (``"truncate"``, the default), left out (``"drop"``), or served as several samples of
                consecutive pieces (``"split"``).
            no_target: ``"keep"`` (the default) or ``"drop"`` the samples with no target token.
            pad_id: as for :meth:`packed`.
        """
        return self.all_documents().documents(seq_len, too_long=too_long, no_target=no_target, pad_id=pad_id)

    def split(self, holdout: float, *, seed: int = 0) -> tuple[DocumentSet, DocumentSet]:
        """The training and validation documents, holding out ``holdout`` of them by a hash of their index.

        ``train, validation = cache.split(0.01)``; then ``train.sequences(2048)`` and
        ``validation.sequences(2048)`` (or ``.packed``, ``.documents``) never share a document. See
        :func:`streampack.samples.split.split`.
        """
        from streampack.samples.split import split

        return split(self, holdout, seed=seed)

    def all_documents(self) -> DocumentSet:
        """Every document of the cache, as a :class:`~streampack.samples.split.DocumentSet`."""
        from streampack.samples.split import Chosen, DocumentSet

        return DocumentSet(self, Chosen(self))

    def export(self, format: str, dest: str | os.PathLike[str], **options: Any) -> Exported:
        """Write the cache in another ecosystem's token format; see :func:`streampack.interop.export`."""
        from streampack.interop import export

        return export(self, format, dest, **options)

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
        if not self.num_shards:
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
        name = shard_name(self._index(shard))
        return self.store.path(tokens_key(name)), self.store.path(offsets_key(name))

    def shard_keys(self, shard: int, *, boundaries: bool = True) -> list[str]:
        """The store keys of shard ``shard``'s files: tokens, then (with ``boundaries``) offsets and the
        loss mask if any."""
        name = shard_name(self._index(shard))
        if not boundaries:
            return [tokens_key(name)]
        return [tokens_key(name), offsets_key(name)] + ([mask_key(name)] if self.manifest.loss_mask else [])

    def shard_tokens(self, shard: int) -> np.ndarray:
        """The token array of shard ``shard`` (memory-mapped on first use).

        Raises:
            CacheError: the file is missing, of another size than the manifest says, or leads out of the
                cache (checked when it is mapped, before anything is read from it).
        """
        return self._map(self._tokens, shard, tokens_key, self.dtype, self.table.num_tokens)

    def shard_offsets(self, shard: int) -> np.ndarray:
        """The cumulative document end offsets of shard ``shard`` (memory-mapped on first use).

        Every reader finds documents through these tables (samples of whole documents, splits, document
        boundaries), so each is checked against the manifest's checksum when this process first maps it
        (a table is about 1 % of its shard: 8 bytes per document); tokens and masks are served as mapped,
        their sizes checked, and ``streampack verify`` checks their checksums.

        Raises:
            CacheError: as for :meth:`shard_tokens`, or the table does not match its checksum.
        """
        return self._map(self._offsets, shard, offsets_key, OFFSET_DTYPE, self.table.num_docs)

    def raw_offsets(self, shard: int) -> np.ndarray:
        """:meth:`shard_offsets` without its checksum check (its size is checked), and not kept: for
        ``verify``, which checks the table itself and says what is wrong with it."""
        index = self._index(shard)
        key, count = offsets_key(shard_name(index)), int(self.table.num_docs[index])
        self._check_size(key, count, OFFSET_DTYPE.itemsize)
        return self.store.map_array(key, OFFSET_DTYPE, count)

    def _check_offsets(self, key: str, index: int, mapped: np.ndarray) -> None:
        """Refuse an offsets table that does not match the manifest's checksum; a table of the same file
        (device, inode, size, modification time) is checked once per process."""
        if self.table.offsets_crc32 is None or isinstance(self.store, CachedStore):
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
            actual = checksum_text(zlib.crc32(mapped.data) if len(mapped) else 0)
            if actual != expected:
                raise CacheError(
                    f"{path}: checksum {actual} does not match the manifest's {expected}: the table of where "
                    "each document ends is damaged; run `streampack verify` on the cache and rebuild it"
                )
            with _checked_lock:
                _checked_offsets.add(identity)

    def shard_loss_mask(self, shard: int) -> np.ndarray:
        """The loss mask of shard ``shard``: uint8, one per token of :meth:`shard_tokens`, 1 where the token
        is a training target (memory-mapped on first use).

        Raises:
            CacheError: the cache has no loss mask (it was not built with ``fields`` or ``chat``).
        """
        if not self.manifest.loss_mask:
            raise CacheError(
                f"{self.root}: the cache has no loss mask (it was built from texts, not with fields=[...] or "
                "chat=...); every token is a training target"
            )
        return self._map(self._masks, shard, mask_key, np.dtype(np.uint8), self.table.num_tokens)

    def shard_mask_path(self, shard: int) -> Path | None:
        """The loss mask file of shard ``shard``, or None when the cache has no loss mask."""
        masked = self.manifest.loss_mask
        return self.store.path(mask_key(shard_name(self._index(shard)))) if masked else None

    @property
    def token_starts(self) -> np.ndarray:
        """Global index of the first token of each shard, plus the total at the end."""
        return self._token_starts

    def _index(self, shard: int) -> int:
        """``shard`` as a non-negative index (IndexError when out of range, as a list would raise)."""
        return range(self.num_shards)[shard]

    def _map(
        self,
        maps: OrderedDict[int, np.ndarray],
        shard: int,
        key_of: Callable[[str], str],
        dtype: np.dtype,
        counts: np.ndarray,
    ) -> np.ndarray:
        """The memory map of one of shard ``shard``'s files (``counts``: items per shard), from a small LRU
        (each open map holds a file descriptor); the file is checked whenever it is (re)mapped.

        Safe from several threads (grain reads from a thread pool): each OrderedDict call is atomic, a map
        another thread evicts meanwhile stays valid for whoever holds it, and nothing is looked up twice.
        """
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
        maps[index] = mapped
        while len(maps) > MAX_OPEN_MAPS:
            try:
                maps.popitem(last=False)  # closed once no caller holds a view of it
            except KeyError:  # emptied by another thread
                break
        return mapped

    def _check_size(self, key: str, count: int, itemsize: int) -> None:
        """Refuse a shard file that is missing, shorter than the manifest says (longer, once complete), or
        a symlink leading out of the cache: one ``lstat`` (and one ``stat``)."""
        if count == 0 and not self.manifest.complete:
            return  # a unit of an unfinished build that has not committed yet may have no files at all
        if isinstance(self.store, CachedStore):
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
    recently used ones are evicted; see :mod:`streampack.store.localcopy`). :meth:`Cache.close` (or a
    ``with`` block) releases what reading it holds: kept maps, and the thread that watches a bounded copy.

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
    if not manifest.complete:
        if not allow_incomplete:
            raise CacheError(
                f"{store.describe('')}: the build of this cache has not finished; rerun the same build "
                "command to complete it, or open it with allow_incomplete=True to read the committed part"
            )
        progress = [read_entry(store, shard_name(i), u) for i, u in enumerate(manifest.units)]
        cache = open_committed(store, manifest, progress)
    else:
        if isinstance(store, CachedStore):
            store.expect(_expected_files(manifest, manifest.table, None))
        cache = Cache(store, manifest, manifest.table)
    if isinstance(store, CachedStore):
        cache._opened_store = store
    return cache


def open_committed(store: LocalStore, manifest: Manifest, progress: list[LedgerEntry]) -> Cache:
    """The cache of an unfinished build as ``progress`` (each unit's ledger entry, read by the caller)
    says it is committed: what :func:`open` gives with ``allow_incomplete=True``, without reading the
    ledger again (a follower keeps the entries of finished units, which are final)."""
    table = _committed_table(progress)
    if isinstance(store, CachedStore):
        store.expect(_expected_files(manifest, table, progress))
    return Cache(store, manifest, table)


def _committed_table(progress: list[LedgerEntry]) -> ShardTable:
    """Each unit's committed prefix from its ledger entry (none: the unit has not committed yet).

    A unit's writer makes its shard files durable before the ledger entry that covers them, so every
    committed byte is on disk; a unit with nothing committed may have no files at all.
    """
    docs = np.array([p.docs for p in progress], dtype=np.int64)
    return ShardTable(docs, np.array([p.tokens for p in progress], dtype=np.int64))


def _expected_files(
    manifest: Manifest, table: ShardTable, progress: list[LedgerEntry] | None
) -> dict[str, Expected]:
    """The size and checksum of every shard file, by key, for verifying local copies: from the manifest of
    a complete build; for an unfinished one, from the ledger entries of its finished units (in object
    storage an entry is published once its unit is done, with its files' checksums); "" where none."""
    itemsize = np.dtype(manifest.dtype).itemsize
    files = {}
    for i in range(len(table)):
        info = table.row(i, "", manifest.loss_mask)
        sums = (info.tokens_checksum, info.offsets_checksum, info.mask_checksum or "")
        if progress is not None:
            done = progress[i]
            sums = (
                (done.tokens_checksum, done.offsets_checksum, done.mask_checksum or "")
                if done.done
                else ("",) * 3
            )
        files[tokens_key(info.name)] = Expected(info.num_tokens * itemsize, sums[0])
        files[offsets_key(info.name)] = Expected(info.num_docs * OFFSET_DTYPE.itemsize, sums[1])
        if manifest.loss_mask:
            files[mask_key(info.name)] = Expected(info.num_tokens, sums[2])
    return files

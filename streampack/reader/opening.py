"""Opening a cache: :func:`open` (a directory, or a URL through a local copy) and the committed prefix of
an unfinished build (:func:`open_committed`).

:func:`open` reads the manifest, whose shard table becomes a few numpy arrays (not one object per shard),
and touches no shard file: each is checked against the manifest when it is first mapped
(:mod:`streampack.reader.shards`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from streampack.errors import CacheError, OptionsError
from streampack.format.ledger import LedgerEntry
from streampack.format.manifest import Manifest, ShardTable
from streampack.format.names import MANIFEST, OFFSET_DTYPE, mask_key, offsets_key, shard_name, tokens_key
from streampack.reader.cache import Cache
from streampack.store import Expected, LocalStore, is_remote, open_store
from streampack.store.files import load_manifest, read_entry

__all__ = ["open", "open_committed"]


def open(
    path: str | os.PathLike[str],
    *,
    allow_incomplete: bool = False,
    local_dir: str | os.PathLike[str] | None = None,
    max_local_bytes: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    prefetch_steps: int | None = None,
    format: str | None = None,
    eos_id: int | None = None,
    bos_id: int | None = None,
    dtype: str | None = None,
    tokenizer: str | None = None,
    vocab_size: int | None = None,
) -> Cache:
    """Open a token cache for reading: a streampack cache, or another ecosystem's token files.

    A local path that holds no streampack cache is opened as the token files of another format if one
    recognises it (:mod:`streampack.interop.reading`): a Megatron prefix (``x`` for ``x.bin`` + ``x.idx``),
    a folder of llm.c shards, datatrove ``.ds`` files, OLMo ``.npy`` memmaps or MDS shards, a nanoGPT
    ``train.bin``. They are memory-mapped as they are (MDS samples excepted: see its module), and the
    cache serves everything a native one does; ``format``, ``eos_id``, ``bos_id``, ``dtype``,
    ``tokenizer`` and ``vocab_size`` tell it what those files do not say
    (:class:`~streampack.interop.reading.ForeignOptions`).

    A cache in object storage (``s3://bucket/prefix``, any fsspec URL) is read through a local copy (so
    are Megatron and datatrove files there, :mod:`streampack.interop.remote`):
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
        format: (other formats) the format of the files; recognised from them by default.
        eos_id: (other formats) the id that ends every document (nanoGPT, OLMo, Megatron).
        bos_id: (other formats) the id that starts every document (llm.c's delimiter).
        dtype: (other formats) the token dtype of headerless files, ``uint16`` or ``uint32``.
        tokenizer: (other formats) the tokenizer the ids are of, as ``build`` takes it (checked by mixtures).
        vocab_size: (other formats) every id is below it.

    Raises:
        CacheError: the directory is not a cache, its build is incomplete (unless allowed), or its
            manifest and files disagree.
        OptionsError: an object-storage option for a local cache, or a bound smaller than a shard.
    """
    declared = {"format": format, "eos_id": eos_id, "bos_id": bos_id, "dtype": dtype}
    declared.update(tokenizer=tokenizer, vocab_size=vocab_size)
    if is_remote(path):
        copy: dict[str, Any] = {"local_dir": local_dir, "max_local_bytes": max_local_bytes}
        copy.update(prefetch_steps=prefetch_steps, storage_options=storage_options)
        from streampack.store.localcopy import cached_store  # object storage only

        store: LocalStore = cached_store(str(path), **copy)
        if format is not None or not store.exists(MANIFEST):
            return _open_foreign_remote(str(path), declared, copy)
        _refuse_declared(path, declared, "a streampack cache")
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
        if format is not None or not store.exists(MANIFEST):
            return _open_foreign(store.root, declared)
        _refuse_declared(path, declared, "a streampack cache")
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
        if store.fetches_copies:
            store.expect(_expected_files(manifest, manifest.table, None))
        cache = Cache(store, manifest, manifest.table)
    if store.fetches_copies:
        cache._opened_store = store  # type: ignore[assignment]  # a CachedStore
    return cache


def _refuse_declared(path: str | os.PathLike[str], declared: dict[str, Any], what: str) -> None:
    """Refuse the options of other formats' files for ``what``."""
    named = [name for name, value in declared.items() if value is not None]
    if named:
        raise OptionsError(f"{path}: {', '.join(named)} apply to other formats' token files, not to {what}")


def _open_foreign(path: str | os.PathLike[str], declared: dict[str, Any]) -> Cache:
    """Another format's token files at ``path`` as a cache; see
    :func:`streampack.interop.reading.open_foreign`."""
    from streampack.interop.reading import open_foreign

    return open_foreign(path, **declared)


def _open_foreign_remote(url: str, declared: dict[str, Any], copy: dict[str, Any]) -> Cache:
    """Another format's token files in object storage as a cache; see
    :func:`streampack.interop.remote.open_remote`."""
    from streampack.interop.remote import open_remote

    return open_remote(url, declared, **copy)


def open_committed(store: LocalStore, manifest: Manifest, progress: list[LedgerEntry]) -> Cache:
    """The cache of an unfinished build as ``progress`` (each unit's ledger entry, read by the caller)
    says it is committed: what :func:`open` gives with ``allow_incomplete=True``, without reading the
    ledger again (a follower keeps the entries of finished units, which are final)."""
    table = _committed_table(progress)
    if store.fetches_copies:
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

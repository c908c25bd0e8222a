"""Opening a cache: :func:`open` (a directory, a URL, or another format's files) and the committed prefix
of an unfinished build (:func:`open_committed`)."""

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

    The manifest is read; no shard file is touched until it is first mapped, when it is checked against
    the manifest. A local path without a streampack cache is opened as another format's token files if
    one recognises them (:mod:`streampack.reader.foreign`): a Megatron prefix, a folder of llm.c shards,
    datatrove ``.ds`` files, OLMo ``.npy`` memmaps or MDS shards, a nanoGPT ``train.bin``. They are mapped
    where they lie, and the cache serves everything a native one does.

    A cache in object storage (``s3://bucket/prefix``, any fsspec URL) is read through a local copy, as
    are Megatron and datatrove files there: each shard file is fetched whole on first use, verified, and
    mapped from ``local_dir``, which the processes of a node share and which holds at most
    ``max_local_bytes`` of shard files (see :mod:`streampack.store.localcopy`). :meth:`Cache.close` (or a
    ``with`` block) releases what reading holds.

    Args:
        path: the cache directory (a path, or a ``file://`` URI), or the URL of a cache in object storage.
        allow_incomplete: read what each unit of an unfinished (or running) build had committed, instead
            of refusing it.
        local_dir: (object storage) the local copy's directory; one per URL under the temp dir by default.
        max_local_bytes: (object storage) the bound on the local copy's shard files; unbounded by default.
            It must hold the shards one batch of every process of the node reads at once.
        storage_options: (object storage) passed to the fsspec filesystem.
        prefetch_steps: (object storage) steps ahead whose shards a :class:`~streampack.Loader` fetches
            in the background; 8 by default.
        format: (other formats) the format of the files; recognised from them by default.
        eos_id: (other formats) the id that ends every document (nanoGPT, OLMo, Megatron).
        bos_id: (other formats) the id that starts every document (llm.c's delimiter).
        dtype: (other formats) the token dtype of headerless files, ``uint16`` or ``uint32``.
        tokenizer: (other formats) the tokenizer of the ids, as ``build`` takes it (mixtures check it).
        vocab_size: (other formats) every id is below it.

    Raises:
        CacheError: the directory is not a cache, its build is incomplete (unless allowed), or its
            manifest and files disagree.
        OptionsError: an object-storage option for a local cache, or a bound smaller than a shard.
    """
    declared: dict[str, Any] = {"format": format, "eos_id": eos_id, "bos_id": bos_id, "dtype": dtype}
    declared.update(tokenizer=tokenizer, vocab_size=vocab_size)
    copy: dict[str, Any] = {"local_dir": local_dir, "max_local_bytes": max_local_bytes}
    copy.update(prefetch_steps=prefetch_steps, storage_options=storage_options)
    remote = is_remote(path)
    if remote:
        from streampack.store.localcopy import cached_store  # object storage only

        store: LocalStore = cached_store(str(path), **copy)
    else:
        given = [name for name, value in copy.items() if value is not None and name != "storage_options"]
        if given or storage_options:
            raise OptionsError(
                f"{path}: {', '.join(given or ['storage_options'])} apply to caches in object storage "
                "(s3://...), not to a local cache"
            )
        store = open_store(path)
    if format is not None or not store.exists(MANIFEST):
        from streampack.reader.foreign.opening import open_foreign, open_remote  # other formats only

        return open_remote(str(path), declared, **copy) if remote else open_foreign(store.root, **declared)
    named = [name for name, value in declared.items() if value is not None]
    if named:
        raise OptionsError(
            f"{path}: {', '.join(named)} apply to other formats' token files, not to a streampack cache"
        )
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


def open_committed(store: LocalStore, manifest: Manifest, progress: list[LedgerEntry]) -> Cache:
    """The cache of an unfinished build as far as ``progress`` (each unit's ledger entry) says it is
    committed: ``open(allow_incomplete=True)`` without reading the ledger again.

    A unit's writer makes its files durable before the ledger entry that covers them, so every committed
    byte is on disk; a unit with nothing committed may have no files at all.
    """
    docs = np.array([p.docs for p in progress], dtype=np.int64)
    table = ShardTable(docs, np.array([p.tokens for p in progress], dtype=np.int64))
    if store.fetches_copies:
        store.expect(_expected_files(manifest, table, progress))
    return Cache(store, manifest, table)


def _expected_files(
    manifest: Manifest, table: ShardTable, progress: list[LedgerEntry] | None
) -> dict[str, Expected]:
    """The size and checksum of every shard file by key, for verifying local copies: from the manifest, or
    for an unfinished build from its finished units' ledger entries ("" for the others)."""
    itemsize = np.dtype(manifest.dtype).itemsize
    files = {}
    for i in range(len(table)):
        info = table.row(i, "", manifest.loss_mask)
        sums = (info.tokens_checksum, info.offsets_checksum, info.mask_checksum or "")
        if progress is not None:
            entry = progress[i]
            sums = (
                (entry.tokens_checksum, entry.offsets_checksum, entry.mask_checksum)
                if entry.done
                else ("",) * 3
            )
        files[tokens_key(info.name)] = Expected(info.num_tokens * itemsize, sums[0])
        files[offsets_key(info.name)] = Expected(info.num_docs * OFFSET_DTYPE.itemsize, sums[1])
        if manifest.loss_mask:
            files[mask_key(info.name)] = Expected(info.num_tokens, sums[2])
    return files

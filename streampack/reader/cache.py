"""The cache opened for reading: :class:`Cache`, its documents and the global token stream.

A cache reads its shards through a :class:`~streampack.reader.shards.Shards`; nothing is read into RAM
beyond the manifest and the offset tables of the shards in use. Its sample views (``sequences``,
``packed``, ``documents``, ``split``) are made in :mod:`streampack.samples`; the methods here delegate.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from streampack.format.manifest import Manifest, ShardInfo, ShardTable
from streampack.reader.shards import ShardFiles, Shards
from streampack.store import LocalStore

if TYPE_CHECKING:
    from streampack.interop import Exported
    from streampack.samples.packing import NoTarget, TooLong
    from streampack.samples.sequences import PackedSequences
    from streampack.samples.split import DocumentSet
    from streampack.store.localcopy import CachedStore

__all__ = ["Cache"]


class Cache:
    """A token cache opened for reading. Create with :func:`streampack.open`.

    Attributes:
        root: the cache directory.
        store: where its files are (see :mod:`streampack.store`).
        manifest: its parsed manifest.
        table: its shard table (the manifest's, or the committed prefix of an unfinished build's).
        dtype: the token dtype (uint16 or uint32).
        files: what its shards' arrays are read from (a :class:`~streampack.reader.shards.Shards`;
            ``ShardFiles`` by default).
    """

    _opened_store: CachedStore | None = None  # the store open() made for this cache, closed with it
    declared: dict[str, Any] | None = None  # another format's files: what reopens them (format, eos_id...)

    def __init__(
        self, store: LocalStore, manifest: Manifest, table: ShardTable, *, files: Shards | None = None
    ) -> None:
        self.store = store
        self.root = store.root
        self.manifest = manifest
        self.table = table
        self.dtype = np.dtype(manifest.dtype).newbyteorder("<")
        self.files: Shards = files if files is not None else ShardFiles(store, manifest, table)
        self._doc_starts = np.concatenate([[0], np.cumsum(table.num_docs, dtype=np.int64)])
        self._token_starts = np.concatenate([[0], np.cumsum(table.num_tokens, dtype=np.int64)])

    def __repr__(self) -> str:
        name = self.store.describe("")
        return f"Cache({name!r}, docs={self.num_docs}, tokens={self.num_tokens}, dtype={self.dtype.name})"

    def close(self) -> None:
        """Drop the kept shard maps and close the store :func:`open` made (as a ``with`` block does); reads
        refuse afterwards. Idempotent."""
        self.files.close()
        if self._opened_store is not None:
            self._opened_store.close()

    def __enter__(self) -> Cache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def drop_maps(self) -> None:
        """Forget the shard maps kept for reuse; those still held stay valid (see ``Shards.drop``)."""
        self.files.drop()

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
        """A short digest of what samples are made of, wherever the cache lives: the shard table, whose
        CRC-32s cover a native cache's files, and for another format's files what they held when opened
        (:mod:`streampack.reader.foreign.identity`)."""
        table, held = self.table.digest(), self.files.identity()
        return table if not held else hashlib.sha256(f"{table}:{held}".encode()).hexdigest()[:16]

    @functools.cached_property
    def version_1_digest(self) -> str:
        """:attr:`content_digest` as streampack computed it before format version 2 (slow at 10^5 shards:
        only asked for to accept a checkpoint or pickle that holds it)."""
        return self.table.version_1_digest()

    @functools.cached_property
    def shards(self) -> list[ShardInfo]:
        """The shard table as rows, in stream order."""
        return [self.shard_info(i) for i in range(self.num_shards)]

    def shard_info(self, shard: int) -> ShardInfo:
        """Row ``shard`` of the shard table, with its work unit's description."""
        return self.table.row(shard, self.manifest.units[shard], self.manifest.loss_mask)

    def sequences(self, seq_len: int, *, overlap: int = 0) -> PackedSequences:
        """Packed windows of the stream. See :meth:`streampack.samples.split.DocumentSet.sequences`."""
        from streampack.samples.split import all_documents

        return all_documents(self).sequences(seq_len, overlap=overlap)

    def packed(
        self,
        seq_len: int,
        *,
        too_long: TooLong = "split",
        no_target: NoTarget = "keep",
        pad_id: int | None = None,
        pad_multiple: int = 1,
    ) -> PackedSequences:
        """Whole documents packed into samples. See :meth:`streampack.samples.split.DocumentSet.packed`."""
        from streampack.samples.split import all_documents

        return all_documents(self).packed(
            seq_len, too_long=too_long, no_target=no_target, pad_id=pad_id, pad_multiple=pad_multiple
        )

    def documents(
        self,
        seq_len: int,
        *,
        too_long: TooLong = "truncate",
        no_target: NoTarget = "keep",
        pad_id: int | None = None,
        pad_multiple: int = 1,
    ) -> PackedSequences:
        """One document per sample, padded. See :meth:`streampack.samples.split.DocumentSet.documents`."""
        from streampack.samples.split import all_documents

        return all_documents(self).documents(
            seq_len, too_long=too_long, no_target=no_target, pad_id=pad_id, pad_multiple=pad_multiple
        )

    def split(self, holdout: float, *, seed: int = 0) -> tuple[DocumentSet, DocumentSet]:
        """The training and validation documents. See :func:`streampack.samples.split.split`."""
        from streampack.samples.split import split

        return split(self, holdout, seed=seed)

    def all_documents(self) -> DocumentSet:
        """Every document of the cache. See :func:`streampack.samples.split.all_documents`."""
        from streampack.samples.split import all_documents

        return all_documents(self)

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
        shard = int(np.searchsorted(self._token_starts, start, side="right") - 1)
        pos = start
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

    def shard_paths(self, shard: int) -> tuple[Path, ...]:
        """The files of shard ``shard``'s tokens and document ends (see ``Shards.paths``)."""
        return self.files.paths(shard)

    def shard_keys(self, shard: int, *, boundaries: bool = True) -> list[str]:
        """The store keys of shard ``shard``'s files (see ``Shards.keys``)."""
        return self.files.keys(shard, boundaries=boundaries)

    def shard_tokens(self, shard: int) -> np.ndarray:
        """The token array of shard ``shard`` (see :meth:`ShardFiles.tokens`)."""
        return self.files.tokens(shard)

    def shard_offsets(self, shard: int) -> np.ndarray:
        """Where each document of shard ``shard`` ends, checked (see :meth:`ShardFiles.offsets`)."""
        return self.files.offsets(shard)

    def raw_offsets(self, shard: int) -> np.ndarray:
        """:meth:`shard_offsets` unchecked and not kept, for ``verify`` (see ``Shards.raw_offsets``)."""
        return self.files.raw_offsets(shard)

    def shard_loss_mask(self, shard: int) -> np.ndarray:
        """The loss mask of shard ``shard``, 1 at a training target (see :meth:`ShardFiles.mask`)."""
        return self.files.mask(shard)

    def shard_mask_path(self, shard: int) -> Path | None:
        """The loss mask file of shard ``shard``, or None without a loss mask (see ``Shards.mask_path``)."""
        return self.files.mask_path(shard)

    @property
    def token_starts(self) -> np.ndarray:
        """Global index of the first token of each shard, plus the total at the end."""
        return self._token_starts

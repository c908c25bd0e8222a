"""Appending documents to a shard (tokens, document ends, an SFT loss mask), and committing them durably."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from streampack.format.ledger import Counts, LedgerEntry
from streampack.format.names import OFFSET_DTYPE, SHARD_DIR, checksum_text, mask_key, offsets_key, tokens_key
from streampack.store import AppendFile, LocalStore
from streampack.store.files import commit_entry


class ShardWriter:
    """Append-only writer of one shard, opened at the lengths ``progress`` committed (dropping an uncommitted
    tail); ``masked``: also write an SFT build's loss mask."""

    def __init__(
        self, root: Path, name: str, dtype: np.dtype, progress: LedgerEntry, *, masked: bool = False
    ) -> None:
        self.root = root
        self.name = name
        self.dtype = np.dtype(dtype)
        self.progress = progress
        self._store = LocalStore(root)
        self._tokens = self._store.append_file(tokens_key(name), progress.tokens * self.dtype.itemsize)
        self._tokens.lock()
        self._created = self._tokens.created
        self._offsets = self._store.append_file(offsets_key(name), progress.docs * OFFSET_DTYPE.itemsize)
        self._mask = self._store.append_file(mask_key(name), progress.tokens) if masked else None
        self.num_tokens = progress.tokens
        self.num_docs = progress.docs
        self._doc_aligned_tokens = progress.tokens

    def append(self, tokens: np.ndarray, ends: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Append tokens (of the shard's dtype), the ends of the documents they complete (relative to
        ``tokens``; none while a long document goes on), and with a masked writer their loss mask."""
        if self._mask is not None:
            assert mask is not None and len(mask) == len(tokens), "a masked shard takes a byte per token"
            self._mask.write(_buffer(mask, np.dtype(np.uint8)))
        self._tokens.write(_buffer(tokens, self.dtype))
        if len(ends):
            self._offsets.write(_buffer(ends + self.num_tokens, OFFSET_DTYPE))
            self._doc_aligned_tokens = self.num_tokens + int(ends[-1])
        self.num_tokens += len(tokens)
        self.num_docs += len(ends)

    def commit(self, counts: Counts, *, done: bool = False) -> LedgerEntry:
        """Fsync everything appended, then record it in the ledger (with ``done``, with its checksums).

        The ledger records tokens up to the last complete document: a resume writes a partial one again.
        """
        for file in self._files():
            file.sync()
        if self._created:  # the new files' directory entries must be durable before a ledger names them
            self._store.sync_dir(SHARD_DIR)
            self._created = False
        checksums = ("", "", "")
        if done:
            mask = "" if self._mask is None else checksum_text(self._mask.crc32())
            checksums = (checksum_text(self._tokens.crc32()), checksum_text(self._offsets.crc32()), mask)
        self.progress = LedgerEntry(
            unit=self.progress.unit,
            records=counts.records,
            docs=self.num_docs,
            tokens=self._doc_aligned_tokens,
            skipped=counts.skipped,
            done=done,
            tokens_checksum=checksums[0],
            offsets_checksum=checksums[1],
            empty_docs=counts.empty_docs,
            inexact_cuts=counts.inexact_cuts,
            mask_checksum=checksums[2],
        )
        commit_entry(self._store, self.name, self.progress)
        return self.progress

    def close(self) -> None:
        """Close the files (without committing)."""
        for file in self._files():
            file.close()

    def _files(self) -> list[AppendFile]:
        return [self._tokens, self._offsets] + ([] if self._mask is None else [self._mask])


def _buffer(array: np.ndarray, dtype: np.dtype) -> memoryview:
    """``array``'s bytes as ``dtype``, without a copy where it already is one, contiguous."""
    return np.ascontiguousarray(array, dtype=dtype).view(np.uint8).data

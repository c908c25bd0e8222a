"""Appending documents to a shard, and committing them durably.

A shard is two files: the token ids, flat, and the uint64 cumulative end offset of every document; an SFT
build's shards have a third, the loss mask, one byte per token. :class:`ShardWriter` opens them at the
committed lengths of the ledger (truncating any uncommitted tail a crash left behind), appends documents,
and on :meth:`ShardWriter.commit` fsyncs every file *before* the ledger entry that covers them is replaced.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import numpy as np

from streampack import ledger
from streampack.errors import CacheError, WriteError
from streampack.format import OFFSET_DTYPE, file_checksum, fsync_dir, mask_path, offsets_path, tokens_path
from streampack.ledger import Counts, UnitProgress


class ShardWriter:
    """Append-only writer of one shard, resuming from a unit's committed progress.

    Use as a context manager; nothing is committed implicitly on exit.

    Args:
        root: the cache directory.
        name: the shard's name.
        dtype: the token dtype.
        progress: what the unit has committed so far.
        masked: also write the loss mask (one byte per token), for SFT builds.
    """

    def __init__(
        self, root: Path, name: str, dtype: np.dtype, progress: UnitProgress, *, masked: bool = False
    ) -> None:
        self.root = root
        self.name = name
        self.dtype = np.dtype(dtype)
        self.progress = progress
        self._tokens_path = tokens_path(root, name)
        self._offsets_path = offsets_path(root, name)
        self._created = not self._tokens_path.exists()
        self._tokens = _open_at(self._tokens_path, progress.tokens * self.dtype.itemsize)
        _lock_shard(self._tokens, self._tokens_path)
        self._offsets = _open_at(self._offsets_path, progress.docs * OFFSET_DTYPE.itemsize)
        self._mask_path = mask_path(root, name)
        self._mask = _open_at(self._mask_path, progress.tokens) if masked else None
        self.num_tokens = progress.tokens
        self.num_docs = progress.docs
        self._doc_aligned_tokens = progress.tokens

    def append(self, tokens: np.ndarray, ends: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Append tokens, and document ends given relative to the start of ``tokens``.

        Args:
            tokens: token ids, already of the shard's dtype.
            ends: cumulative end offsets of the documents completed within ``tokens`` (may be empty when a
                long document continues past this call).
            mask: the tokens' loss mask (uint8, one per token): required when the writer is masked.
        """
        if self._mask is not None:
            assert mask is not None and len(mask) == len(tokens), "a masked shard takes a byte per token"
            self._write(self._mask, mask.astype(np.uint8, copy=False), self._mask_path)
        self._write(self._tokens, tokens.astype(self.dtype, copy=False), self._tokens_path)
        if len(ends):
            self._write(self._offsets, (ends + self.num_tokens).astype(OFFSET_DTYPE), self._offsets_path)
            self._doc_aligned_tokens = self.num_tokens + int(ends[-1])
        self.num_tokens += len(tokens)
        self.num_docs += len(ends)

    def commit(self, counts: Counts, *, done: bool = False) -> UnitProgress:
        """Make everything appended durable, then record it in the ledger.

        The ledger records the tokens up to the end of the last complete document: the tokens of a document
        still being appended (a long one, split into pieces) are cut off on resume and written again, with
        the records they belong to (``counts`` covers complete documents only). With ``done``, also record
        the final checksums.
        """
        for f, path in self._files():
            try:
                f.flush()
                os.fsync(f.fileno())
            except OSError as e:
                raise disk_error(e, path) from None
        if self._created:  # the new files' directory entries must be durable before a ledger names them
            fsync_dir(self._tokens_path.parent)
            self._created = False
        checksums = ("", "", "")
        if done:
            mask = "" if self._mask is None else file_checksum(self._mask_path)
            checksums = (file_checksum(self._tokens_path), file_checksum(self._offsets_path), mask)
        self.progress = UnitProgress(
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
        ledger.commit(self.root, self.name, self.progress)
        return self.progress

    def close(self) -> None:
        """Close the files (without committing)."""
        for f, _ in self._files():
            f.close()

    def _files(self) -> list[tuple[BinaryIO, Path]]:
        files = [(self._tokens, self._tokens_path), (self._offsets, self._offsets_path)]
        if self._mask is not None:
            files.append((self._mask, self._mask_path))
        return files

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @staticmethod
    def _write(f: BinaryIO, array: np.ndarray, path: Path) -> None:
        try:
            f.write(array.tobytes())
        except OSError as e:
            raise disk_error(e, path) from None


def _open_at(path: Path, length: int) -> BinaryIO:
    """Open ``path`` for appending after truncating it to its committed ``length``."""
    try:
        f = open(path, "r+b" if path.exists() else "w+b")  # noqa: SIM115 - kept open by the writer
        size = f.seek(0, os.SEEK_END)
        if size < length:
            f.close()
            raise CacheError(
                f"{path} holds {size} bytes but the ledger committed {length}: the shard was damaged after "
                "it was written; rebuild with overwrite=True"
            )
        f.truncate(length)
        f.seek(length)
        return f
    except OSError as e:
        raise disk_error(e, path) from None


def _lock_shard(f: BinaryIO, path: Path) -> None:
    """Hold an exclusive ``flock`` on a shard while writing it, so that no two processes ever do.

    The build lock keeps builds apart; this also covers a worker that outlived a killed build (a Ray
    task, or a pool worker still starting when its coordinator died) while the rerun resumes its unit.
    """
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise WriteError(
            f"{path} is being written by another process (a worker of a killed build?); wait for it to "
            "exit, then rerun the same command"
        ) from None


def disk_error(error: OSError, path: Path) -> WriteError:
    """A :class:`WriteError` that says what to do about a failed write to ``path``."""
    if error.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        reason = "disk full" if error.errno != errno.EFBIG else "file size limit reached"
        return WriteError(
            f"{reason} while writing {path}: free space (or raise the limit) and rerun the same command to "
            "resume; everything committed so far is kept"
        )
    return WriteError(f"cannot write {path}: {error.strerror or error}")

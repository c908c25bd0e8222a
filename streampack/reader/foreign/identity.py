"""What identifies another format's files (:func:`files_identity`), which record no checksum: with their
shard table it makes the cache's :attr:`~streampack.reader.Cache.content_digest`, the key of stored plans
and loader states.

The identity is what the files hold, not where or when they were written: per shard a digest of its
document ends (every open reads them anyway), and per token or loss-mask file its size and first and last
:data:`BLOCK` bytes, so a copy of the files elsewhere keeps its plans and states, while files rewritten with
other documents, or reordered, do not. It is blind to a rewrite that keeps every document end and both
blocks of each file (a plan made of the ends stays right then); a CRC-32 of every token at each open would
have cost half again an open's time (``streampack convert`` makes a cache whose CRC-32s cover every byte).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from streampack.errors import CacheError
from streampack.reader.foreign.files import LOCAL, ForeignFiles

__all__ = ["BLOCK", "ends_digest", "files_identity"]

#: Bytes read at each end of every token and loss-mask file for its identity: one page.
BLOCK = 4096

#: Files whose blocks are read at once from object storage (each read is a request).
_REMOTE_READS = 16


def ends_digest(ends: np.ndarray) -> bytes:
    """The digest of one shard's document ends (as little-endian uint64, whatever their dtype)."""
    return hashlib.sha256(np.ascontiguousarray(ends, dtype="<u8").data).digest()


def files_identity(ends: Iterable[bytes], sampled: Sequence[Path], files: ForeignFiles = LOCAL) -> str:
    """The identity of another format's files.

    Args:
        ends: each shard's :func:`ends_digest`.
        sampled: the token and loss-mask files, whose sizes and first and last :data:`BLOCK` bytes are read.
        files: where they are read from.

    Raises:
        CacheError: a file cannot be read (it was removed since it was opened).
    """
    digest = hashlib.sha256(b"streampack foreign files 1")
    for shard in ends:
        digest.update(shard)
    if files.local or len(sampled) < 2:
        blocks = [_blocks(path, files) for path in sampled]
    else:
        with ThreadPoolExecutor(min(_REMOTE_READS, len(sampled)), "streampack-identity") as pool:
            blocks = list(pool.map(lambda path: _blocks(path, files), sampled))
    for size, head, tail in blocks:
        digest.update(struct.pack("<Q", size))
        digest.update(head)
        digest.update(tail)
    return digest.hexdigest()[:32]


def _blocks(path: Path, files: ForeignFiles) -> tuple[int, bytes, bytes]:
    """``path``'s size, its first :data:`BLOCK` bytes and its last (none where the first hold it all)."""
    try:
        size = files.size(path)
        if size <= 2 * BLOCK:
            return size, files.read(path, 0, size), b""
        return size, files.read(path, 0, BLOCK), files.read(path, size - BLOCK, size)
    except OSError as e:
        raise CacheError(
            f"{files.name(path)}: cannot be read ({e.strerror or e}); it was there when the files were "
            "opened: open them again"
        ) from None

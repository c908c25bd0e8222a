"""What identifies another format's files: :func:`files_identity`, which with their shard table makes the
cache's :attr:`~streampack.reader.Cache.content_digest`. That digest keys a stored plan of them
(``PATH/layouts/KEY/``), is the ``shards`` of a loader state's data fingerprint, and is what a DataLoader
worker checks when it opens them again (``streampack.samples.refs.reopen_unchanged``).

A native cache's manifest holds every shard file's CRC-32, so its shard table identifies its bytes. Another
format's files record no checksum, and their counts alone do not tell them apart: a nanoGPT ``train.bin``
written again with the same documents in another order has the same counts. Reading every token at every
open would cost what opening them in place saves (a Megatron pair opens without reading its ``.bin``), so:

* **What the files hold, never where or when they were written.** Per shard, a digest of its document ends
  (every open reads them anyway: from an index, or as the scan of a stream finds them), and per token or
  loss-mask file its size and its first and last :data:`BLOCK` bytes. Paths, modification times and inodes
  are left out on purpose: the same files copied to another machine, fetched from object storage or opened
  through another path have the same identity, so a loader state saved over them resumes over the copy and
  a copied folder keeps its plans. Files rewritten in place with other documents (or the same in another
  order) have other ends: their old plan is not used (a fresh one is made), a state saved over the old
  files is refused, and a worker that finds them changed since its parent opened them refuses to read.
* **What it does not see**: a rewrite that keeps every document's end and the first and last
  :data:`BLOCK` bytes of every file (documents of one length reordered except the first and last of each
  file, tokens replaced one for one inside). A plan stays right then (it is made of the ends alone); what
  a state resumes over is not checked. ``streampack convert`` makes a native cache, whose CRC-32s cover
  every byte.

Cost, measured on a 300 MB nanoGPT ``train.bin`` (286,077 documents; page cache warm, this 2-core machine):
its open takes 50 ms (the scan for its EOS ids), to which hashing its ends adds 1.3 ms and its blocks
0.03 ms. A CRC-32 of every token in the same scan would add 28 ms.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from streampack.errors import CacheError
from streampack.interop.files import LOCAL, ForeignFiles

__all__ = ["BLOCK", "ends_digest", "files_identity"]

#: Bytes read at each end of every token and loss-mask file for its identity: one page.
BLOCK = 4096

#: Files whose blocks are read at once from object storage (each read is a request).
_REMOTE_READS = 16


def ends_digest(ends: np.ndarray) -> bytes:
    """The digest of one shard's document ends (as little-endian uint64, whatever their dtype)."""
    return hashlib.sha256(np.ascontiguousarray(ends, dtype="<u8").data).digest()


def files_identity(ends: Iterable[bytes], sampled: Sequence[Path], files: ForeignFiles = LOCAL) -> str:
    """The identity of another format's files (see the module docstring): ``ends``, each shard's
    :func:`ends_digest`; ``sampled``, its token and loss-mask files, whose sizes and first and last
    :data:`BLOCK` bytes are read (``files`` says where from).

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

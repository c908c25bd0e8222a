"""Checking a file against the digests another format records of it (MDS's ``raw_data.hashes``), for
:func:`streampack.reader.verify.verify`.

An algorithm is named as mosaicml-streaming names it, one of :mod:`hashlib`'s or of the ``xxhash``
package's; the digest is the hex digest of the whole file, read once for every algorithm.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["CHUNK_BYTES", "check_file"]

CHUNK_BYTES = 8 << 20


def check_file(path: Path, recorded: Mapping[str, str], described: str) -> tuple[list[str], list[str], int]:
    """Read ``path`` once and compare its digests with ``recorded``.

    Args:
        described: the file as messages name it.

    Returns:
        The problems (a digest that differs, the file missing), the notes (an algorithm this process
        cannot compute, which is not checked) and the bytes read.
    """
    hashers: dict[str, Any] = {}
    notes = []
    for algo in recorded:
        hasher, why = _hasher(algo)
        if hasher is None:
            notes.append(f"{described}: its {algo} digest is recorded but not checked ({why})")
        else:
            hashers[algo] = hasher
    if not hashers:
        return [], notes, 0
    read = 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                read += len(chunk)
                for hasher in hashers.values():
                    hasher.update(chunk)
    except OSError as e:
        return [f"{described}: cannot read it to check its recorded digests ({e.strerror or e})"], notes, read
    problems = [
        f"{described}: its {algo} digest is {hasher.hexdigest()}, but {recorded[algo]} is recorded: the file "
        "changed or was damaged since it was written; write it again"
        for algo, hasher in hashers.items()
        if hasher.hexdigest() != recorded[algo]
    ]
    return problems, notes, read


def _hasher(algo: str) -> tuple[Any, str]:
    """A new hasher of ``algo`` (hashlib's, else xxhash's), or None and why there is none here."""
    if algo in hashlib.algorithms_available and not algo.startswith("shake_"):
        return hashlib.new(algo), ""
    if algo.startswith("xxh"):
        try:
            import xxhash
        except ImportError:
            return None, "install xxhash to check it: pip install xxhash"
        if algo in xxhash.algorithms_available:
            return getattr(xxhash, algo)(), ""
    return None, "an algorithm neither hashlib nor xxhash offers"

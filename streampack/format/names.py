"""The names of a cache's files and the small rules every file follows: keys, directory and shard names,
the token dtype rule, and checksum text (docs/FORMAT.md).
"""

from __future__ import annotations

import importlib
import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from streampack.errors import CacheError

MANIFEST = "manifest.json"
LEDGER_DIR = "ledger"
SHARD_DIR = "shards"
LAYOUT_DIR = "layouts"  # sample plans derived from the shards (streampack.samples.packing); safe to delete
LOCK = "build.lock"
OFFSET_DTYPE = np.dtype("<u8")
_SHARD_NAME = re.compile(r"^[0-9]{6}$")


def token_dtype(vocab_size: int) -> np.dtype:
    """Return the smallest little-endian unsigned dtype that holds ids ``0 .. vocab_size - 1``."""
    if vocab_size <= 1 << 16:
        return np.dtype("<u2")
    if vocab_size <= 1 << 32:
        return np.dtype("<u4")
    raise CacheError(f"vocab size {vocab_size} does not fit in uint32")


def dtype_name(dtype: np.dtype) -> str:
    """Return the manifest name of a token dtype (``uint16`` or ``uint32``)."""
    return np.dtype(dtype).name


def shard_name(unit_index: int) -> str:
    """Return the file stem of the shard written by work unit ``unit_index``."""
    return f"{unit_index:06d}"


def tokens_key(name: str) -> str:
    """Store key of a shard's token file."""
    return f"{SHARD_DIR}/{name}.tokens"


def offsets_key(name: str) -> str:
    """Store key of a shard's offsets file."""
    return f"{SHARD_DIR}/{name}.offsets"


def mask_key(name: str) -> str:
    """Store key of a shard's loss mask file (SFT builds only)."""
    return f"{SHARD_DIR}/{name}.mask"


def ledger_key(name: str) -> str:
    """Store key of the ledger entry of shard ``name``."""
    return f"{LEDGER_DIR}/{name}.json"


def tokens_path(root: Path, name: str) -> Path:
    """Path of a shard's token file."""
    return root / tokens_key(name)


def offsets_path(root: Path, name: str) -> Path:
    """Path of a shard's offsets file."""
    return root / offsets_key(name)


def mask_path(root: Path, name: str) -> Path:
    """Path of a shard's loss mask file (SFT builds only)."""
    return root / mask_key(name)


def checked_shard_name(name: object) -> str:
    """Validate a shard name read from a manifest or ledger; a name is six digits, never a path."""
    if not isinstance(name, str) or not _SHARD_NAME.match(name):
        raise CacheError(f"invalid shard name {name!r} in the manifest: expected six digits like '000042'")
    return name


#: ``crc32(data, value=0)``: the CRC-32 of zlib (IEEE 802.3) of a bytes-like ``data``, continuing ``value``:
#: ISA-L's where ``isal`` is installed (about ten times zlib's 3 GB/s on x86_64), else zlib's.
crc32: Callable[..., int]
try:
    crc32 = importlib.import_module("isal.isal_zlib").crc32
except ImportError:
    crc32 = zlib.crc32


def checksum_text(crc: int) -> str:
    """A CRC-32 as the manifest writes it: ``crc32:xxxxxxxx``."""
    return f"crc32:{crc:08x}"


def content_checksum(doc: dict[str, Any]) -> str:
    """CRC-32 of a JSON object's canonical form (sorted keys, no whitespace), its ``checksum`` field left
    out: the checksum of a manifest, a ledger entry and a ``plan.json``, whatever the file's layout."""
    content = {key: value for key, value in doc.items() if key != "checksum"}
    return checksum_text(zlib.crc32(orjson.dumps(content, option=orjson.OPT_SORT_KEYS)))


manifest_checksum = content_checksum


def with_checksum(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with its ``checksum`` field set (see :func:`content_checksum`)."""
    return {**doc, "checksum": content_checksum(doc)}

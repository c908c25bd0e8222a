"""Reading and writing a cache's JSON files through a store: the manifest and the ledger's entries.

What they hold is the format's (:mod:`streampack.format`); this module moves their bytes. Every function
takes the cache's directory (a :class:`~pathlib.Path`) or its store.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from streampack.errors import CacheError
from streampack.format.ledger import LedgerEntry, parse_entry
from streampack.format.manifest import FORMAT_VERSION, Manifest, parse_manifest
from streampack.format.names import LOCK, MANIFEST, checksum_text, ledger_key, with_checksum
from streampack.store import LocalStore, Store, crc32_file, encode_json

__all__ = [
    "commit_entry",
    "file_checksum",
    "load_manifest",
    "read_entry",
    "upgrade_manifest",
    "write_manifest",
]


def write_manifest(root: Path | Store, manifest: Manifest) -> None:
    """Atomically replace the cache's ``manifest.json`` (``root`` is its directory or its store)."""
    store = _store(root)
    store.put_atomic(MANIFEST, encode_json(with_checksum(manifest.to_json())))


def load_manifest(root: Path | Store) -> Manifest:
    """Read and validate the cache's ``manifest.json`` (``root`` is its directory or its store).

    Raises:
        CacheError: the manifest is missing, malformed, from another format version, or inconsistent.
    """
    store = _store(root)
    path = store.describe(MANIFEST)
    if isinstance(store, LocalStore) and not store.root.is_dir():
        raise CacheError(f"{store.root}: no such cache directory")
    raw = store.read_json(MANIFEST, what="manifest")
    return parse_manifest(raw, path)


def upgrade_manifest(root: str | os.PathLike[str]) -> int:
    """Rewrite a cache's manifest in the current format version, its content unchanged; return the version
    it had. Nothing else is touched, and checkpoints and plans of the cache keep working.

    A version 1 manifest holds its shard table as rows, which open ~20x slower at 10^5 shards
    (``benchmarks/bench_open.py``).

    Raises:
        CacheError: not a cache, or its manifest is damaged.
        BuildLockedError: a build holds the cache's lock.
    """
    store = LocalStore(root)
    if not store.root.is_dir() or not store.exists(MANIFEST):
        raise CacheError(f"{store.root}: not a streampack cache (no {MANIFEST})")
    with store.lock(LOCK):
        raw = store.read_json(MANIFEST, what="manifest")
        version = raw.get("format_version") if isinstance(raw, dict) else None
        manifest = load_manifest(store)  # validates it, whatever its version
        if version != FORMAT_VERSION:
            write_manifest(store, manifest)
    return int(version)  # type: ignore[arg-type]


def read_entry(root: Path | Store, name: str, unit: str) -> LedgerEntry:
    """The committed progress of a unit, or a fresh one if it has not committed yet.

    Args:
        root: the cache directory, or its store.
        name: the unit's shard name.
        unit: the unit's description, which the entry must hold.

    Raises:
        CacheError: the entry is malformed or belongs to a different work unit.
    """
    store = _store(root)
    key = ledger_key(name)
    if not store.exists(key):
        return LedgerEntry(unit=unit)
    raw = store.read_json(key, what="ledger entry")
    path = store.describe(key)
    progress = parse_entry(raw, path)
    if progress.unit != unit:
        raise CacheError(
            f"{path}: ledger entry is for work unit {progress.unit!r}, but this build's unit {name} is "
            f"{unit!r}; the inputs changed since the ledger was written: rerun with overwrite=True"
        )
    return progress


def commit_entry(root: Path | Store, name: str, progress: LedgerEntry) -> None:
    """Atomically and durably replace the ledger entry of shard ``name`` (with its ``checksum``)."""
    _store(root).put_atomic(ledger_key(name), encode_json(with_checksum(msgspec.structs.asdict(progress))))


def file_checksum(path: Path, length: int | None = None) -> str:
    """CRC-32 of the first ``length`` bytes of a file (all of it by default), as ``crc32:xxxxxxxx``.

    It detects damage at memory speed; it is no defence against tampering (the reader never trusts paths
    or sizes from the manifest instead).
    """
    return checksum_text(crc32_file(path, length))


def _store(root: Path | Store) -> Store:
    return LocalStore(root) if isinstance(root, Path) else root

"""The output directory of a local build: prepared, overwritten, or checked to hold the same build."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from streampack.errors import CacheError, ConfigMismatchError, StreampackError
from streampack.format.identity import build_identity
from streampack.format.manifest import Manifest
from streampack.format.names import LAYOUT_DIR, LEDGER_DIR, LOCK, MANIFEST, SHARD_DIR
from streampack.format.sections import InputRecord
from streampack.store import LocalStore
from streampack.store.files import load_manifest


def prepare_directory(store: LocalStore, overwrite: bool) -> None:
    """Create the cache's folders; with ``overwrite``, first delete the cache that is there."""
    root = store.root
    try:
        if overwrite:
            _delete_cache(store)
        elif not store.exists(MANIFEST) and any(n.endswith(".json") for n in store.list(LEDGER_DIR)):
            raise CacheError(
                f"{root}/{LEDGER_DIR} holds build progress but there is no manifest (an overwrite was "
                "interrupted?); rerun with overwrite=True"
            )
        store.makedirs(LEDGER_DIR)
        store.makedirs(SHARD_DIR)
    except PermissionError as e:
        raise StreampackError(
            f"cannot write to {root}: {e.strerror}; choose a writable output directory"
        ) from None


_CACHE_ENTRIES = {MANIFEST, f"{MANIFEST}.tmp", LEDGER_DIR, SHARD_DIR, LAYOUT_DIR, LOCK}


def _delete_cache(store: LocalStore) -> None:
    """Delete a cache, refusing a directory that holds anything else; the manifest goes last."""
    strangers = [name for name in store.list("") if name not in _CACHE_ENTRIES]
    if strangers:
        raise StreampackError(
            f"refusing to overwrite {store.root}: it holds files that are not part of a streampack cache "
            f"({', '.join(strangers[:3])}); choose an empty or new output directory"
        )
    if store.exists(MANIFEST):
        load_manifest(store)  # raises unless it is a streampack manifest
    for sub in (LEDGER_DIR, SHARD_DIR, LAYOUT_DIR):
        store.delete(sub)
    store.delete(MANIFEST)


def check_same_build(root: Path | str, existing: Manifest, new: Manifest) -> None:
    """Refuse to resume or reuse ``existing`` for a build of other settings or inputs (``new``).

    Raises:
        ConfigMismatchError: naming what differs, and what to do.
    """
    old_config, new_config = build_identity(existing), build_identity(new)
    differences = [
        f"{key}: the cache has {old_config.get(key)}, this build has {new_config.get(key)}"
        for key in sorted(old_config.keys() | new_config.keys())
        if old_config.get(key) != new_config.get(key)
    ]
    if differences:
        raise ConfigMismatchError(
            f"{root} holds a cache built with other settings ({'; '.join(differences)}); use another output "
            "directory, or overwrite=True to start over"
        )
    python = [i for i in new.inputs if i.python]
    unidentified = [i.path for i in python if not i.fingerprint]
    if unidentified:
        raise ConfigMismatchError(
            f"{root} holds a cache built from Python objects ({unidentified[0]}), and streampack cannot tell "
            "whether they still hold the same documents: pass overwrite=True to rebuild it from the current "
            "ones, or give the documents an identity that changes with them, "
            "Documents(items, fingerprint='...'), to resume or reuse the cache"
        )
    changed = _changed_inputs(existing.inputs, new.inputs)
    if changed:
        raise ConfigMismatchError(
            f"{root}: the inputs changed since the ledger was written ({changed}); rerun with overwrite=True "
            "to rebuild from the current inputs"
        )


def _changed_inputs(old: Sequence[InputRecord], new: Sequence[InputRecord]) -> str:
    old_paths, new_paths = [i.path for i in old], [i.path for i in new]
    if old_paths != new_paths:
        return (
            f"the cache was built from {len(old_paths)} inputs starting {old_paths[:2]}, not {new_paths[:2]}"
        )
    for old_input, new_input in zip(old, new):
        before, now = old_input.to_json(), new_input.to_json()
        changed = [
            f"{key} {before.get(key)} -> {now.get(key)}"
            for key in sorted(before | now)
            if before.get(key) != now.get(key)
        ]
        if changed:
            return f"{new_input.path}: {', '.join(changed)}"
    return ""

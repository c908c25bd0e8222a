"""Where a build goes: a local directory, prepared, overwritten, or checked to hold the same build; or
object storage, published from a local staging directory unit by unit.

Object storage receives the incomplete manifest (naming no shard), then each finished unit's checked shard
files followed by its ledger entry, then the complete manifest: a reader never sees a manifest naming a
shard that is not all there. A killed build resumes against the remote ledger, which is the authority:
units up there are adopted as done, so the staging directory may be gone. Object stores cannot lock: the
staging directory's lock keeps apart the builds of one machine only.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Collection, Sequence
from pathlib import Path

from streampack.errors import CacheError, ConfigMismatchError, StreampackError
from streampack.format.ledger import LedgerEntry
from streampack.format.manifest import Manifest, build_identity
from streampack.format.names import (
    LAYOUT_DIR,
    LEDGER_DIR,
    LOCK,
    MANIFEST,
    SHARD_DIR,
    checksum_text,
    ledger_key,
    mask_key,
    offsets_key,
    tokens_key,
)
from streampack.format.sections import InputRecord
from streampack.store import LocalStore
from streampack.store.files import commit_entry, load_manifest, read_entry, write_manifest
from streampack.store.remote import RemoteStore

_CACHE_KEYS = (MANIFEST, LEDGER_DIR, SHARD_DIR, LAYOUT_DIR)


def prepare_directory(store: LocalStore, overwrite: bool) -> None:
    """Create the cache's folders; with ``overwrite``, first delete the cache that is there."""
    try:
        if overwrite:  # the manifest last
            _delete_cache(store, (*_CACHE_KEYS[1:], MANIFEST), also={f"{MANIFEST}.tmp", LOCK})
        else:
            _refuse_interrupted_overwrite(store)
        store.makedirs(LEDGER_DIR)
        store.makedirs(SHARD_DIR)
    except PermissionError as e:
        raise StreampackError(
            f"cannot write to {store.root}: {e.strerror}; choose a writable output directory"
        ) from None


def _delete_cache(store: LocalStore | RemoteStore, keys: Sequence[str], also: Collection[str] = ()) -> None:
    """Delete ``keys``, in order, refusing a place that holds anything but them and ``also``."""
    strangers = [name for name in store.list("") if name not in {*keys, *also}]
    if strangers:
        raise CacheError(
            f"refusing to overwrite {store.describe('')}: it holds files that are not part of a streampack "
            f"cache ({', '.join(strangers[:3])}); choose an empty or new output directory or prefix"
        )
    if store.exists(MANIFEST):
        load_manifest(store)  # raises unless it is a streampack manifest
    for key in keys:
        store.delete(key)


def _refuse_interrupted_overwrite(store: LocalStore | RemoteStore) -> None:
    if not store.exists(MANIFEST) and any(name.endswith(".json") for name in store.list(LEDGER_DIR)):
        raise CacheError(
            f"{store.describe(LEDGER_DIR)} holds build progress but there is no manifest (an overwrite was "
            "interrupted?); rerun with overwrite=True"
        )


def default_staging_dir(url: str) -> Path:
    """The staging directory of a build to ``url`` when none is given: one per URL, in the temp dir."""
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "streampack-stage" / digest


class Publisher:
    """Publishes a build made in the staging directory ``staging`` (whose lock the build holds) to ``remote``;
    ``units``: every work unit's description, by shard name."""

    def __init__(self, remote: RemoteStore, staging: LocalStore, units: dict[str, str]) -> None:
        self.remote = remote
        self.staging = staging
        self.units = units
        self.up: set[str] = set()  # the units whose shard and ledger entry are up

    def begin(self, manifest: Manifest, *, overwrite: bool) -> Manifest | None:
        """Reconcile the staging directory with the remote cache before the build runs.

        Returns:
            The remote cache's manifest when it is already complete (nothing to do), else None.

        Raises:
            ConfigMismatchError: the remote cache was built with other settings or inputs.
            CacheError: the remote prefix holds build progress but no manifest, or non-cache objects
                that ``overwrite`` would delete.
        """
        if overwrite:
            _delete_cache(self.remote, _CACHE_KEYS)  # the manifest first
        _refuse_interrupted_overwrite(self.remote)
        existing = load_manifest(self.remote) if self.remote.exists(MANIFEST) else None
        if existing is not None:
            check_same_build(self.remote.url, existing, manifest)
            if existing.complete:
                return existing
        if overwrite or existing is None or not self._staging_matches(manifest):
            for key in _CACHE_KEYS:  # its lock stays: the build holds it
                self.staging.delete(key)
        self.staging.makedirs(LEDGER_DIR)
        self.staging.makedirs(SHARD_DIR)
        write_manifest(self.remote, manifest)
        self._adopt_remote_ledger()
        for name in sorted(set(self.units) - self.up):
            self._upload_from_staging(name)
        return None

    def unit_done(self, name: str) -> None:
        """Upload a unit that just finished: its checked shard files, then its ledger entry."""
        self._upload(name, read_entry(self.staging, name, self.units[name]))

    def finish(self) -> None:
        """Publish the staging directory's complete manifest, once every unit is up.

        Raises:
            CacheError: a unit is not up (a bug: every finished unit is uploaded as it finishes).
        """
        missing = sorted(set(self.units) - self.up)
        if missing:
            raise CacheError(
                f"{self.remote.url}: units {missing[:3]} are not uploaded; rerun the same command to resume"
            )
        self.remote.put_atomic(MANIFEST, self.staging.read(MANIFEST))

    def _staging_matches(self, manifest: Manifest) -> bool:
        if not self.staging.exists(MANIFEST):
            return False
        try:
            check_same_build(str(self.staging.root), load_manifest(self.staging), manifest)
        except StreampackError:
            return False
        return True

    def _adopt_remote_ledger(self) -> None:
        """Adopt every unit whose ledger entry is up as done, copying the entry into the staging directory."""
        entries = set(self.remote.list(LEDGER_DIR))
        for name, unit in self.units.items():
            if f"{name}.json" not in entries:
                continue
            progress = read_entry(self.remote, name, unit)
            if progress.done:
                commit_entry(self.staging, name, progress)
                self.up.add(name)

    def _upload_from_staging(self, name: str) -> None:
        """Upload a unit the staging directory holds finished; a damaged one is deleted, to be built again."""
        progress = read_entry(self.staging, name, self.units[name])
        if not progress.done:
            return
        try:
            self._upload(name, progress)
        except (FileNotFoundError, _StagingDamage):
            for key in (ledger_key(name), tokens_key(name), offsets_key(name), mask_key(name)):
                self.staging.delete(key)

    def _upload(self, name: str, progress: LedgerEntry) -> None:
        files = [(tokens_key(name), progress.tokens_checksum), (offsets_key(name), progress.offsets_checksum)]
        if progress.mask_checksum:
            files.append((mask_key(name), progress.mask_checksum))
        for key, expected in files:
            actual = checksum_text(self.staging.crc32(key))
            if actual != expected:
                raise _StagingDamage(
                    f"{self.staging.describe(key)}: the staging directory's file has checksum {actual}, its "
                    f"ledger entry says {expected}: it was damaged after it was written; delete the staging "
                    f"directory {self.staging.root} and rerun the same command"
                )
        for key, _ in files:
            self.remote.put_file(key, str(self.staging.path(key)))
        self.remote.put_atomic(ledger_key(name), self.staging.read(ledger_key(name)))
        self.up.add(name)


class _StagingDamage(CacheError):
    """A shard file in the staging directory differs from its ledger entry's checksum."""


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

"""Full verification of a cache: every file of its directory, or every object under its URL.

It checks the manifest's checksum, each shard's files (:mod:`streampack.reader.shardchecks`), the ledger
(one sound entry per unit, saying what the manifest says) and the plans under ``layouts/``; anything else
is listed as unknown. Every byte is read once, in chunks, so memory stays bounded. A cache in object
storage is streamed from its objects with ranged reads, never from a reader's local copy, which may hold
the good bytes of an object damaged since; another format's files there are fetched into a local copy of
the verify's own.
"""

from __future__ import annotations

import importlib
import os
import re
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streampack.errors import CacheError, StreampackError
from streampack.format.manifest import Manifest
from streampack.format.names import LAYOUT_DIR, LEDGER_DIR, LOCK, MANIFEST, SHARD_DIR, ledger_key, shard_name
from streampack.reader.cache import Cache
from streampack.reader.filehashes import check_file
from streampack.reader.opening import open as open_cache
from streampack.reader.shardchecks import Mapped, Streamed, check_shards
from streampack.store import is_remote
from streampack.store.files import load_manifest, read_entry
from streampack.store.plans import PLAN_ARRAYS, PLAN_JSON, inspect_plan
from streampack.store.remote import RemoteStore

__all__ = ["VerifyReport", "verify"]


@dataclass
class VerifyReport:
    """The outcome of :func:`verify`: ``problems`` is empty for a sound cache.

    Attributes:
        path: the cache directory, or the URL of a cache in object storage.
        problems: each damage found, naming its file (or object).
        notes: what is there but not checked (unknown entries, leftovers of an interrupted write); none
            is a problem.
        bytes_checked: bytes read and checked.
        seconds: how long it took.
    """

    path: Path | str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    bytes_checked: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems


_PLAN_NAME = re.compile(r"^(packed|documents)-[0-9]+-[0-9a-f]{16}$")
_PLAN_FILES = frozenset({PLAN_JSON, *(f"{name}.bin" for name in PLAN_ARRAYS)})


def verify(
    path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None, **declared: Any
) -> VerifyReport:
    """Check everything about a cache; return a report listing each problem precisely.

    Another format's token files get the checks they allow: what their format records (checked at the
    open; a note says what), every token against the vocabulary size and the EOS and BOS that
    ``declared`` gives, and a loss mask's values. They record no checksums.

    Args:
        path: a cache directory, or the URL of a cache in object storage (``s3://bucket/prefix``), whose
            objects are read (streamed through the checks, nothing kept); or another format's files.
        storage_options: (object storage) passed to the fsspec filesystem.
        **declared: (other formats) what :func:`streampack.open` takes about them: ``eos_id``,
            ``bos_id``, ``vocab_size``, ``format``, ``dtype``, ``tokenizer``.
    """
    started = time.perf_counter()
    if is_remote(path):
        report = VerifyReport(str(path).rstrip("/"))
        try:
            remote = RemoteStore(str(path), storage_options)
            if declared.get("format") is None and remote.exists(MANIFEST):
                _verify_remote(remote, report)
            else:
                _verify_remote_foreign(str(path), storage_options, declared, report)
        except StreampackError as e:
            report.problems.append(str(e))
    else:
        report = VerifyReport(Path(path))
        _verify_local(Path(path), report, declared)
    report.seconds = time.perf_counter() - started
    return report


# ------------------------------------------------------------------------------------- the two walks


def _verify_local(root: Path, report: VerifyReport, declared: Mapping[str, Any]) -> None:
    try:
        cache = open_cache(root, **declared)
    except StreampackError as e:
        report.problems.append(str(e))
        return
    source = Mapped(cache)
    if cache.declared is not None:
        _verify_foreign(cache, source, report)
        return
    expected = _shard_files(cache.manifest)
    report.problems.extend(check_shards(cache.manifest, source))
    report.bytes_checked += source.read
    _note_unknown(report, root / SHARD_DIR, _entries(root / SHARD_DIR), expected)
    _check_ledger(cache.manifest, cache.store, _entries(root / LEDGER_DIR), report)
    layouts = root / LAYOUT_DIR
    if layouts.is_dir() and not layouts.is_symlink():
        _check_layouts(cache, layouts, report)
    known = {MANIFEST, SHARD_DIR, LEDGER_DIR, LAYOUT_DIR, LOCK}
    _note_unknown(report, root, _entries(root), known)


def _verify_foreign(cache: Cache, source: Mapped, report: VerifyReport) -> None:
    """Every token of another format's files, and the digests it records of them; entries of its folder
    it does not read are listed."""
    format = (cache.declared or {})["format"]  # a foreign cache is opened with its format
    report.problems.extend(check_shards(cache.manifest, source, checksums=False))
    report.bytes_checked += source.read
    hashed = 0
    for shard in range(cache.num_shards):
        recorded = cache.files.hashes(shard)
        if recorded:
            path = cache.files.paths(shard)[0]
            problems, notes, read = check_file(path, recorded, cache.files.describe(shard, "tokens"))
            report.problems.extend(problems)
            report.notes.extend(notes)
            report.bytes_checked += read
            hashed += 1
    from streampack.reader.foreign.opening import READERS

    reader = importlib.import_module(READERS[format])  # its OPENED_CHECKS say what reading it checked
    checked = reader.OPENED_CHECKS
    if hashed:
        algos = sorted({a for s in range(cache.num_shards) for a in cache.files.hashes(s)})
        report.notes.append(
            f"{format} files: {checked}, and {hashed} of {cache.num_shards} shard files against the "
            f"{', '.join(algos)} digests recorded of them"
        )
    else:
        report.notes.append(
            f"{format} files: {checked}; no digest of them is recorded (MDSWriter records them when given "
            "hashes=[...]; `streampack convert` makes a cache with a checksum of every file)"
            if format == "mds"
            else f"{format} files: {checked}; they record no checksums (convert them with `streampack "
            "convert` for a cache that has)"
        )
    # Note the entries of its folder it is not read from: what the format writes there, or unknown.
    companion = getattr(reader, "companion", None)
    root = Path(cache.root)
    if not root.is_dir():
        return  # a Megatron prefix: the folder holds other files than the pair by design
    inputs = [Path(entry.path).resolve() for entry in cache.manifest.inputs]
    names_read = {path.name for path in inputs if path.parent == root.resolve()}
    for name in sorted(_entries(root) - names_read - {LAYOUT_DIR}):
        known = None if companion is None else companion(root / name)
        report.notes.append(
            f"{root / name}: {known}"
            if known is not None
            else f"{root / name}: not one of the {format} files this cache is read from, so not part of it "
            "and not checked; move it out of the folder if it does not belong there"
        )


def _verify_remote_foreign(
    url: str, storage_options: Mapping[str, Any] | None, declared: Mapping[str, Any], report: VerifyReport
) -> None:
    """Another format's files in object storage, fetched into a local copy of this verify's own."""
    with (
        tempfile.TemporaryDirectory(prefix="streampack-verify-") as copy,
        open_cache(url, storage_options=storage_options, local_dir=copy, **declared) as cache,
    ):
        _verify_foreign(cache, Mapped(cache), report)


def _verify_remote(remote: RemoteStore, report: VerifyReport) -> None:
    manifest = load_manifest(remote)
    if not manifest.complete:
        raise CacheError(
            f"{remote.url}: the build of this cache has not finished; rerun the same build command to "
            "complete it"
        )
    source = Streamed(remote, remote.list_sizes(SHARD_DIR))
    report.problems.extend(check_shards(manifest, source))
    report.bytes_checked += source.read
    _note_unknown(report, remote.describe(SHARD_DIR), set(source.sizes), _shard_files(manifest))
    _check_ledger(manifest, remote, set(remote.list(LEDGER_DIR)), report)
    known = {MANIFEST, SHARD_DIR, LEDGER_DIR}
    _note_unknown(report, remote.url, set(remote.list("")), known)


def _entries(folder: Path) -> set[str]:
    try:
        return set(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return set()


def _shard_files(manifest: Manifest) -> set[str]:
    names = set()
    for shard in range(len(manifest.table)):
        name = shard_name(shard)
        names |= {f"{name}.tokens", f"{name}.offsets"} | ({f"{name}.mask"} if manifest.loss_mask else set())
    return names


def _note_unknown(report: VerifyReport, where: Path | str, listed: set[str], known: set[str]) -> None:
    """Note the entries of a folder that the format does not name."""
    for name in sorted(listed - known):
        if name.endswith(".tmp"):
            what = "a file being written, or left by an interrupted write; safe to delete when no build runs"
        else:
            what = "unknown to the cache format, not checked"
        report.notes.append(f"{where}/{name}: {what}")


# ------------------------------------------------------------------------------------------ the ledger


def _check_ledger(manifest: Manifest, store: Any, listed: set[str], report: VerifyReport) -> None:
    """One entry per unit, sound (its checksum), finished, and recording the manifest's counts."""
    names = {f"{shard_name(i)}.json" for i in range(len(manifest.units))}
    _note_unknown(report, store.describe(LEDGER_DIR), listed, names)
    table = manifest.table
    skipped = 0
    before = len(report.problems)
    for index, unit in enumerate(manifest.units):
        name = shard_name(index)
        where = store.describe(ledger_key(name))
        if f"{name}.json" not in listed:
            report.problems.append(f"{where}: the ledger entry of work unit {index} is missing")
            continue
        try:
            entry = read_entry(store, name, unit)
        except CacheError as e:
            report.problems.append(str(e))
            continue
        # Its checksums are the manifest's, unless the manifest was rewritten since (a test's forgery, a
        # repair): what the files hold is checked against the manifest, which readers trust.
        recorded = (entry.done, entry.docs, entry.tokens)
        wanted = (True, int(table.num_docs[index]), int(table.num_tokens[index]))
        if recorded != wanted:
            report.problems.append(
                f"{where}: the ledger entry says (done, docs, tokens) {recorded}, the manifest {wanted}"
            )
        skipped += entry.skipped
    # (Caches written before empty_docs and inexact_cuts existed have them in neither file, or in one.)
    if len(report.problems) == before and skipped != manifest.skipped_records:
        report.problems.append(
            f"{store.describe(LEDGER_DIR)}: the entries skipped {skipped} records in all, the manifest says "
            f"{manifest.skipped_records}"
        )


# ------------------------------------------------------------------------------------------ the plans


def _check_layouts(cache: Cache, layouts: Path, report: VerifyReport) -> None:
    """Every plan under ``layouts/``; leftovers of planning noted, anything else unknown."""
    for name in sorted(_entries(layouts)):
        path = layouts / name
        if name.startswith((".planning-", ".damaged-")):
            report.notes.append(f"{path}: a plan being written, or left by a killed process; safe to delete")
        elif _PLAN_NAME.match(name) and path.is_dir() and not path.is_symlink():
            problems, checked, note = inspect_plan(path, cache.table.num_tokens, cache.content_digest)
            report.problems.extend(
                f"{p}; the plan is derived from the shards: delete {path} and it is made again at its next "
                "use"
                for p in problems
            )
            report.bytes_checked += checked
            if note:
                report.notes.append(note)
            _note_unknown(report, path, _entries(path), set(_PLAN_FILES))
        else:
            report.notes.append(f"{path}: unknown to the cache format, not checked")

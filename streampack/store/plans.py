"""The files of a stored plan (``CACHE/layouts/KEY/``): writing them, and checking them before use.

A plan (:mod:`streampack.samples.packing`) decides which tokens every sample holds, for every rank and
later run. ``plan.json`` records what it is of (the cache's content digest, ``seq_len``, the planner's
settings: hence ``KEY``), each array file's size and CRC-32, and its own checksum. A process checks a plan
when it first maps it (the JSON, each file, its structure against the cache) and remembers the files'
identities (device, inode, size, mtime), so DataLoader workers map a checked plan without reading it.

A plan is derived data: one that fails a check is planned again where the cache is writable, and refused
where it is not. One that cannot be written is kept in memory: silently in a read-only cache, with a
``RuntimeWarning`` otherwise (a full disk).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import msgspec
import numpy as np

from streampack.errors import CacheError, read_json
from streampack.format.names import checksum_text, content_checksum, crc32, with_checksum
from streampack.store import LocalStore

__all__ = ["PLAN_ARRAYS", "PlanIdentity", "StoredPlan", "inspect_plan", "load_plan", "plan_key", "stored"]

PLAN_FORMAT = "streampack-plan"
PLAN_VERSION = 2  # a version 1 plan.json has no checksum: it fails the check and is planned again
PLAN_JSON = "plan.json"
PLAN_ARRAYS = {"starts": np.int64, "shards": np.int64, "lo": np.int64, "lengths": np.int32}
_CHUNK_ITEMS = 4 << 20
# Why a plan is not stored in a read-only cache, or in one without a folder for it (a Megatron pair's
# prefix, a file named layouts): expected, so kept in memory without a warning.
_READ_ONLY = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR, errno.EEXIST})
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_Count = Annotated[int, msgspec.Meta(ge=0)]

# Plans this process has checked: directory -> (plan.json's checksum, the identities of its files).
_checked: dict[str, tuple[str, tuple[tuple[int, ...], ...]]] = {}
_checked_lock = threading.Lock()


@dataclass(frozen=True)
class PlanIdentity:
    """What a plan is of: the cache's content digest, the sample length and the planner's settings."""

    content: str
    seq_len: int
    settings: dict[str, int | str]

    @property
    def key(self) -> str:
        """The plan's folder name under ``CACHE/layouts/``."""
        return plan_key(self.content, self.seq_len, self.settings)


def plan_key(content: str, seq_len: int, settings: dict[str, int | str]) -> str:
    """``LAYOUT-SEQLEN-DIGEST``: the digest covers the cache's content and every setting of the plan."""
    text = json.dumps([content, seq_len, settings], sort_keys=True)
    return f"{settings['layout']}-{seq_len}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


@dataclass
class StoredPlan:
    """A plan's arrays, with where they are mapped from.

    Attributes:
        arrays: ``starts``, ``shards``, ``lo``, ``lengths`` (read-only, little-endian).
        directory: the folder they are mapped from; None when held in memory (a read-only cache).
        dropped: documents the plan left out.
        no_target: pieces without a target token (counted; left out with ``no_target="drop"``).
        checksum: ``plan.json``'s checksum ("" in memory): what a copy in another process must find.
        identities: the checked files' identities, for that copy to map them without checking again.
    """

    arrays: dict[str, np.ndarray]
    directory: Path | None
    dropped: int
    no_target: int
    checksum: str = ""
    identities: tuple[tuple[int, ...], ...] = field(default=())


class PlanDamage(CacheError):
    """A stored plan failed a check (the message names the file); it can be planned again."""


def stored(
    directory: Path,
    identity: PlanIdentity,
    tables: Callable[[], Iterator[dict[str, np.ndarray]]],
    left_out: Callable[[], dict[str, int]],
    shard_tokens: np.ndarray,
) -> StoredPlan:
    """The plan in ``directory``, checked; planned and written there first when absent or damaged (into a
    temporary folder renamed into place: two processes planning at once read one).

    Args:
        directory: ``CACHE/layouts/KEY``.
        identity: what the plan is of.
        tables: yields the arrays' parts in order (a chunk of documents at a time).
        left_out: the ``dropped`` and ``no_target`` counts, once ``tables`` is exhausted.
        shard_tokens: tokens per shard, for the structure check.

    Raises:
        CacheError: the stored plan is damaged and the cache is not writable.
    """
    damage: PlanDamage | None = None
    if os.path.lexists(directory):
        try:
            return _open(directory, identity, shard_tokens)
        except PlanDamage as e:
            damage = e
    try:
        directory.parent.mkdir(exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".planning-", dir=directory.parent))
    except OSError as e:
        return _unstored(directory, e, damage, tables, left_out)
    try:
        try:
            checksum = _write(scratch, identity, tables, left_out)
        except OSError as e:  # a full disk, a quota: nothing of the plan is left behind
            shutil.rmtree(scratch, ignore_errors=True)
            return _unstored(directory, e, damage, tables, left_out)
        if damage is not None:
            _move_away(directory)
        try:
            os.rename(scratch, directory)
        except OSError:
            pass  # another process placed the same plan first
        else:
            _remember(directory, checksum)  # written by this process: no need to read it back
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # nothing left once renamed into place
    return _open(directory, identity, shard_tokens)


def _unstored(
    directory: Path,
    error: OSError,
    damage: PlanDamage | None,
    tables: Callable[[], Iterator[dict[str, np.ndarray]]],
    left_out: Callable[[], dict[str, int]],
) -> StoredPlan:
    """The plan held in memory where it cannot be stored (a warning unless the cache is read-only); a
    damaged plan lying there is refused instead: the next run would read it."""
    reason, read_only, full = error.strerror or str(error), error.errno in _READ_ONLY, error.errno in _FULL
    if damage is not None:
        why = "The cache is not writable here" if read_only else f"Writing {directory.parent} failed"
        raise CacheError(
            f"{damage}. {why} ({reason}), so it cannot be planned again: delete {directory} (or all of "
            f"{directory.parent}) where you can write to the cache{', or free space' if full else ''}; a "
            "plan is derived from the shards and is made again at its next use"
        ) from None
    if not read_only:
        fix = "Free space there" if full else "Check that folder"
        warnings.warn(
            f"{directory.parent}: cannot store the plan {directory.name} there ({reason}); it is kept in "
            f"memory, and planned again by each process and run that needs it. {fix} to store it",
            RuntimeWarning,
            stacklevel=3,
        )
    arrays: dict[str, list[np.ndarray]] = {name: [] for name in PLAN_ARRAYS}
    for table in tables():
        for name, values in table.items():
            arrays[name].append(values)
    joined = {name: np.concatenate(parts).astype(PLAN_ARRAYS[name]) for name, parts in arrays.items()}
    counted = left_out()
    return StoredPlan(joined, None, counted["dropped"], counted["no_target"])


def load_plan(directory: Path, checksum: str, identities: tuple[tuple[int, ...], ...]) -> StoredPlan:
    """The plan ``checksum`` names in ``directory``, for a copy of its samples in another process; checked
    again unless ``identities`` shows the files checked already."""
    with _checked_lock:
        _checked.setdefault(str(directory), (checksum, identities))
    plan = _open(directory, None, None)
    if plan.checksum != checksum:
        raise CacheError(
            f"{directory / PLAN_JSON}: the plan changed since these samples were made (checksum "
            f"{plan.checksum}, they were made with {checksum}); make the samples again"
        )
    return plan


def inspect_plan(
    directory: Path, shard_tokens: np.ndarray | None, content: str
) -> tuple[list[str], int, str]:
    """Check every file of the stored plan in ``directory`` (for ``streampack verify``).

    Args:
        directory: ``CACHE/layouts/KEY``.
        shard_tokens: tokens per shard of the cache, for the structure check.
        content: the cache's content digest.

    Returns:
        The problems found (empty: sound), the bytes read, and a note ("" or why the plan is unused).
    """
    try:
        facts = _facts(directory, None)
    except PlanDamage as e:
        return [str(e)], 0, ""
    stale = facts.content != content
    note = f"{directory}: a plan of other shards (the cache changed since), never used; safe to delete"
    note = note if stale else ""
    try:
        plan = _check_files(directory, facts, None if stale else shard_tokens, recheck=True)
    except PlanDamage as e:
        return [str(e)], 0, note
    return [], sum(a.nbytes for a in plan.arrays.values()), note


def _open(directory: Path, identity: PlanIdentity | None, shard_tokens: np.ndarray | None) -> StoredPlan:
    """Map the plan in ``directory`` once its files pass the checks (see the module docstring)."""
    return _check_files(directory, _facts(directory, identity), shard_tokens, recheck=False)


class _File(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    count: _Count
    size: _Count
    crc32: str


class _Files(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    starts: _File = msgspec.field(name="starts.bin")
    shards: _File = msgspec.field(name="shards.bin")
    lo: _File = msgspec.field(name="lo.bin")
    lengths: _File = msgspec.field(name="lengths.bin")


class _Facts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What ``plan.json`` holds."""

    format: str
    version: int
    content: str
    seq_len: _Count
    settings: dict[str, int | str]
    dropped: _Count
    no_target: _Count
    files: _Files
    checksum: str


def _facts(directory: Path, identity: PlanIdentity | None) -> _Facts:
    """``plan.json``, checked: its checksum, its format, and (with ``identity``) that it is that plan."""
    path = directory / PLAN_JSON
    try:
        raw = LocalStore(directory).read_json(PLAN_JSON, what="plan")
    except CacheError as e:
        raise PlanDamage(f"{e}") from None
    if not isinstance(raw, dict):
        raise PlanDamage(f"{path}: the plan is not a JSON object")
    if raw.get("checksum") != content_checksum(raw):
        raise PlanDamage(
            f"{path}: the plan's content does not match its checksum (recorded {raw.get('checksum')!r:.40}, "
            f"content {content_checksum(raw)})"
        )
    if (raw.get("format"), raw.get("version")) != (PLAN_FORMAT, PLAN_VERSION):
        raise PlanDamage(
            f"{path}: not a version {PLAN_VERSION} {PLAN_FORMAT} "
            f"({raw.get('format')!r}, {raw.get('version')!r})"
        )
    facts = read_json(raw, _Facts, PlanDamage, f"{path}: malformed plan", "it is planned again")
    key = plan_key(facts.content, facts.seq_len, facts.settings)
    if key != directory.name:
        raise PlanDamage(f"{path}: the plan of {key}, not of {directory.name}")
    if identity is not None and key != identity.key:
        raise PlanDamage(f"{path}: the plan of other settings than {directory.name} names")
    return facts


def _check_files(
    directory: Path, facts: _Facts, shard_tokens: np.ndarray | None, *, recheck: bool
) -> StoredPlan:
    """Map each array file, checking its size, then (unless this process checked these very files) its
    CRC-32 and the plan's structure."""
    checksum = facts.checksum
    arrays, identities = {}, []
    for name, dtype in PLAN_ARRAYS.items():
        entry = getattr(facts.files, name)
        arrays[name], identity = _map(directory / f"{name}.bin", np.dtype(dtype).newbyteorder("<"), entry)
        identities.append(identity)
    with _checked_lock:
        known = _checked.get(str(directory))
    if recheck or known != (checksum, tuple(identities)):
        for name in PLAN_ARRAYS:
            expected = getattr(facts.files, name).crc32
            actual = checksum_text(crc32(arrays[name]))
            if actual != expected:
                raise PlanDamage(
                    f"{directory / f'{name}.bin'}: checksum {actual} does not match the plan's "
                    f"{expected!r:.40}"
                )
        _check_structure(directory, arrays, facts.seq_len, shard_tokens)
        with _checked_lock:
            _checked[str(directory)] = (checksum, tuple(identities))
    return StoredPlan(arrays, directory, facts.dropped, facts.no_target, checksum, tuple(identities))


def _map(path: Path, dtype: np.dtype, entry: _File) -> tuple[np.ndarray, tuple[int, ...]]:
    """A read-only array over ``path``, whose size must be what ``entry`` records; and its identity."""
    count = entry.count
    expected = count * dtype.itemsize
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise PlanDamage(f"{path}: cannot open the plan's file ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if st.st_size != expected or entry.size != expected:
            raise PlanDamage(
                f"{path}: {st.st_size} bytes, but the plan records {entry.size!r} ({count} items of "
                f"{dtype.itemsize} bytes)"
            )
        identity = _identity(st)
        if not expected:
            return np.zeros(0, dtype=dtype), identity
        # A plain ndarray over the map (which it keeps alive): slicing an np.memmap costs more.
        return np.frombuffer(mmap.mmap(fd, expected, access=mmap.ACCESS_READ), dtype=dtype), identity
    finally:
        os.close(fd)


def _check_structure(
    directory: Path, arrays: dict[str, np.ndarray], seq_len: int, shard_tokens: np.ndarray | None
) -> None:
    """Samples in order, each of 1+ pieces and at most ``seq_len`` tokens; every piece inside its shard."""
    starts, shards, lo, lengths = (arrays[name] for name in PLAN_ARRAYS)
    pieces = len(lo)
    if not (len(shards) == len(lengths) == pieces) or not len(starts):
        raise PlanDamage(f"{directory}: the plan's arrays disagree in length")
    if int(starts[0]) != 0 or int(starts[-1]) != pieces:
        raise PlanDamage(f"{directory / 'starts.bin'}: the samples do not cover the {pieces} pieces")
    for begin in range(0, len(starts) - 1, _CHUNK_ITEMS):
        part = np.asarray(starts[begin : begin + _CHUNK_ITEMS + 1], dtype=np.int64)
        if len(part) > 1 and int(np.diff(part).min()) < 1:
            at = begin + int(np.argmin(np.diff(part)))
            raise PlanDamage(
                f"{directory / 'starts.bin'}: sample {at} holds no piece, or the samples are out of order"
            )
        used = np.add.reduceat(np.asarray(lengths[part[0] : part[-1]], dtype=np.int64), part[:-1] - part[0])
        if len(used) and int(used.max()) > seq_len:
            at = begin + int(np.argmax(used))
            raise PlanDamage(
                f"{directory / 'lengths.bin'}: sample {at} holds {int(used.max())} tokens, over {seq_len}"
            )
    for begin in range(0, pieces, _CHUNK_ITEMS):
        end = begin + _CHUNK_ITEMS
        shard = np.asarray(shards[begin:end], dtype=np.int64)
        first = np.asarray(lo[begin:end], dtype=np.int64)
        length = np.asarray(lengths[begin:end], dtype=np.int64)
        if int(length.min()) < 1 or int(length.max()) > seq_len:
            raise PlanDamage(f"{directory / 'lengths.bin'}: a piece length out of [1, {seq_len}]")
        if int(first.min()) < 0:
            raise PlanDamage(f"{directory / 'lo.bin'}: a piece starts at a negative token")
        if shard_tokens is None:
            continue
        if int(shard.min()) < 0 or int(shard.max()) >= len(shard_tokens):
            raise PlanDamage(f"{directory / 'shards.bin'}: a shard out of the cache's {len(shard_tokens)}")
        over = np.flatnonzero(first + length > shard_tokens[shard])
        if len(over):
            at = int(over[0])
            end, inside = int(first[at] + length[at]), int(shard[at])
            raise PlanDamage(
                f"{directory / 'lo.bin'}: piece {begin + at} ends at token {end} of shard {inside}, which "
                f"holds {int(shard_tokens[inside])}"
            )


def _write(
    scratch: Path,
    identity: PlanIdentity,
    tables: Callable[[], Iterator[dict[str, np.ndarray]]],
    left_out: Callable[[], dict[str, int]],
) -> str:
    """Write the plan's files into ``scratch``, ``plan.json`` last; return its checksum."""
    counts = dict.fromkeys(PLAN_ARRAYS, 0)
    crcs = dict.fromkeys(PLAN_ARRAYS, 0)
    files = {name: open(scratch / f"{name}.bin", "wb") for name in PLAN_ARRAYS}  # noqa: SIM115
    try:
        for table in tables():
            for name, values in table.items():
                data = values.astype(np.dtype(PLAN_ARRAYS[name]).newbyteorder("<")).tobytes()
                files[name].write(data)
                crcs[name] = crc32(data, crcs[name])
                counts[name] += len(values)
    finally:
        for file in files.values():
            file.close()
    facts = with_checksum(
        {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "content": identity.content,
            "seq_len": identity.seq_len,
            "settings": identity.settings,
            **left_out(),
            "files": {
                f"{name}.bin": {
                    "count": counts[name],
                    "size": counts[name] * np.dtype(dtype).itemsize,
                    "crc32": checksum_text(crcs[name]),
                }
                for name, dtype in PLAN_ARRAYS.items()
            },
        }
    )
    (scratch / PLAN_JSON).write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n")
    return str(facts["checksum"])


def _remember(directory: Path, checksum: str) -> None:
    """Record the files this process just wrote as checked."""
    identities = tuple(_identity(os.stat(directory / f"{name}.bin")) for name in PLAN_ARRAYS)
    with _checked_lock:
        _checked[str(directory)] = (checksum, identities)


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _move_away(directory: Path) -> None:
    """Take a damaged plan out of the way (renamed, then deleted; readers that map it keep their maps)."""
    aside = Path(tempfile.mkdtemp(prefix=".damaged-", dir=directory.parent))
    with contextlib.suppress(FileNotFoundError):  # another process moved it first
        os.rename(directory, aside / "plan")
    shutil.rmtree(aside, ignore_errors=True)

"""Full verification of a cache: checksums, offsets, token range, EOS and BOS placement (at every
document's end and start, and nowhere else), and an SFT build's loss mask (0 or 1, 1 at every EOS, 0 at
every BOS).

:func:`streampack.open` checks file sizes on every open; :func:`verify` reads every byte once, in chunks,
checksumming and range-checking each chunk, so it runs in bounded memory at disk or checksum speed,
whichever is slower.
"""

from __future__ import annotations

import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from streampack.errors import CacheError, StreampackError
from streampack.format import checksum_text
from streampack.reader import Cache
from streampack.reader import open as open_cache

_CHUNK_ITEMS = 8 << 20
_SHOWN = 3  # control ids inside documents listed in the report, of a shard


@dataclass
class VerifyReport:
    """The outcome of :func:`verify`: ``problems`` is empty for a sound cache."""

    path: Path
    problems: list[str] = field(default_factory=list)
    bytes_checked: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    @property
    def gb_per_second(self) -> float:
        """Verification speed."""
        return self.bytes_checked / 1e9 / self.seconds if self.seconds else 0.0


def verify(path: str | os.PathLike[str]) -> VerifyReport:
    """Check everything about a cache; return a report listing each problem precisely."""
    report = VerifyReport(Path(path))
    started = time.perf_counter()
    try:
        cache = open_cache(path)
    except StreampackError as e:
        report.problems.append(str(e))
        return report
    for shard in range(cache.num_shards):
        report.problems.extend(_check_shard(cache, shard, report))
    report.seconds = time.perf_counter() - started
    return report


def _check_shard(cache: Cache, shard: int, report: VerifyReport) -> list[str]:
    info = cache.shard_info(shard)
    tokens_file, offsets_file = cache.shard_paths(shard)
    try:
        offsets = cache.shard_offsets(shard)
        tokens = cache.shard_tokens(shard)
    except (CacheError, ValueError, OSError) as e:
        return [f"{tokens_file}: cannot map ({e})"]
    offsets_crc, _, _ = _scan(offsets, None)
    problems = _check_offsets(offsets_file, offsets, info.num_tokens)
    controls = [] if problems else _stray_controls(cache)
    tokens_crc, first_too_large, strays = _scan(tokens, cache.vocab_size, controls, offsets)  # one pass
    report.bytes_checked += tokens.nbytes + offsets.nbytes
    problems[:0] = [
        f"{path}: checksum {actual} does not match the manifest's {expected}"
        for path, actual, expected in (
            (tokens_file, tokens_crc, info.tokens_checksum),
            (offsets_file, offsets_crc, info.offsets_checksum),
        )
        if actual != expected
    ]
    if first_too_large is not None:
        problems.append(
            f"{tokens_file}: token {first_too_large} is {int(tokens[first_too_large])}, not below the vocab "
            f"size {cache.vocab_size}"
        )
    if not problems and len(offsets):
        problems.extend(_check_ends_and_starts(cache, shard, tokens, offsets))
    problems.extend(_stray_problem(cache, shard, found) for found in strays if found.count)
    if cache.has_loss_mask:
        problems.extend(_check_mask(cache, shard, offsets, report, check_places=not problems))
    return problems


def _check_mask(
    cache: Cache, shard: int, offsets: np.ndarray, report: VerifyReport, *, check_places: bool
) -> list[str]:
    """The loss mask's checksum and values; with ``check_places``, that each EOS is a target and each BOS
    is not."""
    path = cache.shard_mask_path(shard)
    try:
        mask = cache.shard_loss_mask(shard)
    except (CacheError, ValueError, OSError) as e:
        return [f"{path}: cannot map ({e})"]
    crc, first_over, _ = _scan(mask, 2)
    report.bytes_checked += mask.nbytes
    expected = cache.shard_info(shard).mask_checksum
    problems = [] if crc == expected else [f"{path}: checksum {crc} does not match the manifest's {expected}"]
    if first_over is not None:
        problems.append(f"{path}: byte {first_over} is {int(mask[first_over])}, not 0 or 1")
    if problems or not check_places or not len(offsets):
        return problems
    ends = np.asarray(offsets, dtype=np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    for control, at, wanted in (("EOS", cache.eos_id, ends - 1), ("BOS", cache.bos_id, starts)):
        if at is None:
            continue
        value = 1 if control == "EOS" else 0
        wrong = np.flatnonzero(mask[wanted] != value)
        if len(wrong):
            doc = int(cache.doc_starts[shard] + wrong[0])
            problems.append(
                f"{path}: the {control} of document {doc} (and {len(wrong) - 1} more) has mask "
                f"{1 - value}, not {value}"
            )
    return problems


def _check_ends_and_starts(cache: Cache, shard: int, tokens: np.ndarray, offsets: np.ndarray) -> list[str]:
    """Every document ends with the EOS id (when appended) and begins with the BOS id (when prepended)."""
    tokens_file, _ = cache.shard_paths(shard)
    ends = np.asarray(offsets, dtype=np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    problems = []
    for name, control, at in (
        ("end with EOS", cache.eos_id, ends - 1),
        ("begin with BOS", cache.bos_id, starts),
    ):
        if control is None:
            continue
        missing = np.flatnonzero((ends <= starts) | (tokens[np.clip(at, 0, len(tokens) - 1)] != control))
        if len(missing):
            doc = int(cache.doc_starts[shard] + missing[0])
            problems.append(
                f"{tokens_file}: document {doc} (and {len(missing) - 1} more) does not {name} {control}"
            )
    return problems


@dataclass(frozen=True)
class _Control:
    """A control id streampack writes, and where in a document it may stand."""

    name: str  # EOS or BOS
    id: int
    at_start: bool  # it may be a document's first token
    at_end: bool  # it may be a document's last token


@dataclass
class _Strays:
    """A control id found where streampack never writes it: how many, and where the first are."""

    control: _Control
    count: int = 0
    first: list[int] = field(default_factory=list)  # positions in the shard


def _stray_controls(cache: Cache) -> list[_Control]:
    """The control ids that may stand only where streampack puts them (an empty list: anywhere).

    With ``special_tokens: parse`` a document's text may hold a control token's string, encoded as its id;
    a chat template writes special tokens (``<|im_end|>`` may be the EOS token) as their ids.
    """
    settings = cache.manifest.settings
    if settings.get("special_tokens") == "parse" or settings.get("chat"):
        return []
    eos, bos = cache.eos_id, cache.bos_id
    controls = []
    if eos is not None:
        controls.append(_Control("EOS", eos, at_start=eos == bos, at_end=True))
    if bos is not None and bos != eos:
        controls.append(_Control("BOS", bos, at_start=True, at_end=False))
    return controls


def _scan(
    array: np.ndarray,
    limit: int | None,
    controls: list[_Control] | None = None,
    ends: np.ndarray | None = None,
) -> tuple[str, int | None, list[_Strays]]:
    """Checksum ``array``'s bytes, a chunk at a time.

    With ``limit``, also find its first value not below ``limit``; with ``controls`` and the document
    ``ends`` of a token array, also find the control ids that stand where streampack never puts them.
    """
    crc, first_over = 0, None
    strays = [_Strays(c) for c in controls or []]
    for start in range(0, len(array), _CHUNK_ITEMS):
        chunk = array[start : start + _CHUNK_ITEMS]
        crc = zlib.crc32(chunk.data, crc)
        if limit is not None and first_over is None and int(chunk.max()) >= limit:
            first_over = start + int(np.argmax(chunk >= limit))
        for found in strays:
            assert ends is not None, "controls come with the document ends"
            positions = _misplaced(chunk, start, found.control, ends)
            found.count += len(positions)
            found.first.extend(positions[: _SHOWN - len(found.first)].tolist())
    return checksum_text(crc), first_over, strays


def _misplaced(chunk: np.ndarray, start: int, control: _Control, ends: np.ndarray) -> np.ndarray:
    """Positions of the ``control`` ids of ``chunk`` (at ``start`` in its shard) where it may not stand."""
    found = np.flatnonzero(chunk == control.id).astype(np.int64) + start
    if not len(found):
        return found
    allowed = np.zeros(len(found), dtype=bool)
    if control.at_end:  # position p ends a document when p + 1 is a document end
        allowed |= _is_end(ends, found + 1)
    if control.at_start:  # and begins one when it is 0 or a document end
        allowed |= (found == 0) | _is_end(ends, found)
    return found[~allowed]


def _is_end(ends: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Whether each of ``positions`` is one of the (sorted) document ``ends``."""
    if not len(ends):
        return np.zeros(len(positions), dtype=bool)
    index = np.minimum(np.searchsorted(ends, positions.astype(np.uint64)), len(ends) - 1)
    return np.asarray(ends[index], dtype=np.int64) == positions


def _stray_problem(cache: Cache, shard: int, strays: _Strays) -> str:
    offsets = cache.shard_offsets(shard)
    where = []
    for position in strays.first:
        local = int(np.searchsorted(offsets, np.uint64(position), side="right"))
        begin = int(offsets[local - 1]) if local else 0
        doc = int(cache.doc_starts[shard]) + local
        where.append(f"document {doc} at token {position - begin} of {int(offsets[local]) - begin}")
    tokens_file, _ = cache.shard_paths(shard)
    control = strays.control
    shown = f" (the first {len(where)})" if strays.count > len(where) else ""
    place = "not at their end" if control.at_end else "not at their start"
    return (
        f"{tokens_file}: {strays.count} {control.name} {'id' if strays.count == 1 else 'ids'} {control.id} "
        f"inside documents, {place}: {'; '.join(where)}{shown}. The text held the {control.name} token's "
        "string, which the tokenizer turned into the control id; rebuild the cache with overwrite=True "
        "(special-token strings are now encoded as text)"
    )


def _check_offsets(path: Path, offsets: np.ndarray, num_tokens: int) -> list[str]:
    if not len(offsets):
        return [] if num_tokens == 0 else [f"{path}: no documents, but {num_tokens} tokens"]
    steps = np.diff(offsets.astype(np.int64), prepend=0)
    bad = np.flatnonzero(steps < 0)
    if len(bad):
        i = int(bad[0])
        return [
            f"{path}: offsets not monotone at document {i} ({int(offsets[i - 1])} then {int(offsets[i])})"
        ]
    if int(offsets[-1]) != num_tokens:
        return [
            f"{path}: the last document ends at {int(offsets[-1])}, but the shard has {num_tokens} tokens"
        ]
    return []

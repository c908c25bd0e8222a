"""Full verification of a cache: checksums, offsets, token range, EOS placement (at every document's end,
and nowhere else).

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
_SHOWN = 3  # EOS ids inside documents listed in the report, of a shard


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
    info = cache.shards[shard]
    tokens_file, offsets_file = cache.shard_paths(shard)
    try:
        offsets = cache.shard_offsets(shard)
        tokens = cache.shard_tokens(shard)
    except (CacheError, ValueError, OSError) as e:
        return [f"{tokens_file}: cannot map ({e})"]
    offsets_crc, _, _ = _scan(offsets, None)
    problems = _check_offsets(offsets_file, offsets, info.num_tokens)
    inner_eos = None if problems else _inner_eos_id(cache)
    tokens_crc, first_too_large, inside = _scan(tokens, cache.vocab_size, inner_eos, offsets)  # one pass
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
    if cache.eos_id is not None and not problems and len(offsets):
        ends = np.asarray(offsets, dtype=np.int64)
        starts = np.concatenate([[0], ends[:-1]])
        missing = np.flatnonzero((ends <= starts) | (tokens[np.maximum(ends - 1, 0)] != cache.eos_id))
        if len(missing):
            doc = int(cache.doc_starts[shard] + missing[0])
            problems.append(
                f"{tokens_file}: document {doc} (and {len(missing) - 1} more) does not end with EOS "
                f"{cache.eos_id}"
            )
    if inside.count:
        problems.append(_inner_eos_problem(cache, shard, inside))
    return problems


@dataclass
class _InnerEos:
    """EOS ids found inside documents (not as their last token): how many, and where the first are."""

    count: int = 0
    first: list[int] = field(default_factory=list)  # positions in the shard


def _inner_eos_id(cache: Cache) -> int | None:
    """The id that may only end documents, or None when documents may hold it.

    With ``special_tokens: parse`` a document's text may hold the EOS token's string, encoded as the id.
    """
    if cache.manifest.settings.get("special_tokens") == "parse":
        return None
    return cache.eos_id


def _scan(
    array: np.ndarray, limit: int | None, eos: int | None = None, ends: np.ndarray | None = None
) -> tuple[str, int | None, _InnerEos]:
    """Checksum ``array``'s bytes, a chunk at a time.

    With ``limit``, also find its first value not below ``limit``; with ``eos`` and the document ``ends``
    of a token array, also find the ``eos`` ids that are not the last token of their document.
    """
    crc, first_over, inside = 0, None, _InnerEos()
    for start in range(0, len(array), _CHUNK_ITEMS):
        chunk = array[start : start + _CHUNK_ITEMS]
        crc = zlib.crc32(chunk.data, crc)
        if limit is not None and first_over is None and int(chunk.max()) >= limit:
            first_over = start + int(np.argmax(chunk >= limit))
        if eos is not None and ends is not None:
            found = _eos_inside(chunk, start, eos, ends)
            inside.count += len(found)
            inside.first.extend(found[: _SHOWN - len(inside.first)].tolist())
    return checksum_text(crc), first_over, inside


def _eos_inside(chunk: np.ndarray, start: int, eos: int, ends: np.ndarray) -> np.ndarray:
    """Positions of the ``eos`` ids of ``chunk`` (at ``start`` in its shard) that end no document."""
    found = np.flatnonzero(chunk == eos).astype(np.int64) + start
    if not len(found):
        return found
    # The id at position p ends a document when p + 1 is a document end: one of the ends in
    # (start, start + len(chunk)]; a sentinel after them matches no position.
    first = np.searchsorted(ends, np.uint64(start + 1), side="left")
    last = np.searchsorted(ends, np.uint64(start + len(chunk)), side="right")
    chunk_ends = np.append(np.asarray(ends[first:last], dtype=np.int64), -1)
    ending = chunk_ends[np.searchsorted(chunk_ends[:-1], found + 1)] == found + 1
    return found[~ending]


def _inner_eos_problem(cache: Cache, shard: int, inside: _InnerEos) -> str:
    offsets = cache.shard_offsets(shard)
    where = []
    for position in inside.first:
        local = int(np.searchsorted(offsets, np.uint64(position), side="right"))
        begin = int(offsets[local - 1]) if local else 0
        doc = int(cache.doc_starts[shard]) + local
        where.append(f"document {doc} at token {position - begin} of {int(offsets[local]) - begin}")
    tokens_file, _ = cache.shard_paths(shard)
    shown = f" (the first {len(where)})" if inside.count > len(where) else ""
    return (
        f"{tokens_file}: {inside.count} EOS {'id' if inside.count == 1 else 'ids'} {cache.eos_id} inside "
        "documents, not at their end: "
        f"{'; '.join(where)}{shown}. The text held the EOS token's string, which the tokenizer turned into "
        "the control id; rebuild the cache with overwrite=True (special-token strings are now encoded as "
        "text)"
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

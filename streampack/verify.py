"""Full verification of a cache: checksums, offsets, token range, EOS placement.

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
    tokens_crc, first_too_large = _scan(tokens, cache.vocab_size)  # one pass over the shard
    offsets_crc, _ = _scan(offsets, None)
    report.bytes_checked += tokens.nbytes + offsets.nbytes
    problems = [
        f"{path}: checksum {actual} does not match the manifest's {expected}"
        for path, actual, expected in (
            (tokens_file, tokens_crc, info.tokens_checksum),
            (offsets_file, offsets_crc, info.offsets_checksum),
        )
        if actual != expected
    ]
    problems.extend(_check_offsets(offsets_file, offsets, info.num_tokens))
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
    return problems


def _scan(array: np.ndarray, limit: int | None) -> tuple[str, int | None]:
    """Checksum ``array``'s bytes; with ``limit``, also find its first value not below ``limit``."""
    crc, first_over = 0, None
    for start in range(0, len(array), _CHUNK_ITEMS):
        chunk = array[start : start + _CHUNK_ITEMS]
        crc = zlib.crc32(chunk.data, crc)
        if limit is not None and first_over is None and int(chunk.max()) >= limit:
            first_over = start + int(np.argmax(chunk >= limit))
    return checksum_text(crc), first_over


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

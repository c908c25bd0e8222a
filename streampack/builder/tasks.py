"""What a worker is given to build a unit (picklable) and gives back; how a worker process is set up: its
tokenizer, its threads, and glibc's allocator.

glibc's dynamic mmap threshold rises above the ~1 MiB buffers a build frees on every thread, whose arenas
then fragment and grow (1.15-1.25x the RSS); a fixed 2 MiB threshold with a 64 MiB trim threshold held it
to 1.05-1.09x at the same speed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import sys
from dataclasses import dataclass

from streampack.builder.options import RunOptions
from streampack.errors import TokenizerError
from streampack.format.ledger import LedgerEntry
from streampack.inputs.records import ReadOptions, WorkUnit
from streampack.tokenizer.base import Tokenizer
from streampack.tokenizer.choices import SpecialTokens, TokenizerEngine
from streampack.tokenizer.load import load_tokenizer
from streampack.tokenizer.pieces import PieceRule
from streampack.tokenizer.specials import BosPolicy, EosPolicy

NO_BOS = BosPolicy(False, None)


@dataclass(frozen=True)
class TokenizerRef:
    """The tokenizer of a build as a worker loads it; its hash refuses a file changed since the start."""

    spec: str
    special_tokens: SpecialTokens
    sha256: str
    engine: TokenizerEngine = "auto"  # the engine the build's own tokenizer runs, so that workers run it too


@dataclass(frozen=True)
class UnitSpec:
    """What every unit of one build shares (picklable): the resolved cache spec and the run's policies."""

    root: str
    tokenizer: TokenizerRef
    read: ReadOptions
    eos: EosPolicy
    dtype: str
    pieces: PieceRule  # resolved for the tokenizer (see :func:`streampack.tokenizer.pieces.piece_rule`)
    run: RunOptions  # its verify_tokens "none" where the engine is the reference (see blocks.VERIFY_FIRST)
    bos: BosPolicy = NO_BOS
    # The manifest's vocab_size: every id written is below it, checked per batch before it is written
    # (None: below the dtype's limit only).
    vocab_size: int | None = None


@dataclass(frozen=True)
class UnitTask:
    """Everything a worker needs to build one unit (picklable)."""

    spec: UnitSpec
    unit: WorkUnit


@dataclass(frozen=True)
class UnitResult:
    """A finished unit's final ledger entry, and its process's timings since its last result."""

    unit_index: int
    entry: LedgerEntry
    timings: dict[str, list[float]] = dataclasses.field(default_factory=dict)


# Set and read only in worker processes and Ray tasks, which load each tokenizer once for all their units.
_worker_threads = 0
_worker_tokenizers: dict[tuple[TokenizerRef, int], Tokenizer] = {}


def init_worker(threads: int) -> None:
    """Encode with ``threads`` threads (``tokenizers`` reads RAYON_NUM_THREADS)."""
    global _worker_threads
    _worker_threads = threads
    os.environ["RAYON_NUM_THREADS"] = str(threads)


def worker_tokenizer(ref: TokenizerRef) -> Tokenizer:
    """This worker's tokenizer for ``ref``, loaded once and checked to be the one the build started with.

    Raises:
        TokenizerError: the tokenizer's files changed since the build started.
    """
    key = (ref, _worker_threads)
    if key not in _worker_tokenizers:
        tokenizer = load_tokenizer(
            ref.spec, threads=_worker_threads or None, special_tokens=ref.special_tokens, engine=ref.engine
        )
        found = tokenizer.fingerprint()["sha256"]
        if found != ref.sha256:
            raise TokenizerError(
                f"tokenizer {ref.spec!r} changed since the build started (sha256 {ref.sha256[:12]}... "
                f"then, {found[:12]}... now); rerun the build to use one tokenizer throughout"
            )
        _worker_tokenizers[key] = tokenizer
    return _worker_tokenizers[key]


@functools.cache
def steady_allocator() -> bool:
    """Fix glibc's mmap and trim thresholds for this process, once; whether it did (glibc only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)  # this process's C library (ctypes.util.find_library runs a subprocess)
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # not glibc: musl's mallopt does nothing
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameters (malloc.h)
    return all(
        [bool(libc.mallopt(m_mmap_threshold, 2 << 20)), bool(libc.mallopt(m_trim_threshold, 64 << 20))]
    )

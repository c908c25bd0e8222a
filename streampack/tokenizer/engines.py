"""Engines: what computes a tokenizer's ids: ``bytes``, ``tokenizers``, ``tiktoken``, or the fast engines
``gigatoken`` and ``fastokens``, each chosen only where :mod:`streampack.tokenizer.proofs` proves it gives the
reference's ids."""

from __future__ import annotations

import array
import contextlib
import importlib.util
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from streampack.errors import MissingDependencyError, TokenizerError
from streampack.tokenizer.choices import TokenizerEngine


class Engine(Protocol):
    """What computes a tokenizer's ids (the tokenizer set up its special-token rule in it)."""

    name: str  # the --tokenizer-engine choice: tokenizers, tiktoken, fastokens, gigatoken (bytes: built in)
    cores_per_worker: int  # see Tokenizer.cores_per_worker
    fast_piece_chars: int | None  # see Tokenizer.fast_piece_chars

    @property
    def version(self) -> str:
        """The version of the library that computes the ids."""
        ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text as uint32 (or uint8) arrays."""
        ...

    def encode_flat(self, texts: list[str]) -> FlatIds:
        """The ids of every text end to end, and where each text's begin (see :data:`FlatIds`)."""
        ...


# A batch's ids end to end and the texts' len(texts) + 1 offsets: text i's are ids[offsets[i]:offsets[i + 1]].
FlatIds = tuple[np.ndarray, np.ndarray]


def joined(arrays: list[np.ndarray]) -> FlatIds:
    """Per-text ids as :data:`FlatIds`."""
    offsets = np.zeros(len(arrays) + 1, dtype=np.intp)
    np.cumsum(np.fromiter(map(len, arrays), dtype=np.intp, count=len(arrays)), out=offsets[1:])
    return (np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.uint32)), offsets


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """Set the environment variable ``name`` for the duration of the block only."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def text_is_whole(tok: Any) -> None:
    """Turn off the truncation and padding a tokenizer.json may set: a document is encoded whole."""
    tok.no_truncation()
    tok.no_padding()


class BytesEngine:
    """UTF-8 bytes as ids: the ``bytes`` tokenizer's only engine."""

    name = "bytes"
    version = "1"
    cores_per_worker = 1  # holds the GIL
    fast_piece_chars: int | None = None  # encoding bytes costs the same per character at any length

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """See :class:`Engine`."""
        return [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]

    def encode_flat(self, texts: list[str]) -> FlatIds:
        """See :class:`Engine`."""
        encoded = [t.encode("utf-8") for t in texts]
        offsets = np.zeros(len(texts) + 1, dtype=np.intp)
        np.cumsum(np.fromiter(map(len, encoded), dtype=np.intp, count=len(texts)), out=offsets[1:])
        return np.frombuffer(b"".join(encoded), np.uint8), offsets


class _PackageEngine:
    """An engine that its package of the same name computes: each subclass gives one of the two encode
    calls, and the other is made from it."""

    name: str

    @property
    def version(self) -> str:
        """See :class:`Engine`."""
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version(self.name)
        except PackageNotFoundError:
            return "unknown"

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """See :class:`Engine`."""
        flat, offsets = self.encode_flat(texts)
        return np.split(flat, offsets[1:-1]) if len(texts) else []

    def encode_flat(self, texts: list[str]) -> FlatIds:
        """See :class:`Engine`."""
        return joined(self.encode_batch(texts))


class TokenizersEngine(_PackageEngine):
    """Hugging Face ``tokenizers``' ``encode_batch_fast``: the reference engine of a ``tokenizer.json``."""

    name = "tokenizers"
    # one process on all cores runs best (0.94x its raw speed; two processes 0.78x)
    cores_per_worker = 8
    fast_piece_chars: int | None = 10_000  # 1.17x whole documents' speed (benchmarks/bench_pieces.py)

    def __init__(self, tok: Any, *, threads: int | None) -> None:
        """Encode with ``tok``, a ``tokenizers.Tokenizer`` already set to the special-token rule."""
        self._tok = tok
        self._encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
        # set by an owner that changes ``tok``'s special-token setting for calls of its own
        self.exclusive: threading.Lock | None = None
        if threads is not None and threads != os.cpu_count():
            # its pool, if this process has none yet, reads RAYON_NUM_THREADS at its first call
            with _environment("RAYON_NUM_THREADS", str(threads)):
                self._encode(["a b", "c d"], add_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """See :class:`Engine`."""
        if self.exclusive is None:
            encodings = self._encode(texts, add_special_tokens=False)
        else:
            with self.exclusive:
                encodings = self._encode(texts, add_special_tokens=False)
        # array('I') copies the Python int list in C at ~60% of np.array's cost; this runs under the GIL.
        return [np.frombuffer(array.array("I", e.ids), dtype=np.uint32) for e in encodings]


class TiktokenEngine(_PackageEngine):
    """tiktoken, one text per call on a thread pool, ids returned in a buffer."""

    name = "tiktoken"
    cores_per_worker = 1  # reading and framing would hold it back (345 MB: 25-27 s, one process 36 s)
    fast_piece_chars: int | None = None  # pieces encode no faster (benchmarks/bench_pieces.py)

    def __init__(self, enc: Any, *, allowed: set[str], threads: int | None) -> None:
        """Encode with ``enc``, a ``tiktoken.Encoding``, matching only the special tokens ``allowed``."""
        self._enc = enc
        self._allowed = allowed
        self._threads = threads or 1
        self._pool = ThreadPoolExecutor(self._threads) if self._threads > 1 else None
        core = getattr(enc, "_core_bpe", None)
        self._to_buffer = getattr(core, "encode_to_tiktoken_buffer", None)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """See :class:`Engine`. Encodes as ``encode_ordinary`` unless special tokens are allowed."""
        if self._to_buffer is None:  # older tiktoken: the public batch call, then a list-to-array copy
            batch = self._enc.encode_batch(texts, allowed_special=self._allowed, disallowed_special=())
            return [np.array(ids, dtype=np.uint32) for ids in batch]
        if self._pool is None:
            return [self._encode_one(t) for t in texts]
        return list(self._pool.map(self._encode_one, texts))

    def _encode_one(self, text: str) -> np.ndarray:
        # No allowed specials makes this encode_ordinary, returning ids in a buffer: no Python int list.
        assert self._to_buffer is not None, "encode_batch checks for it"
        return np.frombuffer(self._to_buffer(text, self._allowed), dtype=np.uint32)


def fastokens_loading(load: Callable[[], Any], threads: int | None) -> Future[Any]:
    """The ``fastokens.Tokenizer`` that ``load()`` makes on a thread of its own (it lets go of the GIL), its
    pool started with the threads a build's call gets."""
    loading: Future[Any] = Future()

    def run() -> None:
        try:
            tok = load()
            text_is_whole(tok)
            # Its pool reads FASTOKENS_BPE_THREADS when the first batch call starts it.
            with _environment("FASTOKENS_BPE_THREADS", str(fastokens_call_threads(threads))):
                tok.encode_batch_flat(["a b", "c d"], add_special_tokens=False)
        except Exception as e:  # fastokens raises ValueError, or a bare Exception, for files it refuses
            loading.set_exception(e)
        else:
            loading.set_result(tok)

    # not a daemon: killing the thread inside fastokens' native code at exit aborts the process
    threading.Thread(target=run, name="streampack-fastokens-load").start()
    return loading


class FastokensEngine(_PackageEngine):
    """``fastokens`` (Rust): encodes byte-level BPE or tiktoken ranks ~10-40x faster than their reference
    engines, into a flat buffer of ids. Used only where proven exact, and sampled against the reference."""

    name = "fastokens"
    # A process frames ~0.25 CPU-s per 100 MB that its threads encode in ~0.65-1.1: one keeps ~3 cores busy.
    cores_per_worker = 3
    # whole documents up to the pieces' bound: fastest so (benchmarks/results/pieces-fastokens.md)
    fast_piece_chars: int | None = None

    def __init__(self, loading: Future[Any], *, split_special: bool, fallback: str) -> None:
        """Encode with the ``fastokens.Tokenizer`` being loaded; ``split_special``: special tokens are text;
        ``fallback``: the engine a load failure's message suggests."""
        self._split_special = split_special
        self._fallback = fallback
        self._tok = loading

    def encode_flat(self, texts: list[str]) -> FlatIds:
        """See :class:`Engine`: its batch call's own flat buffers.

        Raises:
            TokenizerError: fastokens could not load the tokenizer.
        """
        try:
            tok = self._tok.result()
        except Exception as e:
            raise TokenizerError(
                f"fastokens cannot load the tokenizer ({e}); use tokenizer_engine='{self._fallback}'"
            ) from None
        ids, offsets = tok.encode_batch_flat(
            texts, add_special_tokens=False, split_special_tokens=self._split_special
        )
        return np.frombuffer(ids, dtype=np.uint32), np.frombuffer(offsets, dtype=np.uint64).astype(np.intp)


# What the caches of gigatoken's tokenizer may hold in one build process: a quarter of the 1 GB a build
# process keeps under (benchmarks/bench_build.py's RSS goal).
GIGATOKEN_CACHE_BYTES = 256 << 20


class GigatokenEngine(_PackageEngine):
    """``gigatoken`` (Rust): encodes byte-level BPE or tiktoken ranks ~1.5-2x faster than fastokens once its
    caches of the pieces it has seen are warm, into a flat buffer of ids. Used only where proven exact, and
    sampled against the reference.

    Its caches grow with every new piece it meets (gigatoken 0.10.0 never empties them). Where it has
    ``set_max_cache_bytes``, they are bounded by it; else, on Linux, this engine swaps in a fresh tokenizer
    (caches empty) once the process's anonymous memory has grown by ``cache_bytes`` since the last load.
    Caches never change the ids, only how fast they come.
    """

    name = "gigatoken"
    cores_per_worker = 3  # as fastokens: a process's reading and framing keep ~3 cores busy
    fast_piece_chars: int | None = None  # whole documents (up to the pieces' bound): its caches are per piece

    def __init__(self, load: Callable[[], Any], *, threads: int | None, cache_bytes: int) -> None:
        """Encode with the ``gigatoken.Tokenizer`` that ``load()`` makes (loaded here, its pool started with
        ``threads`` threads, default the cores), its caches bounded by ``cache_bytes``.

        Raises:
            TokenizerError: its caches cannot be bounded on this platform, or gigatoken cannot load it.
        """
        try:
            import gigatoken
        except ImportError as e:  # found, yet broken
            raise TokenizerError(f"gigatoken cannot be imported ({e})") from None
        self._threads = threads or os.cpu_count() or 1
        self._pid = os.getpid()  # a pool started before a fork has no threads in the child
        bound = getattr(gigatoken, "set_max_cache_bytes", None)
        self._cache_bytes: int | None = None
        if bound is not None:  # per encode thread, for the tokenizers made from now on
            bound(max(1, cache_bytes // self._threads))
        elif anonymous_memory() is None:
            raise TokenizerError(
                f"gigatoken {self.version} cannot bound its caches on this platform (no "
                "gigatoken.set_max_cache_bytes, no /proc/self/statm)"
            )
        else:
            self._cache_bytes = cache_bytes
        self._load = load
        self._swap = threading.Lock()
        self.reloads = 0  # how many times its caches were dropped
        with _environment("RAYON_NUM_THREADS", str(self._threads)):  # its pool reads it at its first call
            self._tok = self._loaded()
            self._tok.encode_batch(["a b", "c d"], parallel=self._threads > 1)
        self._ceiling = self._memory_ceiling()

    def _loaded(self) -> Any:
        try:
            return self._load()
        except Exception as e:  # gigatoken raises ValueError, or a bare Exception, for files it refuses
            raise TokenizerError(f"gigatoken cannot load the tokenizer ({str(e).splitlines()[0]})") from None

    def _memory_ceiling(self) -> int:
        """The anonymous memory past which the caches are dropped: ``cache_bytes`` more than now."""
        memory = anonymous_memory()
        return 1 << 62 if memory is None or self._cache_bytes is None else memory + self._cache_bytes

    def encode_flat(self, texts: list[str]) -> FlatIds:
        """See :class:`Engine`: its batch call's own flat buffers (an awkward array's content and offsets)."""
        layout = self._tok.encode_batch(texts, parallel=self._threads > 1 and os.getpid() == self._pid).layout
        offsets = np.asarray(layout.offsets.data, dtype=np.intp)
        ids = np.asarray(layout.content.data, dtype=np.uint32)[offsets[0] : offsets[-1]]
        if self._cache_bytes is not None:
            self._bound_caches()
        return ids, offsets - offsets[0]

    def _bound_caches(self) -> None:
        """Drop the caches (a fresh tokenizer) once the process's anonymous memory is past the ceiling."""
        memory = anonymous_memory()
        if memory is None or memory <= self._ceiling:
            return
        with self._swap:
            if (anonymous_memory() or 0) > self._ceiling:  # not already dropped by the other encoder thread
                # the old tokenizer goes when the last call that holds it returns
                self._tok = self._loaded()
                self._ceiling = self._memory_ceiling()
                self.reloads += 1


def anonymous_memory() -> int | None:
    """This process's resident memory that no file backs, in bytes (Linux); None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            resident, shared = statm.read().split()[1:3]
    except (OSError, ValueError):
        return None
    return (int(resident) - int(shared)) * os.sysconf("SC_PAGE_SIZE")


def import_gigatoken(needed: bool) -> bool:
    """Whether ``gigatoken`` is installed (not imported: it pulls in awkward).

    Raises:
        MissingDependencyError: it is ``needed`` and not installed.
    """
    if importlib.util.find_spec("gigatoken") is not None:
        return True
    if needed:
        raise MissingDependencyError(
            "tokenizer_engine='gigatoken' needs the gigatoken package, a dependency of streampack where it "
            "has wheels: pip install gigatoken"
        )
    return False


# A build encodes this many batches at once, one fastokens call each (its ENCODING_THREADS).
FASTOKENS_CALLS = 2


def fastokens_call_threads(threads: int | None) -> int:
    """The threads each of :data:`FASTOKENS_CALLS` concurrent calls gets of ``threads`` (default: the cores);
    sharing them beats oversubscribing (345 MB x 4 on 2 cores: 7.4 s against 8.0 s)."""
    cores = threads or os.cpu_count() or 1
    return max(1, -(-cores // FASTOKENS_CALLS))


def import_fastokens(needed: bool) -> Any:
    """The ``fastokens`` module; None when it is missing and not ``needed``.

    Raises:
        MissingDependencyError: it is ``needed`` and not installed.
    """
    try:
        import fastokens
    except ImportError:
        if needed:
            raise MissingDependencyError(
                "tokenizer_engine='fastokens' needs the fastokens package, a dependency of streampack "
                "where it has wheels: pip install fastokens"
            ) from None
        return None
    return fastokens


def fastokens_unsupported_platform() -> str:
    """The interpreter and platform, when fastokens has no wheels for them; ``""`` where it has."""
    import platform
    import sys
    import sysconfig

    implementation, machine, system = platform.python_implementation(), platform.machine(), sys.platform
    wheels = {"linux": {"x86_64", "i686", "aarch64", "armv7l", "ppc64le"}, "darwin": {"x86_64", "arm64"}}
    wheels["win32"] = {"AMD64"} if sys.maxsize > 1 << 32 else set()  # 32-bit Python on 64-bit Windows
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        return f"free-threaded {implementation} {platform.python_version()}"
    if implementation != "CPython" or machine not in wheels.get(system, set()):
        return f"{implementation} on {system} {machine}"
    return ""


def reference_reason(choice: TokenizerEngine) -> str:
    """Why a tokenizer runs its reference engine when fastokens was not even considered."""
    if choice != "auto":
        return f"asked for: tokenizer_engine={choice!r}"
    unsupported = fastokens_unsupported_platform()
    if unsupported:
        return f"fastokens is not installed on this platform: it has no wheels for {unsupported}"
    return "fastokens is not installed: pip install fastokens (streampack depends on it on this platform)"


class RoutedEngine:
    """``fast`` for every text but those holding one of ``characters``, which ``exact`` encodes (a fast form
    that may differ only there). Named and versioned as ``fast``."""

    def __init__(self, fast: Engine, exact: Engine, characters: str) -> None:
        self.fast, self.exact, self.characters = fast, exact, characters
        self.name = fast.name
        self.cores_per_worker = fast.cores_per_worker
        self.fast_piece_chars = fast.fast_piece_chars

    @property
    def version(self) -> str:
        """See :class:`Engine`."""
        return self.fast.version

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """See :class:`Engine`."""
        routed = {i for i, text in enumerate(texts) if any(c in text for c in self.characters)}
        if not routed:
            return self.fast.encode_batch(texts)
        fast = iter(self.fast.encode_batch([t for i, t in enumerate(texts) if i not in routed]))
        exact = iter(self.exact.encode_batch([t for i, t in enumerate(texts) if i in routed]))
        return [next(exact) if i in routed else next(fast) for i in range(len(texts))]

    def encode_flat(self, texts: list[str]) -> FlatIds:
        """See :class:`Engine`."""
        if not any(c in text for text in texts for c in self.characters):
            return self.fast.encode_flat(texts)
        return joined(self.encode_batch(texts))

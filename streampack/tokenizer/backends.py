"""Tokenizers behind one small interface, and batch encoding.

Three kinds, chosen by a SPEC string:

- ``bytes``: built in, needs no files. Token ids are the UTF-8 bytes (0-255); EOS is 256.
- a Hugging Face ``tokenizer.json`` path, or a folder holding one (``tokenizers.Tokenizer``).
- ``tiktoken:PATH``: a local tiktoken ranks file ``PATH`` (``NAME.tiktoken``) with its split pattern and
  special tokens in ``NAME.json`` beside it. Nothing is ever downloaded.

**Text is text.** A document's tokens are the tokenizer's encoding of its text with special-token strings
(``<|endoftext|>``, ``</s>``, ...) encoded as the plain text they are, and no post-processor template
(no BOS/CLS): tiktoken's ``encode_ordinary``, and for Hugging Face ``encode(text,
add_special_tokens=False)`` with ``encode_special_tokens = True``; for one vocabulary both give the same
ids. Control ids come only from streampack (the EOS it appends). ``special_tokens="parse"`` opts into
matching special-token strings as their ids instead (recorded in the manifest).

Each tokenizer also says which cuts of a long text keep its tokens (``cut_safety``, proven from its
structure by :mod:`streampack.tokenizer.pieces`).

**Tokenizer and engine.** A tokenizer decides which ids a text gets: its definition, fingerprint, EOS and
BOS, and the special-token rule above. An :class:`Engine` computes them: ``tokenizers``
(``encode_batch_fast``), ``tiktoken``, or ``bytes``. Each tokenizer has a reference engine, the library it
is defined by, whose ids are the ids of the cache whatever engine computes them.
"""

from __future__ import annotations

import array
import base64
import binascii
import contextlib
import hashlib
import json
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from streampack._checks import check_choice, check_int
from streampack.errors import MissingDependencyError, TokenizerError
from streampack.tokenizer.choices import ENGINE_CHOICES, SPECIAL_TOKENS, SpecialTokens, TokenizerEngine
from streampack.tokenizer.pieces import (
    GPT2_SPLIT_PATTERNS,
    PROVEN_SPLIT_PATTERNS,
    CutSafety,
    hf_cut_safety,
    tiktoken_cut_safety,
)
from streampack.tokenizer.tiktoken_json import byte_level_json

EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "[SEP]")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")


class Tokenizer(Protocol):
    """What the builder needs of a tokenizer."""

    spec: str
    vocab_size: int
    # What computes its ids (see the module docstring), and why that engine: "proven exact for this
    # tokenizer in parse mode", "fastokens refused: ...", "fastokens is not installed (...)", ...
    engine: Engine
    engine_reason: str
    # Where cuts keep its tokens, documents are cut into pieces of about this many characters because it
    # encodes them faster than whole documents (None: no such cuts); see
    # streampack.tokenizer.pieces.piece_rule.
    fast_piece_chars: int | None
    # Which cuts keep its tokens, proven from its structure.
    cut_safety: CutSafety

    @property
    def cores_per_worker(self) -> int:
        """How many cores one build process of it keeps busy: its engine's threads plus the Python thread
        that reads and frames the documents; see :func:`streampack.builder.coordinator.default_workers`."""
        ...

    @property
    def eos_id(self) -> int | None:
        """The tokenizer's own EOS id, or None."""
        ...

    @property
    def bos_id(self) -> int | None:
        """The tokenizer's own BOS id, or None."""
        ...

    def fingerprint(self) -> dict[str, Any]:
        """Kind, name, vocab size and a hash of the definition: identifies the tokenizer in a manifest."""
        ...

    def reference_engine(self) -> Engine:
        """The engine whose ids define the tokenizer's (``engine`` itself when it is the reference)."""
        ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text (special-token text as text, unless parsed; none added), as arrays."""
        ...

    def encode_specials(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text with special-token strings as their ids (a chat template's own text)."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a sequence of ids."""
        ...


def load_tokenizer(
    spec: str,
    *,
    threads: int | None = None,
    special_tokens: SpecialTokens = "text",
    engine: TokenizerEngine = "auto",
) -> Tokenizer:
    """Load a tokenizer from its SPEC (see the module docstring).

    Args:
        spec: ``bytes``, a ``tokenizer.json`` path or folder, or ``tiktoken:PATH``.
        threads: threads used to encode a batch (tiktoken; Hugging Face uses its own pool).
        special_tokens: ``text`` encodes special-token strings as plain text; ``parse`` as their ids.
        engine: what computes the ids: ``auto`` (the fastest engine known to give exactly the reference
            engine's ids for this tokenizer), ``tokenizers``, ``tiktoken`` or ``fastokens``.

    Raises:
        TokenizerError: the spec names no usable tokenizer.
        MissingDependencyError: the backend's package (or the engine asked for) is not installed.
    """
    check_choice("special_tokens", special_tokens, SPECIAL_TOKENS)
    check_choice("tokenizer_engine", engine, ENGINE_CHOICES)
    if spec == "bytes":
        if engine != "auto":
            raise TokenizerError(
                f"the bytes tokenizer has an engine of its own (got tokenizer_engine={engine!r}); use 'auto'"
            )
        return BytesTokenizer()
    if spec.startswith("tiktoken:"):
        return TiktokenTokenizer(spec, threads=threads, special_tokens=special_tokens, engine=engine)
    return HFTokenizer(spec, threads=threads, special_tokens=special_tokens, engine=engine)


def describe_engine(tokenizer: Tokenizer) -> dict[str, str]:
    """The engine that computes a tokenizer's ids, why, and its reference, with versions (for the
    manifest)."""
    engine, reference = tokenizer.engine, tokenizer.reference_engine()
    return {
        "name": engine.name,
        "version": engine.version,
        "reference": f"{reference.name} {reference.version}",
        "why": tokenizer.engine_reason,
    }


def _fastokens_or_reference(
    reference: Engine,
    choice: TokenizerEngine,
    problem: str,
    load: Callable[[], Any],
    *,
    split_special: bool,
    threads: int | None,
    refusal: str,
) -> tuple[Engine, str]:
    """The fastokens engine where the tokenizer's structure is proven (``problem`` empty), loading in the
    background; else the reference engine, or a :class:`TokenizerError` when fastokens was asked for.
    With the reason for the choice (see :attr:`Tokenizer.engine_reason`)."""
    mode = "text" if split_special else "parse"
    if not problem:
        engine = FastokensEngine(load, split_special=split_special, threads=threads, fallback=reference.name)
        return engine, f"proven exact for this tokenizer in {mode} mode"
    if choice == "fastokens":
        raise TokenizerError(
            f"{refusal} in {mode} mode ({problem}); use tokenizer_engine='auto' or '{reference.name}'"
        )
    return reference, f"fastokens refused: {problem} in {mode} mode"


def _reference_reason(choice: TokenizerEngine, fastokens: Any) -> str:
    """Why a tokenizer runs its reference engine when fastokens was not even considered."""
    if choice != "auto":
        return f"asked for: tokenizer_engine={choice!r}"
    unsupported = fastokens_unsupported_platform()
    if unsupported:
        return f"fastokens is not installed on this platform: it has no wheels for {unsupported}"
    return "fastokens is not installed: pip install fastokens (streampack depends on it on this platform)"


def fastokens_unsupported_platform() -> str:
    """The interpreter and platform, when fastokens has no wheels for them (pyproject.toml's environment
    markers install it where it has); ``""`` where it has."""
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


def _wrong_engine(spec: str, choice: str, kind: str, allowed: str) -> TokenizerError:
    return TokenizerError(
        f"tokenizer {spec!r} is {kind}: its engines are {allowed} (got tokenizer_engine={choice!r})"
    )


@dataclass(frozen=True)
class EosPolicy:
    """Whether an EOS id is appended after every document, and which."""

    append: bool
    id: int | None

    def to_json(self) -> dict[str, Any]:
        """Manifest representation."""
        return {"append": self.append, "id": self.id}


@dataclass(frozen=True)
class BosPolicy:
    """Whether a BOS id is put before every document, and which."""

    prepend: bool
    id: int | None

    def to_json(self) -> dict[str, Any]:
        """Manifest representation."""
        return {"prepend": self.prepend, "id": self.id}


def resolve_bos(tokenizer: Tokenizer, *, bos: bool, bos_id: int | None) -> BosPolicy:
    """Decide the BOS policy: ``bos_id`` when given, else with ``bos`` the tokenizer's own BOS token.

    A Hugging Face tokenizer's BOS is the ``bos_token`` of a ``tokenizer_config.json`` beside its
    ``tokenizer.json``, else an added token named like one of ``BOS_NAMES``; tiktoken and ``bytes``
    tokenizers have none (give ``bos_id``).

    Raises:
        TokenizerError: BOS is wanted but neither given nor known to the tokenizer.
    """
    if not bos and bos_id is None:
        return BosPolicy(False, None)
    if bos_id is not None:
        return BosPolicy(True, bos_id)
    if tokenizer.bos_id is None:
        raise TokenizerError(
            f"tokenizer {tokenizer.spec!r} has no BOS token that streampack recognises (looked for the "
            f"bos_token of a tokenizer_config.json beside a tokenizer.json, and {', '.join(BOS_NAMES)}); "
            "pass bos_id=N"
        )
    return BosPolicy(True, tokenizer.bos_id)


def resolve_eos(tokenizer: Tokenizer, *, eos: bool, eos_id: int | None) -> EosPolicy:
    """Decide the EOS policy from the options and the tokenizer's own EOS token.

    Raises:
        StreampackError: EOS is wanted but neither given nor known to the tokenizer.
    """
    if not eos:
        return EosPolicy(False, None)
    if eos_id is not None:
        return EosPolicy(True, check_int("eos_id", eos_id, min=0, below=2**32))
    if tokenizer.eos_id is None:
        raise TokenizerError(
            f"tokenizer {tokenizer.spec!r} has no EOS token that streampack recognises "
            f"(looked for {', '.join(EOS_NAMES)}); pass eos_id=N, or eos=False to append none"
        )
    return EosPolicy(True, tokenizer.eos_id)


class Engine(Protocol):
    """What computes a tokenizer's ids; the tokenizer decides which ids they are (its special-token rule
    is set up in the engine when the tokenizer makes it)."""

    name: str  # the --tokenizer-engine choice: tokenizers, tiktoken, fastokens (bytes: built in)
    # The cores one build process of it keeps busy (see Tokenizer.cores_per_worker).
    cores_per_worker: int

    @property
    def version(self) -> str:
        """The version of the library that computes the ids."""
        ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text as uint32 (or uint8) arrays."""
        ...


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


class BytesEngine:
    """UTF-8 bytes as ids: the ``bytes`` tokenizer's only engine."""

    name = "bytes"
    version = "1"
    cores_per_worker = 1  # holds the GIL

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """See :class:`Engine`."""
        return [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]


class TokenizersEngine:
    """Hugging Face ``tokenizers``' ``encode_batch_fast``: the reference engine of a ``tokenizer.json``."""

    name = "tokenizers"
    cores_per_worker = 8  # its batch call is slow enough that one reader keeps 8 cores of it busy

    def __init__(self, tok: Any, *, threads: int | None) -> None:
        """Encode with ``tok``, a ``tokenizers.Tokenizer`` already set to the special-token rule."""
        self._tok = tok
        self._encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
        if threads is not None and threads != os.cpu_count():
            self._start_thread_pool(threads)

    @property
    def version(self) -> str:
        """See :class:`Engine`."""
        return _package_version("tokenizers")

    def _start_thread_pool(self, threads: int) -> None:
        """Start ``tokenizers``' thread pool with ``threads`` threads, if this process has none yet.

        The pool reads ``RAYON_NUM_THREADS`` once, when the first batch call starts it; the variable is set
        only for that call, so nothing is left in the caller's environment. A pool already running in this
        process keeps its size.
        """
        with _environment("RAYON_NUM_THREADS", str(threads)):
            self._encode(["a b", "c d"], add_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """See :class:`Engine`."""
        encodings = self._encode(texts, add_special_tokens=False)
        # array('I') copies the Python int list in C at ~60% of np.array's cost; this runs under the GIL.
        return [np.frombuffer(array.array("I", e.ids), dtype=np.uint32) for e in encodings]


class TiktokenEngine:
    """tiktoken, one text per call on a thread pool, ids returned in a buffer: the reference engine of a
    ``tiktoken:`` encoding."""

    name = "tiktoken"
    cores_per_worker = 1  # 3-4 M tokens/s: reading and framing in one process would hold it back

    def __init__(self, enc: Any, *, allowed: set[str], threads: int | None) -> None:
        """Encode with ``enc``, a ``tiktoken.Encoding``, matching only the special tokens ``allowed``."""
        self._enc = enc
        self._allowed = allowed
        self._threads = threads or 1
        self._pool = ThreadPoolExecutor(self._threads) if self._threads > 1 else None
        core = getattr(enc, "_core_bpe", None)
        self._to_buffer = getattr(core, "encode_to_tiktoken_buffer", None)

    @property
    def version(self) -> str:
        """See :class:`Engine`."""
        return _package_version("tiktoken")

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


class FastokensEngine:
    """``fastokens`` (Rust, PCRE2 JIT): encodes a byte-level BPE ``tokenizer.json`` or tiktoken ranks ~10-40x
    faster than their reference engines, into a flat buffer of ids with no per-token Python objects.

    Used only for tokenizers whose structure it is known to reproduce (:func:`fastokens_mismatch`), and
    checked against the reference engine while a build runs (:mod:`streampack.builder.pipeline`).
    """

    name = "fastokens"
    # Its threads encode a GPT-2 batch at ~1.1 CPU-s per 100 MB (58 M tokens/s on 2 cores); the reader spends
    # ~0.55 CPU-s per 100 MB reading, parsing, cutting and writing: one reader keeps ~3 cores busy. On 2
    # cores one process of 2 threads built 345 MB in 4.2 s against 4.7 s for two processes of one thread
    # (each loads the tokenizer, ~0.8 CPU-s).
    cores_per_worker = 3

    def __init__(
        self, load: Callable[[], Any], *, split_special: bool, threads: int | None, fallback: str
    ) -> None:
        """Encode with the ``fastokens.Tokenizer`` that ``load()`` makes; ``split_special``: special tokens
        are text; ``fallback``: the engine a load failure's message suggests.

        It loads on a thread of its own (0.3-1 s), while the build lists and reads its first records.
        """
        self._split_special = split_special
        self._fallback = fallback
        self._tok: Future[Any] = Future()
        # Not a daemon: a process that exits (a finished build resumed) waits for the load to end rather than
        # killing the thread inside fastokens' native code, which aborts ("exception not rethrown").
        loading = threading.Thread(target=self._load, args=(load, threads), name="streampack-fastokens-load")
        loading.start()

    def _load(self, load: Callable[[], Any], threads: int | None) -> None:
        try:
            tok = load()
            _text_is_whole(tok)
            # Its pool reads FASTOKENS_BPE_THREADS when the first batch call starts it.
            with _environment("FASTOKENS_BPE_THREADS", str(threads or os.cpu_count() or 1)):
                tok.encode_batch_flat(["a b", "c d"], add_special_tokens=False)
        except Exception as e:  # fastokens raises ValueError, or a bare Exception, for files it refuses
            self._tok.set_exception(e)
        else:
            self._tok.set_result(tok)

    @property
    def version(self) -> str:
        """See :class:`Engine`."""
        return _package_version("fastokens")

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """See :class:`Engine`.

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
        flat = np.frombuffer(ids, dtype=np.uint32)
        bounds = np.frombuffer(offsets, dtype=np.uint64).astype(np.intp)
        return np.split(flat, bounds[1:-1]) if len(texts) else []


def _import_fastokens(needed: bool) -> Any:
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


def fastokens_mismatch_hf(structure: dict[str, Any], *, parse_special: bool) -> str:
    """Why ``fastokens`` may not give a ``tokenizer.json``'s ids in a special-token mode; ``""`` when its
    structure is one it is known to reproduce exactly: byte-level BPE, no normalizer, a proven split
    pattern, only special added tokens; and where special tokens are parsed, each added token's id the one
    ``tokenizers`` gives it, and no two added tokens that could compete for the same characters.

    Args:
        structure: the tokenizer's parts, as :meth:`HFTokenizer._structure` gives them.
        parse_special: special-token strings in the text are matched as their ids (``parse`` mode).
    """
    model = structure["model"]
    if model["type"] != "BPE":
        return f"the model is {model['type']}, not BPE"
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback"):
        if model.get(key):
            return f"the BPE model has {key}={model[key]!r}"
    if structure["normalizer"] is not None:
        return f"it has a {structure['normalizer'].get('type')} normalizer"
    problem = _byte_level_problem(structure["pre_tokenizer"] or {})
    if problem:
        return problem
    added = structure["added_tokens"]
    plain = [t["content"] for t in added if not t["special"]]
    if plain:
        return f"the added token {plain[0]!r} is not special: it would be matched inside the text"
    contents = [t["content"] for t in added]
    twice = next((c for c in contents if contents.count(c) > 1), None)
    if twice is not None:
        return f"two added tokens are {twice!r}, which fastokens cannot load"
    if not parse_special:
        return ""  # special-token strings are text: no added token is matched
    return _matched_added_problem(added)


def fastokens_mismatch_tiktoken(pattern: str, specials: dict[str, int], *, parse_special: bool) -> str:
    """Why ``fastokens`` may not give a tiktoken encoding's ids in a special-token mode; ``""`` when its split
    pattern is proven and, where special tokens are parsed, no two of them could compete for the same
    characters (tiktoken tries them in an order of its own; fastokens takes the longest)."""
    if pattern not in PROVEN_SPLIT_PATTERNS:
        return "its pat_str is not GPT-2's, cl100k's or o200k's"
    if parse_special:
        overlap = _overlapping(list(specials))
        if overlap:
            return f"the special tokens {overlap[0]!r} and {overlap[1]!r} overlap"
    return ""


# The flags of an added token in a tokenizer.json, which decide where it matches.
_ADDED_FLAGS = ("special", "lstrip", "rstrip", "single_word", "normalized")


def _matched_added_problem(added: list[dict[str, Any]]) -> str:
    """Why fastokens may match a ``tokenizer.json``'s added tokens otherwise than ``tokenizers``; ``""`` when
    it is proven not to.

    Measured against tokenizers 0.23 (tests/test_tokenizer_engines.py): fastokens gives an added token the
    id the file declares, tokenizers the vocabulary's id where the content is a vocabulary entry (else the
    next free id); and the two match differently where one token's text may begin inside another's, or
    where one strips the whitespace that begins or ends another, or where a single_word token's neighbours
    differ between its two passes (below). Every other combination of the flags matches alike.
    """
    for t in added:
        if t["id"] != t["vocab_id"]:
            which = "vocabulary id" if t["in_model"] else "tokenizers' id"
            return f"added token {t['content']!r} id {t['id']} != {which} {t['vocab_id']}"
    overlap = _overlapping([t["content"] for t in added])
    if overlap:
        return f"the added tokens {overlap[0]!r} and {overlap[1]!r} overlap"
    strips = next((t["content"] for t in added if t["lstrip"] or t["rstrip"]), None)
    spaced = next(
        (t["content"] for t in added if t["content"][:1].isspace() or t["content"][-1:].isspace()), None
    )
    if strips is not None and spaced is not None:
        return f"the added token {strips!r} strips whitespace and {spaced!r} begins or ends with whitespace"
    # tokenizers matches the tokens that are not normalized first, then the others in the text between
    # them, where a single_word token's neighbours are the ends of that text, not the characters beside it.
    word = next((t["content"] for t in added if t["single_word"] and t["normalized"]), None)
    if word is not None and not all(t["normalized"] for t in added):
        return f"the added token {word!r} is single_word and normalized, and other added tokens are not"
    return ""


def _overlapping(contents: list[str]) -> tuple[str, str] | None:
    """Two of ``contents`` that may overlap in a text: one inside the other, or an end of one the start of
    another (or of itself); None when no two may."""
    if "" in contents:
        return "", next((c for c in contents if c), "")
    whole = set(contents)
    lengths = sorted({len(c) for c in contents})
    starts = {c[:i]: c for c in contents for i in range(1, len(c))}  # every proper prefix
    for c in contents:
        for i in range(1, len(c)):
            if c[i:] in starts:  # c's end is another's (or its own) start
                return c, starts[c[i:]]
        for n in lengths:
            if n >= len(c):
                break
            inner = next((c[i : i + n] for i in range(len(c) - n + 1) if c[i : i + n] in whole), None)
            if inner is not None:
                return inner, c
    return None


def _text_is_whole(tok: Any) -> None:
    """Turn off the truncation and padding a tokenizer.json may set: a document's tokens are its whole
    text's, and a batch's texts are not padded to one length (``tokenizers`` and ``fastokens`` alike)."""
    tok.no_truncation()
    tok.no_padding()


def _json_member(text: str, key: str) -> Any:
    """The member ``key`` of the JSON object ``text`` (None when absent), parsing only the members before it.

    A ``tokenizer.json`` has ``added_tokens`` before its large ``model``: this reads a few kB of a file whose
    full parse costs ~0.05 s per 3.5 MB.
    """
    decoder = json.JSONDecoder()

    def skip(at: int) -> int:  # past JSON whitespace
        found = _JSON_SPACE.match(text, at)
        return found.end() if found else at

    at = skip(0)
    if text[at : at + 1] != "{":
        return None
    at = skip(at + 1)
    while text[at : at + 1] == '"':
        name, at = decoder.raw_decode(text, at)
        at = skip(at)
        if text[at : at + 1] != ":":
            return None
        value, at = decoder.raw_decode(text, skip(at + 1))
        if name == key:
            return value
        at = skip(at)
        if text[at : at + 1] == ",":
            at = skip(at + 1)
    return None


_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def _byte_level_problem(pre: dict[str, Any]) -> str:
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            return "its ByteLevel pre-tokenizer adds a prefix space or has no regex"
        return ""
    steps = pre.get("pretokenizers") or []
    if pre.get("type") != "Sequence" or len(steps) != 2:
        return f"its pre-tokenizer is {pre.get('type')}, not ByteLevel or Split+ByteLevel"
    split, byte_level = steps
    pattern = (split.get("pattern") or {}).get("Regex")
    if split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert"):
        return "its pre-tokenizer is not Split(Regex, Isolated) + ByteLevel"
    plain = not byte_level.get("add_prefix_space") and not byte_level.get("use_regex")
    if byte_level.get("type") != "ByteLevel" or not plain:
        return "its pre-tokenizer is not Split(Regex, Isolated) + ByteLevel(use_regex=false, no prefix space)"
    if pattern not in PROVEN_SPLIT_PATTERNS:
        return "its split pattern is not one of GPT-2's, cl100k's or o200k's"
    return ""


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


class BytesTokenizer:
    """UTF-8 bytes as token ids 0-255, with EOS = 256. Needs no files; the built-in default."""

    spec = "bytes"
    vocab_size = 257
    eos_id: int | None = 256
    bos_id: int | None = None
    fast_piece_chars: int | None = None  # encoding bytes costs the same per character at any length
    cut_safety = CutSafety(True, "every cut keeps UTF-8 bytes")
    engine: Engine = BytesEngine()  # stateless: one for all
    engine_reason = "the bytes tokenizer's only engine"

    @property
    def cores_per_worker(self) -> int:
        """See :class:`Tokenizer`."""
        return self.engine.cores_per_worker

    def reference_engine(self) -> Engine:
        """The engine that defines this tokenizer's ids: its only one."""
        return self.engine

    def fingerprint(self) -> dict[str, Any]:
        """See :class:`Tokenizer`."""
        return {"kind": "bytes", "name": "bytes", "vocab_size": self.vocab_size, "sha256": "bytes-v1"}

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """See :class:`Tokenizer`."""
        return self.engine.encode_batch(texts)

    def encode_specials(self, texts: list[str]) -> list[np.ndarray]:
        """See :class:`Tokenizer`; bytes have no special tokens."""
        return self.encode_batch(texts)

    def decode(self, ids: Iterable[int]) -> str:
        """See :class:`Tokenizer`; ids above 255 (EOS) are left out."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from a local ``tokenizer.json``.

    Its reference engine is ``tokenizers`` itself, with ``add_special_tokens=False`` and
    ``encode_special_tokens`` set by the special-token rule.
    """

    # Its batch call encodes 100 MB of the real corpus 1.17x as fast in 10,000-character pieces as in whole
    # documents (5,000: 1.16x; 20,000: 1.14x; GPT-2, 2 cores; benchmarks/bench_pieces.py).
    fast_piece_chars: int | None = 10_000

    def __init__(
        self,
        spec: str,
        *,
        threads: int | None = None,
        special_tokens: SpecialTokens = "text",
        engine: TokenizerEngine = "auto",
    ) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(spec)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(
                f"tokenizer {spec!r}: no such file; pass a tokenizer.json path or a folder holding one, "
                "'bytes', or 'tiktoken:PATH'"
            )
        self.spec = spec
        self._path = path
        self._definition = path.read_bytes()
        try:
            self._tok = _Tokenizer.from_str(self._definition.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception for unparsable files
            raise TokenizerError(f"{path}: not a valid Hugging Face tokenizer.json ({e})") from None
        if not hasattr(self._tok, "encode_special_tokens"):
            raise MissingDependencyError(
                "streampack needs tokenizers >= 0.15 (encode_special_tokens): pip install -U tokenizers"
            )
        _text_is_whole(self._tok)
        self._tok.encode_special_tokens = special_tokens == "text"
        self._parsing: Any = None if special_tokens == "text" else self._tok  # see encode_specials
        self._parsing_lock = threading.Lock()
        structure = self._structure()
        self.cut_safety = hf_cut_safety(structure, parse_special=special_tokens == "parse")
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self._config = self._read_config()
        self._eos_id, self._eos_problem = self._find_special("eos_token", EOS_NAMES, added_only=False)
        self._bos_id, self._bos_problem = self._find_special("bos_token", BOS_NAMES, added_only=True)
        self._reference = TokenizersEngine(self._tok, threads=threads)
        self.engine: Engine
        self.engine, self.engine_reason = self._choose_engine(engine, threads, special_tokens, structure)

    def _choose_engine(
        self, choice: TokenizerEngine, threads: int | None, special: SpecialTokens, structure: dict[str, Any]
    ) -> tuple[Engine, str]:
        """``tokenizers``, or ``fastokens`` where it is installed and proven to give the same ids in this
        special-token mode; and why."""
        if choice == "tiktoken":
            raise _wrong_engine(self.spec, choice, "a tokenizer.json", "tokenizers and fastokens")
        fastokens = _import_fastokens(needed=choice == "fastokens") if choice != "tokenizers" else None
        if fastokens is None:
            return self._reference, _reference_reason(choice, fastokens)
        return _fastokens_or_reference(
            self._reference,
            choice,
            fastokens_mismatch_hf(structure, parse_special=special == "parse"),
            lambda: fastokens.Tokenizer.from_json_str(self._definition.decode("utf-8")),
            split_special=special == "text",
            threads=threads,
            refusal=f"{self._path}: fastokens is not known to give this tokenizer's ids",
        )

    @property
    def cores_per_worker(self) -> int:
        """See :class:`Tokenizer`."""
        return self.engine.cores_per_worker

    def reference_engine(self) -> Engine:
        """The engine that defines this tokenizer's ids: ``tokenizers``."""
        return self._reference

    def _structure(self) -> dict[str, Any]:
        """The parts of the definition that decide which cuts keep the tokens (see
        streampack.tokenizer.pieces).

        Read from the loaded tokenizer's parts rather than by parsing the whole file again, whose
        vocabulary and merges make that cost ~0.1 s per process.
        """

        def state(part: Any) -> Any:
            return None if part is None else json.loads(part.__getstate__())

        # The ids the file declares: fastokens gives those, tokenizers numbers its added tokens itself
        # (the vocabulary's id where the content is a vocabulary entry, else the next free id).
        declared = _json_member(self._definition.decode("utf-8"), "added_tokens")
        added = [t for t in declared if isinstance(t, dict)] if isinstance(declared, list) else []
        return {
            "normalizer": state(self._tok.normalizer),
            "pre_tokenizer": state(self._tok.pre_tokenizer),
            "model": {
                "type": type(self._tok.model).__name__,
                **{
                    key: getattr(self._tok.model, key, None)
                    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback")
                },
            },
            "added_tokens": [
                {
                    "id": t.get("id"),
                    "content": str(t.get("content", "")),
                    **{key: bool(t.get(key)) for key in _ADDED_FLAGS},
                    "vocab_id": self._tok.token_to_id(str(t.get("content", ""))),
                    "in_model": self._tok.model.token_to_id(str(t.get("content", ""))) is not None,
                }
                for t in added
            ],
        }

    @property
    def eos_id(self) -> int | None:
        """The tokenizer's EOS id (its config's ``eos_token``, else a usual EOS name), or None.

        Raises:
            TokenizerError: ``tokenizer_config.json`` names an EOS token the vocabulary lacks.
        """
        if self._eos_problem:
            raise TokenizerError(self._eos_problem)
        return self._eos_id

    @property
    def bos_id(self) -> int | None:
        """The tokenizer's BOS id (its config's ``bos_token``, else an added token named like a BOS), or None.

        Raises:
            TokenizerError: ``tokenizer_config.json`` names a BOS token the vocabulary lacks.
        """
        if self._bos_problem:
            raise TokenizerError(self._bos_problem)
        return self._bos_id

    @property
    def config_path(self) -> Path:
        """Where the ``tokenizer_config.json`` beside the ``tokenizer.json`` is (it may not exist)."""
        return self._path.parent / "tokenizer_config.json"

    def _read_config(self) -> dict[str, Any]:
        """The ``tokenizer_config.json`` beside the ``tokenizer.json``, or ``{}`` when there is none."""
        path = self.config_path
        if not path.is_file():
            return {}
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, OSError) as e:
            raise TokenizerError(f"{path}: not a valid tokenizer_config.json ({e})") from None
        if not isinstance(config, dict):
            raise TokenizerError(f"{path}: not a valid tokenizer_config.json (a {type(config).__name__})")
        return config

    def config_token(self, key: str) -> str | None:
        """The string of the config's special token ``key`` (``bos_token``, ``eos_token``), or None."""
        token = self._config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        return token if isinstance(token, str) else None

    def _find_special(self, key: str, names: tuple[str, ...], *, added_only: bool) -> tuple[int | None, str]:
        """The id of the config's ``key`` token, else of the first of ``names`` in the vocabulary (among the
        added tokens only with ``added_only``); and a problem to raise when the config's token is unknown."""
        token = self.config_token(key)
        if token is not None:
            token_id = self._tok.token_to_id(token)
            if token_id is None:
                kind = key.split("_")[0]
                return None, (
                    f"{self.config_path}: {key} {token!r} is not in the vocabulary of {self._path}; fix the "
                    f"config, or give the {kind.upper()} id explicitly ({kind}_id=N)"
                )
            return token_id, ""
        added = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}
        for name in names:
            token_id = added.get(name) if added_only else self._tok.token_to_id(name)
            if token_id is not None:
                return token_id, ""
        return None, ""

    def fingerprint(self) -> dict[str, Any]:
        """See :class:`Tokenizer`."""
        digest = hashlib.sha256(self._definition).hexdigest()
        return {"kind": "hf", "name": self._path.name, "vocab_size": self.vocab_size, "sha256": digest}

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """See :class:`Tokenizer`."""
        return self.engine.encode_batch(texts)

    def encode_specials(self, texts: list[str]) -> list[np.ndarray]:
        """See :class:`Tokenizer`.

        ``encode_special_tokens`` is a setting of the tokenizer object, shared by the threads encoding with
        it, so special tokens are parsed by a second instance, loaded on first use (chat builds only).
        """
        with self._parsing_lock:
            if self._parsing is None:
                from tokenizers import Tokenizer as _Tokenizer

                self._parsing = _Tokenizer.from_str(self._definition.decode("utf-8"))
                _text_is_whole(self._parsing)
        encodings = self._parsing.encode_batch(texts, add_special_tokens=False)
        return [np.frombuffer(array.array("I", e.ids), dtype=np.uint32) for e in encodings]

    @property
    def config(self) -> dict[str, Any]:
        """The ``tokenizer_config.json`` beside the ``tokenizer.json`` (``{}`` when there is none)."""
        return dict(self._config)

    def decode(self, ids: Iterable[int]) -> str:
        """See :class:`Tokenizer`."""
        return self._tok.decode(list(ids), skip_special_tokens=False)


class TiktokenTokenizer:
    """A tiktoken encoding built from a local ranks file and its JSON sidecar (pattern, special tokens).

    Its reference engine is tiktoken itself: ``encode_ordinary``, or with every special token allowed when
    they are parsed.
    """

    fast_piece_chars: int | None = None  # measured: pieces encode no faster (benchmarks/bench_pieces.py)

    def __init__(
        self,
        spec: str,
        *,
        threads: int | None = None,
        special_tokens: SpecialTokens = "text",
        engine: TokenizerEngine = "auto",
    ) -> None:
        try:
            import tiktoken
        except ImportError:
            raise MissingDependencyError(
                "the tiktoken backend needs the tiktoken package: pip install 'streampack[tiktoken]'"
            ) from None
        ranks = Path(spec.removeprefix("tiktoken:"))
        if not ranks.name:
            raise TokenizerError(
                f"tokenizer {spec!r}: no ranks file named; pass tiktoken:/path/to/NAME.tiktoken"
            )
        sidecar = ranks.with_suffix(".json")
        if not ranks.is_file():
            raise TokenizerError(
                f"tokenizer {spec!r}: no ranks file at {ranks}; pass tiktoken:/path/to/NAME.tiktoken "
                "(streampack never downloads one)"
            )
        if not sidecar.is_file():
            raise TokenizerError(
                f"tokenizer {spec!r}: {sidecar} is missing; it holds the encoding's 'pat_str' and "
                "'special_tokens' (JSON)"
            )
        self.spec = spec
        self._definition = ranks.read_bytes() + sidecar.read_bytes()
        try:
            mergeable_ranks = _read_ranks(ranks)
        except ValueError as e:
            raise TokenizerError(str(e)) from None
        pattern, specials, n_vocab = _read_sidecar(sidecar, mergeable_ranks)
        try:
            self._enc = tiktoken.Encoding(
                ranks.stem,
                pat_str=pattern,
                mergeable_ranks=mergeable_ranks,
                special_tokens=specials,
                explicit_n_vocab=n_vocab,
            )
        except (ValueError, KeyError, TypeError, OverflowError) as e:
            raise TokenizerError(f"tokenizer {spec!r}: cannot load ({type(e).__name__}: {e})") from None
        self._name = ranks.stem
        self.vocab_size = self._enc.n_vocab
        self.eos_id = next((specials[n] for n in EOS_NAMES if n in specials), None)
        self.bos_id: int | None = None  # a ranks file says nothing of a BOS: give bos_id
        self._allowed = set(specials) if special_tokens == "parse" else set()
        self.cut_safety = tiktoken_cut_safety(pattern, specials, parse_special=special_tokens == "parse")
        self._reference = TiktokenEngine(self._enc, allowed=self._allowed, threads=threads)
        definition = (ranks, mergeable_ranks, pattern, specials)
        self.engine: Engine
        self.engine, self.engine_reason = self._choose_engine(engine, threads, definition)

    def _choose_engine(
        self,
        choice: TokenizerEngine,
        threads: int | None,
        definition: tuple[Path, dict[bytes, int], str, dict[str, int]],
    ) -> tuple[Engine, str]:
        """tiktoken, or ``fastokens`` where it is installed and proven to give the same ids in this
        special-token mode; and why."""
        if choice == "tokenizers":
            raise _wrong_engine(self.spec, choice, "a tiktoken encoding", "tiktoken and fastokens")
        fastokens = _import_fastokens(needed=choice == "fastokens") if choice != "tiktoken" else None
        if fastokens is None:
            return self._reference, _reference_reason(choice, fastokens)
        ranks, mergeable_ranks, pattern, specials = definition

        def load() -> Any:
            if pattern in GPT2_SPLIT_PATTERNS:  # its fastest form: see streampack.tokenizer.tiktoken_json
                return fastokens.Tokenizer.from_json_str(byte_level_json(mergeable_ranks, specials))
            return fastokens.Tokenizer.from_tiktoken(str(ranks), pattern=pattern, special_tokens=specials)

        return _fastokens_or_reference(
            self._reference,
            choice,
            fastokens_mismatch_tiktoken(pattern, specials, parse_special=bool(self._allowed)),
            load,
            split_special=not self._allowed,
            threads=threads,
            refusal=f"{ranks}: fastokens is not known to give this encoding's ids",
        )

    @property
    def cores_per_worker(self) -> int:
        """See :class:`Tokenizer`."""
        return self.engine.cores_per_worker

    def reference_engine(self) -> Engine:
        """The engine that defines this tokenizer's ids: tiktoken."""
        return self._reference

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("TiktokenTokenizer is not picklable: load it in each process from its spec")

    def fingerprint(self) -> dict[str, Any]:
        """See :class:`Tokenizer`."""
        digest = hashlib.sha256(self._definition).hexdigest()
        return {"kind": "tiktoken", "name": self._name, "vocab_size": self.vocab_size, "sha256": digest}

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """See :class:`Tokenizer`. Encodes as ``encode_ordinary`` unless special tokens are parsed."""
        return self.engine.encode_batch(texts)

    def encode_specials(self, texts: list[str]) -> list[np.ndarray]:
        """See :class:`Tokenizer`."""
        batch = self._enc.encode_batch(texts, allowed_special="all", disallowed_special=())
        return [np.array(ids, dtype=np.uint32) for ids in batch]

    def decode(self, ids: Iterable[int]) -> str:
        """See :class:`Tokenizer`."""
        return self._enc.decode(list(ids))


def _read_sidecar(path: Path, ranks: dict[bytes, int]) -> tuple[str, dict[str, int], int | None]:
    """The split pattern, special tokens and explicit vocabulary size of a tiktoken sidecar, validated."""
    try:
        meta = json.loads(path.read_bytes())
    except ValueError as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("pat_str"), str):
        raise TokenizerError(f"{path}: needs a 'pat_str' string (the encoding's split pattern)")
    specials = meta.get("special_tokens", {})
    if not isinstance(specials, dict):
        raise TokenizerError(
            f"{path}: 'special_tokens' must be an object of token string -> id (got a "
            f"{type(specials).__name__})"
        )
    taken = set(ranks.values())
    for token, token_id in specials.items():
        if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < 1 << 32:
            raise TokenizerError(
                f"{path}: special_tokens[{token!r}] = {token_id!r} is not an id in [0, 2**32)"
            )
        if token_id in taken:
            raise TokenizerError(
                f"{path}: special_tokens[{token!r}] = {token_id} is also the rank of a regular token; "
                "give the special token an id of its own"
            )
    n_vocab = meta.get("explicit_n_vocab")
    real = max([*taken, *specials.values()], default=-1) + 1
    if n_vocab is not None and n_vocab != real:
        raise TokenizerError(
            f"{path}: explicit_n_vocab is {n_vocab!r}, but the ranks and special tokens make {real} ids; "
            "fix it or leave it out"
        )
    return meta["pat_str"], specials, n_vocab


def _read_ranks(path: Path) -> dict[bytes, int]:
    """Parse a ``.tiktoken`` ranks file (``base64-token rank`` per line).

    Read here rather than with ``tiktoken.load.load_tiktoken_bpe``, which serves a copy cached under the
    temp directory by path: an edited ranks file would then not be the one the manifest fingerprints.
    """
    ranks = {}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if line.strip():
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error):
                raise ValueError(f"{path}:{number}: expected 'base64-token rank'") from None
    return ranks

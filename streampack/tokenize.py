"""Tokenizers behind one small interface, batch encoding, and the splitting of very long documents.

Three kinds, chosen by a SPEC string:

- ``bytes``: built in, needs no files. Token ids are the UTF-8 bytes (0-255); EOS is 256.
- a Hugging Face ``tokenizer.json`` path, or a folder holding one (``tokenizers.Tokenizer``).
- ``tiktoken:PATH``: a local tiktoken ranks file ``PATH`` (``NAME.tiktoken``) with its split pattern and
  special tokens in ``NAME.json`` beside it. Nothing is ever downloaded.

A document's tokens are ``encode(text)`` without the post-processor's special tokens (no BOS/CLS
template); the builder appends the EOS id itself. Documents longer than ``max_piece_chars`` are split into
pieces before encoding, to bound the tokenizer's memory and let its threads share a long document, and
where the cuts keep the tokens, also into pieces of about ``fast_piece_chars`` for a tokenizer that
encodes short texts faster; see :func:`split_text` for what that changes and :func:`piece_rule` for the
defaults.
"""

from __future__ import annotations

import array
import base64
import binascii
import hashlib
import json
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from streampack.errors import MissingDependencyError, OptionsError, TokenizerError

EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "[SEP]")
# Piece sizes: small where a cut keeps the tokens (see default_max_piece_chars), else large, so cuts are rare.
EXACT_CUT_PIECE_CHARS = 100_000
INEXACT_CUT_PIECE_CHARS = 1_000_000


class Tokenizer(Protocol):
    """What the builder needs of a tokenizer."""

    spec: str
    vocab_size: int
    eos_id: int | None
    # One process of it keeps every core busy (its batch call runs on threads of its own and the Python
    # work around it is small next to the encoding); see streampack.build.default_workers.
    saturates_cores: bool
    # Where cuts keep its tokens, documents are cut into pieces of about this many characters because it
    # encodes them faster than whole documents (None: no such cuts); see piece_rule.
    fast_piece_chars: int | None

    def fingerprint(self) -> dict[str, Any]:
        """Kind, name, vocab size and a hash of the definition: identifies the tokenizer in a manifest."""
        ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text (no special tokens added), as integer arrays."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a sequence of ids."""
        ...


def load_tokenizer(spec: str, *, threads: int | None = None) -> Tokenizer:
    """Load a tokenizer from its SPEC (see the module docstring).

    Args:
        spec: ``bytes``, a ``tokenizer.json`` path or folder, or ``tiktoken:PATH``.
        threads: threads used to encode a batch (tiktoken; Hugging Face uses its own pool).

    Raises:
        StreampackError: the spec names no usable tokenizer.
    """
    if spec == "bytes":
        return BytesTokenizer()
    if spec.startswith("tiktoken:"):
        return TiktokenTokenizer(spec, threads=threads)
    return HFTokenizer(spec)


@dataclass(frozen=True)
class EosPolicy:
    """Whether an EOS id is appended after every document, and which."""

    append: bool
    id: int | None

    def to_json(self) -> dict[str, Any]:
        """Manifest representation."""
        return {"append": self.append, "id": self.id}


def resolve_eos(tokenizer: Tokenizer, *, eos: bool, eos_id: int | None) -> EosPolicy:
    """Decide the EOS policy from the options and the tokenizer's own EOS token.

    Raises:
        StreampackError: EOS is wanted but neither given nor known to the tokenizer.
    """
    if not eos:
        return EosPolicy(False, None)
    if eos_id is not None:
        if eos_id < 0 or eos_id >= 1 << 32:
            raise OptionsError(f"--eos-id must be in [0, 2**32) (got {eos_id})")
        return EosPolicy(True, eos_id)
    if tokenizer.eos_id is None:
        raise TokenizerError(
            f"tokenizer {tokenizer.spec!r} has no EOS token that streampack recognises "
            f"(looked for {', '.join(EOS_NAMES)}); pass --eos-id N, or --no-eos to append none"
        )
    return EosPolicy(True, tokenizer.eos_id)


class BytesTokenizer:
    """UTF-8 bytes as token ids 0-255, with EOS = 256. Needs no files; the built-in default."""

    spec = "bytes"
    vocab_size = 257
    eos_id: int | None = 256
    saturates_cores = False
    fast_piece_chars: int | None = None  # encoding bytes costs the same per character at any length

    def fingerprint(self) -> dict[str, Any]:
        """See :class:`Tokenizer`."""
        return {"kind": "bytes", "name": "bytes", "vocab_size": self.vocab_size, "sha256": "bytes-v1"}

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """See :class:`Tokenizer`."""
        return [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """See :class:`Tokenizer`; ids above 255 (EOS) are left out."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from a local ``tokenizer.json``."""

    saturates_cores = True
    # Its batch call encodes 100 MB of the real corpus 1.17x as fast in 10,000-character pieces as in whole
    # documents (5,000: 1.16x; 20,000: 1.14x; GPT-2, 2 cores; benchmarks/bench_pieces.py).
    fast_piece_chars: int | None = 10_000

    def __init__(self, spec: str) -> None:
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
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.eos_id = self._find_eos()
        self._encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)

    def _find_eos(self) -> int | None:
        config = self._path.parent / "tokenizer_config.json"
        if config.is_file():
            try:
                eos = json.loads(config.read_text()).get("eos_token")
            except (ValueError, AttributeError) as e:
                raise TokenizerError(f"{config}: not a valid tokenizer_config.json ({e})") from None
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if isinstance(eos, str) and self._tok.token_to_id(eos) is not None:
                return self._tok.token_to_id(eos)
        for name in EOS_NAMES:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    def fingerprint(self) -> dict[str, Any]:
        """See :class:`Tokenizer`."""
        digest = hashlib.sha256(self._definition).hexdigest()
        return {"kind": "hf", "name": self._path.name, "vocab_size": self.vocab_size, "sha256": digest}

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """See :class:`Tokenizer`."""
        encodings = self._encode(texts, add_special_tokens=False)
        # array('I') copies the Python int list in C at ~60% of np.array's cost; this runs under the GIL.
        return [np.frombuffer(array.array("I", e.ids), dtype=np.uint32) for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        """See :class:`Tokenizer`."""
        return self._tok.decode(list(ids), skip_special_tokens=False)


class TiktokenTokenizer:
    """A tiktoken encoding built from a local ranks file and its JSON sidecar (pattern, special tokens)."""

    saturates_cores = False  # 3-4 M tokens/s: reading and framing in one process would hold it back
    fast_piece_chars: int | None = None  # measured: pieces encode no faster (benchmarks/bench_pieces.py)

    def __init__(self, spec: str, *, threads: int | None = None) -> None:
        try:
            import tiktoken
        except ImportError:
            raise MissingDependencyError(
                "the tiktoken backend needs the tiktoken package: pip install 'streampack[tiktoken]'"
            ) from None
        ranks = Path(spec.removeprefix("tiktoken:"))
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
            meta = json.loads(sidecar.read_text())
            self._enc = tiktoken.Encoding(
                ranks.stem,
                pat_str=meta["pat_str"],
                mergeable_ranks=_read_ranks(ranks),
                special_tokens=meta.get("special_tokens", {}),
                explicit_n_vocab=meta.get("explicit_n_vocab"),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise TokenizerError(f"tokenizer {spec!r}: cannot load ({type(e).__name__}: {e})") from None
        self._name = ranks.stem
        self.vocab_size = self._enc.n_vocab
        self.eos_id = next(
            (self._enc._special_tokens[n] for n in EOS_NAMES if n in self._enc._special_tokens), None
        )
        self._threads = threads or 1
        self._pool = ThreadPoolExecutor(self._threads) if self._threads > 1 else None
        core = getattr(self._enc, "_core_bpe", None)
        self._to_buffer = getattr(core, "encode_to_tiktoken_buffer", None)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("TiktokenTokenizer is not picklable: load it in each process from its spec")

    def fingerprint(self) -> dict[str, Any]:
        """See :class:`Tokenizer`."""
        digest = hashlib.sha256(self._definition).hexdigest()
        return {"kind": "tiktoken", "name": self._name, "vocab_size": self.vocab_size, "sha256": digest}

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """See :class:`Tokenizer`. Encodes as ``encode_ordinary``: special-token text is plain text."""
        if self._to_buffer is None:  # older tiktoken: the public batch call, then a list-to-array copy
            return [np.array(ids, dtype=np.uint32) for ids in self._enc.encode_ordinary_batch(texts)]
        if self._pool is None:
            return [self._encode_one(t) for t in texts]
        return list(self._pool.map(self._encode_one, texts))

    def _encode_one(self, text: str) -> np.ndarray:
        # No allowed specials makes this encode_ordinary, returning ids in a buffer: no Python int list.
        assert self._to_buffer is not None, "encode_batch checks for it"
        return np.frombuffer(self._to_buffer(text, set()), dtype=np.uint32)

    def decode(self, ids: Iterable[int]) -> str:
        """See :class:`Tokenizer`."""
        return self._enc.decode(list(ids))


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


# ---------------------------------------------------------------------------------------------- long texts


def split_text(text: str, max_chars: int, target_chars: int | None = None) -> Iterator[str]:
    """Split ``text`` into pieces of at most ``max_chars`` characters at boundaries that keep the tokens.

    A piece ends just before a single space that has a non-space on both sides (``"... word| next"``).
    Byte-level BPE tokenizers with a regex pre-tokenizer (GPT-2, tiktoken's encodings, most
    ``tokenizer.json`` files of that family) split there anyway, so the pieces encode to exactly the tokens
    of the whole text. With ``target_chars``, texts are also cut at such a space near every
    ``target_chars`` characters (the last one before, else the first one after, within ``max_chars``),
    because small pieces encode faster; where there is none, the text stays whole up to ``max_chars``.
    Only a text with no such space in a window of ``max_chars // 2`` characters is cut otherwise: after a
    newline, and failing that at ``max_chars`` exactly. Those rare cuts (and any cut of a tokenizer without
    such a pre-tokenizer, e.g. SentencePiece's prefix space) can change the tokens next to the cut.
    """
    start = 0
    while (cut := _next_cut(text, start, max_chars, target_chars)) is not None:
        yield text[start:cut]
        start = cut
    yield text[start:] if start else text


def stream_pieces(chunks: Iterable[str], max_chars: int, target_chars: int | None = None) -> Iterator[str]:
    """:func:`split_text` over text that arrives in chunks: the same pieces, ~``max_chars`` held at once."""
    buffer = ""
    for chunk in chunks:
        buffer += chunk
        start = 0
        while len(buffer) - start > max_chars:  # the whole window of the next cut is here
            cut = _next_cut(buffer, start, max_chars, target_chars)
            assert cut is not None, "a text longer than max_chars is always cut"
            yield buffer[start:cut]
            start = cut
        buffer = buffer[start:]
    yield from split_text(buffer, max_chars, target_chars)


@dataclass(frozen=True)
class PieceRule:
    """How documents are cut into pieces before encoding: see :func:`split_text`."""

    max_chars: int
    target_chars: int | None = None

    def split(self, text: str) -> Iterator[str]:
        """The pieces of ``text``."""
        return split_text(text, self.max_chars, self.target_chars)

    def stream(self, chunks: Iterable[str]) -> Iterator[str]:
        """The pieces of the text made of ``chunks``."""
        return stream_pieces(chunks, self.max_chars, self.target_chars)


def piece_rule(tokenizer: Tokenizer, max_chars: int | None = None) -> PieceRule:
    """The piece rule for ``tokenizer``: its fast piece size where cuts keep its tokens, within ``max_chars``.

    ``max_chars`` defaults to :func:`default_max_piece_chars`.
    """
    exact = cuts_keep_tokens(tokenizer)
    limit = max_chars or (EXACT_CUT_PIECE_CHARS if exact else INEXACT_CUT_PIECE_CHARS)
    target = tokenizer.fast_piece_chars if exact else None
    return PieceRule(limit, target if target is not None and target < limit else None)


def default_max_piece_chars(tokenizer: Tokenizer) -> int:
    """The piece size for ``tokenizer``: 100,000 characters if cuts keep its tokens, else 1,000,000.

    Small pieces bound the tokenizer's memory (its per-character bookkeeping is ~20x the text) and let
    its threads share a long document: on the real benchmark corpus (GPT-2, 2 cores) a build holds 0.23
    GB of RSS with 100,000-character pieces against 0.5 GB with 1,000,000. Where a cut could change the
    tokens (see :func:`cuts_keep_tokens`), pieces stay large, so that cuts happen only in documents of
    over a million characters.
    """
    return piece_rule(tokenizer).max_chars


_CUT_PROBES = (
    "Hello world, it's 2024: 12345 apples cost $3.50 (not 4). Don't stop!\nA new line\tand a tab.",
    "naïve café déjà-vu Ünïcödé 漢字かな交じり文 テスト 한국어 😀 emoji 👍🏽 end",
    "def f(x):\n    return x ** 2  # two  spaces\n\nclass A: pass ;;; ... --- === +++",
    "'s 're 've 'm 'll 'd 'S THE END. a b c d e 1 2 3 <|endoftext|> [CLS] </s> x",
)


def cuts_keep_tokens(tokenizer: Tokenizer) -> bool:
    """Whether cutting before a single space between non-spaces keeps ``tokenizer``'s tokens.

    Checked on probe texts cut at every such space at once: true for byte-level BPE with a regex
    pre-tokenizer (GPT-2, Llama 3, tiktoken's encodings) and for ``bytes``; false for tokenizers that add
    a prefix space to every input (SentencePiece-style, e.g. Llama 2).
    """
    for text in _CUT_PROBES:
        cuts = [i for i in range(1, len(text) - 1) if _is_safe_space(text, i)]
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        whole, *parts = tokenizer.encode_batch([text, *pieces])
        if not np.array_equal(whole, np.concatenate(parts)):
            return False
    return True


def _is_safe_space(text: str, i: int) -> bool:
    return text[i] == " " and not text[i - 1].isspace() and not text[i + 1].isspace()


def _next_cut(text: str, start: int, max_chars: int, target_chars: int | None) -> int | None:
    """Where the piece that begins at ``start`` ends; ``None`` if it is the last one."""
    rest = len(text) - start
    if target_chars is not None and rest > target_chars:
        hi = min(start + max_chars, len(text) - 1)
        cut = _safe_space_near(text, start + target_chars // 2, start + target_chars, hi)
        if cut is not None:
            return cut
    return _safe_cut(text, start, start + max_chars) if rest > max_chars else None


def _safe_space_near(text: str, lo: int, target: int, hi: int) -> int | None:
    """A safe space in ``(lo, hi)``: the last one up to ``target``, else the first one after it."""
    i = text.rfind(" ", lo + 1, min(target + 1, hi))
    while i > lo:
        if _is_safe_space(text, i):
            return i
        i = text.rfind(" ", lo + 1, i)
    i = text.find(" ", target + 1, hi)
    while i != -1:
        if _is_safe_space(text, i):
            return i
        i = text.find(" ", i + 1, hi)
    return None


def _safe_cut(text: str, lo: int, hi: int) -> int:
    """Index in ``(lo, hi]`` to cut ``text`` at; see :func:`split_text`. Requires ``hi < len(text)``."""
    floor = lo + (hi - lo) // 2
    i = text.rfind(" ", floor, hi)
    while i > floor:
        if _is_safe_space(text, i):
            return i
        i = text.rfind(" ", floor, i)
    i = text.rfind("\n", floor, hi)
    return i + 1 if i > floor else hi

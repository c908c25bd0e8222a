"""Load a tokenizer from its SPEC string.

Three kinds, chosen by the SPEC:

- ``bytes``: built in, needs no files. Token ids are the UTF-8 bytes (0-255); EOS is 256.
- a Hugging Face ``tokenizer.json`` path, or a folder holding one (``tokenizers.Tokenizer``).
- ``tiktoken:PATH``: a local tiktoken ranks file ``PATH`` (``NAME.tiktoken``) with its split pattern and
  special tokens in ``NAME.json`` beside it. Nothing is ever downloaded.

Which kind a SPEC names is a table (:data:`NAMED`, :data:`PREFIXED`, else :data:`DEFAULT`): a new kind is a
row and its loader, not another branch of :func:`load_tokenizer`.
"""

from __future__ import annotations

from typing import Protocol

from streampack._checks import check_choice
from streampack.errors import TokenizerError
from streampack.tokenizer.base import Tokenizer
from streampack.tokenizer.bytes import BytesTokenizer
from streampack.tokenizer.choices import ENGINE_CHOICES, SPECIAL_TOKENS, SpecialTokens, TokenizerEngine
from streampack.tokenizer.hf import HFTokenizer
from streampack.tokenizer.preload import TIKTOKEN_PREFIX
from streampack.tokenizer.tiktoken import TiktokenTokenizer


class Loader(Protocol):
    """What loads one kind of tokenizer from its SPEC (the options already checked)."""

    def __call__(
        self, spec: str, *, threads: int | None, special_tokens: SpecialTokens, engine: TokenizerEngine
    ) -> Tokenizer: ...


def _load_bytes(
    spec: str, *, threads: int | None, special_tokens: SpecialTokens, engine: TokenizerEngine
) -> Tokenizer:
    """The ``bytes`` tokenizer: it has no files, no threads and no special tokens, and one engine."""
    if engine != "auto":
        raise TokenizerError(
            f"the bytes tokenizer has an engine of its own (got tokenizer_engine={engine!r}); use 'auto'"
        )
    return BytesTokenizer()


#: A SPEC that is one of these names is loaded by its loader.
NAMED: dict[str, Loader] = {"bytes": _load_bytes}
#: Else, a SPEC that starts with one of these prefixes is loaded by its loader (given the whole SPEC).
PREFIXED: dict[str, Loader] = {TIKTOKEN_PREFIX: TiktokenTokenizer}
#: Else, the SPEC is a ``tokenizer.json`` path or a folder holding one.
DEFAULT: Loader = HFTokenizer


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
    load = NAMED.get(spec) or next(
        (loader for prefix, loader in PREFIXED.items() if spec.startswith(prefix)), DEFAULT
    )
    return load(spec, threads=threads, special_tokens=special_tokens, engine=engine)

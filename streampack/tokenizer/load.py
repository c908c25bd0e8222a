"""Load a tokenizer from its SPEC string: ``bytes`` (built in), ``tiktoken:PATH`` (a local ranks file with
its ``NAME.json`` sidecar beside it), else a Hugging Face ``tokenizer.json`` or a folder holding one.
Nothing is ever downloaded."""

from __future__ import annotations

from streampack._checks import check_choice
from streampack.errors import TokenizerError
from streampack.tokenizer.base import Tokenizer
from streampack.tokenizer.bytes import BytesTokenizer
from streampack.tokenizer.choices import ENGINE_CHOICES, SPECIAL_TOKENS, SpecialTokens, TokenizerEngine
from streampack.tokenizer.hf import HFTokenizer
from streampack.tokenizer.preload import TIKTOKEN_PREFIX
from streampack.tokenizer.tiktoken import TiktokenTokenizer


def load_tokenizer(
    spec: str,
    *,
    threads: int | None = None,
    special_tokens: SpecialTokens = "text",
    engine: TokenizerEngine = "auto",
) -> Tokenizer:
    """Load a tokenizer from its SPEC.

    Args:
        spec: ``bytes``, a ``tokenizer.json`` path or folder, or ``tiktoken:PATH``.
        threads: threads used to encode a batch (tiktoken; Hugging Face uses its own pool).
        special_tokens: ``text`` encodes special-token strings as plain text; ``parse`` as their ids.
        engine: what computes the ids: ``auto`` (the fastest engine known to give exactly the reference
            engine's ids for this tokenizer), ``tokenizers``, ``tiktoken``, ``fastokens`` or ``gigatoken``.

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
    load = TiktokenTokenizer if spec.startswith(TIKTOKEN_PREFIX) else HFTokenizer
    return load(spec, threads=threads, special_tokens=special_tokens, engine=engine)

"""The fixed choices of a tokenizer, written once: how special-token strings are read, which engine runs."""

from __future__ import annotations

from typing import Literal, get_args

SpecialTokens = Literal["text", "parse"]
TokenizerEngine = Literal["auto", "tokenizers", "tiktoken", "fastokens", "gigatoken"]
SPECIAL_TOKENS: tuple[SpecialTokens, ...] = get_args(SpecialTokens)
ENGINE_CHOICES: tuple[TokenizerEngine, ...] = get_args(TokenizerEngine)

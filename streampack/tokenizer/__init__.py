"""Tokenizers: text becomes ids, exactly as the tokenizer's own library gives them.

``load`` loads one from its SPEC; ``engines`` computes the ids (the reference libraries, and the fast
engine where ``proofs`` proves it exact); ``pieces`` cuts long texts where the cut cannot change the ids.
The names here are loaded on first use, so that ``preload`` imports nothing but the standard library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streampack.tokenizer.base import Tokenizer
    from streampack.tokenizer.load import load_tokenizer

__all__ = ["Tokenizer", "load_tokenizer"]

_PUBLIC = {"Tokenizer": "streampack.tokenizer.base", "load_tokenizer": "streampack.tokenizer.load"}


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])

"""The forms in which the fast engine (``fastokens``) runs a tiktoken encoding fastest, and loads it fastest.

* GPT-2's pattern (r50k, p50k): the ``tokenizer.json`` of :mod:`streampack.tokenizer.tiktoken_json`, whose
  ByteLevel pre-tokenizer fastokens splits with hand-written code (3x ``from_tiktoken``'s general regex on
  the 12 MB sample corpus).
* cl100k_base's and o200k_base's patterns: ``Tokenizer.from_tiktoken`` with the *caseless* spelling of the
  pattern (Llama 3's for cl100k), which fastokens recognises and splits with hand-written code too (2-3x the
  general regex it runs on the sidecars' spelling). It reads the ranks natively, without the GIL: 0.5 s of
  CPU for cl100k and 1.4 s for o200k, against 1.5-1.9 s and 4.5-5.5 s for the same ranks written as a
  ``tokenizer.json`` with every merge (233,000 and 446,000), generated in Python and parsed; and its ids are
  BPE over the ranks, tiktoken's own rule.
* any other pattern (none is proven exact today: :mod:`streampack.tokenizer.proofs`): ``from_tiktoken``
  with the pattern itself, which fastokens runs with its general regex.

The hand-written splitters fold the contractions' ASCII cases only: exactly the spelling with the cases
listed (measured, tests/test_tiktoken_fast.py). The caseless spellings, as tiktoken runs them, also fold
U+017F (long s) to s, so with those, texts holding it go to tiktoken (:attr:`FastSplit.exact_for`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streampack.tokenizer.pieces import (
    CL100K_CASELESS,
    CL100K_LISTED,
    GPT2_SPLIT_PATTERNS,
    O200K_CASELESS,
    O200K_LISTED,
)


@dataclass(frozen=True)
class FastSplit:
    """How fastokens splits a tiktoken pattern fast: ``pattern``, the spelling it splits with hand-written
    code, and the characters (``exact_for``) whose texts go to tiktoken instead, where the two patterns may
    split apart."""

    pattern: str
    exact_for: str = ""


_FAST_SPLITS = {
    CL100K_LISTED: FastSplit(CL100K_CASELESS),
    O200K_LISTED: FastSplit(O200K_CASELESS),
    CL100K_CASELESS: FastSplit(CL100K_CASELESS, exact_for="\u017f"),
    O200K_CASELESS: FastSplit(O200K_CASELESS, exact_for="\u017f"),
}


def fast_split(pattern: str) -> FastSplit | None:
    """The fast form of tiktoken's split ``pattern`` in fastokens, where it has one (cl100k's, o200k's)."""
    return _FAST_SPLITS.get(pattern)


def load_fast_tiktoken(
    fastokens: Any,
    ranks_file: Path,
    ranks: Mapping[bytes, int],
    pattern: str,
    special_tokens: Mapping[str, int],
) -> Any:
    """The ``fastokens.Tokenizer`` of a tiktoken encoding in its fastest form (see the module docstring).

    Args:
        fastokens: the ``fastokens`` module.
        ranks_file: the ``.tiktoken`` file, which ``from_tiktoken`` reads itself.
        ranks: its ranks, already read (for GPT-2's pattern, written as a ``tokenizer.json``).
        pattern: the encoding's split pattern.
        special_tokens: its special tokens and their ids.
    """
    if pattern in GPT2_SPLIT_PATTERNS:
        # imported here: the preload imports this module before the command's imports, orjson among them
        from streampack.tokenizer.tiktoken_json import byte_level_json

        return fastokens.Tokenizer.from_json_str(byte_level_json(ranks, special_tokens))
    split = fast_split(pattern)
    if split is None:
        return fastokens.Tokenizer.from_tiktoken(
            str(ranks_file), pattern=pattern, special_tokens=dict(special_tokens)
        )
    return load_split_tiktoken(fastokens, ranks_file, split, special_tokens)


def load_split_tiktoken(
    fastokens: Any, ranks_file: Path, split: FastSplit, special_tokens: Mapping[str, int]
) -> Any:
    """The ``fastokens.Tokenizer`` of a tiktoken encoding whose split it runs by hand-written code
    (``split``): ``from_tiktoken``, which reads the ranks file itself, without the GIL."""
    return fastokens.Tokenizer.from_tiktoken(
        str(ranks_file), pattern=split.pattern, special_tokens=dict(special_tokens)
    )

"""The forms in which the fast engine (``fastokens``) runs and loads a tiktoken encoding fastest.

* GPT-2's pattern: the ``tokenizer.json`` of :mod:`streampack.tokenizer.tiktoken_json`, whose ByteLevel
  pre-tokenizer fastokens splits with hand-written code (3x its general regex).
* cl100k_base's and o200k_base's patterns: ``from_tiktoken`` with the *caseless* spelling of the pattern,
  which fastokens also splits by hand-written code (2-3x), reading the ranks natively without the GIL.
  Those spellings also fold U+017F (long s) to s, so texts holding it go to tiktoken
  (:attr:`FastSplit.exact_for`).
* any other pattern: ``from_tiktoken`` with the pattern itself (its general regex).
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
    """The spelling of a tiktoken pattern that fastokens splits by hand-written code, and the characters
    whose texts go to tiktoken instead (where the two spellings may split apart)."""

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
    ranks: Mapping[bytes, int] | None,
    pattern: str,
    special_tokens: Mapping[str, int],
) -> Any:
    """The ``fastokens.Tokenizer`` of a tiktoken encoding in its fastest form (see the module docstring);
    ``ranks``, already read, are needed for GPT-2's pattern only."""
    if pattern in GPT2_SPLIT_PATTERNS:
        assert ranks is not None, "GPT-2's pattern needs the ranks"
        # imported here: the preload imports this module before the command's imports, orjson among them
        from streampack.tokenizer.tiktoken_json import byte_level_json

        return fastokens.Tokenizer.from_json_str(byte_level_json(ranks, special_tokens))
    split = fast_split(pattern)
    return fastokens.Tokenizer.from_tiktoken(
        str(ranks_file),
        pattern=pattern if split is None else split.pattern,
        special_tokens=dict(special_tokens),
    )

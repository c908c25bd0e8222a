"""A tiktoken encoding with GPT-2's split pattern, written as the ``tokenizer.json`` that gives its ids.

fastokens encodes a GPT-2 ``tokenizer.json`` (a ByteLevel pre-tokenizer, whose built-in regex is GPT-2's
pattern) ~10x faster than the same vocabulary loaded from tiktoken ranks, which it splits with a general
regex engine (345 MB of English: 2.0 s against ~12 s on 2 cores). So GPT-2-pattern ranks are handed to it
in that form. The ranks become:

* the vocabulary: each token's bytes in the ByteLevel alphabet (every byte a printable character);
* the merges: for every token of two or more bytes, every split into two tokens of the vocabulary, ranked by
  the token's rank (then the halves' ranks). tiktoken merges, at each step, the adjacent pair whose join has
  the lowest rank; byte-level BPE merges the pair with the lowest merge rank: with every pair ranked as its
  join, both pick the same pair. This is how Hugging Face converts tiktoken encodings; the build still
  re-encodes a sample with tiktoken itself (``verify_tokens``) and the tests compare whole caches.

cl100k_base and o200k_base get the same treatment, with their pattern as a ``Split`` pre-tokenizer before a
ByteLevel one that only maps bytes: fastokens recognises their caseless spellings (Llama 3's for cl100k)
and splits them with hand-written code too, ~10x its general regex (:func:`fast_split`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from streampack.tokenizer.pieces import CL100K_CASELESS, CL100K_LISTED, O200K_CASELESS, O200K_LISTED


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's map of bytes to printable characters: printable Latin-1 bytes stand for themselves, the
    others for the characters from U+0100 on, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


_BYTE_CHARS = str.maketrans(_byte_alphabet())  # a Latin-1 decoded byte string -> its ByteLevel spelling


def merges_of(ranks: Mapping[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every split of every multi-byte token into two tokens of ``ranks``, in merge order."""
    ranked = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            left_rank, right_rank = ranks.get(left), ranks.get(right)
            if left_rank is not None and right_rank is not None:
                ranked.append((rank, left_rank, right_rank, left, right))
    ranked.sort(key=lambda m: m[:3])
    return [(m[3], m[4]) for m in ranked]


@dataclass(frozen=True)
class FastSplit:
    """How fastokens splits a tiktoken pattern fast: ``pattern`` in the ``tokenizer.json``, and the
    characters (``exact_for``) whose texts go to tiktoken instead, where the two patterns may split apart."""

    pattern: str
    exact_for: str = ""


# fastokens splits the caseless spellings with hand-written code that folds the contractions' ASCII cases
# only: exactly the listed spellings (measured, tests/test_tiktoken_fast.py). The caseless spellings, as
# tiktoken runs them, also fold U+017F (long s) to s, so texts holding it go to tiktoken.
_FAST_SPLITS = {
    CL100K_LISTED: FastSplit(CL100K_CASELESS),
    O200K_LISTED: FastSplit(O200K_CASELESS),
    CL100K_CASELESS: FastSplit(CL100K_CASELESS, exact_for="\u017f"),
    O200K_CASELESS: FastSplit(O200K_CASELESS, exact_for="\u017f"),
}


def fast_split(pattern: str) -> FastSplit | None:
    """The fast form of tiktoken's split ``pattern`` in fastokens, where it has one (cl100k's, o200k's)."""
    return _FAST_SPLITS.get(pattern)


def byte_level_json(
    ranks: Mapping[bytes, int], special_tokens: Mapping[str, int], *, split: str | None = None
) -> str:
    """The ``tokenizer.json`` of a tiktoken encoding (see the module docstring): its pre-tokenizer is GPT-2's
    ByteLevel regex, or ``split`` followed by a ByteLevel mapping of bytes."""
    spelled = {token: token.decode("latin-1").translate(_BYTE_CHARS) for token in ranks}
    definition: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": token_id,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for content, token_id in special_tokens.items()
        ],
        "normalizer": None,
        "pre_tokenizer": _pre_tokenizer(split),
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            # tiktoken takes a piece that is a token whole, before any merge: so does BPE with this set.
            "ignore_merges": True,
            "vocab": {spelled[token]: rank for token, rank in ranks.items()},
            "merges": [[spelled[left], spelled[right]] for left, right in merges_of(ranks)],
        },
    }
    return orjson.dumps(definition).decode("utf-8")


def _pre_tokenizer(split: str | None) -> dict[str, Any]:
    """GPT-2's ByteLevel pre-tokenizer, or the ``split`` regex then ByteLevel without its own regex."""
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": split is None,
    }
    if split is None:
        return byte_level
    regex = {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False}
    return {"type": "Sequence", "pretokenizers": [regex, byte_level]}

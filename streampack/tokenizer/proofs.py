"""Where the fast engines (``gigatoken``, ``fastokens``) are proven to give a tokenizer's ids: for each
special-token mode, the structure of a ``tokenizer.json`` or of a tiktoken encoding that each is known to
reproduce exactly, and why not where it is not (measured in tests/test_tokenizer_engines.py and
tests/test_gigatoken.py).
"""

from __future__ import annotations

from typing import Any, Literal

from streampack.tokenizer.pieces import (
    CL100K_CASELESS,
    CL100K_LISTED,
    GPT2_SPLIT_PATTERNS,
    O200K_CASELESS,
    O200K_LISTED,
    PROVEN_SPLIT_PATTERNS,
)


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


def gigatoken_mismatch_hf(structure: dict[str, Any], *, parse_special: bool) -> str:
    """Why ``gigatoken`` may not give a ``tokenizer.json``'s ids in a special-token mode; ``""`` when it is
    proven to.

    gigatoken always matches the added tokens in the text, so text mode runs a form of the file without
    them (:func:`streampack.tokenizer.hf.gigatoken_form`); that form is exact under the conditions that make
    fastokens exact in text mode (the same byte-level BPE). In parse mode it matches them as ``tokenizers``
    does under fastokens' conditions (lstrip and rstrip included), except a ``single_word`` token, which it
    matches inside words too (measured in tests/test_gigatoken.py).
    """
    problem = fastokens_mismatch_hf(structure, parse_special=parse_special)
    if problem or not parse_special:
        return problem
    word = next((t["content"] for t in structure["added_tokens"] if t["single_word"]), None)
    return (
        ""
        if word is None
        else f"the added token {word!r} is single_word, which gigatoken matches inside words"
    )


# tiktoken's split patterns that gigatoken splits by a scheme of its own, by the name it gives the scheme.
GIGATOKEN_SCHEMES = {
    **dict.fromkeys(GPT2_SPLIT_PATTERNS, "gpt2"),
    CL100K_LISTED: "gpt4",
    CL100K_CASELESS: "gpt4",
    O200K_LISTED: "o200k",
    O200K_CASELESS: "o200k",
}


def tiktoken_mismatch(
    pattern: str, specials: dict[str, int], *, parse_special: bool, engine: Literal["fastokens", "gigatoken"]
) -> str:
    """Why ``engine`` may not give a tiktoken encoding's ids in a special-token mode; ``""`` when its split
    pattern is one the engine is proven on (GPT-2's, cl100k's, o200k's: gigatoken splits them by schemes of
    its own, :data:`GIGATOKEN_SCHEMES`) and, where special tokens are parsed, no two of them could compete
    for the same characters (tiktoken tries them in an order of its own; the engines take the longest).
    In text mode no special token is loaded into the engine, so none can match."""
    proven = GIGATOKEN_SCHEMES if engine == "gigatoken" else PROVEN_SPLIT_PATTERNS
    if pattern not in proven:
        return "its pat_str is not GPT-2's, cl100k's or o200k's"
    if parse_special:
        overlap = _overlapping(list(specials))
        if overlap:
            return f"the special tokens {overlap[0]!r} and {overlap[1]!r} overlap"
    return ""


# The flags of an added token in a tokenizer.json, which decide where it matches.
ADDED_FLAGS = ("special", "lstrip", "rstrip", "single_word", "normalized")


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

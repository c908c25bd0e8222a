"""Cutting long documents into pieces, and proving from a tokenizer's structure which cuts keep its tokens.

Documents are tokenized in pieces to bound the tokenizer's memory, to let its threads share a long
document, and (for Hugging Face ``tokenizers``) because it encodes short texts faster. A cut *keeps the
tokens* when the pieces encode to exactly the tokens of the whole text.

**Speed cuts** go just before a single space that has a non-space on both sides (``"... word| next"``),
and only for a tokenizer whose structure proves that such a cut keeps its tokens (:class:`CutSafety`,
decided by :func:`hf_cut_safety` / :func:`tiktoken_cut_safety`, never from sample texts). The proof is:

1. The normalizer maps each character on its own (none, NFC, NFD, lowercase), so it cannot join
   characters across the cut and keeps a non-space next to the space a non-space.
2. The pre-tokenizer always splits at such a space, whatever surrounds it, and splits each side the same
   alone as in the whole text: whitespace splitters (BERT, ``Whitespace``, ``WhitespaceSplit``,
   ``Metaspace(split=True)``), or a split regex known to have that property (GPT-2's, ``cl100k_base``'s
   (also Llama 3's) and ``o200k_base``'s: in each, a match holds a space only as its first character or
   within a run of whitespace, so no match that starts before the space can reach it, and the patterns
   look neither behind nor, except after whitespace, ahead). Steps that only split further or map
   characters (``ByteLevel`` without its regex, ``Digits``, ``Punctuation``) may be combined with them.
3. The model works on each pre-token alone (BPE without dropout, WordPiece, WordLevel, Unigram), so
   vocabulary entries can never span the cut.
4. Tokens matched on the raw text before all this (added tokens, and special tokens where they are parsed)
   are *atoms*: no cut ever falls inside an occurrence of one (nor, for an ``rstrip`` token, right after
   it, where its match would take the space).

**Memory cuts** bound the size of a piece where there is no such space (a base64 blob, a long CJK run), or
for every cut of a tokenizer without such a proof: after a newline, else at the limit exactly (never inside
an atom). They can change the tokens next to the cut; the builder counts them (``inexact_cuts`` in the
manifest), so a user sees whether any document differs from the tokenizer's own encoding. A tokenizer
whose every cut keeps its tokens (``CutSafety.anywhere``: the bytes tokenizer) counts none.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

# Piece sizes: small where speed cuts keep the tokens, else large, so that memory cuts are rare.
EXACT_CUT_PIECE_CHARS = 100_000
INEXACT_CUT_PIECE_CHARS = 1_000_000

# Split patterns (tiktoken's pat_str, or a tokenizer.json Split regex) with the property of point 2 above.
_CONTRACTIONS = "'s|'S|'t|'T|'re|'rE|'Re|'RE|'ve|'vE|'Ve|'VE|'m|'M|'ll|'lL|'Ll|'LL|'d|'D"
_O200K_LETTERS = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(CONTRACTIONS)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(CONTRACTIONS)?"
)
_O200K_REST = r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_CL100K_REST = r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# GPT-2 (r50k, p50k): the ByteLevel pre-tokenizer's own regex, both spellings.
GPT2_SPLIT_PATTERNS = frozenset(
    {
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
        r"'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    }
)
# cl100k_base and o200k_base, each with its contractions' cases listed (js-tiktoken's spelling: JavaScript
# cannot scope (?i)) and caseless (tiktoken's own and Llama 3's). The two differ only where an apostrophe
# precedes U+017F (LATIN SMALL LETTER LONG S, which folds to s); in neither does a match reach a space, so
# both keep speed cuts.
CL100K_LISTED = f"({_CONTRACTIONS}){_CL100K_REST}"
CL100K_CASELESS = f"(?i:'s|'t|'re|'ve|'m|'ll|'d){_CL100K_REST}"
O200K_LISTED = _O200K_LETTERS.replace("CONTRACTIONS", _CONTRACTIONS) + _O200K_REST
O200K_CASELESS = _O200K_LETTERS.replace("CONTRACTIONS", "?i:'s|'t|'re|'ve|'m|'ll|'d") + _O200K_REST
PROVEN_SPLIT_PATTERNS = GPT2_SPLIT_PATTERNS | frozenset(
    {CL100K_LISTED, CL100K_CASELESS, O200K_LISTED, O200K_CASELESS}
)


@dataclass(frozen=True)
class Atom:
    """A string a tokenizer matches whole in the raw text (an added token): never cut inside one."""

    text: str
    rstrip: bool = False  # its match also takes the whitespace after it


@dataclass(frozen=True)
class CutSafety:
    """What a tokenizer's structure proves about cutting texts (see the module docstring).

    Attributes:
        exact: cutting before a single space between two non-spaces keeps the tokens.
        reason: why (or why not), in a few words; shown by ``streampack info``.
        atoms: strings matched whole in the raw text, which no cut may split.
        anywhere: every cut between two characters keeps the tokens, not only those at spaces (the bytes
            tokenizer's ids are each character's UTF-8 bytes): no cut is ever counted as inexact.
    """

    exact: bool
    reason: str
    atoms: tuple[Atom, ...] = ()
    anywhere: bool = False


@dataclass
class CutCount:
    """Memory cuts made so far (cuts that may change the tokens next to them)."""

    inexact: int = 0


@dataclass(frozen=True)
class PieceRule:
    """How documents are cut into pieces before encoding.

    Attributes:
        max_chars: no piece is longer than this.
        target_chars: where set, texts are also cut at a safe space near every ``target_chars`` characters
            (the last one before, else the first one after, within ``max_chars``), because small pieces
            encode faster; where there is none, the text stays whole up to ``max_chars``.
        exact_spaces: cuts at a single space between non-spaces keep the tokens (``CutSafety.exact``);
            otherwise every cut is counted as inexact.
        atoms: strings no cut may split.
        exact_anywhere: every cut keeps the tokens (``CutSafety.anywhere``): none is counted as inexact.
    """

    max_chars: int
    target_chars: int | None = None
    exact_spaces: bool = True
    atoms: tuple[Atom, ...] = field(default=(), repr=False)
    exact_anywhere: bool = False

    def split(self, text: str, count: CutCount | None = None) -> Iterable[str]:
        """The pieces of ``text``; memory cuts are added to ``count``."""
        # Most texts (a document, a chat's template text) are one piece: no generator for them.
        return (text,) if len(text) <= self.whole_chars else self._cut(text, count)

    @property
    def whole_chars(self) -> int:
        """The longest text that stays one piece."""
        return self.max_chars if self.target_chars is None else min(self.max_chars, self.target_chars)

    def _cut(self, text: str, count: CutCount | None) -> Iterator[str]:
        start = 0
        while (cut := self._next_cut(text, start, count)) is not None:
            yield text[start:cut]
            start = cut
        yield text[start:] if start else text

    def stream(self, chunks: Iterable[str], count: CutCount | None = None) -> Iterator[str]:
        """:meth:`split` over text that arrives in chunks: the same pieces, ~``max_chars`` held at once."""
        buffer = ""
        # A cut looks this far past the start of its piece: its window, then the character after a space
        # and the end of an atom; and whether the rest is longer than the target.
        horizon = (
            max(self.max_chars, self.target_chars or 0)
            + max((len(a.text) for a in self.atoms), default=0)
            + 1
        )
        for chunk in chunks:
            buffer += chunk
            start = 0
            while len(buffer) - start > horizon:  # all that the next cut looks at is here
                cut = self._next_cut(buffer, start, count)
                assert cut is not None, "a text longer than max_chars is always cut"
                yield buffer[start:cut]
                start = cut
            buffer = buffer[start:]
        yield from self.split(buffer, count)

    def _next_cut(self, text: str, start: int, count: CutCount | None) -> int | None:
        """Where the piece that begins at ``start`` ends; ``None`` if it is the last one."""
        rest = len(text) - start
        if self.target_chars is not None and rest > self.target_chars:
            hi = min(start + self.max_chars, len(text) - 1)
            target = start + self.target_chars
            cut = self._safe_space_near(text, start + self.target_chars // 2, target, hi)
            if cut is not None:
                return cut
        if rest <= self.max_chars:
            return None
        cut, exact = self._bounded_cut(text, start, start + self.max_chars)
        if count is not None and not (exact and self.exact_spaces) and not self.exact_anywhere:
            count.inexact += 1
        return cut

    def _safe_space_near(self, text: str, lo: int, target: int, hi: int) -> int | None:
        """A safe space in ``(lo, hi)``: the last one up to ``target``, else the first one after it."""
        i = text.rfind(" ", lo + 1, min(target + 1, hi))
        while i > lo:
            if self._is_safe_space(text, i):
                return i
            i = text.rfind(" ", lo + 1, i)
        i = text.find(" ", target + 1, hi)
        while i != -1:
            if self._is_safe_space(text, i):
                return i
            i = text.find(" ", i + 1, hi)
        return None

    def _bounded_cut(self, text: str, lo: int, hi: int) -> tuple[int, bool]:
        """A cut in ``(lo, hi]`` (``hi < len(text)``), and whether it is at a safe space.

        A safe space in the second half of the window, else just after a newline there, else at ``hi``
        (moved back out of any atom it would split).
        """
        floor = lo + (hi - lo) // 2
        i = text.rfind(" ", floor, hi + 1)
        while i > floor:
            if self._is_safe_space(text, i):
                return i, True
            i = text.rfind(" ", floor, i)
        i = text.rfind("\n", floor, hi)
        while i > floor:
            if not _inside_atom(text, i + 1, self.atoms):
                return i + 1, False
            i = text.rfind("\n", floor, i)
        cut = hi
        while cut > lo + 1 and _inside_atom(text, cut, self.atoms):
            cut -= 1
        return cut, False

    def _is_safe_space(self, text: str, i: int) -> bool:
        return (
            0 < i < len(text) - 1
            and text[i] == " "
            and not text[i - 1].isspace()
            and not text[i + 1].isspace()
            and not (self.atoms and _inside_atom(text, i, self.atoms))
        )


def _inside_atom(text: str, cut: int, atoms: tuple[Atom, ...]) -> bool:
    """Whether cutting ``text`` at ``cut`` splits an occurrence of an atom (or ends an ``rstrip`` one)."""
    for atom in atoms:
        size = len(atom.text)
        first = cut - size if atom.rstrip else cut - size + 1  # earliest start that the cut would split
        i = text.find(atom.text, max(first, 0), cut + size - 1)
        while i != -1 and i < cut:
            if i + size > cut or (atom.rstrip and i + size == cut and text[cut : cut + 1].isspace()):
                return True
            i = text.find(atom.text, i + 1, cut + size - 1)
    return False


def piece_rule(safety: CutSafety, fast_piece_chars: int | None, max_chars: int | None = None) -> PieceRule:
    """The piece rule for a tokenizer with ``safety``: its fast piece size where cuts keep its tokens.

    ``max_chars`` defaults to 100,000 characters where cuts at spaces keep the tokens, else 1,000,000.
    Small pieces bound the tokenizer's memory (its per-character bookkeeping is ~20x the text) and let its
    threads share a long document; where a cut could change the tokens, pieces stay large, so that cuts
    happen only in documents of over a million characters.
    """
    limit = max_chars or (EXACT_CUT_PIECE_CHARS if safety.exact else INEXACT_CUT_PIECE_CHARS)
    target = fast_piece_chars if safety.exact else None
    return PieceRule(
        limit,
        target if target is not None and target < limit else None,
        exact_spaces=safety.exact,
        atoms=safety.atoms,
        exact_anywhere=safety.anywhere,
    )


# ------------------------------------------------------------------------------- structure of tokenizers

_CHARWISE_NORMALIZERS = {"NFC", "NFD", "Lowercase"}
_WHITESPACE_SPLITTERS = {"Whitespace", "WhitespaceSplit", "BertPreTokenizer"}
_FURTHER_SPLITTERS = {"Digits", "Punctuation"}
_PER_PRETOKEN_MODELS = {"BPE", "WordPiece", "WordLevel", "Unigram"}


def hf_cut_safety(definition: dict[str, Any], *, parse_special: bool) -> CutSafety:
    """The :class:`CutSafety` of a parsed ``tokenizer.json``.

    Args:
        definition: the parsed JSON of the tokenizer.
        parse_special: special tokens in the text are matched as such (otherwise they are plain text, and
            only the added tokens that are not special are atoms).
    """
    atoms = tuple(
        Atom(t["content"], bool(t.get("rstrip")))
        for t in definition.get("added_tokens") or []
        if parse_special or not t.get("special")
    )
    normalizer = definition.get("normalizer")
    problem = (
        _model_problem(definition.get("model"))
        or _pre_tokenizer_problem(definition.get("pre_tokenizer"), normalizer)
        or _added_token_problem(definition.get("added_tokens") or [], normalizer, parse_special)
    )
    if problem:
        return CutSafety(False, problem, atoms)
    return CutSafety(True, "proven from the tokenizer's structure", atoms)


def tiktoken_cut_safety(pattern: str, special_tokens: Iterable[str], *, parse_special: bool) -> CutSafety:
    """The :class:`CutSafety` of a tiktoken encoding with split ``pattern``."""
    atoms = tuple(Atom(s) for s in special_tokens) if parse_special else ()
    if pattern not in PROVEN_SPLIT_PATTERNS:
        return CutSafety(False, "its split pattern is not one streampack has proven", atoms)
    return CutSafety(True, "proven from the encoding's split pattern", atoms)


def _model_problem(model: Any) -> str:
    kind = model.get("type") if isinstance(model, dict) else None
    if kind not in _PER_PRETOKEN_MODELS:
        return f"model {kind!r} is not one streampack has proven"
    if kind == "BPE" and model.get("dropout"):
        return "BPE dropout makes its tokens random"
    return ""


def _pre_tokenizer_problem(pre_tokenizer: Any, normalizer: Any) -> str:
    steps = _flatten(pre_tokenizer, "pretokenizers")
    splitters = [s for s in steps if _splits_at_spaces(s)]
    if not splitters:
        return "its pre-tokenizer does not always split at a space"
    others = [s for s in steps if not _splits_at_spaces(s) and not _only_splits_further(s)]
    if others:
        return f"pre-tokenizer step {others[0].get('type')!r} is not one streampack has proven"
    whitespace_only = all(s.get("type") in _WHITESPACE_SPLITTERS | {"Metaspace"} for s in splitters)
    return _normalizer_problem(normalizer, allow_bert=whitespace_only)


def _normalizer_problem(normalizer: Any, *, allow_bert: bool) -> str:
    # A BERT normalizer drops control characters, so a non-space next to the cut may vanish: fine only
    # where every space is a split (the whitespace splitters), not for a regex that needs its neighbours.
    allowed = _CHARWISE_NORMALIZERS | ({"BertNormalizer"} if allow_bert else set())
    for step in _flatten(normalizer, "normalizers"):
        if step.get("type") not in allowed:
            return f"normalizer {step.get('type')!r} may change text across a cut"
    return ""


def _added_token_problem(added: list[dict[str, Any]], normalizer: Any, parse_special: bool) -> str:
    # Added tokens matched on the normalized text: their occurrences in the raw text are not found by a
    # plain search when the normalizer changes characters.
    if normalizer is None:
        return ""
    matched = [t for t in added if parse_special or not t.get("special")]
    if any(t.get("normalized") for t in matched):
        return "added tokens are matched on normalized text"
    return ""


def _splits_at_spaces(step: dict[str, Any]) -> bool:
    kind = step.get("type")
    if kind in _WHITESPACE_SPLITTERS:
        return True
    if kind == "Metaspace":
        return step.get("split", True) is True
    if kind == "ByteLevel":
        return step.get("use_regex", True) is True and not step.get("add_prefix_space", False)
    if kind == "Split":
        pattern = step.get("pattern") or {}
        return (
            pattern.get("Regex") in PROVEN_SPLIT_PATTERNS
            and step.get("behavior") == "Isolated"
            and not step.get("invert", False)
        )
    return False


def _only_splits_further(step: dict[str, Any]) -> bool:
    kind = step.get("type")
    if kind == "ByteLevel":
        return step.get("use_regex", True) is False and not step.get("add_prefix_space", False)
    return kind in _FURTHER_SPLITTERS


def _flatten(step: Any, key: str) -> list[dict[str, Any]]:
    """The steps of a (possibly nested) ``Sequence`` normalizer or pre-tokenizer; [] for none."""
    if step is None:
        return []
    if not isinstance(step, dict):
        return [{"type": repr(step)}]
    if step.get("type") == "Sequence":
        return [s for inner in step.get(key) or [] for s in _flatten(inner, key)]
    return [step]

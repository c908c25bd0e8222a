"""Cutting long documents: where the cuts go, and that a cut called exact keeps the tokens, for every kind of
tokenizer the tests have, with exactness decided from the tokenizer's structure alone."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

import streampack
from streampack.tokenizer.base import Tokenizer as StreampackTokenizer
from streampack.tokenizer.load import load_tokenizer
from streampack.tokenizer.pieces import (
    EXACT_CUT_PIECE_CHARS,
    INEXACT_CUT_PIECE_CHARS,
    PROVEN_SPLIT_PATTERNS,
    Atom,
    CutCount,
    PieceRule,
    hf_cut_safety,
    piece_rule,
)
from tests.conftest import TIKTOKEN_GPT2, TRAINING_TEXT, run_cli

words = st.text(st.characters(exclude_categories=["Cs", "Zs", "Cc"]), min_size=1, max_size=12)
separators = st.sampled_from([" ", "  ", "\n", " \n ", "\t", ". ", "\n\n"])
prose = st.lists(st.tuples(words, separators), min_size=1, max_size=120).map(
    lambda pairs: "".join(w + s for w, s in pairs)
)
# Text as scraped: words, runs of spaces and newlines, special-token strings, CJK, emoji, multi-word added
# tokens of the test tokenizers, and words of the training text (so that the Unigram's pieces occur).
fragments = st.sampled_from(
    [
        "the", "of", "of the", "in the", "lazy dog", "quick", "brown", "fox", "Tokenizers", "caches",
        "<|endoftext|>", "</s>", "<|fim_prefix|>", "<sep>", "漢字かな", "한국어", "🙂", "👍🏽", "1234", "...",
        "'s", "x",
    ]
)  # fmt: skip
glue = st.sampled_from([" ", " ", " ", "  ", "\n", " \n", "\t", "", ", "])
scraped = st.lists(st.tuples(fragments | words, glue), min_size=1, max_size=80).map(
    lambda pairs: "".join(w + g for w, g in pairs)
)


def _cuts(pieces: list[str]) -> list[int]:
    return np.cumsum([len(p) for p in pieces[:-1]]).tolist()


def _between_words(text: str, cut: int) -> bool:
    """True where ``text[cut]`` is a single space with a non-space on both sides."""
    window = text[cut - 1 : cut + 2]
    return len(window) == 3 and window[1] == " " and not window[0].isspace() and not window[2].isspace()


# ------------------------------------------------------------------------------------------ where cuts go


@settings(max_examples=200, deadline=None)
@given(text=prose, max_chars=st.integers(8, 200), target=st.none() | st.integers(2, 60))
def test_pieces_cover_the_text_within_the_limit_and_count_only_memory_cuts(
    text: str, max_chars: int, target: int | None
) -> None:
    count = CutCount()
    pieces = list(PieceRule(max_chars, target).split(text, count))
    assert "".join(pieces) == text
    assert all(len(p) <= max_chars for p in pieces)
    assert count.inexact == sum(not _between_words(text, c) for c in _cuts(pieces))


def test_pieces_end_at_the_last_word_boundary_before_the_target() -> None:
    text = " ".join(["word"] * 1_000)  # spaces at 4, 9, 14, ...: the last before 100 is at 99
    pieces = list(PieceRule(1_000, 100).split(text))
    assert [len(p) for p in pieces[:-1]] == [99] + [100] * (len(pieces) - 2)
    assert all(p.startswith(" ") for p in pieces[1:])


def test_without_a_word_boundary_near_the_target_the_next_one_is_taken() -> None:
    text = "x" * 150 + " y" + " z" * 200  # no boundary in (50, 100]; the first after it is at 150
    pieces = list(PieceRule(1_000, 100).split(text))
    assert len(pieces[0]) == 150
    assert all(_between_words(text, c) for c in _cuts(pieces))


def test_text_without_word_boundaries_stays_whole_up_to_max_chars() -> None:
    blob = "漢字かな交じり文" * 100  # 800 characters, no spaces: a cut here could change the tokens
    assert list(PieceRule(1_000, 100).split(blob)) == [blob]
    count = CutCount()
    assert [len(p) for p in PieceRule(1_000, 100).split(blob * 2, count)] == [1_000, 600]
    assert count.inexact == 1  # only the memory bound cuts, and it is counted


def test_without_a_proof_every_cut_is_counted() -> None:
    count = CutCount()
    pieces = list(PieceRule(100, exact_spaces=False).split("word " * 100, count))
    assert count.inexact == len(pieces) - 1 > 0


@settings(max_examples=200, deadline=None)
@given(
    text=scraped,
    max_chars=st.integers(8, 200),
    target=st.none() | st.integers(2, 100),
    chunk=st.integers(1, 50),
)
def test_streamed_pieces_and_counts_equal_those_of_the_whole_text(
    text: str, max_chars: int, target: int | None, chunk: int
) -> None:
    rule = PieceRule(max_chars, target, atoms=(Atom("of the"), Atom("<sep>", rstrip=True)))
    chunks = [text[i : i + chunk] for i in range(0, len(text), chunk)]
    streamed, whole = CutCount(), CutCount()
    assert list(rule.stream(chunks, streamed)) == list(rule.split(text, whole))
    assert streamed == whole


@settings(max_examples=300, deadline=None)
@given(text=scraped, max_chars=st.integers(8, 120), target=st.integers(2, 40))
def test_no_cut_splits_an_atom_nor_ends_an_rstrip_one_before_a_space(
    text: str, max_chars: int, target: int
) -> None:
    atoms = (Atom("of the"), Atom("in the"), Atom("<sep>", rstrip=True))
    pieces = list(PieceRule(max_chars, target, atoms=atoms).split(text))
    for cut in _cuts(pieces):
        for atom in atoms:
            for start in range(max(cut - len(atom.text), 0), cut):
                if text.startswith(atom.text, start):
                    end = start + len(atom.text)
                    assert not start < cut < end, f"cut {cut} splits {atom.text!r} at {start}"
                    assert not (atom.rstrip and end == cut and text[cut].isspace())


# ------------------------------------------------------------------- exactness from the structure alone


def _trained(path: Path, model: str, *, split: bool = True, added: list[AddedToken] | None = None) -> Path:
    """A small real tokenizer.json: Unigram + Metaspace, or byte-level BPE, with optional added tokens."""
    if model == "unigram":
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=split)
        trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=["</s>"], unk_token="</s>")
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        trainer = trainers.BpeTrainer(
            vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet
        )
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    if added:
        tok.add_tokens(added)
    tok.save(str(path))
    return path


TOKENIZER_KINDS = ["gpt2", "bpe+added", "unigram-split", "unigram-spanning", "tiktoken", "bytes"]


@pytest.fixture(scope="module")
def kinds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Callable[[str], list[int]]]]:
    """Each kind of tokenizer: its streampack spec, and its own encoding called directly (the rule)."""
    root = tmp_path_factory.mktemp("kinds")
    found: dict[str, tuple[str, Callable[[str], list[int]]]] = {
        "bytes": ("bytes", lambda t: list(t.encode()))
    }
    paths = {
        "bpe+added": _trained(
            root / "bpe.json",
            "bpe",
            added=[AddedToken("of the"), AddedToken("in the"), AddedToken("<sep>", rstrip=True)],
        ),
        "unigram-split": _trained(root / "ug.json", "unigram", split=True),
        "unigram-spanning": _trained(root / "ugs.json", "unigram", split=False),
    }
    gpt2 = Path(__file__).resolve().parents[2] / "shared" / "data" / "tokenizers" / "gpt2" / "tokenizer.json"
    if gpt2.exists():
        paths["gpt2"] = gpt2
    for kind, path in paths.items():
        reference = Tokenizer.from_file(str(path))
        reference.encode_special_tokens = True  # text is text
        found[kind] = (str(path), lambda t, r=reference: r.encode(t, add_special_tokens=False).ids)
    if TIKTOKEN_GPT2.exists():
        tiktoken = pytest.importorskip("tiktoken")
        from streampack.tokenizer.tiktoken import _read_ranks

        meta = json.loads(TIKTOKEN_GPT2.with_suffix(".json").read_text())
        encoding = tiktoken.Encoding(
            "gpt2", pat_str=meta["pat_str"], mergeable_ranks=_read_ranks(TIKTOKEN_GPT2), special_tokens={}
        )
        found["tiktoken"] = (f"tiktoken:{TIKTOKEN_GPT2}", encoding.encode_ordinary)
    return found


def _kind(
    kinds: dict[str, tuple[str, Callable[[str], list[int]]]], name: str
) -> tuple[StreampackTokenizer, Callable[[str], list[int]]]:
    if name not in kinds:
        pytest.skip(f"{name}: needs ../shared/data (absent)")
    spec, reference = kinds[name]
    if spec not in _LOADED:  # loaded once per session: a GPT-2 load takes ~1 s, the examples number 120
        _LOADED[spec] = load_tokenizer(spec)
    return _LOADED[spec], reference


_LOADED: dict[str, StreampackTokenizer] = {}


def test_structure_decides_which_kinds_are_exact(
    kinds: dict[str, tuple[str, Callable[[str], list[int]]]],
) -> None:
    expected = {"bpe+added": True, "unigram-split": True, "unigram-spanning": False, "bytes": True}
    for name, exact in expected.items():
        tok, _ = _kind(kinds, name)
        assert tok.cut_safety.exact is exact, (name, tok.cut_safety)
    tok, _ = _kind(kinds, "bpe+added")
    assert {a.text for a in tok.cut_safety.atoms} == {"of the", "in the", "<sep>"}


@pytest.mark.parametrize("name", TOKENIZER_KINDS)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=scraped, max_chars=st.integers(16, 300), target=st.integers(4, 80))
def test_a_text_cut_without_memory_cuts_has_exactly_the_rules_tokens(
    kinds: dict[str, tuple[str, Callable[[str], list[int]]]],
    name: str,
    text: str,
    max_chars: int,
    target: int,
) -> None:
    tok, reference = _kind(kinds, name)
    rule = piece_rule(tok.cut_safety, target, max_chars)
    count = CutCount()
    pieces = list(rule.split(text, count))
    whole = tok.encode_batch([text])[0].tolist()
    assert whole == reference(text)
    if count.inexact == 0:
        assert np.concatenate([np.zeros(0, np.uint32), *tok.encode_batch(pieces)]).tolist() == whole


def test_a_cut_never_lands_inside_a_multi_word_added_token(tmp_path: Path) -> None:
    path = _trained(tmp_path / "tokenizer.json", "bpe", added=[AddedToken("of the"), AddedToken("in the")])
    text = "lorem " * 1665 + "xx of theoretical physics " + "dolor " * 2000  # a 10,000-char cut: "of| the"
    streampack.build(streampack.Documents([text]), tmp_path / "c", tokenizer=str(path))
    cache = streampack.open(tmp_path / "c")
    assert cache.doc(0)[:-1].tolist() == Tokenizer.from_file(str(path)).encode(text).ids
    assert cache.manifest.inexact_cuts == 0


def test_a_tokenizer_with_pieces_across_spaces_gets_no_speed_cuts_and_its_long_documents_are_exact(
    tmp_path: Path,
) -> None:
    path = _trained(tmp_path / "tokenizer.json", "unigram", split=False)
    spanning = [t for t in Tokenizer.from_file(str(path)).get_vocab() if "▁" in t.strip("▁")]
    assert spanning, "the test needs a tokenizer with pieces that span spaces"
    docs = [" ".join(TRAINING_TEXT)[: 12_000 + 800 * i] for i in range(60)]
    streampack.build(streampack.Documents(docs), tmp_path / "c", tokenizer=str(path), eos_id=0)
    cache = streampack.open(tmp_path / "c")
    reference = Tokenizer.from_file(str(path))
    for i, doc in enumerate(docs):
        assert cache.doc(i)[:-1].tolist() == reference.encode(doc).ids
    assert cache.manifest.settings.max_piece_chars == INEXACT_CUT_PIECE_CHARS
    assert cache.manifest.tokenizer.cuts is not None and cache.manifest.tokenizer.cuts.exact is False


MEMORY_CUT_TEXTS = ["word  \n\n" * 3_000, "x" * 12_000, "fine text " * 100]


def test_memory_cuts_are_counted_in_the_manifest(tmp_path: Path, gpt2_tokenizer: Path) -> None:
    summary = streampack.build(
        streampack.Documents(MEMORY_CUT_TEXTS),
        tmp_path / "c",
        tokenizer=str(gpt2_tokenizer),
        max_piece_chars=1_000,
    )
    assert summary.inexact_cuts == streampack.open(tmp_path / "c").manifest.inexact_cuts == 23 + 11


def test_the_bytes_tokenizer_counts_no_cut_as_inexact(tmp_path: Path) -> None:
    """Its ids are each character's UTF-8 bytes: a cut anywhere keeps them, at a space or not."""
    summary = streampack.build(streampack.Documents(MEMORY_CUT_TEXTS), tmp_path / "c", max_piece_chars=1_000)
    cache = streampack.open(tmp_path / "c")
    assert summary.inexact_cuts == cache.manifest.inexact_cuts == 0
    assert [cache.doc(i)[:-1].tolist() for i in range(3)] == [list(t.encode()) for t in MEMORY_CUT_TEXTS]
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "x" * 1_000_000}) + "\n")
    built = run_cli("build", src, "--out", tmp_path / "d")
    assert "may have changed the tokens" not in built.stdout + built.stderr
    assert "inexact_cuts      0; cuts at spaces: exact" in run_cli("info", tmp_path / "d").stdout


# ----------------------------------------------------------------------------- structures, one by one


def _definition(pre_tokenizer: object, normalizer: object = None, model: object = None) -> dict[str, object]:
    return {
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "model": model or {"type": "BPE", "dropout": None},
        "added_tokens": [],
    }


CL100K = next(p for p in PROVEN_SPLIT_PATTERNS if p.startswith("(?i:") and "{1,3}" in p and "Lu" not in p)


@pytest.mark.parametrize(
    ("definition", "exact"),
    [
        (_definition({"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}), True),
        (_definition({"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}), False),
        (_definition({"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}), False),
        (  # Llama 3
            _definition(
                {
                    "type": "Sequence",
                    "pretokenizers": [
                        {
                            "type": "Split",
                            "pattern": {"Regex": CL100K},
                            "behavior": "Isolated",
                            "invert": False,
                        },
                        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False},
                    ],
                }
            ),
            True,
        ),
        (
            _definition(
                {"type": "Split", "pattern": {"Regex": r"\S+\s*"}, "behavior": "Isolated", "invert": False}
            ),
            False,
        ),
        (_definition({"type": "Metaspace", "split": True, "prepend_scheme": "always"}), True),
        (_definition({"type": "Metaspace", "split": False, "prepend_scheme": "first"}), False),
        (
            _definition(
                None, {"type": "Sequence", "normalizers": [{"type": "Prepend"}, {"type": "Replace"}]}
            ),
            False,
        ),
        (_definition({"type": "WhitespaceSplit"}, {"type": "BertNormalizer"}), True),
        (_definition({"type": "ByteLevel", "use_regex": True}, {"type": "BertNormalizer"}), False),
        (_definition({"type": "ByteLevel", "use_regex": True}, {"type": "NFC"}), True),
        (_definition({"type": "ByteLevel", "use_regex": True}, {"type": "NFKC"}), False),
        (_definition({"type": "ByteLevel", "use_regex": True}, model={"type": "BPE", "dropout": 0.1}), False),
        (_definition({"type": "WhitespaceSplit"}, model={"type": "WordPiece"}), True),
    ],
)
def test_hf_structures(definition: dict[str, object], exact: bool) -> None:
    assert hf_cut_safety(definition, parse_special=False).exact is exact


def test_added_tokens_are_atoms_and_special_ones_only_when_parsed() -> None:
    definition = _definition({"type": "ByteLevel", "use_regex": True})
    definition["added_tokens"] = [
        {"content": "<|endoftext|>", "special": True, "rstrip": False},
        {"content": "of the", "special": False, "rstrip": False},
    ]
    assert [a.text for a in hf_cut_safety(definition, parse_special=False).atoms] == ["of the"]
    assert [a.text for a in hf_cut_safety(definition, parse_special=True).atoms] == [
        "<|endoftext|>",
        "of the",
    ]


def test_the_shared_tiktoken_patterns_are_proven() -> None:
    folder = TIKTOKEN_GPT2.parent
    if not folder.exists():
        pytest.skip(f"{folder} is absent")
    for name in ("gpt2", "cl100k_base", "o200k_base"):
        assert json.loads((folder / f"{name}.json").read_text())["pat_str"] in PROVEN_SPLIT_PATTERNS, name


def test_piece_sizes_follow_the_proof(bpe_tokenizer: Path) -> None:
    hf = load_tokenizer(str(bpe_tokenizer), engine="tokenizers")
    rule = piece_rule(hf.cut_safety, hf.fast_piece_chars)
    assert (rule.max_chars, rule.target_chars, rule.exact_spaces) == (EXACT_CUT_PIECE_CHARS, 10_000, True)
    assert piece_rule(hf.cut_safety, hf.fast_piece_chars, 5_000).target_chars is None  # target >= limit


def test_the_fast_engine_encodes_whole_documents_up_to_the_bound(bpe_tokenizer: Path) -> None:
    pytest.importorskip("fastokens")
    fast = load_tokenizer(str(bpe_tokenizer), engine="fastokens")
    rule = piece_rule(fast.cut_safety, fast.fast_piece_chars)
    assert fast.engine.name == "fastokens"
    assert (rule.max_chars, rule.target_chars, rule.exact_spaces) == (EXACT_CUT_PIECE_CHARS, None, True)
    bytes_rule = piece_rule(load_tokenizer("bytes").cut_safety, None)
    assert (bytes_rule.max_chars, bytes_rule.target_chars) == (EXACT_CUT_PIECE_CHARS, None)

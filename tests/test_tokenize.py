"""Tokenizer specs, EOS resolution, and the long-document splitting that must not change tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from streampack.errors import StreampackError
from streampack.tokenize import (
    EXACT_CUT_PIECE_CHARS,
    INEXACT_CUT_PIECE_CHARS,
    PieceRule,
    cuts_keep_tokens,
    default_max_piece_chars,
    load_tokenizer,
    piece_rule,
    resolve_eos,
    split_text,
    stream_pieces,
)

words = st.text(st.characters(exclude_categories=["Cs", "Zs", "Cc"]), min_size=1, max_size=12)
separators = st.sampled_from([" ", "  ", "\n", " \n ", "\t", ". ", "\n\n"])
prose = st.lists(st.tuples(words, separators), min_size=1, max_size=120).map(
    lambda pairs: "".join(w + s for w, s in pairs)
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=prose, max_chars=st.integers(8, 200))
def test_pieces_keep_byte_level_bpe_tokens(text: str, max_chars: int, bpe_tokenizer: Path) -> None:
    pieces = list(split_text(text, max_chars))
    assert "".join(pieces) == text
    assert all(len(p) <= max_chars for p in pieces)
    cuts = np.cumsum([len(p) for p in pieces[:-1]]).tolist()
    if all(
        _between_words(text, c) for c in cuts
    ):  # the documented guarantee: such cuts leave byte-level BPE tokens unchanged
        tok = load_tokenizer(str(bpe_tokenizer))
        assert np.concatenate(tok.encode_batch(pieces)).tolist() == tok.encode_batch([text])[0].tolist()


def _between_words(text: str, cut: int) -> bool:
    """True where ``text[cut]`` is a single space with a non-space on both sides."""
    window = text[cut - 1 : cut + 2]
    return len(window) == 3 and window[1] == " " and not window[0].isspace() and not window[2].isspace()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=prose, target_chars=st.integers(2, 60), max_chars=st.integers(8, 200))
def test_pieces_near_the_target_keep_byte_level_bpe_tokens(
    text: str, target_chars: int, max_chars: int, bpe_tokenizer: Path
) -> None:
    pieces = list(split_text(text, max_chars, target_chars))
    assert "".join(pieces) == text
    assert all(len(p) <= max_chars for p in pieces)
    cuts = np.cumsum([len(p) for p in pieces[:-1]]).tolist()
    if all(_between_words(text, c) for c in cuts):
        tok = load_tokenizer(str(bpe_tokenizer))
        assert np.concatenate(tok.encode_batch(pieces)).tolist() == tok.encode_batch([text])[0].tolist()


def test_pieces_end_at_the_last_word_boundary_before_the_target() -> None:
    text = " ".join(["word"] * 1_000)  # spaces at 4, 9, 14, ...: the last before 100 is at 99
    pieces = list(split_text(text, 1_000, 100))
    assert [len(p) for p in pieces[:-1]] == [99] + [100] * (len(pieces) - 2)
    assert all(p.startswith(" ") for p in pieces[1:])


def test_without_a_word_boundary_near_the_target_the_next_one_is_taken() -> None:
    text = "x" * 150 + " y" + " z" * 200  # no boundary in (50, 100]; the first after it is at 150
    pieces = list(split_text(text, 1_000, 100))
    assert len(pieces[0]) == 150
    assert all(_between_words(text, c) for c in np.cumsum([len(p) for p in pieces[:-1]]))


def test_text_without_word_boundaries_stays_whole_up_to_max_chars() -> None:
    blob = "漢字かな交じり文" * 100  # 800 characters, no spaces: a cut here could change the tokens
    assert list(split_text(blob, 1_000, 100)) == [blob]
    assert [len(p) for p in split_text(blob * 2, 1_000, 100)] == [1_000, 600]  # only the memory bound cuts


@settings(max_examples=200, deadline=None)
@given(
    text=prose,
    max_chars=st.integers(8, 200),
    target_chars=st.none() | st.integers(2, 100),
    chunk=st.integers(1, 50),
)
def test_streamed_pieces_equal_the_pieces_of_the_whole_text(
    text: str, max_chars: int, target_chars: int | None, chunk: int
) -> None:
    chunks = [text[i : i + chunk] for i in range(0, len(text), chunk)]
    assert list(stream_pieces(chunks, max_chars, target_chars)) == list(
        split_text(text, max_chars, target_chars)
    )


def test_piece_rule_per_tokenizer(tmp_path: Path, bpe_tokenizer: Path) -> None:
    hf = load_tokenizer(str(bpe_tokenizer))
    assert piece_rule(hf) == PieceRule(EXACT_CUT_PIECE_CHARS, hf.fast_piece_chars) and hf.fast_piece_chars
    assert piece_rule(hf, 5_000) == PieceRule(5_000)  # a target at or above the limit is no target
    assert piece_rule(load_tokenizer("bytes")) == PieceRule(EXACT_CUT_PIECE_CHARS)
    # No cuts for speed where cuts change the tokens:
    prefix_space = load_tokenizer(str(_prefix_space_tokenizer(tmp_path / "tokenizer.json")))
    assert piece_rule(prefix_space) == PieceRule(INEXACT_CUT_PIECE_CHARS)


def test_gpt2_long_document_in_pieces_equals_whole(gpt2_tokenizer: Path) -> None:
    from tests.conftest import SAMPLE_CORPUS

    if not SAMPLE_CORPUS.exists():
        pytest.skip(f"{SAMPLE_CORPUS} is absent")
    import zstandard

    raw = zstandard.ZstdDecompressor().stream_reader(SAMPLE_CORPUS.open("rb")).read()
    text = max((json.loads(line)["text"] for line in raw.splitlines()), key=len)
    tok = load_tokenizer(str(gpt2_tokenizer))
    whole = Tokenizer.from_file(str(gpt2_tokenizer)).encode(text).ids
    for pieces in (list(split_text(text, 5_000)), list(PieceRule(100_000, 1_000).split(text))):
        assert len(pieces) > 20
        assert np.concatenate(tok.encode_batch(pieces)).tolist() == whole


def test_bytes_tokenizer_round_trip() -> None:
    tok = load_tokenizer("bytes")
    ids = tok.encode_batch(["héllo 🙂"])[0]
    assert ids.tolist() == list("héllo 🙂".encode()) and tok.decode([*ids.tolist(), 256]) == "héllo 🙂"
    assert resolve_eos(tok, eos=True, eos_id=None).id == 256


def test_hf_tokenizer_folder_and_eos_from_config(tmp_path: Path, bpe_tokenizer: Path) -> None:
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(bpe_tokenizer.read_bytes())
    tok = load_tokenizer(str(folder))
    assert tok.eos_id == Tokenizer.from_file(str(bpe_tokenizer)).token_to_id("<|endoftext|>")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    assert load_tokenizer(str(folder)).eos_id == tok.eos_id


def test_tokenizer_without_eos_needs_an_explicit_choice(tmp_path: Path) -> None:
    from tokenizers import models

    bare = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    bare.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    with pytest.raises(StreampackError, match="--eos-id N, or --no-eos"):
        resolve_eos(tok, eos=True, eos_id=None)
    assert resolve_eos(tok, eos=True, eos_id=1).id == 1
    assert not resolve_eos(tok, eos=False, eos_id=None).append


def test_tiktoken_spec_errors(tmp_path: Path) -> None:
    pytest.importorskip("tiktoken")
    with pytest.raises(StreampackError, match="no ranks file"):
        load_tokenizer(f"tiktoken:{tmp_path / 'gpt2.tiktoken'}")
    (tmp_path / "x.tiktoken").write_text("")
    with pytest.raises(StreampackError, match=r"x\.json is missing"):
        load_tokenizer(f"tiktoken:{tmp_path / 'x.tiktoken'}")


def test_large_vocab_uses_uint32(tmp_path: Path, tiktoken_gpt2: Path) -> None:
    o200k = tiktoken_gpt2.with_name("o200k_base.tiktoken")
    if not o200k.exists():
        pytest.skip(f"{o200k} is absent")
    import streampack

    streampack.build(
        streampack.Documents(["Hello world, 漢字"]), tmp_path / "c", tokenizer=f"tiktoken:{o200k}"
    )
    cache = streampack.open(tmp_path / "c")
    assert cache.dtype == np.dtype("<u4") and cache.vocab_size > 65536
    assert cache.doc(0).max() < cache.vocab_size


def _prefix_space_tokenizer(path: Path) -> Path:
    """A SentencePiece-style tokenizer.json (Llama 2's normalizer: prepend '▁', spaces to '▁')."""
    from tokenizers import models, normalizers, trainers

    from tests.conftest import TRAINING_TEXT

    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.train_from_iterator(TRAINING_TEXT, trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"]))
    tok.save(str(path))
    return path


def test_cut_probe_accepts_byte_level_tokenizers(bpe_tokenizer: Path) -> None:
    assert cuts_keep_tokens(load_tokenizer("bytes"))
    assert cuts_keep_tokens(load_tokenizer(str(bpe_tokenizer)))
    assert default_max_piece_chars(load_tokenizer(str(bpe_tokenizer))) == EXACT_CUT_PIECE_CHARS


def test_cut_probe_accepts_gpt2_and_tiktoken(gpt2_tokenizer: Path, tiktoken_gpt2: Path) -> None:
    assert cuts_keep_tokens(load_tokenizer(str(gpt2_tokenizer)))
    assert cuts_keep_tokens(load_tokenizer(f"tiktoken:{tiktoken_gpt2}"))


def test_cut_probe_rejects_a_prefix_space_tokenizer(tmp_path: Path) -> None:
    tok = load_tokenizer(str(_prefix_space_tokenizer(tmp_path / "tokenizer.json")))
    # Why the probe matters: a piece that starts with a space gets a second '▁' prepended.
    assert tok.encode_batch(["a b"])[0].tolist() != np.concatenate(tok.encode_batch(["a", " b"])).tolist()
    assert not cuts_keep_tokens(tok)
    assert default_max_piece_chars(tok) == INEXACT_CUT_PIECE_CHARS

"""Tokenizer specs, EOS resolution, special-token text, and bad tokenizer files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from streampack.errors import StreampackError, TokenizerError
from streampack.tokenizer.load import load_tokenizer
from streampack.tokenizer.specials import resolve_eos


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
    with pytest.raises(StreampackError, match="eos_id=N, or eos=False"):
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


@pytest.mark.slow
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


# ------------------------------------------------------------------------------------ special-token text

SPECIAL_TEXTS = ["Hello<|endoftext|>World", "<|endoftext|>", "x <|endoftext|> y", "a</s>b <|fim_prefix|>"]


@pytest.mark.slow
def test_special_token_text_is_text_and_both_backends_agree(
    gpt2_tokenizer: Path, tiktoken_gpt2: Path
) -> None:
    import tiktoken

    hf = load_tokenizer(str(gpt2_tokenizer))
    tt = load_tokenizer(f"tiktoken:{tiktoken_gpt2}")
    meta = json.loads(tiktoken_gpt2.with_suffix(".json").read_text())
    from streampack.tokenizer.tiktoken import _read_ranks

    reference = tiktoken.Encoding(
        "gpt2", pat_str=meta["pat_str"], mergeable_ranks=_read_ranks(tiktoken_gpt2), special_tokens={}
    )
    for text in SPECIAL_TEXTS:
        expected = reference.encode_ordinary(text)
        assert 50256 not in expected
        assert hf.encode_batch([text])[0].tolist() == expected
        assert tt.encode_batch([text])[0].tolist() == expected


@pytest.mark.slow
def test_a_cache_holds_no_control_id_inside_a_document(
    tmp_path: Path, gpt2_tokenizer: Path, tiktoken_gpt2: Path
) -> None:
    import streampack

    docs = streampack.Documents(SPECIAL_TEXTS)
    streampack.build(docs, tmp_path / "hf", tokenizer=str(gpt2_tokenizer))
    streampack.build(docs, tmp_path / "tt", tokenizer=f"tiktoken:{tiktoken_gpt2}")
    hf, tt = streampack.open(tmp_path / "hf"), streampack.open(tmp_path / "tt")
    for i in range(len(SPECIAL_TEXTS)):
        assert hf.doc(i).tolist() == tt.doc(i).tolist()
        assert 50256 not in hf.doc(i)[:-1].tolist() and hf.doc(i)[-1] == 50256
    assert hf.manifest.settings.special_tokens == "text"


@pytest.mark.slow
def test_parsing_special_tokens_is_an_explicit_recorded_choice(
    tmp_path: Path, gpt2_tokenizer: Path, tiktoken_gpt2: Path
) -> None:
    import streampack

    for name, spec in (("hf", str(gpt2_tokenizer)), ("tt", f"tiktoken:{tiktoken_gpt2}")):
        streampack.build(
            streampack.Documents(["Hello<|endoftext|>World"]),
            tmp_path / name,
            tokenizer=spec,
            special_tokens="parse",
        )
        cache = streampack.open(tmp_path / name)
        assert cache.doc(0).tolist() == [15496, 50256, 10603, 50256]
        assert cache.manifest.settings.special_tokens == "parse"


# ------------------------------------------------------------------------------------ bad tokenizer files


def test_an_eos_token_missing_from_the_vocabulary_is_an_error_when_it_is_needed(
    tmp_path: Path, bpe_tokenizer: Path
) -> None:
    (tmp_path / "tokenizer.json").write_bytes(bpe_tokenizer.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|not-there|>"}))
    tok = load_tokenizer(str(tmp_path))
    with pytest.raises(
        TokenizerError, match=r"tokenizer_config\.json: eos_token '<\|not-there\|>' is not in"
    ):
        resolve_eos(tok, eos=True, eos_id=None)
    assert resolve_eos(tok, eos=True, eos_id=5).id == 5


def _sidecar(tmp_path: Path, tiktoken_gpt2: Path, **changes: object) -> str:
    ranks = tmp_path / "enc.tiktoken"
    ranks.write_bytes(tiktoken_gpt2.read_bytes())
    meta = {**json.loads(tiktoken_gpt2.with_suffix(".json").read_text()), **changes}
    (tmp_path / "enc.json").write_text(json.dumps(meta))
    return f"tiktoken:{ranks}"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"explicit_n_vocab": 50000},
            r"enc\.json: explicit_n_vocab is 50000, but the ranks and special tokens make 50257",
        ),
        (
            {"special_tokens": ["<|endoftext|>"]},
            r"enc\.json: 'special_tokens' must be an object .* \(got a list\)",
        ),
        (
            {"special_tokens": {"<|endoftext|>": 5000000000}},
            r"enc\.json: special_tokens\['<\|endoftext\|>'\] = 5000000000 is not an id",
        ),
        (
            {"special_tokens": {"<|endoftext|>": 5}},
            r"enc\.json: special_tokens\['<\|endoftext\|>'\] = 5 is also the rank",
        ),
        ({"pat_str": None}, r"enc\.json: needs a 'pat_str' string"),
    ],
)
def test_bad_tiktoken_sidecars_name_the_file_and_field(
    tmp_path: Path, tiktoken_gpt2: Path, changes: dict[str, object], message: str
) -> None:
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer(_sidecar(tmp_path, tiktoken_gpt2, **changes))


def test_an_empty_tiktoken_spec_says_what_to_pass() -> None:
    pytest.importorskip("tiktoken")
    with pytest.raises(TokenizerError, match=r"no ranks file named; pass tiktoken:/path/to/NAME\.tiktoken"):
        load_tokenizer("tiktoken:")


# ------------------------------------------------------------------------------------ no process-wide state


def test_a_build_leaves_the_callers_environment_alone_and_sizes_its_thread_pool(
    tmp_path: Path, bpe_tokenizer: Path
) -> None:
    # In processes of their own: `threads` sizes a process's tokenizers thread pool for good (the tokenizers
    # engine alone: fastokens, which auto would pick for this tokenizer, has a pool of its own).
    counts = []
    for threads in (1, 3):
        script = f"""
import os, streampack
before = dict(os.environ)
docs = streampack.Documents(["a b c"] * 3)
streampack.build(docs, {str(tmp_path / f"c{threads}")!r}, tokenizer={str(bpe_tokenizer)!r}, threads={threads},
                 tokenizer_engine="tokenizers")
assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())
print(len(os.listdir("/proc/self/task")))
"""
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
        counts.append(int(result.stdout))
    assert counts[1] - counts[0] == 2


def test_a_rebuild_after_the_tokenizer_file_changed_uses_the_new_one(tmp_path: Path) -> None:
    import hashlib

    from tokenizers import models, pre_tokenizers, trainers

    import streampack
    from tests.conftest import TRAINING_TEXT

    path = tmp_path / "tokenizer.json"
    docs = streampack.Documents(TRAINING_TEXT[:8])
    caches = []
    for i, vocab_size in enumerate((270, 290)):
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=["</s>"], initial_alphabet=alphabet
        )
        tok.train_from_iterator(TRAINING_TEXT, trainer)
        tok.save(str(path))
        streampack.build(docs, tmp_path / f"c{i}", tokenizer=str(path))
        cache = streampack.open(tmp_path / f"c{i}")
        assert cache.manifest.tokenizer.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
        assert cache.doc(0)[:-1].tolist() == tok.encode(TRAINING_TEXT[0], add_special_tokens=False).ids
        caches.append(cache)
    assert caches[0].num_tokens != caches[1].num_tokens

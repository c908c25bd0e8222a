"""BOS: the tokenizer's own (from its tokenizer_config.json, or an added token like <s>) or an id, once at the
start of every document, recorded in the manifest, checked on resume and by verify."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

import streampack
from streampack.errors import ConfigMismatchError, OptionsError, TokenizerError
from streampack.format import with_checksum
from streampack.store.files import file_checksum
from tests.conftest import run_cli, set_shard_checksum, write_jsonl

GPT2_EOS = 50256

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Text is text: <|endoftext|> and <s> in a document stay characters.",
    "Ünïcödé 🙂 and CJK 漢字.",
]


def gpt2_with_config(gpt2_tokenizer: Path, folder: Path, config: dict[str, object]) -> Path:
    """The real GPT-2 tokenizer.json in ``folder`` with a tokenizer_config.json beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(gpt2_tokenizer, folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def gpt2_with_added_bos(gpt2_tokenizer: Path, folder: Path) -> tuple[Path, int]:
    """The real GPT-2 tokenizer with an added special token ``<s>`` (and no config): its BOS by name."""
    tok = Tokenizer.from_file(str(gpt2_tokenizer))
    tok.add_special_tokens(["<s>"])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder, tok.token_to_id("<s>")


def encode(tokenizer_json: Path, text: str) -> list[int]:
    """The tokenizer called directly, text as text."""
    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.encode_special_tokens = True
    return tok.encode(text, add_special_tokens=False).ids


def docs_of(out: Path) -> list[list[int]]:
    cache = streampack.open(out)
    return [cache.doc(i).tolist() for i in range(cache.num_docs)]


def test_the_bos_token_of_tokenizer_config_starts_every_document(
    tmp_path: Path, gpt2_tokenizer: Path
) -> None:
    """GPT-2's own config names <|endoftext|> as its BOS: BOS and EOS are then one id, and verify knows."""
    folder = gpt2_with_config(gpt2_tokenizer, tmp_path / "tok", {"bos_token": {"content": "<|endoftext|>"}})
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    streampack.build(src, tmp_path / "c", tokenizer=str(folder), bos=True)
    expected = [[GPT2_EOS, *encode(gpt2_tokenizer, t), GPT2_EOS] for t in TEXTS]
    assert docs_of(tmp_path / "c") == expected
    cache = streampack.open(tmp_path / "c")
    assert cache.bos_id == GPT2_EOS and cache.manifest.bos.to_json() == {"prepend": True, "id": GPT2_EOS}
    assert cache.manifest.settings.bos is True
    report = streampack.verify(tmp_path / "c")
    assert report.ok, report.problems  # the BOS at each start is not an EOS inside a document


def test_an_added_bos_token_is_found_by_name(tmp_path: Path, gpt2_tokenizer: Path) -> None:
    folder, bos = gpt2_with_added_bos(gpt2_tokenizer, tmp_path / "tok")
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    streampack.build(src, tmp_path / "c", tokenizer=str(folder), bos=True)
    assert docs_of(tmp_path / "c") == [[bos, *encode(gpt2_tokenizer, t), GPT2_EOS] for t in TEXTS]
    assert streampack.verify(tmp_path / "c").ok


@pytest.mark.parametrize("batch_chars", [1 << 20, 3_000, 700])
def test_a_long_document_cut_into_pieces_gets_one_bos(
    tmp_path: Path, gpt2_tokenizer: Path, batch_chars: int
) -> None:
    """Pieces of 1,000 characters in batches that end inside documents: one BOS per document, first."""
    folder, bos = gpt2_with_added_bos(gpt2_tokenizer, tmp_path / "tok")
    words = ["alpha", "beta", "gamma", "δέλτα", "🙂", "tokens"]
    long_text = " ".join(words[i % len(words)] + str(i % 7) for i in range(6_000))  # ~45,000 characters
    texts = [TEXTS[0], long_text, TEXTS[2], long_text[:2_500]]
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    streampack.build(
        src, tmp_path / "c", tokenizer=str(folder), bos=True, max_piece_chars=1_000, batch_chars=batch_chars
    )
    got = docs_of(tmp_path / "c")
    assert got == [[bos, *encode(gpt2_tokenizer, t), GPT2_EOS] for t in texts]
    assert sum(np.count_nonzero(np.asarray(d) == bos) for d in got) == len(texts)


def test_no_bos_found_says_to_give_an_id(tmp_path: Path, gpt2_tokenizer: Path, tiktoken_gpt2: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    for spec in (str(gpt2_tokenizer), f"tiktoken:{tiktoken_gpt2}", "bytes"):
        with pytest.raises(
            TokenizerError, match=r"has no BOS token that streampack recognises.*pass bos_id=N"
        ):
            streampack.build(src, tmp_path / "c", tokenizer=spec, bos=True, overwrite=True)
    streampack.build(src, tmp_path / "c", tokenizer=f"tiktoken:{tiktoken_gpt2}", bos_id=7, overwrite=True)
    assert docs_of(tmp_path / "c") == [[7, 64, GPT2_EOS]]
    folder = gpt2_with_config(gpt2_tokenizer, tmp_path / "tok", {"bos_token": "<|nope|>"})
    with pytest.raises(TokenizerError, match=r"bos_token '<\|nope\|>' is not in the vocabulary .*bos_id=N"):
        streampack.build(src, tmp_path / "c", tokenizer=str(folder), bos=True, overwrite=True)


def test_a_bos_id_above_the_vocabulary_widens_it_only_when_allowed(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "ab"}])
    with pytest.raises(
        OptionsError, match=r"bos_id=70000 is outside the vocabulary of tokenizer 'bytes', whose 257"
    ):
        streampack.build(src, tmp_path / "c", bos_id=70_000)
    streampack.build(src, tmp_path / "c", bos_id=70_000, allow_new_ids=True)
    cache = streampack.open(tmp_path / "c")
    assert cache.dtype.name == "uint32" and cache.vocab_size == 70_001
    assert docs_of(tmp_path / "c") == [[70_000, 97, 98, 256]]


def test_resuming_with_another_bos_is_refused(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    streampack.build(src, tmp_path / "c", bos_id=5)
    streampack.build(src, tmp_path / "c", bos=True, bos_id=5)  # the same BOS, said another way
    for other in ({"bos_id": 6}, {}):
        with pytest.raises(ConfigMismatchError, match=r"bos_policy: the cache has \{[^}]*'id': 5\b"):
            streampack.build(src, tmp_path / "c", **other)


def test_resuming_after_the_configs_bos_changed_is_refused(tmp_path: Path, gpt2_tokenizer: Path) -> None:
    """The tokenizer's hash covers its tokenizer.json, not the config beside it: the BOS is compared."""
    folder = gpt2_with_config(gpt2_tokenizer, tmp_path / "tok", {"bos_token": "<|endoftext|>"})
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    streampack.build(src, tmp_path / "c", tokenizer=str(folder), bos=True)
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "!"}))
    with pytest.raises(
        ConfigMismatchError, match=r"bos_policy: the cache has .* 50256\b.*this build has \{[^}]*'id': 0\b"
    ):
        streampack.build(src, tmp_path / "c", tokenizer=str(folder), bos=True)


def test_a_manifest_from_before_bos_reads_as_none(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    streampack.build(src, tmp_path / "c")
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    del manifest["bos"], manifest["settings"]["bos"], manifest["settings"]["bos_id"]
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(with_checksum(manifest)))
    assert streampack.open(tmp_path / "c").bos_id is None
    assert streampack.verify(tmp_path / "c").ok
    assert streampack.build(src, tmp_path / "c").num_docs == 1  # the same settings: reused
    with pytest.raises(ConfigMismatchError, match=r"bos_policy: the cache has \{[^}]*'prepend': False"):
        streampack.build(src, tmp_path / "c", bos_id=3)


def poke(cache: Path, position: int, value: int) -> None:
    """Set one token of shard 0 and give it a matching checksum: damage that only verify can see."""
    path = cache / "shards" / "000000.tokens"
    tokens = np.fromfile(path, dtype="<u2")
    tokens[position] = value
    tokens.tofile(path)
    manifest = json.loads((cache / "manifest.json").read_text())
    set_shard_checksum(manifest, 0, "tokens_crc32", file_checksum(path))
    (cache / "manifest.json").write_text(json.dumps(with_checksum(manifest)))


def test_verify_finds_a_missing_or_stray_bos(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in ("abc", "defg", "hi")])
    streampack.build(src, tmp_path / "c", bos_id=300, allow_new_ids=True)
    assert streampack.verify(tmp_path / "c").ok  # [300 a b c 256] [300 d e f g 256] [300 h i 256]
    missing = tmp_path / "missing"
    shutil.copytree(tmp_path / "c", missing)
    poke(missing, 5, ord("x"))
    assert any(
        "document 1 (and 0 more) does not begin with BOS 300" in p
        for p in streampack.verify(missing).problems
    )
    stray = tmp_path / "stray"
    shutil.copytree(tmp_path / "c", stray)
    poke(stray, 7, 300)
    problems = streampack.verify(stray).problems
    assert any(
        "1 BOS id 300 inside documents, not at their start: document 1 at token 2 of 6" in p for p in problems
    )


@pytest.mark.slow
def test_cli_bos_info_and_verify(tmp_path: Path, gpt2_tokenizer: Path) -> None:
    folder, bos = gpt2_with_added_bos(gpt2_tokenizer, tmp_path / "tok")
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    run_cli("build", src, "--tokenizer", folder, "--out", tmp_path / "c", "--bos")
    info = json.loads(run_cli("info", tmp_path / "c", "--json").stdout)
    assert info["bos_id"] == bos and info["eos_id"] == GPT2_EOS
    assert "bos_id" in run_cli("info", tmp_path / "c").stdout
    assert run_cli("verify", tmp_path / "c").stdout.startswith("ok:")
    run_cli("build", src, "--tokenizer", folder, "--out", tmp_path / "d", "--bos-id", "3")
    assert json.loads(run_cli("info", tmp_path / "d", "--json").stdout)["bos_id"] == 3
    failed = run_cli(
        "build", src, "--tokenizer", gpt2_tokenizer, "--out", tmp_path / "e", "--bos", check=False
    )
    assert failed.returncode == 1 and "pass --bos-id N" in failed.stderr and "Traceback" not in failed.stderr
    refused = run_cli("build", src, "--tokenizer", folder, "--out", tmp_path / "d", "--bos", check=False)
    assert refused.returncode == 1 and "bos_policy: the cache has" in refused.stderr


@pytest.mark.slow
def test_cli_refuses_an_eos_or_bos_id_outside_the_vocabulary_unless_allowed(
    tmp_path: Path, gpt2_tokenizer: Path
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    for flag in ("--eos-id", "--bos-id"):
        refused = run_cli(
            "build", src, "-t", gpt2_tokenizer, "--out", tmp_path / "c", flag, "50257", check=False
        )
        assert refused.returncode == 1 and "Traceback" not in refused.stderr
        assert f"{flag} 50257 is outside the vocabulary of tokenizer" in refused.stderr
        assert "whose 50,257 ids are 0..50,256" in refused.stderr and "--allow-new-ids" in refused.stderr
        assert not (tmp_path / "c" / "manifest.json").exists()
    run_cli(
        "build", src, "-t", gpt2_tokenizer, "--out", tmp_path / "c", "--eos-id", "50300", "--allow-new-ids"
    )
    info = json.loads(run_cli("info", tmp_path / "c", "--json").stdout)
    assert info["eos_id"] == 50300 and info["vocab_size"] == 50301
    assert run_cli("verify", tmp_path / "c").stdout.startswith("ok:")
    # An id inside the vocabulary needs no permission, and the vocabulary does not grow.
    run_cli("build", src, "-t", gpt2_tokenizer, "--out", tmp_path / "d", "--eos-id", "50256", "--bos-id", "0")
    assert json.loads(run_cli("info", tmp_path / "d", "--json").stdout)["vocab_size"] == 50257

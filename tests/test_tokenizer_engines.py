"""Tokenizer engines give the same cache bytes as the tokenizer's reference engine, and a build checks that
they do: an engine that gets one id wrong is stopped, naming the record."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import streampack
from streampack.errors import TokenizerError
from streampack.format import load_manifest
from streampack.tokenizer.backends import FastokensEngine, load_tokenizer
from tests.conftest import SAMPLE_CORPUS, shard_bytes, write_jsonl

pytest.importorskip("fastokens", reason="the fast extra is not installed")

# Special-token text stays text whatever the engine: these must come out the same too.
EDGE = ["a<|endoftext|>b", "<|endoftext|>", "  \n\n\t's\n\nThen", "emoji 🙂‍🚀 and 漢字 " * 50, "x" * 30_000]


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first 300 documents of the real natural sample, and edge cases, as JSONL."""
    import zstandard

    if not SAMPLE_CORPUS.exists():
        pytest.skip(f"real text sample not found at {SAMPLE_CORPUS} (../shared/data is absent)")
    with zstandard.ZstdDecompressor().stream_reader(SAMPLE_CORPUS.open("rb")) as raw:
        lines = io.TextIOWrapper(raw, encoding="utf-8")
        texts = [json.loads(next(lines))["text"] for _ in range(300)]
    path = tmp_path_factory.mktemp("sample") / "sample.jsonl"
    return write_jsonl(path, [{"text": t} for t in EDGE + texts])


def _build(sample: Path, out: Path, tokenizer: str, engine: str, **options: Any) -> dict[str, bytes]:
    streampack.build(sample, out, tokenizer=tokenizer, tokenizer_engine=engine, workers=1, **options)
    return {k: v for k, v in shard_bytes(out).items() if k != "manifest.json"}


@pytest.mark.parametrize("special_tokens", ["text", "parse"])
def test_gpt2_caches_are_byte_identical_across_engines(
    tmp_path: Path, sample: Path, gpt2_tokenizer: Path, tiktoken_gpt2: Path, special_tokens: str
) -> None:
    json_spec, ranks_spec = str(gpt2_tokenizer), f"tiktoken:{tiktoken_gpt2}"
    caches = {
        (spec, engine): _build(sample, tmp_path / f"{i}", spec, engine, special_tokens=special_tokens)
        for i, (spec, engine) in enumerate(
            [
                (json_spec, "tokenizers"),
                (json_spec, "fastokens"),
                (ranks_spec, "tiktoken"),
                (ranks_spec, "auto"),
            ]
        )
    }
    reference = caches[(json_spec, "tokenizers")]
    assert all(cache == reference for cache in caches.values())
    engines = load_manifest(tmp_path / "3").engines
    assert [(e["name"], e["reference"].split()[0], e["verify"]["mode"]) for e in engines] == [
        ("fastokens", "tiktoken", "sample")
    ]
    assert load_manifest(tmp_path / "0").engines[0]["name"] == "tokenizers"


def test_the_engine_is_not_a_setting_a_rerun_must_match(
    tmp_path: Path, sample: Path, gpt2_tokenizer: Path
) -> None:
    out = tmp_path / "c"
    first = _build(sample, out, str(gpt2_tokenizer), "tokenizers")
    # A rerun with another engine is the same build (a different setting would raise ConfigMismatchError).
    assert _build(sample, out, str(gpt2_tokenizer), "fastokens") == first


class _OneWrongId(FastokensEngine):
    """fastokens, except that the first token of any text holding 'zebra' is off by one."""

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        ids = super().encode_batch(texts)
        return [np.concatenate([a[:1] + 1, a[1:]]) if "zebra" in t else a for t, a in zip(texts, ids)]


@pytest.fixture
def wrong_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("streampack.tokenizer.backends.FastokensEngine", _OneWrongId)


def test_the_verification_sample_stops_an_engine_that_gets_one_id_wrong(
    tmp_path: Path, gpt2_tokenizer: Path, wrong_engine: None
) -> None:
    texts = [f"document {i} about nothing much" for i in range(1500)]
    texts[4] = "a zebra in the first twenty"
    data = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    assert isinstance(load_tokenizer(str(gpt2_tokenizer), engine="fastokens").engine, _OneWrongId)
    with pytest.raises(TokenizerError, match=r"in\.jsonl:5: the fastokens engine's token ids differ .*zebra"):
        streampack.build(data, tmp_path / "sampled", tokenizer=str(gpt2_tokenizer), workers=1)
    texts[4], texts[1200] = texts[0], "a zebra past the first twenty, not in the 0.1 % sample"
    write_jsonl(data, [{"text": t} for t in texts])
    from streampack.builder.pipeline import verified

    assert not verified(0, 1200, "sample")
    streampack.build(data, tmp_path / "unchecked", tokenizer=str(gpt2_tokenizer), workers=1)  # not seen
    with pytest.raises(TokenizerError, match=r"in\.jsonl:1201: "):
        streampack.build(
            data, tmp_path / "all", tokenizer=str(gpt2_tokenizer), workers=1, verify_tokens="all"
        )


def test_gpt2_ranks_become_the_tokenizer_json_that_gives_tiktokens_ids(tiktoken_gpt2: Path) -> None:
    """The GPT-2-pattern ranks fastokens loads as a tokenizer.json (its fast path) give tiktoken's ids."""
    import fastokens
    import tiktoken
    import tiktoken.load

    from streampack.tokenizer.tiktoken_json import byte_level_json, merges_of

    # Every split into two tokens is a merge, ranked by the join's rank, then by the halves' ranks.
    toy = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5}
    assert merges_of(toy) == [(b"a", b"b"), (b"b", b"c"), (b"a", b"bc"), (b"ab", b"c")]
    tok = load_tokenizer(f"tiktoken:{tiktoken_gpt2}")
    assert isinstance(tok.engine, FastokensEngine)
    meta = json.loads(tiktoken_gpt2.with_suffix(".json").read_text())
    ranks = tiktoken.load.load_tiktoken_bpe(str(tiktoken_gpt2))
    fast = fastokens.Tokenizer.from_json_str(byte_level_json(ranks, meta["special_tokens"]))
    enc = tiktoken.Encoding("gpt2", pat_str=meta["pat_str"], mergeable_ranks=ranks, special_tokens={})
    texts = [*EDGE, "naïve café — “quotes” ’s 's", "\u00a0\u2003 spaces\r\n\r\n", "123456789 1.5e10"]
    for text in texts:
        got = fast.encode(text, add_special_tokens=False, split_special_tokens=True).ids
        assert got == enc.encode_ordinary(text), text


def test_build_profile_reports_every_stage(tmp_path: Path, sample: Path, gpt2_tokenizer: Path) -> None:
    """`--profile` prints where the time went; the summary holds the same [wall, CPU] seconds per stage."""
    from tests.conftest import run_cli

    summary = streampack.build(sample, tmp_path / "api", tokenizer=str(gpt2_tokenizer), profile=True)
    for stage in ("prepare", "read", "pieces", "frame", "write", "encode", "verify", "process"):
        assert stage in summary.stages, stage
    wall, cpu = summary.stages["read"]
    assert wall > 0 and cpu > 0
    assert summary.stages["encode"][1] == 0  # encoder threads report wall time; their CPU is the process's
    out = run_cli("build", sample, "--out", tmp_path / "cli", "-t", gpt2_tokenizer, "--profile").stdout
    table = out[out.index("| stage |") :]
    for row in (
        "| read | main |",
        "| encode calls | encoder threads |",
        "| engine threads |",
        "| all processes |",
    ):
        assert row in table, table
    # A finished build run again exits at once, whatever fastokens' loading thread is doing.
    again = run_cli("build", sample, "--out", tmp_path / "cli", "-t", gpt2_tokenizer)
    assert "FATAL" not in again.stderr and again.returncode == 0

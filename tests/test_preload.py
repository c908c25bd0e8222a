"""The ``streampack`` command starts fastokens' load of a build's ``tokenizer.json`` before its imports
(``streampack/__main__.py``, ``streampack/tokenizer/preload.py``); the tokenizer takes that load only where
its file holds the very bytes loaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import streampack
from streampack.tokenizer import load_tokenizer, preload
from streampack.tokenizer.preload import named_by_command
from tests.conftest import TIKTOKEN_GPT2, run_cli, shard_bytes, write_jsonl

pytest.importorskip("fastokens")


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["build", "in.jsonl", "--tokenizer", "tok.json", "--out", "c"], ("tok.json", "auto")),
        (["build", "in.jsonl", "-t", "tok", "--out", "c"], ("tok", "auto")),
        (
            ["build", "in.jsonl", "--tokenizer=tok.json", "--tokenizer-engine", "fastokens"],
            ("tok.json", "fastokens"),
        ),
        (
            ["build", "in.jsonl", "-t", "tok.json", "--tokenizer-engine=tokenizers"],
            ("tok.json", "tokenizers"),
        ),
        (["build", "in.jsonl", "--tokenizer", "tok.json", "--help"], None),
        (["build", "in.jsonl"], None),
        (["info", "--tokenizer", "tok.json"], None),
        ([], None),
    ],
)
def test_the_command_line_names_the_tokenizer_to_load_early(
    args: list[str], named: tuple[str, str] | None
) -> None:
    assert named_by_command(args) == named


def test_only_a_tokenizer_json_the_fast_engine_may_run_is_loaded_early(gpt2_tokenizer: Path) -> None:
    for spec, engine in [(gpt2_tokenizer, "tokenizers"), ("bytes", "auto"), (None, "auto"), (3, "auto")]:
        assert not preload.start(spec, engine)
    assert preload.start(gpt2_tokenizer, "fastokens") and preload.start(str(gpt2_tokenizer))  # once
    assert preload.take(gpt2_tokenizer.read_bytes()) is not None


def test_a_load_is_taken_once_and_only_for_the_same_bytes(gpt2_tokenizer: Path, tmp_path: Path) -> None:
    assert preload.start(str(gpt2_tokenizer.parent))  # a folder holding a tokenizer.json
    definition = gpt2_tokenizer.read_bytes()
    assert preload.take(definition + b" ") is None
    early = preload.take(definition)
    assert early is not None and preload.take(definition) is None
    text = "Hello world, this is a test."
    assert early.result().encode_batch_flat([text], add_special_tokens=False) is not None
    assert not preload.start(str(tmp_path / "absent.json")) and not preload.start("tiktoken:x")


def test_an_unreadable_file_starts_nothing_and_is_left_to_the_command(
    gpt2_tokenizer: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(self: Path) -> bytes:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", refuse)
    assert not preload.start(str(gpt2_tokenizer))
    assert not preload.start("\0")  # a path the OS refuses outright


def test_the_tokenizer_takes_the_early_load_and_encodes_as_without(gpt2_tokenizer: Path) -> None:
    text = ["Hello world, this is a test. <|endoftext|> and more", "second"]
    fresh = load_tokenizer(str(gpt2_tokenizer)).encode_batch(text)
    assert preload.start(str(gpt2_tokenizer))
    early = load_tokenizer(str(gpt2_tokenizer))
    assert preload.take(gpt2_tokenizer.read_bytes()) is None  # taken by the tokenizer
    assert early.engine.name == "fastokens"
    assert [a.tolist() for a in early.encode_batch(text)] == [a.tolist() for a in fresh]


def test_a_failed_early_load_fails_as_a_load_would(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": {"type": "Unigram", "vocab": []}}')
    assert preload.start(str(bad))
    early = preload.take(bad.read_bytes())
    assert early is not None and early.exception() is not None


def test_the_preload_imports_nothing_but_the_standard_library() -> None:
    probe = (
        "import sys, streampack.tokenizer.preload\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'numpy', 'tokenizers', 'fastokens', 'click', 'orjson'}))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_library_call_loads_early_too(
    gpt2_tokenizer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[tuple[object, object]] = []
    start = preload.start

    def recorded(spec: object, engine: object = "auto") -> bool:
        started.append((spec, engine))
        return start(spec, engine)

    monkeypatch.setattr(preload, "start", recorded)
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a few words"}] * 10)
    streampack.build(src, tmp_path / "c", tokenizer=str(gpt2_tokenizer), workers=1)
    assert started == [(str(gpt2_tokenizer), "auto")]
    assert preload.take(gpt2_tokenizer.read_bytes()) is None  # taken by the build's tokenizer


def _command_builds_what_the_library_builds(spec: str, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": f"document {i} " * (i % 50 + 1)} for i in range(300)])
    run_cli("build", src, "--tokenizer", spec, "--out", tmp_path / "cli")
    streampack.build(src, tmp_path / "lib", tokenizer=spec)
    cli, lib = shard_bytes(tmp_path / "cli"), shard_bytes(tmp_path / "lib")
    shards = {k: v for k, v in cli.items() if k.startswith("shards")}
    assert shards and shards == {k: v for k, v in lib.items() if k.startswith("shards")}


def test_the_command_builds_what_the_library_builds(gpt2_tokenizer: Path, tmp_path: Path) -> None:
    _command_builds_what_the_library_builds(str(gpt2_tokenizer), tmp_path)


def test_both_module_entries_run_the_command() -> None:
    helps = [
        subprocess.run([sys.executable, "-m", module, "build", "--help"], capture_output=True, text=True)
        for module in ("streampack", "streampack.cli")
    ]
    assert [h.returncode for h in helps] == [0, 0]
    assert helps[0].stdout.splitlines()[1:] == helps[1].stdout.splitlines()[1:]  # but the program's name


def _cl100k() -> Path:
    path = TIKTOKEN_GPT2.with_name("cl100k_base.tiktoken")
    if not path.exists():
        pytest.skip(f"{path} is absent (../shared/data)")
    return path


def test_a_tiktoken_encoding_fastokens_reads_itself_is_loaded_early(tmp_path: Path) -> None:
    """cl100k's ranks (split by hand-written code, read by fastokens itself) load early; GPT-2's ranks
    (written as a tokenizer.json first), other engines and ranks without a usable sidecar do not."""
    pytest.importorskip("tiktoken")
    ranks = _cl100k()
    assert not preload.start(f"tiktoken:{TIKTOKEN_GPT2}")
    assert not preload.start(f"tiktoken:{ranks}", "tiktoken")
    for sidecar in [None, "{not json", '{"special_tokens": {}}', '{"pat_str": "\\\\w+"}']:
        copy = tmp_path / "enc.tiktoken"
        copy.write_bytes(ranks.read_bytes())
        copy.with_suffix(".json").unlink(missing_ok=True)
        if sidecar is not None:
            copy.with_suffix(".json").write_text(sidecar)
        assert not preload.start(f"tiktoken:{copy}"), sidecar
    definition = ranks.read_bytes() + ranks.with_suffix(".json").read_bytes()
    assert preload.start(f"tiktoken:{ranks}")
    early = preload.take(definition)
    assert early is not None and early.result().encode_batch_flat(["a b"], add_special_tokens=False)


def test_the_tiktoken_tokenizer_takes_the_early_load_and_encodes_as_without() -> None:
    pytest.importorskip("tiktoken")
    ranks = _cl100k()
    text = ["Hello world, this is a test. <|endoftext|> and more", "second’s line"]
    fresh = load_tokenizer(f"tiktoken:{ranks}").encode_batch(text)
    assert preload.start(f"tiktoken:{ranks}")
    early = load_tokenizer(f"tiktoken:{ranks}")
    assert preload.take(ranks.read_bytes() + ranks.with_suffix(".json").read_bytes()) is None  # taken
    assert early.engine.name == "fastokens"
    assert [a.tolist() for a in early.encode_batch(text)] == [a.tolist() for a in fresh]


@pytest.mark.slow
def test_the_command_builds_a_tiktoken_cache_as_the_library_does(tmp_path: Path) -> None:
    pytest.importorskip("tiktoken")
    _command_builds_what_the_library_builds(f"tiktoken:{_cl100k()}", tmp_path)

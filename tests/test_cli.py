"""The command line, run as a user runs it: real subprocesses, real files, exit codes and messages."""

from __future__ import annotations

import gzip
import json
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from tests.conftest import run_cli, write_bytes, write_jsonl


@pytest.mark.slow
def test_build_info_verify_decode(tmp_path: Path, bpe_tokenizer: Path) -> None:
    docs = [{"text": "Hello there, general reader."}, {"text": "Ünïcödé 🙂"}, {"text": ""}]
    src = write_jsonl(tmp_path / "in.jsonl.gz", docs)
    out = tmp_path / "cache"
    result = run_cli("build", src, "--tokenizer", bpe_tokenizer, "--out", out, "--workers", "2")
    assert "2 documents" in result.stdout and "left out 1 empty or whitespace-only document" in result.stdout
    info = json.loads(run_cli("info", out, "--json").stdout)
    assert info["empty_docs"] == 1 and info["inputs"] == str(src)
    assert info["num_docs"] == 2 and info["dtype"] == "uint16" and info["vocab_size"] > 256
    assert {"doc_tokens_mean", "doc_tokens_p50", "doc_tokens_p99", "bytes", "num_shards"} <= set(info)
    assert "num_tokens" in run_cli("info", out).stdout
    assert run_cli("verify", out).stdout.startswith("ok:")
    assert run_cli("decode", out, "--doc", "1").stdout.startswith("Ünïcödé 🙂")


def test_skip_bad_records_reports_a_count(tmp_path: Path) -> None:
    src = write_bytes(tmp_path / "in.jsonl", b'{"text": "a"}\n{"text": 3}\nnot json\n{"text": "b"}\n')
    result = run_cli("build", src, "--out", tmp_path / "c", "--on-bad-record", "skip")
    assert "2 documents" in result.stdout and "skipped 2 bad records" in result.stdout
    assert json.loads(run_cli("info", tmp_path / "c", "--json").stdout)["skipped_records"] == 2


BAD_INPUTS = {
    "malformed JSON": (
        "bad.jsonl",
        b'{"text": "ok"}\n{"text": "unterminated\n',
        r"bad\.jsonl:2: malformed JSON",
    ),
    "missing field": (
        "bad.jsonl",
        b'{"text": "ok"}\n{"body": "x"}\n',
        r"bad\.jsonl:2: no 'text' field \(fields: 'body'\)",
    ),
    "not an object": ("bad.jsonl", b'["text"]\n', r"bad\.jsonl:1: the line is a JSON list"),
    "null text": ("bad.jsonl", b'{"text": null}\n', r"bad\.jsonl:1: the 'text' field is null"),
    "non-string text": ("bad.jsonl", b'{"text": 1}\n', r"bad\.jsonl:1: the 'text' field is int"),
    "invalid UTF-8": ("bad.jsonl", b'{"text": "ok"}\n{"text": "\xff\xfe"}\n', r"bad\.jsonl:2: invalid UTF-8"),
    "invalid UTF-8 text": ("bad.txt", b"fine\n\xc3\x28\n", r"bad\.txt:2: invalid UTF-8"),
    "unknown extension": ("data.csv", b"a,b\n", r"data\.csv: unknown file type"),
}


@pytest.mark.parametrize("kind", BAD_INPUTS)
def test_bad_input_names_file_and_line(tmp_path: Path, kind: str) -> None:
    name, data, message = BAD_INPUTS[kind]
    src = write_bytes(tmp_path / name, data)
    args = ["--split-lines"] if name.endswith(".txt") else []
    result = run_cli("build", src, "--out", tmp_path / "c", *args, check=False)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ")
    assert re.search(message, result.stderr), result.stderr


@pytest.mark.parametrize("suffix", [".gz", ".zst"])
def test_truncated_stream_is_an_error_and_committed_part_stays(tmp_path: Path, suffix: str) -> None:
    lines = b"".join(json.dumps({"text": f"record {i} " * 20}).encode() + b"\n" for i in range(20000))
    full = gzip.compress(lines) if suffix == ".gz" else zstandard.ZstdCompressor().compress(lines)
    src = tmp_path / f"cut.jsonl{suffix}"
    src.write_bytes(full[: len(full) * 2 // 3])
    out = tmp_path / "c"
    result = run_cli(
        "build", src, "--out", out, "--batch-chars", "100000", "--commit-seconds", "0", check=False
    )
    assert result.returncode == 1
    assert "truncated or corrupt" in result.stderr and "cut.jsonl" in result.stderr
    import streampack

    partial = streampack.open(out, allow_incomplete=True)
    assert 0 < partial.num_docs < 20000
    assert partial.doc(partial.num_docs - 1).tolist()[-1] == 256


def test_input_and_tokenizer_errors(tmp_path: Path) -> None:
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    (empty_dir / "notes.md").write_text("x")
    cases = [
        (["build", tmp_path / "missing.jsonl"], "missing.jsonl: no such file or directory"),
        (["build", empty_dir], "the directory holds no input files"),
        (["build", str(tmp_path / "*.ndjson")], "the glob matches no input files"),
        (
            [
                "build",
                write_bytes(tmp_path / "a.jsonl", b'{"text":"x"}\n'),
                "--tokenizer",
                tmp_path / "nope.json",
            ],
            "nope.json': no such file",
        ),
        (
            ["build", tmp_path / "a.jsonl", "--tokenizer", write_bytes(tmp_path / "t.json", b"{not json")],
            "not a valid Hugging Face tokenizer.json",
        ),
        (["info", tmp_path / "nowhere"], "no such cache directory"),
    ]
    for args, message in cases:
        result = (
            run_cli(*args, "--out", tmp_path / "out", check=False)
            if args[0] == "build"
            else run_cli(*args, check=False)
        )
        assert result.returncode == 1, (args, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_empty_file_gives_an_empty_cache(tmp_path: Path) -> None:
    src = write_bytes(tmp_path / "empty.jsonl", b"")
    result = run_cli("build", src, "--out", tmp_path / "c")
    assert "0 documents" in result.stdout


def test_parquet_wrong_schema_and_corrupt_footer(tmp_path: Path) -> None:
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "a.parquet")
    result = run_cli("build", tmp_path / "a.parquet", "--out", tmp_path / "c", check=False)
    assert result.returncode == 1 and "no column 'text' (columns: body)" in result.stderr
    good = (tmp_path / "a.parquet").read_bytes()
    (tmp_path / "b.parquet").write_bytes(good[:-10])
    result = run_cli("build", tmp_path / "b.parquet", "--out", tmp_path / "d", check=False)
    assert result.returncode == 1 and "b.parquet: not a readable Parquet file" in result.stderr


def test_second_build_in_same_directory_is_refused(tmp_path: Path, bpe_tokenizer: Path) -> None:
    import subprocess
    import sys
    import time

    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "word " * 200}] * 20000)
    out = tmp_path / "c"
    cmd = [
        sys.executable,
        "-m",
        "streampack",
        "build",
        str(src),
        "--out",
        str(out),
        "-t",
        str(bpe_tokenizer),
        "--tokenizer-engine",
        "tokenizers",  # the slow engine: fastokens builds this before the second command starts
    ]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not (out / "build.lock").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        second = run_cli("build", src, "--out", out, "-t", bpe_tokenizer, check=False)
        assert first.poll() is None, "the first build finished too soon for this test"
        assert second.returncode == 1 and "locked by another build (pid" in second.stderr
    finally:
        first.wait(timeout=120)
    assert first.returncode == 0


def test_demo_builds_and_reads_batches(tmp_path: Path) -> None:
    result = run_cli("demo", "--out", tmp_path / "demo")
    assert "standard-library files with the 'bytes' tokenizer" in result.stdout
    assert "batch 2: shape (8, 256)" in result.stdout
    assert run_cli("verify", tmp_path / "demo").stdout.startswith("ok:")


def test_max_piece_chars_is_recorded_and_kept_on_resume(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "word " * 3000}])
    out = tmp_path / "cache"
    run_cli("build", src, "--out", out, "--max-piece-chars", "1000")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["settings"]["max_piece_chars"] == 1000
    assert run_cli("decode", out, "--doc", "0").stdout.rstrip("\n") == "word " * 3000
    result = run_cli("build", src, "--out", out, check=False)  # the default (100000) differs: refused
    assert result.returncode == 1 and "max_piece_chars" in result.stderr and "Traceback" not in result.stderr


COMMANDS = ["build", "info", "verify", "upgrade", "decode", "export", "convert", "bench", "mix", "which"]
COMMANDS += ["demo", "audit"]


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_has_help(name: str) -> None:
    """C18: every option of every command says what it does in --help (hidden ones excepted)."""
    import click

    from streampack.cli import cli

    command = cli.commands[name]
    assert command.help
    for group in (cli, command):
        for param in group.get_params(click.Context(group)):
            if isinstance(param, click.Option) and not param.hidden:
                assert param.help, f"{name} {param.opts[0]} has no help"


def test_every_command_is_checked_for_help() -> None:
    from streampack.cli import cli

    assert set(cli.commands) == {c if isinstance(c, str) else c.values[0] for c in COMMANDS}


def test_verify_prints_sizes_people_read(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "tiny"}])
    run_cli("build", src, "--out", tmp_path / "c")
    shown = run_cli("verify", tmp_path / "c").stdout
    assert re.fullmatch(r"ok: \S+/c \(18 bytes checked at [0-9.]+ (bytes|kB|MB|GB)/s\)\n", shown), shown


def test_text_field_must_not_be_empty(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    result = run_cli("build", src, "--out", tmp_path / "c", "--text-field", "", check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "text_field must be a non-empty string" in result.stderr


def test_decode_asks_for_a_tokenizer_that_is_not_found(tmp_path: Path, bpe_tokenizer: Path) -> None:
    """C6: the manifest's relative tokenizer path does not exist from another directory."""
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(bpe_tokenizer, project / "tok.json")
    write_jsonl(project / "in.jsonl", [{"text": "Hello world"}])
    run_cli("build", "in.jsonl", "--out", "cache", "--tokenizer", "tok.json", cwd=project)
    assert run_cli("decode", "cache", "--doc", "0", cwd=project).stdout.startswith("Hello world")
    result = run_cli("decode", project / "cache", "--doc", "0", check=False, cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert (
        "the cache was built with tokenizer 'tok.json', a path relative to where the build ran, which does "
        f"not exist from {tmp_path}: pass --tokenizer PATH" in result.stderr
    )
    result = run_cli("decode", project / "cache", "--doc", "0", "-t", project / "tok.json", cwd=tmp_path)
    assert result.stdout.startswith("Hello world") and not result.stderr


def test_decode_asks_for_a_tokenizer_where_the_cache_records_none(
    tmp_path: Path, gpt2_tokenizer: Path
) -> None:
    """New user finding 1: a nanoGPT train.bin (written with numpy, as prepare.py does) and the cache
    converted from it name no tokenizer; decode refused to guess (bytes printed mojibake with exit 0) and
    asks for --tokenizer. --ids, and --tokenizer, still decode; a cache built with bytes decodes as before."""
    import numpy as np
    from tokenizers import Tokenizer

    texts = ["Hello world, this is nanoGPT.", "A second document."]
    tokenizer = Tokenizer.from_file(str(gpt2_tokenizer))
    ids = [[*tokenizer.encode(t).ids, 50256] for t in texts]
    (tmp_path / "nano").mkdir()
    np.array([i for doc in ids for i in doc], dtype=np.uint16).tofile(tmp_path / "nano" / "train.bin")
    run_cli("convert", tmp_path / "nano", "--out", tmp_path / "native", "--eos-id", 50256)
    for cache in (tmp_path / "nano", tmp_path / "native"):
        result = run_cli("decode", cache, "--doc", "0", check=False)
        assert result.returncode == 1 and not result.stdout and "Traceback" not in result.stderr, (
            result.stderr
        )
        assert f"error: {cache}: the cache records no tokenizer to decode with" in result.stderr
        assert "pass --tokenizer SPEC" in result.stderr
        shown = run_cli("decode", cache, "--doc", "0", "--tokenizer", gpt2_tokenizer).stdout
        assert shown.startswith(texts[0])
    assert run_cli("decode", tmp_path / "native", "--doc", "1", "--ids").stdout.split() == list(
        map(str, ids[1])
    )
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "plain bytes"}])
    run_cli("build", src, "--out", tmp_path / "bytes")
    assert run_cli("decode", tmp_path / "bytes", "--doc", "0").stdout.startswith("plain bytes")


def test_decode_refuses_a_tokenizer_changed_since_the_build(tmp_path: Path, bpe_tokenizer: Path) -> None:
    """C6: the manifest's sha256 of the tokenizer is checked; --tokenizer overrides it with a warning."""
    import hashlib

    tok = tmp_path / "tok.json"
    shutil.copy(bpe_tokenizer, tok)
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "Hello world"}])
    run_cli("build", src, "--out", tmp_path / "cache", "--tokenizer", tok)
    built_with = hashlib.sha256(tok.read_bytes()).hexdigest()
    edited = json.loads(tok.read_text())
    tok.write_text(json.dumps(edited, indent=1))  # the same tokenizer, another file: another sha256
    now = hashlib.sha256(tok.read_bytes()).hexdigest()
    result = run_cli("decode", tmp_path / "cache", "--doc", "0", check=False)
    assert result.returncode == 1 and not result.stdout, result.stderr
    assert f"has sha256 {now}, but the cache was built with sha256 {built_with}" in result.stderr
    result = run_cli("decode", tmp_path / "cache", "--doc", "0", "--tokenizer", tok)
    assert result.stdout.startswith("Hello world")
    assert result.stderr.startswith(f"warning: tokenizer '{tok}' has sha256 {now}, but the cache was built")


def test_info_lists_what_was_read_and_what_was_skipped(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_jsonl(data / "a.jsonl", [{"text": "one"}])
    write_jsonl(data / ".ipynb_checkpoints" / "a-checkpoint.jsonl", [{"text": "one"}])
    (data / "config.json").write_text('{\n  "vocab": 3\n}\n')
    run_cli("build", data, data / "a.jsonl", "--out", tmp_path / "c")
    info = json.loads(run_cli("info", tmp_path / "c", "--json").stdout)
    assert info["inputs"] == str(data / "a.jsonl") and info["num_docs"] == 1
    assert info["ignored_inputs"].startswith("3 (1 duplicate, 1 hidden, 1 not JSON Lines), e.g. ")


def test_the_guides_python_build_writes_its_own_cache_directory() -> None:
    """A newcomer runs the README's CLI build, then the build guide's Python build: the second must not be
    refused as a build into the first one's cache with other inputs."""
    root = Path(__file__).resolve().parents[1]
    readme, guide = (root / "README.md").read_text(), (root / "docs" / "guide" / "build.md").read_text()
    cli_out = re.search(r"^streampack build data/\S+ .*--out (\S+)", readme, re.M)
    python_out = re.search(r'streampack\.build\(\["a\.jsonl\.gz", "b\.parquet"\], "([^"]+)"', guide)
    assert cli_out and python_out
    assert cli_out.group(1).rstrip("/") != python_out.group(1).rstrip("/")


def test_build_has_one_flag_per_option_field() -> None:
    """Every field of CacheSpec and RunOptions is set by exactly one flag of ``build`` (or is listed as
    having none), so a field added to the dataclasses cannot be missing from the command."""
    import dataclasses

    from streampack.builder.options import CacheSpec, RunOptions
    from streampack.cli.build import FLAGS, NO_FLAG

    declared = [(flag.owner, flag.field) for flag in FLAGS]
    assert len(declared) == len(set(declared))
    every = {(cls, f.name) for cls in (CacheSpec, RunOptions) for f in dataclasses.fields(cls)}
    assert set(declared) | set(NO_FLAG) == every and not set(declared) & set(NO_FLAG)


def test_build_flags_default_to_the_dataclasses_defaults() -> None:
    import click

    from streampack.builder.options import CacheSpec, RunOptions
    from streampack.cli import cli
    from streampack.cli.build import options_from_flags

    command = cli.commands["build"]
    given = {
        p.name: p.get_default(click.Context(command))
        for p in command.params
        if p.name not in {"inputs", "out"}
    }
    spec, run = options_from_flags({**given, "progress": False})
    assert spec == CacheSpec() and run == RunOptions()


@pytest.fixture
def nanogpt_file(tmp_path: Path) -> Path:
    """A headerless nanoGPT train.bin: its format, dtype and EOS are told, not read."""
    import numpy as np

    path = tmp_path / "train.bin"
    np.array([5, 6, 0, 7, 0] * 20, dtype="<u2").tofile(path)
    return path


@pytest.mark.parametrize(("old", "new"), [("--from", "--format"), ("--token-dtype", "--dtype")])
def test_an_old_source_flag_still_works_and_names_the_new_one(nanogpt_file: Path, old: str, new: str) -> None:
    """Scripts written before the source flags took ``streampack.open``'s names keep working, warned."""
    flags = {"--format": "nanogpt", "--dtype": "uint16"}
    given = [arg for flag, value in flags.items() for arg in ((old if flag == new else flag), value)]
    shown = run_cli("info", nanogpt_file, *given, "--eos-id", "0", "--json")
    assert f"warning: {old} is deprecated; use {new}" in shown.stderr
    assert json.loads(shown.stdout)["num_docs"] == 40


@pytest.mark.parametrize(("old", "new"), [("--format", "--to"), ("--dtype", "--out-dtype")])
def test_export_reads_its_old_output_flags_with_a_warning(tmp_path: Path, old: str, new: str) -> None:
    """``export --format F --dtype D`` named what export writes before ``--to`` and ``--out-dtype``."""
    from streampack.testing import write_random_cache

    cache = write_random_cache(tmp_path / "c", 5000)
    dtype = ["--dtype" if old == "--dtype" else "--out-dtype", "uint16"]
    done = run_cli("export", cache, "--format", "nanogpt", *dtype, "--out", tmp_path / "ng", "--no-progress")
    assert f"warning: export {old}" in done.stderr and f"use {new}" in done.stderr
    assert "as nanogpt" in done.stdout and (tmp_path / "ng" / "train.bin").exists()
    missing = run_cli("export", cache, "--out", tmp_path / "x", check=False)
    assert missing.returncode == 2 and "--to" in missing.stderr


def test_bench_workers_is_now_loader_workers(tmp_path: Path) -> None:
    """``bench --workers`` meant DataLoader workers, which ``build --workers`` (processes) does not."""
    from streampack.testing import write_random_cache

    cache = write_random_cache(tmp_path / "c", 5000)
    done = run_cli("bench", cache, "--seq-len", "8", "--batch-size", "4", "--steps", "2", "--workers", "0")
    assert "warning: --workers is deprecated; use --loader-workers" in done.stderr
    assert "throughput" in done.stdout

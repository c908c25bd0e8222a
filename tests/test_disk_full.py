"""A build that runs out of space stops with a clear message and resumes once there is room."""

from __future__ import annotations

import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import streampack
from tests.conftest import run_cli, shard_bytes, write_jsonl


def _limit_file_size(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # writes past it fail with EFBIG


def test_file_size_limit_then_resume(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": f"document {i} " * 40} for i in range(6000)])
    args = [
        str(src),
        "--out",
        str(tmp_path / "c"),
        "--workers",
        "1",
        "--batch-chars",
        "50000",
        "--commit-seconds",
        "0",
        "--commit-mb",
        "0",
    ]
    limited = subprocess.run(
        [sys.executable, "-m", "streampack", "build", *args],
        capture_output=True,
        text=True,
        preexec_fn=lambda: _limit_file_size(1 << 20),
        timeout=120,
    )
    assert limited.returncode == 1, limited.stderr
    assert "file size limit reached while writing" in limited.stderr
    assert "rerun the same command to resume" in limited.stderr and "Traceback" not in limited.stderr
    committed = streampack.open(tmp_path / "c", allow_incomplete=True).num_docs
    assert 0 < committed < 6000

    run_cli("build", *args)
    run_cli("build", args[0], "--out", tmp_path / "reference", *args[3:])
    assert shard_bytes(tmp_path / "c") == shard_bytes(tmp_path / "reference")


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MB tmpfs, mounted for the test (needs root; skipped elsewhere)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_on_a_small_filesystem_then_resume_with_room(
    tmp_path: Path, small_filesystem: Path
) -> None:
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": f"document {i} " * 40} for i in range(6000)])
    args = ["--workers", "1", "--batch-chars", "50000", "--commit-seconds", "0", "--commit-mb", "0"]
    out = small_filesystem / "c"
    full = run_cli("build", src, "--out", out, *args, check=False)
    assert full.returncode == 1 and "Traceback" not in full.stderr, full.stderr
    assert "disk full while writing" in full.stderr and "rerun the same command to resume" in full.stderr
    assert 0 < streampack.open(out, allow_incomplete=True).num_docs < 6000
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_filesystem)], check=True)
    run_cli("build", src, "--out", out, *args)
    run_cli("build", src, "--out", tmp_path / "reference", *args)
    assert shard_bytes(out) == shard_bytes(tmp_path / "reference")


def test_read_only_output_is_a_clear_error(tmp_path: Path, small_filesystem: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(small_filesystem)], check=True)
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}])
    for out in (small_filesystem, small_filesystem / "sub"):
        result = run_cli("build", src, "--out", out, check=False)
        assert result.returncode == 1 and "Read-only file system; choose a writable --out" in result.stderr


# ----------------------------------------------------------------------------- exports


@pytest.fixture
def exported_cache(tmp_path: Path) -> Path:
    """A cache of about 3 MB of uint16 tokens: more than the small file system holds."""
    src = write_jsonl(
        tmp_path / "in.jsonl", [{"text": f"document {i} " + "word " * 200} for i in range(3000)]
    )
    run_cli("build", src, "--out", tmp_path / "c", "--workers", "1")
    return tmp_path / "c"


def test_an_export_that_fills_the_disk_names_its_file_and_keeps_nothing(
    exported_cache: Path, small_filesystem: Path
) -> None:
    """An export is atomic: its message is not the build's (which keeps what it committed and resumes)."""
    for format, written in (("nanogpt", "ng/train.bin"), ("megatron", "ng.bin"), ("streampack", "ng/shards")):
        full = run_cli(
            "export", exported_cache, "--to", format, "--out", small_filesystem / "ng", "--no-progress",
            check=False,
        )  # fmt: skip
        assert full.returncode == 1 and "Traceback" not in full.stderr, full.stderr
        assert f"error: disk full while writing {small_filesystem / written}" in full.stderr
        assert (
            "the export stopped and kept nothing" in full.stderr
            and "then rerun the same command" in full.stderr
        )
        assert "committed so far is kept" not in full.stderr
        assert not list(small_filesystem.iterdir())  # the staging area removed too


def test_an_export_past_the_file_size_limit_names_its_file(exported_cache: Path, tmp_path: Path) -> None:
    limited = subprocess.run(
        [sys.executable, "-m", "streampack", "export", str(exported_cache), "--to", "llmc",
         "--out", str(tmp_path / "llmc"), "--no-progress"],
        capture_output=True, text=True, preexec_fn=lambda: _limit_file_size(1 << 20), timeout=120,
    )  # fmt: skip
    assert limited.returncode == 1 and "Traceback" not in limited.stderr, limited.stderr
    assert f"file size limit reached while writing {tmp_path / 'llmc' / 'train_000000.bin'}" in limited.stderr
    assert "kept nothing" in limited.stderr and "raise the file size limit (ulimit -f)" in limited.stderr
    assert not list(tmp_path.glob("*llmc*"))

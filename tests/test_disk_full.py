"""A build that runs out of space stops with a clear message and resumes once there is room."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

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
        [sys.executable, "-m", "streampack.cli", "build", *args],
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

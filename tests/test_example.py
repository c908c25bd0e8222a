"""Runs `examples/train_tiny_gpt.py` in short: stopped halfway and resumed, it matches a straight run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

import streampack

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_tiny_gpt.py"
FLAGS = ["--steps", "30", "--seq-len", "32", "--batch-size", "8", "--workers", "2"]
FLAGS += ["--checkpoint-every", "10"]


def train(cache: Path, out: Path, *extra: str) -> str:
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), str(cache), "--out", str(out), *FLAGS, *extra],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return run.stdout


def log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_stopped_and_resumed_run_continues_the_straight_run(tmp_path: Path) -> None:
    sources = sorted(Path(streampack.__file__).parent.glob("*.py"))
    cache = tmp_path / "cache"
    texts = streampack.Documents([path.read_text() for path in sources])
    streampack.build(texts, cache, tokenizer="bytes", workers=1)

    train(cache, tmp_path / "straight")
    stopped = train(cache, tmp_path / "resumed", "--stop-after", "15")
    resumed = train(cache, tmp_path / "resumed")

    assert "stopped at step 15 of 30" in stopped
    assert "resumed at step 15" in resumed and "done: 30 steps" in resumed
    straight, interrupted = log(tmp_path / "straight"), log(tmp_path / "resumed")
    assert [entry["step"] for entry in interrupted] == list(range(1, 31))
    assert [entry["batch"] for entry in interrupted] == [entry["batch"] for entry in straight]
    for a, b in zip(interrupted, straight):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)

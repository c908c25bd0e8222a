"""Crash safety: SIGKILL a real build at random instants, rerun it, and get the same bytes."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import streampack
from tests.conftest import shard_bytes, write_bytes, write_jsonl


def make_corpus(root: Path) -> list[Path]:
    """Several files in several formats: a JSONL big enough to split, gzip, zstd, Parquet, text."""
    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", "Ünïcödé", "🙂", "tokens", "cache", "\n"]

    def doc(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    root.mkdir()
    paths = [
        write_jsonl(root / "a.jsonl", [{"text": doc(rng.randint(0, 400))} for _ in range(3000)]),
        write_jsonl(root / "b.jsonl.gz", [{"text": doc(rng.randint(0, 400))} for _ in range(1500)]),
        write_jsonl(root / "c.jsonl.zst", [{"text": doc(rng.randint(0, 400))} for _ in range(1500)]),
    ]
    pq.write_table(
        pa.table({"text": [doc(rng.randint(0, 400)) for _ in range(1500)]}),
        root / "d.parquet",
        row_group_size=100,
    )
    paths.append(root / "d.parquet")
    paths.append(write_bytes(root / "e.txt", doc(20000).encode()))
    return paths


def build_args(inputs: list[Path], out: Path, tokenizer: Path) -> list[str]:
    return [
        *map(str, inputs),
        "--out",
        str(out),
        "--tokenizer",
        str(tokenizer),
        "--workers",
        "2",
        "--unit-mb",
        "1",
        "--batch-chars",
        "20000",
        "--commit-seconds",
        "0",
        "--commit-mb",
        "0",
    ]


def kill_at(args: list[str], delay: float) -> bool:
    """Start a build, SIGKILL its whole process group after ``delay`` s; True if it was still running."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "streampack", "build", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    time.sleep(delay)
    running = proc.poll() is None
    if running:
        os.killpg(proc.pid, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=120)
    assert running or proc.returncode == 0, stderr.decode()
    return running


@pytest.mark.slow
@pytest.mark.parametrize(("kills", "extra"), [(10, []), (6, ["--sft"])], ids=["text", "sft"])
def test_killed_builds_resume_to_identical_bytes(kills: int, extra: list[str]) -> None:
    """The short form of benchmarks/torture.py: SIGKILLs, each resumed to identical bytes (with --sft,
    the loss masks too)."""
    torture = Path(__file__).resolve().parents[1] / "benchmarks" / "torture.py"
    command = [sys.executable, str(torture), "--kills", str(kills), *extra]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    last = result.stdout.strip().splitlines()[-1]
    landed, identical = (int(n) for n in re.findall(r"\d+", last))
    assert landed >= kills and identical == landed, result.stdout


@pytest.mark.slow
def test_a_killed_sft_build_resumes_to_identical_tokens_and_masks(
    tmp_path: Path, bpe_tokenizer: Path
) -> None:
    """Kills after the first commit, twice, each resumed: every file, the .mask files included, is the
    same as an uninterrupted build's."""
    rng = random.Random(5)
    words = ["alpha", "beta", "gamma", "delta", "Ünïcödé", "🙂", "tokens", "\n"]

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    rows = [{"prompt": text(rng.randint(0, 200)), "response": text(rng.randint(0, 300))} for _ in range(6000)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)  # ~9 MB: 9 units of 1 MB
    args = [*build_args([src], tmp_path / "c", bpe_tokenizer), "--fields", "prompt,response"]
    for _ in range(2):
        proc = start_build(args, tmp_path / "c")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    assert not streampack.open(tmp_path / "c", allow_incomplete=True).manifest.complete
    resumed = subprocess.run(
        [sys.executable, "-m", "streampack", "build", *args], capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0 and "resumed" in resumed.stdout, resumed.stderr
    straight = [*build_args([src], tmp_path / "straight", bpe_tokenizer), "--fields", "prompt,response"]
    subprocess.run([sys.executable, "-m", "streampack", "build", *straight], check=True, timeout=300)
    files = shard_bytes(tmp_path / "c")
    assert (
        len([name for name in files if name.endswith(".mask")]) == streampack.open(tmp_path / "c").num_shards
    )
    assert files == shard_bytes(tmp_path / "straight")
    assert streampack.verify(tmp_path / "c").ok


@pytest.mark.slow
def test_readers_during_a_build_see_only_committed_documents(tmp_path: Path, bpe_tokenizer: Path) -> None:
    inputs = make_corpus(tmp_path / "in")
    out = tmp_path / "c"
    proc = subprocess.Popen(
        [sys.executable, "-m", "streampack", "build", *build_args(inputs, out, bpe_tokenizer)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    seen = 0
    while proc.poll() is None:
        if not (out / "manifest.json").exists():  # written once the build has planned its units
            time.sleep(0.01)
            continue
        cache = streampack.open(out, allow_incomplete=True)  # B2: units not started have no files yet
        for shard in range(cache.num_shards):
            if cache.shards[shard].num_docs:
                offsets = cache.shard_offsets(shard)
                last = cache.shard_tokens(shard)[
                    int(offsets[-2]) if len(offsets) > 1 else 0 : int(offsets[-1])
                ]
                assert last[-1] == cache.eos_id  # a whole document, ending in EOS
                seen += 1
    assert proc.wait() == 0, proc.stderr.read().decode()
    assert seen > 0
    final = streampack.open(out)
    assert final.num_docs == sum(s.num_docs for s in final.shards)


def test_an_interrupted_build_serves_its_committed_prefix(tmp_path: Path, bpe_tokenizer: Path) -> None:
    """B2: after a kill, open(allow_incomplete=True) reads what was committed, though later units never
    started (and have no shard files)."""
    rng = random.Random(3)
    words = ["alpha", "beta", "gamma", "delta", "tokens"]
    docs = [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(1, 300)))} for _ in range(9000)]
    src = write_jsonl(tmp_path / "in.jsonl", docs)  # ~8 MB: 8 units of 1 MB
    out = tmp_path / "c"
    args = [*build_args([src], out, bpe_tokenizer)]
    args[args.index("--workers") + 1] = "1"  # the units run in order, so the last ones have not started
    proc = start_build(args, out)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)

    partial = streampack.open(out, allow_incomplete=True)
    assert not (out / "shards" / f"{partial.num_shards - 1:06d}.tokens").exists()
    assert 0 < partial.num_docs < len(docs)
    full = streampack.build(src, tmp_path / "full", tokenizer=str(bpe_tokenizer), unit_bytes=1 << 20)
    complete = streampack.open(full.out)
    assert partial.num_shards == complete.num_shards
    for shard in range(partial.num_shards):  # each unit's committed documents are its first ones
        first = int(complete.doc_starts[shard])
        for i in range(partial.shards[shard].num_docs):
            got = partial.doc(int(partial.doc_starts[shard]) + i)
            assert np.array_equal(got, complete.doc(first + i))


def start_build(args: list[str], out: Path) -> subprocess.Popen:
    """``streampack build ARGS`` in a session of its own, returned once its first unit has committed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "streampack", "build", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not list((out / "ledger").glob("*.json")) and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    return proc


def live_processes(group: int) -> list[str]:
    """The processes of a process group that are still running (zombies left to reap are not)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            found.append(f"{stat.parent.name} {fields[0]} {(stat.parent / 'cmdline').read_bytes()!r}")
    return found


@pytest.mark.slow
@pytest.mark.parametrize("target", ["coordinator", "process group"])
def test_sigterm_stops_a_build_like_ctrl_c(tmp_path: Path, target: str) -> None:
    """C5: SIGTERM (Slurm, Kubernetes) says how to resume, exits 143, leaks nothing; the resume is exact."""
    inputs = make_corpus(tmp_path / "in")
    out = tmp_path / "c"
    args = build_args(inputs, out, Path("bytes"))  # a pool of 2 workers
    proc = start_build(args, out)
    assert proc.poll() is None, "the build finished before it could be stopped"
    (os.kill if target == "coordinator" else os.killpg)(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr.decode()
    assert stderr.decode().strip() == "interrupted; rerun the same command to resume"  # no leak warning
    deadline = time.monotonic() + 10  # a process may still be exiting after it closed its stderr
    while live_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not live_processes(proc.pid)
    assert not streampack.open(out, allow_incomplete=True).manifest.complete

    resumed = subprocess.run(
        [sys.executable, "-m", "streampack", "build", *args], capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0 and "resumed" in resumed.stdout, resumed.stderr
    straight = tmp_path / "straight"
    subprocess.run(
        [sys.executable, "-m", "streampack", "build", *build_args(inputs, straight, Path("bytes"))],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert shard_bytes(out) == shard_bytes(straight)

"""Engines only schedule: the process pool and a real local Ray cluster give the same bytes, and a dying
worker is one resumable error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import streampack
from streampack.builder.executors import run_ray
from streampack.errors import BadRecordError, WorkerDiedError
from tests.conftest import shard_bytes, write_bytes, write_jsonl


def test_a_build_script_without_a_main_guard_runs_once(tmp_path: Path) -> None:
    """B3: the pool's workers never re-run the user's script (here it would delete its own cache)."""
    inputs = [
        write_jsonl(tmp_path / f"{name}.jsonl", [{"text": f"{name} {i} " * 17} for i in range(1000)])
        for name in ("a", "b")
    ]
    assert all(110_000 < p.stat().st_size < 120_000 for p in inputs)  # two units each
    script = tmp_path / "build_cache.py"
    script.write_text(
        textwrap.dedent(
            """
            import shutil
            import streampack

            shutil.rmtree("cache", ignore_errors=True)
            with open("runs.txt", "a") as f:
                f.write("ran\\n")
            streampack.build(["a.jsonl", "b.jsonl"], "cache/", unit_bytes=65536, workers=2)
            print(streampack.open("cache/").num_shards)
            """
        )
    )
    run = subprocess.run(
        [sys.executable, script.name], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "runs.txt").read_text() == "ran\n"  # the script's side effects ran once
    assert run.stdout.split() == ["4"]
    streampack.build(inputs, tmp_path / "straight", unit_bytes=65536, workers=1)
    assert shard_bytes(tmp_path / "cache") == shard_bytes(tmp_path / "straight")


@pytest.fixture(scope="module")
def local_cluster() -> Iterator[None]:
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_ray_engine_matches_local(
    tmp_path: Path, bpe_tokenizer: Path, local_cluster: None, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = [
        write_jsonl(
            tmp_path / "in" / f"{i}.jsonl.gz", [{"text": f"doc {i}.{j} " * (j % 40)} for j in range(2000)]
        )
        for i in range(3)
    ]
    inputs.append(
        write_jsonl(tmp_path / "in" / "big.jsonl", [{"text": "word " * (j % 90)} for j in range(3000)])
    )
    options = {"tokenizer": str(bpe_tokenizer), "unit_bytes": 1 << 16}
    summary = streampack.build(inputs, tmp_path / "ray", executor="ray", progress=True, **options)
    assert summary.empty_docs == 3 * 50 + 34  # the texts repeated 0 times
    docs = f"{9000 - summary.empty_docs:,} docs"
    assert docs in capsys.readouterr().err.splitlines()[-1]  # the tasks' progress reached the bar
    streampack.build(inputs, tmp_path / "local", workers=2, **options)
    assert streampack.open(tmp_path / "ray").num_shards > 4
    assert shard_bytes(tmp_path / "ray") == shard_bytes(tmp_path / "local")


@pytest.mark.slow
def test_ray_engine_reports_bad_records_like_local(tmp_path: Path, local_cluster: None) -> None:
    src = write_bytes(tmp_path / "bad.jsonl", b'{"text": "ok"}\n{"oops": 1}\n')
    with pytest.raises(BadRecordError, match=r"bad\.jsonl:2: no 'text' field"):
        streampack.build(src, tmp_path / "c", executor="ray")


def _killed_units(tasks: Sequence[Any], report: Callable[[dict[str, int]], None]) -> Iterator[Any]:
    os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer, or a lost node, would
    yield from tasks


def _queue_killing_units(tasks: Sequence[Any], report: Callable[[dict[str, int]], None]) -> Iterator[Any]:
    import ray

    ray.kill(report.__self__.actor)  # type: ignore[attr-defined]  # the progress queue's actor dies
    yield from tasks


def _buggy_units(tasks: Sequence[Any], report: Callable[[dict[str, int]], None]) -> Iterator[Any]:
    raise ZeroDivisionError("a bug")
    yield


@pytest.mark.slow
@pytest.mark.parametrize("units", [_killed_units, _queue_killing_units], ids=["task killed", "queue died"])
def test_ray_failures_are_one_resumable_error(local_cluster: None, units: Any) -> None:
    """B7: a dead Ray worker or actor is the same one-line error as a dead pool worker."""
    with pytest.raises(WorkerDiedError, match=r"^a Ray worker of the build failed \(\w+Error: .*\); rerun "):
        list(run_ray(units, [1, 2], address=None, on_progress=lambda event: None))


@pytest.mark.slow
def test_a_bug_in_a_ray_task_keeps_its_own_exception(local_cluster: None) -> None:
    with pytest.raises(ZeroDivisionError, match="a bug"):
        list(run_ray(_buggy_units, [1], address=None, on_progress=lambda event: None))

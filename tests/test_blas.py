"""The processes streampack starts keep numpy's BLAS threads from starting (``streampack/_blas.py``): the
``streampack`` command, and a build's spawned worker processes; a number the user chose is kept."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from streampack.builder import executors

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")

# Run as the console script runs, then count this process's threads (nothing else starts one for --help).
_COMMAND = """
import os, sys
sys.argv = ["streampack", "--help"]
from streampack.__main__ import main
try:
    main()
except SystemExit:
    pass
import numpy
print(len(os.listdir("/proc/self/task")), os.environ.get("OPENBLAS_NUM_THREADS"))
"""


def _run(code: str, **env: str) -> tuple[int, str | None]:
    environ = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"} | env
    command = [sys.executable, "-c", code]
    out = subprocess.run(command, env=environ, capture_output=True, text=True, check=True)
    threads, variable = out.stdout.split()[-2:]
    return int(threads), None if variable == "None" else variable


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS starts no thread of its own on one core")
def test_numpy_alone_starts_blas_threads_that_the_command_does_not() -> None:
    plain = 'import os, numpy; print(len(os.listdir("/proc/self/task")), None)'
    if _run(plain)[0] == 1:  # what the command prevents (where it happens, this test can fail)
        pytest.skip("this numpy's BLAS starts no threads at import")
    assert _run(_COMMAND) == (1, "1")


def test_the_command_keeps_a_number_the_user_chose() -> None:
    assert _run(_COMMAND, OPENBLAS_NUM_THREADS="2")[1] == "2"


def _threads_after_numpy(connection: Connection) -> None:
    import numpy  # noqa: F401

    connection.send((len(os.listdir("/proc/self/task")), os.environ.get("OPENBLAS_NUM_THREADS")))


def _started(process_class: type[multiprocessing.process.BaseProcess]) -> tuple[int, str | None]:
    receiving, sending = multiprocessing.Pipe(duplex=False)
    process = process_class(target=_threads_after_numpy, args=(sending,))
    process.start()
    try:
        return receiving.recv()
    finally:
        process.join()


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS starts no thread of its own on one core")
def test_a_build_worker_process_starts_no_blas_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    if _started(multiprocessing.get_context("spawn").Process)[0] == 1:  # a plain spawned process
        pytest.skip("this numpy's BLAS starts no threads at import")
    assert _started(executors._WorkerProcess) == (1, "1")
    assert "OPENBLAS_NUM_THREADS" not in os.environ  # this process's environment is as it was


def test_a_build_worker_process_keeps_a_number_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    assert _started(executors._WorkerProcess)[1] == "2"

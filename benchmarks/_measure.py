"""Run a command and measure its wall time and peak RSS over its whole process tree.

Shared by the benchmarks. Peak RSS is sampled, not exact: every ``poll_s`` seconds the RSS of the
process and all of its descendants (recursive) is summed and the maximum kept. Sampling every 50 ms
can miss a spike shorter than that, but catches anything that lasts long enough to matter for a
multi-second build; summing the tree is what makes ``num_proc``/worker pools visible, which a
``getrusage(RUSAGE_CHILDREN)`` maximum (the largest single child) would hide.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import psutil

MB = 1024 * 1024


@dataclass(frozen=True)
class Measurement:
    """What one measured run produced.

    Attributes:
        wall_s: Wall-clock seconds from start to exit.
        peak_rss_mb: Largest sampled sum of RSS over the process tree, in MiB.
        returncode: Exit code of the top process (negative: killed by that signal).
        stdout: Everything the command wrote to standard output.
        stderr: Everything the command wrote to standard error.
    """

    wall_s: float
    peak_rss_mb: float
    returncode: int
    stdout: str
    stderr: str


def tree_rss(proc: psutil.Process) -> int:
    """Return the summed RSS in bytes of ``proc`` and all its descendants (0 once it is gone)."""
    total = 0
    try:
        members = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for member in members:
        # a child may exit between listing and reading
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += member.memory_info().rss
    return total


def run(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    poll_s: float = 0.05,
    timeout_s: float | None = None,
    unset: Sequence[str] = (),
) -> Measurement:
    """Run ``cmd`` to completion, sampling the RSS of its process tree every ``poll_s`` seconds.

    Output goes to temporary files rather than pipes, so a chatty command cannot block on a full pipe
    while we are busy polling.

    Args:
        cmd: The command and its arguments.
        env: Extra environment variables, added to (and overriding) the current environment.
        cwd: Working directory for the command.
        poll_s: Sampling interval in seconds.
        timeout_s: Kill the process tree after this many seconds (``None``: wait forever).
        unset: Variables of the current environment to leave out (``PYTHONPATH`` for another venv).

    Returns:
        The measurement. A timed-out run has ``returncode`` -9 and a note appended to ``stderr``.
    """
    full_env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in unset}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        popen = subprocess.Popen(list(cmd), stdout=out, stderr=err, env=full_env, cwd=cwd)
        proc = psutil.Process(popen.pid)
        peak = 0
        timed_out = False
        while popen.poll() is None:
            peak = max(peak, tree_rss(proc))
            if timeout_s is not None and time.perf_counter() - start > timeout_s:
                _kill_tree(proc)
                timed_out = True
                popen.wait()
                break
            time.sleep(poll_s)
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        stderr = err.read() + (f"\n[timed out after {timeout_s} s]" if timed_out else "")
        return Measurement(wall, peak / MB, popen.returncode, out.read(), stderr)


def _kill_tree(proc: psutil.Process) -> None:
    """Kill ``proc`` and its descendants (children first), ignoring ones already gone."""
    try:
        members = [*proc.children(recursive=True), proc]
    except psutil.NoSuchProcess:
        return
    for member in members:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()

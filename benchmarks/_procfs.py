"""Per-process memory from /proc and the timing loop, shared by the loader benchmark's workers (no deps)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def rss_anon_mb(pid: int | str = "self") -> float:
    """``RssAnon`` of a process in MiB (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def cpu_seconds(pid: int | str = "self") -> float:
    """User plus system CPU seconds a process has used so far (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def children() -> list[int]:
    """Process ids of this process's children (the DataLoader workers)."""
    me, found = str(os.getpid()), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[1] == me:
                found.append(int(stat.parent.name))
        except (OSError, IndexError):
            continue
    return found


def time_batches(
    it: Iterator[Any], *, batch: int, warmup: int, repeats: int, batches: int
) -> dict[str, float]:
    """Best samples/s over ``repeats`` rounds of ``batches`` batches, then RssAnon of main and workers.

    Also the best samples per CPU second of this process (``cpu_samples_per_s``): with no workers, the
    work itself, which time slices lost to other processes on a loaded machine do not count against.

    Memory is read after the timed rounds, off the clock: one :func:`children` call scans every process in
    /proc (~8 ms on the shared benchmark machine), which, read every 100 batches inside the rounds, added
    ~80 µs to every batch of every row and pulled all ratios toward 1.
    """
    for _ in range(warmup):
        next(it)
    best, best_cpu = 0.0, 0.0
    for _ in range(repeats):
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(batches):
            next(it)
        best = max(best, batches * batch / (time.perf_counter() - start))
        best_cpu = max(best_cpu, batches * batch / max(time.process_time() - cpu, 1e-9))
    workers = [rss_anon_mb(pid) for pid in children()]
    return {
        "samples_per_s": best,
        "cpu_samples_per_s": best_cpu,
        "main_mb": rss_anon_mb(),
        "worker_mb": max([0.0, *workers]),
    }

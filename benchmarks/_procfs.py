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
    """Best samples/s over ``repeats`` rounds of ``batches`` batches, and peak RssAnon of main and workers."""
    for _ in range(warmup):
        next(it)
    best, main_peak, worker_peak = 0.0, 0.0, 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        for count in range(1, batches + 1):
            next(it)
            if count % 100 == 0 or count == batches:  # a few /proc reads: noise, not a cost
                main_peak = max(main_peak, rss_anon_mb())
                worker_peak = max([worker_peak, *(rss_anon_mb(pid) for pid in children())])
        best = max(best, batches * batch / (time.perf_counter() - start))
    main_peak = max(main_peak, rss_anon_mb())
    return {"samples_per_s": best, "main_mb": main_peak, "worker_mb": worker_peak}

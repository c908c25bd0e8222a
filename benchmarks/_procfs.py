"""Per-process memory from /proc, shared by the loader benchmark's workers (no dependencies)."""

from __future__ import annotations

import os
from pathlib import Path


def rss_anon_mb(pid: int | str = "self") -> float:
    """``RssAnon`` of a process in MiB (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


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

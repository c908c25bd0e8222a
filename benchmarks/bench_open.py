"""Time and memory to open a cache of many shards: `python benchmarks/bench_open.py [--shards 10,1000]`.

For each shard count, writes a synthetic cache of N one-document shards with numpy (each with real
CRC-32s and a unit description as long as a real one), then runs, each 5 times in a fresh process:
`json.load` of its manifest alone (the baseline), `streampack.open` and one `doc()` read, and the same
once its manifest is rewritten as format version 1 wrote it (the shard table as rows). It prints
the median seconds of each (imports not included) and the largest peak RSS of the process (`VmHWM`,
imports included; not `ru_maxrss`, which keeps the parent's peak across `fork` and `exec`). Issue 13
asks for under 1 s and 100 MB at 100,000 shards.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from streampack.testing.caches import rewrite_as_version_1, write_cache

PROBE = """
import json, re, sys, time
start = time.perf_counter()
if sys.argv[2] == "json":
    json.load(open(sys.argv[1] + "/manifest.json"))
else:
    import streampack
    start = time.perf_counter()
    cache = streampack.open(sys.argv[1])
    cache.doc(cache.num_docs // 2)
seconds = time.perf_counter() - start
peak_kb = re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)
print(seconds, int(peak_kb) / 1024)
"""
RUNS = 5
UNIT = "/data/corpora/web-crawl-2026-11/part-{:06d}.jsonl [bytes {}:{}]"  # what a unit of 256 MB reads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shards", default="10,1000,10000,100000", help="comma-separated shard counts")
    args = parser.parse_args()
    print(
        "| shards | manifest MB | json.load s (baseline) | json.load MB | open + doc() s | open MB "
        "| version 1 manifest: open + doc() s | its MB |\n|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for count in (int(n) for n in args.shards.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            root = write_synthetic(Path(tmp) / "c", count)
            size = (root / "manifest.json").stat().st_size / 1e6
            json_s, json_mb = measure(root, "json")
            open_s, open_mb = measure(root, "open")
            rewrite_as_version_1(root)  # the same cache as streampack built it before format version 2
            old_s, old_mb = measure(root, "open")
        print(
            f"| {count:,} | {size:.1f} | {json_s:.3f} | {json_mb:.0f} | {open_s:.3f} | {open_mb:.0f} "
            f"| {old_s:.3f} | {old_mb:.0f} |",
            flush=True,
        )


def write_synthetic(root: Path, count: int) -> Path:
    shards = ((np.full(8, 7, dtype=np.uint16), np.array([8])) for _ in range(count))
    quarter = 1 << 28
    units = [UNIT.format(i // 4, i % 4 * quarter, (i % 4 + 1) * quarter) for i in range(count)]
    return write_cache(root, shards, vocab_size=257, eos_id=256, units=units)


def measure(root: Path, kind: str) -> tuple[float, float]:
    """Median seconds and largest peak RSS (MB) of ``RUNS`` fresh processes."""
    runs = [run(root, kind) for _ in range(RUNS)]
    return statistics.median(s for s, _ in runs), max(mb for _, mb in runs)


def run(root: Path, kind: str) -> tuple[float, float]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(root), kind], capture_output=True, text=True, check=True
    )
    seconds, megabytes = out.stdout.split()
    return float(seconds), float(megabytes)


if __name__ == "__main__":
    main()

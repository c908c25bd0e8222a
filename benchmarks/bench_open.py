"""Time to open a cache of many shards: `python benchmarks/bench_open.py [--shards 10000]`.

Writes a synthetic cache of N one-document shards with numpy, then times (median of 5, each in a fresh
process) `streampack.open` and the first `doc()` read, against the baseline of parsing the manifest alone
with `json.load`. Issue 3 asks for under 1 s at 10,000 shards.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from streampack._synthetic import write_cache

PROBE = """
import json, sys, time
start = time.perf_counter()
if sys.argv[2] == "json":
    json.load(open(sys.argv[1] + "/manifest.json"))
else:
    import streampack
    cache = streampack.open(sys.argv[1])
    cache.doc(cache.num_docs // 2)
print(time.perf_counter() - start)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shards", type=int, default=10_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        shards = [(np.full(8, 7, dtype=np.uint16), np.array([8])) for _ in range(args.shards)]
        root = write_cache(Path(tmp) / "c", shards, vocab_size=257, eos_id=256)
        times = {kind: [run(root, kind) for _ in range(5)] for kind in ("json", "open")}
    print(f"| {args.shards:,} shards | median s |\n|---|---:|")
    print(f"| json.load(manifest.json) (baseline) | {statistics.median(times['json']):.3f} |")
    print(f"| streampack.open + one doc() | {statistics.median(times['open']):.3f} |")


def run(root: Path, kind: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(root), kind], capture_output=True, text=True, check=True
    )
    return float(out.stdout)


if __name__ == "__main__":
    main()

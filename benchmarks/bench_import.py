"""What `import streampack` costs a trainer process: `python benchmarks/bench_import.py [--runs 15]`.

Each statement runs in a fresh interpreter (`python -c`), interleaved with the others run by run so
that a noisy machine slows all of them alike; the table gives the median wall time of the whole
process and its ratio to the baseline, `import numpy, orjson` (what any reader of a cache needs).
It also lists which heavy modules each statement loaded: a trainer that only reads a cache should
load none of multiprocessing, concurrent.futures, socket, ctypes, pyarrow or tokenizers beyond what
the baseline itself loads (numpy loads ctypes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

BASELINE = "import numpy, orjson"
STATEMENTS = [
    BASELINE,
    "import streampack",
    "from streampack import Loader",
    "import streampack; streampack.open",
]
HEAVY = ["multiprocessing", "concurrent.futures", "socket", "ctypes", "pyarrow", "tokenizers", "torch"]
PROBE = "import sys, json; {stmt}; print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))"
ROOT = Path(__file__).resolve().parents[1]


def run_once(stmt: str) -> tuple[float, list[str]]:
    """Wall seconds of a fresh interpreter running ``stmt``, and the heavy modules it loaded."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(stmt=stmt, heavy=HEAVY)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return time.perf_counter() - start, json.loads(done.stdout)


def main() -> None:
    """Time each statement ``--runs`` times in turn and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="fresh processes per statement")
    args = parser.parse_args()
    times: dict[str, list[float]] = {s: [] for s in STATEMENTS}
    loaded: dict[str, list[str]] = {}
    for _ in range(args.runs):
        for stmt in STATEMENTS:
            seconds, loaded[stmt] = run_once(stmt)
            times[stmt].append(seconds)
    base = statistics.median(times[BASELINE])
    print(f"| statement | median s (of {args.runs}) | ÷ `{BASELINE}` | heavy modules beyond the baseline's |")
    print("|---|---:|---:|---|")
    for stmt in STATEMENTS:
        median = statistics.median(times[stmt])
        extra = loaded[stmt] if stmt == BASELINE else sorted(set(loaded[stmt]) - set(loaded[BASELINE]))
        heavy = ", ".join(extra) or "none"
        print(f"| `{stmt}` | {median:.3f} | {median / base:.2f} | {heavy} |")
    print(f"\nThe baseline itself loads: {', '.join(loaded[BASELINE]) or 'none'}.")
    ratio = statistics.median(times["from streampack import Loader"]) / base
    print(
        f"\nGoal: `from streampack import Loader` ÷ baseline <= 1.5: {'met' if ratio <= 1.5 else 'not met'}"
    )


if __name__ == "__main__":
    main()

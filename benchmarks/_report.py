"""What the loader benchmarks share: running a row in a fresh process, warming a cache, goal lines."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def run_json(cmd: list[str]) -> dict[str, Any]:
    """Run one measurement in a fresh process; return the JSON of its last output line."""
    # One torch intra-op thread everywhere: on a small shared machine torch's default threads spin
    # against the other processes and slow per-batch torch ops (HF's formatting, nanoGPT's stack) 10x.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def warm(cache: Path) -> None:
    """Read every shard file of a cache once, so no row pays for the first read from disk."""
    for path in sorted((cache / "shards").iterdir()):
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass


def goal(what: str, value: float, op: str, target: float) -> str:
    """A line of a report's "Goals" list: met or not, with the figure."""
    met = value >= target if op == ">=" else value <= target
    return f"- {'met' if met else '**not met**'}: {what} = {value:.2f} (goal {op} {target:g})"


def environment() -> str:
    """Date, machine and versions, for the report's first line."""
    import torch

    return (
        f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}"
    )


def parser(doc: str, name: str, *, repeats: int, batches: int) -> argparse.ArgumentParser:
    """The options every loader benchmark takes: --quick, --repeats, --batches, --tmp and --out."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small caches and few batches (a smoke test)")
    parser.add_argument(
        "--repeats", type=int, default=repeats, help="best of N throughput runs, median of N starts"
    )
    parser.add_argument("--batches", type=int, default=batches, help="batches per timed throughput run")
    parser.add_argument(
        "--tmp",
        default=os.path.join(tempfile.gettempdir(), f"streampack-bench-{name}"),
        help="scratch space, removed afterwards",
    )
    parser.add_argument("--out", help=f"report file (default benchmarks/results/{name}[-quick].md)")
    return parser


def publish(report: str, name: str, args: argparse.Namespace) -> None:
    """Print the report and write it to ``--out`` (default ``benchmarks/results/NAME[-quick].md``)."""
    print(report)
    results = Path(__file__).resolve().parent / "results"
    out = Path(args.out) if args.out else results / (f"{name}-quick.md" if args.quick else f"{name}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(f"[bench_{name}] wrote {out}", file=sys.stderr, flush=True)

"""What one more node buys: `python benchmarks/bench_scaling.py [--corpus FILE] [--scale N] [--repeats N]`.

The same ``streampack build`` (GPT-2 ``tokenizer.json`` of ``../shared/data``, the default engine, units of
``--unit-mb``, one tokenizer thread per process: ``--threads 1``) on:

* **local, 1 worker** (the baseline): ``--workers 1``, the whole build in the CLI's own process;
* **Ray, 1 node of 1 CPU**: ``--executor ray --ray-address`` a simulated cluster
  (``ray.cluster_utils.Cluster``) of a head node with ``num_cpus=1``;
* **Ray, 2 nodes of 1 CPU each**: the same cluster with a second node of ``num_cpus=1`` added;
* **local, 2 workers** (for reference): ``--workers 2``, the process pool on the same two cores.

Each row is the CLI in a fresh process; wall time is the whole process (interpreter start-up, connecting to
the cluster, Ray's workers starting on each node and loading the tokenizer). The cluster is started once,
before any row, and its second node is added or removed between rows (not timed). Every row also runs
on a one-document corpus: its wall time is the row's fixed cost, and "once started" divides the text by
the wall time less that cost (the rate that a corpus large enough to bury the start-up would see). With
``--repeats N`` each repeat runs the rows in turn, starting one row later each time; the table shows
medians, and each ratio is the median of the N per-repeat ratios.

Both "nodes" are processes on this machine: the figure is the speed-up one more core buys through Ray's
scheduling, with Ray's per-node start-up and per-task overheads, against the same core through the
local pool. It says nothing of the network, of shared storage or of object storage between machines.

The table is printed and written to ``benchmarks/results/scaling.md`` (``scaling-quick.md`` with
``--quick``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._backends import SHARED_DATA, TOKENIZERS_GPT2
from benchmarks._report import environment, publish

SAMPLE = SHARED_DATA / "corpus" / "natural-sample.jsonl.zst"
BUILT_SECONDS = re.compile(r"^built .*, ([0-9.]+) s\b", re.MULTILINE)  # the build's summary line
LOCAL1, RAY1, RAY2, LOCAL2 = "local, 1 worker (baseline)", "Ray, 1 node", "Ray, 2 nodes", "local, 2 workers"


@dataclass
class Row:
    """One configuration: its CLI flags and Ray nodes (0: no cluster), and what each repeat measured."""

    name: str
    what: str
    flags: list[str]
    nodes: int
    wall_s: list[float] = field(default_factory=list)
    build_s: list[float] = field(default_factory=list)  # the build's own timer: no interpreter start-up
    fixed_s: list[float] = field(default_factory=list)  # wall time of a one-document build

    def median(self, values: list[float]) -> float:
        return statistics.median(values)


class Nodes:
    """A simulated Ray cluster on this machine: a head node of one CPU, and a second one on demand."""

    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 1})
        self.cluster.wait_for_nodes()
        self.second: Any = None

    def ensure(self, count: int) -> None:
        """Make the cluster ``count`` nodes (1 or 2); a node added or removed is waited for."""
        if count == 2 and self.second is None:
            self.second = self.cluster.add_node(num_cpus=1)
        elif count == 1 and self.second is not None:
            self.cluster.remove_node(self.second)
            self.second = None
        else:
            return
        self.cluster.wait_for_nodes()
        time.sleep(1.0)  # let the raylets settle: a removed node's processes exit, a new one registers

    def shutdown(self) -> None:
        self.cluster.shutdown()


def sample_corpus(tmp: Path) -> Path:
    """The real sample corpus decompressed (a compressed input is one unit, whatever its size)."""
    import zstandard

    out = tmp / "natural-sample.jsonl"
    with open(SAMPLE, "rb") as f, open(out, "wb") as dst:
        shutil.copyfileobj(io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(f)), dst)
    return out


def scaled(corpus: Path, times: int, tmp: Path) -> Path:
    """``corpus`` concatenated ``times`` times (a newline ensured between copies)."""
    data = corpus.read_bytes()
    data += b"" if data.endswith(b"\n") else b"\n"
    out = tmp / f"corpus-x{times}.jsonl"
    with open(out, "wb") as f:
        for _ in range(times):
            f.write(data)
    return out


def text_mb(corpus: Path) -> float:
    """The UTF-8 size of the ``text`` fields, in 10^6 bytes."""
    with open(corpus, "rb") as f:
        return sum(len(json.loads(line)["text"].encode()) for line in f if line.strip()) / 1e6


def build(corpus: Path, out: Path, row: Row, args: argparse.Namespace, address: str) -> tuple[float, float]:
    """One build of ``row`` in a fresh process: its wall time and its own timer's."""
    cmd = [sys.executable, "-m", "streampack", "build", str(corpus), "--tokenizer", TOKENIZERS_GPT2,
           "--out", str(out), "--overwrite", "--unit-mb", str(args.unit_mb), "--threads", "1",
           "--no-progress", *[address if flag == "ADDRESS" else flag for flag in row.flags]]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - started
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    own = BUILT_SECONDS.search(done.stdout)
    return wall, float(own.group(1)) if own else float("nan")


def tokens(cache: Path) -> int:
    info = subprocess.run([sys.executable, "-m", "streampack", "info", str(cache), "--json"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(json.loads(info.stdout)["num_tokens"])


def ratios(rows: dict[str, Row], top: str, bottom: str) -> list[float]:
    """Throughput of ``top`` ÷ that of ``bottom``, per repeat (the same work: the inverse wall ratio)."""
    return [b / t for t, b in zip(rows[top].wall_s, rows[bottom].wall_s)]


def started(row: Row, mb: float) -> list[float]:
    """MB/s once started, per repeat: the text over the wall time less that repeat's fixed cost."""
    return [mb / max(wall - fixed, 1e-9) for wall, fixed in zip(row.wall_s, row.fixed_s)]


def started_ratios(rows: dict[str, Row], top: str, bottom: str) -> list[float]:
    """MB/s once started of ``top`` ÷ that of ``bottom``, per repeat."""
    return [t / b for t, b in zip(started(rows[top], 1.0), started(rows[bottom], 1.0))]


def report(rows: dict[str, Row], args: argparse.Namespace, mb: float, tok: int, size_mb: float) -> str:
    lines = [
        "# What one more node buys (the Ray executor on a simulated cluster)",
        "",
        environment(),
        "",
        f"Corpus: the sample corpus x{args.scale} ({size_mb:.0f} MB of JSONL, {mb:.1f} MB of text, "
        f"{tok / 1e6:.1f} M GPT-2 tokens), units of {args.unit_mb} MB "
        f"({-(-int(size_mb * 1e6) // (args.unit_mb << 20))} units), the default engine, `--threads 1`. "
        f"Medians of {args.repeats} paired repeats; wall time is the whole CLI process. "
        "Command: `python benchmarks/bench_scaling.py" + "".join(f" {flag}" for flag in sys.argv[1:]) + "`.",
        "",
        "| configuration | what runs | wall s | build s, own timer | MB/s | M tokens/s | ÷ baseline "
        "| fixed cost s (one-document build) | MB/s once started | ÷ baseline, once started |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = rows[LOCAL1]
    per_base = {name: statistics.median(ratios(rows, name, LOCAL1)) for name in rows}
    for name, row in rows.items():
        wall = row.median(row.wall_s)
        lines.append(
            f"| {name} | {row.what} | {wall:.2f} | {row.median(row.build_s):.2f} | {mb / wall:.1f} "
            f"| {tok / 1e6 / wall:.2f} | {per_base[name]:.2f} | {row.median(row.fixed_s):.2f} "
            f"| {statistics.median(started(row, mb)):.1f} "
            f"| {statistics.median(started_ratios(rows, name, LOCAL1)):.2f} |"
        )
    lines += ["", "Ratios of throughput (median of the per-repeat ratios; each repeat's in brackets):", ""]
    pairs = [
        (RAY2, RAY1, "one more node, through Ray"),
        (RAY1, LOCAL1, "Ray's cost on one node, against the same core without it"),
        (RAY2, LOCAL2, "Ray on two nodes against the local pool on the same two cores"),
        (LOCAL2, LOCAL1, "one more core, through the local pool"),
    ]
    for top, bottom, what in pairs:
        each, once = ratios(rows, top, bottom), started_ratios(rows, top, bottom)
        shown, shown_once = ", ".join(f"{r:.2f}" for r in each), ", ".join(f"{r:.2f}" for r in once)
        lines.append(
            f"- {top} ÷ {bottom} = **{statistics.median(each):.2f}** [{shown}]; once started "
            f"**{statistics.median(once):.2f}** [{shown_once}]: {what}"
        )
    lines += [
        "",
        f"The baseline's build took {base.median(base.build_s):.2f} s by its own timer "
        f"and {base.median(base.wall_s):.2f} s in all. Both Ray nodes are raylets on this machine's "
        f"{os.cpu_count()} cores, which other processes share: the figures say what one more core buys "
        "through Ray's scheduling, net of its start-up on each node (a worker process that imports "
        "streampack and loads the tokenizer) and of its per-task overhead. They say nothing of the network, "
        "of shared storage between machines or of object storage.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", help="JSONL, a `text` field per line (default: the sample corpus)")
    parser.add_argument("--scale", type=int, default=8, help="the corpus concatenated N times (default 8)")
    parser.add_argument("--unit-mb", type=int, default=8, help="work unit size in MB (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="paired repeats, rows in turn (default 3)")
    parser.add_argument("--quick", action="store_true", help="--scale 1 --repeats 1 --unit-mb 1 (smoke test)")
    parser.add_argument(
        "--tmp", default=os.path.join(tempfile.gettempdir(), "streampack-bench-scaling"), help="scratch space"
    )
    parser.add_argument("--out", help="report file (default benchmarks/results/scaling[-quick].md)")
    args = parser.parse_args()
    if args.quick:
        args.scale, args.repeats, args.unit_mb = 1, 1, 1
    tmp = Path(args.tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rows = {
        LOCAL1: Row(LOCAL1, "`--workers 1`", ["--workers", "1"], 0),
        RAY1: Row(RAY1, "head of 1 CPU", ["--executor", "ray", "--ray-address", "ADDRESS"], 1),
        RAY2: Row(RAY2, "head + 1 node, 1 CPU each", ["--executor", "ray", "--ray-address", "ADDRESS"], 2),
        LOCAL2: Row(LOCAL2, "`--workers 2` (reference)", ["--workers", "2"], 0),
    }
    nodes = None
    try:
        corpus = Path(args.corpus) if args.corpus else sample_corpus(tmp)
        corpus = scaled(corpus, args.scale, tmp)
        one_doc = tmp / "one-doc.jsonl"
        with open(corpus, "rb") as f:
            one_doc.write_bytes(f.readline())
        mb = text_mb(corpus)
        nodes = Nodes()
        address = str(nodes.cluster.address)
        names = list(rows)
        for repeat in range(args.repeats):
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                row = rows[name]
                if row.nodes:
                    nodes.ensure(row.nodes)
                wall, own = build(corpus, tmp / "cache", row, args, address)
                row.wall_s.append(wall)
                row.build_s.append(own)
                row.fixed_s.append(build(one_doc, tmp / "tiny", row, args, address)[0])
                print(f"[bench_scaling] {repeat + 1}/{args.repeats} {name}: {wall:.2f} s", file=sys.stderr)
        tok = tokens(tmp / "cache")
        publish(report(rows, args, mb, tok, corpus.stat().st_size / 1e6), "scaling", args)
    finally:
        if nodes is not None:
            nodes.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

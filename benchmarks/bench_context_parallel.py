"""Benchmark long context: packed rows split for context parallelism, and data-parallel ranks balanced by
attention cost, each beside today's loader in the same run, on the real corpus.

One command, one run, on a cache of the natural sample (``corpus/natural-sample.jsonl.zst`` in
``../shared/data``, or ``--corpus``) tokenized with GPT-2:

1. Throughput, seq_len 2048, global batch 32, shuffled, ``output="varlen"``, in process: rows/s of CP
   rank 0 of ``Loader(cache.packed(L, pad_multiple=2*cp), cp_size=cp)`` for cp 2 and 4, divided by those
   of today's packed loader (``cache.packed(L)``, whole rows); the rows of one round back to back in
   alternating order, the ratio the median of the rounds' paired ratios. Goal >= 0.9.
2. Balance, seq_len 8192, 8 data-parallel ranks, global batch 64 (8 rows a rank), 10 shuffled epochs: per
   step, the largest rank's attention cost (sum over its rows' documents of their squared lengths) over
   the ranks' mean, with ``balance="attention"`` and today's contiguous slices (``balance="rows"``);
   median, 90th percentile and worst step. Goal: median <= 1.05.

Usage::

    python benchmarks/bench_context_parallel.py [--corpus FILE] [--cache DIR] [--quick] [--repeats 5]

``--cache DIR`` reuses the cache in DIR when there is one, else builds it there and keeps it; without it
the cache is built under ``--tmp`` and deleted afterwards. Prints a markdown table and writes it to
``benchmarks/results/context_parallel.md`` (``context_parallel-quick.md`` with ``--quick``).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _backends import SHARED_DATA, TOKENIZERS_GPT2
from _report import environment, goal, publish
from _report import parser as report_parser

import streampack
from streampack.loader import Loader
from streampack.loader.parallel import attention_costs

SEQ_LEN = 2048
BATCH = 32
LONG = 8192
WORLD = 8
CPS = (2, 4)


def log(message: str) -> None:
    print(f"[bench_context_parallel] {message}", file=sys.stderr, flush=True)


def prepare_cache(corpus: Path, cache: Path) -> str:
    """Build the cache of ``corpus`` unless ``cache`` holds one; describe it."""
    if (cache / "manifest.json").is_file():
        return f"reused from `{cache}`"
    start = time.perf_counter()
    streampack.build(str(corpus), cache, tokenizer=TOKENIZERS_GPT2, progress=False)
    return f"built from `{corpus.name}` in {time.perf_counter() - start:.0f} s"


def rows_per_s(loader: Loader, batches: int) -> tuple[float, float]:
    """Rows per second of wall time and of CPU time, over ``batches`` batches of ``loader`` from position 0
    (an endless run)."""
    loader.load_state_dict({**loader.state_dict(), "position": 0})
    rows, start, cpu = 0, time.perf_counter(), time.process_time()
    for batch in loader:
        rows += len(batch["input_ids"])
        if rows >= batches * loader.options.rows:
            break
    return rows / (time.perf_counter() - start), rows / (time.process_time() - cpu)


def measure_throughput(cache: Any, repeats: int, batches: int) -> dict[str, list[tuple[float, float]]]:
    """Rows/s of today's packed loader and of each CP rank 0, round by round in alternating order."""
    loaders = {"packed": Loader(cache.packed(SEQ_LEN), batch_size=BATCH, output="varlen", seed=1)}
    for cp in CPS:
        samples = cache.packed(SEQ_LEN, pad_multiple=2 * cp)
        loaders[f"cp{cp}"] = Loader(samples, batch_size=BATCH, output="varlen", seed=1, cp_size=cp)
    for loader in loaders.values():  # plans made and pages read before any timing
        rows_per_s(loader, 2)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in loaders}
    for round_ in range(repeats):
        names = list(loaders) if round_ % 2 == 0 else list(reversed(loaders))
        for name in names:
            runs[name].append(rows_per_s(loaders[name], batches))
    return runs


def step_imbalance(cache: Any, balance: str, epochs: int) -> list[float]:
    """Per step of ``epochs`` epochs: the largest rank's attention cost over the ranks' mean."""
    samples = cache.packed(LONG)
    options = {"batch_size": WORLD * 8, "seed": 1, "epochs": epochs, "world_size": WORLD, "balance": balance}
    ranks = [Loader(samples, rank=r, **options) for r in range(WORLD)]  # type: ignore[arg-type]
    out = []
    for position in ranks[0].schedule():
        costs = []
        for loader in ranks:
            picked = loader.indices(position)
            found = samples.boundaries(picked)
            costs.append(
                int(attention_costs(found.starts, found.lengths, found.docs, len(picked), LONG).sum())
            )
        out.append(max(costs) / statistics.mean(costs))
    return out


def main() -> None:
    parser = report_parser(__doc__ or "", "context_parallel", repeats=7, batches=300)
    parser.add_argument("--corpus", default=str(SHARED_DATA / "corpus" / "natural-sample.jsonl.zst"))
    parser.add_argument("--cache", help="build the cache here and keep it (reused when present)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.batches = 3, 60
    tmp = Path(args.tmp)
    cache_dir = Path(args.cache) if args.cache else tmp / "cache"
    built = prepare_cache(Path(args.corpus), cache_dir)
    cache = streampack.open(cache_dir)
    log(f"cache {built}: {cache.num_docs:,} documents, {cache.num_tokens:,} tokens")
    runs = measure_throughput(cache, args.repeats, args.batches)
    epochs = 2 if args.quick else 10
    balanced, sliced = step_imbalance(cache, "attention", epochs), step_imbalance(cache, "rows", epochs)
    if not args.cache:
        shutil.rmtree(tmp, ignore_errors=True)

    lines = [
        "# Context parallelism and attention balance",
        "",
        f"{environment()}; load average {os.getloadavg()[0]:.2f} (a shared machine: ratios are paired, "
        "absolute rates are not comparable across runs).",
        f"Cache {built}: {cache.num_docs:,} documents, {cache.num_tokens:,} GPT-2 tokens.",
        "",
        f"## 1. Throughput: seq_len {SEQ_LEN}, global batch {BATCH}, output='varlen', in process",
        "",
        "| loader | rows/s (median) | ÷ packed (median of paired ratios) | per round | ÷ packed, CPU time |",
        "|---|---:|---:|---|---:|",
    ]
    ratios: dict[str, float] = {}
    for name, values in runs.items():
        paired = [a[0] / b[0] for a, b in zip(values, runs["packed"], strict=True)]
        cpu = statistics.median(a[1] / b[1] for a, b in zip(values, runs["packed"], strict=True))
        ratios[name] = statistics.median(paired)
        what = "today's packed loader (whole rows)" if name == "packed" else f"**CP rank 0 of {name[2:]}**"
        each = ", ".join(f"{r:.2f}" for r in paired)
        wall = statistics.median(v[0] for v in values)
        lines.append(f"| {what} | {wall:,.0f} | {ratios[name]:.2f} | {each} | {cpu:.2f} |")

    def summary(values: list[float]) -> str:
        return f"{statistics.median(values):.3f} | {float(np.percentile(values, 90)):.3f} | {max(values):.3f}"

    lines += [
        "",
        f"## 2. Balance: seq_len {LONG}, {WORLD} data-parallel ranks, global batch {WORLD * 8}, {epochs} "
        f"shuffled epochs ({len(balanced)} steps)",
        "",
        "Per step: max ÷ mean over the ranks of the attention cost (sum of squared document lengths).",
        "",
        "| split | median | p90 | worst step |",
        "|---|---:|---:|---:|",
        f"| today: contiguous slices (`balance='rows'`) | {summary(sliced)} |",
        f"| **`balance='attention'`** | {summary(balanced)} |",
        "",
        "## Goals",
        "",
        *(goal(f"CP {cp} rows/s ÷ packed", ratios[f"cp{cp}"], ">=", 0.9) for cp in CPS),
        goal("median max ÷ mean attention cost, 8 ranks", statistics.median(balanced), "<=", 1.05),
        "",
    ]
    publish("\n".join(lines), "context_parallel", args)


if __name__ == "__main__":
    main()

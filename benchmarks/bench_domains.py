"""Benchmark what a mixture's per-source keys and the data metrics cost the loader, in one process.

One command, one run, on synthetic caches written with numpy (three caches of 60 / 30 / 10 % of the
tokens, weights 5 / 3 / 2, seq_len 2048, global batch 32, shuffled, ``output="dict"``):

1. Samples/s of the mixture's dict batches with ``loss_weights`` (``source_ids`` and a ``float32`` weight
   per token) divided by those of the same loader without the option (``source_ids`` only), the median of
   the rounds' paired ratios (the two alternate within each round). Goal >= 0.9.
2. What measuring costs a batch: the per-batch work of ``Loader.metrics()`` (two clock reads, the
   bytes read from the plan, the record and the meter's sums), timed on its own over the same batches,
   as a share of the batch's time. Goal <= 2 %.

Usage::

    python benchmarks/bench_domains.py [--quick] [--repeats 7] [--batches 200] [--tmp DIR] [--out FILE]

Prints a markdown table and writes it to ``benchmarks/results/domains.md`` (``domains-quick.md`` with
``--quick``). The machine is shared: ratios are paired, so load moves both sides.
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from _report import environment, goal, publish, warm
from _report import parser as report_parser

import streampack
from streampack.loader import Loader
from streampack.loader.metrics import Made, Meter
from streampack.order.mixture import Mixture
from streampack.testing.caches import write_random_cache

SEQ_LEN = 2048
BATCH = 32
SHARES = {"big": 0.6, "mid": 0.3, "small": 0.1}
WEIGHTS = {"big": 5.0, "mid": 3.0, "small": 2.0}


def loader(caches: dict[str, Path], **options: Any) -> Loader:
    seqs = {name: streampack.open(path).sequences(SEQ_LEN) for name, path in caches.items()}
    return Loader(Mixture(seqs, weights=WEIGHTS, seed=0), batch_size=BATCH, output="dict", **options)


def samples_per_second(made: Loader, batches: int) -> float:
    """Samples/s of ``batches`` batches from the loader's position on (after one untimed batch)."""
    it = iter(made)
    next(it)
    started = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * BATCH / (time.perf_counter() - started)


def measuring_seconds(made: Loader, batches: int) -> tuple[float, float]:
    """Seconds per batch of the metrics' own work, and of making the batch, over the same positions."""
    positions = [made.position + k * BATCH for k in range(batches)]
    started = time.perf_counter()
    for position in positions:
        made.batch(position)
    making = (time.perf_counter() - started) / batches
    rows, meter, measuring = made.run.rows, Meter(), 0.0
    for position in positions:
        sources, samples = made.picks(position)  # as a batch asks them: the plan holds the position
        asked = time.perf_counter()
        record = Made(time.perf_counter() - asked, rows.bytes_read(position, sources, samples), 0, 0)
        meter.add(time.perf_counter() - asked, record)
        measuring += time.perf_counter() - asked
    return measuring / batches, making


def main() -> None:
    args = report_parser(__doc__ or "", "domains", repeats=7, batches=200).parse_args()
    tokens = 4_000_000 if args.quick else 40_000_000
    batches = 20 if args.quick else args.batches
    tmp = Path(args.tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    caches = {}
    for seed, (name, share) in enumerate(SHARES.items()):
        caches[name] = write_random_cache(tmp / name, int(tokens * share), num_shards=2, seed=seed)
        warm(caches[name])
    try:
        ratios, weighted, plain, shares = [], [], [], []
        for _ in range(args.repeats):
            with_weights = samples_per_second(loader(caches, loss_weights={"small": 2.0}), batches)
            without = samples_per_second(loader(caches), batches)
            weighted.append(with_weights)
            plain.append(without)
            ratios.append(with_weights / without)
            cost, making = measuring_seconds(loader(caches), batches)
            shares.append(cost / making)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ratio, share = statistics.median(ratios), statistics.median(shares)
    report = "\n".join(
        [
            f"# Per-source keys and data metrics ({environment()})",
            "",
            f"Mixture of 3 caches ({tokens:,} tokens), seq_len {SEQ_LEN}, global batch {BATCH}, "
            f"output='dict', {batches} batches a round, {args.repeats} rounds (medians).",
            "",
            "| what | samples/s | ratio |",
            "|---|---:|---:|",
            f"| dict batches, `source_ids` only (the baseline) | {statistics.median(plain):,.0f} | 1.00 |",
            f"| **with `loss_weights`** | {statistics.median(weighted):,.0f} | {ratio:.2f} |",
            "",
            f"Measuring (`Loader.metrics()`) costs {100 * share:.2f} % of a batch's time.",
            "",
            "Goals:",
            "",
            goal("samples/s with loss_weights / without", ratio, ">=", 0.9),
            goal("metrics' work / a batch's (%)", 100 * share, "<=", 2),
            "",
        ]
    )
    publish(report, "domains", args)


if __name__ == "__main__":
    main()

"""Benchmark fill-in-the-middle: loader throughput of FIM'd windows against plain windows of one cache.

One command, one run, both measured side by side in one process: a synthetic cache written with numpy
(random GPT-2-sized ids in documents of ~600 tokens, the length of a source file), read as
``cache.sequences(2048)`` and as ``cache.sequences(2048).fim(rate=0.5, spm_rate=0.5)``, global batch 32,
shuffled, 0 workers, ``output="numpy"`` and ``"dict"``. Each round times ``--batches`` batches of each, back
to back in alternating order; the ratio is the median of the rounds' paired ratios (FIM / plain). Goal:
FIM >= 0.9 of plain windows.

Usage::

    python benchmarks/bench_fim.py [--quick] [--repeats 7] [--batches 300] [--tmp DIR] [--out FILE]

Prints a markdown table and writes it to ``benchmarks/results/fim.md`` (``fim-quick.md`` with ``--quick``).
"""

from __future__ import annotations

import shutil
import statistics
import time
from itertools import islice
from pathlib import Path
from typing import Any

from _report import environment, goal, publish, warm
from _report import parser as report_parser

import streampack
from streampack import Loader
from streampack.testing.caches import write_random_cache

SEQ_LEN = 2048
BATCH = 32
SENTINELS = (50253, 50254, 50255)  # ids of the random cache's vocabulary, standing for the tokenizer's


def rate(samples: Any, output: str, batches: int) -> float:
    """Samples per second of ``batches`` batches of a fresh Loader (after 20 to warm it)."""
    loader = iter(Loader(samples, batch_size=BATCH, seed=1, output=output))
    for _ in islice(loader, 20):
        pass
    start = time.perf_counter()
    for _ in islice(loader, batches):
        pass
    return batches * BATCH / (time.perf_counter() - start)


def main() -> None:
    args = report_parser(__doc__ or "", "fim", repeats=7, batches=300).parse_args()
    tokens = 20_000_000 if args.quick else 200_000_000
    batches = 50 if args.quick else args.batches
    tmp = Path(args.tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_random_cache(tmp / "cache", tokens, num_shards=4, mean_doc_tokens=600)
        warm(tmp / "cache")
        cache = streampack.open(tmp / "cache")
        plain = cache.sequences(SEQ_LEN)
        fim = plain.fim(rate=0.5, spm_rate=0.5, sentinels=SENTINELS)
        lines = [
            f"# FIM'd windows against plain windows ({environment()})",
            "",
            f"{tokens:,} tokens, seq_len {SEQ_LEN}, batch {BATCH}, 0 workers, medians of {args.repeats} "
            f"rounds of {batches} batches each (alternating order). Machine shared with other work: "
            "the paired ratio is the figure.",
            "",
            "| output | plain samples/s | FIM samples/s | FIM / plain |",
            "| --- | ---: | ---: | ---: |",
        ]
        ratios: dict[str, float] = {}
        for output in ("numpy", "dict"):
            plains, fims, paired = [], [], []
            for round_ in range(args.repeats):
                first, second = (plain, fim) if round_ % 2 == 0 else (fim, plain)
                a, b = rate(first, output, batches), rate(second, output, batches)
                p, f = (a, b) if first is plain else (b, a)
                plains.append(p)
                fims.append(f)
                paired.append(f / p)
            ratios[output] = statistics.median(paired)
            lines.append(
                f"| {output} | {statistics.median(plains):,.0f} | {statistics.median(fims):,.0f} | "
                f"{ratios[output]:.2f} |"
            )
        lines += ["", "Goals:", ""]
        lines += [goal(f"FIM / plain windows, output={o}", r, ">=", 0.9) for o, r in ratios.items()]
        publish("\n".join(lines) + "\n", "fim", args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

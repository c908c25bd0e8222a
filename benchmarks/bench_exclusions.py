"""The Loader with a 1 % exclusion beside the same Loader without one, measured in the same run.

Run: ``python benchmarks/bench_exclusions.py [--tokens N] [--seq-len L] [--batch B] [--steps S]``. It writes
a random cache, then times ``S`` batches of each loader in turn (repeats interleaved), and prints the
median batches per second and their ratio (the target: >= 0.9), and what finding the excluded samples cost
once per process.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import streampack
from streampack.loader import Exclusions, Loader
from streampack.testing.caches import write_random_cache


def rate(loader: Loader, steps: int) -> float:
    """Batches per second over ``steps`` batches from the loader's position 0."""
    loader._position = 0  # restart the same loader: its exclusions are counted once
    start = time.perf_counter()
    for _, _batch in zip(range(steps), loader, strict=False):
        pass
    return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=50_000_000)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fraction", type=float, default=0.01)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = streampack.open(write_random_cache(Path(tmp) / "c", args.tokens, num_shards=4))
        seqs = cache.sequences(args.seq_len)
        rng = np.random.default_rng(0)
        docs = rng.choice(cache.num_docs, size=max(1, int(cache.num_docs * args.fraction)), replace=False)
        plain = Loader(seqs, batch_size=args.batch, seed=1)
        start = time.perf_counter()
        excluded = Loader(seqs, batch_size=args.batch, seed=1, exclude=Exclusions(documents=docs.tolist()))
        setup = time.perf_counter() - start
        rates: dict[str, list[float]] = {"plain": [], "excluded": []}
        for _ in range(args.repeats):
            rates["plain"].append(rate(plain, args.steps))
            rates["excluded"].append(rate(excluded, args.steps))
        medians = {name: statistics.median(values) for name, values in rates.items()}
        print(f"cache: {args.tokens:,} tokens, {cache.num_docs:,} documents, {len(seqs):,} samples")
        print(f"excluded: {len(docs):,} documents ({args.fraction:.1%}); found once in {setup:.2f} s")
        print("| loader | batches/s (median) |")
        print("|---|---|")
        for name, value in medians.items():
            print(f"| {name} | {value:,.1f} |")
        print(f"ratio excluded / plain: {medians['excluded'] / medians['plain']:.3f}")


if __name__ == "__main__":
    main()

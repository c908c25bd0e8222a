"""Benchmark the Feistel :class:`~streampack.permutation.Permutation` against a materialised shuffle.

Baseline, measured in the same run: ``numpy.random.default_rng(seed).permutation(n)``, the array a
loader would otherwise build, hold and checkpoint. For each ``n`` the table reports:

* **state B**: bytes held to be able to serve (and resume) the order: the pickled ``Permutation`` versus
  the ``8n``-byte index array.
* **first index ms**: latency before the first shuffled index is available (one scalar call versus
  building the whole array). Median of ``--repeats`` runs.
* **ms per 1M idx**: time to produce the first 10**6 indices of the shuffled stream (for ``n < 10**6``,
  successive epochs, each a new order). Median of ``--repeats`` runs.
* **abs corr**: absolute correlation between position and shuffled index over one full epoch (equal to
  Spearman's rank correlation, since both are permutations of ``[0, n)``).
* **adj <= 1** / **adj <= n/1k**: fraction of consecutive outputs within distance 1 / ``n/1000`` of
  each other, over one full epoch; a measure of locality leaking through the shuffle.

A final row gives the values expected from a uniformly random permutation, for scale.

Usage::

    python benchmarks/bench_shuffle_quality.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import math
import pickle
import platform
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmark the working tree, whether or not the package is installed

from streampack.permutation import Permutation  # noqa: E402

SIZES = (10**4, 10**6, 10**7)
STREAM = 10**6
SEED = 20240601


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Return the median wall time of ``repeats`` calls of ``fn``, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def quality(order: np.ndarray) -> tuple[float, float, float]:
    """Return ``(|corr(position, index)|, adj <= 1, adj <= n/1000)`` for one epoch's order."""
    n = order.size
    position = np.arange(n, dtype=np.float64)
    corr = abs(float(np.corrcoef(position, order.astype(np.float64))[0, 1]))
    gaps = np.abs(np.diff(order))
    return corr, float(np.mean(gaps <= 1)), float(np.mean(gaps <= max(1, n // 1000)))


def feistel_stream(n: int) -> np.ndarray:
    """The first ``STREAM`` indices of the Feistel-shuffled stream, epoch after epoch."""
    parts, produced, epoch = [], 0, 0
    while produced < STREAM:
        take = min(n, STREAM - produced)
        parts.append(Permutation(n, seed=SEED, epoch=epoch)(np.arange(take)))
        produced += take
        epoch += 1
    return np.concatenate(parts)


def numpy_stream(n: int) -> np.ndarray:
    """The first ``STREAM`` indices of the materialised stream: a fresh array each epoch."""
    rng = np.random.default_rng(SEED)
    parts, produced = [], 0
    while produced < STREAM:
        order = rng.permutation(n)
        take = min(n, STREAM - produced)
        parts.append(order[:take])
        produced += take
    return np.concatenate(parts)


def uniform_expectation(n: int) -> tuple[float, float, float]:
    """Expected ``quality`` values for a uniformly random permutation of ``[0, n)``."""

    def within(d: int) -> float:
        # Share of ordered pairs (a, b), a != b, with |a - b| <= d: 2(dn - d(d+1)/2) of n(n-1).
        return 2 * (d * n - d * (d + 1) / 2) / (n * (n - 1))

    # r is approximately N(0, 1/(n-1)), so E|r| = sqrt(2 / (pi (n-1))).
    return math.sqrt(2 / math.pi / (n - 1)), within(1), within(max(1, n // 1000))


HEADER = ("n", "method", "state B", "first index ms", "ms per 1M idx", "abs corr", "adj <= 1", "adj <= n/1k")
ALIGN = ("---:", "---", "---:", "---:", "---:", "---:", "---:", "---:")
FEISTEL = "streampack Permutation (Feistel)"
BASELINE = "numpy default_rng.permutation (baseline)"


def table_row(cells: list[str]) -> str:
    """Format one markdown table row."""
    return "| " + " | ".join(cells) + " |"


def quality_cells(corr: float, adj1: float, adjk: float) -> list[str]:
    """Format the three quality columns."""
    return [f"{corr:.5f}", f"{adj1:.2e}", f"{adjk:.5f}"]


def measure(n: int, repeats: int) -> list[str]:
    """Measure both methods at size ``n``; return their table rows plus the uniform-random reference."""
    perm = Permutation(n, seed=SEED)
    feistel_order = perm(np.arange(n))
    if not np.array_equal(np.sort(feistel_order), np.arange(n)):
        raise RuntimeError(f"{perm!r} is not a bijection on [0, n)")
    numpy_order = np.random.default_rng(SEED).permutation(n)

    def feistel_first() -> int:
        return Permutation(n, seed=SEED)(0)

    def numpy_first() -> int:
        return int(np.random.default_rng(SEED).permutation(n)[0])

    size = f"{n:.0e}".replace("e+0", "e")
    measured = [
        (FEISTEL, len(pickle.dumps(perm)), feistel_first, partial(feistel_stream, n), feistel_order),
        (BASELINE, numpy_order.nbytes, numpy_first, partial(numpy_stream, n), numpy_order),
    ]
    rows = []
    for method, state_bytes, first, stream, order in measured:
        first_ms = median_seconds(first, repeats) * 1e3
        stream_ms = median_seconds(stream, repeats) * 1e3
        cells = [size, method, f"{state_bytes:,}", f"{first_ms:.3f}", f"{stream_ms:.1f}"]
        rows.append(table_row(cells + quality_cells(*quality(order))))
    expected = quality_cells(*uniform_expectation(n))
    rows.append(table_row([size, "*uniform random (expected)*", "", "", "", *expected]))
    return rows


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print the markdown table."""
    parser = argparse.ArgumentParser(description="Feistel Permutation vs a numpy permutation array.")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per cell (the median is shown)")
    args = parser.parse_args(argv)

    print(f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}, seed {SEED}")
    print(f"timings: median of {args.repeats} runs; quality over one full epoch\n")
    print(table_row(list(HEADER)))
    print(table_row(list(ALIGN)))
    for n in SIZES:
        print("\n".join(measure(n, args.repeats)), flush=True)


if __name__ == "__main__":
    main()

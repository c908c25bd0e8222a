"""Benchmark the Feistel :class:`~streampack.order.permutation.Permutation` against a materialised shuffle.

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

A second table puts the locality-aware :class:`~streampack.order.blockshuffle.BlockShuffled` order next to the
global shuffle and to no shuffle at all, over one epoch of ``n = 10**6`` samples cut into blocks of 1,000
(1,000 blocks), with the same quality columns plus:

* **TV b=32 / b=512**: a corpus stored sorted by domain (16 domains in contiguous runs of 62,500
  samples): the mean total-variation distance between a batch's domain mix and the corpus' mix, over the
  epoch's consecutive batches of 32 and of 512. This is what a training step sees.
* **blocks per 1k**: distinct blocks of 1,000 consecutive samples among each 1,000 consecutive positions,
  on average: the ranges a remote reader fetches per 1,000 samples served.
* **local blocks**: the most distinct blocks among any 2 * window * block consecutive positions
  (aligned to that length): what a reader must hold to never miss.

Its last rows are the order of :class:`~streampack.follow.Follow` (training while the build runs): eras
of consecutive samples whose sizes double from 1,024 to the largest, each shuffled within itself (for
them, window x block is the largest era).

Then the rows a :class:`~streampack.loader.seqlen.SeqLenSchedule` serves at a short length: the order
permutes units of ``k`` windows of that length (``n / k`` windows of the largest length), and each unit's
``k`` sub-windows are served together, in one batch (what the Loader does), next to the alternative of
spreading them over ``k`` consecutive batches (each batch one sub-window of each of ``k`` times as many
units), for ``k`` = 4 (512 of 2048) and 16 (128 of 2048); compare them with the global shuffle's row. Kept
together, a batch of 512 short rows holds the units of 128 (or 32) rows of the largest length, the same
tokens, and so their mix: its TV b=512 is the global shuffle's at a batch of 128 units (0.136) or 32
(0.262), where spreading them would give the short windows' own 0.068, at the price of batches that depend
on ``k`` batches' units (a position inside a unit, a change of length only at a group's end).

The table is printed and saved to ``benchmarks/results/shuffle-quality.md``.

Usage::

    python benchmarks/bench_shuffle_quality.py [--repeats 5] [--locality-only]
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

from streampack.follow import Eras, FollowOrder  # noqa: E402
from streampack.order.blockshuffle import BlockShuffled  # noqa: E402
from streampack.order.permutation import Permutation  # noqa: E402

SIZES = (10**4, 10**6, 10**7)
STREAM = 10**6
SEED = 20240601
# The order of streampack.Follow over a finished cache: eras from 1,024 samples, doubling up to these.
FOLLOW_FIRST, FOLLOW_LARGEST = 1024, (8192, 65536)


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


LOCALITY_N = 10**6
BLOCK = 1000
DOMAINS = 16
WINDOWS = (1, 4, 16, 64, LOCALITY_N // BLOCK)
LOCALITY_HEADER = (
    "order", "state B", "ms per 1M idx", "abs corr", "adj <= 1", "adj <= n/1k", "TV b=32", "TV b=512",
    "blocks per 1k", "local blocks",
)  # fmt: skip


def domain_tv(order: np.ndarray, batch: int) -> float:
    """Mean total-variation distance between each batch's domain mix and the corpus' (domains sorted)."""
    domains = order[: order.size // batch * batch] // (order.size // DOMAINS)
    rows = domains.reshape(-1, batch)
    counts = np.stack([(rows == d).sum(axis=1) for d in range(DOMAINS)], axis=1)
    return float(np.mean(0.5 * np.abs(counts / batch - 1 / DOMAINS).sum(axis=1)))


def distinct_per_row(blocks: np.ndarray, width: int) -> np.ndarray:
    """Distinct values in each run of ``width`` consecutive entries (a shorter tail is dropped)."""
    rows = np.sort(blocks[: blocks.size // width * width].reshape(-1, width), axis=1)
    return 1 + (np.diff(rows, axis=1) != 0).sum(axis=1)


def locality_row(name: str, order: np.ndarray, state: int | str, ms: float | None, window: int) -> str:
    """One row of the locality table for one epoch's ``order``."""
    blocks = order // BLOCK
    per_1k = float(distinct_per_row(blocks, 1000).mean())
    local = int(distinct_per_row(blocks, min(order.size, 2 * window * BLOCK)).max())
    cells = [name, f"{state:,}" if isinstance(state, int) else state, "" if ms is None else f"{ms:.0f}"]
    cells += quality_cells(*quality(order))
    cells += [f"{domain_tv(order, 32):.3f}", f"{domain_tv(order, 512):.3f}", f"{per_1k:.0f}", f"{local:,}"]
    return table_row(cells)


def locality_table(repeats: int) -> list[str]:
    """No shuffle, the global shuffle and the block shuffle at several windows, over one epoch."""
    n, positions = LOCALITY_N, np.arange(LOCALITY_N, dtype=np.int64)
    rows = [table_row(list(LOCALITY_HEADER)), table_row(["---"] + ["---:"] * (len(LOCALITY_HEADER) - 1))]
    rows.append(locality_row("no shuffle (stream order)", positions, 0, None, 1))
    feistel = Permutation(n, seed=SEED)
    ms = median_seconds(partial(feistel, positions), repeats) * 1e3
    state = len(pickle.dumps(feistel))
    rows.append(locality_row("global shuffle (Feistel)", feistel(positions), state, ms, n // BLOCK))
    for window in WINDOWS:
        order = BlockShuffled(n, seed=SEED, block=BLOCK, window=window)
        ms = median_seconds(partial(order.samples, positions), repeats) * 1e3
        label = "all" if window * BLOCK >= n else str(window)
        name = f"block shuffle, block {BLOCK:,}, window {label}"
        rows.append(locality_row(name, order.samples(positions), len(pickle.dumps(order)), ms, window))
    for largest in FOLLOW_LARGEST:
        follow = FollowOrder(seed=SEED, eras=Eras(FOLLOW_FIRST, largest), then="end", data={})
        follow.finish(n)
        ms = median_seconds(partial(follow.samples, positions), repeats) * 1e3
        name = f"follow eras, {FOLLOW_FIRST:,} doubling to {largest:,}"
        rows.append(
            locality_row(name, follow.samples(positions), len(pickle.dumps(follow)), ms, largest // BLOCK)
        )
    rows += [schedule_row(k, spread) for k in SUB_WINDOWS for spread in (False, True)]
    return rows


# Sub-windows a unit is served as: 512 (and 128) tokens of units of 2048.
SUB_WINDOWS = (4, 16)
# Rows of a global batch at the short length, for the spread over batches.
SCHEDULE_BATCH = 512


def schedule_row(k: int, spread: bool) -> str:
    """The order of the ``LOCALITY_N`` windows of a short length that a schedule serves: units of ``k`` of
    them in the global shuffle, each unit's sub-windows together, or spread over ``k`` batches."""
    units = Permutation(LOCALITY_N // k, seed=SEED)(np.arange(LOCALITY_N // k, dtype=np.int64))
    subs = units[:, None] * k + np.arange(k)  # (units, k): each unit's sub-windows, in its order
    if spread:  # groups of k batches: batch j of a group holds sub-window j of each of the group's units
        per_group = SCHEDULE_BATCH  # units of a group: one sub-window of each in each of its k batches
        groups = subs[: len(subs) // per_group * per_group].reshape(-1, per_group, k)
        order = groups.transpose(0, 2, 1).reshape(-1)
        name = f"seq_len schedule, units of {k} spread over {k} batches of {SCHEDULE_BATCH}"
    else:
        order = subs.reshape(-1)
        name = f"seq_len schedule, units of {k} sub-windows, in one batch (the Loader's)"
    return locality_row(name, order, "", None, LOCALITY_N // BLOCK)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark, print the markdown tables and save them to ``benchmarks/results``."""
    parser = argparse.ArgumentParser(description="Feistel Permutation vs a numpy permutation array.")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per cell (the median is shown)")
    parser.add_argument(
        "--locality-only", action="store_true", help="only the block-shuffle table (a few seconds)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "shuffle-quality.md")
    args = parser.parse_args(argv)

    lines = [
        f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}, seed {SEED}",
        f"timings: median of {args.repeats} runs; quality over one full epoch",
        "",
    ]
    print("\n".join(lines), flush=True)
    if not args.locality_only:
        table = [table_row(list(HEADER)), table_row(list(ALIGN))]
        print("\n".join(table), flush=True)
        for n in SIZES:
            rows = measure(n, args.repeats)
            print("\n".join(rows), flush=True)
            table += rows
        lines += [*table, ""]
    described = (
        f"Locality: n = {LOCALITY_N:,} samples, blocks of {BLOCK:,} consecutive samples, {DOMAINS} domains "
        "in contiguous runs (TV: batch domain mix vs the corpus'); 'local blocks': most distinct blocks in "
        "2 x window x block consecutive positions. The seq_len schedule rows: n windows of a short length "
        "(the 16 domains over them), in units of k; a batch of 512 of them together holds 512 / k units, "
        "the mix of a batch of 512 / k windows of the largest length (the same tokens)."
    )
    table = locality_table(args.repeats)
    print(described + "\n\n" + "\n".join(table), flush=True)
    lines += [described, "", *table]
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

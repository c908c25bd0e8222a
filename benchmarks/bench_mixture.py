"""Benchmark ``Mixture`` against the loader over one cache: throughput, memory per source, resume time.

One command, one run, every row in its own process (``_mixture_rows.py``), each figure against the
baseline it names, measured in the same run, on synthetic caches written with numpy (random GPT-2-sized
ids in documents of ~600 tokens; the loader's speed does not depend on the text):

1. Throughput, seq_len 2048 (+1 overlap), global batch 32, shuffled, ``num_workers`` 0 and 2: samples/s
   of a mixture of three caches of very different sizes (60 % / 30 % / 10 % of the tokens, weights
   5 / 3 / 2) divided by that of ``Loader(cache.sequences(2048, overlap=1), batch_size=32)`` over one cache
   holding the same total tokens, the median of the rounds' paired ratios. Goal >= 0.9.
2. Peak anonymous RSS (``RssAnon``) over ``N`` batches of a mixture of 100 sources (100 distinct caches
   of 20k tokens, seq_len 64) minus that of a mixture of 1 source (one cache of the same 2M tokens).
   Goal <= 50 MB.
3. Time to the first batch after ``load_state_dict`` of the three-cache mixture at position 10^9 versus
   position 0 (fresh processes, median). Goal <= 2.

Usage::

    python benchmarks/bench_mixture.py [--quick] [--repeats 7] [--tmp DIR] [--out FILE]

Prints a markdown table and writes it to ``benchmarks/results/mixture.md`` (``mixture-quick.md`` with
``--quick``). Caches are written under ``--tmp`` and deleted afterwards.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

from _report import environment, goal, publish, run_json, warm
from _report import parser as report_parser

from streampack.testing.caches import write_random_cache

HERE = Path(__file__).resolve().parent
ROWS = HERE / "_mixture_rows.py"
SEQ_LEN = 2048
BATCH = 32
# Three caches of very different sizes, read at weights unlike their sizes: the small one wraps into new
# epochs about twice as often as the big one, so the mixture crosses epoch boundaries of every source.
SHARES = {"big": 0.6, "mid": 0.3, "small": 0.1}
WEIGHTS = {"big": 5, "mid": 3, "small": 2}
MANY = 100
TINY_TOKENS = 20_000
TINY_SEQ_LEN = 64
FAR = 10**9
KINDS = {
    "single": "one cache (the baseline)",
    "mixture": "**Mixture of 3 caches** (60/30/10 %, weights 5/3/2)",
}


def log(message: str) -> None:
    print(f"[bench_mixture] {message}", file=sys.stderr, flush=True)


def row(mode: str, caches: list[Path], **options: Any) -> dict[str, Any]:
    """Run one ``_mixture_rows.py`` measurement in this venv."""
    cmd = [sys.executable, str(ROWS), mode, "--caches", *map(str, caches)]
    for key, value in options.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return run_json(cmd)


def make_cache(root: Path, tokens: int, seed: int) -> Path:
    write_random_cache(root, tokens, seed=seed)
    warm(root)
    return root


# --- 1. throughput ------------------------------------------------------------------------------------

Runs = dict[tuple[str, int], list[dict[str, float]]]


def measure_throughput(single: Path, mixed: list[Path], batches: int, repeats: int) -> Runs:
    """Every round runs each row once, for 0 and 2 workers; the order of the two rows alternates."""
    weights = ",".join(str(WEIGHTS[path.name]) for path in mixed)
    runs: Runs = {}
    # Rounds over both rows rather than repeats of one row: a burst of load from other processes then
    # hurts one run of each row, and best-of-rounds discards it; each round's two runs also make a pair.
    for round_ in range(repeats):
        for workers in (0, 2):
            kinds = ["single", "mixture"] if round_ % 2 == 0 else ["mixture", "single"]
            for kind in kinds:
                log(f"throughput round {round_ + 1}/{repeats}: {kind}, {workers} workers")
                caches, options = ([single], {}) if kind == "single" else (mixed, {"weights": weights})
                result = row(
                    "throughput", caches, kind=kind, workers=workers, batches=batches, repeats=3, **options
                )
                runs.setdefault((kind, workers), []).append(result)
    return runs


def throughput_table(runs: Runs) -> tuple[str, list[str]]:
    """Best samples/s of each row, the mixture's ratio to the single cache, and the goal lines.

    The goal is checked on the median of the per-round ratios: the two runs of a round are back to back,
    so each ratio sees about the same load, where a ratio of two bests can pair a lucky run with an
    unlucky one (on this shared machine the two differ by up to 0.3 at nw=2).
    """
    header = ["source", "samples/s, nw=0", "samples/s, nw=2", "÷ single, nw=0", "÷ single, nw=2"]
    header += ["RssAnon, nw=0", "RssAnon, nw=2: main / worker"]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]

    def best(kind: str, workers: int, key: str = "samples_per_s") -> float:
        return max(run[key] for run in runs[kind, workers])

    def pairs(workers: int) -> list[float]:
        mixed, single = runs["mixture", workers], runs["single", workers]
        return [m["samples_per_s"] / s["samples_per_s"] for m, s in zip(mixed, single, strict=True)]

    for kind, label in KINDS.items():
        cells = [f"{best(kind, w):,.0f}" for w in (0, 2)]
        cells += [f"{statistics.median(pairs(w)) if kind == 'mixture' else 1.0:.2f}" for w in (0, 2)]
        cells += [f"{best(kind, 0, 'main_mb'):.0f} MB"]
        cells += [f"{best(kind, 2, 'main_mb'):.0f} / {best(kind, 2, 'worker_mb'):.0f} MB"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    notes = ["samples/s: the best run of each row; ÷ single: the median of the rounds' paired ratios."]
    for workers in (0, 2):
        listed = ", ".join(f"{p:.2f}" for p in pairs(workers))
        ratio_of_bests = best("mixture", workers) / best("single", workers)
        notes.append(f"- nw={workers}: per round {listed}; ratio of the bests {ratio_of_bests:.2f}")
    goals = [
        goal(
            f"Mixture ÷ single cache, samples/s, nw={w} (median of paired rounds)",
            statistics.median(pairs(w)),
            ">=",
            0.9,
        )
        for w in (0, 2)
    ]
    return "\n".join([*lines, "", *notes]), goals


# --- 2. memory ----------------------------------------------------------------------------------------


def memory_table(one: Path, many: list[Path], batches: int) -> tuple[str, list[str]]:
    """RssAnon at start and at its peak, 1 source versus 100, for 0 and 2 workers."""
    peaks: dict[tuple[int, int], dict[str, Any]] = {}
    for workers in (0, 2):
        for caches in ([one], many):
            log(f"RssAnon over {batches} batches, {len(caches)} source(s), {workers} workers")
            peaks[len(caches), workers] = row(
                "rss", caches, kind="mixture", workers=workers, batches=batches, seq_len=TINY_SEQ_LEN
            )
    lines = [
        "| mixture | workers | batches read | main RssAnon at start | main RssAnon peak | worker peak |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for (sources, workers), peak in peaks.items():
        worker = f"{peak['worker_mb']:.1f} MB" if workers else "-"
        lines.append(
            f"| {sources} source{'s' if sources > 1 else ''} | {workers} | {peak['batches']:,} | "
            f"{peak['start_mb']:.1f} MB | {peak['main_mb']:.1f} MB | {worker} |"
        )
    goals = []
    for workers in (0, 2):
        for key in ("main_mb", "worker_mb") if workers else ("main_mb",):
            growth = peaks[len(many), workers][key] - peaks[1, workers][key]
            who = "main" if key == "main_mb" else "worker"
            goals.append(
                goal(
                    f"{who} RssAnon peak, {len(many)} sources − 1 source, nw={workers} (MB)", growth, "<=", 50
                )
            )
    return "\n".join(lines), goals


# --- 3. resume ----------------------------------------------------------------------------------------


def first_batch_table(mixed: list[Path], repeats: int) -> tuple[str, list[str]]:
    """Median seconds to the first batch after ``load_state_dict`` at position 0 and at 10^9."""
    weights = ",".join(str(WEIGHTS[path.name]) for path in mixed)
    seconds: dict[tuple[int, int], list[float]] = {}
    imported_ma: set[bool] = set()
    import_ma: list[float] = []
    for round_ in range(repeats):
        for workers in (0, 2):
            positions = (0, FAR) if round_ % 2 == 0 else (FAR, 0)
            for position in positions:
                log(f"first batch round {round_ + 1}/{repeats}: position {position:,}, {workers} workers")
                result = row("first-batch", mixed, weights=weights, workers=workers, position=position)
                seconds.setdefault((position, workers), []).append(result["seconds"])
                if not workers:
                    imported_ma.add(result["imported_numpy_ma"])
        import_ma.append(row("numpy-ma", mixed)["seconds"])
    lines = ["| workers | position 0 | position 10^9 | ratio |", "|---:|---:|---:|---:|"]
    goals = []
    for workers in (0, 2):
        zero, far = (statistics.median(seconds[p, workers]) for p in (0, FAR))
        lines.append(f"| {workers} | {zero * 1e3:.1f} ms | {far * 1e3:.1f} ms | {far / zero:.2f} |")
        goals.append(goal(f"first batch at position 10^9 ÷ position 0, nw={workers}", far / zero, "<=", 2))
    if imported_ma == {True}:
        lines += [
            "",
            "At nw=0 both include numpy's lazy `import numpy.ma` on the first `np.unique` call, "
            f"{statistics.median(import_ma) * 1e3:.1f} ms on its own in a fresh process (median).",
        ]
    return "\n".join(lines), goals


def load() -> str:
    return " / ".join(f"{value:.2f}" for value in os.getloadavg())


def main() -> None:
    parser = report_parser(__doc__, "mixture", repeats=7, batches=1000)
    args = parser.parse_args()

    tmp = Path(args.tmp)
    total = 20_000_000 if args.quick else 100_000_000  # tokens: 0.04 / 0.2 GB per side
    need = 2 * total * 2 / 1e9 + 0.05
    free = shutil.disk_usage(tmp.parent if not tmp.exists() else tmp).free / 1e9
    if free < need * 1.5:
        sys.exit(f"bench_mixture: needs ~{need:.1f} GB free under {tmp.parent}, has {free:.1f} GB; use --tmp")
    batches = 200 if args.quick else args.batches
    rss_batches = 1000 if args.quick else 5000
    tmp.mkdir(parents=True, exist_ok=True)
    started_load = load()
    try:
        log(f"writing synthetic caches in {tmp}: one of {total:,} tokens and three of 60/30/10 % of it")
        single = make_cache(tmp / "single", total, seed=0)
        mixed = [
            make_cache(tmp / name, int(total * share), seed=1 + k)
            for k, (name, share) in enumerate(SHARES.items())
        ]
        log(f"writing {MANY} caches of {TINY_TOKENS:,} tokens and one of {MANY * TINY_TOKENS:,}")
        one = make_cache(tmp / "one", MANY * TINY_TOKENS, seed=10)
        many = [make_cache(tmp / "many" / f"src{k:03d}", TINY_TOKENS, seed=100 + k) for k in range(MANY)]
        speed, speed_goals = throughput_table(measure_throughput(single, mixed, batches, args.repeats))
        memory, memory_goals = memory_table(one, many, rss_batches)
        starts, start_goals = first_batch_table(mixed, args.repeats)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    shares = ", ".join(f"{share:.0%}" for share in SHARES.values())
    epochs = rss_batches * BATCH / (MANY * ((TINY_TOKENS - 1) // TINY_SEQ_LEN))
    report = "\n".join(
        [
            "# Mixture benchmark" + (" (quick)" if args.quick else ""),
            "",
            f"Measured {environment()}; load average (1/5/15 min) {started_load} at the start,"
            f" {load()} at the end. The machine is shared, so expect ±20 % between runs. Every row runs in"
            " its own process with OMP_NUM_THREADS=1; rounds alternate over the rows.",
            "",
            f"## Throughput: seq_len {SEQ_LEN} (+1), global batch {BATCH}, shuffled, caches in page cache",
            "",
            f"Baseline: `Loader(cache.sequences({SEQ_LEN}, overlap=1), batch_size={BATCH})` over one cache"
            f" of {total:,} tokens; the mixture reads three caches of {shares} of that many tokens at weights"
            f" {'/'.join(map(str, WEIGHTS.values()))}. Best of {args.repeats} rounds (each the best of 3"
            f" runs of {batches:,} batches in one process); with workers through"
            " `streampack.torch.DataLoader(num_workers=2, persistent_workers=True)`.",
            "",
            speed,
            "",
            f"## Anonymous memory of {MANY} sources versus 1 ({rss_batches:,} batches)",
            "",
            f"seq_len {TINY_SEQ_LEN} (+1), global batch {BATCH}, equal weights. {MANY} sources are"
            f" {MANY} distinct caches of {TINY_TOKENS:,} tokens each (their own files, manifests, memory"
            f" maps, index arrays and orders: what {MANY} real sources cost, unlike one cache opened"
            f" {MANY} times); 1 source is one cache of the same {MANY * TINY_TOKENS:,} tokens, so the"
            " difference is the cost per source, not more data. Each source runs through about"
            f" {epochs:.1f} epochs. RssAnon is sampled every 100 batches.",
            "",
            memory,
            "",
            "## First batch after load_state_dict, 3-cache mixture (fresh process, median)",
            "",
            "A real `state_dict()` of the mixture's loader with `position` set to 0 or 10^9 (its schedule"
            " as saved); the clock covers building the Mixture and Loader, `load_state_dict` and the first"
            f" batch (with workers, their start). Median of {args.repeats}.",
            "",
            starts,
            "",
            "## Goals",
            "",
            *speed_goals,
            *memory_goals,
            *start_goals,
            "",
        ]
    )
    publish(report, "mixture", args)


if __name__ == "__main__":
    main()

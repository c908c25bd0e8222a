"""Benchmark the sample layouts on the real corpus: padding and loader speed against concat windows.

One command, one run, every measurement in its own process (``_layout_rows.py``), on a cache of the
real corpus tokenized with GPT-2 (``tokenizer.json`` from ``../shared/data``). The layouts: concat windows
(``cache.sequences(L)``, the baseline), ``cache.packed(L)`` (whole documents packed best-fit decreasing,
documents longer than ``L`` split) and ``cache.documents(L)`` (one document per sample, truncated: SFT).

1. Padding, for seq_len 512, 2048 and 8192: samples per epoch, tokens served (padding excluded) out of
   the cache's, padding fraction, and the time of the first call (planning and storing the plan in
   ``CACHE/layouts/``, removed before each run) and of a second call (the stored plan, mapped); medians
   of ``--repeats``.
2. Throughput, seq_len 2048, global batch 32, shuffled, ``output="numpy"`` and ``"dict"``, 0 workers
   (the ``Loader`` iterated in process) and 2 (``streampack.torch.DataLoader``): samples/s of packed and
   documents divided by those of concat windows, the rows of one round back to back in alternating
   order; the ratio is the median of the rounds' paired ratios. Goal >= 0.8. Real tokens/s (padding
   excluded) and the ratio in CPU time (this process and its workers) beside it.

Usage::

    python benchmarks/bench_layouts.py [--corpus natural.jsonl] [--cache DIR] [--quick] [--repeats 5]

The corpus defaults to ``corpus/natural.jsonl`` in ``$STREAMPACK_SHARED_DATA`` or ``../shared/data``
(``make_corpus.sh`` makes it); ``--quick`` tokenizes only its first ``--quick-mb`` (20) MB. ``--cache DIR``
reuses the cache in DIR when there is one, else builds it there and keeps it; without it the cache is
built under ``--tmp`` and deleted afterwards. Prints a markdown table and writes it to
``benchmarks/results/layouts.md`` (``layouts-quick.md`` with ``--quick``).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _backends import SHARED_DATA, TOKENIZERS_GPT2, head_lines
from _report import environment, goal, publish, run_json, warm
from _report import parser as report_parser

import streampack
from streampack.format import LAYOUT_DIR

HERE = Path(__file__).resolve().parent
ROWS = HERE / "_layout_rows.py"
SEQ_LENS = (512, 2048, 8192)
SEQ_LEN = 2048
BATCH = 32
LAYOUTS = {
    "windows": "concat windows (baseline)",
    "packed": "**packed** (best-fit decreasing)",
    "documents": "**documents** (one per sample)",
}
OUTPUTS = ("numpy", "dict")


def log(message: str) -> None:
    print(f"[bench_layouts] {message}", file=sys.stderr, flush=True)


def load() -> str:
    return " / ".join(f"{value:.2f}" for value in os.getloadavg())


def row(mode: str, cache: Path, layout: str, **options: Any) -> dict[str, Any]:
    """Run one ``_layout_rows.py`` measurement in this venv."""
    cmd = [sys.executable, str(ROWS), mode, "--cache", str(cache), "--layout", layout]
    for key, value in options.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return run_json(cmd)


# --- the cache ----------------------------------------------------------------------------------------


def prepare_cache(corpus: Path, cache: Path, tokenizer: str, quick_mb: float | None, tmp: Path) -> str:
    """Build the cache of ``corpus`` (its head with ``--quick``) unless ``cache`` holds one; describe it."""
    if (cache / "manifest.json").is_file():
        log(f"reusing the cache in {cache}")
        return f"reused from `{cache}`"
    source = corpus
    if quick_mb is not None:
        source = Path(head_lines(str(corpus), tmp / "quick.jsonl", int(quick_mb * 1e6)))
    size_mb = source.stat().st_size / 1e6
    log(f"building a cache of {source} ({size_mb:.0f} MB) with {tokenizer}")
    start = time.perf_counter()
    streampack.build(str(source), cache, tokenizer=tokenizer)
    head = f"the first {size_mb:.0f} MB of " if quick_mb is not None else ""
    return f"built from {head}`{corpus.name}` in {time.perf_counter() - start:.0f} s"


# --- 1. padding ---------------------------------------------------------------------------------------

Plans = dict[tuple[int, str], list[dict[str, Any]]]


def measure_plans(cache: Path, repeats: int) -> Plans:
    """Each layout at each seq_len, ``repeats`` times, its stored plan removed before every run."""
    plans: Plans = {}
    for round_ in range(repeats):
        for seq_len in SEQ_LENS:
            for layout in LAYOUTS:
                log(f"plan round {round_ + 1}/{repeats}: {layout}, seq_len {seq_len}")
                for stored in (cache / LAYOUT_DIR).glob(f"{layout}-{seq_len}-*"):
                    shutil.rmtree(stored)
                result = row("plan", cache, layout, seq_len=seq_len)
                plans.setdefault((seq_len, layout), []).append(result)
    return plans


def padding_table(plans: Plans) -> str:
    header = ["seq_len", "layout", "samples per epoch", "tokens served", "padding"]
    header += ["first call (plan + store)", "second call (mapped)", "plan on disk"]
    lines = ["| " + " | ".join(header) + " |", "|---:|---|" + "---:|" * (len(header) - 2)]
    for (seq_len, layout), runs in plans.items():
        last = runs[-1]
        first, second = (statistics.median(run[key] for run in runs) for key in ("first_s", "second_s"))
        cells = [f"{seq_len:,}", LAYOUTS[layout].replace(" (baseline)", ""), f"{last['samples']:,}"]
        cells += [f"{last['tokens'] / last['cache_tokens']:.2%}", f"{last['padding']:.2%}"]
        cells += [f"{first * 1e3:.1f} ms", f"{second * 1e3:.2f} ms"]
        cells += [f"{last['plan_bytes'] / 1e6:.2f} MB" if last["plan_bytes"] else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --- 2. throughput ------------------------------------------------------------------------------------

Runs = dict[tuple[str, str, int], list[dict[str, float]]]


def measure_throughput(cache: Path, repeats: int, batches: int, seconds: float) -> Runs:
    """Every round runs each layout once per output and worker count, in alternating order."""
    runs: Runs = {}
    # Rounds over the three layouts rather than repeats of one: a burst of load from other processes
    # then hurts one run of each, and the runs of a round, back to back, make the pairs of the ratios.
    for round_ in range(repeats):
        for output in OUTPUTS:
            for workers in (0, 2):
                layouts = list(LAYOUTS) if round_ % 2 == 0 else list(reversed(LAYOUTS))
                for layout in layouts:
                    log(f"throughput round {round_ + 1}/{repeats}: {layout}, {output}, {workers} workers")
                    result = row(
                        "throughput",
                        cache,
                        layout,
                        seq_len=SEQ_LEN,
                        output=output,
                        workers=workers,
                        batches=batches,
                        seconds=seconds,
                    )
                    runs.setdefault((layout, output, workers), []).append(result)
    return runs


def throughput_table(runs: Runs) -> tuple[str, list[str]]:
    """Median samples/s of each row, its paired ratio to concat windows, and the goal lines."""
    header = ["layout", "output", "samples/s, nw=0", "samples/s, nw=2", "÷ windows, nw=0", "÷ windows, nw=2"]
    header += ["÷ windows in CPU time, nw=0", "nw=2", "real M tokens/s, nw=0", "nw=2"]
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]

    def median(layout: str, output: str, workers: int, key: str = "samples_per_s") -> float:
        return statistics.median(run[key] for run in runs[layout, output, workers])

    def pairs(layout: str, output: str, workers: int, key: str = "samples_per_s") -> list[float]:
        mine, base = runs[layout, output, workers], runs["windows", output, workers]
        return [m[key] / b[key] for m, b in zip(mine, base, strict=True)]

    def ratio(layout: str, output: str, workers: int, key: str = "samples_per_s") -> float:
        return statistics.median(pairs(layout, output, workers, key))

    for output in OUTPUTS:
        for layout, label in LAYOUTS.items():
            cells = [label, f"`{output}`", *(f"{median(layout, output, w):,.0f}" for w in (0, 2))]
            cells += [f"{ratio(layout, output, w):.2f}" for w in (0, 2)]
            cells += [f"{ratio(layout, output, w, 'samples_per_cpu_s'):.2f}" for w in (0, 2)]
            tokens = runs[layout, output, 0][0]["tokens_per_sample"]
            cells += [f"{median(layout, output, w) * tokens / 1e6:,.1f}" for w in (0, 2)]
            lines.append("| " + " | ".join(cells) + " |")
    notes = ["Paired ratios of each round (samples/s ÷ concat windows in the same round):", ""]
    goals = []
    for output in OUTPUTS:
        for layout in ("packed", "documents"):
            for workers in (0, 2):
                listed = ", ".join(f"{p:.2f}" for p in pairs(layout, output, workers))
                notes.append(f"- {layout}, {output}, nw={workers}: {listed}")
                what = f"{layout} ÷ concat windows, samples/s, output={output}, nw={workers}"
                goals.append(goal(what, ratio(layout, output, workers), ">=", 0.8))
    return "\n".join([*lines, "", *notes]), goals


def main() -> None:
    parser = report_parser(__doc__, "layouts", repeats=5, batches=100)
    parser.add_argument(
        "--corpus",
        default=str(SHARED_DATA / "corpus" / "natural.jsonl"),
        help="JSONL corpus with a `text` field (default: natural.jsonl of ../shared/data/make_corpus.sh)",
    )
    parser.add_argument("--cache", help="reuse the cache in DIR, or build it there and keep it")
    parser.add_argument("--quick-mb", type=float, default=20.0, help="MB of the corpus that --quick reads")
    parser.add_argument(
        "--seconds", type=float, help="at least this long per timed run (default 2, quick 0.5)"
    )
    parser.add_argument("--tokenizer-json", default=TOKENIZERS_GPT2)
    args = parser.parse_args()
    corpus = Path(args.corpus)
    if not args.cache or not (Path(args.cache) / "manifest.json").is_file():
        if not corpus.is_file():
            sys.exit(
                f"bench_layouts: no corpus at {corpus}; make it with ../shared/data/make_corpus.sh or pass"
                " --corpus FILE (or --cache DIR holding a cache)"
            )
        if not Path(args.tokenizer_json).is_file():
            sys.exit(f"bench_layouts: no tokenizer at {args.tokenizer_json}; pass --tokenizer-json FILE")
    seconds = args.seconds if args.seconds is not None else 0.5 if args.quick else 2.0

    tmp = Path(args.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache) if args.cache else tmp / "cache"
    started_load = load()
    try:
        built = prepare_cache(corpus, cache, args.tokenizer_json, args.quick_mb if args.quick else None, tmp)
        opened = streampack.open(cache)
        warm(cache)
        plans = measure_plans(cache, args.repeats)
        runs = measure_throughput(cache, args.repeats, args.batches, seconds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    speed, speed_goals = throughput_table(runs)
    tokenizer = f"`{opened.manifest.tokenizer.name}`, {opened.vocab_size:,} ids"
    report = "\n".join(
        [
            "# Layouts benchmark" + (" (quick)" if args.quick else ""),
            "",
            f"Measured {environment()}; load average (1/5/15 min) {started_load} at the start,"
            f" {load()} at the end. The machine is shared, so expect ±20 % between runs. Every"
            " measurement runs in its own process with OMP_NUM_THREADS=1.",
            "",
            f"Cache: {opened.num_docs:,} documents, {opened.num_tokens:,} tokens ({opened.dtype.name},"
            f" tokenizer {tokenizer}, EOS after every document), {built}.",
            "",
            "## Padding and planning",
            "",
            "Tokens served: the tokens the samples of one epoch hold, padding excluded, out of the cache's"
            " (windows leave out the final partial window; documents cut each one longer than seq_len)."
            " The first call plans and stores the plan (any stored one removed before); the second, in the"
            f" same process, maps the stored plan. Median of {args.repeats}.",
            "",
            padding_table(plans),
            "",
            f"## Throughput: seq_len {SEQ_LEN}, global batch {BATCH}, shuffled, cache in page cache",
            "",
            f"`Loader(samples, batch_size={BATCH}, seed=0, output=...)`, int64 out, every layout"
            f' {SEQ_LEN} tokens wide (windows without overlap, as `output="dict"` requires); with 2'
            " workers through `streampack.torch.DataLoader(num_workers=2, persistent_workers=True)`."
            f" samples/s: median of {args.repeats} rounds, each one timed run of at least"
            f" {args.batches:,} batches and {seconds:g} s after 20 batches of warm-up; ÷ windows: the"
            " median of the rounds' paired ratios, in wall time and in CPU time (this process and its"
            " workers); real tokens/s: samples/s times the layout's tokens per sample (padding excluded,"
            " averaged over the epoch).",
            "",
            speed,
            "",
            "## Goals",
            "",
            *speed_goals,
            "",
        ]
    )
    publish(report, "layouts", args)


if __name__ == "__main__":
    main()

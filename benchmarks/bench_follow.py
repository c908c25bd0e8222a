"""Training while the build runs: `python benchmarks/bench_follow.py [--corpus FILE] [--quick]`.

One command, one run, on a real corpus and the GPT-2 ``tokenizer.json`` of ``../shared/data`` (or
``$STREAMPACK_SHARED_DATA``):

* **build alone**: ``streampack build`` in a subprocess (default engine), whole-process wall time.
* **build, then train** (the baseline): the build, then one epoch of a ``Loader`` over the finished cache
  with a simulated training step (a sleep, as a GPU step leaves the CPU free) after each batch. The step
  is set so that the epoch's steps take as long as the build alone did: the case where following helps
  most, and where a slow consumer or a slow build would each hide it.
* **train while building**: the same build started again, and a ``Follow`` of it with the same step from
  the start; wall time from the build's start to the last batch, time to the first batch, and the share
  of the batches served before the build ended.
* **read speed**: samples/s of a ``Follow`` over the finished cache (no step) against a ``Loader`` given
  the same order, so reading the same rows (the baseline: what is left is the Follow's own cost), and a
  ``Loader`` in its global shuffle for scale (an era's windows are near each other, a global shuffle's
  are not).

Figures are medians of ``--repeats`` runs (the machine is shared). The table is printed and written to
``benchmarks/results/follow.md`` (``follow-quick.md`` with ``--quick``).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import streampack
from benchmarks._backends import SHARED_DATA, TOKENIZERS_GPT2
from benchmarks._report import environment, goal, parser, publish
from streampack.follow.order import Eras, FollowOrder

SEQ_LEN, BATCH = 1024, 16
SMALL_ERA = 4096
SAMPLE = SHARED_DATA / "corpus" / "natural-sample.jsonl.zst"


def build_command(corpus: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "streampack", "build", str(corpus), "--out", str(out),
            "--tokenizer", TOKENIZERS_GPT2, "--unit-mb", "8", "--overwrite"]  # fmt: skip


def build_alone(corpus: Path, out: Path) -> float:
    started = time.perf_counter()
    subprocess.run(build_command(corpus, out), check=True, capture_output=True)
    return time.perf_counter() - started


def train(batches: object, step: float) -> tuple[int, float]:
    """Consume ``batches`` with a sleep of ``step`` s after each; the batches and the time to the first."""
    started, first, count = time.perf_counter(), None, 0
    for _ in batches:  # type: ignore[attr-defined]
        first = time.perf_counter() - started if first is None else first
        count += 1
        time.sleep(step)
    return count, first or 0.0


def train_while_building(corpus: Path, out: Path, step: float, largest_era: int) -> dict[str, float]:
    """Start the build, follow it with ``step`` s per batch; times from the build's start."""
    shutil.rmtree(out, ignore_errors=True)  # a Follow of the last run's finished cache would not wait
    started = time.perf_counter()
    proc = subprocess.Popen(build_command(corpus, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    follow = streampack.Follow(
        out,
        seq_len=SEQ_LEN,
        overlap=1,
        batch_size=BATCH,
        seed=0,
        poll=0.02,
        largest_era=largest_era,
        then="end",
    )
    opened = time.perf_counter() - started
    first, count, during, built = None, 0, 0, None
    for _ in follow:
        now = time.perf_counter() - started
        first = now if first is None else first
        count += 1
        if built is None and proc.poll() is not None:
            built = now
        during += built is None
        time.sleep(step)
    proc.wait()
    assert proc.returncode == 0, proc.stderr.read().decode() if proc.stderr else ""
    total = time.perf_counter() - started
    return {"total": total, "first": first or 0.0, "opened": opened, "batches": count, "during": during}


def read_speed(cache: Path, batches: int) -> dict[str, float]:
    """Samples/s over a finished cache, ``batches`` batches each: a Follow, a Loader reading the same
    positions in the same order (the Follow's, given to it), and a Loader in its own global shuffle.

    Each reader opens the cache itself (maps fresh in this process), and the pair to compare runs in both
    orders (follow, loader, loader, follow), each figure the mean of its two runs: the reader that goes
    first would otherwise pay for the page faults of both.
    """

    def make(kind: str) -> streampack.Loader:
        if kind == "follow":
            return streampack.Follow(cache, seq_len=SEQ_LEN, overlap=1, batch_size=BATCH, seed=0)
        samples = streampack.open(cache).sequences(SEQ_LEN, overlap=1)
        if kind == "loader":
            order = FollowOrder(seed=0, eras=Eras(), then="end", data={})
            order.finish(len(samples))
            return streampack.Loader(samples, order=order, batch_size=BATCH)
        return streampack.Loader(samples, batch_size=BATCH, seed=0)

    def run(kind: str) -> float:
        steps = iter(make(kind))
        next(steps)
        started = time.perf_counter()
        for _ in range(batches):
            next(steps)
        return batches * BATCH / (time.perf_counter() - started)

    speed: dict[str, list[float]] = {}
    for kind in ("follow", "loader", "loader", "follow", "shuffled"):
        speed.setdefault(kind, []).append(run(kind))
    return {kind: statistics.mean(values) for kind, values in speed.items()}


def main() -> None:
    args_parser = parser(__doc__ or "", "follow", repeats=3, batches=400)
    args_parser.add_argument("--corpus", type=Path, default=SAMPLE, help="JSONL input (default: the sample)")
    args = args_parser.parse_args()
    tmp = Path(args.tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    repeats = 1 if args.quick else args.repeats
    runs: dict[str, list[float]] = {}
    try:
        for repeat in range(repeats):
            alone = build_alone(args.corpus, tmp / "alone")
            batches = len(streampack.open(tmp / "alone").sequences(SEQ_LEN, overlap=1)) // BATCH
            step = alone / batches
            trained, _ = train(streampack.Loader(
                streampack.open(tmp / "alone").sequences(SEQ_LEN, overlap=1), batch_size=BATCH, seed=0,
                epochs=1), step)  # fmt: skip
            sequential = alone + trained * step
            followed = train_while_building(args.corpus, tmp / "followed", step, 65536)
            small = train_while_building(args.corpus, tmp / "followed", step, SMALL_ERA)
            speed = read_speed(tmp / "alone", 40 if args.quick else args.batches)
            for key, value in {
                "alone": alone, "step": step, "batches": batches, "sequential": sequential,
                "followed": followed["total"], "first": followed["first"], "opened": followed["opened"],
                "during": followed["during"] / followed["batches"], "loader": speed["loader"],
                "follow": speed["follow"], "shuffled": speed["shuffled"],
                "ratio": followed["total"] / sequential, "small": small["total"],
                "small_ratio": small["total"] / sequential,
                "small_during": small["during"] / small["batches"],
                "read": speed["follow"] / speed["loader"],
            }.items():  # fmt: skip
                runs.setdefault(key, []).append(value)
            print(f"[bench_follow] repeat {repeat + 1}/{repeats} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    median = {key: statistics.median(values) for key, values in runs.items()}
    publish(report(args, median, runs), "follow", args)


def report(args: object, median: dict[str, float], runs: dict[str, list[float]]) -> str:
    corpus = Path(args.corpus)  # type: ignore[attr-defined]
    name, size = corpus.name, corpus.stat().st_size / 1e6
    lines = [
        "# Training while the build runs (`streampack.Follow`)",
        "",
        environment(),
        "",
        f"Corpus {name} ({size:.0f} MB on disk), GPT-2 tokenizer.json, default engine, units of 8 MB; "
        f"seq_len {SEQ_LEN}, overlap 1, batch {BATCH}, default eras (1,024 doubling to 65,536 samples). "
        f"One epoch: {median['batches']:.0f} batches; simulated step {median['step'] * 1e3:.2f} ms (the "
        f"build's time over the batches). Median of {len(runs['alone'])} runs.",
        "",
        "| schedule | wall s | vs build, then train |",
        "|---|---:|---:|",
        f"| build alone | {median['alone']:.2f} | |",
        f"| build, then train one epoch (baseline) | {median['sequential']:.2f} | 1.00 |",
        f"| train while building (Follow, default eras) | {median['followed']:.2f} | {median['ratio']:.2f} |",
        f"| train while building (Follow, largest_era={SMALL_ERA:,}) | {median['small']:.2f} | "
        f"{median['small_ratio']:.2f} |",
        "",
        f"Follow: first batch {median['first']:.2f} s after the build started ({median['opened']:.2f} s to "
        f"open, waiting for the build's manifest); {median['during'] * 100:.0f} % of the batches served "
        f"before the build ended ({median['small_during'] * 100:.0f} % with largest_era={SMALL_ERA:,}). "
        "Ratios are medians of the per-run ratios. The last era is served once the build is complete: with "
        "the default eras it holds up to 65,536 samples, a large share of a small corpus. On 2 cores the "
        "training loop's reads also take CPU from the build. With a real step (hundreds of ms) and a build "
        "of hours, the overlap is the point; here both last seconds.",
        "",
        "| read a finished cache | samples/s | vs Loader |",
        "|---|---:|---:|",
        f"| Loader given the Follow's order (baseline: the same reads) | {median['loader']:,.0f} | 1.00 |",
        f"| Follow | {median['follow']:,.0f} | {median['read']:.2f} |",
        f"| Loader, its global shuffle (other reads: for scale) | {median['shuffled']:,.0f} | "
        f"{median['shuffled'] / median['loader']:.2f} |",
        "",
        "Goals:",
        "",
        goal("Follow read speed / Loader's", median["read"], ">=", 0.9),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

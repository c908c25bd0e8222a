"""Benchmark the training-time loader against the numpy row-take limit and nanoGPT's ``get_batch``.

One command, one run, every row in its own process (``_loader_rows.py``), on synthetic caches written
with numpy (random GPT-2-sized ids in documents of ~600 tokens; throughput does not depend on the text):

1. Throughput, seq_len 2048 (+1 overlap), global batch 32, shuffled, ``num_workers`` 0 and 2: samples/s
   of the ``Loader`` divided by the *limit* (32 random windows taken as rows of a sliding-window view of
   one flat ``np.memmap``, in one fancy-index take, cast to int64 or left in the cache dtype) and by
   nanoGPT's ``get_batch``, all reading the same file, measured in the same run; the Loader on an 8-shard
   cache of the same size against the row take on that cache's first shard.
2. Peak anonymous RSS (``RssAnon``) per process over a full shuffled epoch of a 1 GB and an 8 GB cache.
3. Time to the first batch after ``load_state_dict`` at step 10^6 versus step 0 (fresh processes).
4. With ``--profile``: the Loader rows (0 workers) under ``cProfile``, top functions by own time.

Usage::

    python benchmarks/bench_loader.py [--quick] [--repeats 3] [--profile] [--tmp DIR] [--out FILE]

Prints a markdown table and writes it to ``benchmarks/results/loader.md`` (``loader-quick.md`` with
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
REPO = HERE.parent
ROWS = HERE / "_loader_rows.py"
SEQ_LEN = 2048
BATCH = 32
KINDS = {
    "rowtake": "numpy row take, int64 out (the limit)",
    "rowtake-cache": "numpy row take, cache dtype out (uint16; the limit of uint16 rows)",
    "gather": "numpy 2-D fancy-index gather, uint16 out",
    "nanogpt": "nanoGPT get_batch (int64)",
    "loader": "**streampack Loader** (int64 out)",
    "loader-uint16": "**streampack Loader**, dtype=None (uint16 out)",
    "loader-tensors": "streampack Loader, one shm tensor per batch (no slots)",
}
# Rows whose batches are in the cache dtype: divided by the row take of the cache dtype.
CACHE_DTYPE = {"rowtake-cache", "gather", "loader-uint16"}
# Rows on the 8-shard cache (keys "8:KIND"), each divided by the row take on that cache's first shard.
SHARDED = {
    "rowtake": "8-shard cache: numpy row take on its first shard, int64 out",
    "loader": "8-shard cache: streampack Loader (int64 out; a batch spans ~8 shards)",
}
PROFILED = {"loader": "Loader, int64 out", "loader-uint16": "Loader, dtype=None (uint16 out)"}
PEERS = {
    "hf": "HF datasets load_from_disk, shuffled DataLoader",
    "mosaic": "MosaicML streaming StreamingDataset",
    "litdata": "litdata StreamingDataset + TokensLoader",
}
PEER_ROWS = HERE / "_loader_peers.py"


def log(message: str) -> None:
    print(f"[bench_loader] {message}", file=sys.stderr, flush=True)


def row(mode: str, cache: Path, **options: Any) -> dict[str, Any]:
    """Run one ``_loader_rows.py`` measurement in this venv."""
    cmd = [sys.executable, str(ROWS), mode, "--cache", str(cache), "--seq-len", str(SEQ_LEN)]
    for key, value in options.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return run_json(cmd)


def prepare_peers(python: str, cache: Path, tmp: Path) -> dict[str, Path | str]:
    """Write the samples in each peer's format; a peer that fails keeps its error instead of a path."""
    prepared: dict[str, Path | str] = {}
    for kind in PEERS:
        out = tmp / f"peer-{kind}"
        log(f"preparing the samples for {PEERS[kind]}")
        try:
            run_json(
                [python, str(PEER_ROWS), "prepare", "--kind", kind, "--cache", str(cache), "--out", str(out)]
            )
            prepared[kind] = out
        except RuntimeError as e:
            prepared[kind] = str(e).strip().splitlines()[-1][:120]
    return prepared


def make_cache(root: Path, gigabytes: float, shard_gb: float = 1.0) -> Path:
    """A synthetic cache of ``gigabytes`` GB in shards of about ``shard_gb`` GB."""
    tokens = int(gigabytes * 1e9) // 2
    log(f"writing a {gigabytes:g} GB synthetic cache in {root}")
    return write_random_cache(root, tokens, num_shards=max(1, round(gigabytes / shard_gb)))


Results = dict[tuple[str, int], dict[str, float]]


def measure_throughput(
    caches: dict[str, Path], batches: int, repeats: int, peers: dict[str, Path | str], peers_python: str
) -> Results:
    """Best samples/s and RssAnon of every row, for 0 and 2 workers.

    ``caches``: ``"1"`` the single-shard cache every row reads, ``"8"`` the 8-shard one of the same size.
    """
    kinds = [*KINDS, *(kind for kind, data in peers.items() if isinstance(data, Path))]
    kinds += [f"8:{kind}" for kind in SHARDED]
    results: Results = {}
    # Rounds over all rows rather than repeats of one row: a burst of load from other processes then
    # hurts one run of each row, and best-of-rounds discards it.
    for round_ in range(repeats):
        for workers in (0, 2):
            for kind in kinds:
                log(f"throughput round {round_ + 1}/{repeats}: {kind}, {workers} workers")
                shards, _, name = kind.rpartition(":")
                if name in KINDS:
                    cache = caches[shards or "1"]
                    result = row("throughput", cache, kind=name, workers=workers, batches=batches, repeats=3)
                else:
                    options = ["--kind", kind, "--data", str(peers[kind]), "--workers", str(workers)]
                    cmd = [peers_python, str(PEER_ROWS), "throughput", *options, "--batches", str(batches)]
                    result = run_json(cmd)
                best = results.setdefault((kind, workers), dict.fromkeys(result, 0.0))
                for key, value in result.items():
                    best[key] = max(best[key], value)
    return results


def limit_of(kind: str) -> str:
    """The row take a row is divided by: of the same out dtype, on the same cache."""
    if kind.startswith("8:"):
        return "8:rowtake"
    return "rowtake-cache" if kind in CACHE_DTYPE else "rowtake"


def throughput_table(results: Results, peers: dict[str, Path | str]) -> tuple[str, list[str]]:
    """The throughput table, each row divided by its row take and by nanoGPT, and the goal lines."""
    header = ["source", "samples/s, nw=0", "samples/s, nw=2", "÷ row take, nw=0", "÷ row take, nw=2"]
    header += [
        "÷ row take, nw=0, CPU s",
        "÷ nanoGPT, nw=0",
        "÷ nanoGPT, nw=2",
        "RssAnon, nw=0",
        "RssAnon, nw=2: main / worker",
    ]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]

    def rate(kind: str, workers: int) -> float:
        return results[kind, workers]["samples_per_s"]

    def per_cpu(kind: str) -> float:  # samples per CPU second, 0 workers: the read's own work
        return results[kind, 0]["cpu_samples_per_s"]

    labels = {**KINDS, **PEERS, **{f"8:{kind}": label for kind, label in SHARDED.items()}}
    for kind, label in labels.items():
        if (kind, 0) not in results:
            lines.append(f"| {label} | not run: {peers[kind]} |" + " |" * (len(header) - 2))
            continue
        cells = [f"{rate(kind, w):,.0f}" for w in (0, 2)]
        cells += [f"{rate(kind, w) / rate(limit_of(kind), w):.2f}" for w in (0, 2)]
        cells += [f"{per_cpu(kind) / per_cpu(limit_of(kind)):.2f}"]
        cells += [f"{rate(kind, w) / rate('nanogpt', w):.2f}" for w in (0, 2)]
        cells += [f"{results[kind, 0]['main_mb']:.0f} MB"]
        cells += [f"{results[kind, 2]['main_mb']:.0f} / {results[kind, 2]['worker_mb']:.0f} MB"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    goals = [
        goal(
            "Loader (int64) ÷ row take (int64), nw=0, per CPU s",
            per_cpu("loader") / per_cpu("rowtake"),
            ">=",
            0.9,
        ),
        goal(
            "Loader dtype=None ÷ row take of the cache dtype, nw=0, per CPU s",
            per_cpu("loader-uint16") / per_cpu("rowtake-cache"),
            ">=",
            0.9,
        ),
        goal(
            "streampack.torch.DataLoader ÷ row take in a torch DataLoader (int64), nw=2",
            rate("loader", 2) / rate("rowtake", 2),
            ">=",
            1.0,
        ),
    ]
    return "\n".join(lines), goals


def profile_section(caches: dict[str, Path], batches: int, top: int, results: Results) -> str:
    """The Loader rows (0 workers) under cProfile: top functions by own time, per row."""
    parts = [
        "numpy indexing and slicing are C code run by the function that indexes, not calls cProfile sees: a"
        " take or slice copy is the own time (tottime) of `_Copies.whole` / `_Copies.apply`; only `astype`"
        " and other ndarray methods are listed apart. The profiler adds its own cost to every Python call.",
    ]
    rows = [("1", kind, label) for kind, label in PROFILED.items()]
    rows.append(("8", "loader", SHARDED["loader"]))
    for shards, kind, label in rows:
        log(f"profile: {label}")
        found = row("profile", caches[shards], kind=kind, batches=batches, top=top)
        per_batch = found["seconds"] / found["batches"] * 1e6
        limit = "8:rowtake" if shards == "8" else limit_of(kind)
        take = BATCH / results[limit, 0]["samples_per_s"] * 1e6
        parts += [
            "",
            f"### {label}: {per_batch:.0f} µs per batch under the profiler ({found['batches']} batches;"
            f" its row take, unprofiled: {take:.0f} µs)",
            "",
            "```",
            found["profile"],
            "```",
        ]
    return "\n".join(parts)


def memory_table(caches: dict[float, Path], batches: int) -> tuple[str, list[str]]:
    peaks: dict[tuple[float, int], dict[str, Any]] = {}
    for gigabytes, cache in caches.items():
        for workers in (0, 2):
            log(f"RssAnon over {batches or 'a full epoch of'} batches, {gigabytes:g} GB, {workers} workers")
            epoch = (int(gigabytes * 1e9) // 2 - 1) // SEQ_LEN // BATCH
            peaks[gigabytes, workers] = row("rss", cache, workers=workers, batches=batches or epoch)
    lines = [
        "| cache | workers | batches read | main RssAnon peak | worker RssAnon peak (max) |",
        "|---|---:|---:|---:|---:|",
    ]
    for (gigabytes, workers), peak in peaks.items():
        worker = f"{peak['worker_mb']:.1f} MB" if workers else "-"
        lines.append(
            f"| {gigabytes:g} GB | {workers} | {peak['batches']:,} | {peak['main_mb']:.1f} MB | {worker} |"
        )
    small, big = min(caches), max(caches)
    goals = []
    for workers in (0, 2):
        for key in ("main_mb", "worker_mb") if workers else ("main_mb",):
            growth = peaks[big, workers][key] - peaks[small, workers][key]
            who = "main" if key == "main_mb" else "worker"
            goals.append(
                goal(f"{who} RssAnon {big:g} GB − {small:g} GB, nw={workers} (MB)", growth, "<=", 50)
            )
    return "\n".join(lines), goals


def first_batch_table(cache: Path, repeats: int) -> tuple[str, list[str]]:
    seconds: dict[tuple[int, int], float] = {}
    for workers in (0, 2):
        for step in (0, 10**6):
            log(f"first batch after load_state_dict at step {step:,}, {workers} workers")
            runs = [row("first-batch", cache, workers=workers, step=step)["seconds"] for _ in range(repeats)]
            seconds[step, workers] = statistics.median(runs)
    lines = [
        "| workers | step 0 | step 10^6 | ratio |",
        "|---:|---:|---:|---:|",
    ]
    goals = []
    for workers in (0, 2):
        zero, far = seconds[0, workers], seconds[10**6, workers]
        lines.append(f"| {workers} | {zero * 1e3:.1f} ms | {far * 1e3:.1f} ms | {far / zero:.2f} |")
        goals.append(goal(f"first batch at step 10^6 ÷ step 0, nw={workers}", far / zero, "<=", 2))
    return "\n".join(lines), goals


def main() -> None:
    parser = report_parser(__doc__, "loader", repeats=3, batches=400)
    parser.add_argument(
        "--peers-python",
        default=os.environ.get("STREAMPACK_PEERS_PYTHON")
        or str(REPO / ".bench-venv-loader" / "bin" / "python"),
        help="python of the peers' venv (default: $STREAMPACK_PEERS_PYTHON, else .bench-venv-loader)",
    )
    parser.add_argument("--skip-peers", action="store_true", help="skip HF datasets, mosaic and litdata")
    parser.add_argument(
        "--profile", action="store_true", help="also run the Loader rows (0 workers) under cProfile"
    )
    parser.add_argument("--profile-top", type=int, default=15, help="functions listed per profiled row")
    args = parser.parse_args()

    tmp = Path(args.tmp)
    sizes = (0.1, 0.4) if args.quick else (1.0, 8.0)
    need = sum(sizes) + 0.4
    free = shutil.disk_usage(tmp.parent if not tmp.exists() else tmp).free / 1e9
    if free < need * 1.5:
        sys.exit(f"bench_loader: needs ~{need:.1f} GB free under {tmp.parent}, has {free:.1f} GB; use --tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        throughput_cache = make_cache(tmp / "throughput", 0.2)
        sharded = {"1": throughput_cache, "8": make_cache(tmp / "throughput-8", 0.2, shard_gb=0.025)}
        for cache in sharded.values():
            warm(cache)
        batches = 200 if args.quick else args.batches
        peers: dict[str, Path | str] = {kind: "--skip-peers" for kind in PEERS}
        if not args.skip_peers and Path(args.peers_python).exists():
            peers = prepare_peers(args.peers_python, throughput_cache, tmp)
        elif not args.skip_peers:
            peers = {kind: f"no {args.peers_python}" for kind in PEERS}
        results = measure_throughput(sharded, batches, args.repeats, peers, args.peers_python)
        speed, speed_goals = throughput_table(results, peers)
        profiled = profile_section(sharded, batches, args.profile_top, results) if args.profile else ""
        starts, start_goals = first_batch_table(throughput_cache, args.repeats)
        caches = {size: make_cache(tmp / f"rss-{size:g}gb", size) for size in sizes}
        for cache in caches.values():
            warm(cache)
        memory, memory_goals = memory_table(caches, 2000 if args.quick else 0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    report = "\n".join(
        [
            "# Loader benchmark",
            "",
            f"Measured {environment()}; the machine is shared, so expect ±20 % between runs. Every row runs"
            " in its own process with OMP_NUM_THREADS=1 (torch's default threads slow the torch-based rows"
            " up to 10x on this loaded 2-core machine).",
            "",
            f"## Throughput: seq_len {SEQ_LEN} (+1), global batch 32, shuffled, 0.2 GB cache in page cache",
            "",
            speed,
            "",
            "÷ row take: by the row take of the same out dtype on the same cache (uint16 rows by the uint16"
            " take, the rest, peers included, by the int64 one; 8-shard rows by the take on that cache's"
            " first shard). With nw=2 the row take, gather and nanoGPT run in a plain torch DataLoader"
            ' (batch_size=None, 2 workers), the Loader in streampack.torch.DataLoader. "CPU s": samples per'
            " CPU second of the process (0 workers: the read's own work, which time slices lost to other"
            " processes do not count against; the nw=0 goals use it). RssAnon is read after the timed runs.",
            "",
            *(
                [
                    f"## Where the Loader's time goes (cProfile, 0 workers, {batches} batches)",
                    "",
                    profiled,
                    "",
                ]
                if profiled
                else []
            ),
            "## First batch after load_state_dict (fresh process, median)",
            "",
            starts,
            "",
            "## Anonymous memory per process over a full shuffled epoch"
            + (" (quick: 2,000 batches)" if args.quick else ""),
            "",
            memory,
            "",
            "## Goals",
            "",
            *speed_goals,
            *memory_goals,
            *start_goals,
            "",
        ]
    )
    publish(report, "loader", args)


if __name__ == "__main__":
    main()

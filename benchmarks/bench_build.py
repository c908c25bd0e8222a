"""Benchmark ``streampack build`` against the raw tokenizer limits and two peers, in one run.

Every row runs in its own subprocess, measured by :mod:`_measure` (wall time, peak RSS summed over the
process tree). Each tokenizer (the GPT-2 ``tokenizer.json``; the GPT-2 tiktoken ranks) is a group of four
rows: the *raw limit* of its own library (the baseline), the raw limit of the fast engine (``fastokens``)
on the same file, both measured in this run over the same texts already in memory (see
``_raw_limit.py``), ``streampack build --tokenizer-engine <its library>`` and ``streampack build`` with the
default ``auto`` engine. With ``--repeats N``, each repeat runs the group's rows once each, starting one row
later every time; the table shows the median run of each row and its ratios are the medians of the N
per-repeat ratios. The auto build also runs at the larger ``--scale`` multiples (peak RSS growth).

Then the groups of :mod:`_build_groups`, each paired and rotated the same way: the same texts in every
input format ÷ the plain JSONL's build (``--formats``), builds with the cl100k_base and o200k_base ranks ÷
the GPT-2 ranks' build (``--encodings``), and a build from a plain ``pip install .`` ÷ both raw limits
(``--plain-venv``, ``--skip-plain``).

Usage::

    python benchmarks/bench_build.py --corpus natural.jsonl [--scale 1,4]
        [--quick] [--skip-peers] [--repeats N] [--backends LIST|none] [--formats LIST|all|none]
        [--encodings LIST|all|none] [--skip-plain] [--plain-venv DIR] [--plain-scale 1,4]

Prints a markdown table and writes it to ``benchmarks/results/build.md`` (``build-quick.md`` with
``--quick``). See ``benchmarks/README.md`` for what each row means.
"""

from __future__ import annotations

import argparse
import compileall
import datetime
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import orjson
import psutil
from _backends import TIKTOKEN_GPT2, TOKENIZERS_GPT2, head_lines
from _build_groups import ENCODINGS, FORMATS, measure_encodings, measure_formats, measure_plain, parse_list
from _build_rows import (
    AUTO,
    BACKENDS,
    BUILD,
    FAST_AS_BUILT,
    FAST_RAW,
    GIGA_RAW,
    GIGATOKEN_BUILD,
    HERE,
    KIND,
    NO_ENGINE,
    PIECES,
    RAW,
    REPO,
    Cli,
    Corpus,
    Row,
    failed,
    log,
    median_of,
    raw_limit,
    stage_cpu,
    streampack_build,
    streampack_cli,
)
from _measure import run

RSS_GOAL_MB = 1024.0
RATIO_GOAL = 0.95
AUTO_GOAL = {"tokenizers": 10.0, "tiktoken": 5.0}  # auto build ÷ the tokenizer's own library's raw limit
FAST_RATIO_GOAL = 0.8  # auto build ÷ the fast engine's raw limit on the same texts, steady state (4x)
FAST_RATIO_GOAL_FIRST = 0.7  # the same at 1x, where the start-up is not amortised (issue 26)
RSS_SCALE_GOAL = 1.1


def rotated(repeats: int, runners: dict[str, Callable[[], Row]]) -> list[Row]:
    """Run every row of a group once per repeat, each repeat starting one row later; medians of ratios.

    A repeat's rows run back to back, so a burst of load from other jobs on the shared machine slows the
    two sides of that repeat's ratios rather than one side of every ratio; rotating the order makes a
    machine that speeds up or slows down over the run favour no row. ``runners`` must hold :data:`RAW`;
    every other row gets its ratio to it, and the builds their ratio to :data:`FAST_RAW` too.
    """
    names = list(runners)
    runs: dict[str, list[Row]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in names}
    fast_ratios: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        done = {name: runners[name]() for name in names[i % len(names) :] + names[: i % len(names)]}
        base, fast = done[RAW].tokens_per_s, done[FAST_RAW].tokens_per_s if FAST_RAW in done else None
        for name, row in done.items():
            runs[name].append(row)
            tps = row.tokens_per_s
            if name != RAW and tps and base:
                ratios[name].append(tps / base)
            if name.startswith(BUILD) and tps and fast:
                fast_ratios[name].append(tps / fast)
    out = []
    for name in names:
        row = median_of(runs[name])
        row.ratio = _median_noted(row, ratios[name], "÷ raw limit")
        row.fast_ratio = _median_noted(row, fast_ratios[name], "÷ fast engine's raw limit")
        out.append(row)
    return out


def _median_noted(row: Row, values: list[float], what: str) -> float | None:
    """The median of ``values`` (``None`` if empty), all of which the row's note lists when more than one."""
    if len(values) > 1:
        row.note += f"; {what} per repeat {', '.join(f'{v:.3f}' for v in values)}"
    return statistics.median(values) if values else None


# --- inputs ---------------------------------------------------------------------------------------


def describe(path: str) -> Corpus:
    """Count documents and text bytes of a JSONL corpus."""
    docs, text_bytes = 0, 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                docs += 1
                text_bytes += len(orjson.loads(line)["text"].encode())
    return Corpus(path, docs, text_bytes / 1e6, os.path.getsize(path) / 1e6)


def scale_corpus(corpus: Corpus, times: int, tmp: Path) -> Corpus:
    """Write ``corpus`` concatenated ``times`` times under ``tmp`` (a newline ensured between copies)."""
    dst = tmp / f"corpus-x{times}.jsonl"
    with open(dst, "wb") as fout:
        for _ in range(times):
            with open(corpus.path, "rb") as fin:
                shutil.copyfileobj(fin, fout, 16 * 1024 * 1024)
                fin.seek(-1, os.SEEK_END)
                if fin.read(1) != b"\n":
                    fout.write(b"\n")
    return Corpus(str(dst), corpus.docs * times, corpus.text_mb * times, corpus.file_mb * times)


# --- rows -----------------------------------------------------------------------------------------


def peer(
    method: str, backend: str, script: str, corpus: Corpus, python: str, tmp: Path, out_name: str
) -> Row:
    """Run one peer worker in the bench venv, with every Hugging Face cache under ``tmp``."""
    row = Row(method, backend, backend, corpus.text_mb)
    work = Path(tempfile.mkdtemp(prefix="peer-", dir=tmp))
    env = {
        "HF_HOME": str(work / "hf-home"),
        "HF_DATASETS_CACHE": str(work / "hf-datasets"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    try:
        m = run([python, str(HERE / script), "--corpus", corpus.path, "--out", str(work / out_name)], env=env)
        if m.returncode != 0:
            return failed(row, m)
        row.tokens = int(json.loads(m.stdout.strip().splitlines()[-1])["num_tokens"])
        row.wall_s, row.peak_rss_mb = m.wall_s, m.peak_rss_mb
        row.note = f"{row.tokens / 1e6:.1f} M tokens"
        return row
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --- report ---------------------------------------------------------------------------------------


def fmt(value: float | None, spec: str) -> str:
    """Format a number, or an en dash for a row that did not run."""
    return "–" if value is None else format(value, spec)


def seconds(value: float | None) -> str:
    """Seconds to one decimal, or two below 10 s (a fast engine's raw limit takes ~2 s on the full corpus)."""
    return fmt(value, ".2f" if value is not None and value < 10 else ".1f")


def render(rows: list[Row], header: list[str], cli: Cli) -> str:
    """The markdown report: header lines, the table, the goals checked against it, the stage tables."""
    raw = {r.backend: r.tokens_per_s for r in rows if r.method == RAW}
    fast = {(r.backend, r.scale): r.tokens_per_s for r in rows if r.method == FAST_RAW}
    lines = [*header, ""]
    lines.append(
        "| method | tokenizer | engine | input MB | wall s | build s, own timer | M tokens/s "
        "| ÷ raw limit | ÷ fast engine's raw limit | peak RSS MB (tree) | note |"
    )
    lines.append("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        tps = r.tokens_per_s
        lines.append(
            f"| {r.method} | {KIND[r.backend]} | {r.engine} | {r.input_mb:.0f} | {seconds(r.wall_s)} "
            f"| {seconds(r.build_s)} | {fmt(None if tps is None else tps / 1e6, '.2f')} "
            f"| {fmt(ratio_to(r, raw), '.2f')} | {fmt(fast_ratio_to(r, fast), '.2f')} "
            f"| {fmt(r.peak_rss_mb, '.0f')} | {r.note} |"
        )
    lines += ["", *goals(rows, raw, fast), *stage_sections(rows, cli)]
    return "\n".join(lines) + "\n"


def ratio_to(row: Row, raw: dict[str, float | None]) -> float | None:
    """The row's ratio to its group's raw limit: the median of its repeats, else from the median runs."""
    if row.ratio is not None:
        return row.ratio
    tps, base = row.tokens_per_s, raw.get(row.backend)
    return tps / base if tps and base else None


def fast_ratio_to(row: Row, fast: dict[tuple[str, int], float | None]) -> float | None:
    """A build's ratio to the fast engine's raw limit on the same tokenizer and texts (``None`` for other
    rows, and for a scale whose limit was not measured)."""
    if row.fast_ratio is not None or not row.method.startswith(BUILD):
        return row.fast_ratio
    tps, base = row.tokens_per_s, fast.get((row.backend, row.scale))
    return tps / base if tps and base else None


def goals(
    rows: list[Row], raw: dict[str, float | None], fast: dict[tuple[str, int], float | None]
) -> list[str]:
    """Check the streampack rows against issue 14's goals, group by group."""
    out = ["Goals for `streampack build` (issue 14):", ""]
    for backend in BACKENDS:
        group = [r for r in rows if r.backend == backend and r.wall_s is not None]
        if not group:
            out.append(f"- {KIND[backend]}: not measured")
            continue
        out += group_goals(backend, group, raw, fast)
    return out


def group_goals(
    backend: str, group: list[Row], raw: dict[str, float | None], fast: dict[tuple[str, int], float | None]
) -> list[str]:
    """The goal lines of one tokenizer: the ratios of both builds, equal tokens, peak RSS and its growth."""
    kind = KIND[backend]
    first = min(r.scale for r in group)
    ref = next((r for r in group if r.method == BUILD and r.scale == first), None)
    auto = next((r for r in group if r.method == AUTO and r.scale == first), None)
    fast_raw = next((r for r in group if r.method == FAST_RAW), None)
    out = []
    ratio = None if ref is None else ratio_to(ref, raw)
    if ratio is not None:
        what = f"{kind}: build --tokenizer-engine {backend} ÷ {backend} raw limit at {first}x"
        out.append(_goal(what, ratio, "≥", RATIO_GOAL))
    pieces = next((r for r in group if r.method == PIECES), None)
    if ref is not None and pieces is not None and pieces.tokens_per_s and ref.tokens_per_s:
        out.append(
            f"- {kind}: build --tokenizer-engine {backend} / raw call over the build's pieces at {first}x: "
            f"{ref.tokens_per_s / pieces.tokens_per_s:.2f} (what reading, framing and writing cost; no goal)"
        )
    if auto is not None:
        engine = auto.engine.removeprefix("auto → ")
        ratio, fast_ratio = ratio_to(auto, raw), fast_ratio_to(auto, fast)
        if ratio is not None:
            what = f"{kind}: auto build ({engine}) ÷ {backend} raw limit at {first}x"
            out.append(_goal(what, ratio, "≥", AUTO_GOAL[backend]))
        if fast_ratio is not None:
            what = f"{kind}: auto build ({engine}) ÷ fastokens raw limit at {first}x"
            out.append(_goal(what, fast_ratio, "≥", FAST_RATIO_GOAL_FIRST))
        base = fast.get((backend, first))
        if auto.build_s and auto.tokens and base:
            out.append(
                f"- {kind}: the same, in the build's own seconds ({auto.build_s:.1f} s of "
                f"{auto.wall_s:.1f} s wall: no interpreter start-up or imports; median run): "
                f"{auto.tokens / auto.build_s / base:.2f} (no goal)"
            )
    if fast_raw is not None and fast_raw.tokens_per_s and raw.get(backend):
        speedup = ratio_to(fast_raw, raw) or 0.0
        out.append(
            f"- {kind}: fastokens raw limit ÷ {backend} raw limit: {speedup:.1f} (the engine's; no goal)"
        )
    out += same_tokens(kind, group)
    builds = [r for r in group if r.method.startswith(BUILD)]
    if builds:
        peak = max(r.peak_rss_mb or 0.0 for r in builds)
        out.append(_goal(f"{kind}: max peak RSS MB of the builds", peak, "≤", RSS_GOAL_MB))
    for steady in (r for r in group if r.method == AUTO and r.scale > first):
        ratio = fast_ratio_to(steady, fast)
        if ratio is not None:
            what = f"{kind}: auto build ÷ fastokens raw limit at {steady.scale}x, same texts (steady state)"
            out.append(_goal(what, ratio, "≥", FAST_RATIO_GOAL))
        as_built = next((r for r in group if r.method == FAST_AS_BUILT and r.scale == steady.scale), None)
        if as_built is not None and as_built.build_over is not None:
            ratio = as_built.build_over
            out.append(
                f"- {kind}: the same ÷ fastokens called as the build calls it (two one-thread calls at once, "
                f"1 MiB batches; its fastest way here) at {steady.scale}x: {ratio:.2f} (no goal)"
            )
        bare = next((r for r in group if r.method == NO_ENGINE and r.scale == steady.scale), None)
        out += cpu_bound(kind, steady, bare, fast.get((backend, steady.scale)))
    scaled = {r.scale: r for r in group if r.method == AUTO}
    small, big = scaled.get(min(scaled, default=0)), scaled.get(max(scaled, default=0))
    if small is not None and big is not None and big is not small and small.peak_rss_mb and big.peak_rss_mb:
        growth = big.peak_rss_mb / small.peak_rss_mb
        what = f"{kind}: auto build peak RSS {big.scale}x / {small.scale}x"
        out.append(_goal(what, growth, "≤", RSS_SCALE_GOAL))
    return out


def cpu_bound(kind: str, build: Row, bare: Row | None, fast_tps: float | None) -> list[str]:
    """What the build's CPU allows on this machine's cores: its processes' CPU seconds (``--profile``, the
    median run) spread over every core at once is the least wall time it can take, whatever its threads
    overlap; that bound against the fast engine's raw limit, and how much of the CPU lies outside the engine
    (the build without its engine)."""
    cpu, cores = stage_cpu(build.stages, "all processes"), os.cpu_count() or 1
    if cpu is None or not build.tokens or not fast_tps:
        return []
    least = cpu / cores
    bare_cpu = None if bare is None else stage_cpu(bare.stages, "all processes")
    outside = (
        ""
        if bare_cpu is None or bare is None
        else (
            f"; the build without its engine (its calls stubbed, no check) took {bare_cpu:.1f} CPU s and "
            f"{seconds(bare.wall_s)} s wall"
        )
    )
    return [
        f"- {kind}: CPU at {build.scale}x: the build's processes took {cpu:.1f} CPU s (`--profile`, its "
        f"median run){outside}; on {cores} cores a build of {cpu:.1f} CPU s takes at least {least:.2f} s: "
        f"at most {build.tokens / least / fast_tps:.2f} of the fast engine's raw limit (a bound; no goal)"
    ]


def same_tokens(kind: str, group: list[Row]) -> list[str]:
    """Whether the engines gave as many tokens: the two raw limits, and the two builds at the same scale."""
    pairs = []
    for a, b in ((RAW, FAST_RAW), (BUILD, AUTO)):
        first = min((r.scale for r in group if r.method in (a, b)), default=1)
        found = [next((r for r in group if r.method == m and r.scale == first), None) for m in (a, b)]
        if found[0] is not None and found[1] is not None:
            pairs.append((found[0], found[1]))
    if not pairs:
        return []
    met = all(x.tokens == y.tokens for x, y in pairs)
    counts = "; ".join(f"{x.method} {x.tokens:,}, {y.method} {y.tokens:,}" for x, y in pairs)
    return [f"- {kind}: same token counts whatever the engine: {counts} — {'met' if met else '**not met**'}"]


def stage_sections(rows: list[Row], cli: Cli) -> list[str]:
    """A section per tokenizer with the stage table of its auto build's median run (``build --profile``)."""
    out = []
    for backend in BACKENDS:
        auto = sorted((r for r in rows if r.method == AUTO and r.backend == backend), key=lambda r: r.scale)
        if not auto or auto[0].wall_s is None:
            continue
        out += ["", f"## Stages of the auto build ({KIND[backend]}, {auto[0].scale}x)", ""]
        if auto[0].stages:
            out += auto[0].stages
        elif cli.profile:
            out.append("The build printed no stage table (no line starting `| stage |`).")
        else:
            out.append("No stage table: this `streampack build` has no `--profile` option yet.")
    return out


def _goal(what: str, value: float, op: str, target: float) -> str:
    passed = value >= target if op == "≥" else value <= target
    shown = f"{value:.0f}" if value >= 100 else f"{value:.2f}"
    return f"- {what}: {shown} (goal {op} {target:g}) — {'met' if passed else '**not met**'}"


def version_of(python: str, module: str) -> str:
    """``module.__version__`` as seen by ``python``, or ``?``."""
    probe = subprocess.run(
        [python, "-c", f"import {module}; print({module}.__version__)"], capture_output=True, text=True
    )
    return probe.stdout.strip() or "?"


# --- main -----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True, help="JSONL file with a `text` field per line")
    parser.add_argument("--scale", default="1,4", help="corpus multiples for the auto build (default 1,4)")
    parser.add_argument("--quick", action="store_true", help="use only the first --quick-mb of the corpus")
    parser.add_argument("--quick-mb", type=float, default=30.0)
    parser.add_argument("--skip-peers", action="store_true", help="skip the slow datasets-based peers")
    parser.add_argument(
        "--backends",
        default=",".join(BACKENDS),
        help="tokenizer groups to run, a comma-separated subset of tokenizers (tokenizer.json), tiktoken "
        "(ranks), or none",
    )
    parser.add_argument(
        "--formats",
        default="all",
        help=f"input formats beside plain JSONL: a subset of {','.join(FORMATS)}, all (default) or none",
    )
    parser.add_argument(
        "--encodings",
        default="all",
        help=f"tiktoken ranks beside GPT-2's: a subset of {','.join(ENCODINGS)}, all (default) or none",
    )
    parser.add_argument("--skip-plain", action="store_true", help="skip the plain-install rows")
    parser.add_argument(
        "--plain-scale", default="1", help="corpus multiples of the plain-install rows (default 1; e.g. 1,4)"
    )
    parser.add_argument(
        "--plain-venv",
        default=str(REPO / ".bench-plain-venv"),
        help="venv of the plain install (`pip install .`, no extras), created if absent",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds of each group's four 1x rows (medians reported)"
    )
    parser.add_argument(
        "--tmp",
        default=os.path.join(tempfile.gettempdir(), "streampack-bench"),
        help="scratch space, cleaned up afterwards",
    )
    parser.add_argument(
        "--bench-python",
        default=os.environ.get("STREAMPACK_PEERS_PYTHON") or str(REPO / ".bench-venv" / "bin" / "python"),
        help="python of the peers' venv (default: $STREAMPACK_PEERS_PYTHON, else .bench-venv in the project)",
    )
    parser.add_argument("--tokenizer-json", default=TOKENIZERS_GPT2)
    parser.add_argument("--tiktoken-ranks", default=TIKTOKEN_GPT2)
    parser.add_argument("--out", help="report file (default benchmarks/results/build[-quick].md)")
    parser.add_argument(
        "--build-args",
        default="",
        help="more arguments for every `streampack build`, e.g. '--bos-id 50256' (split at spaces)",
    )
    args = parser.parse_args()
    args.scales = sorted({int(s) for s in args.scale.split(",")})
    if not args.scales or min(args.scales) < 1:
        parser.error(f"--scale takes positive integers like 1,4 (got {args.scale!r})")
    args.plain_scales = sorted({int(s) for s in args.plain_scale.split(",")})
    if not args.plain_scales or min(args.plain_scales) < 1:
        parser.error(f"--plain-scale takes positive integers like 1,4 (got {args.plain_scale!r})")
    try:
        args.backend_list = parse_list(args.backends, BACKENDS, "--backends")
        args.format_list = parse_list(args.formats, FORMATS, "--formats")
        args.encoding_list = parse_list(args.encodings, ENCODINGS, "--encodings")
    except ValueError as e:
        parser.error(str(e))
    return args


def measure_group(
    backend: str, args: argparse.Namespace, cli: Cli, corpus: Corpus, scaled: dict[int, Corpus], tmp: Path
) -> list[Row]:
    """One tokenizer's rows: both raw limits and both builds, rotated; then the pieces and scale rows."""
    spec = args.tokenizer_json if backend == "tokenizers" else f"tiktoken:{args.tiktoken_ranks}"
    source = args.tokenizer_json if backend == "tokenizers" else args.tiktoken_ranks
    first = args.scales[0]
    for scale in args.scales:
        if scale not in scaled:
            scaled[scale] = scale_corpus(corpus, scale, tmp)

    def build_once(auto: bool, scale: int = first, engine: str | None = None) -> Row:
        out = tmp / "streampack-out"
        extra = args.build_args.split()
        return streampack_build(
            cli, backend, spec, scaled[scale], scale, out, auto=auto, extra=extra, engine=engine
        )

    log(f"{KIND[backend]}: raw limits and streampack builds at {first}x, {args.repeats} repeat(s)")
    rows = rotated(
        args.repeats,
        {
            RAW: lambda: raw_limit(backend, corpus, source),
            FAST_RAW: lambda: raw_limit(backend, corpus, source, fast=True),
            GIGA_RAW: lambda: raw_limit(backend, corpus, source, giga=True),
            BUILD: lambda: build_once(auto=False),
            GIGATOKEN_BUILD: lambda: build_once(auto=False, engine="gigatoken"),
            AUTO: lambda: build_once(auto=True),
        },
    )
    if backend == "tokenizers":  # the build cuts documents into pieces, which encode faster
        log(f"reference: raw call over the build's pieces, {backend}")
        rows.append(raw_limit(backend, corpus, source, pieces=True))
    for scale in args.scales[1:]:  # larger corpora: the steady state, and peak RSS against corpus size
        log(f"streampack build, auto engine, and the fast engine's raw limits, {KIND[backend]}, {scale}x")
        build = functools.partial(build_once, auto=True, scale=scale)
        limit = functools.partial(_scaled_raw_limit, backend, scaled[scale], source, scale)
        as_built = functools.partial(_scaled_raw_limit, backend, scaled[scale], source, scale, as_built=True)
        bare = functools.partial(_build_without_engine, cli, backend, spec, scaled[scale], scale, tmp)
        rows += paired(args.repeats, build, limit, as_built, bare)
    return rows


def _build_without_engine(cli: Cli, backend: str, spec: str, corpus: Corpus, scale: int, tmp: Path) -> Row:
    """The build with its engine's calls stubbed (``_build_without_engine.py``): what the rest of it costs.
    Its ids are not the tokenizer's, so it shows no tokens per second."""
    bare = Cli([sys.executable, str(HERE / "_build_without_engine.py")], cli.why_not, cli.profile)
    out = tmp / "streampack-out"
    unchecked = ["--verify-tokens", "none"]
    row = streampack_build(bare, backend, spec, corpus, scale, out, auto=True, extra=unchecked)
    row.method, row.engine, row.tokens = NO_ENGINE, "none (ids stubbed)", None
    cpu = fmt(stage_cpu(row.stages, "all processes"), ".2f")
    row.note = f"{scale}x corpus; fastokens' calls give zeros, no sampled check; {cpu} CPU s (all processes)"
    return row


def _scaled_raw_limit(backend: str, corpus: Corpus, source: str, scale: int, as_built: bool = False) -> Row:
    row = raw_limit(backend, corpus, source, fast=True, as_built=as_built)
    row.scale = scale
    return row


def paired(
    repeats: int,
    build: Callable[[], Row],
    fast_raw: Callable[[], Row],
    as_built: Callable[[], Row],
    without_engine: Callable[[], Row],
) -> list[Row]:
    """A build, the fast engine's raw limit on the same texts, the engine called as the build calls it and
    the build without its engine, in turn (each repeat starting one later); the build's ratios to the
    second and third, the medians of the per-repeat ratios (the second in the note of the engine's row as
    the build calls it)."""
    runners = (build, fast_raw, as_built, without_engine)
    runs: list[list[Row]] = [[] for _ in runners]
    ratios: list[list[float]] = [[], []]
    for i in range(repeats):
        order = [(i + k) % len(runners) for k in range(len(runners))]
        done = dict(zip(order, [runners[j]() for j in order]))
        for j, run_rows in enumerate(runs):
            run_rows.append(done[j])
        b = done[0].tokens_per_s
        for j in (1, 2):
            other = done[j].tokens_per_s
            if b and other:
                ratios[j - 1].append(b / other)
    row, limit, engine, bare = (median_of(r) for r in runs)
    row.fast_ratio = _median_noted(row, ratios[0], "÷ fast engine's raw limit on the same texts")
    engine.build_over = _median_noted(engine, ratios[1], "the build ÷ this")
    return [row, limit, engine, bare]


def measure_peers(args: argparse.Namespace, corpus: Corpus, tmp: Path) -> list[Row]:
    """The two peers' rows (or rows saying why they did not run)."""
    peers = [
        ("seed's recipe (HF datasets map)", "tokenizers", "_peer_hf_recipe.py", "saved"),
        ("nanoGPT prepare.py (memmap .bin)", "tiktoken", "_peer_nanogpt.py", "train.bin"),
    ]
    rows = []
    for method, backend, script, out_name in peers:
        if args.skip_peers or not Path(args.bench_python).exists():
            reason = "--skip-peers" if args.skip_peers else f"no bench venv at {args.bench_python}"
            rows.append(Row(method, backend, backend, corpus.text_mb, note=f"not run: {reason}"))
            continue
        log(f"peer: {method}")
        rows.append(peer(method, backend, script, corpus, args.bench_python, tmp, out_name))
    return rows


def compile_package() -> None:
    """Write the package's bytecode, as ``pip install`` does: an editable install under
    ``PYTHONDONTWRITEBYTECODE=1`` would otherwise compile every module again in every build process
    (~0.09 s of its start-up here), a cost no installed package pays."""
    compileall.compile_dir(REPO / "streampack", quiet=1)


def report_header(args: argparse.Namespace, corpus: Corpus, load_at_start: tuple[float, ...]) -> list[str]:
    """The report's title, baselines and run details."""
    bench_py = args.bench_python if Path(args.bench_python).exists() else sys.executable
    return [
        "# streampack build benchmark",
        "",
        "**Baseline (÷ raw limit = 1.00): the raw limit** of each tokenizer's own library, measured in this "
        "run — its fastest batch-encode call over the same texts already in memory (`tokenizers` "
        "`encode_batch_fast` for the `tokenizer.json`, `tiktoken` `encode_ordinary_batch(num_threads=cores)` "
        "for the ranks, batches of 1000 docs), timing the encode calls only. **The fast engine's raw limit** "
        "is the same for `fastokens` on the same file (`encode_batch_flat`, special tokens as text); at "
        "each larger scale it is measured again on the larger corpus, in turn with the build (its own "
        "start-up amortised too: the steady state). "
        "Every other row is the wall time of a whole subprocess (start-up, reading, writing included); "
        "*build s, own timer* is the time the build prints in its summary line (`built …, X s`), which "
        "leaves out the interpreter's start-up and imports but not loading the tokenizer.",
        "",
        f"- run: {datetime.datetime.now():%Y-%m-%d %H:%M}, `{' '.join(['bench_build.py', *sys.argv[1:]])}`",
        f"- corpus: `{args.corpus}`{' (quick: first lines only)' if args.quick else ''}, {corpus.docs} docs, "
        f"{corpus.text_mb:.1f} MB of text, {corpus.file_mb:.1f} MB of JSONL",
        f"- machine: {psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
        f"{platform.python_implementation()} {platform.python_version()}, "
        "the package's bytecode compiled before the first build (as an installed package has it), "
        f"load average at start {load_at_start[0]:.2f} / end {os.getloadavg()[0]:.2f} (1 min)",
        f"- versions: tokenizers {version_of(sys.executable, 'tokenizers')}, "
        f"tiktoken {version_of(sys.executable, 'tiktoken')}, fastokens {fastokens_version()}, "
        f"datasets {version_of(bench_py, 'datasets')}",
        "- input MB = text bytes / 10^6; M tokens/s = output tokens / wall s; "
        "peak RSS = max over 50 ms samples of RSS summed over the process tree (MiB); "
        f"{args.repeats} repeat(s) of each group's four 1x rows in rotated order, ratios = medians of the "
        "per-repeat ratios",
    ]


def fastokens_version() -> str:
    """The installed fastokens version, or ``not installed``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fastokens")
    except PackageNotFoundError:
        return "not installed"


def main() -> None:
    args = parse_args()
    load_at_start = os.getloadavg()
    report = Path(args.out or HERE / "results" / ("build-quick.md" if args.quick else "build.md"))

    Path(args.tmp).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-build-", dir=args.tmp))
    compile_package()
    try:
        source = args.corpus
        if args.quick:
            source = head_lines(args.corpus, tmp / "quick.jsonl", int(args.quick_mb * 1e6))
        corpus = describe(source)
        log(f"corpus {corpus.path}: {corpus.docs} docs, {corpus.text_mb:.0f} MB of text")
        cli = streampack_cli()
        if not cli.profile:
            log("`streampack build --help` lists no --profile: no stage tables")
        # Each group's raw limits run among its builds, so that the two sides of a ratio are measured
        # seconds apart, not across the whole run (the machine is shared).
        scaled: dict[int, Corpus] = {1: corpus}
        rows: list[Row] = []
        for backend in args.backend_list:
            rows += measure_group(backend, args, cli, corpus, scaled, tmp)
        for scale, big in scaled.items():
            if scale != 1:
                Path(big.path).unlink()
        if args.backend_list:
            rows += measure_peers(args, corpus, tmp)
        sections: list[str] = []
        if args.format_list:
            sections += measure_formats(args, cli, corpus, tmp, args.format_list)
        if args.encoding_list:
            sections += measure_encodings(args, cli, corpus, tmp, args.encoding_list)
        if not args.skip_plain:
            for scale in args.plain_scales:
                plain_corpus = corpus if scale == 1 else scale_corpus(corpus, scale, tmp)
                sections += measure_plain(args, plain_corpus, tmp, scale)
                if scale != 1:
                    Path(plain_corpus.path).unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    header = report_header(args, corpus, load_at_start)
    text = render(rows, header, cli) if rows else "\n".join(header) + "\n"
    text += "\n".join(sections) + ("\n" if sections else "")
    print(text)
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(text)
    log(f"wrote {report}")


if __name__ == "__main__":
    main()

"""Benchmark ``streampack build`` against the raw tokenizer limits and two peers, in one run.

Every row runs in its own subprocess, measured by :mod:`_measure` (wall time, peak RSS summed over the
process tree). Each tokenizer (the GPT-2 ``tokenizer.json``; the GPT-2 tiktoken ranks) is a group of four
rows: the *raw limit* of its own library (the baseline), the raw limit of the fast engine (``fastokens``)
on the same file, both measured in this run over the same texts already in memory (see
``_raw_limit.py``), ``streampack build --tokenizer-engine <its library>`` and ``streampack build`` with the
default ``auto`` engine. With ``--repeats N``, each repeat runs the group's rows once each, starting one row
later every time; the table shows the median run of each row and its ratios are the medians of the N
per-repeat ratios. The auto build also runs at the larger ``--scale`` multiples (peak RSS growth).

Usage::

    python benchmarks/bench_build.py --corpus natural.jsonl [--scale 1,4]
        [--quick] [--skip-peers] [--repeats N]

Prints a markdown table and writes it to ``benchmarks/results/build.md`` (``build-quick.md`` with
``--quick``). See ``benchmarks/README.md`` for what each row means.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import psutil
from _backends import TIKTOKEN_GPT2, TOKENIZERS_GPT2, head_lines
from _measure import Measurement, run

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BACKENDS = ("tokenizers", "tiktoken")  # a group per tokenizer kind, named after its own library
KIND = {"tokenizers": "tokenizer.json", "tiktoken": "tiktoken ranks"}
FAST_WORKER = {"tokenizers": "fastokens-json", "tiktoken": "fastokens-tiktoken"}  # _raw_limit.py --backend
RAW = "raw limit (baseline)"
FAST_RAW = "raw limit of the fast engine"
PIECES = "reference: raw call over the build's pieces"
BUILD = "streampack build"  # --tokenizer-engine <the tokenizer's own library>
AUTO = "streampack build, auto engine"  # no --tokenizer-engine: the default
RSS_GOAL_MB = 1024.0
RATIO_GOAL = 0.95
AUTO_GOAL = {"tokenizers": 10.0, "tiktoken": 5.0}  # auto build ÷ the tokenizer's own library's raw limit
FAST_RATIO_GOAL = 0.8  # auto build ÷ the fast engine's raw limit
RSS_SCALE_GOAL = 1.1
BUILT_SECONDS = re.compile(r"^built .*, ([0-9.]+) s\b")  # the build's summary line


@dataclass
class Row:
    """One line of the table; ``wall_s``/``tokens``/``peak_rss_mb`` stay ``None`` for a row not run."""

    method: str
    backend: str  # the group: the tokenizer's own library (tokenizers: tokenizer.json, tiktoken: ranks)
    engine: str  # what computed the ids
    input_mb: float
    wall_s: float | None = None
    tokens: int | None = None
    peak_rss_mb: float | None = None
    note: str = ""
    scale: int = 1
    build_s: float | None = None  # a build's own timer, from its summary line: no interpreter start-up
    stages: list[str] = field(default_factory=list)  # a build's --profile table, markdown lines
    ratio: float | None = None  # ÷ the group's raw limit: the median of the per-repeat ratios
    fast_ratio: float | None = None  # ÷ the fast engine's raw limit, likewise

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per wall second, or ``None`` if the row did not run."""
        if self.wall_s is None or self.tokens is None:
            return None
        return self.tokens / self.wall_s


@dataclass(frozen=True)
class Corpus:
    """A JSONL input file and the size of its ``text`` fields."""

    path: str
    docs: int
    text_mb: float  # UTF-8 bytes of the text fields, in 10**6 bytes
    file_mb: float


@dataclass(frozen=True)
class Cli:
    """How to run ``streampack``, and what this version of it can do."""

    prefix: list[str]
    why_not: str  # why it cannot run yet, else ""
    profile: bool  # `build --help` lists --profile (the stage table)


def failed(row: Row, m: Measurement) -> Row:
    """Mark ``row`` as failed with the last line of the command's stderr."""
    tail = (m.stderr.strip().splitlines() or ["(no stderr)"])[-1]
    row.note = f"failed (exit {m.returncode}): {tail[:160]}"
    row.peak_rss_mb = m.peak_rss_mb
    return row


def median_of(rows: list[Row]) -> Row:
    """The run of median wall time among the successful ``rows``, with the largest peak RSS of them all.

    The largest peak RSS is the conservative figure to check a memory goal against.
    """
    ok = sorted((r for r in rows if r.wall_s is not None), key=lambda r: r.wall_s or 0.0)
    if not ok:
        return rows[-1]
    median = ok[(len(ok) - 1) // 2]
    median.peak_rss_mb = max(r.peak_rss_mb or 0.0 for r in ok)
    if len(rows) > 1:
        median.note += f"; median of {len(ok)} runs"
    return median


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


def log(msg: str) -> None:
    """Progress goes to stderr so the table on stdout stays clean."""
    print(f"[bench_build {datetime.datetime.now():%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


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


def raw_limit(
    backend: str, corpus: Corpus, tokenizer: str, *, fast: bool = False, pieces: bool = False
) -> Row:
    """Raw limit: encode-only seconds of a batch call, texts loaded first.

    ``backend`` names the group; ``fast``: the fast engine's call on the same tokenizer file rather than
    the group's own library's (the baseline). With ``pieces``, a reference row rather than the baseline:
    the texts cut as the build cuts them.
    """
    worker = FAST_WORKER[backend] if fast else backend
    method = FAST_RAW if fast else PIECES if pieces else RAW
    row = Row(method, backend, "fastokens" if fast else backend, corpus.text_mb)
    cmd = [sys.executable, str(HERE / "_raw_limit.py"), "--backend", worker, "--corpus", corpus.path]
    m = run([*cmd, "--tokenizer", tokenizer, *(["--build-pieces"] if pieces else [])])
    if m.returncode != 0:
        return failed(row, m)
    out = json.loads(m.stdout.strip().splitlines()[-1])
    row.wall_s, row.tokens, row.peak_rss_mb = out["encode_s"], out["num_tokens"], m.peak_rss_mb
    row.note = f"{row.tokens / 1e6:.1f} M tokens; encode calls only (process wall {m.wall_s:.1f} s)"
    return row


def streampack_cli() -> Cli:
    """How to run streampack, why it cannot run yet (else ""), whether it has ``build --profile``."""
    exe = Path(sys.executable).with_name("streampack")
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "streampack.cli"]
    helps = {}
    for sub in ("build", "info"):
        probe = subprocess.run([*base, sub, "--help"], cwd=REPO, capture_output=True, text=True)
        if probe.returncode != 0:
            tail = (probe.stderr.strip().splitlines() or ["?"])[-1]
            return Cli(base, f"not run: streampack CLI not ready (`{sub} --help`: {tail[:100]})", False)
        helps[sub] = probe.stdout
    return Cli(base, "", re.search(r"^\s*--profile\b", helps["build"], re.MULTILINE) is not None)


def streampack_build(
    cli: Cli,
    backend: str,
    spec: str,
    corpus: Corpus,
    scale: int,
    out_dir: Path,
    *,
    auto: bool,
    extra: Sequence[str] = (),
) -> Row:
    """One ``streampack build`` of ``corpus``; its tokens and engine are read back with ``info --json``.

    ``auto``: the default engine (no ``--tokenizer-engine``), with ``--profile`` where the CLI has it;
    else ``--tokenizer-engine <backend>``, the tokenizer's own library.
    """
    engine = [] if auto else ["--tokenizer-engine", backend]
    extra = [*engine, *(["--profile"] if auto and cli.profile else []), *extra]
    row = Row(AUTO if auto else BUILD, backend, "auto" if auto else backend, corpus.text_mb, scale=scale)
    if cli.why_not:
        row.note = cli.why_not
        return row
    build = [*cli.prefix, "build", corpus.path, "--tokenizer", spec, "--out", str(out_dir), "--overwrite"]
    m = run([*build, *extra], cwd=str(REPO))
    try:
        if m.returncode != 0:
            return failed(row, m)
        info = run([*cli.prefix, "info", str(out_dir), "--json"], cwd=str(REPO))
        if info.returncode != 0:
            failed(row, info).note = f"`info` {row.note}"
            row.peak_rss_mb = m.peak_rss_mb
            return row
        described = json.loads(info.stdout)
        row.tokens = int(described["num_tokens"])
        row.wall_s, row.peak_rss_mb = m.wall_s, m.peak_rss_mb
        row.build_s, row.stages = own_seconds(m.stdout), stage_table(m.stdout)
        ran = str(described.get("tokenizer_engine", "? (`info` does not say)"))
        if auto:
            row.engine = f"auto → {ran.split(' (')[0]}"
        row.note = f"{row.tokens / 1e6:.1f} M tokens; {scale}x corpus" + "".join(f" {a}" for a in extra)
        if auto and scale == 1:
            row.note += f"; engine that ran (`info`): {ran}"
        return row
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def own_seconds(stdout: str) -> float | None:
    """The seconds of the build's summary line (``built ...: N documents, ..., X s``), if it printed one."""
    for line in stdout.splitlines():
        found = BUILT_SECONDS.match(line)
        if found:
            return float(found.group(1))
    return None


def stage_table(stdout: str) -> list[str]:
    """The markdown table ``build --profile`` prints after its summary (header ``| timing |``, ``| stage |``
    before the table was named timings), if any."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(("| timing |", "| stage |"))), None)
    if start is None:
        return []
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append(line.rstrip())
    return table


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
    fast = {r.backend: r.tokens_per_s for r in rows if r.method == FAST_RAW}
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


def fast_ratio_to(row: Row, fast: dict[str, float | None]) -> float | None:
    """A build's ratio to the fast engine's raw limit on the same tokenizer (``None`` for other rows)."""
    if row.fast_ratio is not None or not row.method.startswith(BUILD):
        return row.fast_ratio
    tps, base = row.tokens_per_s, fast.get(row.backend)
    return tps / base if tps and base else None


def goals(rows: list[Row], raw: dict[str, float | None], fast: dict[str, float | None]) -> list[str]:
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
    backend: str, group: list[Row], raw: dict[str, float | None], fast: dict[str, float | None]
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
            out.append(_goal(what, fast_ratio, "≥", FAST_RATIO_GOAL))
        base = fast.get(backend)
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
    scaled = {r.scale: r for r in group if r.method == AUTO}
    small, big = scaled.get(min(scaled, default=0)), scaled.get(max(scaled, default=0))
    if small is not None and big is not None and big is not small and small.peak_rss_mb and big.peak_rss_mb:
        growth = big.peak_rss_mb / small.peak_rss_mb
        what = f"{kind}: auto build peak RSS {big.scale}x / {small.scale}x"
        out.append(_goal(what, growth, "≤", RSS_SCALE_GOAL))
    return out


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
            out.append("The build printed no timings table (no line starting `| timing |`).")
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
        help="tokenizers to run, a comma-separated subset of tokenizers (tokenizer.json), tiktoken (ranks)",
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
    unknown = set(args.backends.split(",")) - set(BACKENDS)
    if unknown:
        parser.error(f"--backends takes a subset of {','.join(BACKENDS)} (got {args.backends!r})")
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

    def build_once(auto: bool, scale: int = first) -> Row:
        out = tmp / "streampack-out"
        extra = args.build_args.split()
        return streampack_build(cli, backend, spec, scaled[scale], scale, out, auto=auto, extra=extra)

    log(f"{KIND[backend]}: raw limits and streampack builds at {first}x, {args.repeats} repeat(s)")
    rows = rotated(
        args.repeats,
        {
            RAW: lambda: raw_limit(backend, corpus, source),
            FAST_RAW: lambda: raw_limit(backend, corpus, source, fast=True),
            BUILD: lambda: build_once(auto=False),
            AUTO: lambda: build_once(auto=True),
        },
    )
    if backend == "tokenizers":  # the build cuts documents into pieces, which encode faster
        log(f"reference: raw call over the build's pieces, {backend}")
        rows.append(raw_limit(backend, corpus, source, pieces=True))
    for scale in args.scales[1:]:  # larger corpora: peak RSS against corpus size, one run each
        log(f"streampack build, auto engine, {KIND[backend]}, {scale}x")
        rows.append(build_once(auto=True, scale=scale))
    return rows


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
        "is the same for `fastokens` on the same file (`encode_batch_flat`, special tokens as text). "
        "Every other row is the wall time of a whole subprocess (start-up, reading, writing included); "
        "*build s, own timer* is the time the build prints in its summary line (`built …, X s`), which "
        "leaves out the interpreter's start-up and imports but not loading the tokenizer.",
        "",
        f"- run: {datetime.datetime.now():%Y-%m-%d %H:%M}, `{' '.join(['bench_build.py', *sys.argv[1:]])}`",
        f"- corpus: `{args.corpus}`{' (quick: first lines only)' if args.quick else ''}, {corpus.docs} docs, "
        f"{corpus.text_mb:.1f} MB of text, {corpus.file_mb:.1f} MB of JSONL",
        f"- machine: {psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
        f"{platform.python_implementation()} {platform.python_version()}, "
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
        for backend in args.backends.split(","):
            rows += measure_group(backend, args, cli, corpus, scaled, tmp)
        for scale, big in scaled.items():
            if scale != 1:
                Path(big.path).unlink()
        rows += measure_peers(args, corpus, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    text = render(rows, report_header(args, corpus, load_at_start), cli)
    print(text)
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(text)
    log(f"wrote {report}")


if __name__ == "__main__":
    main()

"""Benchmark ``streampack build`` against the raw tokenizer limit and two peers, in one run.

Every row runs in its own subprocess, measured by :mod:`_measure` (wall time, peak RSS summed over the
process tree). The baseline of the ratio column is the *raw limit* of the same backend, measured in
this run: its fastest batch-encode call over the same texts already in memory (see ``_raw_limit.py``).
With ``--repeats N``, N pairs of raw-limit and 1x build runs alternate (the build first in every other
pair); the table shows the median run of each and the build's ratio is the median of the N per-pair
ratios.

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
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson
import psutil
from _backends import TIKTOKEN_GPT2, TOKENIZERS_GPT2, head_lines
from _measure import Measurement, run

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BACKENDS = ("tokenizers", "tiktoken")
RSS_GOAL_MB = 1024.0
RATIO_GOAL = 0.95
RSS_SCALE_GOAL = 1.1


@dataclass
class Row:
    """One line of the table; ``wall_s``/``tokens``/``peak_rss_mb`` stay ``None`` for a row not run."""

    method: str
    backend: str
    input_mb: float
    wall_s: float | None = None
    tokens: int | None = None
    peak_rss_mb: float | None = None
    note: str = ""
    scale: int = 1
    ratio: float | None = None  # to the raw limit: the median of the ratios of runs paired in time

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


def paired(repeats: int, raw_once: Callable[[], Row], build_once: Callable[[], Row]) -> tuple[Row, Row]:
    """Alternate raw-limit and build runs; the build's ratio is the median of the per-pair ratios.

    Each pair runs back to back, so a burst of load from other jobs on the shared machine slows both
    sides of one ratio rather than one side of every ratio. Every other pair runs the build first, so a
    machine that speeds up or slows down over the run favours neither side.
    """
    raws, builds, ratios = [], [], []
    for i in range(repeats):
        if i % 2 == 0:
            raw, built = raw_once(), build_once()
        else:
            built, raw = build_once(), raw_once()
        raws.append(raw)
        builds.append(built)
        if raw.tokens_per_s and built.tokens_per_s:
            ratios.append(built.tokens_per_s / raw.tokens_per_s)
    build = median_of(builds)
    if ratios:
        build.ratio = statistics.median(ratios)
        if len(ratios) > 1:
            build.note += f"; ratios of the pairs {', '.join(f'{r:.3f}' for r in ratios)}"
    return median_of(raws), build


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


def raw_limit(backend: str, corpus: Corpus, tokenizer: str, build_pieces: bool = False) -> Row:
    """Raw limit: encode-only seconds of the backend's batch call, texts loaded first.

    With ``build_pieces``, a reference row rather than the baseline: the texts cut as the build cuts them.
    """
    method = "reference: raw call over the build's pieces" if build_pieces else "raw limit (baseline)"
    row = Row(method, backend, corpus.text_mb)
    cmd = [sys.executable, str(HERE / "_raw_limit.py"), "--backend", backend, "--corpus", corpus.path]
    m = run([*cmd, "--tokenizer", tokenizer, *(["--build-pieces"] if build_pieces else [])])
    if m.returncode != 0:
        return failed(row, m)
    out = json.loads(m.stdout.strip().splitlines()[-1])
    row.wall_s, row.tokens, row.peak_rss_mb = out["encode_s"], out["num_tokens"], m.peak_rss_mb
    row.note = f"{row.tokens / 1e6:.1f} M tokens; encode calls only (process wall {m.wall_s:.1f} s)"
    return row


def streampack_cli() -> tuple[list[str], str]:
    """Return the streampack command prefix and, if it cannot run yet, why (else an empty string)."""
    exe = Path(sys.executable).with_name("streampack")
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "streampack.cli"]
    for sub in ("build", "info"):
        probe = subprocess.run([*base, sub, "--help"], cwd=REPO, capture_output=True, text=True)
        if probe.returncode != 0:
            tail = (probe.stderr.strip().splitlines() or ["?"])[-1]
            return base, f"not run: streampack CLI not ready (`{sub} --help`: {tail[:100]})"
    return base, ""


def streampack_build(
    cli: Sequence[str],
    backend: str,
    spec: str,
    corpus: Corpus,
    scale: int,
    out_dir: Path,
    extra: Sequence[str] = (),
) -> Row:
    """One ``streampack build`` of ``corpus``; tokens are read back with ``streampack info --json``."""
    row = Row("streampack build", backend, corpus.text_mb, scale=scale)
    build = [*cli, "build", corpus.path, "--tokenizer", spec, "--out", str(out_dir), "--overwrite", *extra]
    m = run(build, cwd=REPO)
    try:
        if m.returncode != 0:
            return failed(row, m)
        info = run([*cli, "info", str(out_dir), "--json"], cwd=REPO)
        if info.returncode != 0:
            failed(row, info).note = f"`info` {row.note}"
            row.peak_rss_mb = m.peak_rss_mb
            return row
        row.tokens = int(json.loads(info.stdout)["num_tokens"])
        row.wall_s, row.peak_rss_mb = m.wall_s, m.peak_rss_mb
        row.note = f"{row.tokens / 1e6:.1f} M tokens; {scale}x corpus" + "".join(f" {a}" for a in extra)
        return row
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def peer(
    method: str, backend: str, script: str, corpus: Corpus, python: str, tmp: Path, out_name: str
) -> Row:
    """Run one peer worker in the bench venv, with every Hugging Face cache under ``tmp``."""
    row = Row(method, backend, corpus.text_mb)
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


def render(rows: list[Row], header: list[str]) -> str:
    """The markdown report: header lines, the table, then the goals checked against it."""
    raw = {r.backend: r.tokens_per_s for r in rows if r.method.startswith("raw limit")}
    lines = [*header, ""]
    lines.append(
        "| method | backend | input MB | wall s | M tokens/s | ratio to raw limit "
        "| peak RSS MB (tree) | note |"
    )
    lines.append("|---|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        tps, base = r.tokens_per_s, raw.get(r.backend)
        ratio = r.ratio if r.ratio is not None else (None if tps is None or not base else tps / base)
        lines.append(
            f"| {r.method} | {r.backend} | {r.input_mb:.0f} | {fmt(r.wall_s, '.1f')} "
            f"| {fmt(None if tps is None else tps / 1e6, '.2f')} | {fmt(ratio, '.2f')} "
            f"| {fmt(r.peak_rss_mb, '.0f')} | {r.note} |"
        )
    lines += ["", *goals(rows, raw)]
    return "\n".join(lines) + "\n"


def goals(rows: list[Row], raw: dict[str, float | None]) -> list[str]:
    """Check the streampack rows against the goals: ratio, peak RSS, and RSS growth with scale."""
    out = ["Goals for `streampack build`:", ""]
    for backend in BACKENDS:
        ran = {
            r.scale: r
            for r in rows
            if r.method == "streampack build" and r.backend == backend and r.wall_s is not None
        }
        if not ran:
            out.append(f"- {backend}: not measured")
            continue
        first, last = ran[min(ran)], ran[max(ran)]
        base, tps = raw.get(backend), first.tokens_per_s
        ratio = first.ratio if first.ratio is not None else (tps / base if base and tps else None)
        if ratio is not None:
            out.append(_goal(f"{backend}: ratio to raw limit at {min(ran)}x", ratio, "≥", RATIO_GOAL))
        reference = next((r for r in rows if r.method.startswith("reference") and r.backend == backend), None)
        if reference is not None and reference.tokens_per_s and tps:
            out.append(
                f"- {backend}: build / raw call over the build's pieces at {min(ran)}x: "
                f"{tps / reference.tokens_per_s:.2f} (what reading, framing and writing cost; no goal)"
            )
        peak = max(r.peak_rss_mb or 0.0 for r in ran.values())
        out.append(_goal(f"{backend}: max peak RSS MB", peak, "≤", RSS_GOAL_MB))
        if len(ran) > 1 and first.peak_rss_mb and last.peak_rss_mb:
            growth = last.peak_rss_mb / first.peak_rss_mb
            out.append(_goal(f"{backend}: peak RSS {max(ran)}x / {min(ran)}x", growth, "≤", RSS_SCALE_GOAL))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True, help="JSONL file with a `text` field per line")
    parser.add_argument("--scale", default="1,4", help="corpus multiples for streampack (default 1,4)")
    parser.add_argument("--quick", action="store_true", help="use only the first --quick-mb of the corpus")
    parser.add_argument("--quick-mb", type=float, default=30.0)
    parser.add_argument("--skip-peers", action="store_true", help="skip the slow datasets-based peers")
    parser.add_argument(
        "--backends", default=",".join(BACKENDS), help="comma-separated subset of " + ",".join(BACKENDS)
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="pairs of raw-limit and 1x build runs (medians reported)"
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
    scales = sorted({int(s) for s in args.scale.split(",")})
    if not scales or min(scales) < 1:
        parser.error(f"--scale takes positive integers like 1,4 (got {args.scale!r})")
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
        specs = {"tokenizers": args.tokenizer_json, "tiktoken": f"tiktoken:{args.tiktoken_ranks}"}
        sources = {"tokenizers": args.tokenizer_json, "tiktoken": args.tiktoken_ranks}

        # Each backend's raw limit runs right before its streampack rows, so that the two sides of a
        # ratio are measured minutes apart, not across the whole run (the machine is shared).
        cli, why_not = streampack_cli()
        scaled: dict[int, Corpus] = {1: corpus}
        rows: list[Row] = []
        for backend in args.backends.split(","):
            log(f"raw limit and streampack build at {scales[0]}x, {backend}, {args.repeats} pair(s)")
            if scales[0] not in scaled:
                scaled[scales[0]] = scale_corpus(corpus, scales[0], tmp)

            def build_once(b: str = backend, s: int = scales[0]) -> Row:
                if why_not:
                    return Row("streampack build", b, corpus.text_mb * s, note=why_not, scale=s)
                out = tmp / "streampack-out"
                return streampack_build(cli, b, specs[b], scaled[s], s, out, args.build_args.split())

            rows.extend(paired(args.repeats, lambda b=backend: raw_limit(b, corpus, sources[b]), build_once))
            if backend == "tokenizers":  # the build cuts documents into pieces, which encode faster
                log(f"reference: raw call over the build's pieces, {backend}")
                rows.append(raw_limit(backend, corpus, sources[backend], build_pieces=True))
            for scale in scales[1:]:  # larger corpora: peak RSS against corpus size, one run each
                if scale not in scaled:
                    scaled[scale] = scale_corpus(corpus, scale, tmp)
                log(f"streampack build, {backend}, {scale}x")
                rows.append(build_once(backend, scale))
        for scale, big in scaled.items():
            if scale != 1:
                Path(big.path).unlink()

        peers = [
            ("seed's recipe (HF datasets map)", "tokenizers", "_peer_hf_recipe.py", "saved"),
            ("nanoGPT prepare.py (memmap .bin)", "tiktoken", "_peer_nanogpt.py", "train.bin"),
        ]
        for method, backend, script, out_name in peers:
            if args.skip_peers or not Path(args.bench_python).exists():
                reason = "--skip-peers" if args.skip_peers else f"no bench venv at {args.bench_python}"
                rows.append(Row(method, backend, corpus.text_mb, note=f"not run: {reason}"))
                continue
            log(f"peer: {method}")
            rows.append(peer(method, backend, script, corpus, args.bench_python, tmp, out_name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    bench_py = args.bench_python if Path(args.bench_python).exists() else sys.executable
    header = [
        "# streampack build benchmark",
        "",
        "**Baseline (ratio 1.00): the raw limit** of each backend, measured in this run — its fastest "
        "batch-encode call over the same texts already in memory (`tokenizers` `encode_batch_fast`, "
        "`tiktoken` `encode_ordinary_batch(num_threads=cores)`, batches of 1000 docs), timing the encode "
        "calls only. "
        "Every other row is the wall time of a whole subprocess (start-up, reading, writing included).",
        "",
        f"- run: {datetime.datetime.now():%Y-%m-%d %H:%M}, `{' '.join(['bench_build.py', *sys.argv[1:]])}`",
        f"- corpus: `{args.corpus}`{' (quick: first lines only)' if args.quick else ''}, {corpus.docs} docs, "
        f"{corpus.text_mb:.1f} MB of text, {corpus.file_mb:.1f} MB of JSONL",
        f"- machine: {psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
        f"{platform.python_implementation()} {platform.python_version()}, "
        f"load average at start {load_at_start[0]:.2f} / end {os.getloadavg()[0]:.2f} (1 min)",
        f"- versions: tokenizers {version_of(sys.executable, 'tokenizers')}, "
        f"tiktoken {version_of(sys.executable, 'tiktoken')}, datasets {version_of(bench_py, 'datasets')}",
        "- input MB = text bytes / 10^6; M tokens/s = output tokens / wall s; "
        "peak RSS = max over 50 ms samples of RSS summed over the process tree (MiB)",
    ]
    text = render(rows, header)
    print(text)
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(text)
    log(f"wrote {report}")


if __name__ == "__main__":
    main()

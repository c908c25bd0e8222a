"""The groups of ``bench_build.py`` beyond the tokenizer groups, each measured and reported in one call.

- :func:`measure_formats`: the same texts in every input format (:mod:`_build_inputs`), each build ÷ the
  build of the plain JSONL (issue 26 item 3; goal ≥ 0.8);
- :func:`measure_encodings`: builds with the cl100k_base and o200k_base ranks ÷ the GPT-2 ranks' build of
  the same texts in tokens/s (item 4; goal ≥ 0.8), beside the fast engine's raw limit of each;
- :func:`measure_plain`: a build in a venv holding ``pip install .`` with no extras named ÷ the
  ``tokenizers`` and tiktoken raw limits (item 1; goals ≥ 30 and ≥ 8).

Each group runs its rows once per repeat, back to back, starting one row later each repeat (as the
tokenizer groups do); a ratio is the median of the per-repeat ratios, the table shows each row's median
run, and peak RSS is the largest of its runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from _backends import iter_texts
from _build_inputs import FORMATS, chat_tokenizer, convert, files_under, size_mb
from _build_rows import (
    AUTO,
    HERE,
    REPO,
    Cli,
    Corpus,
    Row,
    engines_text,
    failed,
    log,
    median_of,
    raw_limit,
    streampack_build,
)
from _measure import run

FORMAT_GOAL = 0.8
ENCODING_GOAL = 0.8
PLAIN_GOALS = {"tokenizers": 30.0, "tiktoken": 8.0}
ENCODINGS = ("cl100k_base", "o200k_base")
JSONL = "JSONL (baseline)"
LABELS = {
    "parquet": "Parquet (`text` column, row groups of 1000)",
    "zst": "JSONL .zst (one file)",
    "gz": "JSONL .gz (one file)",
    "text": "text, one .txt file per document",
    "hf": "HF dataset (`save_to_disk`, `streampack.build(load_from_disk(...))`)",
    "fields": "SFT `--fields prompt,response`",
    "chat": "SFT `--chat messages` (ChatML)",
}
SFT = ("fields", "chat")

Ratios = dict[tuple[str, str], list[float]]


def paired(
    repeats: int, runners: dict[str, Callable[[], Row]], pairs: Sequence[tuple[str, str]]
) -> tuple[dict[str, Row], Ratios, Ratios]:
    """Run the rows ``repeats`` times, rotated; per pair ``(row, baseline)`` its per-repeat ratios of
    tokens/s, in wall seconds and in the builds' own seconds (where both rows have them)."""
    names = list(runners)
    runs: dict[str, list[Row]] = {name: [] for name in names}
    wall: Ratios = {pair: [] for pair in pairs}
    own: Ratios = {pair: [] for pair in pairs}
    for i in range(repeats):
        done = {name: runners[name]() for name in names[i % len(names) :] + names[: i % len(names)]}
        for name, row in done.items():
            runs[name].append(row)
        for a, b in pairs:
            x, y = done[a], done[b]
            if x.tokens_per_s and y.tokens_per_s:
                wall[a, b].append(x.tokens_per_s / y.tokens_per_s)
            if x.tokens and y.tokens and x.build_s and y.build_s:
                own[a, b].append((x.tokens / x.build_s) / (y.tokens / y.build_s))
    return {name: median_of(rows) for name, rows in runs.items()}, wall, own


def median(values: list[float]) -> float | None:
    """The median, or ``None`` for no values."""
    return statistics.median(values) if values else None


def fmt(value: float | None, spec: str) -> str:
    """A number, or an en dash for one not measured."""
    return "–" if value is None else format(value, spec)


def per_repeat(values: list[float]) -> str:
    """The per-repeat ratios, for a note, when there are several."""
    return f" (per repeat {', '.join(f'{v:.2f}' for v in values)})" if len(values) > 1 else ""


def goal_line(what: str, value: float | None, target: float, values: list[float]) -> str:
    """A goal line: ``value ≥ target``, met or not, with the per-repeat values."""
    if value is None:
        return f"- {what}: not measured"
    met = "met" if value >= target else "**not met**"
    return f"- {what}: {value:.2f}{per_repeat(values)} (goal ≥ {target:g}) — {met}"


def mtps(row: Row) -> str:
    """M tokens per wall second."""
    tps = row.tokens_per_s
    return fmt(None if tps is None else tps / 1e6, ".2f")


def python_build(dataset: Path, tokenizer: str, corpus: Corpus, out: Path) -> Row:
    """``streampack.build`` of a saved Hugging Face dataset, in its own process (``_build_python.py``)."""
    row = Row(AUTO, "tokenizers", "auto", corpus.text_mb)
    worker = [sys.executable, str(HERE / "_build_python.py"), "--dataset", str(dataset)]
    m = run([*worker, "--tokenizer", tokenizer, "--out", str(out)], cwd=str(REPO))
    try:
        if m.returncode != 0:
            return failed(row, m)
        done = json.loads(m.stdout.strip().splitlines()[-1])
        row.tokens, row.build_s, row.stages = int(done["num_tokens"]), float(done["seconds"]), done["stages"]
        row.wall_s, row.peak_rss_mb = m.wall_s, m.peak_rss_mb
        row.engines = "; ".join(engines_text(e) for e in done["engines"])
        row.engine = f"auto → {row.engines.split(':')[0]}"
        row.note = f"{row.tokens / 1e6:.1f} M tokens; load_from_disk {done['load_s']:.2f} s; profile=True"
        return row
    finally:
        shutil.rmtree(out, ignore_errors=True)


def stage_cells(row: Row) -> dict[str, str]:
    """A build's stage table as ``stage -> seconds``: the CPU s where the table gives them, else wall s."""
    cells = {}
    for line in row.stages[2:]:
        parts = [p.strip() for p in line.strip("|").split("|")]
        if len(parts) == 4:
            cells[parts[0]] = parts[3] or parts[2]
    return cells


def stage_columns(rows: dict[str, Row]) -> list[str]:
    """One table of the builds' stages side by side (CPU s; wall s for the encoder threads and the build)."""
    cells = {name: stage_cells(row) for name, row in rows.items() if row.stages}
    if not cells:
        return []
    stages = list(dict.fromkeys(s for c in cells.values() for s in c))
    names = list(cells)
    out = [
        "",
        "Stages of these builds (`--profile`; median runs): CPU s of the main thread's stages, of the "
        "engines' threads and of all processes; wall s of the encoder threads' calls and of the build.",
        "",
        "| stage | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    out += [f"| {s} | " + " | ".join(cells[n].get(s, "") for n in names) + " |" for s in stages]
    return out


# --- input formats ----------------------------------------------------------------------------------


def measure_formats(
    args: argparse.Namespace, cli: Cli, corpus: Corpus, tmp: Path, formats: Sequence[str]
) -> list[str]:
    """Every input format of the same texts, built with the GPT-2 ``tokenizer.json`` and the default engine
    (with ``--profile``), ÷ the build of the plain JSONL; the report section."""
    inputs: dict[str, Path] = {}
    for name in formats:
        start = time.perf_counter()
        inputs[name] = convert(corpus.path, name, tmp)
        log(f"formats: wrote {LABELS[name]} in {time.perf_counter() - start:.1f} s (not timed)")
    chat_spec = str(chat_tokenizer(args.tokenizer_json, tmp / "chat-tokenizer")) if "chat" in formats else ""
    extra = args.build_args.split()
    out = tmp / "streampack-out"

    def cli_build(path: str, *more: str, spec: str = args.tokenizer_json) -> Callable[[], Row]:
        source = dataclasses.replace(corpus, path=path)
        return lambda: streampack_build(
            cli, "tokenizers", spec, source, 1, out, auto=True, extra=[*more, *extra]
        )

    runners: dict[str, Callable[[], Row]] = {JSONL: cli_build(corpus.path)}
    for name in formats:
        source = str(inputs[name])
        if name == "hf":
            runners[name] = functools.partial(python_build, inputs[name], args.tokenizer_json, corpus, out)
        elif name == "fields":
            runners[name] = cli_build(source, "--fields", "prompt,response")
        elif name == "chat":
            runners[name] = cli_build(source, "--chat", "messages", spec=chat_spec)
        else:
            runners[name] = cli_build(source)
    log(f"formats: {', '.join(formats)} and the plain JSONL, {args.repeats} repeat(s)")
    pairs = [(name, JSONL) for name in formats]
    rows, wall, own = paired(args.repeats, runners, pairs)

    base = rows[JSONL]
    lines = [
        "",
        "## Input formats (GPT-2 `tokenizer.json`, default engine, 1x)",
        "",
        "The same texts in each format, written once under `--tmp` before any row runs (not timed); each "
        "build ÷ the plain JSONL's in tokens/s, the median of the per-repeat ratios (wall: whole "
        "process; own timer: the build's summary line, or `BuildSummary.seconds` for the HF dataset, "
        "so no interpreter start-up, imports or `load_from_disk`). The SFT inputs hold each text cut in "
        "two at the space nearest its middle (prompt / user, response / assistant).",
        "",
        "| input | files | MB on disk | wall s | build s, own timer | M tokens/s | ÷ JSONL "
        "| ÷ JSONL, own timer | peak RSS MB (tree) | tokens | engine that ran | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for name, row in rows.items():
        path = Path(corpus.path) if name == JSONL else inputs[name]
        ratio = None if name == JSONL else median(wall[name, JSONL])
        own_ratio = None if name == JSONL else median(own[name, JSONL])
        label = JSONL if name == JSONL else LABELS[name]
        lines.append(
            f"| {label} | {files_under(path)} | {size_mb(path):.0f} | {fmt(row.wall_s, '.2f')} "
            f"| {fmt(row.build_s, '.2f')} | {mtps(row)} | {fmt(1.0 if name == JSONL else ratio, '.2f')} "
            f"| {fmt(1.0 if name == JSONL else own_ratio, '.2f')} | {fmt(row.peak_rss_mb, '.0f')} "
            f"| {fmt(row.tokens, ',')} | {row.engines or row.engine} "
            f"| {row.note.split('; engine that ran')[0]} |"
        )
    lines += [
        "",
        f"Goals (issue 26 item 3): each input ÷ plain JSONL of the same texts ≥ {FORMAT_GOAL:g}",
        "",
    ]
    for name in formats:
        lines.append(
            goal_line(f"{LABELS[name]} ÷ JSONL", median(wall[name, JSONL]), FORMAT_GOAL, wall[name, JSONL])
        )
        own_value = median(own[name, JSONL])
        if own_value is not None:
            lines.append(
                f"  - in the builds' own seconds: {own_value:.2f}{per_repeat(own[name, JSONL])} (no goal)"
            )
    same = [name for name in formats if name not in SFT and rows[name].tokens is not None]
    if same and base.tokens is not None:
        differ = [name for name in same if rows[name].tokens != base.tokens]
        lines.append(
            f"- the same tokens as the JSONL ({base.tokens:,}) from {', '.join(same)}: "
            + (
                "met"
                if not differ
                else f"**not met** ({', '.join(f'{n} {rows[n].tokens:,}' for n in differ)})"
            )
        )
        if "text" in differ:  # a .txt file's first U+FEFF is its byte-order mark, which the reader drops
            boms = sum(text.startswith("\ufeff") for text in iter_texts(corpus.path))
            lines.append(
                f"  - {boms} of the texts begin with U+FEFF, which the `.txt` reader takes for the file's "
                "byte-order mark and drops (`streampack/inputs/text.py`), ~3 tokens each"
            )
    lines += stage_columns({(JSONL if n == JSONL else n): r for n, r in rows.items()})
    return lines


# --- encodings --------------------------------------------------------------------------------------


def measure_encodings(
    args: argparse.Namespace, cli: Cli, corpus: Corpus, tmp: Path, encodings: Sequence[str]
) -> list[str]:
    """Builds with each encoding's tiktoken ranks and the fast engine's raw limit on them, ÷ GPT-2's."""
    folder = Path(args.tiktoken_ranks).parent
    ranks = {name: str(folder / f"{name}.tiktoken") for name in ("gpt2", *encodings)}
    extra = args.build_args.split()
    out = tmp / "streampack-out"
    runners: dict[str, Callable[[], Row]] = {}
    for name, path in ranks.items():
        runners[f"{name} raw"] = functools.partial(raw_limit, "tiktoken", corpus, path, fast=True)
        runners[f"{name} build"] = functools.partial(
            streampack_build, cli, "tiktoken", f"tiktoken:{path}", corpus, 1, out, auto=True, extra=extra
        )
    pairs = []
    for name in encodings:
        pairs += [(f"{name} build", "gpt2 build"), (f"{name} raw", "gpt2 raw")]
    pairs += [(f"{name} build", f"{name} raw") for name in ranks]
    log(f"encodings: gpt2, {', '.join(encodings)} (fast raw limit and build), {args.repeats} repeat(s)")
    rows, wall, own = paired(args.repeats, runners, pairs)

    lines = [
        "",
        "## Encodings (tiktoken ranks, default engine, 1x)",
        "",
        "Per ranks file of `../shared/data/tokenizers/tiktoken`: the fast engine's raw limit "
        "(`_raw_limit.py --backend fastokens-tiktoken`, loaded as builds load it: cl100k's and o200k's "
        "ranks by `from_tiktoken` with the caseless spelling of their pattern, `fast_forms.fast_split`) "
        "and `streampack build --tokenizer tiktoken:RANKS --profile`. Ratios in tokens/s (the encodings "
        "make different numbers of tokens from the same texts), medians of the per-repeat ratios.",
        "",
        "| ranks | row | wall s | build s, own timer | M tokens/s | ÷ GPT-2's same row "
        "| ÷ its fast raw limit | peak RSS MB (tree) | tokens "
        "| engine that ran (manifest `engines`: name version: why) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name in ranks:
        for kind in ("raw", "build"):
            row = rows[f"{name} {kind}"]
            to_gpt2 = 1.0 if name == "gpt2" else median(wall.get((f"{name} {kind}", f"gpt2 {kind}"), []))
            to_raw = median(wall[f"{name} build", f"{name} raw"]) if kind == "build" else None
            what = "fast engine's raw limit" if kind == "raw" else "streampack build"
            engine = "fastokens (encode calls only)" if kind == "raw" else row.engines or row.note
            lines.append(
                f"| {name} | {what} | {fmt(row.wall_s, '.2f')} | {fmt(row.build_s, '.2f')} | {mtps(row)} "
                f"| {fmt(to_gpt2, '.2f')} | {fmt(to_raw, '.2f')} | {fmt(row.peak_rss_mb, '.0f')} "
                f"| {fmt(row.tokens, ',')} | {engine} |"
            )
    lines += [
        "",
        f"Goals (issue 26 item 4): build ÷ the GPT-2 build of the same texts, tokens/s ≥ {ENCODING_GOAL:g}",
        "",
    ]
    for name in encodings:
        pair = (f"{name} build", "gpt2 build")
        lines.append(goal_line(f"{name} build ÷ gpt2 build", median(wall[pair]), ENCODING_GOAL, wall[pair]))
        if own[pair]:
            lines.append(
                f"  - in the builds' own seconds: {median(own[pair]):.2f}{per_repeat(own[pair])} (no goal)"
            )
        raw_pair = (f"{name} raw", "gpt2 raw")
        if wall[raw_pair]:
            lines.append(
                f"  - the fast engine's raw limit, {name} ÷ gpt2: {median(wall[raw_pair]):.2f}"
                f"{per_repeat(wall[raw_pair])} (the engine's own; no goal)"
            )
    lines += stage_columns({name: rows[f"{name} build"] for name in ranks})
    return lines


# --- the plain install ------------------------------------------------------------------------------


def source_commit() -> str:
    """The last commit that changed the package (``streampack/``, ``pyproject.toml``), and whether it has
    uncommitted changes: what a ``pip install .`` of the project holds."""
    head = subprocess.run(
        ["git", "-C", str(REPO), "log", "-1", "--format=%h", "--", "streampack", "pyproject.toml"],
        capture_output=True,
        text=True,
    )
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--", "streampack", "pyproject.toml"],
        capture_output=True,
        text=True,
    )
    return (head.stdout.strip() or "?") + (" + uncommitted changes" if dirty.stdout.strip() else "")


def ensure_plain_venv(venv: Path) -> str:
    """Create ``venv`` with ``pip install <project>`` (no extras) unless it has a ``streampack`` already;
    return why it cannot run ("" if it can)."""
    marker = venv / "streampack-bench-source.txt"
    if (venv / "bin" / "streampack").exists():
        return ""
    log(f"plain install: creating {venv} (python -m venv, then pip install {REPO}, no extras)")
    made = subprocess.run(
        [sys.executable, "-m", "venv", "--clear", str(venv)], capture_output=True, text=True
    )
    if made.returncode != 0:
        return f"not run: `python -m venv {venv}` failed: {(made.stderr.strip().splitlines() or ['?'])[-1]}"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(REPO)]
    done = subprocess.run(pip, capture_output=True, text=True, env=env, cwd=str(venv))
    if done.returncode != 0:
        return (
            f"not run: `pip install {REPO}` failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:160]}"
        )
    marker.write_text(source_commit() + "\n")
    return ""


def plain_versions(venv: Path) -> str:
    """What the plain venv holds: streampack (and where from), fastokens, tokenizers, tiktoken."""
    probe = (
        "import importlib.metadata as m, streampack\n"
        "def v(n):\n    try: return m.version(n)\n    except m.PackageNotFoundError: return 'not installed'\n"
        'print(f\'streampack {v("streampack")} ({streampack.__file__}), fastokens {v("fastokens")}, '
        'tokenizers {v("tokenizers")}, tiktoken {v("tiktoken")}\')'
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, env=env, cwd=str(venv)
    )
    return done.stdout.strip() or f"? ({(done.stderr.strip().splitlines() or ['?'])[-1]})"


def measure_plain(args: argparse.Namespace, corpus: Corpus, tmp: Path, scale: int = 1) -> list[str]:
    """A build in the plain-install venv ÷ the ``tokenizers`` and tiktoken raw limits, on ``corpus`` (the
    benchmark's corpus ``scale`` times); the report section."""
    venv = Path(args.plain_venv).resolve()
    why_not = ensure_plain_venv(venv)
    exe = venv / "bin" / "streampack"
    # PYTHONPATH unset and run outside the project, so that it imports the venv's copy, not the tree's
    plain = Cli([str(exe)], why_not, profile=True, unset=("PYTHONPATH",), cwd=str(tmp))
    out = tmp / "streampack-out"
    extra = args.build_args.split()
    runners: dict[str, Callable[[], Row]] = {
        "tokenizers": lambda: raw_limit("tokenizers", corpus, args.tokenizer_json),
        "tiktoken": lambda: raw_limit("tiktoken", corpus, args.tiktoken_ranks),
        "plain": lambda: streampack_build(
            plain, "tokenizers", args.tokenizer_json, corpus, scale, out, auto=True, extra=extra
        ),
    }
    log(f"plain install: its build and both raw limits, {args.repeats} repeat(s)")
    rows, wall, _ = paired(args.repeats, runners, [("plain", "tokenizers"), ("plain", "tiktoken")])
    marker = venv / "streampack-bench-source.txt"
    installed = marker.read_text().strip() if marker.exists() else "? (no marker: not made by this script)"
    now = source_commit()
    lines = [
        "",
        "## The plain install (`pip install .`, no extras named; GPT-2 `tokenizer.json`, default engine, "
        f"{scale}x)",
        "",
        f"- venv: `{venv}`, its package as of commit {installed}"
        + ("" if installed == now else f" — **the project is now at {now}: remove the venv to reinstall**"),
        f"- it holds: {why_not or plain_versions(venv)}",
        "- the build runs its `streampack` console script with `PYTHONPATH` unset; the raw limits run in the "
        "project's venv, as in the tokenizer groups",
        "",
        "| row | wall s | build s, own timer | M tokens/s | build ÷ it | peak RSS MB (tree) | tokens "
        "| engine / note |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    titles = {
        "tokenizers": "raw limit: `tokenizers` `encode_batch_fast`",
        "tiktoken": "raw limit: tiktoken `encode_ordinary_batch`",
        "plain": "streampack build, plain install",
    }
    for name, row in rows.items():
        ratio = median(wall["plain", name]) if name != "plain" else None
        lines.append(
            f"| {titles[name]} | {fmt(row.wall_s, '.2f')} | {fmt(row.build_s, '.2f')} | {mtps(row)} "
            f"| {fmt(ratio, '.1f')} | {fmt(row.peak_rss_mb, '.0f')} | {fmt(row.tokens, ',')} "
            f"| {row.engines or row.note} |"
        )
    lines += ["", "Goals (issue 26 item 1):", ""]
    for name, target in PLAIN_GOALS.items():
        values = wall["plain", name]
        what = f"plain-install build ÷ {titles[name].split(': ')[1]} at {scale}x"
        lines.append(goal_line(what, median(values), target, values))
    return lines


def parse_list(value: str, allowed: Sequence[str], what: str) -> list[str]:
    """A comma-separated subset of ``allowed`` (``all``: every one; ``none`` or "": none).

    Raises:
        ValueError: a name not in ``allowed``.
    """
    if value.strip() in ("", "none"):
        return []
    if value.strip() == "all":
        return list(allowed)
    chosen = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in allowed]
    if unknown:
        raise ValueError(
            f"{what} takes a comma-separated subset of {','.join(allowed)}, all or none (got {value!r})"
        )
    return chosen


__all__ = ["ENCODINGS", "FORMATS", "measure_encodings", "measure_formats", "measure_plain", "parse_list"]

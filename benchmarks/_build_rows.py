"""The rows of ``bench_build.py``: a row's record, running one raw limit or one ``streampack build``.

Shared by ``bench_build.py`` (the tokenizer groups) and ``_build_groups.py`` (input formats, encodings, the
plain install). Every row runs in its own subprocess, measured by :mod:`_measure`.
"""

from __future__ import annotations

import datetime
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from _measure import Measurement, run

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BACKENDS = ("tokenizers", "tiktoken")  # a group per tokenizer kind, named after its own library
KIND = {"tokenizers": "tokenizer.json", "tiktoken": "tiktoken ranks"}
FAST_WORKER = {"tokenizers": "fastokens-json", "tiktoken": "fastokens-tiktoken"}  # _raw_limit.py --backend
RAW = "raw limit (baseline)"
GIGA_WORKER = {"tokenizers": "gigatoken-json", "tiktoken": "gigatoken-tiktoken"}
FAST_RAW = "raw limit of the fast engine"
GIGA_RAW = "raw limit of gigatoken"  # its encode_batch over the same texts, special tokens as text
GIGATOKEN_BUILD = "streampack build, gigatoken"  # --tokenizer-engine gigatoken, beside auto (fastokens)
FAST_AS_BUILT = "the fast engine as a build calls it"  # two calls at once, a thread each, 1 MiB batches
PIECES = "reference: raw call over the build's pieces"
NO_ENGINE = "the build without its engine"  # _build_without_engine.py: the engine's calls stubbed, no check
BUILD = "streampack build"  # --tokenizer-engine <the tokenizer's own library>
AUTO = "streampack build, auto engine"  # no --tokenizer-engine: the default
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
    build_over: float | None = None  # a FAST_AS_BUILT row: the build's ratio to it (median of the repeats)
    engines: str = ""  # a build's manifest `engines`: "name version: why", one per engine

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
    unset: tuple[str, ...] = ()  # environment variables its runs leave out (PYTHONPATH for another venv)
    cwd: str | None = None  # where it runs (default: the project's root)


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


def log(msg: str) -> None:
    """Progress goes to stderr so the table on stdout stays clean."""
    print(f"[bench_build {datetime.datetime.now():%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def raw_limit(
    backend: str,
    corpus: Corpus,
    tokenizer: str,
    *,
    fast: bool = False,
    pieces: bool = False,
    as_built: bool = False,
    giga: bool = False,
) -> Row:
    """Raw limit: encode-only seconds of a batch call, texts loaded first.

    ``backend`` names the group; ``fast``: the fast engine's call on the same tokenizer file rather than
    the group's own library's (the baseline). With ``pieces``, a reference row rather than the baseline:
    the texts cut as the build cuts them. With ``as_built`` (and ``fast``), a reference row too: the fast
    engine called as a build calls it (two calls at once of one thread each, batches of 1 MiB of text).
    ``giga``: gigatoken's batch call on the same file, as a build loads it.
    """
    worker = GIGA_WORKER[backend] if giga else FAST_WORKER[backend] if fast else backend
    method = (FAST_AS_BUILT if as_built else FAST_RAW) if fast else PIECES if pieces else RAW
    method = GIGA_RAW if giga else method
    row = Row(method, backend, "gigatoken" if giga else "fastokens" if fast else backend, corpus.text_mb)
    cmd = [sys.executable, str(HERE / "_raw_limit.py"), "--backend", worker, "--corpus", corpus.path]
    built = ["--calls", "2", "--batch-chars", str(1 << 20), "--threads", "1"] if as_built else []
    m = run([*cmd, "--tokenizer", tokenizer, *(["--build-pieces"] if pieces else []), *built])
    if m.returncode != 0:
        return failed(row, m)
    out = json.loads(m.stdout.strip().splitlines()[-1])
    row.wall_s, row.tokens, row.peak_rss_mb = out["encode_s"], out["num_tokens"], m.peak_rss_mb
    row.note = f"{row.tokens / 1e6:.1f} M tokens; encode calls only (process wall {m.wall_s:.1f} s)"
    return row


def streampack_cli() -> Cli:
    """How to run streampack, why it cannot run yet (else ""), whether it has ``build --profile``."""
    exe = Path(sys.executable).with_name("streampack")
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "streampack"]
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
    engine: str | None = None,
) -> Row:
    """One ``streampack build`` of ``corpus``; its tokens and engine are read back with ``info --json``.

    ``auto``: the default engine (no ``--tokenizer-engine``), with ``--profile`` where the CLI has it;
    else ``--tokenizer-engine <engine>`` (default: ``backend``, the tokenizer's own library).
    """
    chosen = [] if auto else ["--tokenizer-engine", engine or backend]
    extra = [*chosen, *(["--profile"] if auto and cli.profile else []), *extra]
    method = AUTO if auto else BUILD if engine is None else f"streampack build, {engine}"
    row = Row(method, backend, "auto" if auto else engine or backend, corpus.text_mb, scale=scale)
    if cli.why_not:
        row.note = cli.why_not
        return row
    build = [*cli.prefix, "build", corpus.path, "--tokenizer", spec, "--out", str(out_dir), "--overwrite"]
    shutil.rmtree(out_dir, ignore_errors=True)  # every build into an empty directory: an overwrite's deletion
    m = run([*build, *extra], cwd=cli.cwd or str(REPO), unset=cli.unset)  # of the last one is not building
    try:
        if m.returncode != 0:
            return failed(row, m)
        row.engines = manifest_engines(out_dir)
        info = run([*cli.prefix, "info", str(out_dir), "--json"], cwd=cli.cwd or str(REPO), unset=cli.unset)
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


def manifest_engines(cache: Path) -> str:
    """The cache manifest's ``engines`` as ``name version: why`` (``; ``-joined), or "" if it has none."""
    try:
        engines = json.loads((cache / "manifest.json").read_text()).get("engines") or []
    except (OSError, ValueError):
        return ""
    return "; ".join(engines_text(e) for e in engines)


def engines_text(engine: dict[str, object]) -> str:
    """One entry of a manifest's ``engines``: ``name version: why``."""
    name = " ".join(str(engine[k]) for k in ("name", "version") if engine.get(k))
    return f"{name}: {engine['why']}" if engine.get("why") else name


def own_seconds(stdout: str) -> float | None:
    """The seconds of the build's summary line (``built ...: N documents, ..., X s``), if it printed one."""
    for line in stdout.splitlines():
        found = BUILT_SECONDS.match(line)
        if found:
            return float(found.group(1))
    return None


def stage_cpu(stages: list[str], timing: str) -> float | None:
    """The CPU seconds of ``timing`` (its row's last cell) in a ``--profile`` stage table, if it has it."""
    for line in stages:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == timing:
            try:
                return float(cells[-1])
            except ValueError:
                return None
    return None


def stage_table(stdout: str) -> list[str]:
    """The markdown table ``build --profile`` prints after its summary (header ``| stage |``), if any."""
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

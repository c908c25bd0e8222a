"""Crash torture: SIGKILL real builds at random instants, resume them, compare with an uninterrupted build.

    python benchmarks/torture.py --kills 50 [--seed S] [--workers 2] [--sft]

Builds a corpus of several files in several formats (split JSONL, gzip, zstd, bz2, Parquet, text) with a
byte-level BPE tokenizer trained on the fly, builds it once uninterrupted (the baseline), then runs trials:
each trial kills a fresh build 1-3 times in a row (the later kills land in the resumed runs), lets the last
run finish, and compares every file of the cache byte for byte with the baseline. Each kill is classified
by the phase the directory shows right after it: ``planning`` (no manifest yet), ``running`` (units in
progress), ``finalizing`` (every unit done, manifest not yet complete) or ``finished``.
With ``--sft`` the records hold a prompt and a response, built with ``--fields prompt,response``, so that
the shards' loss masks are compared too (and there is no text file, which holds no fields).
Prints a table and ``kills: N, resumed identical: N``; exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=50, help="kills to land (default 50)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--scale", type=int, default=1, help="corpus size multiplier")
    parser.add_argument("--sft", action="store_true", help="an SFT build (--fields prompt,response)")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="streampack-torture-") as tmp:
        root = Path(tmp)
        inputs = make_corpus(root / "in", args.scale, sft=args.sft)
        tokenizer = train_tokenizer(root / "tokenizer.json")
        command = build_command(inputs, tokenizer, args.workers)
        if args.sft:
            command += ["--fields", "prompt,response"]
        started = time.monotonic()
        run(command, root / "reference")
        duration = time.monotonic() - started
        reference = cache_files(root / "reference")
        kills, identical, trials, phases = 0, 0, 0, collections.Counter()
        while kills < args.kills:
            trials += 1
            out = root / f"trial{trials}"
            landed = []
            for _ in range(rng.randint(1, 3)):
                phase = kill_at(command, out, rng.uniform(0.0, duration * 1.1))
                if phase is None:
                    break
                landed.append(phase)
            run(command, out)
            same = cache_files(out) == reference
            kills += len(landed)
            identical += len(landed) if same else 0
            phases.update(landed)
            if not same:
                print(
                    f"trial {trials}: cache differs from the baseline after kills in {landed}",
                    file=sys.stderr,
                )
            clear(out)
    print_report(seed, duration, trials, phases, kills, identical)
    return 0 if identical == kills else 1


def make_corpus(root: Path, scale: int, sft: bool = False) -> list[Path]:
    """Several files in several formats; the JSONL is large enough to be split into units. With ``sft``,
    records of a prompt and a response, and no text file."""
    import bz2
    import gzip

    import zstandard

    rng = random.Random(1234)
    words = ["the", "of", "and", "streampack", "token", "cache", "Ünïcödé", "🙂", "shard", "commit", "\n"]

    def doc() -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(0, 300)))

    def record() -> dict[str, str]:
        return {"prompt": doc(), "response": doc()} if sft else {"text": doc()}

    def jsonl(n: int) -> bytes:
        return "".join(json.dumps(record()) + "\n" for _ in range(n)).encode()

    root.mkdir(parents=True)
    files = {
        "a.jsonl": jsonl(4000 * scale),
        "b.jsonl.gz": gzip.compress(jsonl(1500 * scale), mtime=0),
        "c.jsonl.zst": zstandard.ZstdCompressor().compress(jsonl(1500 * scale)),
        "d.jsonl.bz2": bz2.compress(jsonl(800 * scale)),
        "f.txt": " ".join(doc() for _ in range(200 * scale)).encode(),
    }
    for name, data in files.items():
        (root / name).write_bytes(data)
    pq.write_table(
        pa.Table.from_pylist([record() for _ in range(1500 * scale)]), root / "e.parquet", row_group_size=100
    )
    names = ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.jsonl.bz2", "e.parquet", "f.txt"]
    return [root / n for n in names if not (sft and n.endswith(".txt"))]


def train_tokenizer(path: Path) -> Path:
    """A small real byte-level BPE tokenizer, so tokenizing costs what it costs."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(
        ["the of and streampack token cache shard ledger commit resume kill"] * 100, trainer
    )
    tok.save(str(path))
    return path


def build_command(inputs: list[Path], tokenizer: Path, workers: int) -> list[str]:
    """The build, with tiny units, batches and commit intervals so that kills land in every phase."""
    return [
        sys.executable, "-m", "streampack", "build", *map(str, inputs), "--tokenizer", str(tokenizer),
        "--workers", str(workers), "--unit-mb", "1", "--batch-chars", "20000", "--commit-seconds", "0",
        "--commit-mb", "0", "--no-progress",
    ]  # fmt: skip


def run(command: list[str], out: Path) -> None:
    result = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise SystemExit(f"build into {out} failed:\n{result.stderr}")


def kill_at(command: list[str], out: Path, delay: float) -> str | None:
    """Start a build and SIGKILL its process group after ``delay`` s; the phase hit, or None if it ended."""
    proc = subprocess.Popen(
        [*command, "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return phase_of(out)
    if proc.returncode != 0:
        raise SystemExit(f"build failed:\n{proc.stderr.read().decode() if proc.stderr else ''}")
    return None


def phase_of(out: Path) -> str:
    manifest = out / "manifest.json"
    if not manifest.exists():
        return "planning"
    if json.loads(manifest.read_text())["complete"]:
        return "finished"
    units = len(json.loads(manifest.read_text())["units"])
    done = sum(json.loads(p.read_text())["done"] for p in (out / "ledger").glob("*.json"))
    return "finalizing" if done == units else "running"


def cache_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def clear(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def print_report(
    seed: int, duration: float, trials: int, phases: collections.Counter, kills: int, same: int
) -> None:
    print(f"\nCrash torture (seed {seed}; baseline: one uninterrupted build of {duration:.1f} s)\n")
    print("| phase at kill | kills |\n|---|---|")
    for phase in ("planning", "running", "finalizing", "finished"):
        print(f"| {phase} | {phases.get(phase, 0)} |")
    print(f"\ntrials: {trials}")
    print(f"kills: {kills}, resumed identical: {same}")


if __name__ == "__main__":
    sys.exit(main())

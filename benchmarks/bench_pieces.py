"""Benchmark the piece size: the same texts encoded whole and cut into pieces, by the raw batch call.

Each backend's fastest batch call (as in ``_raw_limit.py``: ``tokenizers`` ``encode_batch_fast``,
tiktoken ``encode_ordinary_batch`` with one thread per core, the fast engine ``fastokens``
``encode_batch_flat`` on the same ``tokenizer.json``) encodes the corpus's texts, already in
memory, either as whole documents (the baseline, ratio 1.00) or cut by
:class:`streampack.tokenizer.pieces.PieceRule`
into pieces of about N characters at word boundaries, which keep the tokens (the run checks that the
token count is the same). Batches hold 8 M characters whatever the piece size. Every run is its own
subprocess; the rounds alternate the order of the rows, and the table shows the median of each row and
the median of its per-round ratios to the baseline.

Usage::

    python benchmarks/bench_pieces.py --corpus natural.jsonl [--mb 100]
        [--rounds 3] [--targets 100000,20000,10000,5000] [--backends tokenizers,tiktoken,fastokens]

Prints a markdown table and writes it to ``benchmarks/results/pieces.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BATCH_CHARS = 8 << 20
MAX_PIECE_CHARS = 100_000  # streampack's memory bound for these tokenizers

WORKER = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from _backends import TIKTOKEN_GPT2, TOKENIZERS_GPT2, iter_texts, load_tiktoken
from streampack.tokenizer.pieces import PieceRule

backend, corpus = sys.argv[2], sys.argv[3]
limit_chars, target, batch_chars, max_chars = map(int, sys.argv[4:8])
texts, total = [], 0
for text in iter_texts(corpus):
    if total >= limit_chars:
        break
    texts.append(text)
    total += len(text)
if target:
    rule = PieceRule(max(target, max_chars), target if target < max_chars else None)
    texts = [piece for text in texts for piece in rule.split(text)]
batches, batch, size = [], [], 0
for text in texts:
    batch.append(text)
    size += len(text)
    if size >= batch_chars:
        batches.append(batch)
        batch, size = [], 0
if batch:
    batches.append(batch)
if backend == "tokenizers":
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(TOKENIZERS_GPT2)
    encode = lambda b: [len(e) for e in tok.encode_batch_fast(b, add_special_tokens=False)]
elif backend == "fastokens":
    import fastokens
    os.environ.setdefault("FASTOKENS_BPE_THREADS", str(os.cpu_count() or 1))
    fast = fastokens.Tokenizer.from_file(TOKENIZERS_GPT2)
    def encode(b):
        ids, offsets = fast.encode_batch_flat(b, add_special_tokens=False)
        return [len(ids) // 4]
else:
    enc = load_tiktoken(TIKTOKEN_GPT2)
    threads = os.cpu_count() or 1
    encode = lambda b: [len(ids) for ids in enc.encode_ordinary_batch(b, num_threads=threads)]
start, tokens = time.perf_counter(), 0
cpu = os.times()
for b in batches:
    tokens += sum(encode(b))
end = os.times()
seconds, cpu_s = time.perf_counter() - start, end.user - cpu.user + end.system - cpu.system
print(json.dumps({"seconds": seconds, "cpu": cpu_s, "tokens": tokens, "pieces": len(texts), "chars": total}))
"""


def run(backend: str, corpus: str, limit_chars: int, target: int) -> dict[str, float]:
    """One subprocess encoding the texts whole (``target`` 0) or in pieces of about ``target`` chars."""
    args = [str(HERE), backend, corpus, str(limit_chars), str(target), str(BATCH_CHARS), str(MAX_PIECE_CHARS)]
    out = subprocess.run([sys.executable, "-c", WORKER, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True, help="JSONL file with a `text` field per line")
    parser.add_argument("--mb", type=float, default=100.0, help="use the first MB (10^6 chars) of text")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--targets", default="100000,20000,10000,5000", help="piece sizes to compare")
    parser.add_argument("--backends", default="tokenizers,tiktoken,fastokens")
    parser.add_argument("--out", default=str(HERE / "results" / "pieces.md"))
    args = parser.parse_args()
    limit = int(args.mb * 1e6)
    rows = [
        (backend, target)
        for backend in args.backends.split(",")
        for target in [0, *map(int, args.targets.split(","))]
    ]
    results: dict[tuple[str, int], list[dict[str, float]]] = {row: [] for row in rows}
    for round_ in range(args.rounds):
        for row in rows if round_ % 2 == 0 else rows[::-1]:
            results[row].append(run(row[0], args.corpus, limit, row[1]))
            print(
                f"[bench_pieces] round {round_}: {row[0]} {row[1] or 'whole'}: {results[row][-1]}",
                file=sys.stderr,
            )
    lines = [
        "# Piece size: the raw batch call over whole documents and over pieces",
        "",
        f"- run: {datetime.datetime.now():%Y-%m-%d %H:%M}, `bench_pieces.py {' '.join(sys.argv[1:])}`",
        f"- {os.cpu_count()} cores; the first {args.mb:g} MB of text of `{args.corpus}`; batches of "
        f"{BATCH_CHARS >> 20} M characters; pieces cut by `PieceRule(max_chars={MAX_PIECE_CHARS:,}, target)`",
        f"- medians of {args.rounds} rounds (row order alternating); ratio = baseline seconds / row seconds, "
        "median of the per-round ratios",
        "",
        "| backend | pieces of about | pieces | M tokens | encode s | CPU s | ratio to whole documents |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for backend, target in rows:
        runs, base = results[(backend, target)], results[(backend, 0)]
        if {r["tokens"] for r in runs} != {base[0]["tokens"]}:
            raise SystemExit(f"{backend} {target}: the pieces gave other token counts than whole documents")
        ratio = statistics.median(b["seconds"] / r["seconds"] for b, r in zip(base, runs))
        seconds, cpu = (statistics.median(r[key] for r in runs) for key in ("seconds", "cpu"))
        label = f"{target:,} chars" if target else "whole documents (baseline)"
        lines.append(
            f"| {backend} | {label} | {runs[0]['pieces']:,} | {runs[0]['tokens'] / 1e6:.1f} | "
            f"{seconds:.2f} | {cpu:.2f} | {ratio:.3f} |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    Path(args.out).write_text(report)


if __name__ == "__main__":
    main()

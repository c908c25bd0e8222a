"""Other formats' caches opened and read, and Megatron's own path side by side:
`python benchmarks/bench_foreign.py [--corpus natural.jsonl] [--quick]`.

Three tables, each row measured in fresh processes, in one run:

1. **Open**: a native cache of the corpus (GPT-2, default build) and of the corpus 4x, exported to every
   format ``streampack.open`` reads; the time of ``streampack.open`` (median of ``--repeats`` in one
   process, after the imports) and the RSS it adds, beside the native cache's (goal for Megatron: < 0.5 s
   and within 50 MB of the native open; O(index), so 4x costs about 4x of a small number).
2. **Loader**: a ``Loader`` over ``sequences(2048)``, batch 8, shuffled, over each opened cache ÷ the same
   Loader over the native cache (same tokens), timed alternately in one process, best of ``--repeats``
   (goal >= 0.9).
3. **Megatron's path**: ``streampack build`` + ``streampack export --to megatron`` (two CLI processes)
   against megatron-core's ``IndexedDatasetBuilder`` fed by ``tokenizers``' ``encode_batch`` (its Rust
   threads on every core; what ``tools/preprocess_data.py`` does, minus its per-document Python
   encoder), on the same corpus and tokenizer: wall time, peak RSS of the process tree, and whether the
   ``.bin`` and ``.idx`` bytes are the same.

The corpus defaults to ``corpus/natural.jsonl`` in ``$STREAMPACK_SHARED_DATA`` or ``../shared/data``
(``make_corpus.sh`` makes it); ``--quick`` uses the 12 MB sample and one repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import run as measure
from _report import environment, goal, publish

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("STREAMPACK_SHARED_DATA", ROOT.parent / "shared" / "data"))
SAMPLE = SHARED_DATA / "corpus" / "natural-sample.jsonl.zst"
TOKENIZER = SHARED_DATA / "tokenizers" / "gpt2" / "tokenizer.json"
EOS = 50256

#: Formats to open: (name, export options, open keywords).
FORMATS = [
    ("megatron", {}, {"eos_id": EOS}),
    ("datatrove", {}, {"eos_id": EOS}),
    ("olmo", {}, {}),
    ("nanogpt", {}, {"eos_id": EOS}),
    ("llmc", {}, {}),
    ("mds", {}, {}),
]

OPEN_PROBE = """
import json, statistics, sys, time
import numpy as np
import streampack
path, repeats, keywords = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
before = rss()
times, kept = [], []
for _ in range(repeats):
    start = time.perf_counter()
    cache = streampack.open(path, **keywords)
    times.append(time.perf_counter() - start)
    kept.append(cache)
added = rss() - before
cache.doc(cache.num_docs - 1)  # a read, so that nothing is left to do lazily
print(json.dumps({"open_s": statistics.median(times), "rss_mb": added, "docs": cache.num_docs}))
"""

LOADER_PROBE = """
import json, sys, time
import streampack
native, foreign, repeats, batches = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
keywords = json.loads(sys.argv[5])
caches = {"native": streampack.open(native), "foreign": streampack.open(foreign, **keywords)}
best = {name: float("inf") for name in caches}
for _ in range(repeats):
    for name, cache in caches.items():
        loader = streampack.Loader(cache.sequences(2048), batch_size=8, seed=0)
        start = time.perf_counter()
        for _, batch in zip(range(batches), loader):
            batch.sum()  # touch every token
        best[name] = min(best[name], time.perf_counter() - start)
print(json.dumps(best))
"""

MEGATRON_PROBE = """
import sys
import numpy as np, orjson, torch
from tokenizers import Tokenizer
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
corpus, tokenizer_path, prefix = sys.argv[1], sys.argv[2], sys.argv[3]
tokenizer = Tokenizer.from_file(tokenizer_path)
builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(tokenizer.get_vocab_size()))
def flush(texts):
    for encoding in tokenizer.encode_batch(texts):
        builder.add_item(torch.tensor(encoding.ids + [50256], dtype=torch.int64))
        builder.end_document()
texts = []
with open(corpus, "rb") as f:
    for line in f:
        texts.append(orjson.loads(line)["text"])
        if len(texts) == 1000:
            flush(texts)
            texts = []
flush(texts)
builder.finalize(prefix + ".idx")
"""


def main() -> None:
    """Build the caches and exports, run the three tables, print and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default=str(SHARED_DATA / "corpus" / "natural.jsonl"))
    parser.add_argument("--quick", action="store_true", help="the 12 MB sample, one repeat (a smoke run)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=20000, help="batches per timed Loader run")
    parser.add_argument("--tmp", default=os.path.join(tempfile.gettempdir(), "streampack-bench-foreign"))
    parser.add_argument("--out", help="report file (default benchmarks/results/foreign[-quick].md)")
    args = parser.parse_args()
    tmp = Path(args.tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        corpus = corpus_file(args, tmp)
        report = measure_all(corpus, tmp, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    publish(report, "foreign", args)


def corpus_file(args: argparse.Namespace, tmp: Path) -> Path:
    """The corpus as JSONL (the sample, decompressed, with ``--quick``)."""
    if args.quick:
        if not SAMPLE.exists():
            sys.exit(f"the sample corpus is not at {SAMPLE} (../shared/data)")
        out = tmp / "sample.jsonl"
        out.write_bytes(zstandard.ZstdDecompressor().stream_reader(SAMPLE.open("rb")).read())
        return out
    corpus = Path(args.corpus)
    if not corpus.exists():
        sys.exit(
            f"bench_foreign: no corpus at {corpus}; make it with ../shared/data/make_corpus.sh or --corpus"
        )
    return corpus


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "streampack", *args]


def python(code: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_all(corpus: Path, tmp: Path, args: argparse.Namespace) -> str:
    import streampack
    from streampack.reader.foreign.opening import READERS

    repeats = 1 if args.quick else args.repeats
    batches = 200 if args.quick else args.batches
    lines = [f"# Other formats opened and read{' (--quick)' if args.quick else ''}", "", environment(), ""]
    goals: list[str] = []

    # 3 first: its build is the 1x cache the other tables use.
    side = megatron_side_by_side(corpus, tmp)
    native = {"1x": tmp / "streampack-cache"}
    four = tmp / "corpus-4x.jsonl"
    with open(four, "wb") as out:
        for _ in range(4):
            with open(corpus, "rb") as f:
                shutil.copyfileobj(f, out, 64 << 20)
    streampack.build(four, tmp / "native-4x", tokenizer=str(TOKENIZER), progress=False)
    four.unlink()
    native["4x"] = tmp / "native-4x"
    one = streampack.open(native["1x"])
    lines += [
        f"Corpus {corpus.name}: {one.num_docs:,} documents, {one.num_tokens:,} tokens (1x); the 4x cache is "
        "the corpus repeated four times.",
        "",
        "## Open",
        "",
        "| cache | open s (1x) | RSS added MB (1x) | open s (4x) | RSS added MB (4x) |",
        "|---|---:|---:|---:|---:|",
    ]
    opened = {}
    for scale, cache in native.items():
        opened[("native", scale)] = python(OPEN_PROBE, str(cache), str(repeats), "{}")
    lines.append(open_row("native", opened, "native"))
    sources = {}
    for name, options, keywords in FORMATS:
        if name not in READERS:
            continue
        for scale, cache in native.items():
            dest = tmp / f"{name}-{scale}"
            streampack.open(cache).export(name, dest, **options)
            opened[(name, scale)] = python(OPEN_PROBE, str(dest), str(repeats), json.dumps(keywords))
            sources[(name, scale)] = (dest, keywords)
        lines.append(open_row(name, opened, name))
        for scale in native:
            base, row = opened[("native", scale)], opened[(name, scale)]
            if name == "megatron":
                goals.append(goal(f"megatron open s ({scale})", row["open_s"], "<=", 0.5))
                goals.append(
                    goal(
                        f"megatron open RSS − native's MB ({scale})", row["rss_mb"] - base["rss_mb"], "<=", 50
                    )
                )
        print(lines[-1], file=sys.stderr, flush=True)

    lines += ["", f"## Loader ({batches} batches of 8 x 2048, shuffled; best of {repeats})", "",
              "| cache | native s | opened s | throughput ÷ native |", "|---|---:|---:|---:|"]  # fmt: skip
    for (name, scale), (dest, keywords) in sources.items():
        if scale != "1x":
            continue
        best = python(
            LOADER_PROBE, str(native["1x"]), str(dest), str(repeats), str(batches), json.dumps(keywords)
        )
        ratio = best["native"] / best["foreign"]
        lines.append(f"| {name} | {best['native']:.3f} | {best['foreign']:.3f} | {ratio:.2f} |")
        goals.append(goal(f"Loader over {name} ÷ native", ratio, ">=", 0.9))
        print(lines[-1], file=sys.stderr, flush=True)

    lines += ["", "## Megatron's own path, same corpus and tokenizer", "", *side["lines"]]
    goals += side["goals"]
    return "\n".join([*lines, "", "Goals:", "", *goals, ""])


def open_row(label: str, opened: dict, name: str) -> str:
    one, four = opened[(name, "1x")], opened[(name, "4x")]
    cells = [f"{row['open_s']:.4f} | {row['rss_mb']:.1f}" for row in (one, four)]
    return f"| {label} | {' | '.join(cells)} |"


def megatron_side_by_side(corpus: Path, tmp: Path) -> dict:
    """streampack build + export against IndexedDatasetBuilder fed by tokenizers; the cache is kept."""
    cache, ours, theirs = tmp / "streampack-cache", tmp / "ours", tmp / "theirs"
    build = measure(
        cli("build", str(corpus), "--out", str(cache), "--tokenizer", str(TOKENIZER), "--no-progress")
    )
    if build.returncode:
        raise RuntimeError(build.stderr[-3000:])
    export = measure(cli("export", str(cache), "--to", "megatron", "--out", str(ours), "--no-progress"))
    if export.returncode:
        raise RuntimeError(export.stderr[-3000:])
    env = {"PYTHONPATH": str(ROOT)}
    megatron = measure(
        [sys.executable, "-c", MEGATRON_PROBE, str(corpus), str(TOKENIZER), str(theirs)], env=env
    )
    if megatron.returncode:
        raise RuntimeError(megatron.stderr[-3000:])
    same = all(Path(f"{ours}{s}").read_bytes() == Path(f"{theirs}{s}").read_bytes() for s in (".bin", ".idx"))
    wall = build.wall_s + export.wall_s
    lines = [
        "| path | wall s | peak RSS MB | same .bin and .idx bytes |",
        "|---|---:|---:|---|",
        f"| streampack build + export megatron | {wall:.1f} ({build.wall_s:.1f} + {export.wall_s:.1f}) "
        f"| {max(build.peak_rss_mb, export.peak_rss_mb):.0f} | {'yes' if same else '**no**'} |",
        f"| megatron-core IndexedDatasetBuilder + tokenizers encode_batch | {megatron.wall_s:.1f} "
        f"| {megatron.peak_rss_mb:.0f} | |",
        "",
        f"Speed-up: {megatron.wall_s / wall:.2f}x the Megatron path's wall time.",
    ]
    goals = [goal("same ids as Megatron's path (1 = yes)", float(same), ">=", 1)]
    return {"lines": lines, "goals": goals}


if __name__ == "__main__":
    main()

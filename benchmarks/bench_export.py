"""Export throughput and memory, per format: `python benchmarks/bench_export.py [--quick]`.

Builds two caches of the real sample corpus (../shared/data, GPT-2): 1x, and 4x (the corpus repeated four
times). For every export format, a fresh process exports the 4x cache ``--repeats`` times (the best time
counts) and the 1x cache once; the baseline, measured the same way in the same run, is a plain
``shutil.copyfile`` of the cache's shard files (tokens and offsets). The table gives each export's
throughput ÷ the copy's on the same bytes (the copy's seconds ÷ the export's; goal >= 0.8), and the peak
RSS (``VmHWM``, imports included) of the 1x and 4x processes (goal: 4x within 50 MB of 1x: memory flat in
the cache's size). ``--quick`` uses the first 100 documents, one repeat: a smoke run; ``--corpus FILE``
another JSONL corpus (the 345 MB one, with ``--unit-bytes 67108864``: shards of a default build), and
``--rows convert,megatron`` only the rows whose names hold one of those texts. The ``convert``
rows time ``streampack.interop.convert`` of an export of the cache (made beforehand, not timed) into a
native cache, against the same copy.

Notes on the figures:

* Each row's ratio is over the copy measured in the same process, alternately with the export (best of
  each; the copy before the export, then after it, in turn): the machines this runs on are shared, and a
  copy measured once at the start drifted 6x from row to row. The probes import the tree first, then the
  caller's ``PYTHONPATH`` (so that ``isal``, which :data:`streampack.format.names.crc32` uses where it is
  installed, can be measured from outside the venv).
* Why the single-file formats (megatron, nanogpt, llmc) stay under a copy of the shard files: the kernel
  copies a shard's bytes into the middle of one file, at an offset whose remainder modulo the page size
  is not the source's (the shards' sizes are not whole pages; llm.c's header is 1,024 bytes), and a copy
  between pages that do not line up costs about 1.4x one that does (measured here: 22 shard files into
  22 new files 0.49 s, into 22 files behind a 1,024-byte header 0.70 s, median of 9). A ``convert``
  whose native shards are cut between documents pays the same on every shard but the first.
* For those formats the table also gives the export ÷ a *joined copy*: the same shard files appended to one
  file (tokens, and offsets) by the same kernel copy, ``os.copy_file_range``, which pays the same
  misalignment: the plain form of writing a cache's tokens into one file.
* Nothing is fsynced by default, as in the copy (see :mod:`streampack.interop.writing`); the
  ``megatron --durable`` row fsyncs every file before the move into place, and measures what that costs:
  its joined copy fsyncs its files and their folder too (the plain form of a durable export).
* The caches have shards of about 1 MiB of input (0.6 MB of tokens; a default build's are 64 MiB): a format
  that writes more files than the copy's two a shard (datatrove's ``.ds`` + ``.index`` + ``.metadata``,
  OLMo's ``.npy`` + ``.csv.gz``) pays file creation (``open(O_CREAT)`` on ext4 here: about 0.4 ms a file)
  on every shard, whatever the bytes: its ratio is about 2 ÷ files a shard at this shard size, and nearer
  1 as shards grow (``--unit-bytes``).
* hf writes 4 (``input_ids`` int32) to 20 (with int64 ``labels`` and ``position_ids``) bytes a token where
  the cache holds 2, and Parquet encodes and compresses them: no copy of the cache's bytes is its measure.
  Its rows also give the time of pyarrow alone writing the same record batches from memory with the same
  writer (``÷ pyarrow``): what is left is streampack's reading and building of the batches.
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
from _report import environment, goal, publish

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
CORPUS = DATA / "corpus" / "natural-sample.jsonl.zst"
TOKENIZER = DATA / "tokenizers" / "gpt2" / "tokenizer.json"

#: (row name, format, options)
ROWS = [
    ("megatron", "megatron", {}),
    ("megatron --durable", "megatron", {"durable": True}),
    ("llmc", "llmc", {}),
    ("nanogpt", "nanogpt", {}),
    ("nanogpt --val 0.01", "nanogpt", {"val": 0.01}),
    ("datatrove", "datatrove", {}),
    ("olmo", "olmo", {}),
    ("hf (parquet, documents)", "hf", {}),
    ("hf (arrow, --seq-len 2048 --packed)", "hf", {"files": "arrow", "seq_len": 2048, "packed": True}),
    ("mds (documents)", "mds", {}),
    ("mds (--seq-len 2048)", "mds", {"seq_len": 2048}),
    ("convert from megatron", "convert", {"source": "megatron", "open": {"eos_id": 50256}}),
    ("convert from datatrove", "convert", {"source": "datatrove", "open": {"eos_id": 50256}}),
    ("convert from olmo", "convert", {"source": "olmo", "open": {}}),
    ("convert from nanogpt", "convert", {"source": "nanogpt", "open": {"eos_id": 50256}}),
    ("convert from llmc", "convert", {"source": "llmc", "open": {}}),
    ("convert from mds", "convert", {"source": "mds", "open": {}}),
]

# The formats that write the cache's tokens into one file (at this cache's size): their plain form is a copy
# that joins the shard files (see the notes).
SINGLE_FILE = ("megatron", "llmc", "nanogpt")

PROBE = (
    f"SINGLE_FILE = {SINGLE_FILE!r}\n"
    + """
import json, re, shutil, sys, time
import streampack, streampack.interop
cache_dir, out, kind, repeats = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
options = json.loads(sys.argv[5])
cache = streampack.open(cache_dir)
if kind != "copy":
    import importlib
    importlib.import_module(streampack.interop.FORMATS.get(kind, "streampack.interop.hf"))  # not timed
    importlib.import_module("streampack.interop.native")
def copy_shards(dest):
    import os
    os.makedirs(dest)
    for shard in range(cache.num_shards):
        for path in cache.shard_paths(shard):
            shutil.copyfile(path, f"{dest}/{path.name}")
def join_shards(dest):
    # The plain form of a single-file export: every shard's tokens (and offsets) appended to one file by
    # the same kernel copy, so that a shard lands at an offset its pages do not line up with.
    import os
    os.makedirs(dest)
    with open(f"{dest}/tokens", "wb") as tokens, open(f"{dest}/offsets", "wb") as offsets:
        for shard in range(cache.num_shards):
            for path, out in zip(cache.shard_paths(shard), (tokens, offsets)):
                with open(path, "rb") as f:
                    left = os.fstat(f.fileno()).st_size
                    while left > 0:
                        n = os.copy_file_range(f.fileno(), out.fileno(), left)
                        if n == 0:
                            break
                        left -= n
        if options.get("durable"):  # the plain form of a durable export: each file, then the folder, fsynced
            for f in (tokens, offsets):
                f.flush()
                os.fsync(f.fileno())
    if options.get("durable"):
        folder = os.open(dest, os.O_RDONLY)
        os.fsync(folder)
        os.close(folder)
best = paired = joined = float("inf")
def paired_copy(dest):
    global paired, joined
    start = time.perf_counter()
    copy_shards(f"{dest}-copy")
    paired = min(paired, time.perf_counter() - start)
    shutil.rmtree(f"{dest}-copy")
    if kind in SINGLE_FILE:
        start = time.perf_counter()
        join_shards(f"{dest}-joined")
        joined = min(joined, time.perf_counter() - start)
        shutil.rmtree(f"{dest}-joined")
for r in range(repeats):
    dest = f"{out}/{r}"
    # The copy again, beside each export (before it, then after it: neither pays the other's page cache
    # state every time): on a shared machine the load changes from row to row.
    if kind != "copy" and r % 2 == 0:
        paired_copy(dest)
    start = time.perf_counter()
    if kind == "copy":
        copy_shards(dest)
    elif kind == "pyarrow":  # the hf export's batches, built beforehand, written by pyarrow alone
        import os
        import pyarrow as pa, pyarrow.parquet as pq
        from streampack.interop import hf
        if r == 0:
            chosen = hf.Options(**options)
            held = [b for b, _ in hf.batches(cache, chosen)]
            schema = hf.schema(hf.columns_of(cache, chosen))
        os.makedirs(dest)
        start = time.perf_counter()
        if chosen.files == "arrow":
            with open(f"{dest}/x.arrow", "wb") as f, pa.ipc.new_stream(f, schema) as w:
                for b in held:
                    w.write_batch(b)
        else:
            with open(f"{dest}/x.parquet", "wb") as f, pq.ParquetWriter(f, schema, use_dictionary=False) as w:
                for b in held:
                    w.write_batch(b)
    elif kind == "convert":  # a native cache of the cache's export to another format
        source = f"{out}/source-{options['source']}"
        if r == 0:
            cache.export(options["source"], source, overwrite=True, progress=False)
            streampack.open(source, **options["open"])  # the reader's imports, not timed
        start = time.perf_counter()
        streampack.interop.convert(source, f"{dest}/x", progress=False, **options["open"])
    else:
        cache.export(kind, f"{dest}/x", progress=False, **options)
    best = min(best, time.perf_counter() - start)
    shutil.rmtree(dest)
    if kind != "copy" and r % 2 == 1:
        paired_copy(dest)
peak_kb = re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)
figures = {"seconds": best, "copy_seconds": paired, "joined_seconds": joined}
print(json.dumps({**figures, "peak_mb": int(peak_kb) / 1024}))
"""
)


def main() -> None:
    """Build the caches, run every row, print and write the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="the first 100 documents, one repeat (a smoke run)"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="exports of the 4x cache per row (best counts)"
    )
    parser.add_argument(
        "--unit-bytes", type=int, default=1 << 20, help="input bytes a shard of the caches holds (1 MiB)"
    )
    parser.add_argument(
        "--corpus",
        help="a JSONL corpus instead of the sample (e.g. natural.jsonl of ../shared/data/make_corpus.sh)",
    )
    parser.add_argument(
        "--rows", default="", help="only the rows whose name contains one of these comma-separated texts"
    )
    parser.add_argument("--tmp", default=os.path.join(tempfile.gettempdir(), "streampack-bench-export"))
    parser.add_argument("--out", help="report file (default benchmarks/results/export[-quick].md)")
    args = parser.parse_args()
    if not CORPUS.exists():
        sys.exit(f"the sample corpus is not at {CORPUS} (../shared/data)")
    repeats = 1 if args.quick else args.repeats
    tmp = Path(args.tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        caches = build_caches(tmp, quick=args.quick, unit_bytes=args.unit_bytes, corpus=args.corpus)
        report = measure_all(caches, tmp, repeats, args.quick, args.rows)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    publish(report, "export", args)


def build_caches(
    tmp: Path, *, quick: bool, unit_bytes: int = 1 << 20, corpus: str | None = None
) -> dict[str, Path]:
    """The 1x and 4x caches (shards of about ``unit_bytes`` of input each), of the sample or ``corpus``."""
    import streampack

    if corpus is not None:
        text = Path(corpus).read_bytes()
    else:
        text = zstandard.ZstdDecompressor().stream_reader(CORPUS.open("rb")).read()
    if quick:
        text = b"".join(text.splitlines(keepends=True)[:100])
    caches = {}
    for times in (1, 4):
        src = tmp / f"corpus-{times}x.jsonl"
        with open(src, "wb") as f:
            for _ in range(times):
                f.write(text)
        caches[f"{times}x"] = out = tmp / f"cache-{times}x"
        streampack.build(src, out, tokenizer=str(TOKENIZER), unit_bytes=unit_bytes, progress=False)
        src.unlink()
    return caches


def run(cache: Path, out: Path, kind: str, repeats: int, options: dict) -> dict:
    """One row's measurement in a fresh process."""
    out.mkdir(parents=True, exist_ok=True)
    # The tree first, then what the caller put on the path (a package installed beside the venv).
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    cmd = [sys.executable, "-c", PROBE, str(cache), str(out), kind, str(repeats), json.dumps(options)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"{kind} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_all(caches: dict[str, Path], tmp: Path, repeats: int, quick: bool, only: str = "") -> str:
    import streampack

    big = streampack.open(caches["4x"])
    size_mb = sum(p.stat().st_size for s in range(big.num_shards) for p in big.shard_paths(s)) / 2**20
    copy = run(caches["4x"], tmp / "copy", "copy", repeats, {})
    copy_1x = run(caches["1x"], tmp / "copy1", "copy", 1, {})
    lines = [
        f"# Export throughput and memory{' (--quick)' if quick else ''}",
        "",
        environment(),
        "",
        f"4x cache: {big.num_docs:,} documents, {big.num_tokens:,} tokens, {big.num_shards} shards, "
        f"{size_mb:.1f} MB of shard files; best of {repeats}. Baseline: `shutil.copyfile` of those files, "
        f"{copy['seconds']:.3f} s ({size_mb / copy['seconds']:.0f} MB/s), peak RSS "
        f"{copy_1x['peak_mb']:.0f} MB (1x) / {copy['peak_mb']:.0f} MB (4x).",
        "",
        "| format | export s (4x) | MB/s | throughput ÷ copy | ÷ joined copy | peak RSS 1x MB "
        "| peak RSS 4x MB | 4x − 1x MB | ÷ pyarrow |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    goals = []
    chosen = [row for row in ROWS if any(part in row[0] for part in only.split(","))]
    for name, kind, options in chosen:
        four = run(caches["4x"], tmp / "rows", kind, repeats, options)
        one = run(caches["1x"], tmp / "rows", kind, 1, options)
        ratio = four["copy_seconds"] / four["seconds"]
        growth = four["peak_mb"] - one["peak_mb"]
        alone = ""
        if kind == "hf":
            pyarrow = run(caches["4x"], tmp / "rows", "pyarrow", repeats, options)
            alone = f"{pyarrow['seconds'] / four['seconds']:.2f}"
        joined = ""
        if kind in SINGLE_FILE:
            joined = f"{four['joined_seconds'] / four['seconds']:.2f}"
        lines.append(
            f"| {name} | {four['seconds']:.3f} | {size_mb / four['seconds']:.0f} | {ratio:.2f} | {joined} "
            f"| {one['peak_mb']:.0f} | {four['peak_mb']:.0f} | {growth:+.0f} | {alone} |"
        )
        goals.append(goal(f"{name}: throughput ÷ copy", ratio, ">=", 0.8))
        if joined:
            plain = "the plain form of a single-file export"
            if options.get("durable"):
                plain = "the joined copy, its files and folder fsynced: a durable export's plain form"
            goals.append(f"- {name}: throughput ÷ the joined copy = {joined} ({plain})")
        goals.append(goal(f"{name}: peak RSS 4x − 1x (MB)", growth, "<=", 50))
        print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join([*lines, "", "Goals:", "", *goals, ""])


if __name__ == "__main__":
    main()

"""Benchmark the record work of a build: ways to turn a JSONL file into the texts an engine encodes.

The build's reader (:func:`streampack.inputs.units.read_unit`, the baseline: ratio 1.00) against the
candidates for taking that work off the build's main thread or making it cheaper: plain line iteration with
``orjson`` (what the reader does, without its bookkeeping), ``mmap`` with ``orjson`` on memoryview slices,
``msgspec`` with a one-field schema (where installed), pyarrow's multi-threaded JSON reader with the column
turned into Python strings, and a reader *process* that parses and sends batches of about 1 MiB of texts
over a pipe (the work leaves the main process, whose GIL the encoder threads share, but crosses a pipe).
Beside them, the fast engine's own CPU for encoding the same texts (``fastokens`` ``encode_batch_flat``,
GPT-2 ``tokenizer.json``), so the table says what share of a build's CPU the record work is.

Every row is its own subprocess over the file in the page cache (a warm-up read first); rounds alternate
the order of the rows; the table shows medians of CPU seconds (all threads and processes of the row) and
wall seconds, and the median per-round ratio of the baseline's CPU to the row's. Each row must give the
same number of characters as the baseline.

Usage::

    python benchmarks/bench_records.py --corpus natural.jsonl [--rounds 3] [--out results/records.md]
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
ROOT = HERE.parent
ROWS = ("streampack reader", "lines + orjson", "mmap + orjson", "msgspec", "pyarrow.json", "reader process")
ENGINE_ROW = "fastokens encode (for scale)"

_WORKER = r"""
import json, mmap, os, sys, time
sys.path.insert(0, sys.argv[1])
row, path, tokenizer = sys.argv[2], sys.argv[3], sys.argv[4]
BATCH = 1 << 20

# Each reader imports what it needs first, then returns the iterator that is timed.
def streampack_reader():
    from streampack.inputs.inputfile import InputFile
    from streampack.inputs.records import ReadOptions, WorkUnit
    from streampack.inputs.units import read_unit
    file = InputFile(path, "jsonl", None, os.path.getsize(path), None)
    return read_unit(WorkUnit(0, file), ReadOptions())

def lines_orjson():
    import orjson
    return _lines_orjson(orjson)

def _lines_orjson(orjson):
    with open(path, "rb", buffering=1 << 20) as f:
        for line in f:
            yield orjson.loads(line)["text"]

def mmap_orjson():
    import orjson
    return _mmap_orjson(orjson)

def _mmap_orjson(orjson):
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view, pos, size = memoryview(mm), 0, len(mm)
        while pos < size:
            end = mm.find(b"\n", pos)
            end = size if end < 0 else end
            if end > pos:
                yield orjson.loads(view[pos:end])["text"]
            pos = end + 1
        view.release()

def msgspec_struct():
    import msgspec
    class Record(msgspec.Struct):
        text: str
    return _msgspec(msgspec.json.Decoder(Record).decode)

def _msgspec(decode):
    with open(path, "rb", buffering=1 << 20) as f:
        for line in f:
            yield decode(line).text

def pyarrow_json():
    import pyarrow.json as pj
    return _pyarrow(pj)

def _pyarrow(pj):
    table = pj.read_json(path, read_options=pj.ReadOptions(block_size=1 << 28))
    yield from table.column("text").to_pylist()

def batched(texts):
    batch, size = [], 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= BATCH:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch

def reader_process():
    import multiprocessing as mp
    import orjson
    return _reader_process(mp)

def _reader_process(mp):
    def send(conn):
        for batch in batched(lines_orjson()):
            conn.send(batch)
        conn.send(None)
        conn.close()
    receive, give = mp.Pipe(duplex=False)
    child = mp.get_context("fork").Process(target=send, args=(give,))
    child.start()
    give.close()
    while (batch := receive.recv()) is not None:
        yield from batch
    child.join()

def engine():
    import orjson, fastokens
    os.environ.setdefault("FASTOKENS_BPE_THREADS", str(os.cpu_count() or 1))
    fast = fastokens.Tokenizer.from_file(tokenizer)
    with open(path, "rb", buffering=1 << 20) as f:
        texts = [orjson.loads(line)["text"] for line in f]
    before = os.times()
    start = time.perf_counter()
    for batch in batched(texts):
        fast.encode_batch_flat(batch, add_special_tokens=False)
    return sum(map(len, texts)), time.perf_counter() - start, before

ROW_READERS = {
    "streampack reader": streampack_reader, "lines + orjson": lines_orjson, "mmap + orjson": mmap_orjson,
    "msgspec": msgspec_struct, "pyarrow.json": pyarrow_json, "reader process": reader_process,
}
if row == "fastokens encode (for scale)":
    chars, seconds, before = engine()
else:
    try:
        reader = ROW_READERS[row]()
        before = os.times()
        start = time.perf_counter()
        chars = sum(len(text) for text in reader if text)
        seconds = time.perf_counter() - start
    except ImportError as e:
        print(json.dumps({"skipped": str(e)}))
        raise SystemExit(0)
after = os.times()
cpu = sum(after[:4]) - sum(before[:4])  # this process and its children (the reader process)
print(json.dumps({"chars": chars, "seconds": seconds, "cpu": cpu}))
"""


def run(row: str, corpus: str, tokenizer: str) -> dict[str, float | str]:
    """One subprocess giving the row's texts (or encoding them, for the engine row)."""
    args = [sys.executable, "-c", _WORKER, str(ROOT), row, corpus, tokenizer]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    """Run the rows, print the table and write it to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", required=True, help="JSONL file with a `text` field per line")
    parser.add_argument("--rounds", type=int, default=3)
    default_tokenizer = ROOT.parent / "shared" / "data" / "tokenizers" / "gpt2" / "tokenizer.json"
    parser.add_argument("--tokenizer-json", default=str(default_tokenizer))
    parser.add_argument("--out", default=str(HERE / "results" / "records.md"))
    args = parser.parse_args()
    Path(args.corpus).read_bytes()  # into the page cache
    rows = (*ROWS, ENGINE_ROW)
    results: dict[str, list[dict[str, float | str]]] = {row: [] for row in rows}
    for round_ in range(args.rounds):
        for row in rows if round_ % 2 == 0 else rows[::-1]:
            results[row].append(run(row, args.corpus, args.tokenizer_json))
            print(f"[bench_records] round {round_}: {row}: {results[row][-1]}", file=sys.stderr)
    print(_report(args, results))


def _report(args: argparse.Namespace, results: dict[str, list[dict[str, float | str]]]) -> str:
    base = results[ROWS[0]]
    mb = os.path.getsize(args.corpus) / 1e6
    lines = [
        "# Record work: a JSONL file into texts, by each candidate reader",
        "",
        f"- run: {datetime.datetime.now():%Y-%m-%d %H:%M}, `bench_records.py --corpus {args.corpus} "
        f"--rounds {args.rounds}`",
        f"- {os.cpu_count()} cores; {mb:.0f} MB of JSONL in the page cache; each row its own subprocess; "
        "medians of the rounds (row order alternating); CPU = user + system seconds of the row's process "
        "and its children",
        "",
        "| reader | wall s | CPU s | CPU ÷ the build's reader | CPU s per 100 MB | note |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for row, runs in results.items():
        if any("skipped" in r for r in runs):
            lines.append(f"| {row} | – | – | – | – | not run: {runs[0]['skipped']} |")
            continue
        if runs[0]["chars"] != base[0]["chars"]:
            raise SystemExit(f"{row}: {runs[0]['chars']} characters, the build's reader {base[0]['chars']}")
        wall = statistics.median(float(r["seconds"]) for r in runs)
        cpu = statistics.median(float(r["cpu"]) for r in runs)
        ratio = statistics.median(float(r["cpu"]) / float(b["cpu"]) for r, b in zip(runs, base))
        note = "the engine's CPU over the same texts, already in memory" if row == ENGINE_ROW else ""
        note = note or ("baseline" if row == ROWS[0] else "")
        lines.append(f"| {row} | {wall:.2f} | {cpu:.2f} | {ratio:.2f} | {cpu / mb * 100:.3f} | {note} |")
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    return text


if __name__ == "__main__":
    main()

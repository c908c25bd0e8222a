"""Diagnostic: what feeding a build's engine costs, stage by stage, and the candidate ways to feed it.

Reads the corpus's units as a build reads them (``read_unit_parts``: parts of ~1 MiB of whole lines), then
times each stage alone on one thread, as CPU seconds (``time.process_time``, the engine on one thread so
that its CPU is its own) and wall seconds, best of ``--repeats``:

- today's stages: read (the parts), parse (``LinesPart.items``: split, ``orjson.loads``, the field), cut
  (the build's piece rule), encode (fastokens ``encode_flat``: the ceiling), frame;
- parse's parts: splitting the lines, ``orjson.loads`` of each line alone, the field lookup;
- candidates for parse: msgspec with a ``text: str`` Struct, per line and ``decode_lines`` per part;
  orjson and msgspec over a whole part made one JSON array;
- gigatoken ``encode_batch`` of ``str`` against ``bytes`` and a ``BytesSource``; ``encode_files`` over a
  ``JsonlFileSource`` (the whole file: it takes no byte range);
- pyarrow's JSON reader (native, lets go of the GIL) into arrow strings, then ``str`` or gigatoken;
- which calls let go of the GIL: each run on two threads at once, wall against one thread.

Usage: ``python benchmarks/_feed_candidates.py --corpus FILE [--repeats 3] [--only parse,gil]``
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("FASTOKENS_BPE_THREADS", "1")  # read when its pool starts: the engine's own CPU

import msgspec
import numpy as np
import orjson
from _backends import TOKENIZERS_GPT2

from streampack.inputs.discovery import expand_inputs
from streampack.inputs.lines import LinesPart, _split_lines
from streampack.inputs.records import ReadOptions
from streampack.inputs.units import plan_units, read_unit_parts

GPT2 = TOKENIZERS_GPT2  # ../shared/data, or $STREAMPACK_SHARED_DATA


class _Text(msgspec.Struct):
    text: str


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """(CPU s, wall s) of ``fn``: the run of least CPU of ``repeats``."""
    best = (float("inf"), 0.0)
    for _ in range(repeats):
        c, w = time.process_time(), time.perf_counter()
        fn()
        best = min(best, (time.process_time() - c, time.perf_counter() - w))
    return best


def two_threads(fn: Callable[[list[Any]], Any], chunks: list[Any]) -> Callable[[], Any]:
    """``fn`` over each half of ``chunks`` on a thread of its own, at once."""
    halves = [chunks[0::2], chunks[1::2]]

    def run() -> None:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(fn, halves))

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--tokenizer", default=GPT2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="stages,parse,gil,arrow,gigatoken")
    args = parser.parse_args()
    only, r = set(args.only.split(",")), args.repeats
    rows: list[tuple[str, float, float]] = []

    def row(name: str, fn: Callable[[], Any], repeats: int = r) -> None:
        cpu, wall = timed(fn, repeats)
        rows.append((name, cpu, wall))
        print(f"| {name} | {cpu:.3f} | {wall:.3f} |", flush=True)

    options = ReadOptions()
    (file,) = expand_inputs([args.corpus])
    units = plan_units([file], options)

    def read() -> list[LinesPart]:
        return [p for u in units for p in read_unit_parts(u, options, size=1 << 20)]  # type: ignore[misc]

    parts = read()
    datas = [p.data for p in parts]
    lines = [_split_lines(d) for d in datas]
    texts = [p.items() for p in parts]
    chars = sum(len(t) for ts in texts for t in ts if isinstance(t, str))
    print(f"{len(parts)} parts, {sum(map(len, lines))} lines, {chars / 1e6:.1f} M characters")
    print("| stage | CPU s | wall s |\n|---|---:|---:|")

    if "edges" in only:
        edges(Path(args.tokenizer))
        return
    if "stages" in only:
        from streampack.tokenizer.load import load_tokenizer
        from streampack.tokenizer.pieces import CutCount, piece_rule

        tokenizer = load_tokenizer(args.tokenizer)
        tokenizer.encode_flat(["warm up"])  # its load runs on a thread of its own: done before timing
        rule = piece_rule(tokenizer.cut_safety, tokenizer.fast_piece_chars)
        row("read: parts of whole lines (main thread)", read)
        row("parse: LinesPart.items (today)", lambda: [p.items() for p in parts])
        pieces = [[pc for t in ts if isinstance(t, str) for pc in rule.split(t, CutCount())] for ts in texts]
        row("cut: the piece rule", lambda: [[rule.split(t, CutCount()) for t in ts] for ts in texts])
        row(
            "encode: fastokens encode_flat, 1 thread (ceiling)",
            lambda: [tokenizer.encode_flat(p) for p in pieces],
        )
        from streampack.builder.blocks import frame

        flats = [tokenizer.encode_flat(p) for p in pieces]
        ends = [[True] * len(p) for p in pieces]
        dtype = np.dtype(np.uint16)
        row(
            "frame: BOS/EOS, ends",
            lambda: [frame(f, e, True, None, 50256, dtype) for f, e in zip(flats, ends)],
        )
        row(
            "encode: 2 calls at once, 1 thread each (as a build)",
            two_threads(lambda ps: [tokenizer.encode_flat(p) for p in ps], pieces),
        )

    if "parse" in only:
        loads = orjson.loads
        row("parse.split lines", lambda: [_split_lines(d) for d in datas])
        row("parse.orjson.loads each line", lambda: [[loads(x) for x in ls] for ls in lines])
        row("parse.orjson.loads + ['text']", lambda: [[loads(x)["text"] for x in ls] for ls in lines])
        dec = msgspec.json.Decoder(_Text)
        row("(b) msgspec Struct(text) each line", lambda: [[dec.decode(x).text for x in ls] for ls in lines])
        row(
            "(b) msgspec Struct(text) decode_lines per part",
            lambda: [[s.text for s in dec.decode_lines(d)] for d in datas],
        )
        row(
            "(b) msgspec dict each line",
            lambda: [[msgspec.json.decode(x)["text"] for x in ls] for ls in lines],
        )
        arrays = [b"[" + b",".join(ls) + b"]" for ls in lines]
        row(
            "(c) orjson whole part as array (join incl.)",
            lambda: [[o["text"] for o in loads(b"[" + b",".join(ls) + b"]")] for ls in lines],
        )
        row(
            "(c) orjson whole part as array (join excl.)",
            lambda: [[o["text"] for o in loads(a)] for a in arrays],
        )
        adec = msgspec.json.Decoder(list[_Text])
        row(
            "(c) msgspec whole part as array (join excl.)",
            lambda: [[s.text for s in adec.decode(a)] for a in arrays],
        )
        row(
            "(d) str -> UTF-8 bytes of each text",
            lambda: [[t.encode() for t in ts if isinstance(t, str)] for ts in texts],
        )

    if "gil" in only:
        dec = msgspec.json.Decoder(_Text)
        row("2 threads: LinesPart.items", two_threads(lambda ps: [p.items() for p in ps], parts))
        row(
            "2 threads: msgspec decode_lines",
            two_threads(lambda ds: [dec.decode_lines(d) for d in ds], datas),
        )
        row(
            "2 threads: orjson each line",
            two_threads(lambda ls: [[orjson.loads(x) for x in one] for one in ls], lines),
        )

    if "arrow" in only:
        import pyarrow as pa
        import pyarrow.json as pj

        parse = pj.ParseOptions(
            explicit_schema=pa.schema([("text", pa.string())]), unexpected_field_behavior="ignore"
        )
        read_options = pj.ReadOptions(use_threads=False, block_size=2 << 20)

        def arrow(d: bytes) -> Any:
            return pj.read_json(pa.BufferReader(d), read_options=read_options, parse_options=parse).column(0)

        row("(f) pyarrow.json per part -> arrow strings", lambda: [arrow(d) for d in datas])
        columns = [arrow(d) for d in datas]
        row("(f) arrow strings -> list[str]", lambda: [c.to_pylist() for c in columns])
        row("(f) 2 threads: pyarrow.json per part", two_threads(lambda ds: [arrow(d) for d in ds], datas))

    if "gigatoken" in only:
        import gigatoken

        from streampack.tokenizer.hf import gigatoken_form

        os.environ.setdefault("RAYON_NUM_THREADS", "1")
        tok = gigatoken.Tokenizer.from_json(
            gigatoken_form(Path(args.tokenizer).read_text(), parse_special=False)
        )
        strs = [[t for t in ts if isinstance(t, str)] for ts in texts]
        bts = [[t.encode() for t in ts] for ts in strs]
        for _ in range(2):  # its caches warm: the first pass is slower
            [tok.encode_batch(s, parallel=False) for s in strs]
        row(
            "gigatoken encode_batch str, 1 thread",
            lambda: [tok.encode_batch(s, parallel=False) for s in strs],
        )
        row(
            "gigatoken encode_batch bytes, 1 thread",
            lambda: [tok.encode_batch(b, parallel=False) for b in bts],
        )
        joined = [b"\x00".join(b) for b in bts]  # (no text of the corpus holds NUL)
        row(
            "gigatoken BytesSource (NUL-joined), 1 thread",
            lambda: [
                tok.encode_batch(gigatoken.BytesSource([j], separator=b"\x00"), parallel=False)
                for j in joined
            ],
        )
        if "arrow" in only:  # the texts as UTF-8 buffers, no str: an awkward view of the arrow strings
            views = [_awkward_strings(c) for c in columns]
            row(
                "(f) gigatoken encode_batch of arrow strings, 1 thread",
                lambda: [tok.encode_batch(v, parallel=False) for v in views],
            )
        source = gigatoken.JsonlFileSource([args.corpus], field="text")
        row(
            "gigatoken encode_files JsonlFileSource, 1 thread",
            lambda: tok.encode_files(source, parallel=False),
        )
        row(
            "gigatoken encode_files JsonlFileSource, parallel",
            lambda: tok.encode_files(source, parallel=True),
        )


# Crafted JSON Lines files: what each candidate reader makes of them, beside orjson (today's reader).
EDGES = {
    "lone surrogate escape": b'{"text":"x\\ud800y"}\n{"text":"c d"}\n',
    "non-string text": b'{"text":1}\n{"text":null}\n{"text":"ok"}\n',
    "missing field": b'{"other":"a"}\n{"text":"ok"}\n',
    "blank lines": b'{"text":"a"}\n\n   \n{"text":"b"}\n',
    "CRLF": b'{"text":"a"}\r\n{"text":"b"}\r\n',
    "BOM": b'\xef\xbb\xbf{"text":"a"}\n{"text":"b"}\n',
    "malformed line": b'{"text":"a"\n{"text":"b"}\n',
    "invalid UTF-8 in text": b'{"text":"a\xff"}\n{"text":"b"}\n',
    "invalid UTF-8 in another field": b'{"text":"a","x":"\xff"}\n{"text":"b"}\n',
    "NaN in another field": b'{"text":"a","x":NaN}\n',
    "trailing garbage": b'{"text":"a"} x\n',
    "duplicate key": b'{"text":"a","text":"b"}\n',
    "not an object": b'["a"]\n',
}


def edges(tokenizer: Path) -> None:
    """Print what orjson (per line), msgspec, pyarrow.json and gigatoken's JsonlFileSource read from each
    of :data:`EDGES` (an exception's type in brackets)."""
    import tempfile

    import gigatoken
    import pyarrow as pa
    import pyarrow.json as pj

    from streampack.tokenizer.hf import gigatoken_form

    tok = gigatoken.Tokenizer.from_json(gigatoken_form(tokenizer.read_text(), parse_special=False))
    dec = msgspec.json.Decoder(_Text)
    schema = pa.schema([("text", pa.string())])
    parse = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")

    def each_line(fn: Callable[[bytes], Any], data: bytes) -> list[Any]:
        out = []
        for line in data.splitlines():
            try:
                out.append(fn(line))
            except Exception as e:
                out.append(f"<{type(e).__name__}>")
        return out

    def whole(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:
            return f"<{type(e).__name__}>"

    print("| file | orjson per line | msgspec decode_lines | pyarrow.json | gigatoken JsonlFileSource |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in EDGES.items():
            path = Path(tmp, "edge.jsonl")
            path.write_bytes(data)
            source = gigatoken.JsonlFileSource([str(path)], field="text")
            cells = [
                each_line(lambda x: orjson.loads(x)["text"], data),
                whole(lambda: [r.text for r in dec.decode_lines(data)]),  # noqa: B023
                whole(lambda: pj.read_json(pa.BufferReader(data), parse_options=parse)[0].to_pylist()),  # noqa: B023
                whole(lambda: [tok.decode(x) for x in tok.encode_files(source, parallel=False).tolist()]),  # noqa: B023
            ]
            print(f"| {name}: `{data!r}` | " + " | ".join(f"`{c}`" for c in cells) + " |")


def _awkward_strings(column: Any) -> Any:
    """An arrow string column as an awkward array of strings, sharing its buffers."""
    import awkward as ak
    import pyarrow as pa

    c = column.combine_chunks().cast(pa.large_string())
    offsets = np.frombuffer(c.buffers()[1], np.int64)[c.offset : c.offset + len(c) + 1]
    chars = ak.contents.NumpyArray(np.frombuffer(c.buffers()[2], np.uint8), parameters={"__array__": "char"})
    strings = ak.contents.ListOffsetArray(
        ak.index.Index64(offsets), chars, parameters={"__array__": "string"}
    )
    return ak.Array(strings)


if __name__ == "__main__":
    main()

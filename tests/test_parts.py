"""A unit's records in parts (``streampack.inputs.parts``): the same items, in the same order, as reading
them line by line, whatever the part size, the unit's byte range, the records skipped or the format; and
the build parses them on its encoder threads, not on the thread that reads them."""

from __future__ import annotations

import gzip
import json
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import streampack
from streampack.errors import BadRecordError
from streampack.inputs import lines as lines_module
from streampack.inputs.discovery import expand_inputs
from streampack.inputs.parts import parsed
from streampack.inputs.records import ReadOptions, WorkUnit
from streampack.inputs.text import BOM
from streampack.inputs.units import plan_units, read_unit_parts

_LINE = st.one_of(
    st.text(st.characters(codec="utf-8", exclude_characters="\n\r"), max_size=40).map(
        lambda t: json.dumps({"text": t, "n": 1}, ensure_ascii=False)
    ),
    st.sampled_from(["", "  ", "{not json", "[1, 2]", '{"other": 1}', '{"text": 5}', '{"text": "\\ud800"}']),
)


def _expected(data: bytes, path: Path) -> list[Any]:
    """Each line's item, read the plain way: split at newlines, each line parsed on its own."""
    if data.startswith(BOM):
        data = data[len(BOM) :]
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    file = expand_inputs([str(path)])[0]
    reader = lines_module._LineReader(file, 0, True, *_text_reader())
    return [_comparable(reader._json_line(line, n)) for n, line in enumerate(lines, 1)]


def _text_reader() -> tuple[Any, str]:
    from streampack.inputs.records import record_reader

    return record_reader(ReadOptions())


def _comparable(item: Any) -> Any:
    return (item.location, item.problem) if isinstance(item, BadRecordError) else item


def _items(path: Path, options: ReadOptions, size: int, skip: int = 0) -> list[Any]:
    """Every unit's items through its parts of about ``size``, the first unit resumed after ``skip``."""
    items: list[Any] = []
    for unit in plan_units(expand_inputs([str(path)]), options):
        parts = list(read_unit_parts(unit, options, skip=skip if unit.index == 0 else 0, size=size))
        assert all(0 < part.records == len(part.items()) for part in parts)
        items += [_comparable(item) for item in parsed(iter(parts))]
    return items


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lines=st.lists(_LINE, max_size=60),
    last_newline=st.booleans(),
    bom=st.booleans(),
    size=st.integers(1, 300),
    unit_bytes=st.sampled_from([1 << 16, 200]),
    skip=st.integers(0, 70),
)
def test_parts_hold_the_lines_of_a_line_by_line_read(
    tmp_path_factory: pytest.TempPathFactory,
    lines: list[str],
    last_newline: bool,
    bom: bool,
    size: int,
    unit_bytes: int,
    skip: int,
) -> None:
    path = tmp_path_factory.mktemp("parts") / "a.jsonl"
    data = (BOM if bom else b"") + "\n".join(lines).encode() + (b"\n" if last_newline and lines else b"")
    path.write_bytes(data)
    options = ReadOptions(unit_bytes=max(unit_bytes, 1 << 16))
    expected = _expected(data, path)
    if unit_bytes == 200:  # units of a byte range each: ReadOptions refuses less than 64 KiB
        file = expand_inputs([str(path)])[0]
        units = [
            WorkUnit(i, file, a, min(a + 200, len(data))) for i, a in enumerate(range(0, len(data), 200))
        ]
        got = [_comparable(item) for u in units for item in parsed(read_unit_parts(u, options, size=size))]
        assert got == expected
        return
    assert _items(path, options, size, skip) == expected[skip:]


def test_compressed_lines_and_parquet_rows_come_in_parts_of_about_the_size_asked(tmp_path: Path) -> None:
    texts = [f"document {i} " + "word " * (i % 50) for i in range(2000)]
    jsonl = tmp_path / "a.jsonl.gz"
    jsonl.write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in texts).encode()))
    table = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": texts}), table, row_group_size=700)
    for path in (jsonl, table):
        (unit,) = plan_units(expand_inputs([str(path)]), ReadOptions())
        parts = list(read_unit_parts(unit, ReadOptions(), size=20_000))
        assert len(parts) > 5, path
        assert [t for part in parts for t in part.items()] == texts
        resumed = list(read_unit_parts(unit, ReadOptions(), skip=1234, size=20_000))
        assert [t for part in resumed for t in part.items()] == texts[1234:]


def test_the_build_parses_records_on_its_encoder_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reading thread reads parts; the encoder threads parse them (issue 26: the record work off the
    reading thread, so that it runs on as many cores as encoding does)."""
    parsing: set[str] = set()
    original = lines_module.LinesPart.items

    def items(self: lines_module.LinesPart) -> list[Any]:
        parsing.add(threading.current_thread().name)
        return original(self)

    monkeypatch.setattr(lines_module.LinesPart, "items", items)
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i} " * 50}) + "\n" for i in range(3000)))
    streampack.build(path, tmp_path / "c", workers=1, batch_chars=20_000)
    assert parsing and all(name.startswith("streampack-encode") for name in parsing), parsing
    assert streampack.open(tmp_path / "c").num_docs == 3000


def test_a_record_longer_than_a_block_is_cut_where_it_is_read_and_shared_by_both_encoder_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long JSON line is a part of its own, parsed and cut on the reading thread into blocks that both
    encoder threads take; the cache is the same as with blocks that hold it whole."""
    from streampack.builder import blocks

    texts = [f"short {i} " * 20 for i in range(40)]
    texts[17] = " ".join(f"word{i}" for i in range(60_000))  # ~500 K characters
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    threads: set[str] = set()
    original = blocks.encode_and_frame

    def encode_and_frame(unit: Any, batch: Any) -> Any:
        if 17 in batch.records:
            threads.add(threading.current_thread().name)
            time.sleep(0.02)  # as an engine takes time: the next block goes to the other thread
        return original(unit, batch)

    monkeypatch.setattr(blocks, "encode_and_frame", encode_and_frame)
    options = {"workers": 1, "tokenizer": "bytes", "max_piece_chars": 5_000}
    streampack.build(path, tmp_path / "cut", batch_chars=20_000, **options)
    assert len(threads) == 2, threads
    monkeypatch.undo()
    streampack.build(path, tmp_path / "whole", batch_chars=1 << 22, **options)
    for name in ("000000.tokens", "000000.offsets"):
        assert (tmp_path / "cut" / "shards" / name).read_bytes() == (
            tmp_path / "whole" / "shards" / name
        ).read_bytes()
    cache = streampack.open(tmp_path / "cut")
    assert cache.num_docs == 40 and bytes(cache.doc(17)[:-1].tolist()).decode() == texts[17]

"""Tests for the readers of `streampack.inputs` (`units` and the formats): what records become, and that
a resumed unit skips exactly the records it committed, on the paths taken only for bad records too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import streampack
from streampack.errors import BadRecordError, InputError
from streampack.inputs.discovery import expand_inputs
from streampack.inputs.records import ReadOptions
from streampack.inputs.units import plan_units, read_unit

ADVICE = "; pass text_field=... to choose another"


def _invalid_strings(values: list[bytes | None]) -> pa.Array:
    """A string array holding the bytes as they are (pyarrow validates nothing when built from buffers)."""
    binary = pa.array(values, pa.binary())
    return pa.Array.from_buffers(pa.string(), len(values), binary.buffers(), binary.null_count)


def _records(path: Path, options: ReadOptions, skip: int = 0) -> list[Any]:
    """Every item of every unit of ``path``, bad records as their location and problem."""
    items: list[Any] = []
    for unit in plan_units(expand_inputs([path]), options):
        for item in read_unit(unit, options, skip=skip if unit.index == 0 else 0):
            items.append((item.location, item.problem) if isinstance(item, BadRecordError) else item)
    return items


def test_parquet_invalid_utf8_rows_are_bad_records_and_a_resumed_read_skips_exactly(tmp_path: Path) -> None:
    values: list[bytes | None] = [b"row %d" % i for i in range(3000)]
    values[4], values[1500], values[2999] = b"bad \xff", None, b"\xc3"
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": _invalid_strings(values)}), path, row_group_size=1000)
    full = _records(path, ReadOptions())
    assert len(full) == 3000
    assert full[4] == (f"{path}: row 5", "invalid UTF-8 at byte 4 of the value")
    assert full[1500] == (f"{path}: row 1501", "the 'text' value is null")
    assert full[2999] == (f"{path}: row 3000", "invalid UTF-8 at byte 0 of the value")
    assert full[5] == "row 5" and full[2998] == "row 2998"
    for skip in (0, 1, 4, 5, 6, 999, 1000, 1023, 1024, 2500, 2999, 3000):
        assert _records(path, ReadOptions(), skip) == full[skip:], skip


def test_parquet_dictionary_text_with_invalid_utf8_names_the_file_and_the_rows(tmp_path: Path) -> None:
    # pyarrow checks a dictionary's UTF-8 while reading the batch: the batch fails, not a row of it
    dictionary = pa.DictionaryArray.from_arrays(pa.array([0, 1, 0]), _invalid_strings([b"ok", b"\xff"]))
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": dictionary}), path)
    with pytest.raises(InputError, match=r"a\.parquet: row 1 or after: .*Invalid UTF8"):
        _records(path, ReadOptions())


def test_parquet_nested_field_with_null_parents_and_a_literal_dotted_column(tmp_path: Path) -> None:
    meta = pa.array([{"text": "a", "n": 1}, None, {"text": None, "n": 3}, {"text": "d", "n": 4}])
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"meta": meta}), path)
    assert _records(path, ReadOptions(text_field="meta.text")) == [
        "a",
        (f"{path}: row 2", "the 'meta.text' value is null"),
        (f"{path}: row 3", "the 'meta.text' value is null"),
        "d",
    ]
    assert _records(path, ReadOptions(text_field="meta.text"), skip=2)[1:] == ["d"]
    both = tmp_path / "both.parquet"  # a column named "a.b" is preferred to the field b of a struct a
    pq.write_table(pa.table({"a": pa.array([{"b": "nested"}]), "a.b": ["literal"]}), both)
    assert _records(both, ReadOptions(text_field="a.b")) == ["literal"]
    deep = tmp_path / "deep.parquet"
    pq.write_table(pa.table({"a": pa.array([{"b": {"c": "deep"}}])}), deep)
    assert _records(deep, ReadOptions(text_field="a.b.c")) == ["deep"]
    with pytest.raises(InputError, match=r"no column 'a\.b\.c\.d': 'a\.b\.c' has type string"):
        _records(deep, ReadOptions(text_field="a.b.c.d"))


def test_jsonl_nested_fields_prefer_a_literal_key_and_name_the_missing_part(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text(
        '{"meta": {"text": "nested"}}\n'
        '{"meta.text": "literal", "meta": {"text": "nested"}}\n'
        '{"meta": "a string"}\n'
        '{"meta": {"body": "x"}}\n'
        '{"body": "x"}\n'
        '{"meta": {"text": null}}\n'
    )
    assert _records(path, ReadOptions(text_field="meta.text")) == [
        "nested",
        "literal",
        (f"{path}:3", "no 'meta.text' field: 'meta' is str, not an object" + ADVICE),
        (f"{path}:4", "no 'meta.text' field: 'meta' has no 'text' (its fields: 'body')" + ADVICE),
        (f"{path}:5", "no 'meta.text' field (fields: 'body')" + ADVICE),
        (f"{path}:6", "the 'meta.text' field is null, expected a string"),
    ]


def test_python_dicts_take_nested_fields_too(tmp_path: Path) -> None:
    docs = streampack.Documents([{"meta": {"text": "one"}}, {"meta": {"text": "two"}}])
    summary = streampack.build(docs, tmp_path / "c", text_field="meta.text")
    assert summary.num_docs == 2
    assert bytes(streampack.open(tmp_path / "c").doc(1)[:-1].tolist()) == b"two"


def test_json_only_pythons_parser_accepts_is_read_and_counted_like_any_line(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text(
        '{"text": "a", "x": NaN}\n'
        '{"text": "b", "x": [Infinity, -Infinity]}\n'
        '{"text": "c\\ud800"}\n'
        '{"text": "d", "x": "\\udc00", "big": 1e400}\n'
        '{"text": "e"}\n'
    )
    full = _records(path, ReadOptions())
    assert full == ["a", "b", (f"{path}:3", "the text holds a lone surrogate at character 1"), "d", "e"]
    for skip in range(6):
        assert _records(path, ReadOptions(), skip) == full[skip:]


def test_a_plain_file_that_happens_to_start_like_bz2_is_read(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    path.write_text("BZh91AY&SY is how a bz2 stream starts")  # no record fails: nothing is sniffed
    assert _records(path, ReadOptions()) == ["BZh91AY&SY is how a bz2 stream starts"]

"""Inputs read a line at a time: JSON Lines, and text files read one document per line (``split_lines``).

Both share one reader of a unit's lines (:func:`read_lines`): a unit may be a byte range of a large file,
which starts at the first line beginning in it, and a bad record names its absolute line number, counted
from the start of the file only when a message needs it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any, BinaryIO

import orjson

from streampack.errors import BadRecordError, InputError
from streampack.inputs.compression import READ_CHUNK, STREAM_ERRORS, open_input, refuse_compressed
from streampack.inputs.inputfile import COMPRESSION_SUFFIXES, InputFile, looks_like_json_lines
from streampack.inputs.records import (
    Item,
    Position,
    ReadOptions,
    RecordReader,
    Wanted,
    WorkUnit,
    describe,
    encodable,
    record_reader,
)
from streampack.inputs.text import BOM


def read_lines(unit: WorkUnit, options: ReadOptions, skip: int, position: Position | None) -> Iterator[Item]:
    """One item per line of the unit (its byte range, or the whole file) after the first ``skip``.

    Raises:
        InputError: the input cannot be opened, or its stream is truncated or corrupt.
    """
    file = unit.file
    assert file is not None
    is_json = file.format == "jsonl"
    extract, field = record_reader(options)
    line_no = 0
    with open_input(file, position) as f:
        try:
            pos = _seek_line_start(f, unit.start)
            for line in f:
                if unit.stop is not None and pos >= unit.stop:
                    break
                at_file_start = pos == 0
                pos += len(line)
                line_no += 1
                if at_file_start and line.startswith(BOM):
                    line = line[len(BOM) :]
                if line_no <= skip:
                    continue
                if is_json:
                    yield _parse_json_line(line, field, extract, file, unit.start, line_no)
                else:
                    yield _decode_text_line(line, file, unit.start, line_no)
        except STREAM_ERRORS as e:
            where = _location(file, unit.start, line_no) if line_no else f"{file.path}: before the first line"
            raise InputError(
                f"{where}: the {file.compression or 'file'} stream is truncated or corrupt after this point "
                f"({e}); replace the file, then rerun the same command to resume"
            ) from None


def _seek_line_start(f: BinaryIO, start: int) -> int:
    """Position ``f`` at the first line that begins at or after byte ``start``; return that position."""
    if start == 0:
        return 0
    f.seek(start - 1)
    return start - 1 + len(f.readline())


def _location(file: InputFile, start: int, line_no: int) -> str:
    """``path:line`` with the absolute line number (counted from the file start only when needed)."""
    if start:
        line_no += count_lines_before(file, start)
    return f"{file.path}:{line_no}"


@functools.lru_cache(maxsize=64)
def count_lines_before(file: InputFile, start: int) -> int:
    """Number of lines before the first line that begins at or after byte ``start``."""
    with open_input(file) as f:
        try:
            remaining = _seek_line_start(f, start)
            f.seek(0)
            count = 0
            while remaining > 0:
                chunk = f.read(min(READ_CHUNK, remaining))
                if not chunk:
                    break
                count += chunk.count(b"\n")
                remaining -= len(chunk)
        except STREAM_ERRORS as e:
            raise InputError(f"{file.path}: cannot read ({e})") from None
    return count


def _decode_text_line(line: bytes, file: InputFile, start: int, line_no: int) -> Item:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        refuse_compressed(file)
        return BadRecordError(_location(file, start, line_no), f"invalid UTF-8 at byte {e.start} of the line")
    text = text.rstrip("\r\n")
    return text if text.strip() else None


def _parse_json_line(
    line: bytes, field: Wanted, extract: RecordReader, file: InputFile, start: int, line_no: int
) -> Item:
    if not line.strip():
        return None
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        return _parse_json_line_slowly(line, field, extract, file, start, line_no, e)
    if not isinstance(record, dict):
        return _not_an_object(record, field, file, start, line_no)
    return extract(record, field, lambda: _location(file, start, line_no))


def _parse_json_line_slowly(
    line: bytes,
    field: Wanted,
    extract: RecordReader,
    file: InputFile,
    start: int,
    line_no: int,
    error: orjson.JSONDecodeError,
) -> Item:
    """A line orjson refused: Python's parser also accepts ``NaN``, ``Infinity`` and lone surrogates.

    Asked only after orjson failed, so the common path pays nothing. A lone surrogate is still refused
    in the text (no tokenizer can encode it), as for Python inputs; in other fields it does no harm.
    """
    try:
        record = json.loads(line.decode("utf-8"))
    except ValueError:  # invalid UTF-8 or malformed JSON
        refuse_compressed(file)
        problem = _json_problem(line, error) + _json_document_hint(file)
        return BadRecordError(_location(file, start, line_no), problem)
    if not isinstance(record, dict):
        return _not_an_object(record, field, file, start, line_no)
    item = extract(record, field, lambda: _location(file, start, line_no))
    return encodable(item, _location(file, start, line_no))


def _not_an_object(record: Any, wanted: Wanted, file: InputFile, start: int, line_no: int) -> BadRecordError:
    problem = f"the line is a JSON {type(record).__name__}, expected an object with {describe(wanted)}"
    return BadRecordError(_location(file, start, line_no), problem + _json_document_hint(file))


def _json_problem(line: bytes, error: orjson.JSONDecodeError) -> str:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"invalid UTF-8 at byte {e.start} of the line"
    return f"malformed JSON ({error})"


@functools.lru_cache(maxsize=64)
def _json_document_hint(file: InputFile) -> str:
    """A hint for a ``.json`` file with a bad record: the file may be one JSON document."""
    name = file.path.lower()
    if not name.endswith(".json") and not any(name.endswith(f".json{s}") for s in COMPRESSION_SUFFIXES):
        return ""
    try:
        with open_input(file) as f:
            if looks_like_json_lines(f):
                return ""
    except (InputError, *STREAM_ERRORS):
        return ""
    return "; this looks like a single JSON document, not JSON Lines (one object per line)"

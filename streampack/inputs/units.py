"""The plan of work units (decided by the inputs and options alone), and reading one with its format's reader.

A unit yields one item per input record, in order (see :data:`~streampack.inputs.records.Item`): counting
records so lets a resumed unit skip exactly what it committed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence, Set, Sized
from typing import Any

from streampack.errors import InputError
from streampack.inputs.compression import READ_CHUNK
from streampack.inputs.inputfile import InputFile
from streampack.inputs.lines import count_lines_before, read_line_parts
from streampack.inputs.parquet import parquet_file, read_parquet_parts, row_group_ranges
from streampack.inputs.parts import Part, grouped_items, parsed
from streampack.inputs.python import read_python
from streampack.inputs.records import Item, Position, ReadOptions, WorkUnit, refuse_text_for_sft
from streampack.inputs.text import read_text_document

SEQUENCE_UNIT_ROWS = 100_000


def plan_units(files: Sequence[InputFile], options: ReadOptions) -> list[WorkUnit]:
    """Split input files into work units, in input order: a large file into ranges, consecutive small files
    into runs of at most ``unit_bytes`` (a million small files make a few shards)."""
    units: list[WorkUnit] = []
    run: list[InputFile] = []
    run_bytes = 0

    def end_run() -> None:
        nonlocal run_bytes
        if run:
            units.append(WorkUnit(len(units), run[0], rest=tuple(run[1:])))
            run.clear()
            run_bytes = 0

    for file in files:
        ranges = _ranges(file, options)
        if ranges != [(0, None)] or file.format == "parquet":
            end_run()
            units.extend(WorkUnit(len(units), file, start, stop) for start, stop in ranges)
            continue
        if run and run_bytes + file.size > options.unit_bytes:
            end_run()
        run.append(file)
        run_bytes += file.size
    end_run()
    return units


def plan_python_units(items: Any) -> list[WorkUnit]:
    """Work units for a Python object: index ranges of a sequence, or one unit for any other iterable."""
    if (
        isinstance(items, (str, bytes, Mapping, Set))
        or not isinstance(items, Iterable)
        or type(items).__name__ == "DataFrame"  # pandas or polars: iterating one yields column names
    ):
        raise InputError(
            f"cannot read documents from a {type(items).__name__}: pass a list or iterable of str or of "
            "dicts (for a DataFrame: df['text'].tolist() or its records), or a Hugging Face Dataset"
        )
    if isinstance(items, Sized) and hasattr(items, "__getitem__"):
        n = len(items)
        bounds = range(0, max(n, 1), SEQUENCE_UNIT_ROWS)
        return [WorkUnit(i, None, a, min(a + SEQUENCE_UNIT_ROWS, n), items) for i, a in enumerate(bounds)]
    return [WorkUnit(0, None, 0, None, items)]


def _ranges(file: InputFile, options: ReadOptions) -> list[tuple[int, int | None]]:
    if file.format == "jsonl" and file.compression is None and file.size > options.unit_bytes:
        starts = range(0, file.size, options.unit_bytes)
        return [(a, min(a + options.unit_bytes, file.size)) for a in starts]
    if file.format == "parquet":
        return row_group_ranges(file, options.unit_bytes)
    return [(0, None)]


def read_unit(
    unit: WorkUnit, options: ReadOptions, *, skip: int = 0, position: Position | None = None
) -> Iterator[Item]:
    """Yield one item per record of ``unit`` after the first ``skip`` records.

    Raises:
        InputError: the input cannot be opened or its stream is truncated or corrupt.
    """
    return parsed(read_unit_parts(unit, options, skip=skip, position=position))


def read_unit_parts(
    unit: WorkUnit,
    options: ReadOptions,
    *,
    skip: int = 0,
    position: Position | None = None,
    size: int = READ_CHUNK,
) -> Iterator[Part]:
    """The records of ``unit`` after the first ``skip``, in parts of about ``size``, parsed when asked.

    Raises:
        InputError: the input cannot be opened or its stream is truncated or corrupt.
    """
    if unit.file is None:
        return grouped_items(read_python(unit, options, skip), size)
    if options.sft:
        refuse_text_for_sft(unit.files, "fields=[...]" if options.fields is not None else "chat=...")
    if unit.rest:
        return _run_parts(unit, options, skip, position, size)
    if unit.file.format == "parquet":
        return read_parquet_parts(unit, options, skip, size)
    if unit.file.format == "text" and not options.split_lines:
        return grouped_items(read_text_document(unit.file, skip, position), size)
    return read_line_parts(unit, options, skip, position, size)


def records_before(unit: WorkUnit) -> int:
    """Records of the unit's input before its first one (lines of a JSONL file are counted by reading).

    Raises:
        InputError: the input cannot be opened or read up to the unit.
    """
    file = unit.file
    if file is None or unit.rest or not unit.start:
        return unit.start if file is None else 0
    if file.format == "parquet":
        metadata = parquet_file(file).metadata
        return sum(metadata.row_group(g).num_rows for g in range(unit.start))
    return count_lines_before(file, unit.start)


def _run_parts(
    unit: WorkUnit, options: ReadOptions, skip: int, position: Position | None, size: int
) -> Iterator[Part]:
    """The records of a run of whole files, one file after the other."""

    def files() -> Iterator[Part | Item]:
        nonlocal skip
        for file in unit.files:
            if file.format == "text" and not options.split_lines:
                if skip:
                    skip -= 1  # a whole-file document: one record, skipped without reading it
                else:
                    yield from read_text_document(file, 0, position)
            else:
                parts = read_unit_parts(WorkUnit(unit.index, file), options, position=position, size=size)
                for part in parts:
                    if skip >= part.records:  # a resumed run reads its committed records again to count them
                        skip -= part.records
                        continue
                    yield part.after(skip) if skip else part
                    skip = 0
            if position is not None:
                position.file_done(file.size)

    return grouped_items(files(), size)


def record_location(unit: WorkUnit, read: ReadOptions, record: int) -> str:
    """Where record ``record`` of ``unit`` is, for messages: ``path:line``, ``path row N`` or a path."""
    file = unit.file
    if file is None:
        return f"python:{type(unit.items).__name__} row {records_before(unit) + record}"
    if unit.rest:  # a run of whole files: find the file holding the record
        for one in unit.files:
            count = sum(1 for _ in read_unit(WorkUnit(unit.index, one), read))
            if record < count:
                return record_location(WorkUnit(unit.index, one), read, record)
            record -= count
        return unit.describe()
    if file.format == "parquet":
        return f"{file.path} row {records_before(unit) + record}"
    if file.format == "text" and not read.split_lines:
        return file.path
    return f"{file.path}:{records_before(unit) + record + 1}"

"""Parquet inputs: units of whole row groups, their rows read in record batches (pyarrow imported here)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from streampack.errors import BadRecordError, InputError
from streampack.inputs.compression import open_remote
from streampack.inputs.inputfile import InputFile
from streampack.inputs.parts import Part, skipped
from streampack.inputs.records import Item, ReadOptions, RecordReader, Wanted, WorkUnit, record_reader


def parquet_file(file: InputFile) -> Any:
    """The file as a ``pyarrow.parquet.ParquetFile`` (local, or opened through fsspec).

    Raises:
        InputError: the file cannot be opened or is not Parquet.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        source = file.path if file.is_local else open_remote(file.path)
        return pq.ParquetFile(source)
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"{file.path}: not a readable Parquet file ({e})") from None


def row_group_ranges(file: InputFile, unit_bytes: int) -> list[tuple[int, int | None]]:
    """The file's units: ranges of whole row groups of about ``unit_bytes`` (uncompressed) each."""
    metadata = parquet_file(file).metadata
    ranges: list[tuple[int, int | None]] = []
    start, size = 0, 0
    for i in range(metadata.num_row_groups):
        size += metadata.row_group(i).total_byte_size
        if size >= unit_bytes:
            ranges.append((start, i + 1))
            start, size = i + 1, 0
    if start < metadata.num_row_groups or not ranges:
        ranges.append((start, metadata.num_row_groups))
    return ranges


def read_parquet_parts(
    unit: WorkUnit, options: ReadOptions, skip: int, size: int = 1 << 20
) -> Iterator[Part]:
    """The unit's rows after the first ``skip``, in record batches of about ``size`` bytes of text.

    Raises:
        InputError: no such column, not a string column, or the data cannot be read.
    """
    import pyarrow as pa

    file = unit.file
    assert file is not None
    parquet = parquet_file(file)
    names = parquet.schema_arrow.names
    extract, wanted = record_reader(options)
    if options.sft:  # the columns the SFT fields need
        fields = (
            wanted if isinstance(wanted, tuple) else (wanted if isinstance(wanted, str) else wanted.field,)
        )
        columns = list(dict.fromkeys(f if f in names else f.split(".")[0] for f in fields))
        missing = [c for c in columns if c not in names]
        if missing:
            raise InputError(f"{file.path}: no column {missing[0]!r} (columns: {', '.join(names)})")
    else:
        column, path = _text_column(file, parquet.schema_arrow, options.text_field)
        columns = [options.text_field]
    groups, row, skip = _row_groups_after(unit, parquet, skip)
    if not groups:
        return
    batches = parquet.iter_batches(
        batch_size=_rows_of(parquet, groups, size), row_groups=groups, columns=columns
    )

    def numbered() -> Iterator[Rows]:
        nonlocal row
        for batch in batches:
            data = batch if options.sft else _string_values(batch.column(column), path)
            part = Rows(data, row, file, options.text_field, (extract, wanted) if options.sft else None)
            row += part.records
            yield part

    try:
        yield from skipped(numbered(), skip)
    except (OSError, ValueError, TypeError, KeyError, IndexError, pa.ArrowException) as e:
        raise InputError(  # pyarrow fails a whole batch: the row is the first one not read
            f"{file.path}: row {row + 1} or after: cannot read the Parquet data ({type(e).__name__}: {e})"
        ) from None


@dataclass(frozen=True)
class Rows:
    """Consecutive rows of a Parquet unit as Arrow holds them: the text column's values, or for an SFT build
    (``sft``: how a record becomes an item, and what it must hold) a record batch of the columns it needs."""

    data: Any  # a string or large_string array (struct fields taken, dictionaries decoded), or a batch
    row: int  # the rows of the file before the first
    file: InputFile
    field: str
    sft: tuple[RecordReader, Wanted] | None = None

    @property
    def records(self) -> int:
        return len(self.data)

    @property
    def size(self) -> int:
        return int(self.data.nbytes)

    def items(self) -> list[Item]:
        path = self.file.path
        if self.sft is None:
            try:
                texts: list[Any] = self.data.to_pylist()
            except UnicodeDecodeError:
                texts = _decoded_rows(self.data, self.file, self.row)
            problem = f"the {self.field!r} value is null"
            rows = enumerate(texts, self.row + 1)
            return [BadRecordError(f"{path}: row {row}", problem) if t is None else t for row, t in rows]
        extract, wanted = self.sft
        items: list[Item] = []
        for row, record in enumerate(_batch_rows(self.data, self.file, self.row), self.row + 1):
            if isinstance(record, BadRecordError):
                items.append(record)
            else:
                items.append(extract(record, wanted, functools.partial(str, f"{path}: row {row}")))
        return items

    def after(self, skip: int) -> Rows:
        return dataclasses.replace(self, data=self.data.slice(skip), row=self.row + skip)


def _rows_of(parquet: Any, groups: list[int], size: int) -> int:
    """Rows per record batch for about ``size`` bytes of the row groups' (uncompressed) data."""
    metadata = parquet.metadata
    rows = sum(metadata.row_group(g).num_rows for g in groups)
    data = sum(metadata.row_group(g).total_byte_size for g in groups)
    return max(1, min(65536, size * rows // max(data, 1)))


def _row_groups_after(unit: WorkUnit, parquet: Any, skip: int) -> tuple[list[int], int, int]:
    """The row groups left after skipping whole groups of ``skip`` rows, the file's rows before them, and
    the rows still to skip."""
    stop = parquet.metadata.num_row_groups if unit.stop is None else unit.stop
    groups = list(range(unit.start, stop))
    row = sum(parquet.metadata.row_group(g).num_rows for g in range(unit.start))
    while groups and skip >= parquet.metadata.row_group(groups[0]).num_rows:
        rows = parquet.metadata.row_group(groups.pop(0)).num_rows
        skip, row = skip - rows, row + rows
    return groups, row, skip


def _batch_rows(batch: Any, file: InputFile, row: int) -> list[dict[str, Any] | BadRecordError]:
    """The rows of a record batch as dicts; a row holding invalid UTF-8 as a bad record."""
    try:
        return list(batch.to_pylist())
    except UnicodeDecodeError:
        pass
    rows: list[dict[str, Any] | BadRecordError] = []
    for i in range(batch.num_rows):  # only for a batch holding invalid UTF-8
        try:
            rows.append(batch.slice(i, 1).to_pylist()[0])
        except UnicodeDecodeError as e:
            rows.append(BadRecordError(f"{file.path}: row {row + i + 1}", f"invalid UTF-8 at byte {e.start}"))
    return rows


def _text_column(file: InputFile, schema: Any, field: str) -> tuple[str, list[str]]:
    """Where the text is: the top-level column, and the path of struct fields inside it (a dotted field).

    Raises:
        InputError: no such column, a part of the path is missing or not a struct, or no string type.
    """
    import pyarrow as pa

    if field in schema.names:
        column, path, kind = field, [], schema.field(field).type
    else:
        column, *path = field.split(".")
        if not path or column not in schema.names:
            raise InputError(
                f"{file.path}: no column {field!r} (columns: {', '.join(schema.names)}); pass text_field=..."
            )
        kind = schema.field(column).type
        for i, part in enumerate(path):
            outer = ".".join([column, *path[:i]])
            if not pa.types.is_struct(kind):
                raise InputError(f"{file.path}: no column {field!r}: {outer!r} has type {kind}, not a struct")
            if kind.get_field_index(part) < 0:
                names = ", ".join(kind.field(j).name for j in range(kind.num_fields))
                raise InputError(
                    f"{file.path}: no column {field!r}: {outer!r} has no field {part!r} (fields: {names})"
                )
            kind = kind.field(part).type
    value_kind = kind.value_type if pa.types.is_dictionary(kind) else kind
    if pa.types.is_string(value_kind) or pa.types.is_large_string(value_kind) or _is_string_view(value_kind):
        return column, path
    raise InputError(f"{file.path}: column {field!r} has type {kind}, expected string")


def _is_string_view(kind: Any) -> bool:
    import pyarrow as pa

    return bool(getattr(pa.types, "is_string_view", lambda _: False)(kind))


def _string_values(values: Any, path: list[str]) -> Any:
    """The text values of a batch's column as a string or large_string array (UTF-8 is checked later)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if path:
        values = pc.struct_field(values, path)  # null where a parent struct is null
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        return values
    return pc.cast(values, pa.large_string())


def _decoded_rows(values: Any, file: InputFile, row: int) -> list[str | BadRecordError | None]:
    """The values of a batch holding invalid UTF-8, decoded one by one (only for such batches)."""
    import pyarrow as pa

    binary = values.view(pa.large_binary() if pa.types.is_large_string(values.type) else pa.binary())
    texts: list[str | BadRecordError | None] = []
    for i, value in enumerate(binary.to_pylist(), start=row + 1):
        try:
            texts.append(None if value is None else value.decode("utf-8"))
        except UnicodeDecodeError as e:
            problem = f"invalid UTF-8 at byte {e.start} of the value"
            texts.append(BadRecordError(f"{file.path}: row {i}", problem))
    return texts

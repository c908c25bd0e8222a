"""Python objects as inputs: a sequence (a list, a Hugging Face Dataset) read by index ranges, or any other
iterable read once, each record a ``str`` or a dict."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import Any

from streampack.errors import BadRecordError
from streampack.inputs.records import Item, ReadOptions, WorkUnit, describe, encodable, record_reader


def read_python(unit: WorkUnit, options: ReadOptions, skip: int) -> Iterator[Item]:
    """One item per record of the unit's slice (or of the whole iterable) after the first ``skip``."""
    extract, wanted = record_reader(options)
    items = unit.items
    if unit.stop is None:
        records: Iterable[Any] = items
        base = 0
    else:
        records = _slices(items, unit.start + skip, unit.stop)
        base, skip = unit.start + skip, 0
    for i, record in enumerate(records):
        if i < skip:
            continue
        where = f"python record {base + i}"
        if isinstance(record, dict):
            record = extract(record, wanted, functools.partial(str, where))
        elif options.sft:
            kind = type(record).__name__
            record = BadRecordError(where, f"the record is a {kind}, expected a dict with {describe(wanted)}")
        if isinstance(record, (str, tuple)):
            yield encodable(record, where)
        elif isinstance(record, BadRecordError):
            yield record
        else:
            yield BadRecordError(where, f"the record is a {type(record).__name__}, expected str or dict")


def _slices(items: Any, start: int, stop: int, step: int = 1000) -> Iterator[Any]:
    for a in range(start, stop, step):
        chunk = items[a : min(a + step, stop)]
        if isinstance(chunk, dict):  # a Hugging Face Dataset slice is a dict of columns
            keys = list(chunk)
            yield from (dict(zip(keys, row)) for row in zip(*chunk.values()))
        else:
            yield from chunk

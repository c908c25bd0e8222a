"""A unit's records as read, in parts, parsed only when asked: reading (I/O, decompression) releases the
GIL and parsing holds it, so a build parses each part on the thread that encodes it. A part counts its
records without parsing them, so that a resumed unit skips them unparsed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from streampack.errors import BadRecordError
from streampack.inputs.records import Item, TextStream


class Part(Protocol):
    """Consecutive records of a unit as read; parsed into one item per record by :meth:`items`."""

    @property
    def records(self) -> int:
        """The records it holds (known without parsing them)."""
        ...

    @property
    def size(self) -> int:
        """About how much text it holds (bytes or characters), to group parts into batches of a size."""
        ...

    def items(self) -> list[Item]:
        """One item per record, in order (see :mod:`~streampack.inputs.units`)."""
        ...

    def after(self, skip: int) -> Part:
        """The part without its first ``skip`` records (``0 < skip < records``)."""
        ...


@dataclass(frozen=True)
class ItemsPart:
    """Records parsed where they were read: Python records, and whole-file text documents."""

    parsed: tuple[Item, ...]
    size: int

    @property
    def records(self) -> int:
        return len(self.parsed)

    def items(self) -> list[Item]:
        return list(self.parsed)

    def after(self, skip: int) -> ItemsPart:
        rest = self.parsed[skip:]
        return ItemsPart(rest, sum(_chars(item) for item in rest))


@dataclass(frozen=True)
class StreamPart:
    """One document too large to hold as a string, cut into pieces as its chunks are read."""

    stream: TextStream

    records = 1
    size = 0

    def items(self) -> list[Item]:
        return [self.stream]

    def after(self, skip: int) -> Part:
        raise AssertionError("a stream is one record: skipped whole or not at all")


def grouped_items(items: Iterator[Item | Part], size: int) -> Iterator[Part]:
    """``items`` in parts of about ``size`` characters; a stream, or a part among them, a part of its own."""
    held: list[Item] = []
    chars = 0
    for item in items:
        if item is not None and not isinstance(item, (str, tuple, BadRecordError)):  # a stream, or a part
            if held:
                yield ItemsPart(tuple(held), chars)
                held, chars = [], 0
            yield StreamPart(item) if isinstance(item, TextStream) else item
            continue
        held.append(item)
        chars += _chars(item)
        if chars >= size:
            yield ItemsPart(tuple(held), chars)
            held, chars = [], 0
    if held:
        yield ItemsPart(tuple(held), chars)


def skipped(parts: Iterator[Part], skip: int) -> Iterator[Part]:
    """``parts`` without their first ``skip`` records (read, counted, not parsed)."""
    for part in parts:
        if skip >= part.records:
            skip -= part.records
            continue
        yield part.after(skip) if skip else part
        skip = 0


def parsed(parts: Iterator[Part]) -> Iterator[Item]:
    """Every record's item, parsed where the parts are read."""
    for part in parts:
        yield from part.items()


def _chars(item: Item) -> int:
    if isinstance(item, str):
        return len(item)
    if isinstance(item, tuple):
        return sum(len(segment.text) for segment in item)
    return 0

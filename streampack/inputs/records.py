"""The work unit, the read options, and how one record (a JSON object, a Parquet row, a dict) becomes an
:data:`Item`, shared by every format."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeAlias

from streampack._checks import check_int
from streampack.errors import BadRecordError, InputError, OptionsError
from streampack.inputs import DEFAULT_UNIT_BYTES
from streampack.inputs.inputfile import InputFile
from streampack.inputs.sft import ChatError, ChatTemplate, Sft, check_messages, check_tools, field_segments


@dataclass(frozen=True)
class WorkUnit:
    """A piece of input that becomes one shard, decided by the inputs alone (never by the workers).

    ``start``/``stop`` are byte offsets for a split JSONL file, row-group indices for Parquet, row indices
    for a Python sequence; ``stop=None`` means to the end. ``rest``: the files after ``file`` in a run.
    """

    index: int
    file: InputFile | None = None
    start: int = 0
    stop: int | None = None
    items: Any = None
    rest: tuple[InputFile, ...] = ()

    @property
    def files(self) -> tuple[InputFile, ...]:
        """The input files of the unit, in reading order (none for Python objects)."""
        return () if self.file is None else (self.file, *self.rest)

    def describe(self) -> str:
        """A stable, human-readable identity of the unit (stored in the ledger and manifest)."""
        where = self.file.path if self.file else f"python:{type(self.items).__name__}"
        if self.rest:
            return f"{where} .. {self.rest[-1].path} ({len(self.rest) + 1} files)"
        if self.stop is None and self.start == 0:
            return where
        kind = "bytes" if self.file and self.file.format == "jsonl" else "rows"
        if self.file and self.file.format == "parquet":
            kind = "row groups"
        return f"{where} [{kind} {self.start}:{'' if self.stop is None else self.stop}]"

    @property
    def in_process(self) -> bool:
        """Python objects are read in the coordinating process: they may not pickle, or be costly to."""
        return self.file is None


@dataclass(frozen=True)
class ReadOptions:
    """How records become documents.

    Attributes:
        text_field: the JSON key or Parquet column holding the text.
        split_lines: one document per line of a ``.txt`` file instead of one per file.
        unit_bytes: uncompressed JSONL files and Parquet files are split into units of about this size.
        fields: an SFT build from these fields of each record (see :mod:`streampack.inputs.sft`), not
            text_field.
        chat: an SFT build from the conversation of each record, rendered with this template.
    """

    text_field: str = "text"
    split_lines: bool = False
    unit_bytes: int = DEFAULT_UNIT_BYTES
    fields: tuple[str, ...] | None = None
    chat: ChatTemplate | None = None

    @property
    def sft(self) -> bool:
        """Records are SFT documents (fields or a chat), not texts."""
        return self.fields is not None or self.chat is not None

    def __post_init__(self) -> None:
        if not self.text_field:
            raise OptionsError("text_field must be a non-empty string")
        check_int("unit_bytes", self.unit_bytes, min=1 << 16)


class TextStream:
    """A document read in decoded chunks, for texts too large to hold as one string."""

    def __init__(self, chunks: Iterator[str]) -> None:
        self._chunks = chunks

    def __iter__(self) -> Iterator[str]:
        return self._chunks


# A record as read: a text, a streamed text, an SFT document, a bad record, or None (a blank line).
Item: TypeAlias = "str | TextStream | Sft | BadRecordError | None"


def makes_document(item: Item) -> bool:
    """Whether the build makes a document of a record's item: a text, or an SFT document with a segment,
    not empty nor only whitespace; or a streamed text. The build and the loader's replay both ask this."""
    if isinstance(item, str):
        return bool(item) and not item.isspace()
    if isinstance(item, tuple):
        return any(segment.text and not segment.text.isspace() for segment in item)
    return isinstance(item, TextStream)


# What a record must hold: the text field, the SFT fields, or the chat template (with its messages' field).
Wanted: TypeAlias = "str | tuple[str, ...] | ChatTemplate"


RecordReader: TypeAlias = Callable[[dict[str, Any], Any, Callable[[], str]], Item]  # (record, wanted, where)


class Documents:
    """Marks a Python object as the documents themselves (not paths): ``str`` or dicts holding the text
    field. A plain list of strings needs it; datasets and generators are recognised without it.

    Args:
        items: the documents.
        fingerprint: a string that changes whenever the documents do (a dataset version, a content hash).
            With it, an interrupted build resumes and a finished cache is reused; without it, a build into
            a directory that holds a cache is refused unless it overwrites.
    """

    def __init__(self, items: Iterable[Any], *, fingerprint: str | None = None) -> None:
        self.items = items
        self.fingerprint = fingerprint

    def __repr__(self) -> str:
        return f"Documents({type(self.items).__name__})"


class Position:
    """How far a unit has read into its input files, in on-disk (compressed) bytes; for progress bars."""

    def __init__(self) -> None:
        self._raw: BinaryIO | None = None
        self._base = 0
        self._files_done = 0  # bytes of the files of a run already read to the end

    def attach(self, raw: BinaryIO, base: int) -> None:
        """Follow ``raw``, which was positioned at byte ``base``."""
        self._raw, self._base = raw, base

    def file_done(self, size: int) -> None:
        """The file being read (of ``size`` bytes) was read to its end; a run's next file follows."""
        self._raw, self._files_done = None, self._files_done + size

    def bytes_read(self) -> int:
        """Bytes of the input consumed so far (as far as known)."""
        try:
            current = self._raw.tell() - self._base if self._raw is not None else 0
        except (OSError, ValueError):
            current = 0
        return self._files_done + current


def record_reader(options: ReadOptions) -> tuple[RecordReader, Wanted]:
    """How a record becomes an item, and what it must hold: chosen once per unit (one call per record)."""
    if options.fields is not None:
        return _fields_of, options.fields
    if options.chat is not None:
        return _chat_of, options.chat
    return _text_of, options.text_field


def describe(wanted: Wanted) -> str:
    """What a record must hold, for messages."""
    if isinstance(wanted, tuple):
        return f"the fields {', '.join(map(repr, wanted))}"
    return f"a {wanted if isinstance(wanted, str) else wanted.field!r} field"


def refuse_text_for_sft(files: Iterable[InputFile], option: str) -> None:
    """Raise when an SFT build (made with ``option``) is given text files, which hold no fields.

    Raises:
        InputError: naming the first text file.
    """
    text = next((f for f in files if f.format == "text"), None)
    if text is not None:
        raise InputError(
            f"{text.path}: a text file holds no fields to build with {option}; give JSONL, Parquet or "
            "Python dicts"
        )


class _Missing(Exception):
    """A field is absent from a record (the message says which part of its path)."""


def _value(record: dict[str, Any], field: str, option: str) -> Any:
    """``record[field]``, or for a dotted field ``a.b`` absent as such, ``record["a"]["b"]``.

    Raises:
        _Missing: saying which part is absent, and ``option`` to choose another field.
    """
    if field in record:
        return record[field]
    parts = field.split(".")
    advice = f"; pass {option} to choose another"
    if len(parts) == 1 or parts[0] not in record:
        fields = ", ".join(map(repr, list(record)[:10])) or "none"
        raise _Missing(f"no {field!r} field (fields: {fields}){advice}")
    value: Any = record
    for i, part in enumerate(parts):
        outer = ".".join(parts[:i])
        if not isinstance(value, dict):
            raise _Missing(f"no {field!r} field: {outer!r} is {_kind(value)}, not an object{advice}")
        if part not in value:
            fields = ", ".join(map(repr, list(value)[:10])) or "none"
            raise _Missing(f"no {field!r} field: {outer!r} has no {part!r} (its fields: {fields}){advice}")
        value = value[part]
    return value


def _text_of(record: dict[str, Any], field: str, location: Callable[[], str]) -> Item:
    """The text of a record's ``field`` (looked up here first: one call per record)."""
    if field in record:
        text = record[field]
    else:
        try:
            text = _value(record, field, "text_field=...")
        except _Missing as e:
            return BadRecordError(location(), str(e))
    if isinstance(text, str):
        return text
    return BadRecordError(location(), f"the {field!r} field is {_kind(text)}, expected a string")


def _fields_of(record: dict[str, Any], fields: tuple[str, ...], location: Callable[[], str]) -> Item:
    """An SFT document of a record's ``fields``: each a string (the last one the target)."""
    values = []
    for field in fields:
        try:
            value = _value(record, field, "fields=[...]")
        except _Missing as e:
            return BadRecordError(location(), str(e))
        if not isinstance(value, str):
            return BadRecordError(location(), f"the {field!r} field is {_kind(value)}, expected a string")
        values.append(value)
    return field_segments(values)


def _chat_of(record: dict[str, Any], chat: ChatTemplate, location: Callable[[], str]) -> Item:
    """An SFT document of a record's conversation (and its ``tools``), rendered with ``chat``'s template."""
    try:
        messages = _value(record, chat.field, "chat=...")
        return chat.segments(check_messages(messages, chat.field), check_tools(record.get("tools")))
    except (_Missing, ChatError) as e:
        return BadRecordError(location(), str(e))


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def encodable(item: Item, where: str) -> Item:
    """Python strings, unlike decoded files, may hold lone surrogates, which no tokenizer can encode."""
    texts = [item] if isinstance(item, str) else [s.text for s in item] if isinstance(item, tuple) else []
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            return BadRecordError(where, f"the text holds a lone surrogate at character {e.start}")
    return item

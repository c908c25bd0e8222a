"""The sections of a manifest as typed, frozen records: :class:`TokenizerInfo`, :class:`EosPolicy`,
:class:`BosPolicy`, :class:`BuildSettings`, :class:`InputRecord`, :class:`EngineRecord` and
:class:`IgnoredInputs` (docs/FORMAT.md describes each).

Each is checked once when read (a missing or mistyped field is a :class:`~streampack.errors.CacheError`
naming the file and the field), and writes back exactly the JSON it was read from (see
:mod:`streampack.format.record`), so a manifest read and written again keeps its bytes and its build
identity.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, overload

import msgspec

from streampack.errors import CacheError
from streampack.format.record import (
    BOOL,
    COUNT,
    COUNTS,
    INT,
    NUMBER,
    STR,
    STRINGS,
    S,
    Section,
    key,
    malformed,
    or_null,
    section_kind,
    sections_kind,
    shown,
)

__all__ = [
    "BosPolicy",
    "BuildSettings",
    "Cuts",
    "EngineRecord",
    "EosPolicy",
    "IgnoredEntry",
    "IgnoredInputs",
    "InputRecord",
    "InputRecords",
    "Section",
    "TokenizerInfo",
    "Verification",
]


@dataclass(frozen=True)
class Cuts(Section):
    """Whether cutting a long document at spaces is proven to give the tokenizer's own ids, and why."""

    exact: bool = key(BOOL, required=True)
    reason: str = key(STR, required=True)

    section_name: ClassVar[str] = "tokenizer.cuts"


#: The tokenizer kind of another format's token files whose tokenizer nobody declared: a mixture checks
#: it against no other source's.
UNDECLARED = "undeclared"


@dataclass(frozen=True)
class TokenizerInfo(Section):
    """The manifest's ``tokenizer``: what the cache was tokenized with.

    Attributes:
        kind: ``bytes``, ``hf``, ``tiktoken`` (``synthetic`` for a cache written from arrays,
            :data:`UNDECLARED` for another format's files opened without ``tokenizer=``).
        name: the tokenizer's file name (``tokenizer.json``), or ``bytes``.
        vocab_size: token ids are below it (the tokenizer's, grown past an EOS/BOS id given beyond it).
        sha256: the hash of the tokenizer's definition (compared on resume), or None if not recorded.
        spec: the SPEC the build was given, or None if not recorded.
        cuts: whether cuts at spaces are exact, or None if not recorded.
        chat_template_sha256: a chat build: the hash of its chat template (compared on resume).
    """

    kind: str = key(STR, required=True)
    name: str = key(STR, required=True)
    vocab_size: int = key(INT, required=True)
    sha256: str | None = key(STR, None, omit=True)
    spec: str | None = key(STR, None, omit=True)
    cuts: Cuts | None = key(section_kind(Cuts), None, omit=True)  # noqa: RUF009 (a field)
    chat_template_sha256: str | None = key(STR, None, omit=True)

    section_name: ClassVar[str] = "tokenizer"

    @property
    def identity(self) -> str:
        """What tells this tokenizer from another: its definition's hash, else its name."""
        return self.sha256 or self.name


@dataclass(frozen=True)
class EosPolicy(Section):
    """Whether an EOS id is appended after every document, and which (the manifest's ``eos``)."""

    append: bool = key(BOOL, required=True)
    id: int | None = key(or_null(COUNT), None)

    section_name: ClassVar[str] = "eos"

    def _check(self, where: str, name: str) -> None:
        if self.append and self.id is None:
            problem = f"{name}.id must be a non-negative integer when append is true"
            raise CacheError(malformed(where, problem))

    @property
    def appended(self) -> int | None:
        """The id appended after every document, or None."""
        return self.id if self.append else None


@dataclass(frozen=True)
class BosPolicy(Section):
    """Whether a BOS id is put before every document, and which (the manifest's ``bos``)."""

    prepend: bool = key(BOOL, required=True)
    id: int | None = key(or_null(COUNT), None)

    section_name: ClassVar[str] = "bos"

    def _check(self, where: str, name: str) -> None:
        if self.prepend and self.id is None:
            problem = f"{name}.id must be a non-negative integer when prepend is true"
            raise CacheError(malformed(where, problem))

    @property
    def prepended(self) -> int | None:
        """The id put before every document, or None."""
        return self.id if self.prepend else None


@dataclass(frozen=True)
class BuildSettings(Section):
    """The manifest's ``settings``: the build's :class:`~streampack.CacheSpec`, recorded whole.

    A key a cache written before its setting existed lacks reads as the value such a build had, and stays
    absent when the section is written again.
    """

    tokenizer: str | None = key(STR, None, omit=True)  # None: not recorded
    special_tokens: str | None = key(STR, None, omit=True)
    eos: bool = key(BOOL, True)
    eos_id: int | None = key(or_null(COUNT), None)
    bos: bool = key(BOOL, False)
    bos_id: int | None = key(or_null(COUNT), None)
    text_field: str = key(STR, "text")
    split_lines: bool = key(BOOL, False)
    unit_bytes: int = key(COUNT, 64 << 20)
    max_piece_chars: int | None = key(or_null(COUNT), None)
    fields: tuple[str, ...] | None = key(or_null(STRINGS), None)
    chat: str | None = key(or_null(STR), None)
    # (left out at their defaults, as from the identity: see streampack.format.identity)
    chat_turns: str = key(STR, "all", omit=True)
    chat_reasoning: str = key(STR, "train", omit=True)

    section_name: ClassVar[str] = "settings"

    def __post_init__(self) -> None:
        """``fields`` given as a list (as :meth:`CacheSpec.to_json` writes it) is kept as a tuple."""
        if isinstance(self.fields, list):
            object.__setattr__(self, "fields", tuple(self.fields))

    @property
    def sft(self) -> bool:
        """An SFT build (fields or chat)."""
        return self.fields is not None or self.chat is not None


@dataclass(frozen=True)
class InputRecord(Section):
    """One input the build read (the manifest's ``inputs[i]``): what tells a changed input on resume.

    Attributes:
        path: the file or URL; ``python:TYPE`` for Python documents.
        size: its size in bytes (Python documents: their number, or None when unknown).
        mtime_ns: its modification time, or None (Python documents, object storage without one).
        fingerprint: Python documents only: what identifies them across runs, or None.
    """

    path: str = key(STR, required=True)
    size: int | None = key(or_null(COUNT), None)
    mtime_ns: int | None = key(or_null(INT), None)
    fingerprint: str | None = key(or_null(STR), None)

    section_name: ClassVar[str] = "inputs[]"

    @property
    def python(self) -> bool:
        """Python documents, not a file."""
        return self.path.startswith("python:")

    def to_json(self) -> dict[str, Any]:
        """See :meth:`Section.to_json`; the builder records a fingerprint for Python documents only."""
        written = super().to_json()
        if self.json_keys is None and not self.python and self.fingerprint is None:
            del written["fingerprint"]
        return written


class _InputCheck(msgspec.Struct):
    """What :class:`InputRecord` accepts, for checking a whole list at once (unknown keys are ignored)."""

    path: str
    size: Annotated[int, msgspec.Meta(ge=0)] | None = None
    mtime_ns: int | None = None
    fingerprint: str | None = None


@dataclass(frozen=True)
class Verification(Section):
    """How the ids of an engine other than the reference were checked (an engine record's ``verify``)."""

    mode: str = key(STR, required=True)
    first: int | None = key(COUNT, None, omit=True)
    rate: float | None = key(NUMBER, None, omit=True)

    section_name: ClassVar[str] = "engines[].verify"


@dataclass(frozen=True)
class EngineRecord(Section):
    """One engine that computed ids over the runs of a build (the manifest's ``engines[i]``).

    Informational: not compared on resume (every engine gives the same ids).
    """

    name: str = key(STR, required=True)
    version: str = key(STR, required=True)
    reference: str | None = key(STR, None, omit=True)
    why: str | None = key(STR, None, omit=True)
    verify: Verification | None = key(section_kind(Verification), None, omit=True)  # noqa: RUF009

    section_name: ClassVar[str] = "engines[]"


@dataclass(frozen=True)
class IgnoredEntry(Section):
    """An entry under an input directory or glob that the build did not read, and why."""

    path: str = key(STR, required=True)
    reason: str = key(STR, required=True)

    section_name: ClassVar[str] = "ignored_inputs.first[]"


@dataclass(frozen=True)
class IgnoredInputs(Section):
    """What discovery skipped (the manifest's ``ignored_inputs``; ``{}``, all defaults, when nothing).

    Attributes:
        count: entries skipped.
        by_reason: how many for each reason (``hidden``, ``duplicate``, ...).
        first: the first few entries.
    """

    count: int = key(COUNT, 0, omit=True)
    by_reason: Mapping[str, int] = key(COUNTS, {}, omit=True)
    first: tuple[IgnoredEntry, ...] = key(sections_kind(IgnoredEntry), (), omit=True)

    section_name: ClassVar[str] = "ignored_inputs"

    def __bool__(self) -> bool:
        return self.count > 0 or bool(self.extra)


class InputRecords(Sequence[InputRecord]):
    """The manifest's ``inputs``: their JSON objects, checked as a whole when read, each an
    :class:`InputRecord` when asked for (a cache of 10^5 files need not make 10^5 records to open).
    """

    def __init__(self, raws: list[dict[str, Any]]) -> None:
        self._raws = raws

    @classmethod
    def from_json(cls, raw: Any, *, where: str = "manifest.json", name: str = "inputs") -> InputRecords:
        """Check the JSON list of inputs; raises CacheError as :meth:`InputRecord.from_json` does."""
        if not isinstance(raw, list):
            raise CacheError(malformed(where, f"{name} must be a list of objects (got {shown(raw)})"))
        try:
            msgspec.convert(raw, list[_InputCheck])  # 10^5 inputs checked in C, making no InputRecord
        except msgspec.ValidationError:
            for i, item in enumerate(raw):  # the first bad one says what is wrong
                InputRecord.from_json(item, where=where, name=f"{name}[{i}]")
        return cls(raw)

    def to_json(self) -> list[dict[str, Any]]:
        """The JSON list, as it was read."""
        return list(self._raws)

    def __len__(self) -> int:
        return len(self._raws)

    @overload
    def __getitem__(self, index: int) -> InputRecord: ...

    @overload
    def __getitem__(self, index: slice) -> list[InputRecord]: ...

    def __getitem__(self, index: int | slice) -> InputRecord | list[InputRecord]:
        if isinstance(index, slice):
            return [InputRecord.from_json(raw) for raw in self._raws[index]]
        return InputRecord.from_json(self._raws[index])

    def __iter__(self) -> Iterator[InputRecord]:
        return (InputRecord.from_json(raw) for raw in self._raws)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, InputRecords):
            return self._raws == other._raws
        if isinstance(other, Sequence) and not isinstance(other, str):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"InputRecords({len(self)} inputs)"


def sections_of(raw: Any, cls: type[S], *, where: str, name: str) -> tuple[S, ...]:
    """A JSON list of ``cls`` sections (``engines``); a :class:`CacheError` if it is not one."""
    if not isinstance(raw, list):
        raise CacheError(malformed(where, f"{name} must be a list of objects (got {shown(raw)})"))
    return tuple(cls.from_json(item, where=where, name=f"{name}[{i}]") for i, item in enumerate(raw))

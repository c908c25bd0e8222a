"""The sections of a manifest as typed, frozen records: :class:`TokenizerInfo`, :class:`EosPolicy`,
:class:`BosPolicy`, :class:`BuildSettings`, :class:`InputRecord`, :class:`EngineRecord` and
:class:`IgnoredInputs` (docs/FORMAT.md describes each), and :class:`Section`, their base.

A section is a frozen dataclass with one field per key: its type, its default (a key without one is
required), and (:data:`OMIT`) whether a section made in code leaves it out at its default.
:meth:`Section.from_json` checks a JSON object with msgspec, naming the file and the JSON path of what is
wrong;
:meth:`Section.to_json` gives back the object it was read from, absent, unknown and ordered keys included,
so a manifest read and written again keeps its bytes and its build identity.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import MISSING, dataclass, field
from typing import Annotated, Any, ClassVar, TypeVar, overload

import msgspec

from streampack.errors import CacheError, read_json

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


S = TypeVar("S", bound="Section")
Count = Annotated[int, msgspec.Meta(ge=0)]  # a non-negative integer


#: The metadata of a key that a section made in code leaves out while it holds its default (the builder
#: writes it only with a value).
OMIT = {"omit": True}


@dataclass(frozen=True)
class Section:
    """A JSON object of the manifest as a record: one field per key this version knows.

    Attributes:
        extra: the keys this version does not know (a later version wrote them), kept as they were.
        json_keys: the keys of the JSON object it was read from, in their order (None: made in code).
            Not compared: two sections with the same content are equal however they were written.
    """

    extra: Mapping[str, Any] = field(default_factory=dict, kw_only=True, repr=False, hash=False)
    json_keys: tuple[str, ...] | None = field(default=None, kw_only=True, repr=False, compare=False)

    section_name: ClassVar[str] = "section"

    @classmethod
    @functools.cache
    def _keys(cls) -> dict[str, tuple[Any, bool]]:
        """The section's keys, by name, in the order the builder writes them: (default, omitted at it)."""
        return {
            f.name: (
                f.default_factory() if f.default_factory is not MISSING else f.default,
                "omit" in f.metadata,
            )
            for f in dataclasses.fields(cls)
            if f.name not in ("extra", "json_keys")
        }

    @classmethod
    def from_json(cls: type[S], raw: Any, *, where: str = "manifest.json", name: str | None = None) -> S:
        """Read the section from its JSON object.

        Args:
            raw: the parsed JSON.
            where: how messages name the file (its path).
            name: how messages name the section (default: its key in the manifest).

        Raises:
            CacheError: ``raw`` is not an object, lacks a required key, or holds a value of the wrong type;
                the message names the file and the JSON path.
        """
        name = name or cls.section_name
        try:
            section = msgspec.convert(raw, cls)
        except msgspec.ValidationError:  # read again, for the message naming the file and the JSON path
            problem = f"{where}: malformed manifest"
            section = read_json(raw, cls, CacheError, problem, _REBUILD, at=f"$.{name}")
        section._remember(raw)
        section._check(where, name)
        return section

    def _remember(self, raw: dict[str, Any]) -> None:
        """Keep the order and the unknown keys of ``raw``, the JSON object read (and in nested sections)."""
        keys = self._keys()
        self.__dict__["json_keys"] = tuple(raw)  # (frozen: __dict__ costs less than object.__setattr__)
        extra = {} if raw.keys() <= keys.keys() else {k: v for k, v in raw.items() if k not in keys}
        self.__dict__["extra"] = extra
        for name, value in raw.items():  # nested sections, alone or in a list, remember theirs
            if type(value) in (dict, list) and name in keys:
                nested = getattr(self, name)
                pairs = [(nested, value)] if isinstance(nested, Section) else zip(nested, value)
                for item, item_raw in pairs:
                    if isinstance(item, Section):
                        item._remember(item_raw)

    def _check(self, where: str, name: str) -> None:
        """What the types alone do not say (one field's value requiring another's); raises CacheError."""

    def to_json(self) -> dict[str, Any]:
        """The section's JSON object: the one it was read from, or the one the builder writes."""
        keys, extra = self._keys(), self.extra
        written: dict[str, Any] = {}
        if self.json_keys is not None:
            for name in self.json_keys:  # as it was read
                if name in keys:
                    written[name] = _dumped(getattr(self, name))
                elif name in extra:
                    written[name] = extra[name]
            if len(written) == len(keys) + len(extra):
                return written
            # Changed since it was read (dataclasses.replace): a value given to a key that was absent.
            chosen = [n for n, (unset, _) in keys.items() if n not in written and getattr(self, n) != unset]
        else:  # made in code: every key, but those that hold their default and are written only with a value
            chosen = [n for n, (default, omit) in keys.items() if not (omit and getattr(self, n) == default)]
        for name in chosen:
            written[name] = _dumped(getattr(self, name))
        written.update((name, value) for name, value in extra.items() if name not in written)
        return written


def _dumped(value: Any) -> Any:
    """A key's value as JSON: nested sections as objects, tuples as lists."""
    if isinstance(value, Section):
        return value.to_json()
    if isinstance(value, tuple):
        return [_dumped(item) for item in value]
    return dict(value) if isinstance(value, Mapping) else value


_REBUILD = "rebuild the cache (overwrite=True)"


def malformed(where: str, problem: str) -> str:
    return f"{where}: malformed manifest: {problem}; {_REBUILD}"


@dataclass(frozen=True)
class Cuts(Section):
    """Whether cutting a long document at spaces is proven to give the tokenizer's own ids, and why."""

    exact: bool
    reason: str

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

    kind: str
    name: str
    vocab_size: int
    sha256: str | None = field(default=None, metadata=OMIT)
    spec: str | None = field(default=None, metadata=OMIT)
    cuts: Cuts | None = field(default=None, metadata=OMIT)
    chat_template_sha256: str | None = field(default=None, metadata=OMIT)

    section_name: ClassVar[str] = "tokenizer"

    @property
    def identity(self) -> str:
        """What tells this tokenizer from another: its definition's hash, else its name."""
        return self.sha256 or self.name


@dataclass(frozen=True)
class EosPolicy(Section):
    """Whether an EOS id is appended after every document, and which (the manifest's ``eos``)."""

    append: bool
    id: Count | None = None

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

    prepend: bool
    id: Count | None = None

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

    tokenizer: str | None = field(default=None, metadata=OMIT)  # None: not recorded
    special_tokens: str | None = field(default=None, metadata=OMIT)
    eos: bool = True
    eos_id: Count | None = None
    bos: bool = False
    bos_id: Count | None = None
    text_field: str = "text"
    split_lines: bool = False
    unit_bytes: Count = 64 << 20
    max_piece_chars: Count | None = None
    fields: tuple[str, ...] | None = None
    chat: str | None = None
    # (left out at their defaults, as from the identity: see streampack.format.manifest.build_identity)
    chat_turns: str = field(default="all", metadata=OMIT)
    chat_reasoning: str = field(default="train", metadata=OMIT)

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

    path: str
    size: Count | None = None
    mtime_ns: int | None = None
    fingerprint: str | None = None

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
    size: Count | None = None
    mtime_ns: int | None = None
    fingerprint: str | None = None


@dataclass(frozen=True)
class Verification(Section):
    """How the ids of an engine other than the reference were checked (an engine record's ``verify``)."""

    mode: str
    first: Count | None = field(default=None, metadata=OMIT)
    rate: int | float | None = field(default=None, metadata=OMIT)

    section_name: ClassVar[str] = "engines[].verify"


@dataclass(frozen=True)
class EngineRecord(Section):
    """One engine that computed ids over the runs of a build (the manifest's ``engines[i]``).

    Informational: not compared on resume (every engine gives the same ids).
    """

    name: str
    version: str
    reference: str | None = field(default=None, metadata=OMIT)
    why: str | None = field(default=None, metadata=OMIT)
    verify: Verification | None = field(default=None, metadata=OMIT)

    section_name: ClassVar[str] = "engines[]"


@dataclass(frozen=True)
class IgnoredEntry(Section):
    """An entry under an input directory or glob that the build did not read, and why."""

    path: str
    reason: str

    section_name: ClassVar[str] = "ignored_inputs.first[]"


@dataclass(frozen=True)
class IgnoredInputs(Section):
    """What discovery skipped (the manifest's ``ignored_inputs``; ``{}``, all defaults, when nothing).

    Attributes:
        count: entries skipped.
        by_reason: how many for each reason (``hidden``, ``duplicate``, ...).
        first: the first few entries.
    """

    count: Count = field(default=0, metadata=OMIT)
    by_reason: Mapping[str, Count] = field(default_factory=dict, metadata=OMIT, hash=False)
    first: tuple[IgnoredEntry, ...] = field(default=(), metadata=OMIT)

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
        # 10^5 inputs checked in C, making no InputRecord
        read_json(
            raw, list[_InputCheck], CacheError, f"{where}: malformed manifest", _REBUILD, at=f"$.{name}"
        )
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
    read_json(raw, list[dict[str, Any]], CacheError, f"{where}: malformed manifest", _REBUILD, at=f"$.{name}")
    return tuple(cls.from_json(item, where=where, name=f"{name}[{i}]") for i, item in enumerate(raw))

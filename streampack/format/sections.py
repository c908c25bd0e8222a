"""The sections of a manifest as typed, frozen records: :class:`TokenizerInfo`, :class:`EosPolicy`,
:class:`BosPolicy`, :class:`BuildSettings`, :class:`InputRecord`, :class:`EngineRecord` and
:class:`IgnoredInputs` (docs/FORMAT.md describes each), and :class:`Section`, their base.

A section is a frozen dataclass with one field per key, declared with :func:`key`: its :class:`Kind`, its
default (a key without one is required), and whether a section made in code leaves it out at its default.
:meth:`Section.from_json` checks a JSON object once, naming the file and the key of what is wrong;
:meth:`Section.to_json` gives back the object it was read from, absent, unknown and ordered keys included,
so a manifest read and written again keeps its bytes and its build identity.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, TypeVar, overload

import msgspec

from streampack.errors import CacheError

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
    "Kind",
    "Section",
    "TokenizerInfo",
    "Verification",
    "key",
]


S = TypeVar("S", bound="Section")


@dataclass(frozen=True)
class Kind:
    """What a key's value must be: ``what`` for messages, ``parse`` from JSON, ``dump`` back to JSON (None:
    the JSON value itself, kept as it is)."""

    what: str
    accepts: Callable[[Any], bool]
    parse: Callable[[Any, str, str], Any] | None = None
    dump: Callable[[Any], Any] | None = None
    # Types whose every value is accepted, checked before ``accepts``: a call spared per key.
    exact: frozenset[type] = frozenset()


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


STR = Kind("a string", lambda v: isinstance(v, str), exact=frozenset({str}))
BOOL = Kind("true or false", lambda v: isinstance(v, bool), exact=frozenset({bool}))
INT = Kind("an integer", is_int, exact=frozenset({int}))
COUNT = Kind("a non-negative integer", lambda v: is_int(v) and v >= 0)
NUMBER = Kind("a number", lambda v: is_int(v) or isinstance(v, float))
COUNTS = Kind(
    "an object of non-negative integers",
    lambda v: isinstance(v, dict) and all(is_int(n) and n >= 0 for n in v.values()),
    parse=lambda value, where, name: dict(value),
    dump=dict,
)
STRINGS = Kind(
    "a list of strings",
    lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
    parse=lambda value, where, name: tuple(value),  # a tuple: the record stays hashable
    dump=list,
)


def or_null(kind: Kind) -> Kind:
    """``kind``, or JSON null (None)."""
    parse, dump = kind.parse, kind.dump
    return Kind(
        f"{kind.what} or null",
        lambda v: v is None or kind.accepts(v),
        parse=None
        if parse is None
        else lambda value, where, name: None if value is None else parse(value, where, name),
        dump=None if dump is None else lambda value: None if value is None else dump(value),
        exact=kind.exact | {type(None)},
    )


def section_kind(cls: type[Section]) -> Kind:
    """A nested section (an object read by ``cls.from_json``)."""
    return Kind(
        "an object",
        lambda v: isinstance(v, dict),
        parse=lambda value, where, name: cls.from_json(value, where=where, name=name),
        dump=lambda value: value.to_json(),
    )


def sections_kind(cls: type[Section]) -> Kind:
    """A list of nested sections."""
    return Kind(
        "a list of objects",
        lambda v: isinstance(v, list) and all(isinstance(item, dict) for item in v),
        parse=lambda value, where, name: tuple(
            cls.from_json(item, where=where, name=f"{name}[{i}]") for i, item in enumerate(value)
        ),
        dump=lambda value: [item.to_json() for item in value],
    )


def key(kind: Kind, default: Any = dataclasses.MISSING, *, omit: bool = False) -> Any:
    """A dataclass field that is a key of the section's JSON object.

    Args:
        kind: what its value must be.
        default: its value when the key is absent from the JSON; without one, a JSON object without the key
            is refused.
        omit: a section made in code leaves the key out while it holds ``default`` (the builder writes it
            only when it has a value).
    """
    spec = _Key(kind, default is dataclasses.MISSING, omit, default)
    metadata = {"kind": kind, "key": spec}
    if default is dataclasses.MISSING:
        return field(metadata=metadata)
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata, hash=False)
    return field(default=default, metadata=metadata)


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
    def _keys(cls) -> dict[str, _Key]:
        """The section's keys, by name, in the order the builder writes them."""
        return {f.name: f.metadata["key"] for f in dataclasses.fields(cls) if "key" in f.metadata}

    @classmethod
    def from_json(cls: type[S], raw: Any, *, where: str = "manifest.json", name: str | None = None) -> S:
        """Read the section from its JSON object.

        Args:
            raw: the parsed JSON.
            where: how messages name the file (its path).
            name: how messages name the section (default: its key in the manifest).

        Raises:
            CacheError: ``raw`` is not an object, lacks a required key, or holds a value of the wrong type;
                the message names the file and the key.
        """
        name = name or cls.section_name
        if not isinstance(raw, dict):
            raise CacheError(malformed(where, f"{name} must be an object (got {shown(raw)})"))
        keys = cls._keys()
        values: dict[str, Any] = {}
        absent = 0
        for key_name, key in keys.items():
            if key_name not in raw:
                absent += 1
                if key.required:
                    raise CacheError(malformed(where, f"{name} has no {key_name!r} ({key.kind.what})"))
                values[key_name] = dict(key.default) if type(key.default) is dict else key.default
                continue
            value = raw[key_name]
            kind = key.kind
            if type(value) not in kind.exact and not kind.accepts(value):
                problem = f"{name}.{key_name} must be {kind.what} (got {shown(value)})"
                raise CacheError(malformed(where, problem))
            values[key_name] = value if kind.parse is None else kind.parse(value, where, f"{name}.{key_name}")
        unknown = len(raw) > len(keys) - absent
        values["extra"] = {k: v for k, v in raw.items() if k not in keys} if unknown else {}
        values["json_keys"] = tuple(raw)
        # The values are checked: set them as the dataclass's __init__ would, without its object.__setattr__
        # per field (a third of the time of reading an input record).
        section = object.__new__(cls)
        section.__dict__.update(values)
        section.__post_init__()
        section._check(where, name)
        return section

    def __post_init__(self) -> None:
        """Nothing to do here; a section whose fields need it normalises them."""

    def _check(self, where: str, name: str) -> None:
        """What the types alone do not say (one field's value requiring another's); raises CacheError."""

    def to_json(self) -> dict[str, Any]:
        """The section's JSON object: the one it was read from, or the one the builder writes."""
        keys, values, extra = self._keys(), self.__dict__, self.extra
        written: dict[str, Any] = {}
        if self.json_keys is not None:
            for name in self.json_keys:  # as it was read
                key = keys.get(name)
                if key is not None:
                    written[name] = values[name] if key.kind.dump is None else key.kind.dump(values[name])
                elif name in extra:
                    written[name] = extra[name]
            if len(written) == len(keys) + len(extra):
                return written
            # Changed since it was read (dataclasses.replace): a value given to a key that was absent.
            chosen = [n for n, key in keys.items() if n not in written and values[n] != key.default]
        else:  # made in code: every key, but those that hold their default and are written only with a value
            chosen = [n for n, key in keys.items() if not (key.omit and values[n] == key.default)]
        for name in chosen:
            dump = keys[name].kind.dump
            written[name] = values[name] if dump is None else dump(values[name])
        written.update((name, value) for name, value in extra.items() if name not in written)
        return written


@dataclass(frozen=True)
class _Key:
    """A key of a section, as :func:`key` declared it (``default``: ``dataclasses.MISSING`` if required)."""

    kind: Kind
    required: bool
    omit: bool
    default: Any


def malformed(where: str, problem: str) -> str:
    return f"{where}: malformed manifest: {problem}; rebuild the cache (overwrite=True)"


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class Cuts(Section):
    """Whether cutting a long document at spaces is proven to give the tokenizer's own ids, and why."""

    exact: bool = key(BOOL)
    reason: str = key(STR)

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

    kind: str = key(STR)
    name: str = key(STR)
    vocab_size: int = key(INT)
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

    append: bool = key(BOOL)
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

    prepend: bool = key(BOOL)
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
    # (left out at their defaults, as from the identity: see streampack.format.manifest.build_identity)
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

    path: str = key(STR)
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

    mode: str = key(STR)
    first: int | None = key(COUNT, None, omit=True)
    rate: float | None = key(NUMBER, None, omit=True)

    section_name: ClassVar[str] = "engines[].verify"


@dataclass(frozen=True)
class EngineRecord(Section):
    """One engine that computed ids over the runs of a build (the manifest's ``engines[i]``).

    Informational: not compared on resume (every engine gives the same ids).
    """

    name: str = key(STR)
    version: str = key(STR)
    reference: str | None = key(STR, None, omit=True)
    why: str | None = key(STR, None, omit=True)
    verify: Verification | None = key(section_kind(Verification), None, omit=True)  # noqa: RUF009

    section_name: ClassVar[str] = "engines[]"


@dataclass(frozen=True)
class IgnoredEntry(Section):
    """An entry under an input directory or glob that the build did not read, and why."""

    path: str = key(STR)
    reason: str = key(STR)

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

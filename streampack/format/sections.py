"""The sections of a manifest as typed, frozen records: :class:`TokenizerInfo`, :class:`EosPolicy`,
:class:`BosPolicy`, :class:`BuildSettings`, :class:`InputRecord`, :class:`EngineRecord` and
:class:`IgnoredInputs` (docs/FORMAT.md describes each).

Each has ``from_json`` (validating: a missing or mistyped field is a :class:`~streampack.errors.CacheError`
naming the file and the field) and ``to_json``, which gives back exactly the JSON object it was read from:
the same keys in the same order, a key absent stays absent, and keys this version does not know (written
by a later one) are kept, in :attr:`Section.extra`. A section made in code writes the JSON the builder has
always written. So a manifest read and written again keeps its bytes, and what is computed from its JSON
(the build identity, :mod:`streampack.format.identity`) keeps its values.

Why records and not the dicts that used to stand here: a consumer reads ``manifest.tokenizer.vocab_size``,
checked once at the door, instead of ``manifest.tokenizer["vocab_size"]`` at every use, where a missing key
is a ``KeyError`` far from the file. Reading a section by key (``section["name"]``) still works, with a
:class:`DeprecationWarning`.

Pure: imports nothing of streampack's but :mod:`streampack.errors`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import repeat
from operator import is_not
from typing import Any, ClassVar, TypeVar, overload

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
    "Section",
    "TokenizerInfo",
    "Verification",
]

S = TypeVar("S", bound="Section")

# ------------------------------------------------------------------------------------- the value checks


@dataclass(frozen=True)
class _Kind:
    """What a key's value must be: ``what`` for messages, ``parse`` from JSON, ``dump`` back to JSON (None:
    the JSON value itself, kept as it is)."""

    what: str
    accepts: Callable[[Any], bool]
    parse: Callable[[Any, str, str], Any] | None = None
    dump: Callable[[Any], Any] | None = None
    # Types whose every value is accepted: checked by ``type(value) in exact`` before ``accepts`` is called,
    # which spares a call per key (a manifest may list 10^5 inputs). JSON gives values of exactly these.
    exact: frozenset[type] = frozenset()
    at_least: int | None = None  # integers (not bools) from this one up are accepted too


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_STR = _Kind("a string", lambda v: isinstance(v, str), exact=frozenset({str}))
_BOOL = _Kind("true or false", lambda v: isinstance(v, bool), exact=frozenset({bool}))
_INT = _Kind("an integer", _is_int, exact=frozenset({int}))
_COUNT = _Kind("a non-negative integer", lambda v: _is_int(v) and v >= 0, at_least=0)
_NUMBER = _Kind("a number", lambda v: _is_int(v) or isinstance(v, float))
_COUNTS = _Kind(
    "an object of non-negative integers",
    lambda v: isinstance(v, dict) and all(_is_int(n) and n >= 0 for n in v.values()),
    parse=lambda value, where, name: dict(value),
    dump=dict,
)
_STRINGS = _Kind(
    "a list of strings",
    lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
    parse=lambda value, where, name: tuple(value),  # a tuple: the record stays hashable
    dump=list,
)


def _or_null(kind: _Kind) -> _Kind:
    """``kind``, or JSON null (None)."""
    if kind.parse is None and kind.dump is None:
        exact = kind.exact | {type(None)}
        accepts = kind.accepts
        what = f"{kind.what} or null"
        return _Kind(what, lambda v: v is None or accepts(v), exact=exact, at_least=kind.at_least)
    parse, dump = kind.parse, kind.dump
    assert parse is not None and dump is not None
    return _Kind(
        f"{kind.what} or null",
        lambda v: v is None or kind.accepts(v),
        parse=lambda value, where, name: None if value is None else parse(value, where, name),
        dump=lambda value: None if value is None else dump(value),
        exact=kind.exact | {type(None)},
    )


def _section(cls: type[Section]) -> _Kind:
    """A nested section (an object read by ``cls.from_json``)."""
    return _Kind(
        "an object",
        lambda v: isinstance(v, dict),
        parse=lambda value, where, name: cls.from_json(value, where=where, name=name),
        dump=lambda value: value.to_json(),
    )


def _sections(cls: type[Section]) -> _Kind:
    """A list of nested sections."""
    return _Kind(
        "a list of objects",
        lambda v: isinstance(v, list) and all(isinstance(item, dict) for item in v),
        parse=lambda value, where, name: tuple(
            cls.from_json(item, where=where, name=f"{name}[{i}]") for i, item in enumerate(value)
        ),
        dump=lambda value: [item.to_json() for item in value],
    )


def _key(
    kind: _Kind, default: Any = dataclasses.MISSING, *, required: bool = False, omit: bool = False
) -> Any:
    """A dataclass field that is a key of the section's JSON object.

    Args:
        kind: what its value must be.
        default: its value when the key is absent from the JSON.
        required: a JSON object without the key is refused.
        omit: a section made in code leaves the key out while it holds ``default`` (the builder writes it
            only when it has a value).
    """
    metadata = {"kind": kind, "required": required, "omit": omit}
    if default is dataclasses.MISSING:
        return field(metadata=metadata)
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata, hash=False)
    return field(default=default, metadata=metadata)


# ----------------------------------------------------------------------------------------- the base


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
    def _keys(cls) -> dict[str, _Key]:
        """The section's keys, by name, in the order the builder writes them (computed once per class)."""
        keys = _KEYS.get(cls)
        if keys is None:
            keys = _KEYS[cls] = {f.name: _Key.of(f) for f in dataclasses.fields(cls) if "kind" in f.metadata}
        return keys

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
            raise CacheError(_malformed(where, f"{name} must be an object (got {_shown(raw)})"))
        keys = cls._keys()
        values: dict[str, Any] = {}
        absent = 0
        for key_name, key in keys.items():
            if key_name not in raw:
                absent += 1
                if key.required:
                    raise CacheError(_malformed(where, f"{name} has no {key_name!r} ({key.kind.what})"))
                values[key_name] = dict(key.default) if type(key.default) is dict else key.default
                continue
            value = raw[key_name]
            kind = key.kind
            if type(value) not in kind.exact and not kind.accepts(value):
                problem = f"{name}.{key_name} must be {kind.what} (got {_shown(value)})"
                raise CacheError(_malformed(where, problem))
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

    @classmethod
    def all_valid(cls, raws: list[Any]) -> bool:
        """Whether every JSON object of ``raws`` reads as this section, checked a key at a time over all of
        them (a few passes in C, not a loop in Python per object); False also where it cannot tell (a
        nested section, a check between fields): :meth:`from_json` on each then says."""
        if set(map(type, raws)) - {dict} or cls._check is not Section._check:
            return False
        for key_name, key in cls._keys().items():
            kind = key.kind
            if kind.parse is not None:
                return False
            # In C: dict.get over the objects (_NO_DEFAULT, an object(), where the key is absent).
            column = list(map(dict.get, raws, repeat(key_name), repeat(_NO_DEFAULT)))
            types = set(map(type, column))
            found = types - kind.exact - (set() if key.required else {object})
            if found == {int} and kind.at_least is not None:
                ints = column if len(types) == 1 else filter(partial(is_not, None), column)
                if min(filter(partial(is_not, _NO_DEFAULT), ints), default=kind.at_least) < kind.at_least:
                    return False
            elif found:
                return False
        return True

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

    # Reading by key, as when the sections were dicts: deprecated, for code written then.

    def __getitem__(self, key: str) -> Any:
        _warn_key(self, key)
        return self.to_json()[key]

    def get(self, key: str, default: Any = None) -> Any:
        """The JSON value of ``key`` (deprecated: read the attribute)."""
        _warn_key(self, key)
        return self.to_json().get(key, default)

    def __contains__(self, key: object) -> bool:
        _warn_key(self, str(key))
        return key in self.to_json()


@dataclass(frozen=True)
class _Key:
    """A key of a section, as :func:`_key` declared it (``default``: a value no record holds if none)."""

    kind: _Kind
    required: bool
    omit: bool
    default: Any

    @classmethod
    def of(cls, f: dataclasses.Field[Any]) -> _Key:
        default: Any = _NO_DEFAULT
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        return cls(f.metadata["kind"], f.metadata["required"], f.metadata["omit"], default)


_NO_DEFAULT = object()
_KEYS: dict[type[Section], dict[str, _Key]] = {}


def _warn_key(section: Section, key: str) -> None:
    warnings.warn(
        f"manifest sections are records: read {section.section_name}.{key} as an attribute "
        f"({type(section).__name__}), not as {section.section_name}[{key!r}]",
        DeprecationWarning,
        stacklevel=3,
    )


def _malformed(where: str, problem: str) -> str:
    return f"{where}: malformed manifest: {problem}; rebuild the cache (overwrite=True)"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ---------------------------------------------------------------------------------------- the sections


@dataclass(frozen=True)
class Cuts(Section):
    """Whether cutting a long document at spaces is proven to give the tokenizer's own ids, and why."""

    exact: bool = _key(_BOOL, required=True)
    reason: str = _key(_STR, required=True)

    section_name: ClassVar[str] = "tokenizer.cuts"


_CUTS = _section(Cuts)


@dataclass(frozen=True)
class TokenizerInfo(Section):
    """The manifest's ``tokenizer``: what the cache was tokenized with.

    Attributes:
        kind: ``bytes``, ``hf``, ``tiktoken`` (``synthetic`` for a cache written from arrays).
        name: the tokenizer's file name (``tokenizer.json``), or ``bytes``.
        vocab_size: token ids are below it (the tokenizer's, grown past an EOS/BOS id given beyond it).
        sha256: the hash of the tokenizer's definition (compared on resume), or None if not recorded.
        spec: the SPEC the build was given, or None if not recorded.
        cuts: whether cuts at spaces are exact, or None if not recorded.
        chat_template_sha256: a chat build: the hash of its chat template (compared on resume).
    """

    kind: str = _key(_STR, required=True)
    name: str = _key(_STR, required=True)
    vocab_size: int = _key(_INT, required=True)
    sha256: str | None = _key(_STR, None, omit=True)
    spec: str | None = _key(_STR, None, omit=True)
    cuts: Cuts | None = _key(_CUTS, None, omit=True)  # noqa: RUF009 (_key makes a dataclasses.field)
    chat_template_sha256: str | None = _key(_STR, None, omit=True)

    section_name: ClassVar[str] = "tokenizer"

    @property
    def identity(self) -> str:
        """What tells this tokenizer from another: its definition's hash, else its name."""
        return self.sha256 or self.name


@dataclass(frozen=True)
class EosPolicy(Section):
    """Whether an EOS id is appended after every document, and which (the manifest's ``eos``)."""

    append: bool = _key(_BOOL, required=True)
    id: int | None = _key(_or_null(_COUNT), None)

    section_name: ClassVar[str] = "eos"

    def _check(self, where: str, name: str) -> None:
        if self.append and self.id is None:
            problem = f"{name}.id must be a non-negative integer when append is true"
            raise CacheError(_malformed(where, problem))

    @property
    def appended(self) -> int | None:
        """The id appended after every document, or None."""
        return self.id if self.append else None


@dataclass(frozen=True)
class BosPolicy(Section):
    """Whether a BOS id is put before every document, and which (the manifest's ``bos``)."""

    prepend: bool = _key(_BOOL, required=True)
    id: int | None = _key(_or_null(_COUNT), None)

    section_name: ClassVar[str] = "bos"

    def _check(self, where: str, name: str) -> None:
        if self.prepend and self.id is None:
            problem = f"{name}.id must be a non-negative integer when prepend is true"
            raise CacheError(_malformed(where, problem))

    @property
    def prepended(self) -> int | None:
        """The id put before every document, or None."""
        return self.id if self.prepend else None


@dataclass(frozen=True)
class BuildSettings(Section):
    """The manifest's ``settings``: the build's :class:`~streampack.CacheSpec`, recorded whole.

    A cache written before a setting existed lacks its key: the field then holds the value such a build
    had (``special_tokens``: None, not recorded), and the key stays absent when the section is written.
    A cache written from arrays (:mod:`streampack.testing`) records none of them.
    """

    tokenizer: str | None = _key(_STR, None, omit=True)  # None: not recorded
    special_tokens: str | None = _key(_STR, None, omit=True)
    eos: bool = _key(_BOOL, True)
    eos_id: int | None = _key(_or_null(_COUNT), None)
    bos: bool = _key(_BOOL, False)
    bos_id: int | None = _key(_or_null(_COUNT), None)
    text_field: str = _key(_STR, "text")
    split_lines: bool = _key(_BOOL, False)
    unit_bytes: int = _key(_COUNT, 64 << 20)
    max_piece_chars: int | None = _key(_or_null(_COUNT), None)
    fields: tuple[str, ...] | None = _key(_or_null(_STRINGS), None)
    chat: str | None = _key(_or_null(_STR), None)

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

    path: str = _key(_STR, required=True)
    size: int | None = _key(_or_null(_COUNT), None)
    mtime_ns: int | None = _key(_or_null(_INT), None)
    fingerprint: str | None = _key(_or_null(_STR), None)

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


@dataclass(frozen=True)
class Verification(Section):
    """How the ids of an engine other than the reference were checked (an engine record's ``verify``)."""

    mode: str = _key(_STR, required=True)
    first: int | None = _key(_COUNT, None, omit=True)
    rate: float | None = _key(_NUMBER, None, omit=True)

    section_name: ClassVar[str] = "engines[].verify"


_VERIFICATION = _section(Verification)


@dataclass(frozen=True)
class EngineRecord(Section):
    """One engine that computed ids over the runs of a build (the manifest's ``engines[i]``).

    Informational: not compared on resume (every engine gives the same ids).
    """

    name: str = _key(_STR, required=True)
    version: str = _key(_STR, required=True)
    reference: str | None = _key(_STR, None, omit=True)
    why: str | None = _key(_STR, None, omit=True)
    verify: Verification | None = _key(_VERIFICATION, None, omit=True)  # noqa: RUF009 (a field too)

    section_name: ClassVar[str] = "engines[]"


@dataclass(frozen=True)
class IgnoredEntry(Section):
    """An entry under an input directory or glob that the build did not read, and why."""

    path: str = _key(_STR, required=True)
    reason: str = _key(_STR, required=True)

    section_name: ClassVar[str] = "ignored_inputs.first[]"


_IGNORED_ENTRIES = _sections(IgnoredEntry)


@dataclass(frozen=True)
class IgnoredInputs(Section):
    """What discovery skipped (the manifest's ``ignored_inputs``; ``{}``, all defaults, when nothing).

    Attributes:
        count: entries skipped.
        by_reason: how many for each reason (``hidden``, ``duplicate``, ...).
        first: the first few entries.
    """

    count: int = _key(_COUNT, 0, omit=True)
    by_reason: Mapping[str, int] = _key(_COUNTS, {}, omit=True)
    first: tuple[IgnoredEntry, ...] = _key(_IGNORED_ENTRIES, (), omit=True)

    section_name: ClassVar[str] = "ignored_inputs"

    def __bool__(self) -> bool:
        return self.count > 0 or bool(self.extra)


class InputRecords(Sequence[InputRecord]):
    """The manifest's ``inputs``: their JSON objects, checked as a whole when read, each an
    :class:`InputRecord` when asked for.

    Why not a list of records: a cache may be built from 10^5 files, and opening it would make 10^5 objects
    that few readers look at (a resumed build, ``which``, ``info``); the objects are kept as read, and
    written back as they are.
    """

    def __init__(self, raws: list[dict[str, Any]]) -> None:
        self._raws = raws

    @classmethod
    def from_json(cls, raw: Any, *, where: str = "manifest.json", name: str = "inputs") -> InputRecords:
        """Check the JSON list of inputs; raises CacheError as :meth:`InputRecord.from_json` does."""
        if not isinstance(raw, list):
            raise CacheError(_malformed(where, f"{name} must be a list of objects (got {_shown(raw)})"))
        if not InputRecord.all_valid(raw):
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
    """A JSON list of ``cls`` sections (``inputs``, ``engines``).

    Raises:
        CacheError: ``raw`` is not a list of such objects.
    """
    if not isinstance(raw, list):
        raise CacheError(_malformed(where, f"{name} must be a list of objects (got {_shown(raw)})"))
    return tuple(cls.from_json(item, where=where, name=f"{name}[{i}]") for i, item in enumerate(raw))

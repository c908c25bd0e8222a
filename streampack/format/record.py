"""A JSON object of the manifest as a typed record: :class:`Section`, the base of the manifest's sections.

A section is a frozen dataclass with one field per key, declared with :func:`key` (its :class:`Kind`,
whether it is required, whether a section made in code leaves it out at its default).
:meth:`Section.from_json` checks a JSON object once, naming the file and the key of what is wrong;
:meth:`Section.to_json` gives back the object it was read from, absent, unknown and ordered keys
included, so what is computed from it (the build identity) keeps its value.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from streampack.errors import CacheError

__all__ = ["Kind", "Section", "key"]

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


def key(kind: Kind, default: Any = dataclasses.MISSING, *, required: bool = False, omit: bool = False) -> Any:
    """A dataclass field that is a key of the section's JSON object.

    Args:
        kind: what its value must be.
        default: its value when the key is absent from the JSON.
        required: a JSON object without the key is refused.
        omit: a section made in code leaves the key out while it holds ``default`` (the builder writes it
            only when it has a value).
    """
    spec = _Key(kind, required, omit, _NO_DEFAULT if default is dataclasses.MISSING else default)
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
    """A key of a section, as :func:`key` declared it (``default``: a value no record holds if none)."""

    kind: Kind
    required: bool
    omit: bool
    default: Any


_NO_DEFAULT = object()


def malformed(where: str, problem: str) -> str:
    return f"{where}: malformed manifest: {problem}; rebuild the cache (overwrite=True)"


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

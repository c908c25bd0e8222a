"""Taking documents and steps out of a run: what :class:`Exclusions` names, and how a checkpoint records it.

An :class:`Exclusions` names documents (by index in a source's cache, by input record as ``streampack
which`` reports it, or by :func:`token_hash`) and ranges of global steps or positions. From the position
it takes effect at, ``mode`` says what happens to them:

* ``"skip"``: samples that touch an excluded document, and excluded positions, are not served; the rest of
  the run is served once, in the same order (:mod:`streampack.loader.excluding`), and the run gets shorter.
* ``"mask"``: positions are unchanged; in dict outputs the excluded tokens get ``labels = -100``, as do
  all tokens of a row at an excluded position.

Steps are the trainer's steps as its logs number them, mapped to positions through the run's history
(:class:`~streampack.loader.history.StepCount`). A loader state records, per exclusion in force, a digest
of what it names (:func:`entry_state`); a resume must be given the checkpoint's exclusions first
(:func:`check_prefix`), then any new ones.

Trade-off: indices cost nothing; finding a list of hashes hashes every document once per process,
O(tokens); a record name reads the input again up to it, which must be as it was at build time.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from msgspec import Struct

from streampack._checks import is_int
from streampack.errors import LoaderStateError, OptionsError, read_json
from streampack.loader.history import StepCount, digest
from streampack.order import MAX_POSITION

__all__ = [
    "ExclusionMode",
    "Exclusions",
    "check_prefix",
    "counted",
    "entry_state",
    "parse_record",
    "token_hash",
]

ExclusionMode = Literal["skip", "mask"]
_MODES = ("skip", "mask")

#: What a list of document ids or hashes is given for: the only source of a loader (one source).
ONLY = ""


def token_hash(tokens: np.ndarray) -> str:
    """The hash that names a document in :class:`Exclusions`: BLAKE2b (16 bytes, hex) of its tokens, as
    :meth:`Cache.doc <streampack.reader.Cache.doc>` returns them, taken as little-endian ``int64`` (so
    the hash does not depend on the cache's token dtype)."""
    data = np.ascontiguousarray(np.asarray(tokens), dtype="<i8").tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


_LINE = re.compile(r"^(?P<path>.+):(?P<line>[0-9]+)$")
_ROW = re.compile(r"^(?P<path>.+)\[(?P<row>[0-9]+)\]$")


def parse_record(name: str) -> tuple[str, int | None, int | None] | None:
    """``(path, line, row)`` of a record named ``path:line`` (lines from 1) or ``path[row]`` (rows from 0);
    None for a name of neither form."""
    if (match := _LINE.match(name)) is not None and int(match["line"]) >= 1:
        return match["path"], int(match["line"]), None
    if (match := _ROW.match(name)) is not None:
        return match["path"], None, int(match["row"])
    return None


_ITEMS = {
    "documents": (lambda one: is_int(one) and one >= 0, "document indices >= 0"),
    "hashes": (lambda one: isinstance(one, str) and len(one) == 32, "32-digit hex token hashes"),
    "records": (
        lambda one: isinstance(one, str) and parse_record(one) is not None,
        "input records named 'path:line' (lines from 1) or 'path[row]' (rows from 0), as streampack which "
        "reports them",
    ),
}


def _by_source(name: str, value: object) -> dict[str, tuple[Any, ...]]:
    """A list (for the only source) or a mapping of source name -> list, as a dict of sorted tuples."""
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, (str, bytes)) or not isinstance(value, Sequence | np.ndarray):
        raise OptionsError(
            f"Exclusions({name}=...) takes a list, or a dict of source name -> list (got {value!r:.120})"
        )
    else:
        pairs = [(ONLY, value)]
    out: dict[str, tuple[Any, ...]] = {}
    for source, items in pairs:
        if not isinstance(source, str):
            raise OptionsError(f"Exclusions({name}=...) source names must be strings (got {source!r})")
        listed = list(np.asarray(items).tolist()) if isinstance(items, np.ndarray) else list(items)
        for one in listed:
            if not _ITEMS[name][0](one):
                allowed = _ITEMS[name][1]
                raise OptionsError(
                    f"Exclusions({name}=...) holds {one!r} for source {source or 'data'!r}: it takes "
                    f"{allowed}"
                )
        if listed:
            out[source] = tuple(sorted(set(listed)))
    return out


def _ranges(name: str, value: object, *, inclusive: bool) -> tuple[tuple[int, int], ...]:
    """Pairs ``(first, last)`` (``inclusive``) or ``(start, stop)`` as sorted ``[start, stop)`` pairs."""
    out = []
    for pair in value if isinstance(value, Sequence) else [value]:
        if not (
            isinstance(pair, Sequence)
            and len(pair) == 2
            and all(is_int(v) and 0 <= v <= MAX_POSITION for v in pair)
            and (pair[0] <= pair[1] if inclusive else pair[0] < pair[1])
        ):
            form = "(first, last) with first <= last" if inclusive else "(start, stop) with start < stop"
            raise OptionsError(
                f"Exclusions({name}=...) takes a list of pairs {form}, integers >= 0 (got {pair!r:.80})"
            )
        out.append((int(pair[0]), int(pair[1]) + 1 if inclusive else int(pair[1])))
    return tuple(sorted(out))


class _ExclusionConfig(Struct, forbid_unknown_fields=True):
    """A config's ``exclude:`` mapping: the arguments of :class:`Exclusions`."""

    documents: list[int] | dict[str, list[int]] = []
    records: list[str] | dict[str, list[str]] = []
    hashes: list[str] | dict[str, list[str]] = []
    steps: list[tuple[int, int]] = []
    positions: list[tuple[int, int]] = []
    mode: Literal["skip", "mask"] = "skip"
    at: int | None = None


_ARGUMENTS = ", ".join(_ExclusionConfig.__struct_fields__)


@dataclass(frozen=True)
class Exclusions:
    """Documents and steps to take out of a run from a position on (see the module docstring).

    Example::

        loader = Loader(cache.sequences(2048), batch_size=32, exclude=Exclusions(documents=[17, 4242]))
        # at a resume: the checkpoint's list, then what was found since, from the checkpoint's position
        loader = Loader(..., exclude=[first, Exclusions(steps=[(1200, 1250)])])
        loader.load_state_dict(state)

    Args:
        documents: indices of documents in the source's cache (``cache.doc(i)``, as ``streampack which``
            reports them): a list for a loader of one source, a dict of source name -> list for a mixture.
        records: the input records documents were built from, named as ``streampack which`` reports
            them: ``"path:line"`` (JSON Lines, text read a line a document; lines from 1) or
            ``"path[row]"`` (a Parquet row, or a document of another format's file; rows from 0), given
            like ``documents``.
        hashes: :func:`token_hash` of documents' tokens, given like ``documents``.
        steps: the trainer's steps ``(first, last)``, both included, as its logs number them, mapped to
            positions through the run's history (see the module docstring).
        positions: global position ranges ``(start, stop)``, ``stop`` excluded, of the run as it was served.
        mode: ``"skip"`` (not served) or ``"mask"`` (served, with no loss; dict outputs only).
        at: the global position it takes effect at; ``None``: where the loader is when it is given.

    Raises:
        OptionsError: a value not of the form above; when put in force, a range of steps or positions
            wholly before the position it takes effect at.
    """

    documents: Sequence[int] | Mapping[str, Sequence[int]] = ()
    records: Sequence[str] | Mapping[str, Sequence[str]] = ()
    hashes: Sequence[str] | Mapping[str, Sequence[str]] = ()
    steps: Sequence[tuple[int, int]] = ()
    positions: Sequence[tuple[int, int]] = ()
    mode: ExclusionMode = "skip"
    at: int | None = None
    _documents: dict[str, tuple[int, ...]] = field(init=False, repr=False, compare=False)
    _records: dict[str, tuple[str, ...]] = field(init=False, repr=False, compare=False)
    _hashes: dict[str, tuple[str, ...]] = field(init=False, repr=False, compare=False)
    _steps: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)
    _positions: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise OptionsError(f"Exclusions(mode=...) must be 'skip' or 'mask' (got mode={self.mode!r})")
        if self.at is not None and not (is_int(self.at) and 0 <= self.at <= MAX_POSITION):
            raise OptionsError(f"Exclusions(at=...) must be a position >= 0 or None (got at={self.at!r})")
        set_ = object.__setattr__
        set_(self, "_documents", _by_source("documents", self.documents))
        set_(self, "_records", _by_source("records", self.records))
        set_(self, "_hashes", _by_source("hashes", self.hashes))
        set_(self, "_steps", _ranges("steps", self.steps, inclusive=True))
        set_(self, "_positions", _ranges("positions", self.positions, inclusive=False))

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, source: str | None = None) -> Exclusions:
        """An exclusion from a mixture config's ``exclude:`` mapping (keys: the arguments above), given
        under ``source`` (its documents are that source's) or at the top.

        Raises:
            OptionsError: a key that is not an argument, or a value not of its form.
        """
        read = read_json(config, _ExclusionConfig, OptionsError, "exclude", f"it takes {_ARGUMENTS}")
        given = {name: getattr(read, name) for name in read.__struct_fields__}
        if source is not None:
            for key in ("documents", "records", "hashes"):
                given[key] = {source: given[key]}
        return cls(**given)

    def document_ids(self) -> dict[str, tuple[int, ...]]:
        """The documents named by index, by source name (``""``: the only source), sorted."""
        return self._documents

    def document_records(self) -> dict[str, tuple[str, ...]]:
        """The documents named by input record (``path:line``, ``path[row]``), by source name."""
        return self._records

    def document_hashes(self) -> dict[str, tuple[str, ...]]:
        """The documents named by :func:`token_hash`, by source name (``""``: the only source)."""
        return self._hashes

    def ranges(self, steps: StepCount | int) -> list[tuple[int, int]]:
        """The position ranges ``[start, stop)`` it takes out, its steps counted as ``steps`` says (an
        ``int``: steps of that many positions from position 0)."""
        count = StepCount.at_batch_size(steps) if isinstance(steps, int) else steps
        return sorted(
            [r for first, stop in self._steps for r in count.positions(first, stop)] + list(self._positions)
        )

    def step_ranges(self) -> list[tuple[int, int]]:
        """Its steps, as ``(first, last)`` pairs, both included."""
        return [(first, stop - 1) for first, stop in self._steps]

    def position_ranges(self) -> list[tuple[int, int]]:
        """Its positions, as ``(start, stop)`` pairs, ``stop`` excluded."""
        return list(self._positions)

    @property
    def digest(self) -> str:
        """What it names (not where it takes effect): the digest a checkpoint records for it."""
        spec = {
            "documents": self._documents,
            **({"records": self._records} if self._records else {}),
            "hashes": self._hashes,
            "steps": self._steps,
            "positions": self._positions,
            "mode": self.mode,
        }
        return digest(spec, 32)

    def counts(self) -> dict[str, int]:
        """How much it names, by kind (``records`` only when it names some, as states saved before had)."""
        return {
            "documents": sum(map(len, self._documents.values())),
            **({"records": sum(map(len, self._records.values()))} if self._records else {}),
            "hashes": sum(map(len, self._hashes.values())),
            "steps": len(self._steps),
            "positions": len(self._positions),
        }


def entry_state(entry: Exclusions, at: int, steps: StepCount) -> dict[str, Any]:
    """What a loader state records of an exclusion in force: a digest and counts, small whatever it names,
    and the history entries (``legs``) or the batch size (older states) its steps were counted through."""
    counting = {"batch_size": steps.legs[0][2]} if steps.through is None else {"legs": steps.through}
    return {"digest": entry.digest, "mode": entry.mode, "at": at, **counting, **entry.counts()}


def counted(record: Mapping[str, Any], history: Sequence[Mapping[str, Any]]) -> StepCount:
    """How the steps of an exclusion a state records were counted (see :func:`entry_state`).

    Raises:
        LoaderStateError: the state's history has fewer entries than the record counts through.
    """
    if "legs" not in record:
        return StepCount.at_batch_size(int(record["batch_size"]))
    legs = int(record["legs"])
    if legs > len(history):
        raise LoaderStateError(
            f"the loader state's exclusion in force from position {record['at']} counts its steps through "
            f"{legs} history entries, and the state's history has {len(history)}: the state is damaged; "
            "load one as state_dict() returned it"
        )
    return StepCount.of_history(history[:legs])


def check_prefix(saved: Sequence[Mapping[str, Any]], given: Sequence[Exclusions]) -> None:
    """Refuse a resume whose exclusions do not start with the checkpoint's (both sides named)."""
    for index, entry in enumerate(saved):
        if index >= len(given):
            raise LoaderStateError(
                f"the checkpoint has {len(saved)} exclusions in force, this loader was given {len(given)}: "
                f"exclusion {index} (mode {entry['mode']!r}, in force from position {entry['at']}, "
                f"{_named(entry)}) is missing. Taking an exclusion back would change batches already "
                "served; pass the checkpoint's exclusions first, in order, then any new ones (exclude=[...])"
            )
        mine = given[index]
        if mine.digest != entry["digest"] or (mine.at is not None and mine.at != entry["at"]):
            raise LoaderStateError(
                f"exclusion {index} differs from the checkpoint's: in checkpoint: digest {entry['digest']}, "
                f"mode {entry['mode']!r}, at {entry['at']}, {_named(entry)} / in this loader: digest "
                f"{mine.digest}, mode {mine.mode!r}, at {mine.at}, {_named(mine.counts())}. Pass the "
                "checkpoint's exclusions unchanged, in order, then any new ones"
            )


def _named(counts: Mapping[str, Any]) -> str:
    keys = ("documents", "records", "hashes", "steps", "positions")
    return ", ".join(f"{counts[k]} {k}" for k in keys if k in counts)

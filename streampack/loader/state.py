"""The loader state's format, read strictly: the keys each version of a state, and each kind of order in
it, holds (docs/FORMAT.md, "Loader checkpoints").

A state resumes a run only when it means one place of it. So every reader of a state reads it here,
through :func:`read`, against a :class:`Schema` (:meth:`Loader.load_state_dict
<streampack.loader.Loader.load_state_dict>` for the loader's own keys and for the order of every kind in
it, which covers :class:`~streampack.loader.follow.Follow`, mixtures and the trainer adapters, whose states
are
loader states):

* a key the schema does not have is refused, naming the key, what the schema holds and what the state
  holds; a key of *another* version or kind (a version 2 state carrying version 1's ``epoch``, as a
  script that edits a checkpoint writes it, would otherwise resume at its own ``position``) also says
  where it belongs and how to say it in this version;
* so is a missing required key, and a value of the wrong type or out of range.

Real states of an earlier version are converted by their reader (the loader reads version 1), after
they were read strictly as what they are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from streampack._checks import bounds, is_int
from streampack.errors import LoaderStateError
from streampack.loader.exclusions import is_entries
from streampack.loader.history import check_history, history_digest
from streampack.order import MAX_POSITION, Order

if TYPE_CHECKING:
    from streampack.loader.options import LoaderOptions

__all__ = [
    "HISTORY_ENTRY",
    "LOADER_FORMAT",
    "LOADER_VERSION",
    "LOADER_VERSIONS",
    "ORDERS",
    "Field",
    "Schema",
    "read",
    "read_loader_state",
    "read_order",
    "resume",
    "saved",
    "version_1",
]

LOADER_FORMAT = "streampack.Loader"
LOADER_VERSION = 2
"""The version :meth:`Loader.state_dict <streampack.loader.Loader.state_dict>` writes."""

_DAMAGED = "the state is damaged: load one as state_dict() returned it"


@dataclass(frozen=True)
class Field:
    """What one key of a state may hold.

    Attributes:
        allowed: what it must be, as a message says it (``"an integer in [0, 2**62]"``).
        test: whether a value is allowed.
        each: the value is an object whose every entry is read with this schema (a mixture's sources).
        items: the value is a list whose every item is read with this schema (a state's history).
    """

    allowed: str
    test: Callable[[Any], bool]
    each: Schema | None = None
    items: Schema | None = None


@dataclass(frozen=True)
class Schema:
    """The keys of one version of a state (or one kind of order): required, optional, and what to say of
    keys that belong elsewhere.

    Attributes:
        name: what states of this schema are, plural, for messages (``"version 2 loader states"``).
        required: keys every such state holds.
        optional: keys it may hold.
        hints: for a key of another version or kind, how this version says the same.
    """

    name: str
    required: Mapping[str, Field]
    optional: Mapping[str, Field] = field(default_factory=dict)
    hints: Mapping[str, str] = field(default_factory=dict)

    @property
    def fields(self) -> dict[str, Field]:
        """Every key it may hold, required first."""
        return {**self.required, **self.optional}


def integer(*, min: int | None = None, max: int | None = None, below: int | None = None) -> Field:
    """An integer (not a bool) within the bounds."""

    def test(value: Any) -> bool:
        return (
            is_int(value)
            and (min is None or value >= min)
            and (max is None or value <= max)
            and (below is None or value < below)
        )

    return Field(bounds(min, max, below), test)


def _is_object(value: Any) -> bool:
    return isinstance(value, Mapping)


def _is_block_shuffle(value: Any) -> bool:
    return (
        isinstance(value, Mapping)
        and set(value) == {"block", "window"}
        and all(is_int(v) and v >= 1 for v in value.values())
    )


def _is_mixture_shuffle(value: Any) -> bool:
    return isinstance(value, bool) or _is_block_shuffle(value)


def _is_schedule(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and len(value) > 0
        and all(
            isinstance(segment, (list, tuple)) and len(segment) == 2 and isinstance(segment[1], Mapping)
            for segment in value
        )
    )


def _is_eras(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == 2 and all(is_int(v) and v >= 1 for v in value)


SEED = integer(min=0, below=2**64)
BOOL = Field("True or False", lambda value: isinstance(value, bool))
OBJECT = Field("a JSON object (a dict)", _is_object)
_FORMAT = Field(repr(LOADER_FORMAT), lambda value: value == LOADER_FORMAT)


def _kind(name: str) -> Field:
    return Field(repr(name), lambda value: value == name)


def _version(number: int) -> Field:
    return Field(str(number), lambda value: is_int(value) and value == number)


def _is_list(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def _is_step(value: Any) -> bool:
    return value is None or (is_int(value) and 0 <= value <= MAX_POSITION)


def _is_digest(value: Any, length: int = 16) -> bool:
    return isinstance(value, str) and len(value) == length and all(c in "0123456789abcdef" for c in value)


def _is_data(value: Any) -> bool:
    return isinstance(value, Mapping) and all(
        isinstance(k, str) and (isinstance(v, str) or is_int(v)) for k, v in value.items()
    )


def _is_served(value: Any) -> bool:
    if (
        not isinstance(value, Mapping)
        or set(value) != {"seq_len", "schedule"}
        or not is_int(value["seq_len"])
    ):
        return False
    schedule = value["schedule"]
    return schedule is None or (
        isinstance(schedule, (list, tuple))
        and all(
            isinstance(pair, (list, tuple)) and len(pair) == 2 and all(map(is_int, pair)) for pair in schedule
        )
    )


HISTORY_ENTRY = Schema(
    "history entries",
    required={
        "position": integer(min=0, max=MAX_POSITION),
        "step": Field("an integer >= 0 or null", _is_step),
        "order": Field("16 hexadecimal digits (the order fingerprint's digest)", _is_digest),
        "kind": Field("a string", lambda value: isinstance(value, str)),
        "seed": SEED,
        "shuffle": Field("True, False or {'block': B, 'window': W}", _is_mixture_shuffle),
        "batch_size": integer(min=1),
        "world_size": integer(min=1),
        "batches_per_step": integer(min=1),
        "data": Field("an object of layout, seq_len and overlap", _is_data),
        "block_size": Field("an integer >= 1 or null", lambda v: v is None or (is_int(v) and v >= 1)),
        "schedule": Field(
            "null or a non-empty list of [first block, {source: count}]",
            lambda value: value is None or _is_schedule(value),
        ),
        "exclusions": Field("any JSON value", lambda value: True),
    },
    optional={
        "served": Field(
            "an object of seq_len and schedule (null or a list of [first token, seq_len] pairs)", _is_served
        ),
        "epochs": integer(min=1),
        "drop_last": Field("false (a run serving its partial last batch)", lambda value: value is False),
        "stop": Field("'first_exhausted'", lambda value: value == "first_exhausted"),
        "sources": Field(
            "a non-empty list of distinct source names",
            lambda value: (
                isinstance(value, list)
                and bool(value)
                and all(isinstance(name, str) and name for name in value)
                and len(set(value)) == len(value)
            ),
        ),
    },
)
"""One entry of a state's ``history``: how the run was read from ``position`` on (see
:func:`~streampack.loader.history.history_entry`). The run's start has one, and every resume appends one."""

_POSITION_HINT = (
    "A version 2 state says where the run stands by 'position' alone: the samples consumed since the run "
    "started over all ranks (sample s of epoch e of a dataset of N samples is position e * N + s). Set "
    "'position' and leave this key out."
)

LOADER_VERSIONS: dict[int, Schema] = {
    1: Schema(
        "version 1 loader states",
        required={
            "format": _FORMAT,
            "version": _version(1),
            "seed": SEED,
            "shuffle": BOOL,
            "dataset": OBJECT,
            "epoch": integer(min=0),
            "samples_in_epoch": integer(min=0),
        },
        optional={"batch_size": integer(min=1), "drop_last": BOOL, "world_size": integer(min=1)},
        hints=dict.fromkeys(
            ("position", "order"),
            "A version 1 state says where the run stands by 'epoch' and 'samples_in_epoch'; to give a "
            "position, write a version 2 state (as Loader.state_dict() writes it).",
        ),
    ),
    LOADER_VERSION: Schema(
        "version 2 loader states",
        required={
            "format": _FORMAT,
            "version": _version(2),
            "position": integer(min=0, max=MAX_POSITION),
            "order": OBJECT,
        },
        optional={
            "batch_size": integer(min=1),
            "world_size": integer(min=1),
            # The exclusions in force (streampack.loader.exclusions.entry_state), in the order given.
            "exclusions": Field("a list of exclusion entries as Loader.state_dict() writes them", is_entries),
            "history": Field("a list of history entries", _is_list, items=HISTORY_ENTRY),
            # The history's digest (streampack.loader.history.history_digest); a state saved before it
            # has none, and its history is checked for order alone.
            "history_digest": Field(
                "32 hexadecimal digits (the history's digest)", lambda value: _is_digest(value, 32)
            ),
        },
        hints={"epoch": _POSITION_HINT, "samples_in_epoch": _POSITION_HINT},
    ),
}
"""Every version of a loader state this streampack reads."""

_MIXTURE_SOURCE = Schema("a mixture's sources", required={"seed": SEED, "data": OBJECT})

ORDERS: dict[str, Schema] = {
    "shuffled": Schema(
        "orders of kind 'shuffled'",
        required={"kind": _kind("shuffled"), "seed": SEED, "shuffle": BOOL, "data": OBJECT},
    ),
    "blocks": Schema(
        "orders of kind 'blocks'",
        required={
            "kind": _kind("blocks"),
            "seed": SEED,
            "block": integer(min=1),
            "window": integer(min=1),
            "data": OBJECT,
        },
    ),
    "mixture": Schema(
        "orders of kind 'mixture'",
        required={
            "kind": _kind("mixture"),
            "seed": SEED,
            "shuffle": Field(
                "True, False or {'block': B, 'window': W}",
                lambda v: isinstance(v, bool) or _is_block_shuffle(v),
            ),
            "block_size": integer(min=1),
            "sources": Field("an object of source name -> {seed, data}", _is_object, each=_MIXTURE_SOURCE),
            "schedule": Field("a non-empty list of [first block, {source: count}] pairs", _is_schedule),
        },
    ),
    "follow": Schema(
        "orders of kind 'follow'",
        required={
            "kind": _kind("follow"),
            "seed": SEED,
            "eras": Field("a list of two integers >= 1, [first_era, largest_era]", _is_eras),
            "data": OBJECT,
        },
    ),
}
"""Every kind of order a loader state may hold, by its ``kind``."""


def read(
    state: object, schema: Schema, where: str, *, others: Sequence[Schema] = (), fix: str = _DAMAGED
) -> dict[str, Any]:
    """``state`` as a dict, once it holds exactly what ``schema`` allows.

    Args:
        state: what was given.
        schema: what it must be.
        where: what it is, for messages (``"loader state"``, ``"version 2 loader state's order"``).
        others: the other versions or kinds of the same state, to say where a foreign key belongs.
        fix: what to do, for messages.

    Raises:
        LoaderStateError: ``state`` is not an object, holds a key ``schema`` does not have, lacks a
            required one, or holds a value that is not allowed; the message names the key, what the
            schema holds and what the state holds.
    """
    if not isinstance(state, Mapping):
        raise LoaderStateError(f"{where} must be a JSON object (got {_summary(state)}); {fix}")
    fields = schema.fields
    given = list(state)
    for key in given:
        if key not in fields:
            homes = [other.name for other in others if key in other.fields and other is not schema]
            home = f" (a key of {' and '.join(homes)})" if homes else ""
            hint = schema.hints.get(key) if isinstance(key, str) else None
            raise LoaderStateError(
                f"{where} holds {key!r}{home}, which {schema.name} do not hold: they hold "
                f"{_listed(schema)}; this one holds {given}. {hint or _capital(fix)}"
            )
    for key in schema.required:
        if key not in state:
            raise LoaderStateError(
                f"{where} has no {key!r}, which {schema.name} hold: they hold {_listed(schema)}; this one "
                f"holds {given}; {fix}"
            )
    checked: dict[str, Any] = {}
    for key, value in state.items():
        field_ = fields[key]
        if not field_.test(value):
            raise LoaderStateError(
                f"{where} {key} must be {field_.allowed} (got {key}={_summary(value)}); {fix}"
            )
        if field_.each is not None:
            value = {
                name: read(item, field_.each, f"{where} {key}[{name!r}]", fix=fix)
                for name, item in value.items()
            }
        if field_.items is not None:
            value = [read(item, field_.items, f"{where} {key}[{i}]", fix=fix) for i, item in enumerate(value)]
        checked[key] = value
    return checked


def read_loader_state(state: object) -> dict[str, Any]:
    """A loader state read strictly as the version it says it is (its order is read by
    :func:`read_order`).

    Raises:
        LoaderStateError: not a loader state, a version this streampack does not read, or not what its
            version holds (see :func:`read`).
    """
    if not isinstance(state, Mapping) or state.get("format") != LOADER_FORMAT:
        raise LoaderStateError(
            f"not a streampack loader state (expected a dict with format={LOADER_FORMAT!r}, got "
            f"{_summary(state)}); pass what Loader.state_dict() returned"
        )
    version = state.get("version")
    schema = LOADER_VERSIONS.get(version) if is_int(version) else None
    if schema is None:
        readable = " and ".join(map(str, LOADER_VERSIONS))
        raise LoaderStateError(
            f"loader state version {version!r} is not supported by this streampack (it reads versions "
            f"{readable}); resume with the streampack version that saved it"
        )
    checked = read(state, schema, f"version {version} loader state", others=list(LOADER_VERSIONS.values()))
    if "history" in checked:
        check_history(checked["history"], checked["position"], checked.get("history_digest"))
    return checked


def read_order(order: Mapping[str, Any], version: int) -> dict[str, Any]:
    """A loader state's ``order`` read strictly as the kind it says it is.

    Raises:
        LoaderStateError: an unknown kind, or not what its kind holds (see :func:`read`).
    """
    where = f"version {version} loader state's order"
    kind = order.get("kind")
    schema = ORDERS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise LoaderStateError(
            f"{where} has kind={_summary(kind)}, which is none of the kinds of order a loader state holds "
            f"({', '.join(map(repr, ORDERS))}); {_DAMAGED}"
        )
    return read(order, schema, where, others=list(ORDERS.values()))


def _listed(schema: Schema) -> str:
    required = list(schema.required)
    optional = list(schema.optional)
    return f"{required}" + (f" and may hold {optional}" if optional else "")


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:] + "."


def _summary(value: object, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def saved(
    position: int, order: Order, options: LoaderOptions, history: Sequence[Mapping[str, Any]] = ()
) -> dict[str, Any]:
    """The state of a loader at ``position`` of ``order``, as :meth:`Loader.state_dict
    <streampack.loader.Loader.state_dict>` returns it (a version :data:`LOADER_VERSION` state).

    It holds the format and version, the position (samples consumed since the run started, over all
    ranks) and the order's fingerprint: what the positions mean (seed, data, and for a mixture its
    sources, weights and the schedule so far). The batch size and world size are recorded for
    information only: a state may be loaded with others. ``history`` (one entry per start or resume,
    :func:`~streampack.loader.history.history_entry`) is what :mod:`streampack.loader.audit` recomputes
    the run from, and ``history_digest`` its digest, checked at load.
    """
    entries = [dict(entry) for entry in history]
    return {
        "format": LOADER_FORMAT,
        "version": LOADER_VERSION,
        "position": position,
        "order": order.fingerprint(),
        "batch_size": options.batch_size,
        "world_size": options.world_size,
        "history": entries,
        "history_digest": history_digest(entries),
    }


def version_1(state: Mapping[str, Any], size: int) -> tuple[int, dict[str, Any]]:
    """A version 1 state (epoch and samples into it, read strictly) of a dataset of ``size`` samples, as a
    version 2 position and order: the same place of the same epoch.

    Raises:
        LoaderStateError: the place is not one of an epoch of ``size`` samples within ``2**62``.
    """
    epoch, samples = state["epoch"], state["samples_in_epoch"]
    if samples >= size or epoch * size + samples > MAX_POSITION:
        raise LoaderStateError(
            f"version 1 loader state has epoch={epoch!r}, samples_in_epoch={samples!r}: not a place in "
            f"an epoch of {size} samples within 2**62 samples; the state is damaged"
        )
    order = {
        "kind": "shuffled",
        "seed": state["seed"],
        "shuffle": state["shuffle"],
        "data": state["dataset"],
    }
    return epoch * size + samples, order


def resume(state: object, order: Order, datasets: Sequence[object]) -> tuple[int, Order]:
    """Where a loader state resumes a run over ``order`` (the order a loader was made with), and that
    order continued there.

    The state is read strictly (:func:`read_loader_state`); a version 1 one is converted
    (:func:`version_1`); its order is read strictly when it is one of streampack's kinds that ``order``
    continues (:func:`read_order`; an order of a kind of its own reads its fingerprint itself), its data
    fingerprints from before format version 2 get the current digests of ``datasets``
    (:func:`~streampack.samples.sequences.with_current_digests`), and ``order.resumed`` checks it.

    Raises:
        LoaderStateError: the state is not one of a supported version, or not one ``order`` continues.
        TypeError: a version 1 state, and ``order`` has no single epoch to place it in.
    """
    from streampack.samples.sequences import with_current_digests

    state = read_loader_state(state)
    version = state["version"]
    saved: Mapping[str, Any]
    if version == 1:
        position, saved = version_1(state, order.epoch_size("resuming a version 1 state"))
    else:
        position, saved = int(state["position"]), state["order"]
    if saved.get("kind") in order.resumes and saved.get("kind") in ORDERS:
        saved = read_order(saved, version)
    return position, order.resumed(with_current_digests(saved, datasets), position)

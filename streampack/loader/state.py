"""The loader state's format (docs/FORMAT.md, "Loader checkpoints"), read strictly.

Each version of a state and each kind of order in it is a msgspec struct that refuses an unknown key, a
missing one and a value of the wrong type or range, naming its JSON path; a key of the other version
also says how this version says it. A version 1 state is converted by :func:`version_1`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from streampack._checks import is_int
from streampack.errors import LoaderStateError, read_json
from streampack.loader.history import check_history, history_digest
from streampack.order import MAX_POSITION, Order

if TYPE_CHECKING:
    from streampack.loader.options import LoaderOptions

__all__ = [
    "LOADER_FORMAT",
    "LOADER_VERSION",
    "LOADER_VERSIONS",
    "ORDERS",
    "BlockShuffleState",
    "ExclusionRecord",
    "HistoryEntry",
    "LoaderStateV1",
    "LoaderStateV2",
    "MixtureSource",
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

Count = Annotated[int, Meta(ge=0)]
Positive = Annotated[int, Meta(ge=1)]
Position = Annotated[int, Meta(ge=0, le=MAX_POSITION)]
Seed = Annotated[int, Meta(ge=0)]  # and below 2**64, which _Strict checks: msgspec bounds only int64s
Data = dict[str, Any]


class _Strict(Struct, forbid_unknown_fields=True):
    """A JSON object of exactly these keys; a key with a default (``UNSET``) may be left out."""

    def __post_init__(self) -> None:
        seed = getattr(self, "seed", 0)
        if seed >= 2**64:
            raise ValueError(f"Expected `seed` < 2**64, got `{seed}`")


class BlockShuffleState(_Strict):
    """A block shuffle, as an order's ``shuffle`` records it."""

    block: Positive
    window: Positive


class ExclusionRecord(_Strict):
    """An exclusion in force, as :func:`~streampack.loader.exclusions.entry_state` records it."""

    digest: str
    mode: Literal["skip", "mask"]
    at: Count
    documents: Count
    hashes: Count
    steps: Count
    positions: Count
    records: Count | UnsetType = UNSET
    legs: Positive | UnsetType = UNSET
    batch_size: Positive | UnsetType = UNSET

    def __post_init__(self) -> None:
        if (self.legs is UNSET) == (self.batch_size is UNSET):
            raise ValueError("an exclusion records `legs` or `batch_size`, exactly one of them")


class Served(_Strict):
    """The lengths a loader served its units at: its own ``seq_len`` and ``[first token, seq_len]`` pairs."""

    seq_len: int
    schedule: list[tuple[int, int]] | None


Schedule = Annotated[list[tuple[int, dict[str, int]]], Meta(min_length=1)]
"""A mixture's schedule: ``[first block, {source: count}]`` per segment."""


class HistoryEntry(_Strict):
    """One entry of a state's ``history`` (see :func:`~streampack.loader.history.history_entry`)."""

    position: Position
    step: Position | None
    order: Annotated[str, Meta(pattern="^[0-9a-f]{16}$")]
    kind: str
    seed: Seed
    shuffle: bool | BlockShuffleState
    batch_size: Positive
    world_size: Positive
    batches_per_step: Positive
    data: dict[str, str | int]
    block_size: Positive | None
    schedule: Schedule | None
    exclusions: Any
    served: Served | UnsetType = UNSET
    epochs: Positive | UnsetType = UNSET
    drop_last: Literal[False] | UnsetType = UNSET
    stop: Literal["first_exhausted"] | UnsetType = UNSET
    sources: Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(min_length=1)] | UnsetType = UNSET
    balance: Literal["attention"] | UnsetType = UNSET
    cp_size: Annotated[int, Meta(ge=2)] | UnsetType = UNSET
    # An entry saved before loss weights were recorded has none: read as none given.
    loss_weights: dict[Annotated[str, Meta(min_length=1)], Annotated[float, Meta(ge=0)]] | UnsetType = UNSET

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sources is not UNSET and len(set(self.sources)) < len(self.sources):
            raise ValueError(f"Expected distinct `sources`, got `{self.sources}`")


class LoaderStateV1(_Strict):
    """A version 1 loader state: where the run stands as ``epoch`` and ``samples_in_epoch``."""

    format: Literal["streampack.Loader"]
    version: Literal[1]
    seed: Seed
    shuffle: bool
    dataset: Data
    epoch: Count
    samples_in_epoch: Count
    batch_size: Positive | UnsetType = UNSET
    drop_last: bool | UnsetType = UNSET
    world_size: Positive | UnsetType = UNSET


class LoaderStateV2(_Strict):
    """A version 2 loader state, as :func:`saved` writes it (its ``order`` is read by :func:`read_order`)."""

    format: Literal["streampack.Loader"]
    version: Literal[2]
    position: Position
    order: Data
    batch_size: Positive | UnsetType = UNSET
    world_size: Positive | UnsetType = UNSET
    exclusions: list[ExclusionRecord] | UnsetType = UNSET
    history: list[HistoryEntry] | UnsetType = UNSET
    # A state saved before the digest has none: its history is checked for order alone.
    history_digest: Annotated[str, Meta(pattern="^[0-9a-f]{32}$")] | UnsetType = UNSET


LOADER_VERSIONS: dict[int, type[Struct]] = {1: LoaderStateV1, 2: LoaderStateV2}
"""Every version of a loader state this streampack reads."""

_OTHER_VERSION_HINTS = {
    1: (
        {"position", "order"},
        "a version 1 state says where the run stands by 'epoch' and 'samples_in_epoch'; 'position' and "
        "'order' are version 2's keys: to give a position, write a version 2 state (as Loader.state_dict() "
        "writes it).",
    ),
    2: (
        {"epoch", "samples_in_epoch"},
        "a version 2 state says where the run stands by 'position' alone: the samples consumed since the "
        "run started over all ranks (sample s of epoch e of a dataset of N samples is position e * N + s). "
        "Set 'position' and leave out 'epoch' and 'samples_in_epoch', which are version 1's keys.",
    ),
}


class ShuffledOrder(_Strict):
    """One dataset read in a shuffled (or sequential) epoch order."""

    kind: Literal["shuffled"]
    seed: Seed
    shuffle: bool
    data: Data


class BlocksOrder(_Strict):
    """One dataset read with ``shuffle=BlockShuffle(block, window)``."""

    kind: Literal["blocks"]
    seed: Seed
    block: Positive
    window: Positive
    data: Data


class MixtureSource(_Strict):
    """One source of a mixture's order: its own seed and data."""

    seed: Seed
    data: Data


class MixtureOrder(_Strict):
    """A mixture: its sources and the schedule of per-block counts so far."""

    kind: Literal["mixture"]
    seed: Seed
    shuffle: bool | BlockShuffleState
    block_size: Positive
    sources: dict[str, MixtureSource]
    schedule: Schedule


class FollowOrder(_Strict):
    """A :class:`~streampack.follow.Follow` of a growing cache: its eras ``[first, largest]``."""

    kind: Literal["follow"]
    seed: Seed
    eras: tuple[Positive, Positive]
    data: Data


ORDERS: dict[str, type[Struct]] = {
    "shuffled": ShuffledOrder,
    "blocks": BlocksOrder,
    "mixture": MixtureOrder,
    "follow": FollowOrder,
}
"""Every kind of order a loader state may hold, by its ``kind``."""


def read_loader_state(state: object) -> dict[str, Any]:
    """A loader state, read strictly as the version it says it is (its order: :func:`read_order`).

    Raises:
        LoaderStateError: not a loader state, a version this streampack does not read, or not what its
            version holds; the message names the JSON path (``$.history[0].seed``).
    """
    if not isinstance(state, Mapping) or state.get("format") != LOADER_FORMAT:
        raise LoaderStateError(
            f"not a streampack loader state (expected a dict with format={LOADER_FORMAT!r}, got "
            f"{_summary(state)}); pass what Loader.state_dict() returned"
        )
    version = state.get("version")
    if not is_int(version) or version not in LOADER_VERSIONS:
        readable = " and ".join(map(str, LOADER_VERSIONS))
        raise LoaderStateError(
            f"loader state version {version!r} is not supported by this streampack (it reads versions "
            f"{readable}); resume with the streampack version that saved it"
        )
    others, hint = _OTHER_VERSION_HINTS[version]
    fix = hint if others & set(state) else _DAMAGED
    read_json(state, LOADER_VERSIONS[version], LoaderStateError, f"version {version} loader state", fix)
    if "history" in state:
        check_history(state["history"], state["position"], state.get("history_digest"))
    return dict(state)


def read_order(order: Mapping[str, Any], version: int) -> dict[str, Any]:
    """A loader state's ``order``, read strictly as the kind it says it is.

    Raises:
        LoaderStateError: an unknown kind, or not what its kind holds (the message names the JSON path).
    """
    where = f"version {version} loader state"
    kind = order.get("kind")
    struct = ORDERS.get(kind) if isinstance(kind, str) else None
    if struct is None:
        raise LoaderStateError(
            f"{where}'s order has kind={_summary(kind)}, which is none of the kinds of order a loader state "
            f"holds ({', '.join(map(repr, ORDERS))}); {_DAMAGED}"
        )
    read_json(order, struct, LoaderStateError, where, _DAMAGED, at="$.order")
    return dict(order)


def _summary(value: object, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def saved(
    position: int, order: Order, options: LoaderOptions, history: Sequence[Mapping[str, Any]] = ()
) -> dict[str, Any]:
    """The version 2 state of a loader at ``position`` of ``order``, as :meth:`Loader.state_dict
    <streampack.loader.Loader.state_dict>` returns it (its batch and world size are for information)."""
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
    """A version 1 state of a dataset of ``size`` samples as a version 2 position and order: the same place.

    Raises:
        LoaderStateError: the place is not one of an epoch of ``size`` samples within ``2**62``.
    """
    epoch, samples = state["epoch"], state["samples_in_epoch"]
    if samples >= size or epoch * size + samples > MAX_POSITION:
        raise LoaderStateError(
            f"version 1 loader state has epoch={epoch!r}, samples_in_epoch={samples!r}: not a place in "
            f"an epoch of {size} samples within 2**62 samples; the state is damaged"
        )
    order = {"kind": "shuffled", "seed": state["seed"], "shuffle": state["shuffle"], "data": state["dataset"]}
    return epoch * size + samples, order


def resume(state: object, order: Order, datasets: Sequence[object]) -> tuple[int, Order]:
    """Where a loader state resumes a run over ``order`` (the loader's own), and that order continued there.

    The saved order is read strictly when it is of one of streampack's kinds; ``order.resumed`` checks
    the rest.

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

"""The run's history a loader state carries: one small entry for the start and one per resume, each saying
how the run was read from its position on (:func:`history_entry`; the schema that reads it back is
:data:`streampack.loader.state.HISTORY_ENTRY`). :mod:`streampack.loader.audit` recomputes a run from it.

A state carries the history's digest (:func:`history_digest`), and :func:`check_history` refuses one that
is not a run's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from streampack._checks import is_int
from streampack.errors import LoaderStateError

if TYPE_CHECKING:
    from streampack.loader.options import LoaderOptions
    from streampack.order import Order

__all__ = ["check_history", "data_description", "history_digest", "history_entry", "order_digest"]


def order_digest(fingerprint: Mapping[str, Any]) -> str:
    """16 hexadecimal digits that identify an order's fingerprint (its canonical JSON's SHA-256)."""
    text = json.dumps(fingerprint, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def data_description(fingerprint: Mapping[str, Any]) -> dict[str, Any]:
    """What a source's samples are, from its fingerprint: ``layout`` (``"windows"``, ``"packed"``,
    ``"documents"``; ``"array"`` for samples that are not a cache's), ``seq_len`` and ``overlap``."""
    layout = fingerprint.get("layout", "windows" if "seq_len" in fingerprint else "array")
    described: dict[str, Any] = {"layout": layout if isinstance(layout, str) else str(layout)}
    for key in ("seq_len", "overlap"):
        if is_int(fingerprint.get(key)):
            described[key] = int(fingerprint[key])
    return described


def history_entry(
    position: int,
    order: Order,
    configured: Order,
    options: LoaderOptions,
    data: Mapping[str, Any],
    *,
    step: int | None = None,
    batches_per_step: int = 1,
    exclusions: Any = None,
    served: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One entry of a state's history (:data:`HISTORY_ENTRY`): how a run was read from ``position``.

    It holds what recomputes the samples served from there (the audit builds the loader it describes,
    :mod:`streampack.loader.audit`): the order's kind, seed and shuffle, and for a mixture its block
    size and the schedule it was *configured* with (the part before ``position`` is the earlier entries'),
    the data's layout, ``seq_len`` and ``overlap``, the batch and world size, the exclusions in force;
    the digest of the order in force, to check the recomputed one; ``step``, the trainer's own step
    there when a framework adapter (or the caller) gave it, null otherwise; and ``batches_per_step``,
    the global batches the trainer takes per step (gradient accumulation), which the adapters set; and
    for a loader that serves its units at other lengths (a seq_len schedule, or a resume at another
    ``seq_len``), ``served``: its own ``seq_len`` and the schedule's ``[first token, seq_len]`` pairs
    (:mod:`streampack.loader.seqlen`; ``data`` holds the units' ``seq_len``). Every field is bounded: a
    history grows by one small entry per resume.
    """
    mine = order.fingerprint()
    own = configured.fingerprint()
    shuffle = mine.get("shuffle", True)
    if mine.get("kind") == "blocks":
        shuffle = {"block": mine.get("block"), "window": mine.get("window")}
    mixed = own.get("kind") == "mixture"
    entry = {
        "position": int(position),
        "step": None if step is None else int(step),
        "order": order_digest(mine),
        "kind": str(mine.get("kind")),
        "seed": int(mine.get("seed", 0)),
        "shuffle": shuffle,
        "batch_size": options.batch_size,
        "world_size": options.world_size,
        "batches_per_step": int(batches_per_step),
        "data": data_description(data),
        "block_size": own.get("block_size") if mixed else None,
        "schedule": own.get("schedule") if mixed else None,
        "exclusions": exclusions,
    }
    return entry if served is None else entry | {"served": dict(served)}


# ------------------------------------------------------------------------------ checking a history


def history_digest(entries: Sequence[Mapping[str, Any]]) -> str:
    """32 hexadecimal digits that identify a history (its canonical JSON's SHA-256): a state carries them,
    so that a history edited or damaged by accident is refused at load (:func:`check_history`)."""
    text = json.dumps(list(entries), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def check_history(entries: Sequence[Mapping[str, Any]], position: int, digest: str | None) -> None:
    """Refuse a history that cannot be the run's that a state at ``position`` saved.

    Each entry begins where the previous leg stopped, so positions never go back, and none is past the
    state's own position; ``digest`` (the state's ``history_digest``, None in a state saved before it)
    must be the history's. Steps are not checked against positions: a model checkpoint and a data state
    of different steps are a real resume, which the audit reports. The first entry may be past position
    0: a state saved before histories, resumed, begins its history there.

    Raises:
        LoaderStateError: an entry is out of place (named), or the history is not the one its digest was
            made of.
    """
    for i, entry in enumerate(entries):
        at = int(entry["position"])
        if at > position:
            raise LoaderStateError(
                f"the loader state's history[{i}] begins at position {at:,}, past the state's own position "
                f"{position:,}: the history was edited or damaged; load the state as state_dict() returned it"
            )
        if i and at < int(entries[i - 1]["position"]):
            raise LoaderStateError(
                f"the loader state's history[{i}] begins at position {at:,}, before history[{i - 1}] "
                f"({int(entries[i - 1]['position']):,}): a run's resumes never go back in its own history; "
                "the history was edited or damaged; load the state as state_dict() returned it"
            )
    if digest is not None and digest != (found := history_digest(entries)):
        raise LoaderStateError(
            f"the loader state's history does not match its history_digest ({digest}; the history holds "
            f"{found}): an entry was edited, added or removed. Load the state as state_dict() returned it "
            "(to resume an edited history on purpose, remove 'history_digest': an audit then takes the "
            "history as it is)"
        )

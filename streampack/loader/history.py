"""The run's history a loader state carries: one small entry for the start and one per resume.

Each entry says how the run was read from its position on (:func:`history_entry`), which is what
:mod:`streampack.runs.audit` recomputes a run from, and begins a *leg* of the trainer's steps, which
:class:`StepCount` maps to positions. :func:`check_history` refuses a history that is not a run's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from streampack._checks import is_int
from streampack.errors import LoaderStateError
from streampack.order import MAX_POSITION

if TYPE_CHECKING:
    from streampack.loader.options import LoaderOptions
    from streampack.order import Order

__all__ = [
    "StepCount",
    "check_history",
    "data_description",
    "digest",
    "history_digest",
    "history_entry",
    "leg_steps",
    "order_digest",
    "stride",
]


def digest(value: Any, digits: int) -> str:
    """The first ``digits`` hexadecimal digits of the SHA-256 of ``value``'s canonical JSON."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:digits]


def order_digest(fingerprint: Mapping[str, Any]) -> str:
    """16 hexadecimal digits that identify an order's fingerprint."""
    return digest(fingerprint, 16)


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
    """One entry of a state's history: what the audit needs to rebuild the loader that served the run
    from ``position`` on (the fields are listed in docs/FORMAT.md, "Loader checkpoints").

    It records the order's kind, seed, shuffle and digest; a mixture's block size, configured schedule,
    sources and ``stop``; the data's layout; batch and world size; the exclusions in force; the trainer's
    ``step`` and ``batches_per_step``; and, when not the default, ``epochs``, ``served``, ``drop_last``,
    ``balance``, ``cp_size`` and ``loss_weights`` (one per source the order reads, 1.0 where not given:
    they change no sample served, so only the history says a resume changed them). Every field is
    bounded: a history grows by one small entry per resume.
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
    if mixed:  # which sources it read (a source's weight may be 0): what an audit makes its mixture of
        entry["sources"] = list(own.get("sources", {}))
        if getattr(configured, "stop", "never") != "never":
            entry["stop"] = str(getattr(configured, "stop"))  # noqa: B009 - an Order need not have one
    elif getattr(configured, "epochs", None) is not None:  # where the run ends: an audit's legs end there
        entry["epochs"] = int(configured.epochs)  # type: ignore[attr-defined]
    if not options.drop_last:  # a run that ends serves its partial last batch
        entry["drop_last"] = False
    if options.balance != "rows":  # which rank served which row (streampack.loader.parallel)
        entry["balance"] = options.balance
    if options.cp_size > 1:
        entry["cp_size"] = options.cp_size
    if options.loss_weights is not None:
        given = options.loss_weights
        entry["loss_weights"] = {name: float(given.get(name, 1.0)) for name in configured.names}
    return entry if served is None else entry | {"served": dict(served)}


# --------------------------------------------------------------------------------- the trainer's steps


def stride(entry: Mapping[str, Any]) -> int:
    """Positions one trainer step of an entry's leg takes: ``batch_size * batches_per_step``."""
    return int(entry["batch_size"]) * int(entry["batches_per_step"])


def leg_steps(entries: Sequence[Mapping[str, Any]]) -> list[int]:
    """The trainer's step at the start of each entry's leg.

    An entry's own ``step`` (the model checkpoint's) is taken as it is, even when it disagrees with the
    data (the audit reports that). Without one, the step is counted on from the previous entry's, a
    partial step counted whole; the first entry's from step 0 at position 0.
    """
    steps: list[int] = []
    for i, entry in enumerate(entries):
        if entry["step"] is not None:
            steps.append(int(entry["step"]))
        elif i == 0:
            steps.append(-(-int(entry["position"]) // stride(entry)))
        else:
            previous = entries[i - 1]
            moved = int(entry["position"]) - int(previous["position"])
            steps.append(steps[-1] + max(0, -(-moved // stride(previous))))
    return steps


@dataclass(frozen=True)
class StepCount:
    """Where a run's trainer steps are: the global positions of each step, leg by leg.

    Leg ``i`` starts at step ``s_i`` and position ``p_i`` and takes ``k_i`` positions a step: step ``s``
    of it is positions ``[p_i + (s - s_i) * k_i, p_i + (s - s_i + 1) * k_i)``, up to the first step of any
    later leg (a resume from an earlier model checkpoint trains those steps again). The last leg runs on.

    Attributes:
        legs: per leg, ``(first step, first position, positions a step)``, in the run's order.
        through: the history entries the legs are; None for steps counted at one batch size from
            position 0 (states saved before steps were counted through the history).
    """

    legs: tuple[tuple[int, int, int], ...]
    through: int | None = None

    @classmethod
    def at_batch_size(cls, batch_size: int) -> StepCount:
        """Steps of ``batch_size`` positions from position 0 (how states saved before histories counted)."""
        return cls(((0, 0, int(batch_size)),))

    @classmethod
    def of_history(cls, entries: Sequence[Mapping[str, Any]]) -> StepCount:
        """Steps counted through history entries, the last of them the leg that runs on."""
        steps = leg_steps(entries)
        legs = tuple(
            (step, int(entry["position"]), stride(entry)) for step, entry in zip(steps, entries, strict=True)
        )
        return cls(legs, len(entries))

    def positions(self, first: int, stop: int) -> list[tuple[int, int]]:
        """The position ranges ``[start, stop)`` of steps ``first`` to ``stop - 1``, one per leg."""
        out = []
        for i, (start, position, step) in enumerate(self.legs):
            later = [other for other, _, _ in self.legs[i + 1 :]]
            lo = max(first, start) if i else first
            hi = min(stop, *later) if later else stop
            if lo < hi:
                a = max(0, position + (lo - start) * step)
                b = min(position + (hi - start) * step, MAX_POSITION)
                if a < b:
                    out.append((a, b))
        return out

    def describe(self) -> str:
        """The legs in words: ``step 40 at position 1,280, 32 positions a step``, for messages."""
        return "; ".join(
            f"step {step:,} at position {position:,}, {size:,} positions a step"
            for step, position, size in self.legs
        )


# ------------------------------------------------------------------------------ checking a history


def history_digest(entries: Sequence[Mapping[str, Any]]) -> str:
    """32 hexadecimal digits that identify a history: a state carries them to refuse an edited one."""
    return digest(list(entries), 32)


def check_history(entries: Sequence[Mapping[str, Any]], position: int, saved_digest: str | None) -> None:
    """Refuse a history that cannot be the run's that a state at ``position`` saved: positions that go
    back or lie past the state's, or a history that does not match ``saved_digest`` (None: not checked).

    Steps are not checked against positions: a model checkpoint and a data state of different steps are
    a real resume, which the audit reports.

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
    if saved_digest is not None and saved_digest != (found := history_digest(entries)):
        raise LoaderStateError(
            f"the loader state's history does not match its history_digest ({saved_digest}; the history "
            f"holds {found}): an entry was edited, added or removed. Load the state as state_dict() returned "
            "it (to resume an edited history on purpose, remove 'history_digest': an audit then takes the "
            "history as it is)"
        )

"""The run's history a loader state carries: one small entry for the start and one per resume.

Each entry says how the run was read from its position on (:func:`history_entry`, read back by
:class:`streampack.loader.state.HistoryEntry`); :mod:`streampack.runs.audit` recomputes a run from them.
Each entry also begins a *leg* of the trainer's steps (:func:`leg_steps`), which :class:`StepCount` maps
to positions for ``Exclusions(steps=...)`` and the audit alike. A state carries the history's digest
(:func:`history_digest`), and :func:`check_history` refuses a history that is not a run's.
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
    "history_digest",
    "history_entry",
    "leg_steps",
    "order_digest",
    "stride",
]


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
    """One entry of a state's history: what recomputes the samples a run served from ``position`` on.

    The audit builds the loader an entry describes (:mod:`streampack.runs.audit`), so it holds:

    * the order's kind, seed and shuffle, and the digest of the order in force, to check the recomputed one;
    * for a mixture, its block size, the schedule it was *configured* with (earlier entries hold the part
      before ``position``), the names of the sources it read, and ``stop`` unless ``"never"``; for one
      dataset read for a number of epochs, ``epochs``;
    * the data's layout, ``seq_len`` and ``overlap``; the batch and world size; the exclusions in force;
    * ``step``, the trainer's step there when an adapter or the caller gave it (else null), and
      ``batches_per_step``, the trainer's gradient accumulation;
    * ``served`` for a loader that serves its units at other lengths (:mod:`streampack.loader.seqlen`):
      its own ``seq_len`` and ``[first token, seq_len]`` pairs; ``drop_last`` when False; ``balance``
      when not ``"rows"`` and ``cp_size`` when above 1 (:mod:`streampack.loader.parallel`).

    Every field is bounded: a history grows by one small entry per resume.
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
    return entry if served is None else entry | {"served": dict(served)}


# --------------------------------------------------------------------------------- the trainer's steps


def stride(entry: Mapping[str, Any]) -> int:
    """Positions one trainer step of an entry's leg takes: ``batch_size * batches_per_step``."""
    return int(entry["batch_size"]) * int(entry["batches_per_step"])


def _steps_in(positions: int, step: int) -> int:
    """Steps of ``step`` positions that ``positions`` take, the last one partial."""
    return -(-positions // step)


def leg_steps(entries: Sequence[Mapping[str, Any]]) -> list[int]:
    """The trainer's step at the start of each entry's leg.

    An entry's own ``step`` (the model checkpoint's, which the framework adapters and
    ``load_state_dict(step=...)`` record) is taken as it is: it resets the count there, also when it
    disagrees with the data (a model checkpoint and a data state of different steps, which the audit
    reports). Without one, the step is counted: the previous entry's step plus the steps its leg took to
    this entry's position (a partial step counted whole); the first entry's from step 0 at position 0.
    """
    steps: list[int] = []
    for i, entry in enumerate(entries):
        if entry["step"] is not None:
            steps.append(int(entry["step"]))
        elif i == 0:
            steps.append(_steps_in(int(entry["position"]), stride(entry)))
        else:
            previous = entries[i - 1]
            moved = int(entry["position"]) - int(previous["position"])
            steps.append(steps[-1] + max(0, _steps_in(moved, stride(previous))))
    return steps


@dataclass(frozen=True)
class StepCount:
    """Where a run's trainer steps are: the global positions of each step, leg by leg.

    Leg ``i`` starts at step ``s_i`` and position ``p_i`` and takes ``k_i`` positions a step: step ``s``
    of it is positions ``[p_i + (s - s_i) * k_i, p_i + (s - s_i + 1) * k_i)``. A leg holds the steps from
    its own first one to the first step of any later leg (a resume from a model checkpoint of an earlier
    step trains those steps again, from its own data); the last leg runs on, so steps past the history
    are counted at its stride. Steps before the first leg's are counted back from it (down to position 0).

    Attributes:
        legs: per leg, ``(first step, first position, positions a step)``, in the run's order.
        through: the history entries the legs are (what a loader state records of an exclusion, so that
            a resume counts its steps again the same way); None for steps counted at one batch size from
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
        """Steps counted through history entries (each with ``position``, ``step``, ``batch_size`` and
        ``batches_per_step``), the last of them the leg that runs on."""
        steps = leg_steps(entries)
        legs = tuple(
            (step, int(entry["position"]), stride(entry)) for step, entry in zip(steps, entries, strict=True)
        )
        return cls(legs, len(entries))

    def positions(self, first: int, stop: int) -> list[tuple[int, int]]:
        """The position ranges ``[start, stop)`` of steps ``first`` to ``stop - 1``, one per leg they
        lie in, in the legs' order."""
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

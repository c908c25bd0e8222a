"""The exclusions in force over a loader's order: which apply from where, checked, layered over the order,
and carried through a resume. What the samples, orders and masks are is :mod:`streampack.loader.excluding`'s;
the :class:`~streampack.loader.Loader` holds the entries and asks here.

An entry in force is ``(exclusions, at, steps)``: the exclusions, the position they take effect at, and
where the trainer's steps are (:class:`~streampack.loader.history.StepCount`, counted through the run's
history when the entry was put in force, the current leg at the loader's ``batch_size *
batches_per_step``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from streampack.errors import OptionsError
from streampack.loader.collate import CausalLMDict, Format
from streampack.loader.exclusions import Exclusions, check_prefix, counted
from streampack.loader.history import StepCount
from streampack.loader.state import read_loader_state, resume
from streampack.order import MAX_POSITION, Order

if TYPE_CHECKING:
    import numpy as np

    from streampack.loader.excluding import Masking

__all__ = ["Entry", "checked", "layered", "listed", "placed", "reaching", "resumed"]

Entry = tuple[Exclusions, int, StepCount]
#: Per process, the documents each exclusion names (by its digest), by source: found once.
Found = dict[str, dict[int, "np.ndarray"]]


def listed(exclude: Exclusions | Sequence[Exclusions] | None) -> list[Exclusions]:
    """``exclude=`` as a list of exclusions, checked."""
    if exclude is None:
        return []
    entries = [exclude] if isinstance(exclude, Exclusions) else list(exclude)
    for entry in entries:
        if not isinstance(entry, Exclusions):
            raise TypeError(
                f"exclude= takes streampack.loader.Exclusions, or a list of them (got {type(entry).__name__})"
            )
    return entries


def placed(entry: Exclusions, position: int, steps: StepCount) -> Entry:
    """``entry`` in force from its ``at``, else ``position``, with its steps where ``steps`` puts them.

    Raises:
        OptionsError: ``at`` is before ``position`` (batches already served would change).
    """
    at = position if entry.at is None else entry.at
    if at < position:
        raise OptionsError(
            f"Exclusions(at={at}) is before the loader's position {position}: batches already served "
            "would change; leave at=None (from here on) or give a position >= the current one"
        )
    return entry, at, steps


def reaching(entries: Sequence[Entry]) -> None:
    """Refuse an entry with a range of steps or positions that lies wholly before the position it takes
    effect at: it could never take anything out.

    Raises:
        OptionsError: such a range; the message names it, the positions it is and where the entry takes
            effect.
    """
    for entry, at, steps in entries:
        for first, last in entry.step_ranges():
            ranges = steps.positions(first, last + 1)
            if all(stop <= at for _, stop in ranges):
                where = ", ".join(f"{a:,}-{b:,}" for a, b in ranges) or "none"
                raise OptionsError(
                    f"Exclusions(steps=[({first}, {last})]) takes out positions {where} (the trainer's steps "
                    f"counted through the run's history: {steps.describe()}), all before position {at:,}, "
                    "where the exclusion takes effect: it would take out nothing. Name steps the run reaches "
                    f"from position {at:,} on (with the trainer's gradient accumulation set as "
                    "loader.batches_per_step, as streampack.hf and streampack.lightning do), or positions"
                )
        for start, stop in entry.position_ranges():
            if stop <= at:
                raise OptionsError(
                    f"Exclusions(positions=[({start}, {stop})]) lies wholly before position {at:,}, where "
                    f"the exclusion takes effect: it would take out nothing. Name positions from {at:,} on"
                )


def layered(
    base: Order, entries: Sequence[Entry], datasets: Sequence[Any], found: Found
) -> tuple[Order, Masking | None]:
    """``base`` filtered by the skip ``entries``, and the masking of the mask ones."""
    from streampack.loader.excluding import (
        Masking,
        Skipping,
        excluded_documents,
        excluded_samples,
        merged,
        sample_keys,
    )

    order, masks = base, []
    names = list(base.names)
    for entry, at, steps in entries:
        docs = found.get(entry.digest)
        if docs is None:
            docs = found[entry.digest] = excluded_documents(entry, names, datasets)
        ranges = merged(entry.ranges(steps))
        if entry.mode == "mask":
            masks.append((at, docs, ranges))
            continue
        samples = {source: excluded_samples(datasets[source], ids) for source, ids in docs.items()}
        if base.end is None and all(len(samples.get(s, ())) >= size for s, size in enumerate(base.sizes())):
            raise OptionsError(
                f"the exclusions take out every sample of every source ({', '.join(names)}), and the run is "
                "endless: nothing is left to serve"
            )
        order = Skipping(order, at, sample_keys(samples), ranges)
    return order, (Masking(masks) if masks else None)


def checked(
    base: Order,
    entries: Sequence[Entry],
    datasets: Sequence[Any],
    found: Found,
    formatter: Format,
    output: str,
) -> tuple[Order, Masking | None]:
    """``base`` filtered by ``entries`` and their masking, once they fit: their positions do not go back,
    and mask mode has labels to mask.

    Raises:
        OptionsError: they do not fit.
    """
    ats = [at for _, at, _ in entries]
    if ats != sorted(ats):
        raise OptionsError(
            f"exclusions take effect at positions {ats}: each must be at or after the one before (they are "
            "given in the order of the run)"
        )
    if any(entry.mode == "mask" for entry, _, _ in entries) and not isinstance(formatter, CausalLMDict):
        raise OptionsError(
            f"Exclusions(mode='mask') sets labels=-100 on excluded tokens, and output={output!r} has no "
            "labels; use output='dict' (or 'varlen', 'hf-flash'), or mode='skip'"
        )
    return layered(base, entries, datasets, found)


def resumed(
    state: Mapping[str, Any],
    position: int,
    order: Order,
    configured: Order,
    datasets: Sequence[Any],
    given: Sequence[Exclusions],
    found: Found,
) -> tuple[Order, list[Entry]]:
    """The base order a resume continues, and the entries the state had in force (a prefix of ``given``),
    their steps counted as the state records (through its history).

    A skip entry in force before ``position`` skipped positions of the saved run's order: the base order
    resumes where that run's stood.

    Raises:
        LoaderStateError: the state's exclusions are not a prefix of ``given``, or one counts its steps
            through more history than the state has.
    """
    recorded: list[Mapping[str, Any]] = list(state.get("exclusions", ()))
    check_prefix(recorded, given)
    history = read_loader_state(state).get("history", [])
    kept = [(given[i], int(e["at"]), counted(e, history)) for i, e in enumerate(recorded)]
    if any(entry.mode == "skip" and at < position for entry, at, _ in kept):
        whole = resume({**state, "position": MAX_POSITION}, configured, datasets)[1]
        from streampack.loader.excluding import reached

        cursor = reached(layered(whole, kept, datasets, found)[0], position)  # under every skip layer
        order = resume({**state, "position": cursor}, configured, datasets)[1]
    return order, kept

"""The exclusions in force over a loader's order: which apply from where, checked, layered over the order,
and carried through a resume. What the samples, orders and masks are is :mod:`streampack.loader.excluding`'s;
the :class:`~streampack.loader.Loader` holds the entries and asks here.

An entry in force is ``(exclusions, at, batch_size)``: the exclusions, the position they take effect at, and
the batch size their steps are counted in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from streampack.errors import OptionsError
from streampack.loader.collate import CausalLMDict, Format
from streampack.loader.exclusions import Exclusions, check_prefix
from streampack.loader.state import resume
from streampack.order import MAX_POSITION, Order

if TYPE_CHECKING:
    import numpy as np

    from streampack.loader.excluding import Masking

__all__ = ["Entry", "checked", "layered", "listed", "placed", "resumed"]

Entry = tuple[Exclusions, int, int]
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


def placed(entry: Exclusions, position: int, batch_size: int) -> Entry:
    """``entry`` in force from its ``at``, else ``position``, with its steps at ``batch_size``.

    Raises:
        OptionsError: ``at`` is before ``position`` (batches already served would change).
    """
    at = position if entry.at is None else entry.at
    if at < position:
        raise OptionsError(
            f"Exclusions(at={at}) is before the loader's position {position}: batches already served "
            "would change; leave at=None (from here on) or give a position >= the current one"
        )
    return entry, at, batch_size


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
    for entry, at, batch in entries:
        docs = found.get(entry.digest)
        if docs is None:
            docs = found[entry.digest] = excluded_documents(entry, names, datasets)
        ranges = merged(entry.ranges(batch))
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
    """The base order a resume continues, and the entries the state had in force (a prefix of ``given``).

    A skip entry in force before ``position`` skipped positions of the saved run's order: the base order
    resumes where that run's stood.

    Raises:
        LoaderStateError: the state's exclusions are not a prefix of ``given``.
    """
    recorded: list[Mapping[str, Any]] = list(state.get("exclusions", ()))
    check_prefix(recorded, given)
    kept = [(given[i], int(e["at"]), int(e["batch_size"])) for i, e in enumerate(recorded)]
    if any(entry.mode == "skip" and at < position for entry, at, _ in kept):
        whole = resume({**state, "position": MAX_POSITION}, configured, datasets)[1]
        cursor = layered(whole, kept, datasets, found)[0]._cursor(position)  # type: ignore[attr-defined]
        order = resume({**state, "position": cursor}, configured, datasets)[1]
    return order, kept

"""A mixture's schedule: how many positions of each block every source holds, from which block on.

A schedule is a list of segments ``(first block, counts)``: from block ``first`` until the next segment,
every block holds ``counts[j]`` positions of source ``j``. A checkpoint's schedule is read back strictly
(:func:`saved_history`): a damaged one is refused, not guessed at.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from streampack._checks import check_int
from streampack.errors import LoaderStateError, OptionsError
from streampack.order import MAX_POSITION, mismatch

__all__ = [
    "Counts",
    "counts",
    "exhausted",
    "merged",
    "saved_history",
    "segments",
    "spliced",
    "summary",
    "tables",
]

Counts = tuple[int, ...]


def counts(weights: Mapping[str, float], names: Sequence[str], block_size: int) -> Counts:
    """Positions per block of each source: the weights times the block size, rounded by largest remainder.

    Raises:
        OptionsError: a weight names no source, is not a non-negative number, or is below one position
            per block; or every weight is zero.
    """
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise OptionsError(
            f"weights name sources the mixture does not have: {unknown} (it has {list(names)})"
        )
    exact: list[Fraction] = []
    for name in names:
        weight = weights.get(name, 0)
        if (
            isinstance(weight, bool)
            or not isinstance(weight, numbers.Real)
            or not math.isfinite(weight)
            or weight < 0
        ):
            raise OptionsError(f"the weight of {name!r} must be a non-negative number (got {weight!r})")
        exact.append(Fraction(float(weight)))
    total = sum(exact)
    if total == 0:
        raise OptionsError(f"the weights are all zero: {dict(weights)}; give some source a positive weight")
    quotas = [w * block_size / total for w in exact]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda j: (counts[j] - quotas[j], j))
    for j in by_remainder[: block_size - sum(counts)]:
        counts[j] += 1
    for name, share, count in zip(names, exact, counts, strict=True):
        if share and not count:
            fits = math.ceil(total / share)
            raise OptionsError(
                f"the weight of {name!r} ({float(share / total):.3g} of the mixture) is less than one "
                f"position per block of block_size={block_size}; use block_size={fits} or more"
            )
    return tuple(counts)


def merged(segments: Sequence[tuple[int, Counts]], block_size: int) -> tuple[tuple[int, Counts], ...]:
    """The segments in order of their first block, neighbours with equal counts merged.

    Raises:
        OptionsError: two segments start in the same block.
    """
    merged: list[tuple[int, Counts]] = []
    for first, counts in sorted(segments):
        if merged and merged[-1][0] == first:
            raise OptionsError(
                f"two stages start in the same block ({first}, positions from "
                f"{first * block_size}); stages must be at least block_size={block_size} "
                "positions apart"
            )
        if not merged or merged[-1][1] != counts:
            merged.append((first, counts))
    return tuple(merged)


def tables(schedule: Sequence[tuple[int, Counts]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The arrays a mixture maps positions with, one row per segment: its first block, its counts, and each
    source's cursor at its first block."""
    firsts = np.array([first for first, _ in schedule], dtype=np.int64)
    matrix = np.array([counts for _, counts in schedule], dtype=np.int64)
    lengths = np.diff(firsts)
    # Cursor of each source at the first block of each segment, summed in Python ints: a damaged
    # schedule fails to fit int64 here, loudly, rather than wrapping.
    bases = [[0] * matrix.shape[1]]
    for length, counts in zip(lengths.tolist(), matrix[:-1].tolist(), strict=True):
        bases.append([b + length * c for b, c in zip(bases[-1], counts, strict=True)])
    return firsts, matrix, np.array(bases, dtype=np.int64)


def exhausted(
    schedule: Sequence[tuple[int, Counts]], bases: np.ndarray, sizes: Sequence[int], block_size: int
) -> int | None:
    """Where a ``stop="first_exhausted"`` stream stops: the first block some source of ``sizes`` samples
    cannot fill from its first epoch, as a position."""
    nexts = [*(first for first, _ in schedule[1:]), None]
    for (first, counts), base, following in zip(schedule, bases.tolist(), nexts, strict=True):
        ends = [
            first + max(0, (size - start) // count)
            for size, start, count in zip(sizes, base, counts, strict=True)
            if count
        ]
        block = min(ends)
        if following is None or block < following:
            return min(block * block_size, MAX_POSITION)
    return None  # pragma: no cover - the last segment always ends


def segments(
    weights: Mapping[str, float] | None,
    stages: Sequence[tuple[int, Mapping[str, float]]] | None,
    names: Sequence[str],
    block_size: int,
) -> list[tuple[int, Counts]]:
    """The segments of a mixture given ``weights`` (one stage at 0) or ``stages``: each stage's counts from
    the first block starting at or after its position.

    Raises:
        OptionsError: both or neither given, stages that are not pairs from position 0 in increasing order,
            or a weight that is not allowed.
    """
    if (weights is None) == (stages is None):
        raise OptionsError("give a Mixture either weights={...} or stages=[(0, {...}), ...], one of the two")
    checked: list[tuple[int, Mapping[str, float]]] = [(0, weights)] if weights is not None else []
    for k, stage in enumerate(stages or ()):
        if not (isinstance(stage, (tuple, list)) and len(stage) == 2 and isinstance(stage[1], Mapping)):
            raise OptionsError(
                f"each stage is a (position, weights) pair, e.g. (0, {{'web': 1.0}}) (got {stage!r})"
            )
        position = check_int(f"stages[{k}] position", stage[0], min=0, max=MAX_POSITION)
        if checked and position <= checked[-1][0]:
            raise OptionsError(
                f"stages must be in increasing order of position (got {position} after {checked[-1][0]})"
            )
        checked.append((position, stage[1]))
    if not checked or checked[0][0] != 0:
        raise OptionsError("the first stage must start at position 0, e.g. stages=[(0, {'web': 1.0}), ...]")
    return [(-(-start // block_size), counts(w, names, block_size)) for start, w in checked]


def spliced(
    history: Sequence[tuple[int, Counts]], own: Sequence[tuple[int, Counts]], started: int
) -> list[tuple[int, Counts]]:
    """The schedule of a run resumed when ``started`` blocks had begun: the checkpoint's ``history`` before
    that block, the mixture's ``own`` from there."""
    in_force = [counts for first, counts in own if first <= started][-1]
    kept = [segment for segment in history if segment[0] < started]
    return [*kept, (started, in_force), *(segment for segment in own if segment[0] > started)]


def saved_history(
    saved: Mapping[str, Any],
    *,
    names: Sequence[str],
    data: Sequence[Any],
    seed: int,
    shuffle: Any,
    block_size: int,
) -> tuple[list[tuple[int, Counts]], dict[str, tuple[int, Any]]]:
    """A checkpoint's schedule, as counts over the mixture's ``names``, and each saved source's seed and data.

    ``saved`` is a mixture's order, or a single dataset's, which continues as the source with its data; it
    was read strictly as its kind (:func:`streampack.loader.state.read_order`), so only what ties its
    values together is checked here. ``data`` are the fingerprints of the sources ``names``; ``seed``,
    ``shuffle`` and ``block_size`` the mixture's (``shuffle`` as a checkpoint records it).

    Raises:
        LoaderStateError: the checkpoint does not continue this mixture (another seed, shuffle or block
            size; a source missing here or with other data), or it is damaged.
    """
    kind = saved.get("kind")
    if kind in ("shuffled", "blocks"):
        one = saved.get("data")
        found = [name for name, mine in zip(names, data, strict=True) if mine == one]
        if not found:
            raise LoaderStateError(
                f"the checkpoint read one dataset ({summary(one)}), which is none of this mixture's "
                f"sources {list(names)}; add it to the mixture to continue its epoch"
            )
        saved_shuffle = (
            saved.get("shuffle")
            if kind == "shuffled"
            else {"block": saved.get("block"), "window": saved.get("window")}
        )
        if saved_shuffle != shuffle:
            raise LoaderStateError(mismatch("shuffle", saved_shuffle, shuffle))
        whole = tuple(block_size if name == found[0] else 0 for name in names)
        return [(0, whole)], {found[0]: (int(saved["seed"]), one)}
    if kind != "mixture":
        raise LoaderStateError(f"the checkpoint's order is not a loader order (kind={kind!r}); it is damaged")
    for key, mine in (("seed", seed), ("shuffle", shuffle), ("block_size", block_size)):
        if saved.get(key) != mine:
            raise LoaderStateError(mismatch(key, saved.get(key), mine))
    seeds = {name: (int(info["seed"]), info["data"]) for name, info in saved["sources"].items()}
    history = _saved_schedule(saved["schedule"], set(seeds), names, block_size)
    for name, (_, saved_data) in seeds.items():
        if name not in names:
            raise LoaderStateError(
                f"the checkpoint reads source {name!r}, which this mixture does not have (it has "
                f"{list(names)}); keep it in the mixture, with weight 0 to stop reading it"
            )
        here = data[list(names).index(name)]
        if saved_data != here:
            raise LoaderStateError(mismatch(f"data of source {name!r}", saved_data, here))
    return history, seeds


def _saved_schedule(
    schedule: list[tuple[int, Mapping[str, int]]], known: set[str], names: Sequence[str], block_size: int
) -> list[tuple[int, Counts]]:
    """A checkpoint's schedule as counts over the mixture's ``names``, refused as damaged unless its segments
    start at block 0, in increasing order, each of counts of the ``known`` sources filling a block."""
    history: list[tuple[int, Counts]] = []
    for first, counts in schedule:
        previous = history[-1][0] if history else -1
        if first <= previous:
            problem = f"a segment at block {first!r} follows one at block {previous}"
        elif not set(counts) <= known:
            problem = f"counts {summary(counts)} name sources other than {sorted(known)}"
        elif min(counts.values(), default=0) < 0 or sum(counts.values()) != block_size:
            problem = f"counts {summary(counts)} do not fill a block of {block_size}"
        else:
            history.append((first, tuple(counts.get(name, 0) for name in names)))
            continue
        raise LoaderStateError(f"the checkpoint's mixture schedule is damaged ({problem})")
    if history[0][0] != 0:
        raise LoaderStateError(
            f"the checkpoint's mixture schedule is damaged (it starts at block {history[0][0]}, not 0)"
        )
    return history


def summary(value: object, limit: int = 120) -> str:
    """``repr(value)``, cut to ``limit`` characters (for messages)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

"""The interval arithmetic of an audit (:mod:`streampack.runs.audit`): which samples each leg served.

A leg serves a contiguous run of each source's *cursors*, read from :meth:`Order.consumed
<streampack.order.Order.consumed>` at its two ends. A cursor served by two legs is a sample served twice
within its epoch; one below the furthest served that no leg served was skipped.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from streampack.errors import LoaderStateError
from streampack.loader import Loader
from streampack.loader.excluding import Skipping, merged, reached

__all__ = [
    "CHUNK",
    "Finding",
    "Leg",
    "batches",
    "coverage",
    "cursor_runs",
    "findings",
    "intervals",
    "listed",
    "served",
]

CHUNK = 1 << 20  # positions recomputed at once: 16 MB of picks


@dataclass(frozen=True)
class Leg:
    """One stretch of a run between two resumes.

    Attributes:
        index: its history entry (0: the run's start).
        positions: ``(start, stop)``: the global positions the model trained in it.
        steps: ``(start, stop)``: the trainer's steps it trained.
        batch_size: its global batch size.
        batches_per_step: global batches per trainer step (gradient accumulation).
        world_size: its ranks.
        step_given: whether its first step was the trainer's own (recorded by an adapter), not inferred.
        weights: each source's share of the stream at its start.
        parallel: how its ranks shared each global batch, in words, when not in contiguous slices of whole
            rows (``balance``, ``cp_size``); else empty.
        loss_weights: each source's loss weight in it (the loader's ``loss_weights``), or None: none given
            (also for a history saved before they were recorded).
    """

    index: int
    positions: tuple[int, int]
    steps: tuple[int, int]
    batch_size: int
    batches_per_step: int
    world_size: int
    step_given: bool
    weights: dict[str, float]
    parallel: str = ""
    loss_weights: dict[str, float] | None = None

    @property
    def stride(self) -> int:
        """Positions per trainer step: ``batch_size * batches_per_step``."""
        return self.batch_size * self.batches_per_step

    def steps_of(self, lo: int, hi: int) -> tuple[int, int]:
        """The trainer steps that trained its positions ``[lo, hi)``."""
        start = self.positions[0]
        return self.steps[0] + (lo - start) // self.stride, self.steps[0] + batches(hi - start, self.stride)


@dataclass(frozen=True)
class Finding:
    """Where and why a run did not serve each sample once.

    Attributes:
        kind: ``"twice"`` (positions served again), ``"skipped"``, or ``"unverified"`` (the history begins
            after position 0: the state was saved by a streampack without histories, or edited).
        resume: the history entry at which it happened.
        positions: ``(start, stop)``: the positions concerned (for ``"twice"``, those of the later leg).
        steps: ``(start, stop)``: the trainer's steps that trained them (for ``"skipped"``, the step the
            run jumped at, twice).
        samples: per source, the samples concerned.
        message: the finding in words.
    """

    kind: str
    resume: int
    positions: tuple[int, int]
    steps: tuple[int, int]
    samples: dict[str, int]
    message: str


def batches(positions: int, batch: int) -> int:
    """Steps of ``batch`` positions that ``positions`` take, counting a partial last one."""
    return -(-positions // batch)


def served(legs: list[Leg], loaders: list[Loader], names: list[str]) -> tuple[dict[str, int], dict[str, int]]:
    """Per source, the samples the legs trained on and those skip exclusions passed over, recomputed
    position by position and checked against the cursors."""
    counts = dict.fromkeys(names, 0)
    taken = dict.fromkeys(names, 0)
    for leg, loader in zip(legs, loaders, strict=True):
        start, stop = leg.positions
        here = np.zeros(len(loader.order.names), dtype=np.int64)
        for lo in range(start, stop, CHUNK):
            sources, _ = loader.served(lo, min(stop, lo + CHUNK))
            here += np.bincount(sources, minlength=len(here))
        before, after = loader.order.consumed(start), loader.order.consumed(stop)
        out = _excluded(loader, start, stop, here)
        for j, name in enumerate(loader.order.names):
            if int(here[j] + out[j]) != after[j] - before[j]:
                raise LoaderStateError(
                    f"leg {leg.index}: source {name!r} served {int(here[j])} samples at positions "
                    f"{start}-{stop} ({int(out[j])} excluded), its cursor moved {after[j] - before[j]}: "
                    "the order is not consistent with itself (a bug: please report it)"
                )
            counts[name] = counts.get(name, 0) + int(here[j])
            taken[name] = taken.get(name, 0) + int(out[j])
    return counts, taken


def _excluded(loader: Loader, start: int, stop: int, served: np.ndarray) -> np.ndarray:
    """Per source id, the samples the skip exclusions of ``loader`` passed over in ``[start, stop)``: those
    its order without them picks there, less those ``served``."""
    if not isinstance(loader.order, Skipping):
        return np.zeros(len(served), dtype=np.int64)
    base = loader.run.base
    lo, hi = reached(loader.order, start), reached(loader.order, stop)
    counts = np.zeros(len(served), dtype=np.int64)
    for first in range(lo, hi, CHUNK):
        sources, _ = base(np.arange(first, min(hi, first + CHUNK), dtype=np.int64))
        counts += np.bincount(sources, minlength=len(counts))
    return counts - served


def cursor_runs(legs: list[Leg], loaders: list[Loader], name: str) -> list[tuple[int, int, int]]:
    """``(first, stop, leg)``: the cursors of source ``name`` each leg served."""
    return [
        (_cursor(loader, name, leg.positions[0]), _cursor(loader, name, leg.positions[1]), leg.index)
        for leg, loader in zip(legs, loaders, strict=True)
        if name in loader.order.names
    ]


def _minus(run: tuple[int, int], union: list[tuple[int, int]]) -> list[tuple[int, int]]:
    pieces, (a, b) = [], run
    for lo, hi in union:
        if hi <= a or lo >= b:
            continue
        if lo > a:
            pieces.append((a, lo))
        a = max(a, hi)
    if a < b:
        pieces.append((a, b))
    return pieces


def _stands(legs: list[Leg]) -> list[int]:
    """Per leg, the leg at whose end the model stood when it resumed there: the one before, or, when that
    one trained nothing, the one that one resumed from."""
    found = [0] * len(legs)
    for k in range(2, len(legs)):
        before = legs[k - 1]
        found[k] = k - 1 if before.positions[1] > before.positions[0] else found[k - 1]
    return found


def _cursor(loader: Loader, name: str, position: int) -> int:
    return int(loader.order.consumed(position)[loader.order.names.index(name)])


def _jumps(legs: list[Leg], loaders: list[Loader], name: str) -> list[tuple[int, int, int]]:
    """``(leg, model, data)`` per resume the model kept: source ``name``'s cursor where the model stood, and
    where its data state resumed (equal for a faithful resume)."""
    found = []
    for k, m in enumerate(_stands(legs)):
        if k == 0 or (k + 1 < len(legs) and legs[k].positions[1] <= legs[k].positions[0]):
            continue  # a resume into a leg that trained nothing was undone by the next one
        if name in loaders[m].order.names and name in loaders[k].order.names:
            model = _cursor(loaders[m], name, legs[m].positions[1])
            found.append((k, model, _cursor(loaders[k], name, legs[k].positions[0])))
    return found


def intervals(
    legs: list[Leg], loaders: list[Loader], names: list[str]
) -> tuple[dict[str, list[tuple[int, int, int, int]]], dict[str, list[tuple[int, int, int]]]]:
    """Per source, the cursors served twice, ``(leg, first, stop, resume)``, and those skipped,
    ``(resume, first, stop)``.

    Cursors only rise within a leg, so a cursor served again was crossed downwards by a resume whose data
    state was behind the model: the latest such resume began the replay. A skipped cursor was jumped over
    by a resume whose data state was ahead of the model (the first, if several did).
    """
    twice: dict[str, list[tuple[int, int, int, int]]] = {}
    skipped: dict[str, list[tuple[int, int, int]]] = {}
    for name in names:
        covered: list[tuple[int, int]] = []
        owners: list[tuple[int, int, int]] = []  # who served what, for naming the earlier leg
        for a, b, leg in cursor_runs(legs, loaders, name):
            if b <= a:  # a stretch that trained nothing (the model went back before it) moved nothing
                continue
            for lo, hi, earlier in owners:
                first, stop = max(a, lo), min(b, hi)
                if first < stop:
                    twice.setdefault(name, []).append((leg, first, stop, earlier))
            owners.append((a, b, leg))
            covered = merged([*covered, (a, b)])
        moves = _jumps(legs, loaders, name)
        _merge_twice(twice, name, [(k, data, model) for k, model, data in moves if data < model])
        top = max((hi for _, hi in covered), default=0)
        done = list(covered)  # cursors served, or already reported skipped
        for leg, model, data in moves:
            if min(data, top) <= model:
                continue
            for first, stop in _minus((model, min(data, top)), merged(done)):
                skipped.setdefault(name, []).append((leg, first, stop))
                done.append((first, stop))
    return twice, skipped


def _merge_twice(
    twice: dict[str, list[tuple[int, int, int, int]]], name: str, back: list[tuple[int, int, int]]
) -> None:
    """Count a cursor served by three legs once per later leg, and name for each the resume that began
    its replay: the latest of ``back`` (``(resume, data, model)``) at or before that leg."""
    runs = twice.get(name)
    if not runs:
        return
    out: list[tuple[int, int, int, int]] = []
    for leg in sorted({run[0] for run in runs}):
        left = merged([(a, b) for at, a, b, _ in runs if at == leg])
        for resume, lo, hi in sorted((r for r in back if r[0] <= leg), reverse=True):
            out += [(leg, max(a, lo), min(b, hi), resume) for a, b in left if max(a, lo) < min(b, hi)]
            left = [piece for run in left for piece in _minus(run, [(lo, hi)])]
        out += [(leg, a, b, leg) for a, b in left]  # none: a replay needs a resume that went back
    twice[name] = sorted(out)


def _position_of(loader: Loader, j: int, cursor: int, lo: int, hi: int) -> int:
    """The first position in ``[lo, hi]`` where source ``j`` has served ``cursor`` samples, else ``hi``."""
    return lo + bisect.bisect_left(
        range(lo, hi), cursor, key=lambda position: loader.order.consumed(position)[j]
    )


def findings(
    legs: list[Leg],
    loaders: list[Loader],
    names: list[str],
    twice: dict[str, list[tuple[int, int, int, int]]],
    skipped: dict[str, list[tuple[int, int, int]]],
) -> list[Finding]:
    """One finding per resume that replayed or skipped, with the positions and steps concerned; a replay
    is reported at the resume that began it, over every leg it spans."""
    replays: dict[int, tuple[dict[str, int], list[tuple[int, int, int, int]]]] = {}
    for k, leg in enumerate(legs):
        loader, (start, stop) = loaders[k], leg.positions
        for name in names:
            for at, a, b, began in twice.get(name, []):
                if at != k:
                    continue
                j = loader.order.names.index(name)
                lo = _position_of(loader, j, a + 1, start, stop) - 1
                hi = _position_of(loader, j, b, start, stop)
                counts, spans = replays.setdefault(began, ({}, []))
                counts[name] = counts.get(name, 0) + b - a
                spans.append((lo, hi, *leg.steps_of(lo, hi)))
    found: list[Finding] = []
    for k, leg in enumerate(legs):
        why = _why(legs, k)
        if k in replays:
            counts, spans = replays[k]
            lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
            steps = (min(s[2] for s in spans), max(s[3] for s in spans))
            found.append(
                Finding(
                    kind="twice",
                    resume=k,
                    positions=(lo, hi),
                    steps=steps,
                    samples=counts,
                    message=f"positions {lo:,}-{hi:,} (steps {steps[0]:,}-{steps[1]:,}) served twice "
                    f"({listed(counts)}): {why}; the data state is older than the model checkpoint",
                )
            )
        loader, start = loaders[k], leg.positions[0]
        counts, lo, hi = {}, 2**63, -1
        for name in names:
            for at, a, b in skipped.get(name, []):
                if at != k:
                    continue
                j = loader.order.names.index(name)
                counts[name] = counts.get(name, 0) + b - a
                lo = min(lo, _position_of(loader, j, a + 1, 0, start) - 1)
                hi = max(hi, _position_of(loader, j, b, 0, start))
        if counts:
            found.append(
                Finding(
                    kind="skipped",
                    resume=k,
                    positions=(lo, hi),
                    steps=(leg.steps[0], leg.steps[0]),
                    samples=counts,
                    message=f"positions {lo:,}-{hi:,} skipped ({listed(counts)}), never trained: {why}; "
                    "the data state is newer than the model checkpoint",
                )
            )
    return found


def _why(legs: list[Leg], k: int) -> str:
    """How resume ``k`` came about: the model's step, the data state's position and step."""
    leg, start = legs[k], legs[k].positions[0]
    if k == 0:
        return f"the run started at step {leg.steps[0]:,} and position {start:,}"
    previous, stood = legs[k - 1], legs[_stands(legs)[k]].positions[1]
    data_step = previous.steps[0] + batches(start - previous.positions[0], previous.stride)
    return (
        f"resumed at step {leg.steps[0]:,} from a data state at position {start:,} (step {data_step:,}), "
        f"the model had trained to position {stood:,}"
    )


def listed(counts: Mapping[str, int]) -> str:
    """``counts`` of samples per source, in words."""
    return ", ".join(f"{count:,} samples of {name}" for name, count in counts.items())


def coverage(
    size: int,
    union: list[tuple[int, int]],
    twice: list[tuple[int, int, int, int]],
    skipped: list[tuple[int, int, int]],
) -> list[list[int]]:
    """Per epoch: samples served (once or more), served twice, skipped."""
    if size <= 0 or not union:
        return []
    epochs = -(-max(b for _, b in union) // size)

    def per_epoch(runs: list[tuple[int, int]]) -> list[int]:
        counts = [0] * epochs
        for a, b in runs:
            for e in range(a // size, min(epochs, -(-b // size))):
                counts[e] += max(0, min(b, (e + 1) * size) - max(a, e * size))
        return counts

    served = per_epoch(union)
    again = per_epoch([(a, b) for _, a, b, _ in twice])
    missed = per_epoch([(a, b) for _, a, b in skipped])
    return [[s - t, t, m] for s, t, m in zip(served, again, missed, strict=True)]

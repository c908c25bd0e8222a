"""A proof of what a run saw, from its last checkpoint alone: every sample each step consumed, recomputed.

A loader state carries the run's history (:attr:`Loader.history <streampack.loader.Loader.history>`):
one entry for the start and one per resume. Entry ``i`` starts a *leg* at position ``p_i`` and step
``s_i`` that trains ``B_i`` positions per step up to ``p_i + (s_{i+1} - s_i) * B_i`` (the last leg: to
the state's position). A resume whose data state is elsewhere replays or skips positions, usually because
the model checkpoint and the data state are of different steps.

:func:`audit` rebuilds each entry's :class:`~streampack.loader.Loader` from the data given, checks its
order against the recorded digest, and, as a leg serves a contiguous run of each source's cursors, gives
the verdict by interval arithmetic (:mod:`streampack.runs.coverage`). No token is read, only manifests.

Ranges in reports are half-open: ``positions 9600-10000`` are positions 9600 to 9999.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from streampack.errors import LoaderStateError, OptionsError, read_json
from streampack.follow import FollowOptions, GrowingCache
from streampack.loader import Loader
from streampack.loader.excluding import merged
from streampack.loader.exclusions import Exclusions
from streampack.loader.history import leg_steps, order_digest, stride
from streampack.loader.run import listed
from streampack.loader.state import read_loader_state, saved
from streampack.order import Ordered
from streampack.order.blockshuffle import BlockShuffle
from streampack.order.mixture import Mixture
from streampack.reader import open as open_cache
from streampack.runs import coverage as cov
from streampack.runs.auditexclusions import excluded_served, in_force, placed
from streampack.runs.coverage import Finding, Leg
from streampack.runs.mixconfig import is_config, load_mixture, mixture_exclusions

__all__ = ["AuditReport", "Finding", "Leg", "SourceAudit", "audit", "leg_loaders"]


@dataclass(frozen=True)
class SourceAudit:
    """What one source served over the whole run.

    Attributes:
        name: the source's name (``"data"`` for one dataset).
        size: its samples per epoch.
        samples: samples of it the model trained on, replays included.
        tokens: ``samples * seq_len`` (the sample width, for samples that are not a cache's).
        epochs: the furthest cursor served over ``size``: epochs gone through, with the fraction of the last.
        twice: samples served a second time within their epoch.
        skipped: samples of an epoch never served while later ones were.
        coverage: per epoch ``[served once, served twice, skipped]``, counts of samples.
        excluded: samples that skip exclusions passed over (not served, and not counted as skipped).
    """

    name: str
    size: int
    samples: int
    tokens: int
    epochs: float
    twice: int
    skipped: int
    coverage: list[list[int]] = field(default_factory=list)
    excluded: int = 0


@dataclass(frozen=True)
class AuditReport:
    """The audit of a run (see :func:`audit`).

    Attributes:
        position: the last state's position.
        step: the trainer's step there.
        legs: the run's legs, one per history entry.
        sources: per source, what it served.
        findings: each replay, skip or gap in the history, in the run's order; none for a clean run.
    """

    position: int
    step: int
    legs: list[Leg]
    sources: list[SourceAudit]
    findings: list[Finding]

    @property
    def clean(self) -> bool:
        """True when every sample trained was served once within its epoch and none was skipped."""
        return not self.findings

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-able dicts (``streampack audit --json``)."""
        return {"clean": self.clean, **asdict(self)}

    def text(self) -> str:
        """The report as ``streampack audit`` prints it."""
        lines = [
            f"run         {len(self.legs)} legs ({len(self.legs) - 1} resumes), to position "
            f"{self.position:,}, step {self.step:,}"
        ]
        for before, leg in zip([None, *self.legs], self.legs):
            given = "" if leg.step_given else " (inferred)"
            lines.append(
                f"leg {leg.index:<7} positions {leg.positions[0]:,}-{leg.positions[1]:,}, steps "
                f"{leg.steps[0]:,}{given}-{leg.steps[1]:,}, batch {leg.batch_size} over {leg.world_size} "
                f"rank{'s' if leg.world_size > 1 else ''}{leg.parallel}"
            )
            if before is None and leg.loss_weights is not None:
                lines.append(f"{'':12}loss weights {describe_loss_weights(leg.loss_weights)}")
            elif before is not None and (change := loss_weights_change(before, leg)) is not None:
                lines.append(f"{'':12}{change}")
        lines.append(
            f"{'source':<16} {'samples':>14} {'tokens':>16} {'epochs':>9} {'twice':>10} {'skipped':>10} "
            f"{'excluded':>10}"
        )
        for s in self.sources:
            lines.append(
                f"{s.name:<16} {s.samples:>14,} {s.tokens:>16,} {s.epochs:>9.3f} {s.twice:>10,} "
                f"{s.skipped:>10,} {s.excluded:>10,}"
            )
        if self.clean:
            lines.append("verdict     clean: every sample served once within its epoch, none skipped")
        else:
            lines.append(f"verdict     NOT clean: {len(self.findings)} findings")
            lines.extend(f"  - {finding.message}" for finding in self.findings)
        return "\n".join(lines)


def describe_loss_weights(weights: Mapping[str, float] | None) -> str:
    """Loss weights in words: ``web 1, code 2``, or ``none (every source 1)``."""
    if weights is None:
        return "none (every source 1)"
    return ", ".join(f"{name} {weight:g}" for name, weight in weights.items())


def loss_weights_change(before: Leg, after: Leg) -> str | None:
    """What the resume that began ``after`` changed of the loss weights, in words; None if nothing.

    The weights change no sample served (the verdict does not count them), but they change what a
    source's tokens weigh in the loss: a run's record should say where they changed.
    """
    old, new = before.loss_weights, after.loss_weights
    names = {*(old or {}), *(new or {})}  # a source without a weight (or a leg without any) weighs 1
    if all((old or {}).get(name, 1.0) == (new or {}).get(name, 1.0) for name in names):
        return None
    return (
        f"loss weights changed at position {after.positions[0]:,} (step {after.steps[0]:,}): "
        f"{describe_loss_weights(old)} -> {describe_loss_weights(new)}"
    )


def audit(
    state: Mapping[str, Any] | str | Path,
    data: Any,
    *,
    seq_len: int | None = None,
    seed: int | None = None,
    exclude: Exclusions | Sequence[Exclusions] | None = None,
) -> AuditReport:
    """Recompute every sample a run consumed from its last loader state, and check each was served once
    within its epoch.

    Example::

        report = streampack.runs.audit.audit("ckpt/streampack_loader.json", "mix.yaml")
        assert report.clean, report.text()

    Args:
        state: the run's last :meth:`Loader.state_dict`, or a JSON file holding one.
        data: what the run read: a cache directory or a mixture config (``.yaml``/``.yml``/``.json``), as
            ``streampack which`` takes them; or the sources themselves: a dataset, or a
            :class:`~streampack.order.mixture.Mixture` (only its sources are used, not its weights).
        seq_len: the run's sequence length, checked against the history if given.
        seed: the run's seed, checked against the history if given.
        exclude: the run's exclusions, as its loader was given them; the audit re-applies them where the
            history says they were in force (a state records only their digests). Default: a mixture
            config's ``exclude:``, else none.

    Returns:
        An :class:`AuditReport`: per source, samples and tokens served, epochs, replays and skips; each
        finding with its positions, steps and cause.

    Raises:
        LoaderStateError: the state is not a loader state or has no history; ``data`` is not what the run
            read (both orders named); or ``exclude`` lacks exclusions the history has in force.
        OptionsError: ``seq_len`` or ``seed`` differ from the run's.
    """
    checked = read_loader_state(read_state_file(state))
    entries = checked.get("history") or []
    if not entries:
        raise LoaderStateError(
            "the loader state has no history (it was saved by a streampack before 0.2's histories, or "
            "edited): there is nothing to audit from; audit a state saved by this version"
        )
    _check_given(entries, seq_len, seed)
    given = run_exclusions(data, exclude)
    exclusions = checked.get("exclusions") or []
    loaders = leg_loaders(entries, data, given, exclusions, order=checked["order"])
    legs = _legs(entries, loaders, int(checked["position"]))
    names = list(loaders[-1].order.names)
    served, taken = cov.served(legs, loaders, names)
    twice, skipped = cov.intervals(legs, loaders, names)
    findings = _unverified(legs) + cov.findings(legs, loaders, names, twice, skipped)
    findings += excluded_served(legs, loaders, in_force(entries, exclusions), given)
    width = entries[-1]["data"].get("seq_len") or loaders[-1].width  # samples not a cache's: their width
    sizes = dict(zip(names, loaders[-1].order.sizes(), strict=True))
    sources = []
    for name in names:
        union = merged([(a, b) for a, b, _ in cov.cursor_runs(legs, loaders, name)])
        twice_of, skipped_of = twice.get(name, []), skipped.get(name, [])
        sources.append(
            SourceAudit(
                name=name,
                size=sizes[name],
                samples=served[name],
                tokens=served[name] * width,
                epochs=max((b for _, b in union), default=0) / max(sizes[name], 1),
                twice=sum(b - a for _, a, b, _ in twice_of),
                skipped=sum(b - a for _, a, b in skipped_of),
                coverage=cov.coverage(sizes[name], union, twice_of, skipped_of),
                excluded=taken[name],
            )
        )
    return AuditReport(
        position=int(checked["position"]),
        step=legs[-1].steps[1],
        legs=legs,
        sources=sources,
        findings=findings,
    )


def _legs(entries: Sequence[Mapping[str, Any]], loaders: list[Loader], final: int) -> list[Leg]:
    """The run's legs: each up to where the next resume's step says the model got, the last one up to
    ``final``, the state's position."""
    steps = leg_steps(entries)  # as Exclusions(steps=...) counts them
    legs = []
    for i, (entry, loader) in enumerate(zip(entries, loaders, strict=True)):
        start, batch = int(entry["position"]), int(entry["batch_size"])
        if i + 1 == len(entries):
            end = final
        elif entries[i + 1]["step"] is not None:
            end = start + max(0, steps[i + 1] - steps[i]) * stride(entry)
        else:
            end = int(entries[i + 1]["position"])
        limit = loader.order.end
        if limit is not None and entry.get("drop_last", True):  # its partial last batch is not served
            limit = start + max(0, limit - start) // batch * batch
        end = max(start, end if limit is None else min(end, limit))
        legs.append(
            Leg(
                index=i,
                positions=(start, end),
                steps=(steps[i], steps[i] + cov.batches(end - start, stride(entry))),
                batch_size=batch,
                batches_per_step=int(entry["batches_per_step"]),
                world_size=int(entry["world_size"]),
                step_given=entry["step"] is not None,
                weights=dict(zip(loader.order.names, loader.order.weights(start), strict=True)),
                parallel=_parallel(entry),
                loss_weights=entry.get("loss_weights"),
            )
        )
    return legs


def _parallel(entry: Mapping[str, Any]) -> str:
    """How an entry's ranks shared each global batch, in words; empty for contiguous slices of rows."""
    words = []
    if entry.get("balance", "rows") != "rows":
        words.append(f"rows balanced by {entry['balance']} cost")
    if entry.get("cp_size", 1) > 1:
        words.append(f"each row split over {entry['cp_size']} context-parallel ranks")
    return f" ({', '.join(words)})" if words else ""


def _unverified(legs: list[Leg]) -> list[Finding]:
    """A finding for the positions before the history's first entry, if any."""
    first = legs[0].positions[0]
    if not first:
        return []
    return [
        Finding(
            kind="unverified",
            resume=0,
            positions=(0, first),
            steps=(0, legs[0].steps[0]),
            samples={},
            message=f"positions 0-{first:,} are not in the history: the run's start was saved by a "
            "streampack without histories, so what they served cannot be audited",
        )
    ]


def read_state_file(state: Mapping[str, Any] | str | Path) -> Mapping[str, Any]:
    """A loader state given as a dict, or read from the JSON file ``state`` names.

    Raises:
        LoaderStateError: the file cannot be read, or holds no JSON object.
    """
    if isinstance(state, Mapping):
        return state
    try:
        text = Path(state).read_bytes()
    except OSError as error:
        raise LoaderStateError(f"cannot read the loader state {state}: {error}") from None
    fix = "a loader state is the JSON object of a Loader.state_dict()"
    return read_json(text, dict[str, Any], LoaderStateError, str(state), fix)


def _check_given(entries: Sequence[Mapping[str, Any]], seq_len: int | None, seed: int | None) -> None:
    """Refuse a ``seq_len`` (of the units, or one a seq_len schedule served them at) or ``seed`` that is not
    the run's."""
    served = [entry.get("served") or {} for entry in entries]
    lengths = {e["data"].get("seq_len") for e in entries} | {s.get("seq_len") for s in served}
    lengths |= {length for s in served for _, length in s.get("schedule") or []}
    known = sorted(length for length in lengths if length is not None)
    recorded_by = {"seq_len": known, "seed": sorted({entry["seed"] for entry in entries})}
    for key, given in (("seq_len", seq_len), ("seed", seed)):
        recorded = recorded_by[key]
        if given is not None and recorded and given not in recorded:
            raise OptionsError(
                f"{key}={given} was given, but the run's history records {key} {recorded}; leave it out "
                "(the history holds it) or give the run's"
            )


def run_exclusions(data: Any, exclude: Exclusions | Sequence[Exclusions] | None) -> list[Exclusions]:
    """The run's exclusions: those given, else a mixture config's ``exclude:``, else none."""
    if exclude is not None:
        return listed(exclude)
    if isinstance(data, (str, Path)) and is_config(data):
        return mixture_exclusions(data)
    return []


def leg_loaders(
    entries: Sequence[Mapping[str, Any]],
    data: Any,
    exclude: Sequence[Exclusions] = (),
    final: Sequence[Mapping[str, Any]] = (),
    *,
    order: Mapping[str, Any] | None = None,
) -> list[Loader]:
    """The loader of each history entry, resumed as the run resumed, with the exclusions in force in its leg
    (``final``: the state's exclusions; ``order``: its order, which names what a Follow run read).

    Raises:
        LoaderStateError: a loader's order is not the one its entry records (``data`` is not the run's),
            or ``exclude`` is not the run's exclusions.
        OptionsError: ``data`` is not of the kind the run read (a mixture's config for a mixture).
    """
    if entries and entries[0]["kind"] == "follow":
        data = _followed(data, order)
    loaders: list[Loader] = []
    forced = in_force(entries, final)
    for i, entry in enumerate(entries):
        loader = _loader(entry, data, placed(forced[i], exclude, i))
        position = int(entry["position"])
        if loaders or position or forced[i]:
            # From the previous leg's order (the first leg: its own), with the exclusions in force in this
            # leg, and the history up to here, which counts their steps as the run did.
            state = saved(
                position, (loaders[-1] if loaders else loader).order, loader.options, entries[: i + 1]
            )
            if forced[i]:
                state["exclusions"] = [dict(record) for record in forced[i]]
            loader.load_state_dict(state)
        digest, mine = entry["order"], order_digest(loader.order.fingerprint())
        if digest != mine:
            raise LoaderStateError(
                f"history entry {i} (position {position:,}) records the order {digest}; the data given "
                f"makes the order {mine} ({loader.order!r}): it is not what the run read. Give the cache or "
                "mixture config of the run (the same caches, seq_len and layout)"
            )
        loaders.append(loader)
    return loaders


def _loader(entry: Mapping[str, Any], data: Any, exclude: list[Exclusions]) -> Loader:
    """The loader a history entry describes, over ``data``."""
    # Mask mode needs labels to mask.
    output = "dict" if any(exclusion.mode == "mask" for exclusion in exclude) else "numpy"
    common: dict[str, Any] = {"batch_size": int(entry["batch_size"]), "exclude": exclude, "output": output}
    if entry["kind"] == "follow":  # the build it followed (see _followed) grows with its own order
        return Loader(copy.copy(data), **common)
    common["seq_len_schedule"] = _schedule(entry)
    shuffle = entry["shuffle"]
    shuffle = BlockShuffle(**shuffle) if isinstance(shuffle, Mapping) else shuffle
    if isinstance(data, (str, Path)) and is_config(data):
        data = load_mixture(data)
    if entry["kind"] == "mixture":
        if not isinstance(data, Ordered):
            raise OptionsError(
                "the run read a mixture: give its mixture config (or the Mixture), not "
                f"{type(data).__name__} {data!r}"
            )
        sources, base = data.sources_and_order()
        if "sources" in entry:  # the leg read these (a run may add sources at a resume)
            missing = [name for name in entry["sources"] if name not in sources]
            if missing:
                raise OptionsError(
                    f"the run read the sources {entry['sources']} from position {int(entry['position']):,}; "
                    f"the data given has no {missing}: give the mixture of the run's last sources"
                )
            sources = {name: sources[name] for name in entry["sources"]}
        block = int(entry["block_size"])
        mixture = Mixture(
            dict(sources),
            stages=[(int(first) * block, dict(counts)) for first, counts in entry["schedule"]],
            seed=int(entry["seed"]),
            shuffle=shuffle,
            block_size=block,
            stop=entry.get("stop", "never") if "sources" in entry else getattr(base, "stop", "never"),
        )
        return Loader(mixture, **common)
    if isinstance(data, Ordered):
        raise OptionsError(
            f"the run read one dataset (an order of kind {entry['kind']!r}): give its cache, not a mixture"
        )
    if isinstance(data, (str, Path)):
        data = _samples(str(data), entry["data"])
    return Loader(data, seed=int(entry["seed"]), shuffle=shuffle, epochs=entry.get("epochs"), **common)


def _followed(data: Any, order: Mapping[str, Any] | None) -> Any:
    """A fresh :class:`~streampack.follow.GrowingCache` of the build a Follow run read: the cache at the path
    given with the settings the run's ``order`` names, or the one a given Follow reads. It goes on with
    epochs after the eras (the history does not record ``then=``, and no leg served a position past them).

    Raises:
        OptionsError: ``data`` is neither a path (with ``order``) nor a Follow.
    """
    growing = getattr(data, "dataset", data)
    if isinstance(growing, GrowingCache):
        path, options = growing.path, replace(growing.options, then="epochs")
        order = growing.order.fingerprint()
    elif isinstance(data, (str, Path)) and order is not None:
        described = dict(order.get("data") or {})
        described.pop("build", None)
        first, largest = (int(size) for size in order["eras"])
        # Nothing waits: the audit reads the positions the run served, which the build has committed.
        path, options = data, FollowOptions(**described, first_era=first, largest_era=largest, timeout=1e-3)
    else:
        raise OptionsError(
            f"the run followed a build (streampack.Follow): give its cache directory (with the state's "
            f"order) or a Follow of it, not {type(data).__name__}"
        )
    # Of batch 1 without drop_last: a finished cache refused only when it holds no sample at all.
    return GrowingCache(path, options, seed=int(order["seed"]), batch_size=1, drop_last=False)


def _schedule(entry: Mapping[str, Any]) -> list[list[int]] | None:
    """The lengths a leg served its units at (a seq_len schedule, or a resume at another seq_len)."""
    served, unit = entry.get("served"), entry["data"].get("seq_len")
    if served is None:
        return None
    schedule = served["schedule"] if served["schedule"] is not None else [[0, int(served["seq_len"])]]
    # A leg that joined units (resumed at a multiple of their length) served the same units; the loader
    # that ran it checked its lengths, and a loader made afresh takes only lengths that divide them.
    divides = isinstance(unit, int) and all(unit % length == 0 for _, length in schedule)
    return schedule if divides else None


def _samples(path: str, described: Mapping[str, Any]) -> Any:
    """The samples of the cache at ``path`` that the history describes (layout, seq_len, overlap)."""
    layout, seq_len = described.get("layout"), described.get("seq_len")
    if seq_len is None or layout not in ("windows", "packed", "documents"):
        raise OptionsError(
            f"the run read samples of layout {layout!r} (not a cache's): give those samples to "
            "streampack.runs.audit.audit(state, samples), not a path"
        )
    cache = open_cache(path)
    if layout == "windows":
        return cache.sequences(int(seq_len), overlap=int(described.get("overlap", 0)))
    return getattr(cache, layout)(int(seq_len))

"""A proof of what a run saw, from its last checkpoint alone: every sample each step consumed, recomputed.

A loader state carries the run's history (:attr:`Loader.history <streampack.loader.Loader.history>`):
one entry for the start and one per resume, each saying how the run was read from its position on. The
run is a sequence of *legs*, one per entry. Leg ``i`` starts at the entry's position ``p_i`` and the
trainer's step ``s_i`` (the step an adapter recorded, else the one the data implies), and trains one
global batch per step until the next resume, whose step says how far the model got: it trained
positions ``[p_i, X_i)`` with ``X_i = p_i + (s_{i+1} - s_i) * B_i`` (up to the state's position, for the
last leg). A resume whose data state is not at ``X_i`` replays or skips: the usual way is a model
checkpoint and a data state of different steps.

:func:`audit` builds the :class:`~streampack.loader.Loader` each entry describes (from the data given:
a cache directory, a mixture config, or the sources themselves; the entry's seed, shuffle, batch size,
layout and mixture schedule, resumed from the previous leg as the run resumed), checks its order against
the digest recorded, and asks it, through the function its batches are served with
(:meth:`Loader.served <streampack.loader.Loader.served>`), for the samples of every position the leg
trained, in chunks of positions with numpy. Each source serves its samples at a *cursor* (samples of it
served so far: sample ``c mod N`` of epoch ``c // N``), and the positions of a leg serve a contiguous run
of each source's cursors (:meth:`Order.consumed <streampack.order.Order.consumed>`), so the verdict is
interval arithmetic per source: a cursor served by two legs is a sample served twice within its epoch, a
cursor below the furthest one served that no leg served is a sample skipped. Nothing is read but the
caches' manifests: no token.

Ranges in reports are half-open: ``positions 9600-10000`` are positions 9600 to 9999.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from streampack.errors import LoaderStateError, OptionsError
from streampack.loader import Loader
from streampack.loader import coverage as cov
from streampack.loader.auditexclusions import excluded_served, in_force, placed
from streampack.loader.coverage import Finding, Leg
from streampack.loader.exclusions import Exclusions
from streampack.loader.history import leg_steps, order_digest, stride
from streampack.loader.run import listed
from streampack.loader.state import LOADER_FORMAT, LOADER_VERSION, read_loader_state

__all__ = ["AuditReport", "Finding", "Leg", "SourceAudit", "audit", "leg_loaders"]


@dataclass(frozen=True)
class SourceAudit:
    """What one source served over the whole run.

    Attributes:
        name: the source's name (``"data"`` for one dataset).
        size: its samples per epoch.
        samples: samples of it the model trained on, replays included.
        tokens: ``samples * seq_len`` (the sample width for samples that are not a cache's).
        epochs: the furthest cursor served over ``size``: the epochs it went through, with the fraction
            of the last.
        twice: samples served a second time within their epoch.
        excluded: samples skip exclusions took out (passed over, not served: not skipped).
        skipped: samples of an epoch never served while later ones were.
        coverage: per epoch ``[served once, served twice, skipped]``, counts of samples.
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
        for leg in self.legs:
            given = "" if leg.step_given else " (inferred)"
            lines.append(
                f"leg {leg.index:<7} positions {leg.positions[0]:,}-{leg.positions[1]:,}, steps "
                f"{leg.steps[0]:,}{given}-{leg.steps[1]:,}, batch {leg.batch_size} over {leg.world_size} "
                f"rank{'s' if leg.world_size > 1 else ''}"
            )
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


def audit(
    state: Mapping[str, Any] | str | Path,
    data: Any,
    *,
    seq_len: int | None = None,
    seed: int | None = None,
    exclude: Exclusions | Sequence[Exclusions] | None = None,
) -> AuditReport:
    """Recompute every sample a run consumed from its last loader state, and say whether each was served
    once within its epoch.

    Example::

        report = streampack.loader.audit.audit("ckpt/streampack_loader.json", "mix.yaml")
        assert report.clean, report.text()

    Args:
        state: the run's last :meth:`Loader.state_dict` (a dict, or a JSON file holding one).
        data: what the run read: a cache directory or a mixture config (``.yaml``/``.yml``/``.json``),
            as ``streampack which`` takes them; or the sources themselves: a dataset (``cache.sequences
            (...)``, an array) or a :class:`~streampack.order.mixture.Mixture` (its weights are the
            history's, only its sources are used).
        seq_len: the run's sequence length, checked against the history (not needed).
        seed: the run's seed, checked against the history (not needed).
        exclude: the run's exclusions, as its loader was given them (``Loader(exclude=...)``), which the
            audit re-applies leg by leg where the history says they were in force (a state records only
            their digests); default: a mixture config's ``exclude:``, else none.

    Returns:
        An :class:`AuditReport`: per source, samples and tokens served, epochs, replays and skips; each
        finding with its positions, steps and why.

    Raises:
        LoaderStateError: the state is not a loader state, or has no history (saved by a streampack before
            histories), or ``data`` is not what the run read (the recomputed order differs from the one
            recorded: both named).
        OptionsError: ``seq_len`` or ``seed`` differ from the run's.
        LoaderStateError: the history has exclusions in force that ``exclude`` lacks, or holds otherwise.
    """
    state = read_state_file(state)
    checked = read_loader_state(state)
    entries = checked.get("history") or []
    if not entries:
        raise LoaderStateError(
            "the loader state has no history (it was saved by a streampack before 0.2's histories, or "
            "edited): there is nothing to audit from; audit a state saved by this version"
        )
    _check_given(entries, seq_len, seed)
    final = int(checked["position"])
    given = run_exclusions(data, exclude)
    recorded = in_force(entries, checked.get("exclusions") or [])
    loaders = leg_loaders(entries, data, given, checked.get("exclusions") or [], order=checked["order"])
    starts = leg_steps(entries)  # as Exclusions(steps=...) counts them
    ends = _ends(entries, starts, final, loaders)
    legs = [
        Leg(
            i,
            (int(e["position"]), ends[i]),
            (starts[i], starts[i] + cov.batches(ends[i] - int(e["position"]), stride(e))),
            int(e["batch_size"]),
            int(e["batches_per_step"]),
            int(e["world_size"]),
            e["step"] is not None,
            dict(zip(loader.order.names, loader.order.weights(int(e["position"])), strict=True)),
        )
        for i, (e, loader) in enumerate(zip(entries, loaders, strict=True))
    ]
    names = list(loaders[-1].order.names)
    sizes = dict(zip(names, loaders[-1].order.sizes(), strict=True))
    served, taken = cov.served(legs, loaders, names)
    findings: list[Finding] = []
    if legs[0].positions[0] > 0:
        first = legs[0].positions[0]
        findings.append(
            Finding(
                "unverified",
                0,
                (0, first),
                (0, legs[0].steps[0]),
                {},
                f"positions 0-{first:,} are not in the history: the run's start was saved by a streampack "
                "without histories, so what they served cannot be audited",
            )
        )
    twice, skipped = cov.intervals(legs, loaders, names)
    findings += cov.findings(legs, loaders, names, twice, skipped)
    findings += excluded_served(legs, loaders, recorded, given)
    width = _width(entries[-1], loaders[-1])
    sources = []
    for name in names:
        union = cov.union([(a, b) for a, b, _ in cov.cursor_runs(legs, loaders, name)])
        distinct = sum(b - a for a, b in union)
        twice_count = sum(b - a for _, a, b, _ in twice.get(name, []))
        skipped_count = sum(b - a for _, a, b in skipped.get(name, []))
        sources.append(
            SourceAudit(
                name,
                sizes[name],
                served[name],
                served[name] * width,
                (max((b for _, b in union), default=0)) / max(sizes[name], 1) if distinct else 0.0,
                twice_count,
                skipped_count,
                cov.coverage(sizes[name], union, twice.get(name, []), skipped.get(name, [])),
                taken[name],
            )
        )
    return AuditReport(final, legs[-1].steps[1], legs, sources, findings)


# --------------------------------------------------------------------------------- the legs' loaders


def read_state_file(state: Mapping[str, Any] | str | Path) -> Mapping[str, Any]:
    """A loader state given as a dict, or read from the JSON file ``state`` names.

    Raises:
        LoaderStateError: the file cannot be read, or holds no JSON object.
    """
    if isinstance(state, Mapping):
        return state
    try:
        loaded = json.loads(Path(state).read_text())
    except (OSError, ValueError) as error:
        raise LoaderStateError(f"cannot read the loader state {state}: {error}") from None
    if not isinstance(loaded, Mapping):
        raise LoaderStateError(f"{state}: a loader state is a JSON object (Loader.state_dict())")
    return loaded


def _check_given(entries: Sequence[Mapping[str, Any]], seq_len: int | None, seed: int | None) -> None:
    """Refuse a ``seq_len`` or ``seed`` not the run's (they are not needed: the history holds them)."""
    for key, given in (("seq_len", seq_len), ("seed", seed)):
        if given is None:
            continue
        if key == "seed":
            recorded = sorted({e["seed"] for e in entries})
        else:  # the units' length, and those a seq_len schedule served them at
            recorded = sorted({length for e in entries for length in _lengths(e)} - {None})
        if recorded and given not in recorded:
            raise OptionsError(
                f"{key}={given} was given, but the run's history records {key} {recorded}; leave it out "
                "(the history holds it) or give the run's"
            )


def run_exclusions(data: Any, exclude: Exclusions | Sequence[Exclusions] | None) -> list[Exclusions]:
    """The run's exclusions: those given, else a mixture config's ``exclude:``, else none."""
    if exclude is not None:
        return listed(exclude)
    if isinstance(data, (str, Path)) and _is_config(data):
        from streampack.loader.mixconfig import mixture_exclusions

        return mixture_exclusions(data)
    return []


def _lengths(entry: Mapping[str, Any]) -> list[int | None]:
    """The sequence lengths a history entry's leg read: its units', and those it served them at."""
    served = entry.get("served") or {}
    schedule = served.get("schedule") or []
    return [entry["data"].get("seq_len"), served.get("seq_len"), *(length for _, length in schedule)]


def leg_loaders(
    entries: Sequence[Mapping[str, Any]],
    data: Any,
    exclude: Sequence[Exclusions] = (),
    final: Sequence[Mapping[str, Any]] = (),
    *,
    order: Mapping[str, Any] | None = None,
) -> list[Loader]:
    """The loader each history entry describes, each after the first resumed from the previous one's order
    at its position, as the run resumed (what :func:`audit` recomputes the run with), with the exclusions
    in force in its leg (:func:`~streampack.loader.auditexclusions.in_force`; ``final``: the state's).
    ``order`` is the state's: what a Follow run read (its eras), to audit it from a cache directory.

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
            # Resumed as the run resumed, from the previous leg's order (the first leg: its own), with every
            # exclusion in force in this leg as the run recorded it: at its position, its steps counted
            # through the history up to here, as the run counted them.
            state = {
                "format": LOADER_FORMAT,
                "version": LOADER_VERSION,
                "position": position,
                "order": (loaders[-1] if loaders else loader).order.fingerprint(),
                "history": [dict(earlier) for earlier in entries[: i + 1]],
            }
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
    from streampack.order import Ordered
    from streampack.order.blockshuffle import BlockShuffle
    from streampack.order.mixture import Mixture

    shuffle = entry["shuffle"]
    shuffle = BlockShuffle(**shuffle) if isinstance(shuffle, Mapping) else shuffle
    batch = int(entry["batch_size"])
    if isinstance(data, (str, Path)) and _is_config(data):
        from streampack.loader.mixconfig import load_mixture

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
        stages = [(int(first) * block, dict(counts)) for first, counts in entry["schedule"]]
        mixture = Mixture(
            dict(sources),
            stages=stages,
            seed=int(entry["seed"]),
            shuffle=shuffle,
            block_size=block,
            stop=entry.get("stop", "never") if "sources" in entry else getattr(base, "stop", "never"),
        )
        return Loader(
            mixture,
            batch_size=batch,
            exclude=exclude,
            output=_output(exclude),
            seq_len_schedule=_schedule(entry),
        )
    if entry["kind"] == "follow":  # the build it followed (see _followed) grows with its own order
        return Loader(copy.copy(data), batch_size=batch, exclude=exclude, output=_output(exclude))
    if isinstance(data, Ordered):
        raise OptionsError(
            f"the run read one dataset (an order of kind {entry['kind']!r}): give its cache, not a mixture"
        )
    if isinstance(data, (str, Path)):
        data = _samples(str(data), entry["data"])
    return Loader(
        data,
        batch_size=batch,
        seed=int(entry["seed"]),
        shuffle=shuffle,
        epochs=entry.get("epochs"),
        exclude=exclude,
        output=_output(exclude),
        seq_len_schedule=_schedule(entry),
    )


def _followed(data: Any, order: Mapping[str, Any] | None) -> Any:
    """The build a Follow run read, as its audit reads it: a fresh
    :class:`~streampack.loader.follow.GrowingCache` of the cache at the path given (with the settings the
    run's ``order`` fingerprint names: samples, seed, eras), or of the one a Follow (or GrowingCache) given
    reads. It goes on with epochs after the eras: the history does not record ``then=``, and a leg that
    ended served no position past them.

    Raises:
        OptionsError: ``data`` is neither a path (with ``order``) nor a Follow.
    """
    from streampack.loader.follow import FollowOptions, GrowingCache

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


def _output(exclude: list[Exclusions]) -> str:
    """The output a loader with these exclusions serves in the audit: mask mode needs labels to mask."""
    return "dict" if any(entry.mode == "mask" for entry in exclude) else "numpy"


def _schedule(entry: Mapping[str, Any]) -> list[list[int]] | None:
    """The lengths a leg served its units at (a seq_len schedule, or a resume at another seq_len; the
    units are the entry's data): what the leg's loader is made with, so that it checks they fit."""
    served, unit = entry.get("served"), entry["data"].get("seq_len")
    if served is None:
        return None
    schedule = served["schedule"] if served["schedule"] is not None else [[0, int(served["seq_len"])]]
    # A leg that joined units (resumed at a multiple of their length) served the same units; the loader
    # that ran it checked its lengths, and a loader made afresh takes only lengths that divide them.
    divides = isinstance(unit, int) and all(unit % length == 0 for _, length in schedule)
    return schedule if divides else None


def _is_config(data: str | Path) -> bool:
    return Path(data).suffix in {".yaml", ".yml", ".json"} and Path(data).is_file()


def _samples(path: str, described: Mapping[str, Any]) -> Any:
    """The samples of the cache at ``path`` that the history describes (layout, seq_len, overlap)."""
    from streampack.reader import open as open_cache

    layout, seq_len = described.get("layout"), described.get("seq_len")
    if seq_len is None or layout not in ("windows", "packed", "documents"):
        raise OptionsError(
            f"the run read samples of layout {layout!r} (not a cache's): give those samples to "
            "streampack.loader.audit.audit(state, samples), not a path"
        )
    cache = open_cache(path)
    if layout == "windows":
        return cache.sequences(int(seq_len), overlap=int(described.get("overlap", 0)))
    return getattr(cache, layout)(int(seq_len))


def _width(entry: Mapping[str, Any], loader: Loader) -> int:
    """Tokens one sample gives the model: its ``seq_len`` (the width of samples that are not a cache's)."""
    seq_len = entry["data"].get("seq_len")
    return int(seq_len) if seq_len is not None else loader.width


# --------------------------------------------------------------------------------------- steps, ends


def _ends(
    entries: Sequence[Mapping[str, Any]], steps: list[int], final: int, loaders: list[Loader]
) -> list[int]:
    """Where the model stopped training each leg: the next resume's step says how many batches it
    trained (its data state may say otherwise), up to the run's end (its last full batch, with
    ``drop_last``); the last leg ends at the state's position."""
    ends = []
    for i, entry in enumerate(entries):
        start = int(entry["position"])
        if i + 1 == len(entries):
            end = final
        elif entries[i + 1]["step"] is not None:
            end = start + max(0, steps[i + 1] - steps[i]) * stride(entry)
        else:
            end = int(entries[i + 1]["position"])
        limit = loaders[i].order.end
        if limit is not None and entry.get("drop_last", True):  # its partial last batch is not served
            batch = int(entry["batch_size"])
            limit = start + max(0, limit - start) // batch * batch
        ends.append(max(start, end if limit is None else min(end, limit)))
    return ends

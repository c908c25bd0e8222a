"""A loader's run from its start or last resume: what it reads, in which order, under which exclusions.

A :class:`Run` is one immutable value, made by :func:`started` or :func:`resumed`. The loader swaps its run
whole, so a change that is refused leaves the loader as it was. An exclusion in force is an :data:`Entry`
``(exclusions, at, steps)``: the position it takes effect at, and where the trainer's steps are.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streampack._checks import is_int
from streampack.errors import LoaderStateError, OptionsError
from streampack.loader.batches import Batches
from streampack.loader.collate import CausalLMDict, Format, format_for
from streampack.loader.domains import Domains, domains_for
from streampack.loader.excluding import (
    Masking,
    Skipping,
    excluded_documents,
    excluded_samples,
    merged,
    reached,
    sample_keys,
)
from streampack.loader.exclusions import Exclusions, check_prefix, counted, entry_state
from streampack.loader.growing import Growing
from streampack.loader.history import StepCount, history_entry
from streampack.loader.options import LoaderOptions, check_dtype, unknown_keyword, with_keywords
from streampack.loader.reading import DataSource, Rows, Source, vocab_size_of
from streampack.loader.seqlen import SeqLenSchedule
from streampack.loader.served import Served, own_order
from streampack.loader.state import read_loader_state, resume
from streampack.order import MAX_POSITION, Order, Ordered

__all__ = ["Entry", "Found", "Run", "listed", "regrained", "resumed", "started"]

Entry = tuple[Exclusions, int, StepCount]
#: Per process, the documents each exclusion names (by its digest), by source id: found once.
Found = dict[str, dict[int, np.ndarray]]

_OPTION_NAMES = {f.name for f in dataclasses.fields(LoaderOptions)}


@dataclass(frozen=True, eq=False)
class Run:
    """What a loader reads and in which order, from its start or last resume on (see the module)."""

    options: LoaderOptions
    rows: Rows  # the sources read: the checkpoint's units, after a resume at another seq_len
    formatter: Format
    served: Served | None  # the units served at other lengths (a seq_len schedule); None: as they are
    configured: Order  # what every checkpoint resumes: the order given, or made of the options
    order: Order  # the order served: ``configured`` as resumed, under the skip exclusions in force
    masking: Masking | None = None
    exclusions: tuple[Exclusions, ...] = ()  # given, in the order of the run
    in_force: tuple[Entry, ...] = ()
    history: tuple[dict[str, Any], ...] = ()
    batches_per_step: int = 1  # the trainer's gradient accumulation, which the adapters set
    found: Found = field(default_factory=dict)  # a cache, shared by the runs that follow
    grows: bool = False  # the source grows while it is read (streampack.loader.growing)
    domains: Domains | None = None  # the per-source keys of its dicts (a mixture's)
    own: bool = False  # the order is the loader's own, made of the options

    @property
    def base(self) -> Order:
        """The order under the skip exclusions: ``configured`` as the last resume continued it."""
        order = self.order
        while isinstance(order, Skipping):
            order = order.base
        return order

    @functools.cached_property
    def batches(self) -> Batches:
        """Where the batches of the order served are."""
        costs = self.rows.costs if self.options.balance == "attention" else None
        return Batches(self.options, self.order, costs)

    @functools.cached_property
    def out_dtype(self) -> np.dtype:
        """The dtype of the token arrays served."""
        return np.dtype(self.options.dtype or self.rows.dtype)

    def counting(self, history: Sequence[Mapping[str, Any]] | None = None) -> StepCount:
        """Where the trainer's steps are for an exclusion put in force now, through ``history`` (default:
        the run's)."""
        *earlier, current = (self.history if history is None else history) or [{"position": 0, "step": None}]
        leg = {**current, "batch_size": self.options.batch_size, "batches_per_step": self.batches_per_step}
        return StepCount.of_history([*earlier, leg])

    def enforced(self, entries: Sequence[Entry]) -> Run:
        """This run with ``entries`` in force over its base order.

        Raises:
            OptionsError: their positions go back, mask mode has no labels to mask, or a skip exclusion
                is given over a source that grows (what it takes out lies ahead, not committed yet).
        """
        skips = any(entry.mode == "skip" for entry, _, _ in entries)
        if self.grows and skips:
            raise OptionsError(
                "Exclusions(mode='skip') are not supported over a source that grows (a Follow, or a mixture "
                "with one): the samples they pass over lie ahead, where the build has not committed them "
                "yet; use mode='mask' (labels=-100 on the excluded tokens, output='dict')"
            )
        ats = [at for _, at, _ in entries]
        if ats != sorted(ats):
            raise OptionsError(
                f"exclusions take effect at positions {ats}: each must be at or after the one before (they "
                "are given in the order of the run)"
            )
        masks = any(entry.mode == "mask" for entry, _, _ in entries)
        if masks and not isinstance(self.formatter, CausalLMDict):
            raise OptionsError(
                "Exclusions(mode='mask') sets labels=-100 on excluded tokens, and "
                f"output={self.options.output!r} has no labels; use output='dict' (or 'varlen', 'hf-flash'), "
                "or mode='skip'"
            )
        order, masking = layered(self.base, entries, [s.data for s in self.rows.sources], self.found)
        return dataclasses.replace(self, order=order, masking=masking, in_force=tuple(entries))

    def entry(self, position: int, step: int | None) -> dict[str, Any]:
        """This run's history entry from ``position`` on (see :mod:`streampack.loader.history`)."""
        sources = self.rows.sources
        return history_entry(
            position, self.base, self.configured, self.options, sources[0].fingerprint if sources else {},
            step=step, batches_per_step=self.batches_per_step, exclusions=self.exclusions_state() or None,
            served=None if self.served is None else self.served.entry(),
        )  # fmt: skip

    def exclusions_state(self) -> list[dict[str, Any]]:
        """The exclusions in force, as a state records them (see :mod:`streampack.loader.exclusions`)."""
        return [entry_state(entry, at, steps) for entry, at, steps in self.in_force]


def started(
    what: str,
    source: DataSource | Mapping[str, DataSource] | Ordered | Growing,
    order: Order | None,
    options: LoaderOptions | None,
    keywords: Mapping[str, Any],
    exclude: Exclusions | Sequence[Exclusions] | None,
) -> Run:
    """The run of a loader made of these, at position 0 (see :class:`~streampack.loader.Loader`'s arguments).

    Raises:
        TypeError: ``source`` cannot be indexed by an array; a keyword names no option; ``exclude`` holds
            something else than :class:`~streampack.loader.exclusions.Exclusions`.
        OptionsError: an option is out of range; the dataset holds less than one global batch; ``dtype``
            cannot hold the cache's ids; an order or a mixture is given with ``seed``, ``shuffle`` or
            ``epochs``; the order does not name the sources given; the seq_len schedule or the exclusions
            do not fit the sources.
    """
    unknown = sorted(set(keywords) - _OPTION_NAMES)
    if unknown:
        raise unknown_keyword(what, unknown[0], sorted(_OPTION_NAMES))
    # seed=None and shuffle=None say "not given": the defaults, or an order's own.
    keywords = {k: v for k, v in keywords.items() if v is not None or k not in ("seed", "shuffle")}
    parts, order, named = _sources_and_order(source, order)
    if order is not None:
        _refuse_order_options(order, {k: keywords.get(k) for k in ("seed", "shuffle", "epochs")})
    opts = with_keywords(LoaderOptions, options, keywords)
    if order is not None and len(order.names) != len(parts):
        raise OptionsError(
            f"the order reads {len(order.names)} sources ({', '.join(order.names)}), the Loader was "
            "given one; give a dict of name -> source, one per name of the order"
        )
    sources = [Source(part) for part in parts]
    own = order is None
    order = own_order(opts, sources[0]) if order is None else order
    check_dtype(opts, [s.dtype for s in sources], [vocab_size_of(s.data) for s in sources])
    grows = isinstance(source, Growing)
    domains = domains_for(opts.loss_weights, order.names, named=named, output=opts.output)
    formatter = format_for(
        opts.output, [s.data for s in sources], (opts.cp_size, opts.cp_rank), domains=domains
    )
    schedule, served = SeqLenSchedule.of(opts.seq_len_schedule), None
    if schedule is not None and grows:
        raise OptionsError(
            "seq_len_schedule is not supported over a source that grows (Follow); read the finished cache"
        )
    if schedule is not None:
        served = Served(sources, default=None, schedule=schedule, output=opts.output, domains=domains)
    _check_balance(opts, sources, served)
    run = Run(opts, Rows(sources), formatter, served, order, order, grows=grows, own=own, domains=domains)
    exclusions = listed(exclude)
    if exclusions:  # their ranges are checked once the position is known: at the first batch, or a resume
        placed_ = [placed(e, e.at or 0, run.counting()) for e in exclusions]
        run = dataclasses.replace(run.enforced(placed_), exclusions=tuple(exclusions))
    return dataclasses.replace(run, history=(run.entry(0, None),))


def resumed(run: Run, state: Mapping[str, Any], step: int | None) -> tuple[int, Run]:
    """Where ``state`` resumes ``run``, and the run from there (its history one entry longer).

    A checkpoint whose units are windows of another length becomes the run's sources (:func:`regrained`).
    The exclusions the state had in force must be the first ones the run was given; the others are put in
    force at the resume's position.

    Raises:
        LoaderStateError: (a ``ValueError``) not a state this run continues, or its exclusions are not a
            prefix of the run's.
        OptionsError: an exclusion does not fit, or ``drop_last=False`` would give some rank an empty last
            batch from there.
    """
    run = regrained(run, state) or run
    datasets = [s.data for s in run.rows.sources]
    position, order = resume(state, run.configured, datasets)  # the state read strictly
    recorded: list[Mapping[str, Any]] = list(state.get("exclusions", ()))
    check_prefix(recorded, run.exclusions)
    earlier = tuple(dict(entry) for entry in read_loader_state(state).get("history", []))
    kept = [(run.exclusions[i], int(e["at"]), counted(e, earlier)) for i, e in enumerate(recorded)]
    if any(entry.mode == "skip" and at < position for entry, at, _ in kept):
        whole = resume({**state, "position": MAX_POSITION}, run.configured, datasets)[1]
        cursor = reached(layered(whole, kept, datasets, run.found)[0], position)  # under every skip layer
        order = resume({**state, "position": cursor}, run.configured, datasets)[1]
    counting = run.counting([*earlier, {"position": position, "step": step}])  # this leg begins here
    added = [placed(entry, position, counting) for entry in run.exclusions[len(kept) :]]
    reaching(added)
    run = dataclasses.replace(run, order=order).enforced([*kept, *added])
    run.batches.check_last_batch(position)
    return position, dataclasses.replace(run, history=(*earlier, run.entry(position, step)))


def regrained(run: Run, state: Mapping[str, Any]) -> Run | None:
    """What ``run`` of one cache becomes to resume ``state``, whose units are windows of another length;
    None when the state's units are the run's (or not windows at all).

    The run then reads the checkpoint's units in the checkpoint's order, each served as sub-windows (or
    joins) of its own lengths, and its ``batch_size`` becomes the units of a global batch: the same tokens
    a step. Only a run whose order the loader made itself (``own``) does.

    Raises:
        LoaderStateError: the lengths do not divide the saved one, or a batch is not whole units; a length
            joins units with an overlap, or in ``output="numpy"`` (no labels mask the joins).
    """
    sources, served, options = run.rows.sources, run.served, run.options
    saved = read_loader_state(state).get("order")
    if len(sources) != 1 or not run.own or not isinstance(saved, Mapping):
        return None
    data = saved.get("data") or {}
    unit = data.get("seq_len") if isinstance(data, Mapping) else None
    if saved.get("kind") not in ("shuffled", "blocks") or not is_int(unit) or "layout" in data:
        return None  # not windows of one source
    current = served.unit if served is not None else getattr(sources[0].data, "seq_len", None)
    if current is None or unit == current:
        return None
    from streampack.samples.lengths import at_seq_len, windows_of

    part = windows_of(sources[0].data, "resuming at another seq_len")
    default = served.default if served is not None else part.seq_len
    schedule = served.schedule if served is not None else None
    lengths = [default, *(schedule.lengths if schedule is not None else [])]
    fits = [unit % length == 0 or length % unit == 0 for length in lengths]
    if not all(fits):
        raise LoaderStateError(
            f"the checkpoint's samples are windows of {unit} tokens, this loader serves seq_len "
            f"{', '.join(map(str, dict.fromkeys(lengths)))}: a run changes its length at a resume exactly "
            f"only to a length that divides the checkpoint's ({unit}) or is a multiple of it; resume with "
            f"cache.sequences({unit}) and a seq_len_schedule, or with such a seq_len"
        )
    longest = max(lengths)
    joins = f"resuming windows of {unit} tokens at seq_len {longest} joins {longest // unit} of them a row"
    if longest > unit and part.overlap:
        raise LoaderStateError(
            f"{joins}, and with overlap={part.overlap} the last input token of each joined window would get "
            "the next window's first token as its target (text from elsewhere in the corpus), not its own "
            f"next token. Resume at seq_len {unit} or a length that divides it (joins need a run without "
            "overlap, read with output='dict', whose labels mask each join)"
        )
    if longest > unit and options.output == "numpy":
        raise LoaderStateError(
            f"{joins}, and output='numpy' has no labels to mask the joins: x, y = row[:-1], row[1:] would "
            "train the last token of each joined window on the next window's first token (text from "
            "elsewhere in the corpus). Use output='dict' (each join a segment start, label -100), or resume "
            f"at seq_len {unit} or a length that divides it"
        )
    if longest > unit and not options.drop_last:
        raise LoaderStateError(
            f"{joins}, which the partial last batch of drop_last=False cannot always do; use drop_last=True"
        )
    tokens = options.batch_size * default
    if tokens % unit or (tokens // unit) % options.world_size:
        raise LoaderStateError(
            f"batch_size={options.batch_size} rows of seq_len {default} are {tokens} tokens, not whole "
            f"windows of the checkpoint's {unit} tokens for each of the {options.world_size} ranks; use a "
            f"batch_size that is a multiple of {max(1, unit // default) * options.world_size}"
        )
    per_rank = tokens // unit // options.world_size
    for length in lengths:
        if length > unit and per_rank % (length // unit):
            raise LoaderStateError(
                f"batch_size={options.batch_size} rows of seq_len {default} give each rank {per_rank} "
                f"windows of the checkpoint's {unit} tokens, which seq_len {length} cannot join "
                f"{length // unit} at a time; use a batch_size that makes them a multiple"
            )
    units = Source(at_seq_len(part, unit))
    options = dataclasses.replace(options, batch_size=tokens // unit)
    order = own_order(options, units)
    served = Served([units], default=default, schedule=schedule, output=options.output, joins=True)
    formatter = format_for(options.output, [units.data], (options.cp_size, options.cp_rank))
    _check_balance(options, [units], served)
    return dataclasses.replace(
        run, options=options, rows=Rows([units]), formatter=formatter, served=served, configured=order,
        order=order,
    )  # fmt: skip


def listed(exclude: Exclusions | Sequence[Exclusions] | None) -> list[Exclusions]:
    """``exclude=`` as a list of exclusions, checked."""
    entries = [] if exclude is None else [exclude] if isinstance(exclude, Exclusions) else list(exclude)
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
    """Refuse an entry with a range of steps or positions wholly before where it takes effect: it could
    never take anything out."""
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
    order, masks = base, []
    names = list(base.names)
    for entry, at, steps in entries:
        docs = found.get(entry.digest)
        if docs is None:
            docs = found[entry.digest] = excluded_documents(entry, names, datasets)
        ranges = tuple(np.array(merged(entry.ranges(steps)), dtype=np.int64).reshape(-1, 2).T.copy())
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


def _sources_and_order(
    source: DataSource | Mapping[str, DataSource] | Ordered | Growing, order: Order | None
) -> tuple[list[DataSource], Order | None, bool]:
    """The sources a Loader reads, the order given with them (None: the Loader makes one), and whether
    they are named (a mixture, or a dict of sources)."""
    if isinstance(source, Growing):  # what it holds now, in the order that grows with it
        if order is not None:
            raise OptionsError(
                f"a {type(source).__name__} grows with its own order; give it without order=..."
            )
        view = source.view()  # one source, or several by name (a mixture with a source that grows)
        named = isinstance(view, Mapping)
        return (list(view.values()) if named else [view]), source.order, named
    if isinstance(source, Ordered):  # a Mixture: its sources, and itself their order
        if order is not None:
            raise OptionsError(
                f"a {type(source).__name__} reads its sources in its own order; give it, or its sources with "
                "order=..., not both"
            )
        sources, order = source.sources_and_order()
        return list(sources.values()), order, True
    if isinstance(source, Mapping):
        if order is None:
            raise OptionsError(
                f"several sources ({', '.join(map(str, source))}) are read in an order: pass order=..., or "
                "a streampack.order.mixture.Mixture of them"
            )
        if tuple(source) != tuple(order.names):
            raise OptionsError(
                f"the sources must be named as the order names them, in its order: {list(order.names)} "
                f"(got {list(source)})"
            )
        return list(source.values()), order, True
    return [source], order, False


def _check_balance(options: LoaderOptions, sources: list[Source], served: Served | None) -> None:
    """Refuse ``balance="attention"`` over sources without document boundaries, or with a seq_len schedule."""
    if options.balance != "attention":
        return
    for source in sources:
        if not hasattr(source.data, "boundaries"):
            raise OptionsError(
                f"balance='attention' weighs each row by its documents' lengths, which "
                f"{type(source.data).__name__} does not provide (no boundaries() method); read samples of a "
                "cache (cache.packed(...)), or use balance='rows'"
            )
    if served is not None:
        raise OptionsError(
            "balance='attention' is not supported with a seq_len_schedule (it serves sub-windows of fixed "
            "windows, whose rows cost the same); use balance='rows'"
        )


def _refuse_order_options(order: Order, given: Mapping[str, object]) -> None:
    """An order given sets seed, shuffle and end itself: refuse the options of a single dataset's order."""
    kind = type(order).__name__
    for name, value in given.items():
        if value is not None:
            where = f"{kind}(..., {name}=...)"
            if name == "epochs":
                where = "the order's own end, e.g. Mixture(stop='first_exhausted') or Shuffled(n, epochs=...)"
            raise OptionsError(
                f"{name}= sets the order of a single dataset; {kind} is an order of its own: use {where} "
                f"(got {name}={value!r})"
            )

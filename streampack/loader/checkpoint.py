"""What a :class:`~streampack.loader.Loader` saves and resumes from: its state dict (position, the order's
fingerprint, the run's history, the exclusions in force) and :meth:`Checkpointed.load_state_dict`, the base
the Loader is made on, as it is on :class:`~streampack.loader.steps.Steps`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from streampack._checks import check_int
from streampack.errors import OptionsError
from streampack.loader import inforce
from streampack.loader.collate import format_for
from streampack.loader.exclusions import Exclusions, entry_state
from streampack.loader.history import StepCount, history_entry
from streampack.loader.options import check_last_batch
from streampack.loader.reading import Rows
from streampack.loader.served import regrained
from streampack.loader.state import read_loader_state, resume, saved
from streampack.loader.steps import Steps
from streampack.order import Order

if TYPE_CHECKING:
    from streampack.loader.collate import Format
    from streampack.loader.excluding import Masking
    from streampack.loader.reading import Source
    from streampack.loader.served import Served

__all__ = ["Checkpointed"]


class Checkpointed(Steps):
    """The state of a loader's run, saved and resumed; its history; the exclusions in force.

    Set by the :class:`~streampack.loader.Loader`: what it reads (``sources``, ``formatter``, ``_rows``),
    the order it was configured with and the base order the exclusions filter.
    """

    _ahead_checked = True  # the run from the position on was checked (see _check_ahead)
    # No exclusions, no history: what a loader unpickled from an earlier version holds.
    _exclude_given: Sequence[Exclusions] = ()
    _in_force: Sequence[inforce.Entry] = ()
    _masking: Masking | None = None
    _history: tuple[dict[str, Any], ...] = ()
    _served: Served | None = None  # no seq_len schedule (streampack.loader.served)
    _own_order = False  # whether the loader made its order from its options
    _batches_per_step = 1

    dataset: Any
    formatter: Format
    _rows: Rows
    _base: Order
    _configured: Order
    _excluded_docs: inforce.Found

    @property
    def batches_per_step(self) -> int:
        """Global batches the trainer takes per step (its gradient accumulation; default 1), which the
        framework adapters set. It is recorded in the history entry of the stretch of the run now being
        read, so that an audit counts the trainer's steps, and it places the steps of the exclusions put
        in force in this stretch (``Exclusions(steps=...)``: the trainer's steps).

        Raises:
            OptionsError: (when set) not an integer >= 1; or batches were served past where an exclusion
                took effect whose steps it moves (set it before the first batch), or it moves them wholly
                before that position.
        """
        return self._batches_per_step

    @batches_per_step.setter
    def batches_per_step(self, value: int) -> None:
        value = check_int("batches_per_step", value, min=1, hint="the trainer's gradient accumulation steps")
        before = self._batches_per_step
        self._batches_per_step = value
        try:
            self._recount()
        except BaseException:
            self._batches_per_step = before
            raise

    def _counting(self, history: Sequence[Mapping[str, Any]] | None = None) -> StepCount:
        """Where the trainer's steps are for an exclusion put in force now: through ``history`` (default:
        the run's), its last entry the current leg, at this loader's ``batch_size * batches_per_step`` (no
        history yet, a loader being made: from step 0 at position 0)."""
        *earlier, current = (self._history if history is None else history) or [{"position": 0, "step": None}]
        leg = {**current, "batch_size": self.options.batch_size, "batches_per_step": self.batches_per_step}
        return StepCount.of_history([*earlier, leg])

    def _recount(self) -> None:
        """Count again the steps of the exclusions put in force in the current leg (``batches_per_step``
        was set), check them, and put them in force so where that moves them."""
        legs, counting = len(self._history) or 1, self._counting()
        entries = list(self._in_force)
        current = [i for i, (e, _, steps) in enumerate(entries) if steps.through == legs and e.step_ranges()]
        for i in current:
            entries[i] = (entries[i][0], entries[i][1], counting)
        moved = [
            i
            for i in current
            if entries[i][0].ranges(counting) != self._in_force[i][0].ranges(self._in_force[i][2])
        ]
        for i in moved:
            entry, at, _ = entries[i]
            if at < self._position:
                raise OptionsError(
                    f"batches_per_step={self.batches_per_step} moves the trainer's steps of exclusion {i} "
                    f"(steps {entry.step_ranges()}), in force from position {at:,}, and the loader has "
                    f"served batches up to position {self._position:,} with them where they were: set "
                    "batches_per_step before the first batch (the framework adapters do)"
                )
        # An entry that takes effect past the position of a loader not yet resumed (the checkpoint's own,
        # given again with at=) is counted again by the resume, and checked there.
        inforce.reaching([entries[i] for i in current if entries[i][1] <= self._position])
        if moved:
            self._enforce(entries)

    @property
    def serves_sub_windows(self) -> bool:
        """Whether batches may be served at lengths other than the units' (a ``seq_len_schedule``, or a
        resume at another ``seq_len``): their shape then follows the length (:meth:`batch_shape`)."""
        return self._served is not None

    @property
    def sources(self) -> list[Source]:
        """The sources read, in source-id order."""
        return self._rows.sources

    def state_dict(self) -> dict[str, Any]:
        """The position, the order's fingerprint and the run's :attr:`history` as a small
        JSON-serializable dict (:func:`streampack.loader.state.saved`); another batch size or world size
        may load it. With exclusions in force it also holds :meth:`exclusions_state`."""
        history = list(self._history)
        if history:  # how this stretch is trained is known by now (an adapter set it)
            history[-1] = history[-1] | {"batches_per_step": int(self.batches_per_step)}
        state = saved(self._position, self._base, self.options, history)
        if self._in_force:
            state["exclusions"] = self.exclusions_state()
        return state

    @property
    def epoch(self) -> int:
        """Epoch of the dataset that the next batch starts in (one dataset only). Under skip exclusions it
        is the epoch of the order they filter: the samples they took out count in it.

        Raises:
            TypeError: the order reads a mixture, whose sources each run through their own epochs (see
                :meth:`realised`).
        """
        size = self.order.epoch_size("epoch")
        if not any(entry.mode == "skip" for entry, _, _ in self._in_force):
            return self._position // size
        from streampack.loader.excluding import unfiltered

        return unfiltered(self.order, self._position) // size

    @property
    def history(self) -> list[dict[str, Any]]:
        """The run's history: one entry for its start and one per resume, each saying how the run was
        read from its position on (:func:`~streampack.loader.history.history_entry`). :meth:`state_dict`
        carries it, so the last checkpoint of a run is enough to audit it
        (:func:`streampack.loader.audit.audit`)."""
        return [dict(entry) for entry in self._history]

    def _entry(self, position: int, step: int | None) -> dict[str, Any]:
        """This loader's history entry at ``position``, with the exclusions in force."""
        data = self.sources[0].fingerprint if self.sources else {}
        return history_entry(
            position, self._base, self._configured, self.options, data, step=step,
            batches_per_step=self.batches_per_step, exclusions=self.exclusions_state() or None,
            served=None if self._served is None else self._served.entry(),
        )  # fmt: skip

    def exclusions_state(self) -> list[dict[str, Any]]:
        """The exclusions in force, as the state records them: per exclusion its digest, mode, the
        position it took effect at, the history entries its steps were counted through and how much it
        names (:func:`~streampack.loader.exclusions.entry_state`); small and JSON-able."""
        return [entry_state(entry, at, steps) for entry, at, steps in self._in_force]

    def exclude(self, entry: Exclusions) -> None:
        """Take what ``entry`` names out of the run from its ``at`` (default: the current position) on.

        Raises:
            OptionsError: ``at`` is before the current position (batches already served would change),
                a range of its steps or positions lies wholly before it, or ``entry`` does not fit the
                sources or the output (see :class:`Loader`).
        """
        added = inforce.placed(entry, self._position, self._counting())
        inforce.reaching([added])
        self._enforce([*self._in_force, added])
        self._exclude_given = [*self._exclude_given, entry]

    def load_state_dict(self, state: Mapping[str, Any], *, step: int | None = None) -> None:
        """Resume from a :meth:`state_dict`: the next batch starts where the saved run stopped.

        O(1): nothing is replayed. The world size, the DataLoader workers and the global batch size may
        differ from the saved run's, a mixture may come with new stages or sources (see
        :class:`~streampack.order.mixture.Mixture`), and a version 1 state resumes at the same place of
        the same epoch. What follows depends on the state and this loader's dataset only.

        Raises:
            LoaderStateError: (a ``ValueError``) not a state this loader continues: of no supported
                version, a key too many or missing, a value of the wrong type, or another seed, shuffle
                or data (both sides named; see :func:`streampack.loader.state.resume`).
            OptionsError: ``drop_last=False`` would give some rank an empty last batch from there.

        The state's :attr:`history` is kept, with an entry for this resume appended; ``step`` is the
        trainer's own step at this resume (the model checkpoint's, which the framework adapters pass),
        so that an audit can tell a data state and a model checkpoint of different steps apart.
        """
        if step is not None:
            step = check_int("step", step, min=0, max=2**62, hint="the trainer's step at this resume")
        before = self._take_over(state)
        try:
            self._resume(state, step)
        except BaseException:
            self.__dict__.update(before)  # as it was: the units it read, its order and options
            raise

    def _take_over(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Read the units of ``state`` when they are windows of another length that this loader's lengths
        divide (:func:`~streampack.loader.served.regrained`); what it held before, to undo it."""
        keys = ("options", "_rows", "formatter", "order", "_base", "_configured", "_served", "_in_force")
        before = {key: self.__dict__[key] for key in keys if key in self.__dict__}
        parts = regrained(state, self.sources, self.options, self._served, self._own_order)
        if parts is not None:
            self.options, self._rows, self._served = parts.options, Rows(parts.sources), parts.served
            self.formatter = format_for(self.options.output, [source.data for source in parts.sources])
            self.order = self._base = self._configured = parts.order
        return before

    def _resume(self, state: Mapping[str, Any], step: int | None) -> None:
        datasets = [source.data for source in self.sources]
        position, order = resume(state, self._configured, datasets)  # the state read strictly
        order, kept = inforce.resumed(
            state, position, order, self._configured, datasets, self._exclude_given, self._excluded_docs
        )
        earlier = [dict(entry) for entry in read_loader_state(state).get("history", [])]
        counting = self._counting([*earlier, {"position": position, "step": step}])  # this leg begins here
        added = [inforce.placed(entry, position, counting) for entry in self._exclude_given[len(kept) :]]
        inforce.reaching(added)
        filtered, masking = self._checked(order, kept + added)
        check_last_batch(self.options, filtered.end, position)  # before anything changes
        if self.dataset is self._base:  # a dataset that is its own order (a Mixture) follows it
            self.dataset = order
        if self._reach is not None:  # a growing source grows with the order resumed
            self._reach.resumed(order)
        self._base, self._position = order, position
        self.order, self._masking, self._in_force = filtered, masking, kept + added
        self._rows.forget()
        self._history = (*earlier, self._entry(position, step))

    def _enforce(self, entries: list[inforce.Entry]) -> None:
        """Put ``entries`` in force over the base order (see :meth:`_checked`)."""
        self.order, self._masking = self._checked(self._base, entries)
        self._in_force = list(entries)
        self._ahead_checked = False
        self._rows.forget()

    def _check_ahead(self) -> None:
        """Before a batch is served (once, until a resume or an exclusion changes the run): refuse a last
        batch that leaves a rank none, and an exclusion that takes effect from here on whose steps or
        positions all lie before that. A loader made to resume a checkpoint is judged from the
        checkpoint's position, with the steps counted through its history, not from position 0.

        Raises:
            OptionsError: either; the message names the numbers and the fixes.
        """
        self._check_last_batch()
        inforce.reaching([entry for entry in self._in_force if entry[1] >= self._position])
        self._ahead_checked = True

    def _checked(self, base: Order, entries: list[inforce.Entry]) -> tuple[Order, Masking | None]:
        """``base`` filtered by ``entries`` and their masking (:func:`streampack.loader.inforce.checked`).

        Raises:
            OptionsError: they do not fit, or a skip exclusion is given over a source that grows (what it
                takes out lies ahead, in samples the build has not committed yet).
        """
        if self._reach is not None and any(entry.mode == "skip" for entry, _, _ in entries):
            raise OptionsError(
                "Exclusions(mode='skip') are not supported over a source that grows (a Follow, or a mixture "
                "with one): the samples they pass over lie ahead, where the build has not committed them "
                "yet; use mode='mask' (labels=-100 on the excluded tokens, output='dict')"
            )
        datasets = [source.data for source in self.sources]
        formatter, output = self.formatter, self.options.output
        return inforce.checked(base, entries, datasets, self._excluded_docs, formatter, output)

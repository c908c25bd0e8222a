"""Where a loader's batches are: the arithmetic of global positions, batches, ranks and the run's end.

The global batch at position ``p`` is positions ``[p, p + B)``, ``B`` the *global* batch size. A run that
ends (``epochs``, or a mixture that stops) ends with one partial global batch, dropped (``drop_last``) or
split as evenly as possible over the ranks. Rank ``r`` of ``W`` takes the contiguous ``r``-th slice of
each global batch: ``B / W`` positions of a full one, ``rows // W`` or one more of the partial one. Ranks
only slice global batches and DataLoader workers only take every n-th of them (:meth:`Steps.schedule`),
so none of this depends on the world size, the workers or the batch size a run started with: a run may
resume with others.

:class:`Steps` is that arithmetic over a loader's options, order and position, and the questions about
the run it answers (``len()``, epochs, what each source has served); the
:class:`~streampack.loader.Loader` is made of it. Over a source that grows
(:mod:`streampack.loader.growing`), a question about a batch first waits until the source knows it.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from streampack._checks import check_int
from streampack.loader.growing import Reach
from streampack.loader.options import LoaderOptions, SourceShare, check_last_batch, shares
from streampack.order import MAX_POSITION, Order

__all__ = ["Steps"]


class Steps:
    """The batches of a run through an order, by global position (see the module docstring).

    What it reads is set by the :class:`~streampack.loader.Loader`: its options, its order, its position
    and its reach into a growing source (None: the source is whole).
    """

    options: LoaderOptions
    order: Order
    _position: int
    _reach: Reach | None

    @property
    def num_samples(self) -> int:
        """Samples per epoch of the dataset (of all sources together, for a mixture; of those known so
        far, for a source that grows)."""
        return sum(self.order.sizes())

    @property
    def position(self) -> int:
        """Global position of the next batch: samples consumed since the run started, over all ranks."""
        return self._position

    @property
    def epoch(self) -> int:
        """Epoch of the dataset that the next batch starts in (one dataset only).

        Raises:
            TypeError: the order reads a mixture, whose sources each run through their own epochs (see
                :meth:`realised`).
        """
        return self._position // self.order.epoch_size("epoch")

    @property
    def steps_per_epoch(self) -> int:
        """Global batches in one epoch: ``N // B``, or ``ceil(N / B)`` with ``drop_last=False``.

        Batches run on across epochs, so ``E`` epochs give ``len(loader)`` batches, up to ``E - 1`` more
        than ``E * steps_per_epoch``.

        Raises:
            TypeError: the order reads a mixture, which has no single epoch.
        """
        n, batch = self.order.epoch_size("steps_per_epoch"), self.options.batch_size
        return n // batch if self.options.drop_last else -(-n // batch)

    def __len__(self) -> int:
        """Global batches of the whole run, the same on every rank (for LR schedules and progress bars).

        Counted from position 0 at this batch size: ``end // B``, or ``ceil(end / B)`` with
        ``drop_last=False``, where ``end`` is ``epochs * N`` (or where a stopping mixture ends). It is not
        the number of batches still to come.

        Raises:
            TypeError: the run is endless (``epochs=None``, or a mixture that never stops).
        """
        return self.order.batches(self.options.batch_size, self.options.drop_last)

    @property
    def finished(self) -> bool:
        """True once the run has ended: no batch is left at the current position."""
        return self._global_rows(self._position) == 0

    def schedule(self, start: int | None = None) -> Iterator[int]:
        """The position of every batch still to come, without changing the state.

        DataLoader workers use it to take every n-th batch (:mod:`streampack.torch`).

        Args:
            start: the position to start from instead of the current one.
        """
        position = self._position if start is None else start
        while rows := self._global_rows(position):
            yield position
            position += rows

    def advance(self, batches: int = 1) -> None:
        """Move the position forward by ``batches`` steps, as if that many batches had been consumed."""
        check_int("batches", batches, min=0, max=2**62)
        batch = self.options.batch_size
        if self._reach is not None:  # a run that ends must know where, to stop there
            self._reach.grow(min(self._position + batches * batch, MAX_POSITION), self._check_last_batch)
        end = self.order.end
        full = batches if end is None else min(batches, max(0, end - self._position) // batch)
        self._position = min(self._position + full * batch, MAX_POSITION)
        if batches > full:  # past the last full batch: the partial one, when it is served
            self._position += self._global_rows(self._position)

    def realised(self, steps: int = 0) -> list[SourceShare]:
        """Per source: samples served, realised share and epoch, ``steps`` batches after the position.

        Computed from the order alone (nothing is read), so a plan far ahead is as cheap as now.

        Args:
            steps: batches to look ahead at this batch size; 0 reports the current position.
        """
        check_int("steps", steps, min=0, max=2**62)
        position = min(self._position + steps * self.options.batch_size, MAX_POSITION)
        if self.order.end is not None:
            position = min(position, self.order.end)
        return shares(self.order, position)

    def _global_rows(self, position: int) -> int:
        """Rows of the global batch at ``position``: ``B``, fewer for the last of a run, 0 past it (once
        a growing source knows the batch's samples: it may wait for them)."""
        batch = self.options.batch_size
        reach = self._reach
        if reach is not None and position + batch > reach.known:  # wait for a growing source
            reach.grow(min(position + batch, MAX_POSITION), self._check_last_batch)
        end = self.order.end
        end = MAX_POSITION if end is None else end
        if end - position >= batch:
            return batch
        if self.options.drop_last or position >= end:
            return 0
        return end - position

    def _span(self, position: int) -> tuple[int, int]:
        """This rank's slice ``[lo, hi)`` of the positions of the global batch at ``position``."""
        opts = self.options
        size = self._global_rows(position)
        return (
            position + opts.rank * size // opts.world_size,
            position + (opts.rank + 1) * size // opts.world_size,
        )

    def served(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Source ids and sample ids served at the global positions ``[start, stop)``, over all ranks: what
        the batches covering them serve, asked as a batch asks them (``int64``).

        An audit recomputes a run through it (:mod:`streampack.loader.audit`), so whatever decides what a
        position serves is audited as it serves.
        """
        return self.order(np.arange(start, stop, dtype=np.int64))

    def _unplanned_picks(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """The order's picks for this rank's rows of the batch at ``position``, asked on their own."""
        return self.served(*self._span(position))

    def _picks_ahead(self, at: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The picks of the batch at ``at``; None, without waiting, if it is not known yet or past the end."""
        if self._reach is not None and not self._reach.ready(at + self.options.batch_size):
            return None
        return self._unplanned_picks(at) if self._global_rows(at) else None

    def _view_behind(self, position: int) -> bool:
        """Whether the batch at ``position`` needs a newer view of the growing source than the one opened
        last; it first waits until the source knows the batch's samples."""
        reach = self._reach
        if reach is None or position + self.options.batch_size <= reach.readable:
            return False
        self._global_rows(position)  # waits for the source to hold the batch's samples
        return reach.readable < reach.known

    def _planned_end(self) -> int | None:
        """Where planning ahead stops: the run's end, or what a growing source knows so far."""
        return self.order.end if self._reach is None else self._reach.end(self.order.end)

    def _check_last_batch(self) -> None:
        """Refuse ``drop_last=False`` when the run's last batch cannot give every rank a row (see
        :func:`~streampack.loader.options.check_last_batch`)."""
        check_last_batch(self.options, self.order.end, self._position)

    def _missing(self, position: int) -> IndexError:
        """The error for a batch asked at ``position``, where none starts."""
        return IndexError(
            f"no batch at position {position}: positions start at 0 and the run ends at {self.order.end}"
            + (" (drop_last drops a partial last batch)" if self.options.drop_last else "")
        )

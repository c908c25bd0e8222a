"""Where a run's batches are: the arithmetic of global positions, batches, ranks and the run's end.

The global batch at position ``p`` is positions ``[p, p + B)``, ``B`` the *global* batch size; a run that
ends has one partial last batch, dropped (``drop_last``) or split over the ranks. Rank ``r`` takes the
``r``-th slice of each global batch, or with ``balance="attention"`` rows assigned by attention cost
(:mod:`streampack.loader.parallel`). Nothing depends on the world size, the workers or the batch size a
run started with, so a run may resume with others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from streampack.errors import OptionsError
from streampack.loader.options import LoaderOptions, SourceShare
from streampack.order import MAX_POSITION, Order

__all__ = ["Batches"]


@dataclass(frozen=True)
class Batches:
    """The global batches of a run through ``order`` with ``options``, by position; a pure value.

    ``costs``, given a global batch's picks, says each row's attention cost, by which the rows are spread
    over the ranks (``balance="attention"``); None: contiguous slices.
    """

    options: LoaderOptions
    order: Order
    costs: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None

    def rows(self, position: int) -> int:
        """Rows of the global batch at ``position``: ``B``, fewer for the last of a run, 0 past it."""
        batch, end = self.options.batch_size, self.order.end
        end = MAX_POSITION if end is None else end
        if end - position >= batch:
            return batch
        if self.options.drop_last or position >= end:
            return 0
        return end - position

    def span(self, position: int) -> tuple[int, int]:
        """This rank's slice ``[lo, hi)`` of the global batch at ``position`` (balanced: as many rows)."""
        o, size = self.options, self.rows(position)
        return position + o.rank * size // o.world_size, position + (o.rank + 1) * size // o.world_size

    def ranks(self, sources: np.ndarray, samples: np.ndarray) -> np.ndarray:
        """The rank that serves each row of a global batch of these picks (in position order)."""
        n, world = len(samples), self.options.world_size
        if self.costs is None:
            return np.searchsorted(np.arange(world + 1) * n // world, np.arange(n), side="right") - 1
        from streampack.loader.parallel import balanced_ranks

        return balanced_ranks(self.costs(sources, samples), world)

    def positions(self, position: int) -> np.ndarray:
        """The positions of this rank's rows of the global batch at ``position``, ascending."""
        if self.costs is None:
            return np.arange(*self.span(position), dtype=np.int64)
        ranks = self.ranks(*self.served(position, position + self.rows(position)))
        return position + np.flatnonzero(ranks == self.options.rank)

    def advanced(self, position: int, batches: int) -> int:
        """The position ``batches`` batches after ``position`` (the partial last one counted, if served)."""
        batch, end = self.options.batch_size, self.order.end
        full = batches if end is None else min(batches, max(0, end - position) // batch)
        position = min(position + full * batch, MAX_POSITION)
        return position + self.rows(position) if batches > full else position

    def count(self) -> int:
        """Global batches of the whole run from position 0 (``len()`` of a loader).

        Raises:
            TypeError: the run is endless.
        """
        return self.order.batches(self.options.batch_size, self.options.drop_last)

    def steps_per_epoch(self) -> int:
        """Global batches in one epoch: ``N // B``, or ``ceil(N / B)`` with ``drop_last=False``.

        Raises:
            TypeError: the order reads a mixture, which has no single epoch.
        """
        n, batch = self.order.epoch_size("steps_per_epoch"), self.options.batch_size
        return n // batch if self.options.drop_last else -(-n // batch)

    def epoch(self, position: int) -> int:
        """The epoch ``position`` is in; under skip exclusions, the epoch of the order they filter.

        Raises:
            TypeError: the order reads a mixture, whose sources each run through their own epochs.
        """
        size = self.order.epoch_size("epoch")
        from streampack.loader.excluding import unfiltered

        return unfiltered(self.order, position) // size

    def realised(self, position: int) -> list[SourceShare]:
        """Per source: samples served, realised share and epoch at ``position`` (capped at the end)."""
        order = self.order
        position = position if order.end is None else min(position, order.end)
        served, weights = order.consumed(position), order.weights(position)
        sizes = [max(size, 1) for size in order.sizes()]  # a growing source may know none yet
        return [
            SourceShare(name, weight, count, count / position if position else 0.0, size, count / size)
            for name, weight, count, size in zip(order.names, weights, served, sizes, strict=True)
        ]

    def served(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Source ids and sample ids (``int64``) the order serves at positions ``[start, stop)``."""
        return self.order(np.arange(start, stop, dtype=np.int64))

    def picks(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's picks of the batch at ``position``, asked of the order on their own (unplanned)."""
        if self.costs is None:
            return self.served(*self.span(position))
        sources, samples = self.served(position, position + self.rows(position))
        mine = self.ranks(sources, samples) == self.options.rank
        return sources[mine], samples[mine]

    def check_last_batch(self, position: int) -> None:
        """Refuse ``drop_last=False`` when the run's last partial global batch cannot give every rank a row.

        A rank's 0-row batch has a NaN mean loss, which DDP's all-reduce spreads to every rank. It is refused
        rather than padded with repeated samples, so every served row stays a distinct sample.
        """
        opts, end = self.options, self.order.end
        if opts.drop_last or end is None or end <= position:
            return
        left = end - position
        remainder = left % opts.batch_size
        if not 0 < remainder < opts.world_size:
            return
        plural = "s" if remainder > 1 else ""
        fixes = []
        if left >= opts.batch_size:
            fixes.append(f"drop_last=True (the run then skips its last {remainder} sample{plural})")
        other = _batch_size_for_ranks(left, opts.batch_size, opts.world_size)
        if other is not None:
            fixes.append(f"batch_size={other} (it leaves 0 or at least {opts.world_size} samples over)")
        fixes.append("fewer ranks, or more samples (a larger cache or a smaller seq_len)")
        raise OptionsError(
            f"drop_last=False would give {opts.world_size - remainder} of the {opts.world_size} ranks an "
            f"empty last batch: the {left} samples left in global batches of batch_size={opts.batch_size} "
            f"leave {left} mod {opts.batch_size} = {remainder} sample{plural} for the last one, fewer than "
            f"world_size={opts.world_size}. A mean loss over 0 rows is NaN, and DDP spreads it to every "
            f"rank. Use {', or '.join(fixes)}."
        )

    def missing(self, position: int) -> IndexError:
        """The error for a batch asked at ``position``, where none starts."""
        return IndexError(
            f"no batch at position {position}: positions start at 0 and the run ends at {self.order.end}"
            + (" (drop_last drops a partial last batch)" if self.options.drop_last else "")
        )


def _batch_size_for_ranks(n: int, batch_size: int, world_size: int) -> int | None:
    """The multiple of ``world_size`` nearest ``batch_size`` whose last global batch has a row per rank."""
    for k in range(1, 1000):
        for candidate in (batch_size - k * world_size, batch_size + k * world_size):
            if 0 < candidate <= n and (n % candidate == 0 or n % candidate >= world_size):
                return candidate
    return None

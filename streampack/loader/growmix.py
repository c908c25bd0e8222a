"""A mixture with a source that grows: finished caches and a cache whose build runs, mixed by weight.

A :class:`~streampack.order.mixture.Mixture` may hold a source that grows while it is read (a
:class:`~streampack.loader.follow.GrowingCache`, which a :class:`~streampack.loader.follow.Follow` reads).
The mixture's order is unchanged: source ``j``'s cursor at position ``p`` is a pure function of the
schedule, and the growing source maps its cursors to samples with its follow order. What a loader needs
is when a position can be served: :class:`GrowingMixture` is that mixture as a source that grows
(:class:`~streampack.loader.growing.Growing`), which a :class:`~streampack.Loader` given such a mixture
reads through (:func:`growing_mixture`).

* **known**: the positions ``[0, P)`` whose every cursor of a growing source is known to it:
  ``consumed(P)[j] <= known_j`` for each growing source ``j`` (cursors rise with the position, so the
  largest such ``P`` is found by bisection).
* **grow**: each growing source grows until it knows the cursors of positions ``[0, stop)``:
  ``consumed(stop)[j]``.
* **view**: every source as committed now, by name.

So every process computes the same batches from the same schedule and builds, whenever it reads the
ledgers: ranks, DataLoader workers and checkpoints work as for any mixture, and a checkpoint's schedule
(with new weights or sources) is the order it grows with after a resume.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from streampack.loader.growing import Growing
from streampack.order import MAX_POSITION
from streampack.order.mixture import Mixture, growing_sources, with_sources

__all__ = ["GrowingMixture", "growing_mixture"]


def growing_mixture(source: Any) -> Any:
    """``source``, or a :class:`GrowingMixture` of it when it is a Mixture with a source that grows."""
    if isinstance(source, Mixture) and growing_sources(source):
        return GrowingMixture(source)
    return source


class GrowingMixture:
    """A :class:`~streampack.order.mixture.Mixture` with sources that grow, as a source that grows (see
    the module docstring).

    Args:
        mixture: the mixture; its growing sources grow as this source grows.
    """

    def __init__(self, mixture: Mixture) -> None:
        self.order = mixture
        self.known = 0  # positions whose samples are known and committed

    def __repr__(self) -> str:
        return f"GrowingMixture({self.order!r}, known={self.known})"

    def __getstate__(self) -> dict[str, Any]:
        """A copy grows on its own: its own copies of the growing sources, in a mixture that reads them."""
        growing = {name: copy.copy(data) for name, data in growing_sources(self.order).items()}
        return self.__dict__ | {"order": with_sources(self.order, growing)}

    @property
    def sources(self) -> dict[str, Any]:
        """The mixture's sources by name."""
        return self.order.sources

    def sources_and_order(self) -> tuple[dict[str, Any], Mixture]:
        """Its sources and its order, as a Mixture gives them."""
        return self.order.sources, self.order

    def grow(self, stop: int, check: Callable[[], None]) -> None:
        """Wait until the growing sources know the samples of positions ``[0, stop)`` (see
        :meth:`~streampack.loader.growing.Growing.grow`); ``stop=0`` takes what they know now."""
        needed = self.order.consumed(stop) if stop else [0] * len(self.order.names)
        for j, (name, data) in enumerate(self.order.sources.items()):
            if name in self._growing_names():
                data.grow(needed[j], check)
        self.known = self._known()

    def resume(self, order: Any) -> None:
        """Grow with ``order`` (the mixture a checkpoint resumed) from now on."""
        self.order = order
        self.known = self._known()

    def view(self) -> dict[str, Any]:
        """Every source as committed now, by name: the growing ones' views, the others themselves."""
        growing = self._growing_names()
        return {name: data.view() if name in growing else data for name, data in self.order.sources.items()}

    def _growing_names(self) -> set[str]:
        return set(growing_sources(self.order))

    def _known(self) -> int:
        """The largest position ``P`` whose cursors ``consumed(P)`` each growing source knows."""
        order = self.order
        sources = enumerate(order.sources.values())
        limits = [(j, data.known) for j, data in sources if isinstance(data, Growing)]
        if all(known >= MAX_POSITION for _, known in limits):
            return MAX_POSITION

        def fits(position: int) -> bool:
            served = order.consumed(position)
            return all(served[j] <= known for j, known in limits)

        if fits(MAX_POSITION):
            return MAX_POSITION
        # Whole blocks first (a block's first position needs no block table), then within the block.
        size = order.block_size
        lo, hi = 0, MAX_POSITION // size  # fits(lo * size); the answer is below hi * size
        while hi - lo > 1:
            middle = (lo + hi) // 2
            lo, hi = (middle, hi) if fits(middle * size) else (lo, middle)
        lo, hi = lo * size, lo * size + size
        while hi - lo > 1:
            middle = (lo + hi) // 2
            lo, hi = (middle, hi) if fits(middle) else (lo, middle)
        return lo

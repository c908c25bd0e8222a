"""Sources that grow while a loader reads them: the protocol a :class:`~streampack.loader.Loader` asks.

A source that grows (:class:`~streampack.follow.GrowingCache`) comes with the order of its samples. It
answers how many positions are **known**, can **grow** until a batch's positions are known, and gives a
**view**, the source as committed now, which the loader reopens when it knows more. ``Loader(growing)`` is
an ordinary loader with a :class:`Reach` (how far it has read). :class:`GrowingMixture` is a Mixture with
a growing source, known up to the first position one of those sources does not know the cursor of.
"""

from __future__ import annotations

import bisect
import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from streampack.order import MAX_POSITION, Order, Ordered

if TYPE_CHECKING:
    from streampack.order.mixture import Mixture

__all__ = ["Growing", "GrowingMixture", "Reach", "growing_mixture"]


@runtime_checkable
class Growing(Protocol):
    """A source that grows while it is read, with the order that serves its samples (see the module)."""

    @property
    def order(self) -> Order:
        """The order of its samples; it knows its ``end`` once the source is complete."""
        ...

    @property
    def known(self) -> int:
        """Positions whose samples are known and committed (``MAX_POSITION`` once it is complete)."""
        ...

    def grow(self, stop: int, check: Callable[[], None]) -> None:
        """Wait until the samples of positions ``[0, stop)`` are known, or the source is complete
        (``stop=0``: take what is known now). ``check`` is called once the order knows its end; what it
        raises is raised, and the end is taken back."""
        ...

    def view(self) -> Any:
        """The source as committed now: a :class:`~streampack.loader.DataSource`, or a dict of them."""
        ...

    def resume(self, order: Any) -> None:
        """Grow with ``order`` (what a checkpoint resumed) from now on."""
        ...


class Reach:
    """How far a loader reads a growing ``source``: the positions it knows, and those its view can read."""

    def __init__(self, source: Growing) -> None:
        self.source = source
        self.known = 0  # positions whose samples are known and committed
        self.readable = 0  # positions the view opened last holds

    def __getstate__(self) -> dict[str, Any]:
        """A copy grows on its own copy of the source, which it reopens before its first read."""
        return self.__dict__ | {"source": copy.copy(self.source), "readable": -1}

    def grow(self, stop: int, check: Callable[[], None]) -> None:
        """Wait until the source knows the samples of positions ``[0, stop)`` (see :meth:`Growing.grow`)."""
        if stop and stop <= self.known:
            return
        try:
            self.source.grow(stop, check)
        finally:
            self.known = self.source.known

    def resumed(self, order: Order) -> None:
        """The loader goes on from a checkpoint in ``order``: the source grows with it, and a new order
        has what is known asked again and the view opened anew."""
        before = self.source.order
        self.source.resume(order)
        if self.source.order is not before:
            self.known, self.readable = self.source.known, 0

    def ready(self, stop: int) -> bool:
        """Whether positions ``[0, stop)`` can be read now, without waiting or reopening."""
        return stop <= min(self.known, self.readable)

    def end(self, end: int | None) -> int | None:
        """Where planning ahead stops: the run's ``end``, or what is known so far."""
        return self.known if end is None else min(end, self.known)


def growing_mixture(source: Any) -> Any:
    """``source``, or a :class:`GrowingMixture` of it when it is a Mixture with a source that grows."""
    if not isinstance(source, Ordered):  # a Mixture is Ordered; a trainer without one never imports it
        return source
    from streampack.order.mixture import Mixture, growing_sources

    if isinstance(source, Mixture) and growing_sources(source):
        return GrowingMixture(source)
    return source


class GrowingMixture:
    """A :class:`~streampack.order.mixture.Mixture` with sources that grow, as a source that grows."""

    def __init__(self, mixture: Mixture) -> None:
        self.order = mixture
        self.known = 0  # positions whose samples are known and committed

    def __repr__(self) -> str:
        return f"GrowingMixture({self.order!r}, known={self.known})"

    def __getstate__(self) -> dict[str, Any]:
        """A copy grows on its own: its own copies of the growing sources, in a mixture that reads them."""
        from streampack.order.mixture import growing_sources, with_sources

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
        """Wait until the growing sources know the samples of positions ``[0, stop)``."""
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
        from streampack.order.mixture import growing_sources

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
        # The last position that fits: whole blocks first (a block's first position needs no block
        # table), then within the block.
        size = order.block_size
        block = bisect.bisect_left(range(1, MAX_POSITION // size), True, key=lambda b: not fits(b * size))
        return block * size + bisect.bisect_left(
            range(1, size), True, key=lambda k: not fits(block * size + k)
        )

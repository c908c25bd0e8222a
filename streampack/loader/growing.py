"""Sources that grow while a loader reads them: the protocol a :class:`~streampack.loader.Loader` asks.

Most sources are whole when a loader opens them. One that grows (the committed part of a cache whose
build is running, :class:`~streampack.loader.follow.GrowingCache`) comes with the order of its samples,
which learns its positions as the source grows, and answers three questions:

* **known**: how many positions have samples that are known and committed. The loader serves those at
  once, and asks for more only when a batch reaches past them (one comparison per batch).
* **grow**: wait until the positions of a batch are known, or the source is complete, when the order
  learns where the stream ends. The loader then checks that end (its last batch must give every rank a
  row) before it is accepted.
* **view**: the source as committed now, which the loader reads from. The loader reopens it when it
  knows more positions than the view it holds can read.

So growing is a property of the source and its order, not of the loader: ``Loader(growing)`` is an
ordinary loader, whose ranks, workers, state and adapters work as for any other. It keeps its
:class:`Reach` (how far it has read) beside the source.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from streampack.order import Order

__all__ = ["Growing", "Reach"]


@runtime_checkable
class Growing(Protocol):
    """A source that grows while it is read, with the order that serves its samples (see the module)."""

    @property
    def order(self) -> Order:
        """The order of its samples; it knows its :attr:`~streampack.order.Order.end` once the source
        is complete."""
        ...

    @property
    def known(self) -> int:
        """Positions whose samples are known and committed: every position
        (:data:`~streampack.order.MAX_POSITION`) once the source is complete."""
        ...

    def grow(self, stop: int, check: Callable[[], None]) -> None:
        """Wait until the samples of positions ``[0, stop)`` are known, or the source is complete.

        ``stop=0`` takes what is known now without waiting.

        Args:
            stop: the first position not needed.
            check: called once the source is complete and the order knows its end, before that is
                accepted; what it raises is raised, and the end is taken back (to be checked again at the
                next call).
        """
        ...

    def view(self) -> Any:
        """The source as committed now (a :class:`~streampack.loader.DataSource`, or a dict of name ->
        source for an order of several): it holds the samples of every position known."""
        ...

    def resume(self, order: Any) -> None:
        """The loader goes on from a checkpoint in ``order`` (what its order's ``resumed`` gave): the
        source grows with that order from now on."""
        ...


class Reach:
    """How far a loader reads a growing source: the positions whose samples it knows, and those the view
    it opened last can read (it reopens the source when it knows more).

    Args:
        source: the growing source.
    """

    def __init__(self, source: Growing) -> None:
        self.source = source
        self.known = 0  # positions whose samples are known and committed
        self.readable = 0  # positions the view opened last holds

    def __getstate__(self) -> dict[str, Any]:
        """A copy grows on its own: its own copy of the source (and so of its order), which it reopens
        (grown since) before its first read."""
        return self.__dict__ | {"source": copy.copy(self.source), "readable": -1}

    def copied(self, dataset: object) -> dict[str, Any]:
        """What a copy of a loader over this source holds in place of the original's: its own copy of
        this reach, and so of the source and its order (which it resumes against), and its dataset (the
        source's copy, when the loader was given the source itself)."""
        reach = copy.copy(self)
        order = reach.source.order
        mine = reach.source if dataset is self.source else dataset
        return {"_reach": reach, "order": order, "_configured": order, "dataset": mine}

    def grow(self, stop: int, check: Callable[[], None]) -> None:
        """Wait until the source knows the samples of positions ``[0, stop)``, or is complete (see
        :meth:`Growing.grow`); ``stop=0`` takes what it knows now."""
        if stop and stop <= self.known:
            return
        try:
            self.source.grow(stop, check)
        finally:
            self.known = self.source.known

    def resumed(self, order: Order) -> None:
        """The loader goes on from a checkpoint in ``order``: the source grows with it. A new order (a
        mixture's, with the schedule of the checkpoint) maps positions to other samples: what is known is
        asked again, and the next batch reads a view opened anew."""
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

"""The order of a cache whose build is running: its windows in eras, each shuffled once committed.

The finished cache's windows are cut into **eras** ``[W_e, W_{e+1})`` whose sizes double from ``first``
up to ``largest`` (:class:`Eras`). Position ``p`` of era ``e`` is window ``W_e + Permutation(size_e, seed,
epoch=e)(p - W_e)``. Then come epochs of the finished cache (``then="epochs"``) or the end. Whole-document
layouts count eras in documents, and learn each era's samples from its plan (:meth:`FollowOrder.learn`).

The order reads nothing: :class:`streampack.follow.GrowingCache` tells it how much is committed
(:attr:`FollowOrder.known`) and, at the end, how many windows there are (:meth:`FollowOrder.finish`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from streampack._checks import check_int
from streampack.errors import LoaderStateError
from streampack.order import OneSource, Shuffled, check_same, count_batches, groups, kept
from streampack.order.permutation import Permutation

__all__ = ["Eras", "FollowOrder"]


@dataclass(frozen=True)
class Eras:
    """Era boundaries, in windows: sizes ``first, 2 * first, ...`` up to ``largest``, then ``largest`` each.

    Args:
        first: windows of era 0.
        largest: the size eras grow to.
    """

    first: int = 1024
    largest: int = 65536

    def __post_init__(self) -> None:
        # Python ints: numpy integers would not serialize as JSON.
        object.__setattr__(self, "first", check_int("first_era", self.first, min=1, max=2**40))
        largest = check_int("largest_era", self.largest, min=self.first, max=2**40, hint="at least first_era")
        object.__setattr__(self, "largest", largest)

    @functools.cached_property
    def _doubling(self) -> np.ndarray:
        """``W_0 .. W_k``: where each era starts, up to the first one of size ``largest``."""
        k = max(0, (-(-self.largest // self.first) - 1).bit_length())
        return self.first * (np.int64(1) << np.arange(k + 1, dtype=np.int64)) - self.first

    def start(self, era: int) -> int:
        """``W_era``: the first window of ``era``."""
        table = self._doubling
        if era < len(table):
            return int(table[era])
        return int(table[-1]) + (era - len(table) + 1) * self.largest

    def of(self, windows: np.ndarray) -> np.ndarray:
        """The era of each window (``int64``)."""
        table = self._doubling
        last = int(table[-1])
        return np.where(
            windows < last,
            np.searchsorted(table, windows, side="right") - 1,
            len(table) - 1 + (windows - last) // self.largest,
        )

    def covered(self, windows: int) -> int:
        """Windows of the eras wholly within the first ``windows``: where the era holding that one starts."""
        return self.start(int(self.of(np.array([windows], dtype=np.int64))[0]))


class FollowOrder(OneSource):
    """The order of a :class:`~streampack.follow.Follow` (see the module docstring): pure given the build.

    Args:
        seed: shuffle seed.
        eras: the era sizes.
        then: ``"end"`` after the last era, or ``"epochs"`` of the finished cache.
        data: what identifies the samples (the build and the layout's settings), for checkpoints.
        by: what the eras count: ``"windows"``, or ``"documents"`` for whole-document layouts, whose
            eras' sizes in samples are learnt from their plans (:meth:`learn`).
    """

    resumes: tuple[str, ...] = ("follow",)
    #: Whole-document layouts: the first sample of each era planned, then the end of the last; None: windows.
    bounds: list[int] | None = None

    def __init__(
        self,
        *,
        seed: int,
        eras: Eras,
        then: Literal["end", "epochs"],
        data: Mapping[str, Any],
        by: Literal["windows", "documents"] = "windows",
    ) -> None:
        super().__init__(0, seed=seed, epochs=None, data=data, name="data")
        self.eras, self.then = eras, then
        self.bounds = [0] if by == "documents" else None
        self.total: int | None = None  # windows of the finished cache, once the build is complete
        self.known = 0  # windows of the eras known to be committed
        self._permutations: dict[int, Callable[[np.ndarray], np.ndarray]] = {}
        self._epochs = Shuffled(1)  # then="epochs": the Loader's order of the finished cache

    def __repr__(self) -> str:
        return f"FollowOrder(seed={self.seed}, {self.eras}, then={self.then!r}, total={self.total})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_permutations": {}}

    def learn(self, samples: int) -> None:
        """Take note that the next era's plan holds ``samples`` samples (whole-document layouts)."""
        assert self.bounds is not None
        self.bounds = [*self.bounds, self.bounds[-1] + samples]  # a new list: a prefetch thread may read it
        self.known = self.bounds[-1]

    def finish(self, total: int | None) -> None:
        """The build is complete and its cache holds ``total`` windows (``None``: take that back)."""
        self.total = total
        self.known = total if total is not None else self.known
        self._permutations = {}  # the last era's may have been made at its full size
        self._epochs = Shuffled(max(total or 0, 1), seed=self.seed)

    @property
    def end(self) -> int | None:
        """The last window's position with ``then="end"`` once the build is complete; else ``None``."""
        return self.total if self.then == "end" else None

    def samples(self, positions: np.ndarray) -> np.ndarray:
        """The windows at ``positions`` (in eras known to be committed, or anywhere once complete)."""
        total = self.total
        if total is not None and len(positions) and positions.max() >= total:
            out = np.empty_like(positions)
            late = positions >= total
            out[late] = self._epochs.samples(positions[late] - total)
            out[~late] = self.samples(positions[~late])
            return out
        out = np.empty_like(positions)
        bounds = self.bounds
        if bounds is not None:  # eras of documents: where each starts in samples is learnt
            # side="right" skips eras without samples: the last era starting at or before the position.
            of = np.searchsorted(np.asarray(bounds, dtype=np.int64), positions, side="right") - 1
        else:
            of = self.eras.of(positions)
        for era, rows in groups(of):
            first = self._start(era, bounds)
            out[rows] = first + self._permutation(era)(positions[rows] - first)
        return out

    def _start(self, era: int, bounds: list[int] | None) -> int:
        return self.eras.start(era) if bounds is None else bounds[era]

    def _permutation(self, era: int) -> Callable[[np.ndarray], np.ndarray]:
        permutation = self._permutations.get(era)
        if permutation is None:
            bounds = self.bounds
            first, stop = self._start(era, bounds), self._start(era + 1, bounds)
            size = stop - first if self.total is None else min(stop, self.total) - first
            permutation = Permutation(size, seed=self.seed, epoch=era)
            self._permutations = kept(self._permutations, era, permutation)
        return permutation

    def sizes(self) -> list[int]:
        """Windows of the finished cache; while it builds, those of the eras known to be committed."""
        return [self.known]

    def epoch_size(self, what: str) -> int:
        """Windows of the finished cache, once the build is complete.

        Raises:
            TypeError: the build is still running.
        """
        if self.total is None:
            raise TypeError(
                f"{what} is not known while the build runs: the number of samples is known once it is "
                "complete"
            )
        return self.total

    def batches(self, batch_size: int, drop_last: bool) -> int:
        """Global batches of the one pass over the finished cache (``then="end"``).

        Raises:
            TypeError: ``then="epochs"`` (endless), or the build is still running.
        """
        if self.then == "epochs":
            raise TypeError(
                "a Follow with then='epochs' goes on with epochs of the finished cache endlessly: it has no "
                "len(); use then='end' for one pass over every sample, or count steps yourself (max_steps)"
            )
        if self.end is None:
            raise TypeError(
                "a Follow has no len() while the build runs: the number of samples is known once it is "
                "complete; count steps yourself (max_steps)"
            )
        return count_batches(self.end, batch_size, drop_last)

    def fingerprint(self) -> dict[str, Any]:
        """Kind, seed, era sizes and the data's identity; ``then`` only decides what follows the eras."""
        return {
            "kind": "follow",
            "seed": self.seed,
            "eras": [self.eras.first, self.eras.largest],
            "data": self.data,
        }

    def resumed(self, saved: Mapping[str, Any], position: int) -> FollowOrder:
        """This order, once the checkpoint is checked to be a ``Follow``'s of the same build and settings."""
        if saved.get("kind") != "follow":
            raise LoaderStateError(
                f"the checkpoint was saved by a loader over a {saved.get('kind')!r} order, not by a Follow; "
                "a Follow resumes its own states (with then='epochs' it goes on past the build by itself)"
            )
        check_same(saved, self.fingerprint(), ("seed", "eras", "data"))
        return self

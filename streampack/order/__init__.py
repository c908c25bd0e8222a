"""Orders: which sample each global position of a run reads, as a pure function shared by every process.

A *global position* counts the samples consumed since the run started, summed over all ranks. An
:class:`Order` maps positions to ``(source, sample)`` pairs and holds no state, so a checkpoint is one
integer plus the order's fingerprint. The orders: :class:`Shuffled`,
:class:`~streampack.order.blockshuffle.BlockShuffled` (locality-aware for remote caches),
:class:`~streampack.order.mixture.Mixture` (several sources by weight) and
:class:`~streampack.follow.order.FollowOrder` (a cache whose build is running). A Mixture also holds its
sources (:class:`Ordered`), so ``Loader(mixture)`` reads them in its order.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from streampack.errors import LoaderStateError
from streampack.order.permutation import Permutation

__all__ = [
    "MAX_POSITION",
    "OneSource",
    "Order",
    "Ordered",
    "Permutation",
    "Shuffled",
    "count_batches",
    "data_fingerprint",
    "groups",
]

# Below this many distinct small keys, grouping scans once per key rather than sorting.
_SCANNED_KEYS = 9
# Datasets up to this many samples keep each epoch's order as an int32 table.
_TABLE_MAX = 1 << 14

MAX_POSITION = 2**62
"""A run may read up to this many samples: a position plus a batch always fits in ``int64``."""


class Order(Protocol):
    """A pure map from global positions to samples, shared by every rank and worker of a run.

    Deterministic in any process and on any machine, picklable, and cheap on thousands of positions.
    """

    names: tuple[str, ...]
    """One name per source; source ids index this tuple."""

    resumes: tuple[str, ...]
    """The kinds of saved order (``fingerprint()["kind"]``) that :meth:`resumed` continues."""

    @property
    def end(self) -> int | None:
        """The first position past the stream, or ``None`` for an endless one."""
        ...

    def __call__(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ``(source ids, sample ids)`` at ``positions`` (1-D ``int64``, below :attr:`end`)."""
        ...

    def consumed(self, position: int) -> list[int]:
        """Each source's cursor at ``position``: the samples it has served."""
        ...

    def sizes(self) -> list[int]:
        """Samples in one epoch of each source (so far, for a source that grows)."""
        ...

    def weights(self, position: int) -> list[float]:
        """Each source's share of the stream at ``position``."""
        ...

    def epoch_size(self, what: str) -> int:
        """Samples per epoch of the one source this order reads epoch after epoch.

        Args:
            what: what needs it (``"epoch"``, ``"steps_per_epoch"``), for the message.

        Raises:
            TypeError: the order has no single epoch (a mixture), or does not know it yet (a running build).
        """
        ...

    def batches(self, batch_size: int, drop_last: bool) -> int:
        """Global batches in the whole stream (a loader's ``len()``); see :func:`count_batches`.

        Raises:
            TypeError: the stream is endless, or its end is not known yet.
        """
        ...

    def fingerprint(self) -> dict[str, Any]:
        """What the positions mean, JSON-able: a checkpoint stores it next to its position."""
        ...

    def resumed(self, saved: Mapping[str, Any], position: int) -> Order:
        """This order, continued from a checkpoint's ``saved`` fingerprint at ``position``.

        A ``saved`` of one of streampack's kinds was already read strictly
        (:func:`streampack.loader.state.read_order`); an order of another kind checks its own here.

        Raises:
            LoaderStateError: the checkpoint's positions mean other samples here (other data or seed), or
                it is of a kind this order does not continue.
        """
        ...


@runtime_checkable
class Ordered(Protocol):
    """Sources that come with their order, such as a :class:`~streampack.order.mixture.Mixture`.

    ``Loader(ordered)`` reads them as ``Loader(sources, order=order)`` would.
    """

    def sources_and_order(self) -> tuple[Mapping[str, Any], Order]:
        """The sources by name (in source-id order) and the order that reads them."""
        ...


def count_batches(end: int | None, batch_size: int, drop_last: bool) -> int:
    """Global batches in a stream ending at ``end``; with ``drop_last`` the partial last one is not counted.

    Raises:
        TypeError: ``end`` is None: the stream is endless.
    """
    if end is None:
        raise TypeError(
            "an endless Loader has no len(): pass epochs=... (or Mixture(stop='first_exhausted')), "
            "or count steps yourself"
        )
    return end // batch_size if drop_last else -(-end // batch_size)


class OneSource:
    """The base of the orders of one source read epoch after epoch; subclasses implement :meth:`samples`."""

    def __init__(
        self, size: int, *, seed: int, epochs: int | None, data: Mapping[str, Any] | None, name: str
    ) -> None:
        self.size, self.seed, self.epochs = size, seed, epochs
        self.data = dict(data) if data is not None else {"num_samples": size}
        self.names: tuple[str, ...] = (name,)

    @property
    def end(self) -> int | None:
        """``epochs * size``, or ``None`` when endless."""
        return None if self.epochs is None else min(self.epochs * self.size, MAX_POSITION)

    def __call__(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Source ids (all 0) and sample ids at ``positions``."""
        return np.zeros(len(positions), dtype=np.int64), self.samples(positions)

    def samples(self, positions: np.ndarray) -> np.ndarray:
        """Sample ids at ``positions``."""
        raise NotImplementedError

    def consumed(self, position: int) -> list[int]:
        """``[position]``: every position is the one source's."""
        return [position]

    def sizes(self) -> list[int]:
        """``[size]``."""
        return [self.size]

    def weights(self, position: int) -> list[float]:
        """``[1.0]``."""
        return [1.0]

    def epoch_size(self, what: str) -> int:
        """``size``."""
        return self.size

    def batches(self, batch_size: int, drop_last: bool) -> int:
        """Global batches of the ``epochs`` (see :func:`count_batches`)."""
        return count_batches(self.end, batch_size, drop_last)


class Shuffled(OneSource):
    """One source read epoch after epoch: position ``p`` is sample ``Permutation(n, seed, epoch)(i)``.

    With ``epoch, i = divmod(p, n)``, every epoch visits each sample once, in a new order (stream order
    with ``shuffle=False``). Batches may straddle two epochs.

    Args:
        size: samples per epoch, ``n``.
        seed: shuffle seed.
        shuffle: a seeded random order per epoch; else stream order.
        epochs: end the stream after this many epochs; ``None`` for an endless one.
        data: the data's fingerprint, which a checkpoint is checked against.
        name: the source's name in reports.
    """

    resumes: tuple[str, ...] = ("shuffled",)

    def __init__(
        self,
        size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        epochs: int | None = None,
        data: Mapping[str, Any] | None = None,
        name: str = "data",
    ) -> None:
        super().__init__(size, seed=seed, epochs=epochs, data=data, name=name)
        self.shuffle = shuffle
        self._permutations: dict[int, Callable[[np.ndarray], np.ndarray]] = {}

    def __repr__(self) -> str:
        return f"Shuffled({self.size}, seed={self.seed}, shuffle={self.shuffle}, epochs={self.epochs})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_permutations": {}}

    def samples(self, positions: np.ndarray) -> np.ndarray:
        """Sample ids at ``positions``."""
        epochs, offsets = np.divmod(positions, self.size)
        if not self.shuffle:
            return offsets
        first = int(epochs[0]) if len(epochs) else 0
        if len(epochs) == 0 or (epochs == first).all():
            return self.permutation(first)(offsets)
        out = np.empty_like(offsets)
        for epoch, mine in groups(epochs):
            out[mine] = self.permutation(epoch)(offsets[mine])
        return out

    def permutation(self, epoch: int) -> Callable[[np.ndarray], np.ndarray]:
        """The order of ``epoch``; the last two are kept, as batches straddle at most one epoch boundary.
        A small dataset's is a table (at most 64 kB): a lookup costs less than the Feistel passes."""
        permutation = self._permutations.get(epoch)
        if permutation is None:
            feistel = Permutation(self.size, seed=self.seed, epoch=epoch)
            if self.size <= _TABLE_MAX:
                table = feistel(np.arange(self.size, dtype=np.int64)).astype(np.int32)
                permutation = functools.partial(_look_up, table)
            else:
                permutation = feistel
            self._permutations = kept(self._permutations, epoch, permutation)
        return permutation

    def fingerprint(self) -> dict[str, Any]:
        """Kind, seed, shuffle and the data's fingerprint; the number of epochs only ends the stream."""
        return {"kind": "shuffled", "seed": self.seed, "shuffle": self.shuffle, "data": dict(self.data)}

    def resumed(self, saved: Mapping[str, Any], position: int) -> Shuffled:
        """This order, once the checkpoint is checked to have the same seed, shuffle and data."""
        if saved.get("kind") == "blocks":
            block = f"BlockShuffle(block={saved.get('block')!r}, window={saved.get('window')!r})"
            raise LoaderStateError(
                f"the checkpoint was saved by a loader that block-shuffles ({block}), this loader reads in "
                f"{'a global shuffle' if self.shuffle else 'stream order'}; resume it with shuffle={block}"
            )
        if saved.get("kind") != "shuffled":
            raise LoaderStateError(
                f"the checkpoint was saved by a loader over a {saved.get('kind')!r} order, this loader reads "
                "one dataset; resume it with the same kind of loader (a Mixture can take over a "
                "single-dataset checkpoint, not the reverse)"
            )
        check_same(saved, self.fingerprint(), ("seed", "shuffle", "data"))
        return self


def _look_up(table: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    return table[offsets].astype(np.int64)


def kept(recent: dict[int, Any], key: int, value: Any, keep: int = 1) -> dict[int, Any]:
    """``recent``'s last ``keep`` entries and ``key: value``, in a new dict.

    A cache replaced whole, never changed in place: a prefetch thread may be reading the old one (evicting
    in place, two threads pop one key: a KeyError).
    """
    return {**dict(list(recent.items())[-keep:]), key: value}


def groups(keys: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """Each distinct key with the indices holding it, in O(n log n); keys in order need no sort, and a few
    small keys (a mixture's sources) one scan each: the cases the loader asks most."""
    if len(keys) == 0:
        return
    steps = np.diff(keys)
    if (steps >= 0).all():
        bounds = [0, *(np.flatnonzero(steps) + 1).tolist(), len(keys)]
        for start, stop in itertools.pairwise(bounds):
            yield int(keys[start]), np.arange(start, stop)
        return
    if keys.min() >= 0 and keys.max() < _SCANNED_KEYS:
        for key in range(int(keys.max()) + 1):
            mine = np.flatnonzero(keys == key)
            if len(mine):
                yield key, mine
        return
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    starts = np.flatnonzero(np.diff(sorted_keys, prepend=sorted_keys[:1] - 1))
    for start, stop in zip(starts.tolist(), [*starts[1:].tolist(), len(keys)], strict=True):
        yield int(sorted_keys[start]), order[start:stop]


def data_fingerprint(data: object) -> dict[str, Any]:
    """What identifies a dataset's samples: its ``fingerprint()``, else its number of samples."""
    fingerprint = getattr(data, "fingerprint", None)
    return dict(fingerprint()) if fingerprint is not None else {"num_samples": len(data)}  # type: ignore[arg-type]


def derive(seed: int, tag: str) -> int:
    """A 64-bit seed for one use (``tag``) of an order's seed."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{tag}".encode(), digest_size=8).digest(), "little")


def splitmix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's step on ``uint64`` words: a bijection whose outputs look independent (it wraps)."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def check_same(saved: Mapping[str, Any], mine: Mapping[str, Any], keys: tuple[str, ...]) -> None:
    """Refuse a checkpoint whose fingerprint differs from ``mine`` at one of ``keys``.

    Raises:
        LoaderStateError: naming the first such key and both values (see :func:`mismatch`).
    """
    for key in keys:
        if saved.get(key) != mine[key]:
            raise LoaderStateError(mismatch(key, saved.get(key), mine[key]))


def mismatch(key: str, saved: object, mine: object) -> str:
    """The message for a checkpoint whose ``key`` differs from this loader's, naming both values."""
    hint = ""
    if isinstance(saved, Mapping) and isinstance(mine, Mapping):
        if saved.get("seq_len") != mine.get("seq_len"):
            hint = (
                f" The sequence length changed ({saved.get('seq_len')} -> {mine.get('seq_len')}): positions "
                "count samples of one length. A Loader of one cache.sequences(...) that makes its own order "
                "resumes at a seq_len that divides the checkpoint's or is a multiple of it "
                "(streampack.loader.served); this order resumes only with the seq_len it was saved with."
            )
        elif saved.get("shards") != mine.get("shards") and {**saved, "shards": 0} == {**mine, "shards": 0}:
            hint = (
                f" Only the data's content digest differs (shards {saved.get('shards')} -> "
                f"{mine.get('shards')}): the cache holds as many samples and tokens, but not those the state "
                "was saved over (another cache, or files rewritten since)."
            )
    return (
        f"the loader state does not match this loader: {key} in checkpoint: {saved!r} / {key} in this "
        f"loader: {mine!r}.{hint} Create the Loader with the settings and data of the run that saved the "
        "state."
    )

"""Training while the build runs: a :class:`~streampack.Loader` over a cache whose build is still going.

A :class:`Follow` serves the samples of the *finished* cache, ``open(path).sequences(seq_len,
overlap=overlap)``, numbered in stream order (units in order, each unit's tokens in order), as soon as the
build has committed them. It serves them in **eras** of consecutive windows: era ``e`` is windows ``[W_e,
W_{e+1})``, whose sizes double from ``first_era`` up to ``largest_era`` and then stay there, and position
``p`` of era ``e`` is window ``W_e + Permutation(size_e, seed, epoch=e)(p - W_e)``. An era is served once
the ledger shows its windows committed: every unit before the one it ends in done, and that one far enough
along. The last era ends where the finished cache's windows end, known once every unit is done.

So the order is a function of the build and the settings alone, never of when the ledger was read:

* every process computes the same eras on its own, so ranks need no broadcast and DataLoader workers
  (:mod:`streampack.torch`) no coordination;
* a resumed run serves exactly the batches of the saved one, whenever it resumes: the state is the
  position and the order's fingerprint, as for any :class:`~streampack.Loader`;
* no window is served twice, and none before it is committed.

The cost is latency: an era waits for the units before it, in order, and a larger era for more of them
(the doubling keeps the wait proportional to what was served). When the ledger shows no new committed
tokens for ``timeout`` seconds while a batch waits, :class:`~streampack.errors.BuildStalledError` is raised.

After the last era, it goes on with full permutations of the finished cache (``then="epochs"``, the
default): position ``N + q``, ``N`` its number of windows, is position ``q`` of
``Loader(open(path).sequences(seq_len, overlap=overlap), seed=seed)``; or iteration **ends**
(``then="end"``: every window of the finished cache was served once, like one epoch).

A cache in object storage is read through a local copy (see :func:`streampack.open`), and the shards of
the next steps whose eras are known are prefetched, as for a Loader.

Scope: the windows layout only (not ``packed`` or ``documents``, whose samples depend on later documents),
and one cache (not a mixture).
"""

from __future__ import annotations

import copy
import functools
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from streampack import reader
from streampack._checks import check_choice, check_int
from streampack.errors import BuildStalledError, LoaderStateError, OptionsError
from streampack.format import ledger
from streampack.format.identity import build_digest
from streampack.format.manifest import Manifest
from streampack.format.names import MANIFEST, shard_name
from streampack.loader import Loader, LoaderOptions, Output, _Source, prefetch
from streampack.loader.collate import format_for
from streampack.order import MAX_POSITION, Shuffled, groups, mismatch
from streampack.order.permutation import Permutation
from streampack.samples.sequences import JoinedSequences
from streampack.store import LocalStore, open_store
from streampack.store.files import load_manifest, read_progress
from streampack.store.localcopy import cached_store
from streampack.store.remote import is_remote

__all__ = ["Eras", "Follow", "FollowOrder"]

# Units past the first unfinished one whose ledger entries are read while waiting, to tell a build that
# works on later units from a stalled one (a build runs its units roughly in order); read at most every
# _WATCH_SECONDS (and at least 8 times per timeout), the first unfinished unit's at every poll.
_WATCHED_UNITS = 32
_WATCH_SECONDS = 5.0


@dataclass(frozen=True)
class Eras:
    """Era boundaries, in windows: sizes ``first, 2 * first, 4 * first, ...`` up to ``largest``, then
    ``largest`` each.

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
        """Windows of the eras that lie wholly within the first ``windows``: where the era holding window
        ``windows`` starts."""
        return self.start(int(self.of(np.array([windows], dtype=np.int64))[0]))


class FollowOrder:
    """The order of a :class:`Follow`: eras of the finished cache's windows, then (``then="epochs"``) the
    :class:`~streampack.Loader`'s epochs of it. See the module docstring.

    Pure given the build: positions of an era whose windows are all committed map to the same windows
    before the build finishes as after. The last era's size, and the end, are known once the build is
    complete (:meth:`finish`); the :class:`Follow` asks for no position before it knows its era.

    Args:
        seed: shuffle seed.
        eras: the era sizes.
        then: ``"end"`` after the last era, or ``"epochs"`` of the finished cache.
        data: what identifies the samples (the build and the window settings), for checkpoints.
    """

    names: tuple[str, ...] = ("data",)
    resumes: tuple[str, ...] = ("follow",)

    def __init__(
        self, *, seed: int, eras: Eras, then: Literal["end", "epochs"], data: Mapping[str, Any]
    ) -> None:
        self.seed, self.eras, self.then, self.data = seed, eras, then, dict(data)
        self.total: int | None = None  # windows of the finished cache, once the build is complete
        self.known = 0  # windows of the eras known to be committed
        self._permutations: dict[int, Callable[[np.ndarray], np.ndarray]] = {}
        self._epochs = Shuffled(1)  # then="epochs": the Loader's order of the finished cache

    def __repr__(self) -> str:
        return f"FollowOrder(seed={self.seed}, {self.eras}, then={self.then!r}, total={self.total})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_permutations": {}}

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

    def __call__(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Source ids (all 0) and windows at ``positions``."""
        return np.zeros(len(positions), dtype=np.int64), self.samples(positions)

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
        for era, rows in groups(self.eras.of(positions)):
            first = self.eras.start(era)
            out[rows] = first + self._permutation(era)(positions[rows] - first)
        return out

    def _permutation(self, era: int) -> Callable[[np.ndarray], np.ndarray]:
        permutation = self._permutations.get(era)
        if permutation is None:
            first, stop = self.eras.start(era), self.eras.start(era + 1)
            size = stop - first if self.total is None else min(stop, self.total) - first
            permutation = Permutation(size, seed=self.seed, epoch=era)
            # A new dict, not an update: a loader's prefetch thread may be looking up this one.
            kept = dict(list(self._permutations.items())[-1:])
            kept[era] = permutation
            self._permutations = kept
        return permutation

    def consumed(self, position: int) -> list[int]:
        """``[position]``: one source."""
        return [position]

    def sizes(self) -> list[int]:
        """Windows of the finished cache; while it builds, those of the eras known to be committed."""
        return [max(1, self.known)]

    def fingerprint(self) -> dict[str, Any]:
        """Kind, seed, era sizes and the data's identity; ``then`` only decides what follows the eras."""
        return {
            "kind": "follow",
            "seed": self.seed,
            "eras": [self.eras.first, self.eras.largest],
            "data": self.data,
        }

    def resumed(self, saved: Mapping[str, Any], position: int) -> FollowOrder:
        """This order, after checking the checkpoint was saved by a :class:`Follow` of the same build with
        the same settings."""
        if saved.get("kind") != "follow":
            raise LoaderStateError(
                f"the checkpoint was saved by a loader over a {saved.get('kind')!r} order, not by a Follow; "
                "a Follow resumes its own states (with then='epochs' it goes on past the build by itself)"
            )
        mine = self.fingerprint()
        for key in ("seed", "eras", "data"):
            if saved.get(key) != mine[key]:
                raise LoaderStateError(mismatch(key, saved.get(key), mine[key]))
        return self


class _Ledger:
    """What a build has committed, read from its ledger: the contiguous prefix of the stream, and whether
    the build is complete. Finished units' entries are final and kept, so each read starts at the first
    unfinished unit and looks a few units further (to see that the build is working)."""

    def __init__(self, store: LocalStore, units: list[str]) -> None:
        self.store, self.units = store, units
        self.done: list[ledger.UnitProgress] = []  # the entries of the first units, all finished
        self.running: ledger.UnitProgress | None = None  # the first unfinished unit's, as last read
        self._done_tokens = 0

    def read(self) -> tuple[int, bool]:
        """``(tokens of the committed prefix, complete)``."""
        self.running = None  # until read again: a failed read leaves no entry in another unit's place
        progress = self._progress(len(self.done))
        while progress is not None and progress.done:
            self.done.append(progress)
            self._done_tokens += progress.tokens
            progress = self._progress(len(self.done))
        self.running = progress
        if progress is None:
            return self._done_tokens, True
        return self._done_tokens + progress.tokens, False

    def later(self) -> tuple[int, ...]:
        """Tokens committed by the units after the first unfinished one (up to ``_WATCHED_UNITS``)."""
        first = len(self.done) + 1
        later = [self._progress(i) for i in range(first, min(first + _WATCHED_UNITS, len(self.units)))]
        return tuple(p.tokens for p in later if p is not None)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"done": list(self.done)}  # a copy's reads must not grow this one's list

    def progress(self) -> list[ledger.UnitProgress]:
        """Every unit's entry as last read: the finished ones, the first unfinished one, none after it (the
        follower reads nothing past the prefix)."""
        first = [*self.done, *([self.running] if self.running is not None else [])]
        return first + [ledger.UnitProgress(unit=unit) for unit in self.units[len(first) :]]

    def _progress(self, unit: int) -> ledger.UnitProgress | None:
        if unit >= len(self.units):
            return None
        return read_progress(self.store, shard_name(unit), self.units[unit])


class Follow(Loader):
    """A :class:`~streampack.Loader` of a cache whose build is running: its windows, served once committed.

    Example::

        follow = Follow("cache/", seq_len=2048, overlap=1, batch_size=32, seed=1)
        for batch in follow:  # (32, 2049) arrays while the build runs, then epochs of the finished cache
            ...
        data = streampack.torch.DataLoader(follow, num_workers=4)  # workers, ranks, resume: as a Loader

    It is a Loader in every other way (ranks, ``output=``, ``collate``, ``state_dict``, the adapters of
    :mod:`streampack.torch`, Lightning and Hugging Face), with one dataset and its own order: see the
    module docstring. ``len()`` is known once the build is complete (with ``then="end"``).

    Args:
        path: the cache directory or URL (its build may not have written its manifest yet).
        seq_len: tokens per sample.
        batch_size: the GLOBAL batch size; each rank yields ``batch_size // world_size`` rows.
        overlap: extra tokens at the end of each sample (1 for next-token targets).
        seed: shuffle seed.
        rank: this process's rank.
        world_size: number of ranks; it must divide ``batch_size``.
        drop_last: with ``then="end"``, drop the last partial global batch (see :class:`LoaderOptions`).
        then: after the last era: ``"epochs"`` of the finished cache, endlessly (as a Loader runs), or
            ``"end"`` (one pass over every window).
        first_era: windows in era 0 (the first batch waits for them).
        largest_era: the size eras grow to by doubling: the shuffle's reach once they are that large.
        timeout: seconds a batch waits without the build committing anything before
            :class:`~streampack.errors.BuildStalledError`. A build in object storage shows a unit only
            once it is done: give more than one unit's build time.
        poll: seconds between two reads of the ledger while waiting.
        output: ``"numpy"``, ``"dict"`` or ``"varlen"``, as for the Loader.
        dtype: integer dtype of the token arrays; ``None`` keeps the cache's.
        collate: applied to every batch before it is yielded.
        local_dir: (object storage) the local copy's directory.
        max_local_bytes: (object storage) the bound on the local copy.
        storage_options: (object storage) passed to the fsspec filesystem.
        prefetch_steps: (object storage) steps ahead whose shards are fetched in the background, within the
            eras known (8 by default; 0: none).

    Raises:
        OptionsError: an option is out of range.
        BuildStalledError: the build wrote no manifest within ``timeout`` (and later: committed nothing
            new while a batch waited ``timeout`` seconds).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        seq_len: int,
        batch_size: int,
        overlap: int = 0,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        then: Literal["end", "epochs"] = "epochs",
        first_era: int = 1024,
        largest_era: int = 65536,
        timeout: float = 600.0,
        poll: float = 0.2,
        output: Output = "numpy",
        dtype: npt.DTypeLike = np.int64,
        collate: Callable[[Any], Any] | None = None,
        local_dir: str | os.PathLike[str] | None = None,
        max_local_bytes: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        prefetch_steps: int | None = None,
    ) -> None:
        # Options are checked before waiting for the build, not after.
        LoaderOptions(batch_size=batch_size, seed=seed, rank=rank, world_size=world_size, drop_last=drop_last,
                      output=output, dtype=dtype)  # fmt: skip
        check_int("seq_len", seq_len, min=1, max=2**40)
        check_int("overlap", overlap, min=0, max=2**40)
        check_choice("then", then, ("end", "epochs"))
        if not timeout > 0 or not poll > 0:
            raise OptionsError(
                f"timeout and poll must be positive seconds (got timeout={timeout}, poll={poll})"
            )
        eras = Eras(first_era, largest_era)
        self.path, self.then, self.timeout, self.poll = path, then, timeout, poll
        self.seq_len, self.overlap = int(seq_len), int(overlap)
        reading: dict[str, Any] = {"local_dir": local_dir, "max_local_bytes": max_local_bytes}
        reading |= {"storage_options": storage_options, "prefetch_steps": prefetch_steps}
        self._reading: dict[str, Any] = reading if is_remote(path) else {}
        given = [name for name, value in reading.items() if value is not None]
        if given and not self._reading:
            raise OptionsError(
                f"{path}: {', '.join(given)} apply to caches in object storage (s3://...), not to a "
                "local cache"
            )
        self._store = cached_store(str(path), **self._reading) if self._reading else open_store(path)
        self._manifest = self._manifest_when_written()
        self._ledger = _Ledger(self._store, self._manifest.units)
        tokens, complete = self._ledger.read()
        sequences = self._committed().sequences(seq_len, overlap=overlap)
        self._known = 0  # positions whose samples are known and committed
        self._data_known = 0  # positions the sources opened last can read
        super().__init__(
            sequences,
            batch_size=batch_size,
            seed=seed,
            rank=rank,
            world_size=world_size,
            drop_last=drop_last,
            output=output,
            dtype=dtype,
            collate=collate,
        )
        data = {"build": build_digest(self._manifest), "seq_len": self.seq_len, "overlap": self.overlap}
        self._batch_size = self.options.batch_size
        self.follow_order = FollowOrder(seed=self.options.seed, eras=eras, then=then, data=data)
        self.order = self._configured = self.follow_order
        # What the first read showed is known, and the view opened above holds it: no second open.
        if complete:  # len() and the end are known at once
            self._finish(self._windows(tokens))
        else:
            self._known = self.follow_order.known = eras.covered(self._windows(tokens))
        self._data_known = self._known

    def _windows(self, tokens: int) -> int:
        """Windows that lie within the first ``tokens`` tokens of the stream."""
        return max(0, (tokens - self.overlap) // self.seq_len)

    def _manifest_when_written(self) -> Manifest:
        """The build's manifest, once it has written it."""
        store = self._store
        started = time.monotonic()
        while not store.exists(MANIFEST):
            if time.monotonic() - started > self.timeout:
                raise BuildStalledError(
                    f"{store.describe('')}: no build has written a manifest here in {self.timeout:g} s; "
                    "start the build (or check the path), or raise timeout="
                )
            time.sleep(self.poll)
        return load_manifest(store)

    def _committed(self) -> reader.Cache:
        """The cache as the ledger was last read: it holds every sample of the positions known."""
        return reader.open_committed(self._store, self._manifest, self._ledger.progress())

    def __getstate__(self) -> dict[str, Any]:
        """Pickle (and copy) as a Loader, with an order and ledger of its own; the copy reopens the cache
        (it has grown since) before its first read."""
        order = copy.copy(self.follow_order)
        mine = {
            "follow_order": order,
            "order": order,
            "_configured": order,
            "_ledger": copy.copy(self._ledger),
        }
        return super().__getstate__() | mine | {"_data_known": -1}

    @property
    def num_samples(self) -> int:
        """Samples of the finished cache once the build is complete; before, of the eras known committed."""
        order = self.follow_order
        return order.total if order.total is not None else order.known

    # --- what the build has committed ------------------------------------------------------------------

    def _check_size(self) -> None:
        """Nothing to check up front: the cache grows while it is followed."""

    def _single_size(self, what: str) -> int:
        if self.follow_order.total is None:
            raise TypeError(
                f"{what} is not known while the build runs: the number of samples is known once it is "
                "complete"
            )
        return self.follow_order.total

    def __len__(self) -> int:
        """Global batches of the whole run, once the build is complete (see :meth:`Loader.__len__`).

        Raises:
            TypeError: the build is still running, or ``then="epochs"`` (endless).
        """
        if self.then == "epochs":
            raise TypeError(
                "a Follow with then='epochs' goes on with epochs of the finished cache endlessly: it has no "
                "len(); use then='end' for one pass over every sample, or count steps yourself (max_steps)"
            )
        if self.order.end is None:
            raise TypeError(
                "a Follow has no len() while the build runs: the number of samples is known once it is "
                "complete; count steps yourself (max_steps)"
            )
        return super().__len__()

    def _global_rows(self, position: int) -> int:
        if position + self._batch_size > self._known:  # the one check per call once the eras are known
            self._await(min(position + self._batch_size, MAX_POSITION))
        return Loader._global_rows(self, position)

    def _finish(self, windows: int) -> None:
        """The build is complete and holds ``windows`` samples: every position is known from now on.

        Raises:
            OptionsError: the finished cache cannot serve these options (see :meth:`_check_finished` and
                :meth:`Loader._check_last_batch`); asked again at every batch.
        """
        self._check_finished(windows)
        order = self.follow_order
        order.finish(windows)
        try:
            self._check_last_batch()
        except OptionsError:
            order.finish(None)
            raise
        self._known = MAX_POSITION

    def _check_finished(self, windows: int) -> None:
        """Refuse to go on with epochs of a finished cache that holds no global batch."""
        opts = self.options
        if self.then == "epochs" and (windows == 0 or (opts.drop_last and windows < opts.batch_size)):
            raise OptionsError(
                f"{self.path}: the finished cache holds {windows} samples of seq_len={self.seq_len}, fewer "
                f"than one global batch of {opts.batch_size}: then='epochs' has nothing to repeat. Use a "
                "smaller batch_size or seq_len, or then='end'"
            )

    def advance(self, batches: int = 1) -> None:
        """Move the position forward by ``batches`` steps (see :meth:`Loader.advance`), once known (a run
        that ends must know where, to stop there)."""
        check_int("batches", batches, min=0, max=2**62)
        self._await(min(self._position + batches * self._batch_size, MAX_POSITION))
        super().advance(batches)

    def _ready(self, position: int) -> bool:
        """Whether the samples of the batch at ``position`` are known to be committed (no wait)."""
        return position + self._batch_size <= min(self._known, self._data_known)

    def _planned_end(self) -> int | None:
        end = self.order.end
        return self._known if end is None else min(end, self._known)

    def _await(self, stop: int) -> None:
        """Wait until the samples of positions ``[0, stop)`` are known and committed, or the build is done.

        Raises:
            BuildStalledError: the ledger showed nothing new for ``timeout`` seconds.
        """
        if stop <= self._known:
            return
        order = self.follow_order
        waited_since = watched_at = time.monotonic()
        seen: tuple[int, ...] | None = None
        later: tuple[int, ...] | None = None
        while True:
            tokens, complete = self._ledger.read()
            windows = self._windows(tokens)
            if complete:
                self._finish(windows)
                return
            order.known = self._known = max(self._known, order.eras.covered(windows))
            if stop <= self._known:
                return
            now = time.monotonic()
            if now - watched_at >= min(_WATCH_SECONDS, self.timeout / 8):  # later units: less often
                watched_at, before, later = now, later, self._ledger.later()
                if before is not None and later != before:
                    waited_since = now
            if (tokens, len(self._ledger.done)) != seen:
                waited_since, seen = now, (tokens, len(self._ledger.done))
            elif now - waited_since > self.timeout:
                raise BuildStalledError(
                    f"{self.path}: the build committed nothing for {self.timeout:g} s while position "
                    f"{stop - 1} waited for its era ({windows} samples are committed in stream order); is "
                    "the build still running? Rerun the build command to resume it, or raise timeout="
                )
            time.sleep(self.poll)

    # --- reading ----------------------------------------------------------------------------------------

    def picks(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """Source and sample ids of this rank's rows at ``position``, once committed (see
        :meth:`Loader.picks`); the view of the cache is reopened first when it does not hold them."""
        if position + self._batch_size > self._data_known:
            self._global_rows(position)  # waits for the build
            if self._data_known < self._known:
                self._reopen()
        return super().picks(position)

    def indices(self, position: int) -> np.ndarray:
        """Sample indices of this rank's rows of the batch at ``position`` (``int64``)."""
        return self.picks(position)[1]

    def _reopen(self) -> None:
        """Read from the cache as committed now: it holds every sample of the positions known."""
        known = self._known
        sequences = self._committed().sequences(self.seq_len, overlap=self.overlap)
        self.dataset, self.sources = sequences, [_Source(sequences)]
        self._joined = JoinedSequences([sequences])
        self._prefetches = prefetch.steps_for(self._joined) > 0
        self.formatter = format_for(self.options.output, [sequences])
        self._clear_caches()
        self._data_known = known

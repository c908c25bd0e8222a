"""Training while the build runs: batches of the committed part of a cache whose build is still going.

:class:`Follow` serves windows of ``seq_len`` tokens of what the build has committed, in *eras*. An era is
a snapshot of the ledger's committed token counts, one per work unit. Era 0 is what is committed when the
first batch is asked for; its samples are the fixed windows over each unit's committed range (the ranges
laid end to end, a :class:`~streampack.layout.Runs` stream, as a split of a cache is), in a seeded shuffled
order (``Permutation(n, seed, epoch=era)``). Once they are used up the ledger is read again, and the next
era serves only the tokens committed since: each unit from where the previous era stopped reading it (a
window never straddles two eras, so the last partial window of an era is carried into the next). No token
is served twice while following, and none the build has not committed.

When nothing new is committed, :class:`Follow` polls the ledger every ``poll`` seconds, and raises
:class:`~streampack.errors.BuildStalledError` after ``timeout`` seconds without progress. Once every unit's
ledger entry says it is done (the build's data is final) and the last era has been served, iteration
**ends** (``then="end"``, the default; at most ``seq_len + overlap - 1`` tokens of the tail and a partial
last batch are never served), or goes on with full permutations of the complete cache
(``then="epochs"``): position ``F + p``, ``F`` where the eras end, is position ``p`` of
``Loader(streampack.open(path).sequences(seq_len), seed=seed)``.

Positions are global, as in the :class:`~streampack.Loader`: the global batch at position ``p`` is
positions ``[p, p + B)`` and rank ``r`` of ``W`` takes the ``r``-th contiguous slice of it. The eras
themselves come from the ledger *when a rank reads it*, so ranks must agree on them: with ``world_size >
1``, pass ``share``, which hands every rank rank 0's snapshot (e.g. over ``torch.distributed``).

:meth:`Follow.state_dict` holds the position and every era seen so far (its per-unit committed counts), so
:meth:`Follow.load_state_dict` rebuilds the same eras from the state, not from the ledger of now: the same
samples follow, given the same build.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import numpy as np

from streampack import ledger, reader
from streampack.errors import BuildStalledError, LoaderStateError, OptionsError
from streampack.format import MANIFEST, load_manifest, shard_name
from streampack.layout import FixedWindows, Runs, Spans, read_spans
from streampack.loader import check_int
from streampack.order import Shuffled
from streampack.permutation import Permutation
from streampack.remote import is_remote
from streampack.store import open_store

__all__ = ["Era", "Follow", "Snapshot"]

_STATE_FORMAT = "streampack.Follow"
_STATE_VERSION = 1

Snapshot = dict[str, Any]
"""What ranks share about the ledger: ``{"tokens": [committed tokens per unit], "complete": bool}``."""


class Era:
    """The samples of one era: windows over each unit's tokens ``[starts[u], stops[u])``.

    Args:
        index: the era's number (the shuffle's epoch).
        starts: per unit, the first token not served by an earlier era.
        stops: per unit, the tokens committed at the era's snapshot.
        seq_len: tokens per sample.
        overlap: extra tokens at the end of each window.
    """

    def __init__(self, index: int, starts: np.ndarray, stops: np.ndarray, seq_len: int, overlap: int) -> None:
        self.index, self.starts, self.stops = index, starts, stops
        units = np.flatnonzero(stops > starts)
        lengths = stops[units] - starts[units]
        run_starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.runs = Runs(run_starts, units.astype(np.int64), starts[units].astype(np.int64))
        self.windows = FixedWindows(self.runs, seq_len, overlap)
        self.size = len(self.windows)

    def next_starts(self) -> np.ndarray:
        """Per unit, the first token the next era serves: what the windows of this one did not start on."""
        served = self.size * self.windows.seq_len  # tokens of this era's stream its windows advanced over
        runs = self.runs
        taken = np.clip(served - runs.starts[:-1], 0, np.diff(runs.starts))
        starts = self.starts.copy()
        starts[runs.shards] += taken
        return starts

    def spans(self, positions: np.ndarray, seed: int) -> Spans:
        """The spans of the samples at ``positions`` of this era (``0 <= positions < size``)."""
        order = Permutation(self.size, seed=seed, epoch=self.index)
        return self.windows.spans(order(positions))


class Follow:
    """Iterate over global batches of the committed part of a cache whose build is running.

    Example::

        follow = Follow("cache/", seq_len=2048, overlap=1, batch_size=32, seed=1)
        for batch in follow:  # (32, 2049) arrays, while the build runs; ends once it is complete
            ...
        loader = Loader(streampack.open("cache/").sequences(2048, overlap=1), batch_size=32)

    Args:
        path: the cache directory (its build may not have written its manifest yet).
        seq_len: tokens per sample.
        batch_size: the GLOBAL batch size; each rank yields ``batch_size // world_size`` rows.
        overlap: extra tokens at the end of each sample (1 for next-token targets).
        seed: shuffle seed.
        rank: this process's rank.
        world_size: number of ranks; it must divide ``batch_size``.
        share: with ``world_size > 1``: called on every rank with its :data:`Snapshot` of the ledger,
            returns rank 0's (a broadcast), so all ranks build the same eras.
        timeout: seconds without new committed data after which :class:`BuildStalledError` is raised.
        poll: seconds between two reads of the ledger while waiting.
        dtype: integer dtype of the batches.
        then: once the build is complete and its eras served: ``"end"`` the iteration, or go on with
            ``"epochs"`` of the complete cache, endlessly (the :class:`~streampack.Loader`'s order).

    Raises:
        OptionsError: an option is out of range, ``world_size > 1`` without ``share``, or ``path`` is in
            object storage (not supported yet).
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
        share: Callable[[Snapshot], Snapshot] | None = None,
        timeout: float = 600.0,
        poll: float = 0.2,
        dtype: np.dtype | type = np.int64,
        then: Literal["end", "epochs"] = "end",
    ) -> None:
        check_int("seq_len", seq_len, 1, 2**40, "a positive integer")
        check_int("overlap", overlap, 0, 2**40, "a non-negative integer")
        check_int("world_size", world_size, 1, 2**31, "a positive integer (the number of ranks)")
        check_int("batch_size", batch_size, 1, 2**62, "a positive integer (the global batch size)")
        check_int("rank", rank, 0, world_size - 1, f"an integer in [0, {world_size})")
        check_int("seed", seed, 0, 2**64 - 1, "an integer in [0, 2**64)")
        if batch_size % world_size:
            raise OptionsError(f"batch_size={batch_size} does not divide by world_size={world_size}")
        if world_size > 1 and share is None:
            raise OptionsError(
                f"world_size={world_size}: every rank must follow the same eras; pass share=..., a function "
                "that returns rank 0's snapshot on every rank (e.g. torch.distributed.broadcast_object_list)"
            )
        if is_remote(path):
            raise OptionsError(
                f"{path}: Follow reads local caches only for now (a build in object storage publishes a unit "
                "when it is done); follow a local build, or open the remote cache once it is complete"
            )
        if then not in ("end", "epochs"):
            raise OptionsError(f"then must be 'end' or 'epochs' (got then={then!r})")
        if not timeout > 0 or not poll > 0:
            raise OptionsError(
                f"timeout and poll must be positive seconds (got timeout={timeout}, poll={poll})"
            )
        self.path = path
        self.seq_len, self.overlap, self.seed = seq_len, overlap, seed
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.share = share
        self.timeout, self.poll = timeout, poll
        self.dtype = np.dtype(dtype)
        self.then = then
        self._position = 0
        self._snapshots: list[list[int]] = []  # committed tokens per unit, one list per era
        self._eras: list[Era] = []
        self._bounds = [0]  # first position of each era, then the end of the last one
        self._complete = False  # the last era holds the end of the complete build
        self._cache: reader.Cache | None = None
        self._units: list[str] | None = None  # the manifest's work units, once it is written
        self._done: dict[int, ledger.UnitProgress] = {}  # the final entries of the units done
        self._full: tuple[Shuffled, FixedWindows] | None = None  # the epochs after the eras (then="epochs")

    # --- eras -------------------------------------------------------------------------------------------

    @property
    def position(self) -> int:
        """Global position of the next batch: samples served since following began, over all ranks."""
        return self._position

    @property
    def eras(self) -> list[Era]:
        """The eras seen so far."""
        return list(self._eras)

    @property
    def covered(self) -> int:
        """Positions the eras seen so far cover: the batches before it are fixed by the state alone."""
        return self._bounds[-1]

    @property
    def finished(self) -> bool:
        """True once the build is complete and every full global batch of its eras has been served."""
        ended = self._complete and self.then == "end"
        return ended and self._position + self.batch_size > self._bounds[-1]

    def _add_era(self, tokens: list[int]) -> Era:
        previous = self._eras[-1] if self._eras else None
        stops = np.asarray(tokens, dtype=np.int64)
        starts = previous.next_starts() if previous is not None else np.zeros(len(stops), dtype=np.int64)
        if len(stops) != len(starts) or (stops < starts).any():
            raise LoaderStateError(
                f"{self.path}: the ledger's committed counts went back or changed shape since the previous "
                "era; this is not the build the eras were taken from: start following afresh"
            )
        era = Era(len(self._eras), starts, stops, self.seq_len, self.overlap)
        if self._cache is not None and (stops > self._cache.table.num_tokens).any():
            self._cache = None  # opened before this era's snapshot (another rank's): reopened to read it
        self._snapshots.append([int(t) for t in tokens])
        self._eras.append(era)
        self._bounds.append(self._bounds[-1] + era.size)
        return era

    def _snapshot(self) -> Snapshot | None:
        """The ledger's committed counts now (None before the build wrote its manifest), shared by ranks."""
        mine = self._committed()
        if self.share is None:
            return mine
        shared = self.share(mine or {"tokens": None, "complete": False})
        return shared if shared.get("tokens") is not None else None

    def _committed(self) -> Snapshot | None:
        """Each unit's committed tokens from its ledger entry; the build is complete once every unit is done.

        The manifest is read once; a finished unit's entry is final, so each poll reads only the entries of
        the units still running (and looks for those not started).
        """
        store = open_store(self.path)
        if self._units is None:
            if not store.exists(MANIFEST):
                return None
            self._units = load_manifest(store).units
        tokens = []
        for i, unit in enumerate(self._units):
            done = self._done.get(i)
            progress = done if done is not None else ledger.read_progress(store, shard_name(i), unit)
            if progress.done:
                self._done[i] = progress
            tokens.append(progress.tokens)
        return {"tokens": tokens, "complete": len(self._done) == len(self._units)}

    def _cover(self, stop: int) -> None:
        """Take eras until they cover positions ``[0, stop)`` or the build is complete; waits meanwhile."""
        waited_since = time.monotonic()
        while self._bounds[-1] < stop and not self._complete:
            snapshot = self._snapshot()
            if snapshot is not None:
                complete = bool(snapshot["complete"])
                grown = self._grows(snapshot["tokens"])
                if grown or complete:
                    era = self._add_era(snapshot["tokens"])
                    self._complete = complete
                    if era.size:
                        waited_since = time.monotonic()
                    continue
            if time.monotonic() - waited_since > self.timeout:
                raise BuildStalledError(
                    f"{self.path}: the build committed no new samples for {self.timeout:g} s (position "
                    f"{self._bounds[-1]}, {len(self._eras)} eras); is it still running? Rerun the build "
                    "command to resume it, or raise timeout="
                )
            time.sleep(self.poll)

    def _grows(self, tokens: list[int]) -> bool:
        """Whether ``tokens`` hold at least one new window past the last era."""
        starts = self._eras[-1].next_starts() if self._eras else np.zeros(len(tokens), dtype=np.int64)
        new = np.asarray(tokens, dtype=np.int64) - starts
        return int(new[new > 0].sum()) >= self.seq_len + self.overlap

    # --- batches ----------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[np.ndarray]:
        """Yield this rank's rows of each global batch, waiting for the build as needed."""
        while True:
            self._cover(self._position + self.batch_size)
            if self.finished:
                return
            batch = self.batch(self._position)
            self._position += self.batch_size
            yield batch

    def spans(self, positions: np.ndarray) -> Spans:
        """Where the samples at global ``positions`` (covered by the eras seen, or past them once the build
        is complete with ``then="epochs"``) lie: ``rows`` index ``positions``."""
        eras = np.searchsorted(self._bounds, positions, side="right") - 1
        parts = []
        for era in np.unique(eras).tolist():
            rows = np.flatnonzero(eras == era)
            if era < len(self._eras):
                spans = self._eras[era].spans(positions[rows] - self._bounds[era], self.seed)
            else:
                spans = self._epochs_spans(positions[rows] - self._bounds[-1])
            parts.append(Spans(rows[spans.rows], spans.shards, spans.lo, spans.hi, spans.col))
        fields = ("rows", "shards", "lo", "hi", "col")
        return Spans(*(np.concatenate([getattr(part, f) for part in parts]) for f in fields))

    def batch(self, position: int) -> np.ndarray:
        """This rank's rows of the global batch at ``position`` (covered by the eras seen)."""
        rows = self.batch_size // self.world_size
        first = position + self.rank * rows
        positions = np.arange(first, first + rows, dtype=np.int64)
        if positions[-1] >= self._bounds[-1] and not (self._complete and self.then == "epochs"):
            raise IndexError(
                f"position {int(positions[-1])} is past the eras seen ({self._bounds[-1]} samples)"
            )
        out = np.empty((rows, self.seq_len + self.overlap), dtype=self.dtype)
        cache = self._cache if self._cache is not None else self._reopen()
        read_spans(self.spans(positions), out, cache.shard_tokens)
        return out

    def _epochs_spans(self, positions: np.ndarray) -> Spans:
        """Spans of positions of the full permutations that follow the eras of a complete build."""
        cache = self._cache if self._cache is not None else self._reopen()
        if self._full is None:
            if not cache.manifest.complete:
                cache = self._reopen()
            windows = FixedWindows(Runs.whole(cache.token_starts), self.seq_len, self.overlap)
            self._full = Shuffled(len(windows), seed=self.seed), windows
        order, windows = self._full
        return windows.spans(order.samples(positions))

    def _reopen(self) -> reader.Cache:
        self._cache = reader.open(self.path, allow_incomplete=True)
        return self._cache

    # --- state ------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position, the settings that give positions their meaning, and every era seen (JSON-able)."""
        return {
            "format": _STATE_FORMAT,
            "version": _STATE_VERSION,
            "position": self._position,
            "seq_len": self.seq_len,
            "overlap": self.overlap,
            "seed": self.seed,
            "eras": [list(tokens) for tokens in self._snapshots],
            "complete": self._complete,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a :meth:`state_dict`: the eras are rebuilt from it, the next batch is the saved run's.

        Raises:
            LoaderStateError: not a follow state, saved with other settings, or of another build (its eras
                hold counts the ledger has not committed).
        """
        if not isinstance(state, Mapping) or state.get("format") != _STATE_FORMAT:
            raise LoaderStateError(
                f"not a streampack follow state (expected format={_STATE_FORMAT!r}); pass what "
                "Follow.state_dict() returned"
            )
        if state.get("version") != _STATE_VERSION:
            raise LoaderStateError(f"follow state version {state.get('version')!r} is not supported")
        for key in ("seq_len", "overlap", "seed"):
            if state.get(key) != getattr(self, key):
                raise LoaderStateError(
                    f"the follow state does not match this Follow: {key} in state: {state.get(key)!r} / "
                    f"{key} here: {getattr(self, key)!r}; create it with the settings of the saved run"
                )
        cache = self._reopen()
        committed = cache.table.num_tokens
        self._position, self._snapshots, self._eras, self._bounds = 0, [], [], [0]
        self._complete, self._full = False, None
        for tokens in state["eras"]:
            if len(tokens) != len(committed) or (np.asarray(tokens) > committed).any():
                raise LoaderStateError(
                    f"{self.path}: the follow state's eras hold data this cache has not committed; it was "
                    "saved while following another build"
                )
            self._add_era(tokens)
        self._complete = bool(state["complete"])
        self._position = int(state["position"])

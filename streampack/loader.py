"""The training loader: global batches of shuffled samples, split over ranks, resumable in O(1).

Order is a pure function of a few integers, so every process computes its own share without talking to
the others, and a checkpoint is a small JSON dict:

* Epoch ``e`` visits the samples in the order of ``Permutation(N, seed=seed, epoch=e)`` (the identity
  when ``shuffle=False``).
* Global batch ``b`` of an epoch is positions ``[b*B, (b+1)*B)`` of that order, ``B`` the *global*
  batch size; rank ``r`` of ``W`` takes the contiguous ``r``-th slice of ``B / W`` rows. Every rank gets
  the same number of batches, so no rank waits for a batch that never comes. A last partial global
  batch (``drop_last=False``) is split as evenly as possible; one with fewer rows than ranks, which would
  leave some rank an empty batch, is refused when the loader is created.
* The state is ``(seed, epoch, samples consumed in the epoch)``. Resuming recomputes the next batch from
  it directly; nothing is replayed. Since ranks only slice a global batch, the global order is the same
  for any world size, and a run may resume with another number of ranks if ``B`` stays the same.

Trade-off: the shuffle is global (any sample can follow any other), so reads are random; a memory-mapped
cache on a local disk or in the page cache serves them at memory speed, a network filesystem does not.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeGuard

import numpy as np
import numpy.typing as npt

from streampack.errors import LoaderStateError, OptionsError
from streampack.permutation import Permutation

__all__ = ["STATE_VERSION", "DataSource", "Loader", "LoaderOptions"]

STATE_VERSION = 1
"""Version of the dict :meth:`Loader.state_dict` returns; :meth:`Loader.load_state_dict` checks it."""

_STATE_FORMAT = "streampack.Loader"
# Indices are permuted for this many upcoming rows at once: one Permutation call costs ~100 numpy
# dispatches whatever its size, which would otherwise dominate a small batch.
_PERMUTE_BLOCK_ROWS = 4096
_MAX_EPOCH = 2**64 - 1  # the largest epoch Permutation accepts

Output = Literal["numpy", "dict"]


class DataSource(Protocol):
    """What a :class:`Loader` reads: ``len()`` samples, fetched a batch of indices at a time.

    :class:`streampack.sequences.PackedSequences` is the usual one; a 2-D numpy array is one too (sample
    ``i`` is row ``i``), a list of arrays is not (it cannot be indexed by an array). A source may also offer
    ``read(indices, out=...)`` (fill a given array), ``boundaries(indices)`` (needed for
    ``output="dict"``), ``fingerprint()`` (checked against checkpoints) and ``dtype``.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, indices: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class LoaderOptions:
    """Settings of a :class:`Loader`, validated on creation.

    Attributes:
        batch_size: the GLOBAL batch size ``B``: rows of one step summed over all ranks.
        seed: shuffle seed, an integer in ``[0, 2**64)``.
        shuffle: visit samples in a seeded random order that changes every epoch; else in stream order.
        rank: this process's rank, in ``[0, world_size)``.
        world_size: number of ranks; it must divide ``batch_size``.
        drop_last: drop the last global batch of an epoch when it is partial (its samples are different
            ones every shuffled epoch); else serve it, split as evenly as possible over the ranks: with
            ``N`` samples it has ``N mod B`` rows, and each rank gets ``(N mod B) // W`` of them or one
            more. The :class:`Loader` refuses ``drop_last=False`` when ``0 < N mod B < W``: some rank
            would get a 0-row batch, whose mean loss is NaN.
        epochs: stop after this many epochs; ``None`` iterates forever.
        output: ``"numpy"``, one ``(rows, seq_len + overlap)`` array per step; or ``"dict"``, the
            ``input_ids`` / ``labels`` / ``position_ids`` arrays Hugging Face causal LMs take (they
            shift ``labels`` themselves, so the samples must have no overlap).
        dtype: integer dtype of the token arrays; ``None`` keeps the cache dtype (the smallest to move
            between processes; cast on arrival).

    Raises:
        OptionsError: (a ``ValueError``) an option is out of range or of the wrong type, or
            ``batch_size`` does not divide by ``world_size``. Integer options are stored as Python ints.
    """

    batch_size: int
    seed: int = 0
    shuffle: bool = True
    rank: int = 0
    world_size: int = 1
    drop_last: bool = True
    epochs: int | None = None
    output: Output = "numpy"
    dtype: npt.DTypeLike = np.int64

    def __post_init__(self) -> None:
        # Stored as Python ints: numpy integers (seeds from np.random, sizes from arrays) would make
        # state_dict() fail to serialize as JSON.
        self._set_int("batch_size", 1, 2**62, "a positive integer (the global batch size)")
        self._set_int("world_size", 1, 2**31, "a positive integer (the number of ranks)")
        self._set_int("rank", 0, self.world_size - 1, f"an integer in [0, {self.world_size})")
        self._set_int("seed", 0, 2**64 - 1, "an integer in [0, 2**64)")
        if self.epochs is not None:
            self._set_int("epochs", 1, 2**63, "a positive integer, or None to loop forever")
        for name in ("shuffle", "drop_last"):
            if not isinstance(getattr(self, name), bool):
                raise OptionsError(f"{name} must be True or False (got {name}={getattr(self, name)!r})")
        if self.batch_size % self.world_size:
            smaller = self.batch_size // self.world_size * self.world_size
            suggestion = f"{smaller} or {smaller + self.world_size}" if smaller else str(self.world_size)
            raise OptionsError(
                f"batch_size is the global batch size, split evenly over the ranks: batch_size="
                f"{self.batch_size} does not divide by world_size={self.world_size}. Use a multiple of "
                f"{self.world_size}, e.g. {suggestion}."
            )
        if self.output not in ("numpy", "dict"):
            raise OptionsError(f"output must be 'numpy' or 'dict' (got output={self.output!r})")
        if self.dtype is not None:
            dtype = np.dtype(self.dtype)
            if dtype.kind not in "iu":
                raise OptionsError(
                    f"dtype must be an integer dtype such as int64, or None (got dtype={dtype})"
                )
            object.__setattr__(self, "dtype", dtype)

    def _set_int(self, name: str, lo: int, hi: int, allowed: str) -> None:
        value = getattr(self, name)
        _check_int(name, value, lo, hi, allowed)
        object.__setattr__(self, name, int(value))

    @property
    def rows(self) -> int:
        """Rows of a full batch on one rank: ``batch_size // world_size``."""
        return self.batch_size // self.world_size


class Loader:
    """Iterate over global batches of samples, this rank's share of each, resumable exactly in O(1).

    Iterating yields one batch per step, starting at the current state, until ``epochs`` epochs are done
    (forever when ``epochs=None``). Each yielded batch advances the state, so :meth:`state_dict` taken
    after a batch resumes at the next one.

    Example::

        loader = Loader(cache.sequences(2048, overlap=1), batch_size=32, seed=1)
        for batch in loader:  # (32, 2049) int64 arrays
            x, y = batch[:, :-1], batch[:, 1:]

    ``len(loader)`` is the number of batches per epoch (:attr:`steps_per_epoch`).

    Args:
        dataset: the samples, usually ``cache.sequences(seq_len)``; see :class:`DataSource`. A 2-D numpy
            array also is one; a list of arrays is not (``np.stack`` it).
        batch_size: the GLOBAL batch size; each rank yields ``batch_size // world_size`` rows per step.
        seed: shuffle seed.
        shuffle: seeded random order, a different one every epoch; else stream order.
        rank: this process's rank.
        world_size: the number of ranks.
        drop_last: drop each epoch's last partial global batch; else split it over the ranks (refused
            when it has fewer rows than ranks, see :class:`LoaderOptions`).
        epochs: epochs to run; ``None`` runs forever.
        output: ``"numpy"`` or ``"dict"``; see :class:`LoaderOptions`.
        dtype: integer dtype of the token arrays; ``None`` keeps the cache's.
        collate: applied to every batch before it is yielded (e.g. ``torch.from_numpy``).

    Raises:
        TypeError: ``dataset`` is a list or tuple, or has no ``__len__`` or ``__getitem__``.
        OptionsError: (a ``ValueError``) an option is out of range, ``batch_size`` does not divide by
            ``world_size``, the dataset holds less than one global batch (with ``drop_last``),
            ``drop_last=False`` would give some rank an empty last batch (fewer rows than ranks; the
            message names the numbers and the fixes), ``dtype`` cannot hold the cache's ids, or
            ``output="dict"`` is asked of samples it does not fit.
    """

    def __init__(
        self,
        dataset: DataSource,
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        epochs: int | None = None,
        output: Output = "numpy",
        dtype: npt.DTypeLike = np.int64,
        collate: Callable[[Any], Any] | None = None,
    ) -> None:
        self.options = LoaderOptions(
            batch_size=batch_size,
            seed=seed,
            shuffle=shuffle,
            rank=rank,
            world_size=world_size,
            drop_last=drop_last,
            epochs=epochs,
            output=output,
            dtype=dtype,
        )
        _check_source(dataset)
        self.dataset = dataset
        self.collate = collate
        self.num_samples = len(dataset)
        self._check_dataset()
        fingerprint = getattr(dataset, "fingerprint", None)
        self._fingerprint: dict[str, Any] = (
            dict(fingerprint()) if fingerprint else {"num_samples": self.num_samples}
        )
        self._epoch = 0
        self._step = 0
        self._clear_caches()

    def _check_dataset(self) -> None:
        opts, n = self.options, self.num_samples
        if n == 0 or (opts.drop_last and n < opts.batch_size):
            raise OptionsError(
                f"the dataset has {n} samples, fewer than one global batch of {opts.batch_size}: nothing to "
                "iterate. Use a smaller batch_size or seq_len, a larger cache"
                + (", or drop_last=False." if n else ".")
            )
        self._check_last_batch()
        source_dtype = getattr(self.dataset, "dtype", None)
        if opts.dtype is not None and source_dtype is not None and not np.can_cast(source_dtype, opts.dtype):
            raise OptionsError(
                f"dtype={opts.dtype} cannot hold every id of the cache's {np.dtype(source_dtype)} tokens; "
                "use int64 (the default), a wider integer type, or None to keep the cache dtype"
            )
        if opts.output == "dict":
            if not hasattr(self.dataset, "boundaries"):
                raise OptionsError(
                    f"output='dict' needs position ids, which {type(self.dataset).__name__} does not provide "
                    "(no boundaries() method); use output='numpy' or cache.sequences(...)"
                )
            overlap = getattr(self.dataset, "overlap", 0)
            if overlap:
                raise OptionsError(
                    "output='dict' gives labels = input_ids (Hugging Face models shift them inside), so the "
                    f"samples need no overlap (got overlap={overlap}); use cache.sequences(seq_len) with "
                    "overlap=0, or output='numpy' for x/y windows"
                )

    def _check_last_batch(self) -> None:
        """Refuse ``drop_last=False`` when the last partial global batch cannot give every rank a row.

        A rank with a 0-row batch computes a NaN mean loss, and DDP's all-reduce spreads the NaN
        gradients to every rank. The remainder is known up front, so this is refused here rather than
        padded with repeated samples: every served row stays a distinct sample, in the same order.
        """
        opts, n = self.options, self.num_samples
        remainder = n % opts.batch_size
        if opts.drop_last or not 0 < remainder < opts.world_size:
            return
        plural = "s" if remainder > 1 else ""
        fixes = []
        if n >= opts.batch_size:
            fixes.append(
                f"drop_last=True (each epoch then skips its last {remainder} sample{plural}, other ones "
                "every shuffled epoch)"
            )
        other = _batch_size_for_ranks(n, opts.batch_size, opts.world_size)
        if other is not None:
            fixes.append(f"batch_size={other} (it leaves 0 or at least {opts.world_size} samples over)")
        fixes.append("fewer ranks, or more samples (a larger cache or a smaller seq_len)")
        raise OptionsError(
            f"drop_last=False would give {opts.world_size - remainder} of the {opts.world_size} ranks an "
            f"empty batch at the end of every epoch: {n} samples in global batches of batch_size="
            f"{opts.batch_size} leave {n} mod {opts.batch_size} = {remainder} sample{plural} for the last "
            f"one, fewer than world_size={opts.world_size}. A mean loss over 0 rows is NaN, and DDP spreads "
            f"it to every rank. Use {', or '.join(fixes)}."
        )

    def _clear_caches(self) -> None:
        self._permutation: Permutation | None = None
        self._block: tuple[int, int, np.ndarray] | None = None  # (epoch, first step, rows of indices)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle options, dataset and position; derived caches are rebuilt where unpickled."""
        state = self.__dict__.copy()
        state["_permutation"] = state["_block"] = None
        return state

    def __repr__(self) -> str:
        o = self.options
        return (
            f"Loader({self.dataset!r}, batch_size={o.batch_size}, seed={o.seed}, shuffle={o.shuffle}, "
            f"rank={o.rank}, world_size={o.world_size}, epoch={self._epoch}, step={self._step})"
        )

    @property
    def epoch(self) -> int:
        """Epoch of the next batch."""
        return self._epoch

    @property
    def step(self) -> int:
        """Index within its epoch of the next global batch."""
        return self._step

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch, the same on every rank."""
        full, partial = divmod(self.num_samples, self.options.batch_size)
        return full + (1 if partial and not self.options.drop_last else 0)

    def __len__(self) -> int:
        """Batches per epoch on this rank, :attr:`steps_per_epoch` (for LR schedules and progress bars).

        Every rank gets a share of every global batch, so this is also the number of optimizer steps
        per epoch, the same on every rank. It is not the number of batches still to come: iteration starts
        at the current state and runs until ``epochs`` epochs are done (``epochs * len(loader)`` batches
        from a fresh loader), or forever when ``epochs=None``.
        """
        return self.steps_per_epoch

    @property
    def finished(self) -> bool:
        """True once ``epochs`` epochs have been served."""
        return self.options.epochs is not None and self._epoch >= self.options.epochs

    def __iter__(self) -> Iterator[Any]:
        """Yield batches from the current state on, advancing it as each batch is handed out.

        The state is read afresh before every batch, so :meth:`load_state_dict` takes effect at the next
        batch even in the middle of a loop.
        """
        while not self.finished:
            epoch, step = self._epoch, self._step
            batch = self.batch(epoch, step)
            self._epoch, self._step = self._following(epoch, step)
            yield batch

    def schedule(self, start: tuple[int, int] | None = None) -> Iterator[tuple[int, int]]:
        """The ``(epoch, step)`` of every batch still to come, without changing the state.

        DataLoader workers use it to take every n-th batch (:mod:`streampack.torch`).

        Args:
            start: the ``(epoch, step)`` to start from instead of the current state.
        """
        epoch, step = (self._epoch, self._step) if start is None else start
        while self.options.epochs is None or epoch < self.options.epochs:
            yield epoch, step
            epoch, step = self._following(epoch, step)

    def advance(self, batches: int = 1) -> None:
        """Move the state forward by ``batches`` steps, as if that many batches had been consumed."""
        _check_int("batches", batches, 0, 2**62, "a non-negative integer")
        epochs, step = divmod(self._step + batches, self.steps_per_epoch)
        self._epoch += epochs
        self._step = step

    def _following(self, epoch: int, step: int) -> tuple[int, int]:
        return (epoch, step + 1) if step + 1 < self.steps_per_epoch else (epoch + 1, 0)

    def batch(self, epoch: int, step: int, *, out: np.ndarray | None = None) -> Any:
        """This rank's batch at ``step`` of ``epoch``, formatted; a pure function of the arguments.

        Args:
            epoch: the epoch.
            step: the global batch within the epoch, in ``[0, steps_per_epoch)``.
            out: an array of shape ``(rows, width)`` and the output dtype to read the tokens into
                (e.g. a view of shared memory); a new one when omitted.

        Returns:
            An array, or a dict of arrays, passed through ``collate`` when one was given.
        """
        indices = self.indices(epoch, step)
        tokens = self._read(indices, out)
        if self.options.output == "dict":
            boundaries = self.dataset.boundaries(indices)  # type: ignore[attr-defined]
            result: Any = {
                "input_ids": tokens,
                "labels": tokens.copy(),
                "position_ids": boundaries.position_ids,
            }
        else:
            result = tokens
        return self.collate(result) if self.collate is not None else result

    def batch_shape(self, step: int) -> tuple[int, int]:
        """Shape ``(rows, width)`` of this rank's token array at ``step``.

        Rows are ``batch_size // world_size`` except in a last partial batch (``drop_last=False``).
        """
        lo, hi = self._span(step)
        width = getattr(self.dataset, "width", None)
        if width is None:
            width = int(np.asarray(self.dataset[np.zeros(1, dtype=np.int64)]).shape[-1])
        return hi - lo, width

    def indices(self, epoch: int, step: int) -> np.ndarray:
        """Sample indices of this rank's rows at ``step`` of ``epoch`` (``int64``).

        Raises:
            IndexError: ``step`` is outside ``[0, steps_per_epoch)`` or ``epoch`` is negative.
        """
        if not 0 <= step < self.steps_per_epoch or epoch < 0:
            raise IndexError(
                f"no batch at epoch={epoch}, step={step}: epochs start at 0 and steps are in "
                f"[0, {self.steps_per_epoch})"
            )
        lo, hi = self._span(step)
        if not self.options.shuffle:
            return np.arange(lo, hi, dtype=np.int64)
        if step >= self.num_samples // self.options.batch_size:  # the last partial batch, on its own
            return self._permute(epoch, np.arange(lo, hi, dtype=np.int64))
        return self._permuted_block(epoch, step)

    def _span(self, step: int) -> tuple[int, int]:
        """This rank's slice ``[lo, hi)`` of the positions of global batch ``step``."""
        opts = self.options
        first = step * opts.batch_size
        size = min(opts.batch_size, self.num_samples - first)
        return first + opts.rank * size // opts.world_size, first + (opts.rank + 1) * size // opts.world_size

    def _permute(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        perm = self._permutation
        if perm is None or perm.epoch != epoch:
            perm = self._permutation = Permutation(self.num_samples, seed=self.options.seed, epoch=epoch)
        return perm(positions)

    def _permuted_block(self, epoch: int, step: int) -> np.ndarray:
        """Indices of a full step, permuted together with those of the next few full steps."""
        block = self._block
        if block is None or block[0] != epoch or not 0 <= step - block[1] < len(block[2]):
            opts = self.options
            full_steps = self.num_samples // opts.batch_size
            steps = np.arange(step, min(full_steps, step + max(1, _PERMUTE_BLOCK_ROWS // opts.rows)))
            firsts = steps * opts.batch_size + opts.rank * opts.rows
            positions = firsts[:, None] + np.arange(opts.rows, dtype=np.int64)
            block = self._block = (epoch, step, self._permute(epoch, positions))
        return block[2][step - block[1]]

    def _read(self, indices: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        dtype = self.options.dtype
        read = getattr(self.dataset, "read", None)
        if read is not None:
            if out is None and dtype is not None:
                out = np.empty((len(indices), self.dataset.width), dtype=dtype)  # type: ignore[attr-defined]
            return read(indices, out=out)
        tokens = np.asarray(self.dataset[indices])
        if dtype is not None:
            tokens = tokens.astype(dtype, copy=False)
        if out is not None:
            out[...] = tokens
            return out
        return tokens

    def state_dict(self) -> dict[str, Any]:
        """The position of this loader as a small JSON-serializable dict.

        Holds the format version, what the order depends on (seed, shuffle, global batch size,
        drop_last, the dataset's fingerprint), and the position: epoch and samples consumed in it.
        World size and rank are recorded for information only: a state may be loaded with others.
        """
        opts = self.options
        return {
            "format": _STATE_FORMAT,
            "version": STATE_VERSION,
            "seed": opts.seed,
            "shuffle": opts.shuffle,
            "batch_size": opts.batch_size,
            "drop_last": opts.drop_last,
            "dataset": dict(self._fingerprint),
            "epoch": self._epoch,
            "samples_in_epoch": self._step * opts.batch_size,
            "world_size": opts.world_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a :meth:`state_dict`: the next batch is the one the saved run would have produced.

        O(1): nothing is replayed. The world size may differ from the saved run's as long as the global
        batch size is the same; every rank then continues the same global order.

        Raises:
            LoaderStateError: (a ``ValueError``) the state is not a loader state of a supported version,
                it was saved with a different seed, shuffle, batch size, drop_last or dataset (both values
                are named), or its position is out of range (epoch outside ``[0, 2**64)``, or
                samples_in_epoch not a step of this epoch).
        """
        if not isinstance(state, Mapping) or state.get("format") != _STATE_FORMAT:
            raise LoaderStateError(
                f"not a streampack loader state (expected a dict with format={_STATE_FORMAT!r}, got "
                f"{_summary(state)}); pass what Loader.state_dict() returned"
            )
        if state.get("version") != STATE_VERSION:
            raise LoaderStateError(
                f"loader state version {state.get('version')!r} is not supported by this streampack (it "
                f"reads version {STATE_VERSION}); resume with the streampack version that saved it"
            )
        mine = self.state_dict()
        for key in ("seed", "shuffle", "batch_size", "drop_last", "dataset"):
            if key not in state:
                raise LoaderStateError(f"loader state has no {key!r}; it is damaged: {_summary(state)}")
            if state[key] != mine[key]:
                raise LoaderStateError(
                    f"the loader state does not match this loader: {key} in checkpoint: {state[key]!r} / "
                    f"{key} in this loader: {mine[key]!r}. Create the Loader with the settings and data "
                    "of the run that saved the state."
                )
        epoch, samples = state.get("epoch"), state.get("samples_in_epoch")
        batch = self.options.batch_size
        if not _is_int(epoch) or not 0 <= epoch <= _MAX_EPOCH:
            raise LoaderStateError(
                f"loader state epoch must be a non-negative integer below 2**64, the epochs a shuffle order "
                f"exists for (got epoch={epoch!r}); the state is damaged"
            )
        end = self.steps_per_epoch * batch
        if not _is_int(samples) or not 0 <= samples < end or samples % batch:
            raise LoaderStateError(
                f"loader state samples_in_epoch must be a multiple of batch_size={batch} in [0, {end}) "
                f"(got samples_in_epoch={samples!r}); the state is damaged"
            )
        self._epoch, self._step = int(epoch), int(samples) // batch


def _check_source(dataset: object) -> None:
    """Refuse at creation what cannot serve ``dataset[index_array]``, rather than at the first batch."""
    missing = [name for name in ("__len__", "__getitem__") if not hasattr(dataset, name)]
    if isinstance(dataset, (list, tuple)):
        got = f"a {type(dataset).__name__} of {len(dataset)} items, which cannot be indexed by an array"
        hint = " (np.stack(samples) makes one of equal-length samples)"
    elif missing:
        got = f"{type(dataset).__name__}, which has no {' or '.join(missing)}"
        hint = ""
    else:
        return
    raise TypeError(
        f"the Loader reads each batch as dataset[index_array], a (rows, width) array (got {got}). Pass "
        f"cache.sequences(seq_len), a 2-D numpy array{hint}, or an object with __len__() and "
        "__getitem__(index array) returning a 2-D array."
    )


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(name: str, value: object, lo: int, hi: int, allowed: str) -> None:
    if not _is_int(value) or not lo <= int(value) <= hi:
        raise OptionsError(f"{name} must be {allowed} (got {name}={value!r})")


def _batch_size_for_ranks(n: int, batch_size: int, world_size: int) -> int | None:
    """The multiple of ``world_size`` nearest ``batch_size`` whose last global batch has a row per rank."""
    for k in range(1, 1000):
        for candidate in (batch_size - k * world_size, batch_size + k * world_size):
            if 0 < candidate <= n and (n % candidate == 0 or n % candidate >= world_size):
                return candidate
    return None


def _summary(value: object, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

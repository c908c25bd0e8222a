"""PyTorch adapters: feed a :class:`~streampack.loader.Loader` through ``torch.utils.data.DataLoader``.

Install with ``pip install 'streampack[torch]'``.

* :class:`IterableDataset` yields a rank's batches as tensors; DataLoader worker ``k`` of ``n`` makes
  batches ``k, k + n, ...``, and the DataLoader hands them out in order.
* :class:`DataLoader` counts the batches it hands out, so its ``state_dict()`` resumes exactly at the
  next one, whatever the workers had prefetched.
* :class:`Dataset` is a plain map-style dataset of samples, for samplers of your own.

Why a ring of shared-memory slots: sending each batch as a shared-memory tensor of its own costs a new
file and a descriptor handshake per batch, which caps a DataLoader near a thousand batches per second.
So the workers write batches into slots allocated once (in the cache dtype), send only the slot number,
and the training process copies the slot out; a stamp per slot detects a slot overwritten before it was
read. ``shared_slots=False`` sends one tensor per batch instead.

Example (one process of ``torchrun``)::

    rank, world = rank_and_world_size()
    loader = Loader(cache.sequences(2048, overlap=1), batch_size=32, seed=0, rank=rank, world_size=world)
    data = DataLoader(loader, num_workers=4, pin_memory=True, persistent_workers=True)
    for batch in data:  # (32 // world, 2049) int64 tensors
        ...
    torch.save({"data": data.state_dict(), ...}, path)
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Any, NamedTuple

import numpy as np

from streampack.errors import LoaderStateError, OptionsError, extra_needed

with extra_needed("streampack.torch", "PyTorch", "torch"):
    import torch
    import torch.utils.data as torch_data

from streampack.loader import Loader
from streampack.loader.collate import Tokens
from streampack.loader.metrics import Made
from streampack.samples.sequences import PackedSequences

__all__ = ["DataLoader", "Dataset", "IterableDataset", "SourceLosses", "rank_and_world_size", "token_losses"]


def rank_and_world_size() -> tuple[int, int]:
    """This process's ``(rank, world_size)`` in the default ``torch.distributed`` group, else ``(0, 1)``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Dataset(torch_data.Dataset):
    """Map-style dataset of packed samples: ``dataset[i]`` is sample ``i`` as a 1-D tensor.

    A batch of indices is one vectorised read (``__getitems__``). Order, ranks and resuming are up to your
    sampler; :class:`DataLoader` over a :class:`~streampack.loader.Loader` does all three.

    Args:
        sequences: the samples, e.g. ``cache.sequences(2048)``.
        dtype: tensor dtype of the tokens, an integer type that holds every id of the cache dtype.

    Raises:
        OptionsError: ``dtype`` cannot hold every id of the cache dtype (``torch.int16`` for uint16).
    """

    def __init__(self, sequences: PackedSequences, *, dtype: torch.dtype = torch.int64) -> None:
        self.sequences = sequences
        self.dtype = dtype
        self._numpy_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        if self._numpy_dtype.kind not in "iu" or not np.can_cast(sequences.dtype, self._numpy_dtype, "safe"):
            raise OptionsError(
                f"dtype={dtype} cannot hold every id of the cache's {sequences.dtype} tokens; use "
                "torch.int64 (the default)"
            )

    def __len__(self) -> int:
        """Number of samples."""
        return len(self.sequences)

    def __repr__(self) -> str:
        return f"streampack.torch.Dataset({self.sequences!r}, dtype={self.dtype})"

    def __getitem__(self, index: int) -> torch.Tensor:
        """Sample ``index`` as a 1-D tensor of ``seq_len + overlap`` tokens."""
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        """Samples at ``indices``, read in one call; rows of one tensor, which the default collate stacks."""
        out = np.empty((len(indices), self.sequences.width), dtype=self._numpy_dtype)
        self.sequences.read(np.asarray(indices, dtype=np.int64), out=out)
        return list(torch.from_numpy(out))


class IterableDataset(torch_data.IterableDataset):
    """A rank's batches as tensors, split over DataLoader workers in order. Use with ``batch_size=None``.

    Iteration starts at the loader's position when the DataLoader iterator is created; the dataset never
    moves the loader (:class:`DataLoader` does, as it hands batches out). Persistent workers keep the
    order they started with, so after a :meth:`load_state_dict` that changed it (a mixture resumed with
    new weights) they refuse to iterate (:class:`LoaderStateError`); :class:`DataLoader` restarts them.

    Args:
        loader: the loader to serve; its ``collate``, if any, runs in the workers before conversion.
    """

    def __init__(self, loader: Loader) -> None:
        self.loader = loader
        # The start position and the digest of its order, in shared memory: it survives fork and spawn.
        self._start = torch.zeros(2, dtype=torch.int64).share_memory_()
        self._ring: _SlotRing | None = None  # set by DataLoader, which alone knows how to read slots
        self._measured = False  # send what making each batch took with it (DataLoader reads it)
        self.publish()

    def __repr__(self) -> str:
        return f"streampack.torch.IterableDataset({self.loader!r})"

    def publish(self) -> None:
        """Make the loader's current position the start of the next iteration, in every worker."""
        self._start[0] = self.loader.position
        self._start[1] = _order_digest(self.loader)

    def __iter__(self) -> Iterator[Any]:
        """Yield this worker's share of the batches from the published start, in schedule order."""
        info = torch_data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        start = int(self._start[0])
        if info is not None and int(self._start[1]) != _order_digest(self.loader):
            raise LoaderStateError(
                f"DataLoader worker {worker} reads the loader's order from when it started, but "
                "load_state_dict has since changed it (a mixture resumed with new weights or sources, or "
                "from another checkpoint's history), and persistent workers keep the order they were "
                "started with. Resume through streampack.torch.DataLoader, which restarts them, or use "
                "persistent_workers=False"
            )
        ring = self._ring if info is not None else None
        for position in islice(self.loader.schedule(start=start), worker, None, workers):
            if ring is not None:
                yield ring.put(self.loader, worker, position)
            elif self._measured:
                yield _Measured(self._make(position, in_worker=info is not None), self.loader.made)
            else:
                yield self._make(position, in_worker=info is not None)

    def _make(self, position: int, *, in_worker: bool) -> Any:
        loader = self.loader
        out = None
        if in_worker:
            dtype = np.dtype(loader.options.dtype or loader.source_dtype)
            out = _shared_array(loader.batch_shape(position), dtype)
        return _to_torch(loader.batch(position, out=None if out is None else out[1]), out)

    def state_dict(self) -> dict[str, Any]:
        """The loader's state (see :meth:`Loader.state_dict`)."""
        return self.loader.state_dict()

    def load_state_dict(self, state: Mapping[str, Any], *, step: int | None = None) -> None:
        """Resume the loader from ``state`` (``step``: the trainer's, for the loader's history)."""
        self.loader.load_state_dict(state, step=step)
        self.publish()


class DataLoader(torch_data.DataLoader):
    """``torch.utils.data.DataLoader`` over a :class:`~streampack.loader.Loader`, with exact resume.

    The loader makes the batches (this rank's rows of each global batch), so there is no ``batch_size``,
    ``sampler`` or ``collate_fn``; other DataLoader arguments pass through. Each batch handed out advances
    the loader, so :meth:`state_dict` after ``k`` batches resumes at batch ``k + 1``.

    Args:
        loader: the loader to serve.
        shared_slots: with workers, send batches through a ring of shared-memory slots (see the module
            docs); ``False`` sends each batch as a tensor of its own.
        **kwargs: ``num_workers``, ``pin_memory``, ``persistent_workers``, ``prefetch_factor``,
            ``multiprocessing_context``, ``timeout``, ... as for ``torch.utils.data.DataLoader``.

    Raises:
        OptionsError: a batching argument, or ``in_order=False``, was given.
    """

    pin_memory: bool  # torch's attribute, declared for type checking without torch installed

    def __init__(self, loader: Loader, *, shared_slots: bool = True, **kwargs: Any) -> None:
        for name in ("batch_size", "shuffle", "sampler", "batch_sampler", "collate_fn", "drop_last"):
            if name in kwargs:
                raise OptionsError(
                    f"streampack.torch.DataLoader makes batches with the Loader, so it takes no {name}= "
                    f"(got {name}={kwargs[name]!r}); set batch_size, shuffle, drop_last and collate on the "
                    "Loader instead"
                )
        if kwargs.get("in_order") is False:
            raise OptionsError(
                "streampack.torch.DataLoader hands batches out in schedule order, which resuming relies on; "
                "in_order=False is not supported"
            )
        dataset = IterableDataset(loader)
        dataset._measured = True
        super().__init__(dataset, batch_size=None, **kwargs)
        self._pin = False
        self._running = 0  # iterators started and not yet exhausted or closed
        if shared_slots and self.num_workers > 0 and _SlotRing.fits(loader):
            # Pinning happens on copy-out instead, as torch's, only where there is an accelerator.
            dataset._ring = _SlotRing(loader, self.num_workers, (self.prefetch_factor or 2) + 2)
            self._pin = bool(self.pin_memory) and _have_accelerator()
            self.pin_memory = False

    @property
    def loader(self) -> Loader:
        """The loader whose batches are served."""
        return self.dataset.loader  # type: ignore[attr-defined, unused-ignore]

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override, unused-ignore]
        """Yield batches from the loader's position, advancing it by one per batch handed out; each is
        counted in the loader's :meth:`~streampack.loader.Loader.metrics`, with the time this process was
        blocked waiting for it (the workers' time making it is not a wait)."""
        dataset: IterableDataset = self.dataset  # type: ignore[assignment, unused-ignore]
        dataset.publish()
        ring, wanted = dataset._ring, self.loader.options.dtype
        dtype = None if wanted is None else np.dtype(wanted)
        loader = dataset.loader
        self._running += 1
        try:
            batches = super().__iter__()
            while True:
                asked = time.perf_counter()  # stopped across the yield: the trainer's time is not a wait
                item = next(batches, None)
                if item is None:
                    return
                if isinstance(item, _Slot):
                    made, batch = item.made, ring.take(item, dtype, pin=self._pin)  # type: ignore[union-attr]
                else:
                    made, batch = item.made, item.batch
                loader.advance(1)
                loader.meter.add(time.perf_counter() - asked, made)
                yield batch
        finally:
            self._running -= 1

    def __len__(self) -> int:
        """Batches of the whole run: ``len(loader)``.

        Raises:
            TypeError: the run is endless (trainers then rely on ``max_steps``).
        """
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        """The loader's state after the batches handed out so far (small, JSON-serializable)."""
        return self.loader.state_dict()

    def load_state_dict(self, state: Mapping[str, Any], *, step: int | None = None) -> None:
        """Resume from :meth:`state_dict`; the next ``iter()`` starts there.

        ``step``, the trainer's step, goes into the loader's history. Refused while an iterator is running:
        its workers already make the batches of the old position (``break`` out of the loop first).

        Raises:
            LoaderStateError: an iterator is running, or the state does not fit the loader (see
                :meth:`Loader.load_state_dict`).
        """
        if self._running:
            raise LoaderStateError(
                "load_state_dict was called while an iterator over this DataLoader is running; call it "
                "before iter(), or break out of the loop first (or close() the iterator)"
            )
        before = self.loader.order.fingerprint()
        self.dataset.load_state_dict(state, step=step)  # type: ignore[attr-defined, unused-ignore]
        iterator = getattr(self, "_iterator", None)
        if self.loader.order.fingerprint() != before and iterator is not None:
            # Let persistent workers go: they hold the order from before the resume changed it.
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            self._iterator = None


_LOSS_CHUNK = 1 << 28  # logits a chunk of token_losses upcasts at once (1 GiB in float32)


def token_losses(
    logits: torch.Tensor, labels: torch.Tensor, shift_labels: torch.Tensor | None = None
) -> torch.Tensor:
    """The cross-entropy of every token's label, ``float32``, shaped and placed as ``labels``: column ``t``
    is predicted from the logits of column ``t - 1`` (Hugging Face causal LMs shift labels so), and the
    first column and every label of -100 lose 0. ``(losses * batch["loss_weights"]).sum()`` weighs them.

    Under context parallelism a rank's batch has ``shift_labels`` (a rank's columns are chunks of the row:
    the next column is not always the next token): given them, column ``t`` is the loss of
    ``shift_labels[:, t]`` predicted from the logits of column ``t``, and the batch's ``loss_weights`` are
    placed so too.

    Args:
        logits: ``(rows, seq_len, vocab)``, the model's.
        labels: ``(rows, seq_len)``, the batch's.
        shift_labels: the batch's ``shift_labels``, where it has them.
    """
    rows, columns = labels.shape
    if shift_labels is not None:
        return _cross_entropy(logits.flatten(0, 1), shift_labels.flatten()).view(rows, columns)
    first = torch.zeros((rows, 1), dtype=torch.float32, device=logits.device)
    if columns < 2:
        return first.expand(rows, columns).clone()
    losses = _cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    return torch.cat([first, losses.view(rows, columns - 1)], dim=1)


def targets_counted(labels: torch.Tensor, shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """Per row, how many of :func:`token_losses`' columns have a target (a label that is not -100)."""
    if shift_labels is not None:
        return (shift_labels != -100).sum(1)
    return (labels[:, 1:] != -100).sum(1)


def _cross_entropy(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each target's cross-entropy (``float32``; 0 for -100) from its row of ``inputs``."""
    # In float32 a chunk of tokens at a time: a whole batch's logits in float32 can take gigabytes.
    chunk = max(1, _LOSS_CHUNK // max(1, inputs.shape[-1]))
    pieces = [
        torch.nn.functional.cross_entropy(
            inputs[k : k + chunk].float(), targets[k : k + chunk], ignore_index=-100, reduction="none"
        )
        for k in range(0, len(targets), chunk)
    ]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.float32, device=inputs.device)


class SourceLosses:
    """The mean loss of each source of a mixture over the batches since the last :meth:`report`, per token.

    The framework adapters keep one: :mod:`streampack.hf` logs it with the Trainer's loss, and
    :func:`streampack.lightning.mixture_loss` each step.

    Args:
        names: the sources' names, by source id (``loader.order.names``).
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self._sums: torch.Tensor | None = None  # (sources,) float64: summed token losses, and their count
        self._counts: torch.Tensor | None = None

    def add(
        self,
        losses: torch.Tensor,
        labels: torch.Tensor,
        source_ids: torch.Tensor,
        shift_labels: torch.Tensor | None = None,
    ) -> None:
        """Count a batch's :func:`token_losses` (not weighted, of its ``labels`` and ``shift_labels`` if
        any), each row's to its source."""
        with torch.no_grad():
            rows = losses.detach().double().sum(1)
            counted = targets_counted(labels, shift_labels).double()
            if self._sums is None or self._counts is None:
                self._sums = torch.zeros(len(self.names), dtype=torch.float64, device=losses.device)
                self._counts = torch.zeros_like(self._sums)
            self._sums.index_add_(0, source_ids.to(self._sums.device), rows)
            self._counts.index_add_(0, source_ids.to(self._sums.device), counted)

    def report(self) -> dict[str, float]:
        """``loss/<name>`` of each source with tokens since the last report, summed over the ranks of
        ``torch.distributed`` when it runs (every rank must call it then), and start over."""
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        if self._sums is None or self._counts is None:  # nothing added: zeros where the collective runs
            cuda = distributed and dist.get_backend() == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
            self._sums = torch.zeros(len(self.names), dtype=torch.float64, device=device)
            self._counts = torch.zeros_like(self._sums)
        both = torch.stack([self._sums, self._counts])
        if distributed:
            dist.all_reduce(both)
        self._sums = self._counts = None
        sums, counts = both.tolist()
        return {f"loss/{name}": s / c for name, s, c in zip(self.names, sums, counts, strict=True) if c}


@dataclass(frozen=True)
class _Slot:
    """What a worker sends for a batch it wrote into the ring: the slot, the stamp it left there, and what
    making the batch took."""

    index: int
    rows: int
    stamp: tuple[int, int]
    made: Made | None = None


class _Measured(NamedTuple):
    """A batch and what making it took, as a worker sends them (a named tuple: pinning reaches inside)."""

    batch: Any
    made: Made | None


class _SlotRing:
    """Batch slots in shared memory: each worker cycles through its own, the training process copies out.

    Args:
        loader: the loader whose batches the slots hold (in the cache dtype).
        workers: DataLoader workers.
        per_worker: slots per worker; more than the batches a worker can have in flight.
    """

    def __init__(self, loader: Loader, workers: int, per_worker: int) -> None:
        rows, width = loader.options.rows, loader.width
        dtype = torch.from_numpy(np.empty(0, dtype=loader.source_dtype)).dtype
        self.per_worker = per_worker
        self.tokens = torch.zeros((workers * per_worker, rows, width), dtype=dtype).share_memory_()
        self.stamps = torch.zeros((workers * per_worker, 2), dtype=torch.int64).share_memory_()
        self._counter = 0

    @staticmethod
    def fits(loader: Loader) -> bool:
        """Whether batches are plain token arrays the ring can carry (no collate, no seq_len schedule)."""
        return (
            isinstance(loader.formatter, Tokens) and loader.collate is None and not loader.serves_sub_windows
        )

    def put(self, loader: Loader, worker: int, position: int) -> _Slot:
        """Write the batch at ``position`` into this worker's next slot (called in the worker)."""
        index = worker * self.per_worker + self._counter % self.per_worker
        self._counter += 1
        stamps = self.stamps.numpy()
        stamps[index] = -1  # mark the slot as being written before touching its tokens
        rows = loader.batch_shape(position)[0]
        loader.batch(position, out=self.tokens.numpy()[index, :rows])
        stamp = (os.getpid(), self._counter)
        stamps[index] = stamp
        return _Slot(index, rows, stamp, loader.made)

    def take(self, slot: _Slot, dtype: np.dtype | None, *, pin: bool) -> torch.Tensor:
        """Copy a slot out into a new tensor of ``dtype`` (the cache dtype when None)."""
        source = self.tokens.numpy()[slot.index, : slot.rows]
        torch_dtype = torch.from_numpy(np.empty(0, dtype=dtype or source.dtype)).dtype
        out = torch.empty(source.shape, dtype=torch_dtype, pin_memory=pin)
        self._check(slot)
        np.copyto(out.numpy(), source)
        self._check(slot)
        return out

    def _check(self, slot: _Slot) -> None:
        if tuple(self.stamps[slot.index].tolist()) != slot.stamp:
            raise RuntimeError(
                f"a batch slot in shared memory was overwritten before it was read (slot {slot.index}, "
                f"stamp {slot.stamp}, found {tuple(self.stamps[slot.index].tolist())}). This is a bug: "
                "please report it with your DataLoader settings, and use DataLoader(..., "
                "shared_slots=False) meanwhile."
            )


def _order_digest(loader: Loader) -> int:
    """A signed 64-bit digest of what the loader's positions mean: its order's fingerprint."""
    text = json.dumps(loader.order.fingerprint(), sort_keys=True, default=repr)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _have_accelerator() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    return bool(accelerator.is_available()) if accelerator is not None else torch.cuda.is_available()


def _shared_array(shape: tuple[int, int], dtype: np.dtype) -> tuple[torch.Tensor, np.ndarray]:
    """A tensor allocated in shared memory (as ``default_collate`` does), and a numpy view of it to fill:
    sending it to the training process then copies nothing."""
    torch_dtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    try:
        storage = torch.UntypedStorage._new_shared(nbytes)
        # torch's stubs lack the (source, offset, size) form that torch accepts
        tensor = torch.empty(0, dtype=torch_dtype).set_(storage, 0, shape)  # type: ignore[call-overload, unused-ignore]
    except (AttributeError, RuntimeError):  # pragma: no cover - other torch versions
        tensor = torch.empty(shape, dtype=torch_dtype).share_memory_()
    return tensor, tensor.numpy()


def _to_torch(batch: Any, shared: tuple[torch.Tensor, np.ndarray] | None) -> Any:
    """Turn numpy arrays into tensors sharing their memory (a filled shared array becomes its tensor)."""
    if shared is not None and batch is shared[1]:
        return shared[0]
    if isinstance(batch, np.ndarray):
        return torch.from_numpy(batch)
    if isinstance(batch, dict):
        return {key: _to_torch(value, shared) for key, value in batch.items()}
    return batch

"""torchdata's ``StatefulDataLoader`` over a :class:`~streampack.loader.Loader`, resuming from ITS state.

Install with ``pip install 'streampack[torchdata]'``. ``StatefulDataLoader`` checkpoints its sampler in
the main process at the index each batch was made from, whatever the workers prefetched, so the loader's
order enters it as a sampler: :class:`LoaderSampler` yields the loader's state at each batch to come, and
:class:`LoaderBatches` maps such a state to the loader's batch there. :func:`stateful_dataloader` puts the
two together::

    loader = streampack.Loader(seqs, batch_size=32, seed=0, rank=rank, world_size=world)
    data = streampack.torchdata.stateful_dataloader(loader, num_workers=2)
    for step, batch in enumerate(data):
        ...
        torch.save({"data": data.state_dict(), ...}, path)  # StatefulDataLoader's own state
    # later, in a new process: the same construction, then
    data.load_state_dict(torch.load(path)["data"])  # continues at the batch after the saved one

Resuming needs the same ``num_workers`` (torchdata's rule), and a state saved with another number is
refused, naming both. The sampler's state inside it (``_index_sampler_state``) is a plain loader state,
which resumes with any. Checkpoint the DataLoader's state, not the ``Loader``'s: the sampler advances a
copy of the loader.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator, Mapping
from typing import Any

from streampack._checks import is_int
from streampack.errors import LoaderStateError, OptionsError, extra_needed
from streampack.loader import Loader
from streampack.loader.state import LOADER_FORMAT, read_loader_state

with extra_needed("streampack.torchdata", "PyTorch and torchdata", "torchdata"):
    import torch.utils.data as torch_data
    from torch.utils.data._utils.collate import default_convert

__all__ = ["LoaderBatches", "LoaderSampler", "stateful_dataloader"]


class LoaderSampler(torch_data.Sampler):
    """Stateful sampler: the loader's state at each batch still to come, in schedule order.

    Its :meth:`state_dict` is the loader state after the last state it yielded, so a ``StatefulDataLoader``
    resumes at the next batch.

    Args:
        loader: the loader whose batches to schedule; it is copied, and the copy advances.
    """

    def __init__(self, loader: Loader) -> None:
        self._loader = copy.copy(loader)

    def __repr__(self) -> str:
        return f"streampack.torchdata.LoaderSampler({self._loader!r})"

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Yield the loader state at each batch from the current position on, advancing past each one."""
        loader = self._loader
        while not loader.finished:
            state = loader.state_dict()
            loader.advance(1)
            yield state

    def __len__(self) -> int:
        """Batches of the whole run; ``TypeError`` for an endless run."""
        return len(self._loader)

    def state_dict(self) -> dict[str, Any]:
        """The loader state at the batch after the last one yielded (small, JSON-serializable)."""
        return self._loader.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict` (or a :meth:`Loader.state_dict`).

        Raises:
            LoaderStateError: the state does not fit the loader (see :meth:`Loader.load_state_dict`).
        """
        self._loader.load_state_dict(state)


class LoaderBatches(torch_data.Dataset):
    """Map-style dataset of a loader's batches: the item at a loader state is the batch it starts with.

    Items are this rank's rows in the loader's output format, as tensors; pass ``batch_size=None`` to the
    DataLoader so that each item is one batch. A worker given a state of another order (a mixture resumed
    with new weights) resumes its copy of the loader from it first.

    Args:
        loader: the loader to read; each DataLoader worker gets a copy.
    """

    def __init__(self, loader: Loader) -> None:
        self.loader = loader
        self._order = loader.order.fingerprint()

    def __repr__(self) -> str:
        return f"streampack.torchdata.LoaderBatches({self.loader!r})"

    def __getitem__(self, state: Mapping[str, Any]) -> Any:
        """The batch at ``state`` (what :class:`LoaderSampler` yields), as tensors.

        Raises:
            LoaderStateError: ``state`` is not a loader state that fits the loader.
        """
        if not isinstance(state, Mapping) or "position" not in state:
            raise LoaderStateError(
                f"LoaderBatches is indexed by loader states, as LoaderSampler yields them (got {state!r}); "
                "pass sampler=LoaderSampler(loader) and batch_size=None to the DataLoader"
            )
        position = read_loader_state(state)["position"]
        if state.get("order") != self._order:
            self.loader.load_state_dict(state)  # a resumed mixture whose order changed
            self._order = self.loader.order.fingerprint()
        return default_convert(self.loader.batch(int(position)))


def stateful_dataloader(loader: Loader, **kwargs: Any) -> Any:
    """A torchdata ``StatefulDataLoader`` of the loader's batches whose own state resumes exactly.

    Args:
        loader: the loader to serve (not advanced: checkpoint the returned DataLoader's state).
        **kwargs: ``num_workers``, ``pin_memory``, ``persistent_workers``, ``prefetch_factor``,
            ``snapshot_every_n_steps``, ... as for ``StatefulDataLoader``.

    Returns:
        ``StatefulDataLoader(LoaderBatches(loader), sampler=LoaderSampler(loader), batch_size=None,
        **kwargs)``, whose ``load_state_dict`` refuses a state saved with another ``num_workers``
        (:class:`~streampack.errors.LoaderStateError`) rather than fail later with a bare ``AssertionError``.

    Raises:
        MissingDependencyError: torchdata is not installed.
        OptionsError: a batching argument was given (the loader makes the batches).
    """
    for name in ("batch_size", "shuffle", "sampler", "batch_sampler", "collate_fn", "drop_last"):
        if name in kwargs:
            raise OptionsError(
                f"the Loader makes the batches, so stateful_dataloader takes no {name}= (got "
                f"{name}={kwargs[name]!r}); set batch_size, shuffle, drop_last and collate on the Loader"
            )
    cls = _stateful_dataloader_class()
    return cls(LoaderBatches(loader), sampler=LoaderSampler(loader), batch_size=None, **kwargs)


@functools.cache
def _stateful_dataloader_class() -> type:
    """torchdata's ``StatefulDataLoader`` with its state's worker count checked on load (made once)."""
    with extra_needed("stateful_dataloader", "torchdata", "torchdata"):
        from torchdata.stateful_dataloader import StatefulDataLoader

    class LoaderStatefulDataLoader(StatefulDataLoader):
        """A ``StatefulDataLoader`` that refuses a state saved with another ``num_workers``."""

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            _check_workers(state_dict, self.num_workers)
            super().load_state_dict(state_dict)

    return LoaderStatefulDataLoader


def _check_workers(state: object, num_workers: int) -> None:
    """Refuse a ``StatefulDataLoader`` state that a DataLoader with ``num_workers`` cannot resume.

    With workers, torchdata's state is ``{"_snapshot": {"_main_snapshot": {"_num_workers": n, ...}, ...}}``;
    without, a flat dict with ``"_num_yielded"``.

    Raises:
        LoaderStateError: the state was saved with another ``num_workers``, or it is a streampack loader
            state rather than the DataLoader's.
    """
    if not isinstance(state, Mapping) or not state:
        return
    if state.get("format") == LOADER_FORMAT:
        raise LoaderStateError(
            "this is a streampack loader state (Loader.state_dict()), not a StatefulDataLoader state: load "
            "it into the Loader (loader.load_state_dict(state)) and make the DataLoader of it, or pass what "
            "the DataLoader's own state_dict() returned"
        )
    snapshot = state.get("_snapshot")
    if isinstance(snapshot, Mapping) and isinstance(snapshot.get("_main_snapshot"), Mapping):
        saved, inner = snapshot["_main_snapshot"].get("_num_workers"), "['_snapshot']['_main_snapshot']"
    elif "_num_yielded" in state:
        saved, inner = 0, ""
    else:
        return
    if not is_int(saved) or saved == num_workers:
        return  # the same number, or not a state of this torchdata's layout: torchdata judges it
    raise LoaderStateError(
        f"the DataLoader state was saved with num_workers={saved}, this DataLoader has "
        f"num_workers={num_workers}: torchdata's StatefulDataLoader resumes a state only with the "
        "num_workers that saved it (its state holds one part per worker). Create the DataLoader with "
        f"num_workers={saved}; or, to change the number, load the loader state inside it, "
        f"state{inner}['_index_sampler_state'], into the Loader (loader.load_state_dict(...)) and make a "
        f"new stateful_dataloader(loader, num_workers={num_workers}) of it"
    )

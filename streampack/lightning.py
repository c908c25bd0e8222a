"""Lightning: a ``LightningDataModule`` whose loader state Lightning's own checkpoints save and restore.

Install with ``pip install 'streampack[lightning]'`` (``lightning``, else ``pytorch_lightning``)::

    loader = streampack.Loader(cache.sequences(1024), batch_size=32, seed=0, rank=rank, world_size=world)
    data = streampack.lightning.DataModule(loader, num_workers=2)
    trainer = lightning.pytorch.Trainer(max_steps=10_000, callbacks=[ModelCheckpoint(...)])
    trainer.fit(model, datamodule=data)  # after a crash, the same with ckpt_path="last"

Lightning fetches one batch ahead of the step it runs, so a DataLoader that counts the batches it handed
out is one ahead of the model when a checkpoint is saved, and the resumed run would skip a batch. This
DataModule counts the batches the *model* received instead (a callback on ``on_train_batch_start``), so
a resumed run continues with exactly the batch an uninterrupted one would have had. A ``training_step``
that pulls batches itself from ``dataloader_iter`` is not supported.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Iterator, Mapping
from typing import Any, cast

from streampack._checks import is_int
from streampack.errors import extra_needed
from streampack.loader import Loader
from streampack.torch import DataLoader

with extra_needed("streampack.lightning", "Lightning", "lightning"):
    try:
        import lightning.pytorch as pl
    except ImportError:  # pragma: no cover - depends on the environment
        import pytorch_lightning as pl

__all__ = ["DataModule", "ModelPacedDataLoader"]


class ModelPacedDataLoader(DataLoader):
    """A :class:`streampack.torch.DataLoader` whose state counts only the batches a consumer confirmed.

    Each batch handed out stays pending until :meth:`consumed` confirms it (the :class:`DataModule`'s
    callback does, when the model receives it); :meth:`state_dict` is the loader state at the first
    pending batch. Takes the arguments of :class:`streampack.torch.DataLoader`.
    """

    def __init__(self, loader: Loader, **kwargs: Any) -> None:
        super().__init__(loader, **kwargs)
        self._pending: deque[int] = deque()  # positions of batches handed out and not yet consumed

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override, unused-ignore]
        """Yield batches like :class:`streampack.torch.DataLoader`, each pending until consumed."""
        self._pending.clear()
        batches = cast(Generator[Any, None, None], super().__iter__())
        try:
            while True:
                position = self.loader.position
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                self._pending.append(position)
                yield batch
        finally:
            batches.close()

    def consumed(self) -> None:
        """Confirm the oldest pending batch: the model has it."""
        if self._pending:
            self._pending.popleft()

    def state_dict(self) -> dict[str, Any]:
        """The loader state at the first batch handed out and not consumed (else at the next one)."""
        state = self.loader.state_dict()
        if self._pending:
            state["position"] = self._pending[0]
        return state

    def load_state_dict(self, state: Mapping[str, Any], *, step: int | None = None) -> None:
        """Resume from :meth:`state_dict` (see :meth:`streampack.torch.DataLoader.load_state_dict`)."""
        super().load_state_dict(state, step=step)
        self._pending.clear()


class DataModule(pl.LightningDataModule):
    """Serves a :class:`~streampack.loader.Loader` to a Lightning ``Trainer``, resumable exactly.

    Build the loader with this process's ``rank`` and ``world_size`` (the DDP rank under Lightning).

    Args:
        loader: the training loader.
        **dataloader_kwargs: ``num_workers``, ``pin_memory``, ``persistent_workers``, ... as for
            :class:`streampack.torch.DataLoader`.
    """

    def __init__(self, loader: Loader, **dataloader_kwargs: Any) -> None:
        super().__init__()
        self.loader = loader
        self.dataloader_kwargs = dataloader_kwargs
        self._train: ModelPacedDataLoader | None = None
        self._callback = _CountModelBatches(self)

    def setup(self, stage: str) -> None:
        """Add the callback that tells the DataLoader which batches the model received (once)."""
        trainer = self.trainer
        if trainer is not None and not any(c is self._callback for c in trainer.callbacks):
            trainer.callbacks.append(self._callback)

    def train_dataloader(self) -> ModelPacedDataLoader:
        """A DataLoader of the loader's batches from its current position."""
        accumulate = getattr(self.trainer, "accumulate_grad_batches", 1) if self.trainer else 1
        if isinstance(accumulate, int) and accumulate >= 1:  # the loader's history counts the steps
            self.loader.batches_per_step = accumulate
        self._train = ModelPacedDataLoader(self.loader, **self.dataloader_kwargs)
        return self._train

    def state_dict(self) -> dict[str, Any]:
        """The loader state at the first batch the model has not received (small, JSON-serializable)."""
        return self._train.state_dict() if self._train is not None else self.loader.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next batch is the first one the model had not received.

        Raises:
            LoaderStateError: the state does not fit the loader (see :meth:`Loader.load_state_dict`), or
                it came while a DataLoader iterator is running.
        """
        step = self._checkpoint_step()
        if self._train is not None:
            self._train.load_state_dict(state_dict, step=step)
        else:
            self.loader.load_state_dict(state_dict, step=step)

    def _checkpoint_step(self) -> int | None:
        """The ``global_step`` of the checkpoint being restored, for the loader's history."""
        trainer = getattr(self, "trainer", None)
        connector = getattr(trainer, "_checkpoint_connector", None)
        checkpoint = getattr(connector, "_loaded_checkpoint", None) or {}
        step = checkpoint.get("global_step") if isinstance(checkpoint, Mapping) else None
        return step if is_int(step) and step >= 0 else None


class _CountModelBatches(pl.Callback):
    """Confirms each training batch to the DataModule's DataLoader as the model receives it."""

    def __init__(self, datamodule: DataModule) -> None:
        self.datamodule = datamodule

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.datamodule._train is not None:
            self.datamodule._train.consumed()

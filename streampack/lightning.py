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

**Logs.** After each optimizer step the DataModule logs (``self.log``, so through the Trainer's logger)
the loader's data metrics per step (``data/wait_s``, ``data/make_s``, ``data/bytes_read``,
``data/prefetch_hits``, ``data/prefetch_misses``: :mod:`streampack.loader.metrics`), counted as the
DataLoader hands batches out (Lightning fetches one ahead). For a mixture, :func:`mixture_loss` computes a
dict batch's loss from the model's logits, weighted by its ``loss_weights`` if any, and logs each source's::

    def training_step(self, batch, batch_idx):
        inputs = {k: batch[k] for k in ("input_ids", "position_ids")}
        return streampack.lightning.mixture_loss(self, self.model(**inputs).logits, batch)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Iterator, Mapping
from typing import Any, cast

import torch

from streampack._checks import is_int
from streampack.errors import extra_needed
from streampack.loader import Loader
from streampack.loader.metrics import per_step
from streampack.torch import DataLoader, SourceLosses, targets_counted, token_losses

with extra_needed("streampack.lightning", "Lightning", "lightning"):
    try:
        import lightning.pytorch as pl
    except ImportError:  # pragma: no cover - depends on the environment
        import pytorch_lightning as pl

__all__ = ["DataModule", "ModelPacedDataLoader", "mixture_loss"]


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


def mixture_loss(
    module: pl.LightningModule,
    logits: torch.Tensor,
    batch: Mapping[str, torch.Tensor],
    *,
    names: tuple[str, ...] | None = None,
) -> torch.Tensor:
    """The loss of a mixture's dict batch from the model's logits, each source's loss logged.

    Token ``t``'s label is predicted from the logits of token ``t - 1`` (as Hugging Face causal LMs shift
    them; under context parallelism, ``shift_labels[t]`` from those of token ``t``). The loss is
    ``sum(loss_weights * token_loss) / tokens``, ``tokens`` the labels that are not -100 (the mean loss when
    the batch has no ``loss_weights``); ``loss/<name>``, each source's mean (unweighted) loss over its
    tokens in the batch, summed over the ranks, is logged with ``module.log``.
    Call it from ``training_step`` on every rank.

    Args:
        module: the LightningModule, whose ``log`` logs the sources' losses.
        logits: ``(rows, seq_len, vocab)``, the model's.
        batch: the batch, with ``labels`` and ``source_ids`` (and ``loss_weights``, if given).
        names: the sources' names by source id; by default the :class:`DataModule` loader's.

    Raises:
        KeyError: the batch has no ``source_ids``: it is not a mixture's dict batch.
    """
    labels, sources, shifted = batch["labels"], batch["source_ids"], batch.get("shift_labels")
    losses = token_losses(logits, labels, shifted)
    weights = batch.get("loss_weights")
    weighed = losses if weights is None else losses * weights
    loss = weighed.sum() / targets_counted(labels, shifted).sum().clamp(min=1)
    if names is None:
        datamodule = getattr(module.trainer, "datamodule", None)
        loader = datamodule.loader if isinstance(datamodule, DataModule) else None
        names = (
            tuple(loader.order.names)
            if loader is not None
            else tuple(map(str, range(int(sources.max()) + 1)))
        )
    counted = SourceLosses(names)
    counted.add(losses, labels, sources, shifted)
    for key, value in counted.report().items():  # the same keys on every rank: reduced already
        module.log(key, value, on_step=True, on_epoch=False, batch_size=len(labels))
    return loss


class _CountModelBatches(pl.Callback):
    """Confirms each training batch to the DataModule's DataLoader as the model receives it, and logs the
    loader's data metrics after each optimizer step."""

    def __init__(self, datamodule: DataModule) -> None:
        self.datamodule = datamodule
        self._logged: tuple[int, dict[str, float]] | None = None  # (step, metrics) at the last log

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.datamodule._train is not None:
            self.datamodule._train.consumed()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._logged = (trainer.global_step, self.datamodule.loader.metrics())

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step, before = self._logged or (0, None)
        if trainer.global_step > step:  # an optimizer step ended
            now = self.datamodule.loader.metrics()
            for key, value in per_step(now, before, trainer.global_step - step).items():
                pl_module.log(key, value, on_step=True, on_epoch=False, batch_size=1)
            self._logged = (trainer.global_step, now)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._logged = None

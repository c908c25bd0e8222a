"""Hugging Face ``transformers.Trainer`` fed by a :class:`~streampack.loader.Loader`, resuming exactly.

Install with ``pip install 'streampack[hf]'``. Pass the loader as ``train_dataset`` to :class:`Trainer`,
or to a Trainer class of your own with :class:`LoaderTrainerMixin` first among its bases::

    args = TrainingArguments("out", per_device_train_batch_size=8, max_steps=10_000, save_steps=500)
    loader = streampack.Loader(cache.sequences(1024), batch_size=8 * args.world_size, seed=0,
                               rank=args.process_index, world_size=args.world_size, output="dict")
    trainer = streampack.hf.Trainer(model=model, args=args, train_dataset=loader)
    trainer.train()  # after a crash: trainer.train(resume_from_checkpoint=True)

What it changes, and why:

* **Batches**: ``get_train_dataloader`` returns a :class:`streampack.torch.DataLoader` over the loader,
  not passed through accelerate, which would re-batch its batches or scatter them from rank 0. Every rank
  reads its own rows of each global batch.
* **Checkpoints**: every checkpoint folder gets ``streampack_loader.json``, the loader state after the
  batches of its steps.
* **Resume**: ``train(resume_from_checkpoint=...)`` loads that state first, with ``ignore_data_skip=True``,
  so nothing is replayed.
* **Logs**: every training log adds the loader's data metrics per step since the last log
  (``data/wait_s``, ``data/make_s``, ``data/bytes_read``, ``data/prefetch_hits``, ``data/prefetch_misses``:
  :mod:`streampack.loader.metrics`), and, of a mixture, each source's mean loss per token (``loss/<name>``).
* **Loss**: a mixture's batches carry ``source_ids`` and, with the ``loss_weights`` option,
  ``loss_weights``; ``compute_loss`` takes them out before the model sees them, and with weights computes
  the loss itself from the logits: ``sum(loss_weights * token_loss) / tokens`` (tokens: the labels that
  count, over the accumulated batches as the Trainer counts them), the Trainer's loss when every weight is 1.

**TRL**: ``class MyTrainer(LoaderTrainerMixin, trl.SFTTrainer)``. TRL's trainers take only a ``datasets``
dataset, so the mixin hands them a ``datasets.IterableDataset`` view of the loader's rows while they are
constructed, skips their dataset preparation, then trains on the loader itself. ``SFTConfig(packing=True)``
is refused: pack with ``cache.packed(seq_len)``.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from streampack._checks import is_int
from streampack.errors import LoaderStateError, OptionsError, extra_needed
from streampack.loader import Loader

with extra_needed("streampack.hf", "transformers and accelerate", "hf,torch"):
    import transformers
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from streampack.loader.metrics import per_step
from streampack.torch import DataLoader, SourceLosses, targets_counted, token_losses

__all__ = ["LOADER_STATE_NAME", "LoaderTrainerMixin", "Trainer"]

LOADER_STATE_NAME = "streampack_loader.json"
"""The file in each checkpoint folder that holds the loader state."""

if TYPE_CHECKING:
    from transformers import Trainer as _TrainerBase
else:
    _TrainerBase = object


class LoaderTrainerMixin(_TrainerBase):
    """Lets a ``transformers.Trainer`` class train on a :class:`~streampack.loader.Loader` and resume it.

    Put it first among the bases: ``class MyTrainer(LoaderTrainerMixin, SFTTrainer): ...``. A
    ``train_dataset`` that is not a ``Loader`` is left to the Trainer as usual.

    Raises:
        OptionsError: (at ``train()``) the loader's rank, world size or rows per rank do not match the
            Trainer's ``process_index``, ``world_size`` or per-device batch size.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        loader = kwargs.get("train_dataset", args[3] if len(args) > 3 else None)
        if isinstance(loader, Loader) and _checks_its_dataset(type(self)):
            args, kwargs = _with_rows_view(loader, args, kwargs)
        super().__init__(*args, **kwargs)
        if isinstance(loader, Loader):
            self.train_dataset = loader  # what the Trainer trains on, whatever its __init__ was handed
        self.add_callback(_SaveLoaderState(self))
        self._source_losses: SourceLosses | None = None
        self._data_logged: tuple[int, dict[str, float]] | None = None  # (step, metrics) at the last log
        if isinstance(self.train_dataset, Loader):
            # The loader resumes itself; a Trainer skipping batches would replay them and drop as many.
            self.args.ignore_data_skip = True

    def get_train_dataloader(self) -> Any:
        """A :class:`streampack.torch.DataLoader` over a ``Loader`` train dataset; else the Trainer's."""
        loader = self.train_dataset
        if not isinstance(loader, Loader):
            return super().get_train_dataloader()
        self.args.ignore_data_skip = True
        loader.batches_per_step = max(1, int(self.args.gradient_accumulation_steps))  # for its history
        _check_ranks(loader, self.args, self._train_batch_size)
        args = self.args
        options: dict[str, Any] = {
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory,
        }
        if args.dataloader_num_workers > 0:
            options["persistent_workers"] = args.dataloader_persistent_workers
            options["prefetch_factor"] = args.dataloader_prefetch_factor
            options["multiprocessing_context"] = args.dataloader_multiprocessing_context
        return DataLoader(loader, **options)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """Train; when resuming, the loader first continues from the checkpoint's loader state.

        Args:
            resume_from_checkpoint: a checkpoint folder, or ``True`` for the last one in ``output_dir``
                (as for ``transformers.Trainer.train``).
            *args: passed on to ``Trainer.train``.
            **kwargs: passed on to ``Trainer.train``.

        Raises:
            LoaderStateError: the checkpoint has no loader state, or it does not fit the loader.
        """
        if resume_from_checkpoint and isinstance(self.train_dataset, Loader):
            folder = resume_from_checkpoint
            if folder is True:
                folder = get_last_checkpoint(self.args.output_dir)
                if folder is None:
                    raise ValueError(f"no checkpoint found in output_dir {self.args.output_dir}")
            # The model checkpoint's step goes into the loader's history, for an audit to compare.
            step = _checkpoint_step(str(folder))
            self.train_dataset.load_state_dict(_read_state(str(folder)), step=step)
            resume_from_checkpoint = folder
        if isinstance(self.train_dataset, Loader):
            start = _checkpoint_step(str(resume_from_checkpoint)) if resume_from_checkpoint else 0
            self._data_logged = (start or 0, self.train_dataset.metrics())
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def compute_loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """The Trainer's loss of a batch; of a mixture's (``source_ids``), counted per source for the logs,
        and weighted by its ``loss_weights`` when it has them (see the module docs)."""
        loader = self.train_dataset
        if not isinstance(loader, Loader) or not isinstance(inputs, Mapping) or "source_ids" not in inputs:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        inputs = dict(inputs)
        sources, weights = inputs.pop("source_ids"), inputs.pop("loss_weights", None)
        labels, shifted = inputs["labels"], inputs.get("shift_labels")  # shift_labels: context parallelism
        if weights is None:
            loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
            losses = token_losses(outputs["logits"].detach(), labels, shifted)
        else:
            del inputs["labels"]  # the model need not compute the unweighted loss
            inputs.pop("shift_labels", None)
            outputs = model(**inputs)
            losses = token_losses(outputs["logits"], labels, shifted)
            tokens = num_items_in_batch
            if tokens is None:
                tokens = targets_counted(labels, shifted).sum()
            # a batch whose labels are all -100 loses 0
            least = tokens.clamp(min=1) if hasattr(tokens, "clamp") else max(1, int(tokens))
            loss = (losses * weights).sum() / least
            if num_items_in_batch is not None and self.args.average_tokens_across_devices:
                # As the Trainer does: the count is over every device, whose gradients DDP averages.
                loss = loss * self.accelerator.num_processes
        if self._source_losses is None:
            self._source_losses = SourceLosses(tuple(loader.order.names))
        self._source_losses.add(losses, labels, sources, shifted)
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Log ``logs``; to a training log of a ``Loader``, add its data metrics and the per-source losses."""
        loader = self.train_dataset
        if isinstance(loader, Loader) and "loss" in logs:  # a training log: every rank makes it at once
            if self._source_losses is not None:
                logs = {**logs, **self._source_losses.report()}
            step, before = self._data_logged or (0, None)
            now = loader.metrics()
            logs = {**logs, **per_step(now, before, self.state.global_step - step)}
            self._data_logged = (self.state.global_step, now)
        super().log(logs, *args, **kwargs)


class Trainer(LoaderTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` that takes a :class:`~streampack.loader.Loader` as ``train_dataset``.

    See :class:`LoaderTrainerMixin` and the module docs.
    """


def _checks_its_dataset(cls: type) -> bool:
    """Whether a class between the mixin and ``transformers.Trainer`` has an ``__init__`` of its own, which
    may refuse a train dataset that is not a ``datasets`` one (TRL's trainers do)."""
    mro = cls.__mro__
    after = mro[mro.index(LoaderTrainerMixin) + 1 :]
    return any("__init__" in vars(base) for base in after[: after.index(transformers.Trainer)])


def _with_rows_view(
    loader: Loader, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The Trainer's arguments with a ``datasets`` view of ``loader`` as its train dataset, and (for an
    ``SFTConfig``) dataset preparation skipped: the rows are already training rows."""
    view = _rows_view(loader)
    if "train_dataset" in kwargs:
        kwargs = {**kwargs, "train_dataset": view}
    else:
        args = (*args[:3], view, *args[4:])
    config = kwargs.get("args", args[1] if len(args) > 1 else None)
    if getattr(config, "packing", False):
        raise OptionsError(
            "packing=True packs the Trainer's own dataset, but the Loader's samples are trained as they "
            "come; set packing=False and pack with cache.packed(seq_len) (best-fit packing of documents)"
        )
    if config is not None and hasattr(config, "dataset_kwargs"):
        given = config.dataset_kwargs if isinstance(config.dataset_kwargs, dict) else {}
        config.dataset_kwargs = {**given, "skip_prepare_dataset": True}
    return args, kwargs


def _rows_view(loader: Loader) -> Any:
    """A ``datasets.IterableDataset`` of the rows of ``loader``'s batches (dicts of lists), with the
    loader's ``len()``; iterating it never moves the loader."""
    with extra_needed("this Trainer, which takes only a datasets.Dataset,", "datasets", "hf"):
        import datasets
    view = datasets.IterableDataset.from_generator(_rows, gen_kwargs={"loader": loader})
    view.__class__ = _sized_rows_class()  # the same object, with a length: Trainer checks one for epochs
    view._streampack_loader = loader
    return view


def _rows(loader: Loader) -> Any:
    for position in loader.schedule():
        batch = loader.batch(position)
        columns = batch if isinstance(batch, dict) else {"input_ids": batch}
        rows = {key: value for key, value in columns.items() if getattr(value, "ndim", 0) == 2}
        for row in range(len(rows["input_ids"])):
            yield {key: value[row].tolist() for key, value in rows.items()}


@functools.lru_cache(maxsize=1)
def _sized_rows_class() -> type:
    import datasets

    class LoaderRows(datasets.IterableDataset):
        """A ``datasets.IterableDataset`` of a Loader's rows, with the loader's ``len()``."""

        _streampack_loader: Loader

        def __len__(self) -> int:
            return len(self._streampack_loader)

    return LoaderRows


class _SaveLoaderState(transformers.TrainerCallback):
    """Writes the loader state into each checkpoint folder, from the process that saves checkpoints."""

    def __init__(self, trainer: LoaderTrainerMixin) -> None:
        self.trainer = trainer

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        loader = self.trainer.train_dataset
        if not isinstance(loader, Loader) or not args.should_save:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if os.path.isdir(folder):  # absent under hyperparameter search, which saves per trial
            path = os.path.join(folder, LOADER_STATE_NAME)
            with open(path + ".tmp", "w") as file:
                json.dump(loader.state_dict(), file)
            os.replace(path + ".tmp", path)


def _checkpoint_step(folder: str) -> int | None:
    """The Trainer's ``global_step`` its checkpoint folder records (``trainer_state.json``), if any."""
    try:
        with open(os.path.join(folder, "trainer_state.json")) as file:
            step = json.load(file).get("global_step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if is_int(step) and step >= 0 else None


def _read_state(folder: str) -> Any:
    path = os.path.join(folder, LOADER_STATE_NAME)
    try:
        with open(path) as file:
            return json.load(file)
    except FileNotFoundError:
        raise LoaderStateError(
            f"{path} does not exist: the checkpoint {folder} was not saved by streampack.hf (or its "
            f"{LOADER_STATE_NAME} was removed), so where the data stopped is unknown. Resume from a "
            "checkpoint saved by streampack.hf.Trainer, or load a Loader state yourself and train without "
            "resume_from_checkpoint"
        ) from None
    except (OSError, ValueError) as error:
        raise LoaderStateError(f"{path}: cannot read the loader state ({error}); it is damaged") from error


def _check_ranks(loader: Loader, args: Any, rows: int) -> None:
    """Refuse a loader built for another rank, world size or per-device batch size than the Trainer's."""
    opts = loader.options
    if (opts.rank, opts.world_size) != (args.process_index, args.world_size):
        raise OptionsError(
            f"the Loader was built for rank {opts.rank} of {opts.world_size}, but this Trainer process is "
            f"rank {args.process_index} of {args.world_size}: ranks would read the same rows. Build it with "
            "Loader(..., rank=args.process_index, world_size=args.world_size)"
        )
    if opts.rows != rows:
        raise OptionsError(
            f"the Loader gives each rank {opts.rows} rows per batch (batch_size={opts.batch_size} over "
            f"{opts.world_size} ranks), but the Trainer's per-device batch size is {rows}; set "
            f"per_device_train_batch_size={opts.rows}, or Loader(batch_size={rows * opts.world_size})"
        )

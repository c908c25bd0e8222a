"""Tests for `streampack.lightning`: Lightning's own checkpoints resume the loader at the model's batch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from streampack.samples import PackedSequences

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch", reason="needs pip install 'streampack[lightning]'")

import streampack  # noqa: E402
import streampack.lightning  # noqa: E402
from tests.frameworks import VOCAB, numbered_cache, sample_ids  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def seqs(tmp_path_factory: pytest.TempPathFactory) -> PackedSequences:
    return numbered_cache(tmp_path_factory.mktemp("lightning") / "c").sequences(8)


class TinyLM(pl.LightningModule):
    """An embedding and a linear head, recording the sample ids of every batch it trains on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)
        self.seen: list[list[int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.seen.append(sample_ids(batch))
        logits = self.head(self.embed(batch[:, :-1]))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(
    seqs: PackedSequences,
    out: Path,
    max_steps: int,
    *,
    epochs: int | None,
    resume: Path | None = None,
    workers: int = 0,
) -> list[list[int]]:
    checkpoint = pl.callbacks.ModelCheckpoint(out, every_n_train_steps=3, save_top_k=-1)
    trainer = pl.Trainer(
        max_steps=max_steps,
        max_epochs=1 if epochs else -1,
        callbacks=[checkpoint],
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = TinyLM()
    loader = streampack.Loader(seqs, batch_size=4, seed=5, epochs=epochs)
    data = streampack.lightning.DataModule(loader, num_workers=workers)
    trainer.fit(model, datamodule=data, ckpt_path=resume)
    return model.seen


# An endless loader has no length, so Lightning fetches a batch ahead; with one, it does not.
@pytest.mark.parametrize("epochs", [None, 1])
def test_lightning_checkpoint_resumes_at_the_first_batch_the_model_had_not_seen(
    seqs: PackedSequences, tmp_path: Path, epochs: int | None
) -> None:
    uninterrupted = fit(seqs, tmp_path / "a", 7, epochs=epochs)
    first = fit(seqs, tmp_path / "b", 3, epochs=epochs)
    checkpoint = tmp_path / "b" / "epoch=0-step=3.ckpt"
    saved = torch.load(checkpoint, weights_only=False)
    assert saved["DataModule"]["position"] == 3 * 4  # three batches of 4 trained on, not the one fetched
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [saved["DataModule"]]
    json.dumps(saved["DataModule"])
    rest = fit(seqs, tmp_path / "b", 7, epochs=epochs, resume=checkpoint, workers=1)
    assert first + rest == uninterrupted
    assert len(uninterrupted) == 7


def test_datamodule_state_after_fit_excludes_the_batch_fetched_ahead(
    seqs: PackedSequences, tmp_path: Path
) -> None:
    loader = streampack.Loader(seqs, batch_size=4, seed=5)
    data = streampack.lightning.DataModule(loader)
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyLM(), datamodule=data)
    assert loader.position == 3 * 4  # Lightning fetched a third batch
    assert data.state_dict()["position"] == 2 * 4
    fresh = streampack.Loader(seqs, batch_size=4, seed=5)
    fresh.load_state_dict(data.state_dict())
    assert sample_ids(fresh.batch(fresh.position)) == sample_ids(loader.batch(8))


# --- a mixture: each source's loss, and the data metrics, through Lightning's logger ----------------------


class MixtureLM(TinyLM):
    """TinyLM on a mixture's dict batches, its loss from streampack.lightning.mixture_loss."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        logits = self.head(self.embed(batch["input_ids"]))
        return streampack.lightning.mixture_loss(self, logits, batch)


class Remembered(pl.loggers.logger.Logger):
    """A logger that keeps what it is given: (step, metrics)."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "remembered"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((int(step or 0), dict(metrics)))


def test_lightning_logs_each_sources_loss_and_the_data_metrics_per_step(
    seqs: PackedSequences, tmp_path: Path
) -> None:
    from streampack.order.mixture import Mixture

    mix = Mixture({"web": seqs, "code": seqs}, weights={"web": 0.5, "code": 0.5}, block_size=8, seed=1)
    loader = streampack.Loader(mix, batch_size=4, output="dict", loss_weights={"code": 0.5})
    logger = Remembered()
    trainer = pl.Trainer(
        max_steps=6,
        accelerator="cpu",
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(MixtureLM(), datamodule=streampack.lightning.DataModule(loader, num_workers=1))
    logged = [metrics for _, metrics in logger.logged if "data/bytes_read" in metrics]
    assert len(logged) == 6
    batch_bytes = 4 * 8 * seqs.dtype.itemsize
    # Counted as the DataLoader hands batches out (one ahead of the model): one batch a step.
    assert all(metrics["data/bytes_read"] == batch_bytes and metrics["data/wait_s"] > 0 for metrics in logged)
    assert loader.metrics()["batches"] in (6, 7)
    losses = [metrics for _, metrics in logger.logged if {"loss/web", "loss/code"} & set(metrics)]
    assert len(losses) == 6 and all(
        value > 0 for m in losses for k, value in m.items() if k.startswith("loss/")
    )


def test_mixture_loss_weighs_each_token_by_its_sources_weight(seqs: PackedSequences) -> None:
    from streampack.order.mixture import Mixture

    mix = Mixture({"web": seqs, "code": seqs}, weights={"web": 0.5, "code": 0.5}, block_size=8, seed=2)
    loader = streampack.Loader(mix, batch_size=8, output="dict", loss_weights={"code": 0.5})
    batch = {key: torch.as_tensor(value) for key, value in loader.batch(0).items()}
    torch.manual_seed(0)
    logits = torch.randn(8, 8, VOCAB)
    loss = streampack.lightning.mixture_loss(MixtureLM(), logits, batch, names=("web", "code"))

    def summed(rows: Any) -> Any:  # the cross-entropy summed over the labels of ``rows``, shifted
        labels = torch.where(rows[:, None], batch["labels"], -100)[:, 1:]
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum"
        )

    web = batch["source_ids"] == 0
    assert web.any() and not web.all()
    tokens = (batch["labels"][:, 1:] != -100).sum()
    assert float(loss) == pytest.approx(float((summed(web) + 0.5 * summed(~web)) / tokens), rel=1e-6)

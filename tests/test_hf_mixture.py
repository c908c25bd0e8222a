"""`streampack.hf` over a mixture: per-source losses and data metrics in the Trainer's logs, loss weights in
its loss; a real `transformers.Trainer` and a tiny GPT-2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("accelerate", reason="Trainer needs accelerate: pip install 'streampack[hf]'")
pytest.importorskip("transformers", reason="streampack.hf needs pip install 'streampack[hf]'")

import torch

import streampack
import streampack.hf
from streampack.order.mixture import Mixture
from tests.frameworks import SEQ_LEN, numbered_cache, tiny_gpt2

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

ROWS, ACCUMULATE = 4, 2


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> tuple[streampack.Cache, streampack.Cache]:
    root = tmp_path_factory.mktemp("hf-mixture")
    return numbered_cache(root / "web"), numbered_cache(root / "code")


def _loader(caches: Any, **options: Any) -> streampack.Loader:
    web, code = caches
    mix = Mixture(
        {"web": web.sequences(SEQ_LEN), "code": code.sequences(SEQ_LEN)},
        weights={"web": 0.5, "code": 0.5},
        block_size=8,
        seed=3,
    )
    return streampack.Loader(mix, batch_size=ROWS, output="dict", **options)


def _trainer(loader: streampack.Loader, out: Path, max_steps: int, workers: int = 0) -> streampack.hf.Trainer:
    from transformers import TrainingArguments

    args = TrainingArguments(
        str(out),
        per_device_train_batch_size=ROWS,
        gradient_accumulation_steps=ACCUMULATE,
        max_steps=max_steps,
        save_steps=2,
        logging_steps=1,
        dataloader_num_workers=workers,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        learning_rate=1e-3,
    )
    return streampack.hf.Trainer(model=tiny_gpt2(), args=args, train_dataset=loader)


def _training_logs(trainer: Any) -> list[dict[str, float]]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.slow
def test_the_trainer_logs_each_sources_loss_and_the_data_metrics_per_step_across_a_resume(
    caches: Any, tmp_path: Path
) -> None:
    trainer = _trainer(_loader(caches), tmp_path, 4, workers=1)
    trainer.train()
    logs = _training_logs(trainer)
    assert [entry["step"] for entry in logs] == [1, 2, 3, 4]
    step_bytes = ACCUMULATE * ROWS * SEQ_LEN * caches[0].dtype.itemsize
    for entry in logs:
        assert entry["data/bytes_read"] == step_bytes  # what each step's batches read, exactly
        assert entry["data/wait_s"] > 0 and entry["data/make_s"] > 0
        assert entry["data/prefetch_hits"] == entry["data/prefetch_misses"] == 0  # a local cache
        assert {"loss/web", "loss/code"} & set(entry)
        assert all(entry[key] > 0 for key in ("loss/web", "loss/code") if key in entry)
    resumed = _trainer(_loader(caches), tmp_path, 6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    later = [entry for entry in _training_logs(resumed) if entry["step"] > 4]
    assert [entry["step"] for entry in later] == [5, 6]
    assert all(entry["data/bytes_read"] == step_bytes for entry in later)


def _first_batch(loader: streampack.Loader) -> dict[str, torch.Tensor]:
    return {key: torch.as_tensor(value) for key, value in loader.batch(0).items()}


def _model_loss(model: Any, batch: dict[str, torch.Tensor], rows: torch.Tensor) -> tuple[float, int]:
    """The model's own mean loss over the tokens of ``rows``, and how many tokens count."""
    labels = torch.where(rows[:, None], batch["labels"], -100)
    loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=labels).loss
    return float(loss), int((labels[:, 1:] != -100).sum())


def test_loss_weights_weigh_each_sources_tokens_in_the_trainers_loss(caches: Any, tmp_path: Path) -> None:
    loader = _loader(caches, loss_weights={"code": 0.0, "web": 2.0})
    trainer = _trainer(loader, tmp_path, 1)
    model = trainer.model.eval()  # no dropout: each forward pass the same
    batch = _first_batch(loader)
    web = batch["source_ids"] == 0
    assert web.any() and not web.all()
    with torch.no_grad():
        loss = trainer.compute_loss(model, dict(batch))
        web_loss, web_tokens = _model_loss(model, batch, web)
        code_loss, code_tokens = _model_loss(model, batch, ~web)
        # Each token's loss times its weight, over every token that counts: code's weigh 0, web's twice.
        assert float(loss) == pytest.approx(
            2.0 * web_loss * web_tokens / (web_tokens + code_tokens), rel=1e-5
        )
        assert trainer._source_losses is not None
        assert trainer._source_losses.report() == pytest.approx(
            {"loss/web": web_loss, "loss/code": code_loss}
        )
        plain = _trainer(_loader(caches), tmp_path / "plain", 1)
        unweighted = plain.compute_loss(
            model, dict(batch) | {"loss_weights": torch.ones_like(batch["labels"])}
        )
        assert float(unweighted) == pytest.approx(
            float(model(**{k: batch[k] for k in ("input_ids", "labels", "position_ids")}).loss)
        )

"""Tests for `streampack.hf`: a real `transformers.Trainer` trains, checkpoints and resumes exactly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from streampack.samples import PackedSequences

pytest.importorskip("torch")
pytest.importorskip("accelerate", reason="Trainer needs accelerate: pip install 'streampack[hf]'")
pytest.importorskip("transformers", reason="streampack.hf needs pip install 'streampack[hf]'")

import streampack
import streampack.hf
from streampack.errors import LoaderStateError, OptionsError
from tests.frameworks import numbered_cache, sample_ids, tiny_gpt2

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module")
def seqs(tmp_path_factory: pytest.TempPathFactory) -> PackedSequences:
    return numbered_cache(tmp_path_factory.mktemp("hf") / "c").sequences(8)


class Recording(streampack.hf.Trainer):
    """Records the sample ids of every batch the model trains on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[list[int]] = []

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        self.seen.append(sample_ids(inputs))
        return super().training_step(model, inputs, num_items_in_batch)


def train(
    seqs: PackedSequences,
    out: Path,
    max_steps: int,
    resume: bool = False,
    workers: int = 0,
    exclude: streampack.loader.Exclusions | None = None,
) -> list[list[int]]:
    from transformers import TrainingArguments

    args = TrainingArguments(
        str(out),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=max_steps,
        save_steps=3,
        dataloader_num_workers=workers,
        use_cpu=True,
        report_to=[],
        logging_strategy="no",
        disable_tqdm=True,
    )
    loader = streampack.Loader(seqs, batch_size=4, seed=1, output="dict", exclude=exclude)
    trainer = Recording(model=tiny_gpt2(), args=args, train_dataset=loader)
    trainer.train(resume_from_checkpoint=resume or None)
    return trainer.seen


@pytest.mark.slow
def test_trainer_resumes_at_the_next_batch_with_nothing_replayed(
    seqs: PackedSequences, tmp_path: Path
) -> None:
    uninterrupted = train(seqs, tmp_path / "a", max_steps=6)
    assert len(uninterrupted) == 12  # 6 steps of 2 accumulated batches
    first = train(seqs, tmp_path / "b", max_steps=3)
    state = json.loads((tmp_path / "b" / "checkpoint-3" / streampack.hf.LOADER_STATE_NAME).read_text())
    assert state["position"] == 3 * 2 * 4
    # A new process would build all of this anew: a new model, Trainer and Loader at position 0.
    rest = train(seqs, tmp_path / "b", max_steps=6, resume=True, workers=1)
    assert first + rest == uninterrupted


@pytest.mark.slow
def test_trainer_resumed_with_an_exclusion_of_its_steps_skips_those_steps_under_accumulation(
    seqs: PackedSequences, tmp_path: Path
) -> None:
    """Exclusions(steps=...) names the Trainer's steps: with gradient accumulation 2, step 4 of a run
    resumed at step 3 is the batches of positions 32-40 (4 rows, 2 batches a step), which the model does not
    see; the step after serves what step 5 did."""
    uninterrupted = train(seqs, tmp_path / "a", max_steps=6)
    first = train(seqs, tmp_path / "b", max_steps=3)
    spike = streampack.loader.Exclusions(steps=[(4, 4)])
    rest = train(seqs, tmp_path / "b", max_steps=6, resume=True, exclude=spike)
    assert first == uninterrupted[:6]
    assert rest[:2] == uninterrupted[6:8] and rest[2:4] == uninterrupted[10:12]
    assert not {s for batch in uninterrupted[8:10] for s in batch} & {s for batch in rest for s in batch}
    state = json.loads((tmp_path / "b" / "checkpoint-6" / streampack.hf.LOADER_STATE_NAME).read_text())
    assert [(e["step"], e["batches_per_step"]) for e in state["history"]] == [(None, 2), (3, 2)]


def test_trainer_refuses_a_loader_of_another_shape_and_a_checkpoint_without_a_state(
    seqs: PackedSequences, tmp_path: Path
) -> None:
    from transformers import TrainingArguments

    args = TrainingArguments(
        str(tmp_path), per_device_train_batch_size=2, max_steps=1, use_cpu=True, report_to=[]
    )
    wrong_rows = streampack.Loader(seqs, batch_size=4, output="dict")
    with pytest.raises(OptionsError, match=r"4 rows per batch .* per-device batch size is 2; set"):
        streampack.hf.Trainer(model=tiny_gpt2(), args=args, train_dataset=wrong_rows).train()
    wrong_rank = streampack.Loader(seqs, batch_size=4, rank=1, world_size=2, output="dict")
    with pytest.raises(OptionsError, match=r"built for rank 1 of 2, but this Trainer process is rank 0 of 1"):
        streampack.hf.Trainer(model=tiny_gpt2(), args=args, train_dataset=wrong_rank).train()
    (tmp_path / "checkpoint-5").mkdir()
    loader = streampack.Loader(seqs, batch_size=2, output="dict")
    trainer = streampack.hf.Trainer(model=tiny_gpt2(), args=args, train_dataset=loader)
    with pytest.raises(LoaderStateError, match=r"checkpoint-5/streampack_loader.json does not exist"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-5"))


def with_project_on_path() -> dict[str, str]:
    """The environment, with the project root first on PYTHONPATH (scripts import tests.frameworks)."""
    root = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


_DDP_SCRIPT = """
import json, os, sys
from pathlib import Path
import torch.distributed as dist
from transformers import TrainingArguments
import streampack, streampack.hf
from tests.frameworks import sample_ids, tiny_gpt2

class Recording(streampack.hf.Trainer):
    seen = None
    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen.append(sample_ids(inputs))
        return super().training_step(model, inputs, num_items_in_batch)

def train(out, max_steps, resume=False):
    args = TrainingArguments(out, per_device_train_batch_size=2, max_steps=max_steps, save_steps=2,
                             use_cpu=True, ddp_backend="gloo", report_to=[], logging_strategy="no",
                             disable_tqdm=True)
    loader = streampack.Loader(streampack.open(sys.argv[1]).sequences(8), batch_size=2 * args.world_size,
                               seed=2, rank=args.process_index, world_size=args.world_size, output="dict")
    trainer = Recording(model=tiny_gpt2(), args=args, train_dataset=loader)
    trainer.seen = []
    trainer.train(resume_from_checkpoint=resume or None)
    return trainer.seen

out = Path(sys.argv[2])
mine = {"full": train(str(out / "a"), 4), "first": train(str(out / "b"), 2)}
mine["rest"] = train(str(out / "b"), 4, resume=True)
everyone = [None] * dist.get_world_size()
dist.all_gather_object(everyone, mine)
if dist.get_rank() == 0:
    (out / "seen.json").write_text(json.dumps(everyone))

# Torn down here, as the other torchrun scripts of the suite do: a gloo process group left to the
# interpreter's exit once aborted a rank there ("terminate called without an active exception").
if dist.is_initialized():
    dist.barrier()
    dist.destroy_process_group()
# Even so a rank's interpreter exit aborted once more in CI (the same message, rank 1, 2026-12-04), after
# its work was done and the group torn down: in torch's or transformers' native teardown, not here.
# What this test checks is the work, so a rank leaves without that teardown.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


@pytest.mark.slow
def test_trainer_under_torchrun_gives_each_rank_its_rows_and_resumes_exactly(
    seqs: PackedSequences, tmp_path: Path
) -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this Python")
    script = tmp_path / "ddp.py"
    script.write_text(textwrap.dedent(_DDP_SCRIPT))
    run = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", str(script), seqs.path, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=with_project_on_path(),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = json.loads((tmp_path / "seen.json").read_text())
    reference = streampack.Loader(seqs, batch_size=4, seed=2)
    for rank, seen in enumerate(ranks):
        assert seen["first"] + seen["rest"] == seen["full"]
        # Rank r trains on its half of each global batch, as the loader defines it.
        expected = [sample_ids(reference.batch(4 * step))[2 * rank : 2 * rank + 2] for step in range(4)]
        assert seen["full"] == expected


def trl_train(
    seqs: PackedSequences, out: Path, tokenizer: Any, max_steps: int, resume: bool = False
) -> tuple[list[list[int]], Any]:
    """Train with the README's own-Trainer path over TRL's SFTTrainer; the batches it trained on."""
    import trl

    class SFT(streampack.hf.LoaderTrainerMixin, trl.SFTTrainer):
        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            self.seen.append(sample_ids(inputs))
            return super().training_step(model, inputs, num_items_in_batch)

    args = trl.SFTConfig(
        str(out),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=max_steps,
        save_steps=3,
        use_cpu=True,
        bf16=False,
        report_to=[],
        logging_strategy="no",
        disable_tqdm=True,
    )
    loader = streampack.Loader(seqs, batch_size=4, seed=1, output="dict")
    trainer = SFT(model=tiny_gpt2(), args=args, train_dataset=loader, processing_class=tokenizer)
    trainer.seen = []
    assert trainer.train_dataset is loader and loader.position == 0  # the view TRL saw moved nothing
    trainer.train(resume_from_checkpoint=resume or None)
    return trainer.seen, trainer


@pytest.mark.slow
def test_trl_sft_trainer_with_the_mixin_trains_checkpoints_and_resumes_exactly(
    seqs: PackedSequences, tmp_path: Path, bpe_tokenizer: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("trl", reason="the TRL path needs trl (the dev extra has it)")
    from transformers import PreTrainedTokenizerFast

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # TRL pings the Hub at construction otherwise
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(bpe_tokenizer), pad_token="<|endoftext|>")
    uninterrupted, trainer = trl_train(seqs, tmp_path / "a", tokenizer, max_steps=6)
    assert uninterrupted == [sample_ids(trainer.train_dataset.batch(4 * i)) for i in range(12)]
    first, _ = trl_train(seqs, tmp_path / "b", tokenizer, max_steps=3)
    state = json.loads((tmp_path / "b" / "checkpoint-3" / streampack.hf.LOADER_STATE_NAME).read_text())
    assert state["position"] == 3 * 2 * 4
    rest, _ = trl_train(seqs, tmp_path / "b", tokenizer, max_steps=6, resume=True)
    assert first + rest == uninterrupted

    import trl

    class SFT(streampack.hf.LoaderTrainerMixin, trl.SFTTrainer):
        pass

    packing = trl.SFTConfig(str(tmp_path / "c"), packing=True, use_cpu=True, bf16=False, report_to=[])
    loader = streampack.Loader(seqs, batch_size=8, output="dict")
    with pytest.raises(OptionsError, match=r"packing=True packs the Trainer's own dataset.*cache\.packed"):
        SFT(model=tiny_gpt2(), args=packing, train_dataset=loader, processing_class=tokenizer)

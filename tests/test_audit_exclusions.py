"""The audit of a run with exclusions: it re-applies them where the history says they were in force, so a
run with skip exclusions resumed through batch-size, world-size and mixture changes audits clean with the
counts its loaders really served, and one whose model trained on an excluded document is flagged."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import streampack
from streampack.errors import LoaderStateError
from streampack.loader import Exclusions, Loader
from streampack.order.mixture import Mixture
from streampack.runs.audit import audit
from tests.conftest import run_cli
from tests.test_exclusions import SEQ_LEN, _numbered


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> tuple[streampack.Cache, streampack.Cache]:
    root = tmp_path_factory.mktemp("ax")
    return _numbered(root / "a", 240, 0), _numbered(root / "b", 160, 1)


def _served(ranks: list[Loader], steps: int, seen: Counter[tuple[str, int]]) -> None:
    """Train ``steps`` global steps on the loaders of every rank, counting each (source, sample) served."""
    for _ in range(steps):
        for loader in ranks:
            sources, samples = loader.picks(loader.position)
            for source, sample in zip(sources.tolist(), samples.tolist(), strict=True):
                seen[loader.order.names[source], sample] += 1
            loader.advance(1)


@pytest.mark.slow
def test_a_run_with_skip_exclusions_audits_clean_with_what_it_served(
    caches: tuple[streampack.Cache, streampack.Cache], tmp_path: Path
) -> None:
    a, b = (cache.sequences(SEQ_LEN) for cache in caches)
    first = Exclusions(documents={"a": [3, 40, 41]}, steps=[(2, 3)])
    later = Exclusions(documents={"b": [7, 8]}, positions=[(100, 140)])
    seen: Counter[tuple[str, int]] = Counter()
    run = Loader(
        Mixture({"a": a, "b": b}, {"a": 1, "b": 1}, block_size=16, seed=4), batch_size=8, exclude=first
    )
    _served([run], 6, seen)
    again = Loader(
        Mixture({"a": a, "b": b}, {"a": 3, "b": 1}, block_size=16, seed=4),
        batch_size=12,
        exclude=[first, later],
    )
    again.load_state_dict(run.state_dict(), step=6)
    _served([again], 7, seen)
    ranks = [
        Loader(
            Mixture({"a": a, "b": b}, {"a": 3, "b": 1}, block_size=16, seed=4),
            batch_size=4,
            rank=rank,
            world_size=2,
            exclude=[first, later],
        )
        for rank in range(2)
    ]
    for loader in ranks:
        loader.load_state_dict(json.loads(json.dumps(again.state_dict())), step=13)
    _served(ranks, 9, seen)
    state = ranks[0].state_dict()
    mixture = Mixture({"a": a, "b": b}, {"a": 1}, block_size=16, seed=4)
    report = audit(state, mixture, exclude=[first, later])
    assert report.clean, report.text()
    served = {s.name: s.samples for s in report.sources}
    assert served == {name: sum(c for (n, _), c in seen.items() if n == name) for name in ("a", "b")}
    assert max(seen.values()) == 1  # the run served each sample once, and the audit agrees
    assert all(s.excluded > 0 for s in report.sources)
    with pytest.raises(LoaderStateError, match="has 1 exclusions in force, and 0 were given"):
        audit(state, mixture)
    with pytest.raises(LoaderStateError, match=r"exclusion 1 given .* is not the one the run had"):
        audit(state, mixture, exclude=[first, Exclusions(documents={"b": [7]})])

    # The CLI re-applies a mixture config's exclude:, and --exclude FILE's.
    config = tmp_path / "mix.yaml"
    config.write_text(
        f"seq_len: {SEQ_LEN}\nseed: 4\nblock_size: 16\nsources:\n  a: {caches[0].root}\n"
        f"  b: {caches[1].root}\n"
        "weights: {a: 1, b: 1}\n"
        "exclude:\n  - {documents: {a: [3, 40, 41]}, steps: [[2, 3]]}\n"
        "  - {documents: {b: [7, 8]}, positions: [[100, 140]]}\n"
    )
    (tmp_path / "state.json").write_text(json.dumps(state))
    done = run_cli("audit", tmp_path / "state.json", config, "--json")
    assert json.loads(done.stdout)["clean"] is True
    bare = tmp_path / "bare.yaml"
    bare.write_text("\n".join(config.read_text().split("\n")[:8]) + "\n")
    refused = run_cli("audit", tmp_path / "state.json", bare, check=False)
    assert refused.returncode == 1 and "exclusions in force" in refused.stderr
    done = run_cli("audit", tmp_path / "state.json", bare, "--exclude", config)
    assert "verdict     clean" in done.stdout and "excluded" in done.stdout


def test_a_model_that_trained_on_an_excluded_document_is_flagged(
    caches: tuple[streampack.Cache, streampack.Cache],
) -> None:
    seqs = caches[0].sequences(SEQ_LEN)
    run = Loader(seqs, batch_size=6, seed=2)
    run.advance(6)
    older = run.state_dict()  # the data state saved at step 6; the model goes on to step 10
    trained = np.concatenate([run.picks(position)[1] for position in range(36, 60, 6)])
    doc = int(seqs.boundaries(trained[3:4]).doc_ids[0, 0])
    bad = Exclusions(documents=[doc])
    resumed = Loader(seqs, batch_size=6, seed=2, exclude=bad)
    resumed.load_state_dict(older, step=10)  # the exclusion takes effect at position 36: too late
    resumed.advance(5)
    report = audit(resumed.state_dict(), seqs, exclude=[bad])
    kinds = [finding.kind for finding in report.findings]
    assert kinds.count("twice") == 1 and kinds.count("excluded") == 1, report.text()
    (flagged,) = [finding for finding in report.findings if finding.kind == "excluded"]
    assert flagged.resume == 0 and flagged.positions[0] >= 36 and flagged.positions[1] <= 60
    assert "exclusion 0 (mode 'skip') takes out from position 36" in flagged.message
    clean = Loader(seqs, batch_size=6, seed=2, exclude=bad)
    clean.load_state_dict(older, step=6)
    clean.advance(5)
    assert audit(clean.state_dict(), seqs, exclude=[bad]).clean


def test_a_run_with_mask_exclusions_audits_clean_with_nothing_taken_out(
    caches: tuple[streampack.Cache, streampack.Cache],
) -> None:
    seqs = caches[0].sequences(SEQ_LEN)
    masks = [Exclusions(documents=[5, 6], mode="mask"), Exclusions(steps=[(9, 10)], mode="mask")]
    run = Loader(seqs, batch_size=6, seed=2, output="dict", exclude=masks[:1])
    run.advance(7)
    again = Loader(seqs, batch_size=4, seed=2, output="dict", exclude=masks)
    again.load_state_dict(run.state_dict(), step=7)
    again.advance(6)
    report = audit(again.state_dict(), seqs, exclude=masks)
    assert report.clean, report.text()
    assert report.sources[0].samples == 7 * 6 + 6 * 4 and report.sources[0].excluded == 0


# --- the real run: a streampack.hf.Trainer job resumed three times ------------------------------------------

_RUN_SCRIPT = """
import json, sys
from pathlib import Path
import torch.distributed as dist
from transformers import TrainingArguments
import streampack, streampack.hf
from streampack.loader import Exclusions
from tests.frameworks import tiny_gpt2

def train(phase):
    args = TrainingArguments(str(out / "run"), per_device_train_batch_size=2, max_steps=phase["steps"],
                             save_steps=3, use_cpu=True, ddp_backend="gloo", report_to=[],
                             logging_strategy="no", disable_tqdm=True)
    mixture = streampack.Mixture(sources, phase["weights"], block_size=8, seed=1)
    exclude = [Exclusions(documents={"code": phase["exclude"]})] if phase["exclude"] else None
    loader = streampack.Loader(mixture, batch_size=2 * args.world_size, rank=args.process_index,
                               world_size=args.world_size, output="dict", exclude=exclude)
    model, seen = tiny_gpt2(), []
    record = lambda module, args, kwargs: seen.extend(kwargs["input_ids"][:, 0].tolist())
    model.register_forward_pre_hook(record, with_kwargs=True)  # what the model's forward receives
    trainer = streampack.hf.Trainer(model=model, args=args, train_dataset=loader)
    trainer.train(resume_from_checkpoint=phase["resume"] or None)
    (out / f"seen-{phase['steps']}-{args.process_index}.json").write_text(json.dumps(seen))

web, code, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
sources = {"web": streampack.open(web).sequences(8), "code": streampack.open(code).sequences(8)}
for phase in json.loads(sys.argv[4]):
    train(phase)

# Torn down here, as the other torchrun scripts of the suite do: a gloo process group left to the
# interpreter's exit once aborted a rank there ("terminate called without an active exception").
if dist.is_initialized():
    dist.barrier()
    dist.destroy_process_group()
"""


def _numbered_source(root: Path, offset: int) -> Path:
    """A cache whose sample i of ``sequences(8)`` is 8 copies of ``offset + i``, in documents of 3 tokens."""
    from streampack.testing.caches import write_cache

    tokens = np.repeat(np.arange(150) + offset, 8)
    ends = np.append(np.arange(3, len(tokens), 3), len(tokens))
    return Path(write_cache(root, [(tokens, ends)], vocab_size=1000, eos_id=999))


@pytest.mark.slow
def test_a_trainer_run_resumed_over_ranks_weights_and_an_exclusion_audits_clean(tmp_path: Path) -> None:
    """A streampack.hf.Trainer job on 1 rank, resumed on 2 (torchrun, gloo), then with new mixture weights,
    then with an exclusion: ``streampack audit`` on its last checkpoint says clean, and its samples per
    source are those the model's forward received (a forward hook records every rank's input_ids)."""
    import os
    import shutil
    import subprocess
    import sys
    import textwrap

    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this Python")
    web, code = _numbered_source(tmp_path / "web", 0), _numbered_source(tmp_path / "code", 300)
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(_RUN_SCRIPT))
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    bad = [20, 21, 22, 23, 24, 25, 60, 61]  # documents of code samples 7-9 and 22-23
    phases = [
        (1, {"steps": 3, "weights": {"web": 1, "code": 1}, "exclude": [], "resume": False}),
        (2, {"steps": 6, "weights": {"web": 1, "code": 1}, "exclude": [], "resume": True}),  # 1 -> 2 ranks
        (2, {"steps": 9, "weights": {"web": 1, "code": 3}, "exclude": [], "resume": True}),  # new weights
        (2, {"steps": 12, "weights": {"web": 1, "code": 3}, "exclude": bad, "resume": True}),  # exclusion
    ]
    for ranks in (1, 2):  # one launch per world size, its phases one after the other
        launch = [torchrun, "--standalone", "--nproc_per_node", str(ranks)]
        mine = [phase for world, phase in phases if world == ranks]
        command = [*launch, str(script), str(web), str(code), str(tmp_path), json.dumps(mine)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
    seen = {steps: [] for steps in (3, 6, 9, 12)}
    for path in tmp_path.glob("seen-*.json"):
        seen[int(path.name.split("-")[1])] += json.loads(path.read_text())
    assert [len(seen[s]) for s in (3, 6, 9, 12)] == [3 * 2, 3 * 4, 3 * 4, 3 * 4]
    after = {i - 300 for i in seen[12] if i >= 300}
    assert not after & {7, 8, 9, 22, 23}, "the exclusion's samples were served after it took effect"

    config = tmp_path / "mix.yaml"
    config.write_text(
        f"seq_len: 8\nseed: 1\nblock_size: 8\nsources:\n  web: {web}\n  code: {code}\n"
        f"weights: {{web: 1, code: 1}}\nexclude:\n  - documents: {{code: {bad}}}\n"
    )
    state = tmp_path / "run" / "checkpoint-12" / "streampack_loader.json"
    done = run_cli("audit", state, config, "--json")
    report = json.loads(done.stdout)
    assert report["clean"] is True and [leg["world_size"] for leg in report["legs"]] == [1, 2, 2, 2]
    every = [i for ids in seen.values() for i in ids]
    forward = {"web": sum(i < 300 for i in every), "code": sum(i >= 300 for i in every)}
    assert {s["name"]: s["samples"] for s in report["sources"]} == forward

"""The audit of a run from its last state: its verdict equals a brute-force replay of the run, it names
the steps of a planted replay or skip, and its CLI and pictures work on real caches."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

import streampack
from streampack import Loader, Mixture
from streampack.runs.audit import audit
from tests.conftest import run_cli, write_jsonl

SIZES = {"web": 53, "code": 31}


def sources() -> dict[str, np.ndarray]:
    """Each row names its source and sample, ``[source id, sample]``: served batches say what they hold."""
    return {
        name: np.stack([np.full(n, j), np.arange(n)], axis=1).astype(np.int32)
        for j, (name, n) in enumerate(SIZES.items())
    }


@dataclass
class Run:
    """A run driven as a trainer drives it: a model trains steps, checkpoints, and resumes from a model
    checkpoint and a data state that may be of another step. ``trained`` is what the model saw, and
    ``spans`` the global positions each of its steps read."""

    mixed: bool
    trained: list[list[tuple[int, int]]] = field(default_factory=list)  # per step, (source, sample) rows
    spans: list[tuple[int, int]] = field(default_factory=list)  # per step, its positions [lo, hi)
    ends: list[tuple[int, ...]] = field(default_factory=list)  # per step, each source's samples read by then
    saved: dict[int, dict[str, Any]] = field(default_factory=dict)  # data state after each step
    # the samples of each source read up to each saved state, along the states' own history
    read: dict[int, tuple[int, ...]] = field(default_factory=dict)
    jumps: set[int] = field(default_factory=set)  # steps where the data did not continue the model's
    loaders: list[Loader] = field(default_factory=list)  # one per rank, this leg

    def start(self, batch: int, world: int, weights: tuple[int, int]) -> None:
        self.loaders = [self._loader(batch, world, rank, weights) for rank in range(world)]
        self.saved[0] = self.loaders[0].state_dict()
        self.read[0] = (0,) * len(SIZES)

    def _loader(self, batch: int, world: int, rank: int, weights: tuple[int, int]) -> Loader:
        data = sources()
        if self.mixed:
            mixture = Mixture(data, dict(zip(SIZES, weights, strict=True)), block_size=8, seed=5)
            return Loader(mixture, batch_size=batch, rank=rank, world_size=world)
        return Loader(data["web"], batch_size=batch, rank=rank, world_size=world, seed=5)

    def train(self, steps: int) -> None:
        iterators = [iter(loader) for loader in self.loaders]
        for _ in range(steps):
            before = self.loaders[0].position
            rows = np.concatenate([next(it) for it in iterators])  # rank by rank: the global batch
            self.trained.append([(int(s), int(i)) for s, i in rows])
            self.spans.append((before, self.loaders[0].position))
            self.saved[len(self.trained)] = json.loads(json.dumps(self.loaders[0].state_dict()))
            sources = [int(s) if self.mixed else 0 for s, _ in rows]
            previous = self.read[len(self.trained) - 1]
            self.read[len(self.trained)] = tuple(n + sources.count(j) for j, n in enumerate(previous))
            self.ends.append(self.read[len(self.trained)])

    def resume(self, model: int, data: int, batch: int, world: int, weights: tuple[int, int]) -> None:
        """The model resumes from its checkpoint at step ``model`` (what it trained after is lost), the
        data from the state saved after step ``data``."""
        state, read = self.saved[data], self.read[data]
        del self.trained[model:], self.spans[model:], self.ends[model:]
        self.jumps = {step for step in self.jumps if step < model}
        # A jump: the data state's sources were read to other places than where the model's last step left
        # them. In a mixture that may be at the same global position, reached under other weights.
        if read != (self.ends[-1] if self.ends else (0,) * len(SIZES)):
            self.jumps.add(model)
        self.loaders = [self._loader(batch, world, rank, weights) for rank in range(world)]
        for loader in self.loaders:
            loader.load_state_dict(state, step=model)
        self.saved = {model: self.loaders[0].state_dict()}
        self.read = {model: read}

    def served(self) -> dict[str, list[int]]:
        found: dict[str, list[int]] = {name: [] for name in (SIZES if self.mixed else ["data"])}
        for rows in self.trained:
            for source, sample in rows:
                found[list(SIZES)[source] if self.mixed else "data"].append(sample)
        return found

    def coverage(self) -> tuple[int, int]:
        """Positions the model read twice (counted once per extra read) and those below the furthest
        read that it never read."""
        counts = np.zeros(max((hi for _, hi in self.spans), default=0), dtype=np.int64)
        for lo, hi in self.spans:
            counts[lo:hi] += 1
        return int(np.maximum(counts - 1, 0).sum()), int((counts == 0).sum())


def reference(name: str, mixed: bool, count: int) -> list[int]:
    """Source ``name``'s own stream, its first ``count`` samples: what a clean run serves of it."""
    data = sources()
    if mixed:  # the same mixture reading this source alone serves its samples at its cursors
        weights = {n: (1 if n == name else 0) for n in SIZES}
        loader = Loader(Mixture(data, weights, block_size=8, seed=5), batch_size=1)
    else:
        loader = Loader(data["web"], batch_size=1, seed=5)
    return [int(s) for s in loader.served(0, count)[1]] if count else []


LEG = st.tuples(
    st.integers(1, 7),  # steps trained
    st.sampled_from([(2, 1), (4, 2), (6, 2), (6, 3), (8, 4), (3, 1)]),  # batch size, world size
    st.tuples(st.integers(1, 3), st.integers(1, 3)),  # mixture weights
)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(
    mixed=st.booleans(),
    legs=st.lists(LEG, min_size=1, max_size=5),
    picks=st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1), st.booleans()), min_size=4, max_size=4),
)
@example(  # a skip whose source is served again only legs later, past a leg that trained nothing
    mixed=True,
    legs=[
        (3, (8, 4), (3, 3)),
        (1, (2, 1), (3, 3)),
        (1, (2, 1), (3, 1)),
        (3, (2, 1), (3, 1)),
        (3, (8, 4), (3, 1)),
    ],
    picks=[(0.0, 0.45, False), (0.67, 0.5, False), (0.86, 0.0, False), (0.0, 0.45, False)],
)
@example(  # a data state at the model's global position, reached under other weights (other cursors)
    mixed=True,
    legs=[
        (6, (4, 2), (2, 2)),
        (5, (6, 2), (2, 3)),
        (6, (8, 4), (1, 1)),
        (5, (8, 4), (1, 3)),
        (2, (6, 2), (2, 2)),
    ],
    picks=[(0.0, 0.52, False), (0.99, 0.43, False), (0.56, 0.03, False), (0.0, 0.52, False)],
)
@example(  # a replay that a resume jumping forward, short of what was served, does not end
    mixed=True,
    legs=[
        (4, (8, 4), (3, 2)),
        (6, (3, 1), (2, 3)),
        (7, (4, 2), (1, 3)),
        (6, (2, 1), (1, 2)),
        (3, (4, 2), (3, 3)),
    ],
    picks=[(0.78, 0.02, False), (0.77, 0.58, True), (0.44, 0.78, False), (0.06, 0.0, False)],
)
@example(  # a replay and a skip at positions read once each: the data state's cursors came from other weights
    mixed=True,
    legs=[
        (1, (8, 4), (1, 3)),
        (1, (2, 1), (1, 1)),
        (2, (2, 1), (3, 1)),
        (4, (6, 3), (3, 2)),
        (6, (2, 1), (1, 1)),
    ],
    picks=[(0.17, 0.27, False), (0.87, 0.12, False), (0.0, 0.7, False), (0.0, 0.0, False)],
)
def test_the_verdict_equals_a_brute_force_replay_of_random_histories(
    mixed: bool, legs: list[Any], picks: list[tuple[float, float, bool]]
) -> None:
    run = Run(mixed)
    (steps, (batch, world), weights), *rest = legs
    run.start(batch, world, weights)
    run.train(steps)
    for (steps, (batch, world), weights), (m, d, faithful) in zip(rest, picks, strict=False):
        first, last = min(run.saved), len(run.trained)  # this leg's start, and where it stands
        model = first + round(m * (last - first))
        data = model if faithful else first + round(d * (last - first))
        run.resume(model, data, batch, world, weights)
        run.train(steps)
    state = json.loads(json.dumps(run.loaders[0].state_dict()))
    data_given: Any = Mixture(sources(), {"web": 1}, block_size=8, seed=5) if mixed else sources()["web"]
    report = audit(state, data_given)

    served = run.served()
    # The brute force: clean when what the model saw of each source is that source's own stream, each
    # sample once per epoch. Positions alone do not decide it: in a mixture the same positions reached
    # under other weights hold other samples.
    faithful = all(samples == reference(name, mixed, len(samples)) for name, samples in served.items())
    assert report.clean == faithful, (report.text(), run.trained)
    twice, skipped = run.coverage()  # the positions each trained step read
    if twice or skipped:
        assert not report.clean
    assert {s.name: s.samples for s in report.sources} == {name: len(v) for name, v in served.items()}
    assert report.step == len(run.trained)
    # Each finding names a step where the model resumed with a data state of another step.
    assert {f.steps[0] for f in report.findings} <= run.jumps
    if not mixed:  # one source: positions are its cursors, so the counts are the brute force's
        (source,) = report.sources
        assert (source.twice, source.skipped) == (twice, skipped)


def test_a_planted_replay_and_skip_are_named_by_positions_and_steps() -> None:
    data = sources()["web"]
    first = Loader(data, batch_size=4, seed=5)
    first.advance(10)
    at_10 = first.state_dict()
    first.advance(5)
    at_15 = first.state_dict()
    replayed = Loader(data, batch_size=4, seed=5)
    replayed.load_state_dict(at_10, step=15)  # the model had trained 15 steps; the data state is of 10
    replayed.advance(8)
    report = audit(replayed.state_dict(), data)
    (finding,) = report.findings
    assert (finding.kind, finding.positions, finding.steps) == ("twice", (40, 60), (15, 20))
    assert "positions 40-60 (steps 15-20) served twice" in finding.message
    assert "the data state is older than the model checkpoint" in finding.message
    assert report.sources[0].twice == 20 and report.sources[0].skipped == 0
    skipped = Loader(data, batch_size=4, seed=5)
    skipped.load_state_dict(at_15, step=10)
    skipped.advance(2)
    report = audit(skipped.state_dict(), data)
    (finding,) = report.findings
    assert (finding.kind, finding.positions, finding.steps) == ("skipped", (40, 60), (10, 10))
    assert "newer than the model checkpoint" in finding.message
    assert report.sources[0].skipped == 20


def test_a_run_that_ends_in_a_partial_batch_is_audited_to_its_end() -> None:
    """epochs=1 with drop_last=False: the last batch holds the 3 samples left, and the audit counts those,
    not a whole batch past the run's end (the history records the epochs)."""
    data = sources()["web"]  # 53 samples: 6 batches of 8 and one of 5
    first = Loader(data, batch_size=8, seed=5, epochs=1, drop_last=False)
    for _ in first:
        pass
    state = first.state_dict()
    assert state["position"] == 53 and state["history"][0]["epochs"] == 1
    resumed = Loader(data, batch_size=8, seed=5, epochs=1, drop_last=False)
    resumed.load_state_dict(state, step=7)
    report = audit(resumed.state_dict(), data)
    assert report.clean, report.text()
    assert report.sources[0].samples == 53 and report.legs[0].positions == (0, 53)


def test_a_leg_that_reaches_the_end_of_a_drop_last_run_is_audited_to_its_last_full_batch() -> None:
    """epochs=1 with drop_last: the 5 samples after the last full batch are never served, so a trainer
    step counted past them (gradient accumulation 4: two steps, the second with two batches) trains up
    to the last full batch, and a resume there is no replay."""
    data = sources()["web"]  # 53 samples: 6 batches of 8, 5 left over
    first = Loader(data, batch_size=8, seed=5, epochs=1)
    first.batches_per_step = 4
    assert len(list(first)) == 6
    state = first.state_dict()
    tail = Loader(data, batch_size=1, seed=5, epochs=1)
    tail.load_state_dict(state, step=2)
    next(iter(tail))
    report = audit(tail.state_dict(), data)
    assert report.clean, report.text()
    assert report.legs[0].positions == (0, 48) and report.sources[0].samples == 49


def test_a_mixture_run_that_adds_a_source_at_a_resume_is_audited_clean() -> None:
    """Each history entry names the sources its leg read, so the audit makes each leg's mixture of them."""
    data = sources()
    web = Loader(Mixture({"web": data["web"]}, {"web": 1}, block_size=8, seed=5), batch_size=4)
    web.advance(5)
    state = web.state_dict()
    both = Loader(Mixture(data, {"web": 1, "code": 1}, block_size=8, seed=5), batch_size=4)
    both.load_state_dict(state, step=5)
    both.advance(5)
    final = both.state_dict()
    assert [entry["sources"] for entry in final["history"]] == [["web"], ["web", "code"]]
    report = audit(final, Mixture(data, {"web": 1}, block_size=8, seed=5))
    assert report.clean, report.text()
    assert sum(source.samples for source in report.sources) == 40
    with pytest.raises(streampack.errors.OptionsError, match=r"has no \['code'\]"):
        audit(final, Mixture({"web": data["web"]}, {"web": 1}, block_size=8, seed=5))


def test_a_state_without_history_is_refused_and_wrong_settings_are_named() -> None:
    data = sources()["web"]
    loader = Loader(data, batch_size=4, seed=5)
    loader.advance(3)
    state = loader.state_dict()
    with pytest.raises(streampack.StreampackError, match="no history"):
        audit({k: v for k, v in state.items() if k != "history"}, data)
    with pytest.raises(ValueError, match="seed=6 was given, but the run's history records seed"):
        audit(state, data, seed=6)
    with pytest.raises(streampack.StreampackError, match="it is not what the run read"):
        audit(state, sources()["code"])


def test_a_run_of_a_million_steps_is_audited_without_reading_tokens() -> None:
    """10^6 steps: it finishes here (benchmarks/bench_audit.py prints how long it takes)."""
    data = np.zeros((100_000, 2), dtype=np.int32)
    loader = Loader(data, batch_size=8, seed=1)
    loader.advance(600_000)
    resumed = Loader(data, batch_size=8, seed=1)
    resumed.load_state_dict(loader.state_dict(), step=600_000)
    resumed.advance(400_000)
    report = audit(resumed.state_dict(), data)
    assert report.clean and report.step == 1_000_000
    assert report.sources[0].samples == 8_000_000


# --- real caches: the CLI, its pictures, a mixture config ------------------------------------------------


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("audit")
    for name in ("web", "code"):
        docs = [{"text": f"{name} document {i} " * (i % 4 + 2)} for i in range(120)]
        streampack.build([write_jsonl(root / f"{name}.jsonl", docs)], root / name, tokenizer="bytes")
    (root / "mix.yaml").write_text(
        "seq_len: 16\nseed: 3\nblock_size: 16\nsources:\n  web: web\n  code: code\n"
        "weights: {web: 3, code: 1}\n"
    )
    return root


def test_the_cli_audits_a_cache_run_and_a_mixture_run_and_draws_them(caches: Path, tmp_path: Path) -> None:
    web = streampack.open(caches / "web").sequences(16, overlap=1)
    loader = Loader(web, batch_size=4, seed=2)
    loader.advance(20)
    (tmp_path / "one.json").write_text(json.dumps(loader.state_dict()))
    done = run_cli("audit", tmp_path / "one.json", caches / "web", "--seq-len", "16", "--json")
    report = json.loads(done.stdout)
    assert report["clean"] is True and report["sources"][0]["samples"] == 80
    assert report["sources"][0]["tokens"] == 80 * 16

    run = Loader(streampack.load_mixture(caches / "mix.yaml"), batch_size=4)
    run.advance(6)
    older = run.state_dict()
    again = Loader(streampack.load_mixture(caches / "mix.yaml"), batch_size=8)
    again.load_state_dict(older, step=10)  # the model trained 10 steps, the data state is of step 6
    again.advance(5)
    (tmp_path / "mix.json").write_text(json.dumps(again.state_dict()))
    picture = tmp_path / "audit.png"
    done = run_cli("audit", tmp_path / "mix.json", caches / "mix.yaml", "--plot", picture, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "served twice" in done.stdout and "resumed at step 10" in done.stdout
    assert picture.stat().st_size > 1000 and picture.read_bytes()[:4] == b"\x89PNG"
    wrong = run_cli("audit", tmp_path / "mix.json", caches / "mix.yaml", "--seq-len", "32", check=False)
    assert wrong.returncode != 0 and "seq_len=32 was given" in wrong.stderr

    mix_picture = tmp_path / "mix.png"
    run_cli(
        "mix", "--config", caches / "mix.yaml", "--steps", "50", "--batch-size", "4", "--plot", mix_picture
    )
    assert mix_picture.stat().st_size > 1000 and mix_picture.read_bytes()[:4] == b"\x89PNG"


def test_a_follow_run_is_audited_from_its_cache_directory_or_a_follow_of_it(
    caches: Path, tmp_path: Path
) -> None:
    """A Follow run (whole documents, eras of documents) resumed with another batch size audits clean
    from the cache directory, from a Follow of it and with the CLI (and its picture); a planted replay is
    found."""
    settings = {"layout": "packed", "seq_len": 16, "seed": 4, "first_era": 2, "largest_era": 16}
    run = streampack.Follow(caches / "web", batch_size=4, **settings)
    run.advance(5)
    first = run.state_dict()
    resumed = streampack.Follow(caches / "web", batch_size=6, **settings)
    resumed.load_state_dict(first)
    resumed.advance(3)
    state = resumed.state_dict()
    for data in (caches / "web", str(caches / "web"), resumed):
        report = audit(state, data)
        assert report.clean and report.sources[0].samples == 5 * 4 + 3 * 6, report.text()
    (tmp_path / "follow.json").write_text(json.dumps(state))
    picture = tmp_path / "follow.png"
    assert "clean" in run_cli("audit", tmp_path / "follow.json", caches / "web", "--plot", picture).stdout
    assert picture.read_bytes()[:4] == b"\x89PNG"

    replayed = streampack.Follow(caches / "web", batch_size=4, **settings)
    replayed.load_state_dict(first, step=8)  # the model trained 8 steps, the data state is of step 5
    replayed.advance(1)
    report = audit(replayed.state_dict(), caches / "web")
    assert not report.clean and report.sources[0].twice == 4, report.text()


# --- a real Trainer ---------------------------------------------------------------------------------------


def test_a_resumed_hf_trainer_run_audits_clean_with_the_counts_its_model_saw(tmp_path: Path) -> None:
    """A streampack.hf.Trainer run resumed twice, with a batch-size change and a mixture weight change:
    the audit of its last checkpoint says clean, and its counts are what the model's forward received."""
    pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    import streampack.hf
    from tests.frameworks import numbered_cache, sample_ids, tiny_gpt2

    web = numbered_cache(tmp_path / "web").sequences(8)
    code = numbered_cache(tmp_path / "code").sequences(8)
    seen: list[int] = []

    class Recording(streampack.hf.Trainer):
        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            seen.extend(sample_ids(inputs))
            return super().training_step(model, inputs, num_items_in_batch)

    def train(batch: int, weights: dict[str, int], steps: int, resume: bool) -> None:
        from transformers import TrainingArguments

        args = TrainingArguments(
            str(tmp_path / "out"), per_device_train_batch_size=batch, gradient_accumulation_steps=2,
            max_steps=steps, save_steps=3, use_cpu=True, report_to=[], logging_strategy="no",
            disable_tqdm=True,
        )  # fmt: skip
        mixture = Mixture({"web": web, "code": code}, weights, block_size=8, seed=1)
        loader = Loader(mixture, batch_size=batch, output="dict")
        trainer = Recording(model=tiny_gpt2(), args=args, train_dataset=loader)
        trainer.train(resume_from_checkpoint=resume or None)

    train(4, {"web": 1, "code": 1}, 3, False)
    train(2, {"web": 1, "code": 1}, 6, True)  # batch size 4 -> 2
    train(2, {"web": 3, "code": 1}, 9, True)  # the weights change
    state = json.loads((tmp_path / "out" / "checkpoint-9" / streampack.hf.LOADER_STATE_NAME).read_text())
    report = audit(state, Mixture({"web": web, "code": code}, {"web": 1}, block_size=8, seed=1))
    assert report.clean, report.text()
    assert [(leg.steps, leg.batch_size, leg.batches_per_step, leg.step_given) for leg in report.legs] == [
        ((0, 3), 4, 2, False), ((3, 6), 2, 2, True), ((6, 9), 2, 2, True)
    ]  # fmt: skip
    assert sum(s.samples for s in report.sources) == len(seen) == 3 * 2 * 4 + 6 * 2 * 2

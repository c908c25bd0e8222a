"""Follow mode: loaders train on the committed part of a cache while a real build writes it."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import streampack
from streampack.errors import BuildStalledError, LoaderStateError, OptionsError
from streampack.follow import Eras, Follow, FollowOrder
from tests.conftest import s3_options, write_jsonl
from tests.test_resume import build_args, start_build

SEQ_LEN, OVERLAP, BATCH = 48, 1, 8
ERAS = {"first_era": 64, "largest_era": 2048}


def corpus(tmp_path: Path, docs: int = 9000) -> Path:
    """~8 MB of JSONL: units of 1 MB, built one after the other by one worker over a few seconds."""
    rng = random.Random(3)
    words = ["alpha", "beta", "gamma", "delta", "tokens", "cache", "Ünïcödé"]
    records = [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(1, 300)))} for _ in range(docs)]
    return write_jsonl(tmp_path / "in.jsonl", records)


def follow_args(src: Path, out: Path | str, tokenizer: Path) -> list[str]:
    args = build_args([src], out, tokenizer)  # type: ignore[arg-type]
    args[args.index("--workers") + 1] = "1"
    return args


def hold(proc: Any) -> None:
    """Stop a running build's process group (SIGSTOP): it stays running, committing nothing more, so a
    test's loaders serve its committed part while it runs however slowly the machine starts them."""
    os.killpg(proc.pid, signal.SIGSTOP)


def release(proc: Any) -> None:
    """Let a build held by :func:`hold` go on (SIGCONT; harmless if it was not held)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGCONT)


def kill_once_a_unit_is_done(proc: Any, out: Path) -> None:
    """SIGKILL a build's process group as soon as its ledger says one unit is done: the first of its 8
    units, so the build is still running (a fixed sleep raced a build that got faster)."""
    deadline = time.monotonic() + 120
    while proc.poll() is None and not any(_done(entry) for entry in (out / "ledger").glob("*.json")):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)


def _done(entry: Path) -> bool:
    try:
        return bool(json.loads(entry.read_bytes()).get("done"))
    except (OSError, ValueError):  # replaced while it was read: the next poll reads it
        return False


def make_follow(out: Path | str, **kwargs: Any) -> Follow:
    settings: dict = {"seq_len": SEQ_LEN, "overlap": OVERLAP, "batch_size": BATCH, "seed": 5, **ERAS}
    settings["then"] = "end"  # one pass, so that a test's loop ends
    settings.update(timeout=60.0, poll=0.02)
    settings.update(kwargs)
    return Follow(out, **settings)


def expected_rows(follow: Follow, samples: Any, steps: int) -> np.ndarray:
    """The rows of the first ``steps`` global batches: the finished cache's windows, in the follow order."""
    rows = steps * follow.options.batch_size
    return samples[follow.follow_order.samples(np.arange(rows, dtype=np.int64))]


@pytest.mark.slow
def test_loaders_follow_a_running_build_in_an_order_fixed_by_the_build(
    tmp_path: Path, bpe_tokenizer: Path
) -> None:
    """One Follow, two ranks and a DataLoader with two workers read a running build in lockstep. Each
    serves the finished cache's windows in the follow order (each window once, all of them), the ranks'
    rows side by side are the global batch, and a state saved mid-build resumes, after the build, to the
    same batches: nothing depends on when the ledger was read."""
    torch_data = pytest.importorskip("streampack.torch", reason="the DataLoader part needs torch")
    out = tmp_path / "c"
    proc = start_build(follow_args(corpus(tmp_path), out, bpe_tokenizer), out)
    hold(proc)
    try:
        follow = make_follow(out)
        ranks = [make_follow(out, rank=r, world_size=2) for r in (0, 1)]
        workers = torch_data.DataLoader(make_follow(out), num_workers=2)
        batches, running, saved = [], [], None
        for step, (batch, left, right, tensor) in enumerate(zip(follow, *ranks, workers, strict=True)):
            batches.append(batch)
            running.append(proc.poll() is None)
            assert np.array_equal(np.concatenate([left, right]), batch)
            assert np.array_equal(tensor.numpy(), batch)
            if step == 1:
                release(proc)
            if step == 20:
                saved = json.loads(json.dumps(follow.state_dict()))
    finally:
        release(proc)
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr.decode()
    assert saved is not None and running[0] and sum(running) >= 2, "no batch was served while building"

    samples = streampack.open(out).sequences(SEQ_LEN, overlap=OVERLAP)
    windows = follow.order.samples(np.arange(len(batches) * BATCH, dtype=np.int64))  # type: ignore[attr-defined]
    assert np.array_equal(np.concatenate(batches), samples[windows])
    assert len(np.unique(windows)) == len(windows) == len(samples) // BATCH * BATCH  # each window once
    assert len(follow) == len(batches)  # known once the build is complete

    again = make_follow(out)
    again.load_state_dict(saved)
    rest = list(again)
    assert len(rest) == len(batches) - 21
    assert all(np.array_equal(a, b) for a, b in zip(rest, batches[21:], strict=True))


def test_a_stalled_build_serves_only_committed_eras_then_raises(tmp_path: Path, bpe_tokenizer: Path) -> None:
    """A killed build: every era whose windows its ledger committed (in stream order) is served, nothing
    past the committed prefix, and the next batch ends in a clear error once ``timeout`` passes."""
    out = tmp_path / "c"
    proc = start_build(follow_args(corpus(tmp_path), out, bpe_tokenizer), out)
    kill_once_a_unit_is_done(proc, out)
    partial = streampack.open(out, allow_incomplete=True)
    done = [
        streampack.store.files.read_entry(out, f"{i:06d}", u) for i, u in enumerate(partial.manifest.units)
    ]
    assert not all(p.done for p in done), "the build finished before it was killed"
    prefix, unit = 0, 0
    while done[unit].done:
        prefix, unit = prefix + done[unit].tokens, unit + 1
    prefix += done[unit].tokens  # the committed prefix of the stream: done units, then the next one's part

    follow = make_follow(out, timeout=0.5, first_era=16, largest_era=256)
    served = []
    started = time.monotonic()
    with pytest.raises(BuildStalledError, match=r"committed nothing for 0.5 s .* Rerun the build command"):
        for batch in follow:
            served.append(batch)
    assert time.monotonic() - started < 30
    covered = Eras(16, 256).covered((prefix - OVERLAP) // SEQ_LEN)
    assert len(served) == covered // BATCH > 0
    windows = follow.order.samples(np.arange(len(served) * BATCH, dtype=np.int64))  # type: ignore[attr-defined]
    assert (windows * SEQ_LEN + SEQ_LEN + OVERLAP).max() <= prefix  # nothing past the committed prefix
    tokens = partial.sequences(SEQ_LEN, overlap=OVERLAP)[windows]
    assert np.array_equal(np.concatenate(served), tokens)

    with pytest.raises(BuildStalledError, match="no build has written a manifest"):
        make_follow(tmp_path / "nothing-yet", timeout=0.2)


@pytest.mark.slow
def test_a_loader_follows_a_build_into_object_storage(
    tmp_path: Path, bpe_tokenizer: Path, bucket: tuple[Any, str], s3_endpoint: str
) -> None:
    """A CLI build publishes to a real S3 server (moto's) unit by unit; a Follow of the URL, in process and
    in two DataLoader workers, reads each era through a local copy as soon as its units are up (prefetching
    the next steps' shards), and serves the finished cache's windows in order."""
    from tests.test_publish import start_cli_build

    torch_data = pytest.importorskip("streampack.torch", reason="the DataLoader part needs torch")
    _, name = bucket
    url, options = f"s3://{name}/c", s3_options(s3_endpoint)
    args = [*follow_args(corpus(tmp_path), url, bpe_tokenizer), "--staging-dir", str(tmp_path / "stage")]
    proc = start_cli_build(args, s3_endpoint)
    fs, deadline = bucket[0], time.monotonic() + 120
    while proc.poll() is None and not (fs.invalidate_cache() or fs.exists(f"{name}/c/ledger")):
        assert time.monotonic() < deadline, "no unit of the build reached the bucket"
        time.sleep(0.02)
    hold(proc)
    # Batches of 32: a DataLoader costs ~1 ms a batch here whatever its size.
    reading = {"storage_options": options, "local_dir": tmp_path / "copy", "poll": 0.05, "batch_size": 32}
    try:
        follow = make_follow(url, **reading)
        copy = tmp_path / "workers-copy"  # its own: downloads here do not take the in-process prefetch's
        workers = torch_data.DataLoader(make_follow(url, **{**reading, "local_dir": copy}), num_workers=2)
        batches, running = [], []
        for batch, tensor in zip(follow, workers, strict=True):
            assert np.array_equal(tensor.numpy(), batch)
            batches.append(batch)
            running.append(proc.poll() is None)
            if len(running) == 2:
                release(proc)
            time.sleep(0.002)  # a training step, which the prefetcher overlaps
    finally:
        release(proc)
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr.decode()
    assert running[0] and sum(running) >= 2, "no batch was served while the build ran"
    samples = streampack.open(url, storage_options=options, local_dir=tmp_path / "copy").sequences(
        SEQ_LEN, overlap=OVERLAP
    )
    assert np.array_equal(np.concatenate(batches), expected_rows(follow, samples, len(batches)))
    assert len(batches) == len(samples) // 32
    prefetcher = follow._prefetcher
    assert prefetcher is not None and prefetcher.fetched > 0  # shards of the known eras fetched ahead


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, bpe_tokenizer: Path) -> Path:
    root = tmp_path_factory.mktemp("finished")
    built = streampack.build(corpus(root, 1500), root / "c", tokenizer=str(bpe_tokenizer), unit_bytes=1 << 16)
    return built.out


def test_then_epochs_goes_on_with_the_loaders_epochs_and_the_end_is_one_epoch(finished: Path) -> None:
    """Over a finished cache: then="end" serves every window once (len() is known), then="epochs" goes on
    at position N with the Loader's epochs of the cache, and output="dict" formats the same rows."""
    samples = streampack.open(finished).sequences(SEQ_LEN, overlap=OVERLAP)
    n = len(samples)
    ended = make_follow(finished)
    assert len(ended) == n // BATCH  # known at once: the build is complete
    assert np.array_equal(ended.indices(BATCH), ended.follow_order.samples(np.arange(BATCH, 2 * BATCH)))
    rows = np.concatenate(list(ended))
    assert len(rows) == n // BATCH * BATCH
    assert np.array_equal(rows, expected_rows(ended, samples, n // BATCH))
    assert len({row.tobytes() for row in rows}) == len(rows)

    endless = make_follow(finished, then="epochs")
    loader = streampack.Loader(samples, batch_size=1, seed=5)
    for position in (n, n + 1, 2 * n - 1, 2 * n, 2 * n + 3):  # epochs 0 and 1 of the loader
        first = position // BATCH * BATCH
        endless.load_state_dict({**endless.state_dict(), "position": first})
        assert np.array_equal(next(iter(endless))[position - first], loader.batch(position - n)[0])
    with pytest.raises(TypeError, match="endless"):
        len(endless)
    assert list(make_follow(finished, seq_len=10**7)) == []  # not one window: the run ends at once
    with pytest.raises(OptionsError, match="then='epochs' has nothing to repeat"):
        next(iter(make_follow(finished, seq_len=10**7, then="epochs")))

    plain = make_follow(finished, overlap=0)
    as_dict = make_follow(finished, overlap=0, output="dict")
    assert np.array_equal(next(iter(as_dict))["input_ids"], next(iter(plain)))


def test_options_are_refused_before_waiting_and_states_serialize(finished: Path, tmp_path: Path) -> None:
    """Bad options fail at once, not after waiting for a build; numpy integers make a JSON state; a
    finished cache whose last batch would leave a rank empty is refused at every try, not once."""
    with pytest.raises(OptionsError, match="does not divide by world_size=3"):
        make_follow(tmp_path / "no-build-yet", batch_size=10, world_size=3, timeout=600)
    with pytest.raises(OptionsError, match="storage_options apply to caches in object storage"):
        make_follow(finished, storage_options={"anon": True})
    follow = make_follow(finished, seed=np.uint64(5), first_era=np.int64(64), seq_len=np.int32(SEQ_LEN))
    next(iter(follow))
    assert json.loads(json.dumps(follow.state_dict()))["order"]["eras"] == [64, 2048]
    n = len(streampack.open(finished).sequences(SEQ_LEN, overlap=OVERLAP))
    world = next(w for w in range(2, 64) if n % w)  # batches of one row per rank: a partial last one
    refused = make_follow(finished, batch_size=world, world_size=world, drop_last=False)
    for _ in range(2):  # before its first batch, from its position (a resume may move it where it fits)
        with pytest.raises(OptionsError, match="empty last batch"):
            next(iter(refused))


def test_a_follow_made_to_resume_a_finished_build_is_judged_from_the_checkpoints_position(
    finished: Path,
) -> None:
    """drop_last=False over a finished build: the last batch is checked from the position the resume
    gives, not from position 0, where another remainder would be refused."""
    n = len(streampack.open(finished).sequences(SEQ_LEN, overlap=OVERLAP))
    world = next(w for w in range(2, 64) if n % w)  # from position 0, a last batch of n % w rows
    first = make_follow(finished, batch_size=1, drop_last=False)
    first.advance(n % world)  # from here, whole batches of world rows to the end
    resumed = make_follow(finished, batch_size=world, world_size=world, drop_last=False)
    resumed.load_state_dict(first.state_dict())
    assert len(list(resumed)) == (n - n % world) // world


@pytest.mark.slow
def test_exclusions_of_a_followed_build_mask_documents_not_committed_yet_and_skip_is_refused(
    finished: Path, tmp_path: Path
) -> None:
    """Mask mode may name a document the running build has not committed yet: it is masked once served,
    as over the finished build, and the run audits clean; skip mode, whose walk ahead would read samples
    not committed yet, is refused."""
    from streampack.loader import Exclusions
    from streampack.runs.audit import audit
    from tests.test_reference_model import StagedBuild

    build = StagedBuild(finished, tmp_path / "c")
    build.commit(0, 3)
    later = build.docs[0] + 1  # a document of the second unit
    mask = Exclusions(documents=[later], mode="mask")

    def loader(**kwargs: Any) -> streampack.Loader:
        growing = make_follow(tmp_path / "c", overlap=0).dataset
        return streampack.Loader(growing, batch_size=BATCH, output="dict", **kwargs)

    with pytest.raises(OptionsError, match=r"mode='skip'.* not supported over a source that grows"):
        loader(exclude=Exclusions(documents=[later]))
    running = loader(exclude=mask)  # made while the build runs: the document is not committed yet
    build.finish()
    done = loader(exclude=mask)
    batches = list(running)
    assert len(batches) == len(done) > 0
    for a, b in zip(batches, done, strict=True):
        assert np.array_equal(a["labels"], b["labels"]) and np.array_equal(a["input_ids"], b["input_ids"])
    unmasked = list(loader())
    assert sum(int((a["labels"] != b["labels"]).sum()) for a, b in zip(batches, unmasked, strict=True)) > 0
    assert audit(running.state_dict(), tmp_path / "c", exclude=[mask]).clean


def test_the_build_digest_ignores_what_a_resumed_build_may_change(finished: Path) -> None:
    """A build resumed with its tokenizer at another path rewrites the manifest's tokenizer spec; states
    saved while following it must still resume."""
    import dataclasses

    from streampack.format.manifest import build_digest

    manifest = streampack.open(finished).manifest
    moved = dataclasses.replace(
        manifest,
        tokenizer=dataclasses.replace(manifest.tokenizer, spec="/elsewhere/tokenizer.json"),
        settings=dataclasses.replace(manifest.settings, tokenizer="/elsewhere/tokenizer.json"),
    )
    assert build_digest(moved) == build_digest(manifest)
    assert build_digest(dataclasses.replace(manifest, units=manifest.units[:-1])) != build_digest(manifest)


def test_states_resume_only_the_same_follow(finished: Path) -> None:
    follow = make_follow(finished)
    next(iter(follow))
    state = follow.state_dict()
    assert state["order"]["kind"] == "follow" and state["position"] == BATCH
    with pytest.raises(LoaderStateError, match="seed in checkpoint: 5 / seed in this loader: 6"):
        make_follow(finished, seed=6).load_state_dict(state)
    with pytest.raises(LoaderStateError, match="eras in checkpoint"):
        make_follow(finished, first_era=32).load_state_dict(state)
    with pytest.raises(LoaderStateError, match="The sequence length changed"):
        make_follow(finished, seq_len=SEQ_LEN + 1).load_state_dict(state)
    samples = streampack.open(finished).sequences(SEQ_LEN, overlap=OVERLAP)
    with pytest.raises(LoaderStateError, match="over a 'follow' order"):
        streampack.Loader(samples, batch_size=BATCH).load_state_dict(state)
    with pytest.raises(LoaderStateError, match="not by a Follow"):
        follow.load_state_dict(streampack.Loader(samples, batch_size=BATCH).state_dict())


@settings(max_examples=40, deadline=None)
@given(
    first=st.integers(1, 40),
    growth=st.integers(0, 5),
    total=st.integers(1, 3000),
    seed=st.integers(0, 2**64 - 1),
)
def test_the_follow_order_is_an_exact_epoch_and_eras_do_not_change_once_complete(
    first: int, growth: int, total: int, seed: int
) -> None:
    """Positions ``[0, N)`` visit each of the N windows once, each era within its own windows, and a full
    era maps the same before the build is complete as after."""
    eras = Eras(first, first * 2**growth + growth)
    running = FollowOrder(seed=seed, eras=eras, then="end", data={})
    done = FollowOrder(seed=seed, eras=eras, then="end", data={})
    done.finish(total)
    positions = np.arange(total, dtype=np.int64)
    windows = done.samples(positions)
    assert np.array_equal(np.sort(windows), positions)
    assert np.array_equal(eras.of(windows), eras.of(positions))
    full = eras.covered(total)
    assert np.array_equal(running.samples(positions[:full]), windows[:full])


@pytest.mark.slow
def test_a_trainer_trains_while_the_build_runs_and_resumes_to_the_same_batches(
    tmp_path: Path, bpe_tokenizer: Path
) -> None:
    """A real transformers Trainer (tiny random GPT-2) fed by a Follow trains while a build runs; after
    the build, a run of 3 steps resumed to 6 trains on exactly the batches of the run made while building."""
    pytest.importorskip("accelerate", reason="Trainer needs accelerate: pip install 'streampack[hf]'")
    hf = pytest.importorskip("streampack.hf", reason="needs pip install 'streampack[hf]'")
    from transformers import TrainingArguments

    from tests.frameworks import tiny_gpt2

    out = tmp_path / "c"
    seen: list[tuple[list[list[int]], bool]] = []
    proc = start_build(follow_args(corpus(tmp_path), out, bpe_tokenizer), out)

    class Recording(hf.Trainer):
        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            seen.append((inputs["input_ids"].tolist(), proc.poll() is None))
            if len(seen) == 2:
                release(proc)
            return super().training_step(model, inputs, num_items_in_batch)

    def train(run: str, max_steps: int, resume: bool = False) -> list[list[list[int]]]:
        args = TrainingArguments(str(tmp_path / run), per_device_train_batch_size=4, max_steps=max_steps,
                                 save_steps=3, use_cpu=True, report_to=[], logging_strategy="no",
                                 disable_tqdm=True)  # fmt: skip
        follow = make_follow(out, seq_len=8, overlap=0, batch_size=4, output="dict", then="epochs")
        seen.clear()
        trainer = Recording(model=tiny_gpt2(), args=args, train_dataset=follow)
        trainer.train(resume_from_checkpoint=resume or None)
        return [batch for batch, _ in seen]

    hold(proc)
    try:
        during = train("a", 6)
        assert seen[0][1], "the first step came after the build ended"
    finally:
        release(proc)
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr.decode()
    assert train("b", 3) + train("b", 6, resume=True) == during


def test_a_follow_takes_its_options_as_objects_or_keywords(finished: Path) -> None:
    """``Follow(path, options=LoaderOptions(...), follow=FollowOptions(...))`` is the Follow the keywords
    make; a Follow is a Loader made of a growing source and its order, no subclass of its own logic."""
    from streampack.follow import FollowOptions, GrowingCache
    from streampack.loader import LoaderOptions

    keywords = make_follow(finished)
    objects = Follow(
        finished,
        options=LoaderOptions(batch_size=BATCH, seed=5),
        follow=FollowOptions(seq_len=SEQ_LEN, overlap=OVERLAP, then="end", timeout=60.0, poll=0.02, **ERAS),
    )
    assert isinstance(objects, streampack.Loader) and isinstance(objects.dataset, GrowingCache)
    assert objects.options == keywords.options and objects.follow_options == keywords.follow_options
    assert objects.order is objects.follow_order and objects.path == finished
    assert all(np.array_equal(a, b) for a, b in zip(objects, keywords, strict=True))
    assert objects.state_dict() == keywords.state_dict()
    assert {name for name in vars(Follow) if not name.startswith("__")} <= {
        "follow_order", "follow_options", "path", "seq_len", "overlap", "then", "timeout", "poll",
    }  # fmt: skip
    assert (objects.seq_len, objects.overlap, objects.then, objects.poll) == (SEQ_LEN, OVERLAP, "end", 0.02)
    with pytest.raises(TypeError, match="'seq_lenn'; did you mean 'seq_len'"):
        make_follow(finished, seq_lenn=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'shuffle'"):
        make_follow(finished, shuffle=False)
    with pytest.raises(OptionsError, match="shuffle and epochs do not apply"):
        Follow(finished, options=LoaderOptions(batch_size=BATCH, epochs=2), seq_len=SEQ_LEN)


def test_a_mixture_refuses_a_followed_source_that_would_end(finished: Path) -> None:
    """In a Mixture a followed source serves epochs after its last era, so then="end" (which it could not
    keep) is refused, naming the source; the default then="epochs" is taken."""
    from streampack.order.mixture import Mixture

    web = streampack.open(finished).sequences(SEQ_LEN, overlap=OVERLAP)
    mix = {"weights": {"web": 0.5, "fresh": 0.5}, "block_size": 4, "seed": 2}
    with pytest.raises(OptionsError, match="source 'fresh' follows a build with then='end'"):
        Mixture({"web": web, "fresh": make_follow(finished)}, **mix)  # type: ignore[arg-type]
    endless = Mixture({"web": web, "fresh": make_follow(finished, then="epochs")}, **mix)  # type: ignore[arg-type]
    assert len(next(iter(streampack.Loader(endless, batch_size=BATCH)))) == BATCH

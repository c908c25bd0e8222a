"""Tests for `streampack.loader.exclusions` / `excluding`: documents and steps taken out of a run."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import streampack
from streampack.errors import LoaderStateError, OptionsError
from streampack.loader import Exclusions, Loader
from streampack.loader.excluding import Skipping, excluded_samples
from streampack.loader.exclusions import token_hash
from streampack.loader.history import StepCount
from streampack.order import Shuffled
from streampack.order.mixture import Mixture
from streampack.testing.caches import write_cache
from tests.conftest import in_threads

SEQ_LEN = 8
NUM_SAMPLES = 240


def _numbered(root: Path, count: int, seed: int) -> streampack.Cache:
    """A cache whose sample ``i`` of ``sequences(SEQ_LEN)`` holds only the id ``i``, in documents of random
    lengths (many cross a window boundary), in two shards."""
    rng = np.random.default_rng(seed)
    tokens = np.repeat(np.arange(count, dtype=np.int64), SEQ_LEN)
    half = len(tokens) // 2
    shards = []
    for part in (tokens[:half], tokens[half:]):
        cuts = np.sort(rng.choice(np.arange(1, len(part)), size=len(part) // 13, replace=False))
        shards.append((part, np.append(cuts, len(part))))
    return streampack.open(write_cache(root, shards, vocab_size=1000, eos_id=999))


@pytest.fixture(scope="module")
def numbered(tmp_path_factory: pytest.TempPathFactory) -> streampack.Cache:
    return _numbered(tmp_path_factory.mktemp("x") / "c", NUM_SAMPLES, 0)


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> streampack.Cache:
    return _numbered(tmp_path_factory.mktemp("y") / "c", 160, 1)


def _ids(batch: np.ndarray) -> list[int]:
    assert bool((batch == batch[:, :1]).all()), "a row mixes samples"
    return batch[:, 0].tolist()


def _global_steps(make, world: int) -> list[list[int]]:
    """Each global step's sample ids, the ranks' batches put side by side (ranks must be in lockstep)."""
    per_rank = [[_ids(b) for b in make(rank)] for rank in range(world)]
    assert len({len(steps) for steps in per_rank}) == 1, "ranks out of lockstep"
    return [[s for steps in per_rank for s in steps[i]] for i in range(len(per_rank[0]))]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    docs=st.lists(st.integers(0, 35), max_size=8),
    ranges=st.lists(st.tuples(st.integers(0, 400), st.integers(1, 20)), max_size=2),
    at_step=st.integers(0, 20),
    resume_step=st.integers(0, 40),
    world=st.sampled_from([1, 2, 3]),
    batch=st.sampled_from([6, 12]),
    seed=st.integers(0, 3),
)
def test_skip_serves_every_other_sample_of_an_epoch_once_and_keeps_the_past(
    numbered: streampack.Cache,
    docs: list[int],
    ranges: list[tuple[int, int]],
    at_step: int,
    resume_step: int,
    world: int,
    batch: int,
    seed: int,
) -> None:
    seqs = numbered.sequences(SEQ_LEN)
    at = at_step * batch
    # A range wholly before ``at`` is refused (it could take nothing out): the ranges reach ``at`` or past.
    exclusion = Exclusions(documents=docs, positions=[(a, a + n) for a, n in ranges if a + n > at], at=at)
    options = dict(batch_size=batch, seed=seed, epochs=2, world_size=world)
    plain = _global_steps(lambda r: Loader(seqs, rank=r, **options), world)

    def resumed(rank: int):
        first = Loader(seqs, rank=rank, exclude=exclusion, **options)
        out = []
        for step, got in enumerate(first):
            out.append(got)
            if step + 1 == resume_step:
                break
        # resume in a new loader, at another world size's worth of ranks' state (the state is global)
        again = Loader(seqs, rank=rank, exclude=[exclusion], **options)
        again.load_state_dict(first.state_dict())
        return out + list(again)

    steps = _global_steps(resumed, world)
    # Before the exclusion's position: byte for byte the run without it.
    assert steps[:at_step] == plain[:at_step]
    bad = set(excluded_samples(seqs, np.asarray(sorted(set(docs)), dtype=np.int64)).tolist())
    order = Loader(seqs, **options).order
    positions = np.arange(2 * NUM_SAMPLES, dtype=np.int64)
    samples = order(positions)[1]
    skipped_positions = {p for a, n in ranges for p in range(a, a + n)}
    expected = [
        int(s)
        for p, s in zip(positions.tolist(), samples.tolist(), strict=True)
        if p < at or (int(s) not in bad and p not in skipped_positions)
    ]
    served = [s for step in steps for s in step]
    assert served == expected[: len(served)]  # the same order, the excluded ones left out
    assert len(expected) - len(served) < batch  # only the partial last batch is dropped
    assert not set(served[at:]) & bad  # no excluded sample from the exclusion's position on
    in_epoch_one = sum(
        1 for p in range(NUM_SAMPLES) if p < at or (int(samples[p]) not in bad and p not in skipped_positions)
    )
    first = served[:in_epoch_one]
    assert len(first) == len(set(first))  # every sample of the epoch at most once


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(docs=st.lists(st.integers(0, 35), min_size=1, max_size=6), at_step=st.integers(0, 10))
def test_mask_keeps_positions_and_labels_exactly_the_excluded_tokens(
    numbered: streampack.Cache, docs: list[int], at_step: int
) -> None:
    seqs = numbered.sequences(SEQ_LEN)
    options = dict(batch_size=6, seed=2, epochs=1, output="dict")
    plain = list(Loader(seqs, **options))
    masked = list(Loader(seqs, exclude=Exclusions(documents=docs, mode="mask", at=at_step * 6), **options))
    assert len(plain) == len(masked)
    for step, (a, b) in enumerate(zip(plain, masked, strict=True)):
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
        doc_ids = seqs.boundaries(np.asarray(_ids(a["input_ids"]))).doc_ids
        hit = np.isin(doc_ids, docs) if step >= at_step else np.zeros_like(doc_ids, dtype=bool)
        assert (b["labels"][hit] == -100).all()
        np.testing.assert_array_equal(b["labels"][~hit], a["labels"][~hit])


def test_mask_mode_is_refused_for_plain_arrays(numbered: streampack.Cache) -> None:
    with pytest.raises(OptionsError, match="output='dict'"):
        Loader(numbered.sequences(SEQ_LEN), batch_size=6, exclude=Exclusions(documents=[1], mode="mask"))


def test_a_resume_with_a_longer_list_keeps_the_past_and_is_exact(numbered: streampack.Cache) -> None:
    seqs = numbered.sequences(SEQ_LEN)
    first, later = Exclusions(documents=[2, 30]), Exclusions(documents=[5], steps=[(14, 15)])
    run = Loader(seqs, batch_size=6, seed=4, epochs=2, exclude=first)
    head = [_ids(b) for _, b in zip(range(10), run, strict=False)]
    state = run.state_dict()
    again = Loader(seqs, batch_size=6, seed=4, epochs=2, exclude=[first, later])
    again.load_state_dict(state)
    assert again.exclusions_state()[1]["at"] == state["position"] == 60
    tail = [_ids(b) for b in again]
    # the same run made whole, with the second exclusion in force from position 60
    whole = Loader(
        seqs,
        batch_size=6,
        seed=4,
        epochs=2,
        exclude=[first, Exclusions(documents=[5], steps=[(14, 15)], at=60)],
    )
    assert [_ids(b) for b in whole] == head + tail
    plain_with_first = [_ids(b) for b in Loader(seqs, batch_size=6, seed=4, epochs=2, exclude=first)]
    assert plain_with_first[:10] == head
    # steps 14-15 of the run as served are gone: step 14 now serves what step 16 did, less document 5
    bad5 = set(excluded_samples(seqs, np.asarray([5])).tolist())
    rest = [s for step in plain_with_first[10:] for s in step]
    expected = [s for s in rest[:24] if s not in bad5] + [s for s in rest[36:] if s not in bad5]
    assert [s for step in tail for s in step][: len(expected) - 6] == expected[: len(expected) - 6]
    # the same list again: exact
    same = Loader(seqs, batch_size=6, seed=4, epochs=2, exclude=[first, later])
    same.load_state_dict(
        again.state_dict() | {"position": state["position"]} | {"exclusions": again.exclusions_state()}
    )
    assert [_ids(b) for b in same] == tail


def test_a_shorter_or_changed_list_is_refused(numbered: streampack.Cache) -> None:
    seqs = numbered.sequences(SEQ_LEN)
    run = Loader(seqs, batch_size=6, exclude=[Exclusions(documents=[2]), Exclusions(documents=[3], at=12)])
    state = run.state_dict()
    with pytest.raises(LoaderStateError, match="missing"):
        Loader(seqs, batch_size=6, exclude=[Exclusions(documents=[2])]).load_state_dict(state)
    with pytest.raises(LoaderStateError, match="missing"):
        Loader(seqs, batch_size=6).load_state_dict(state)
    with pytest.raises(LoaderStateError, match="differs"):
        Loader(
            seqs, batch_size=6, exclude=[Exclusions(documents=[9]), Exclusions(documents=[3])]
        ).load_state_dict(state)
    with pytest.raises(LoaderStateError, match="exclusions"):
        Loader(seqs, batch_size=6).load_state_dict(state | {"exclusions": [{"digest": 1}]})


def test_real_dataloader_workers_and_ranks_serve_the_filtered_epoch_once(numbered: streampack.Cache) -> None:
    from streampack.torch import DataLoader

    seqs = numbered.sequences(SEQ_LEN)
    exclusion = Exclusions(documents=[0, 7, 33], steps=[(3, 3)])
    served = []
    for rank in range(2):
        loader = Loader(seqs, batch_size=8, seed=5, epochs=1, rank=rank, world_size=2, exclude=exclusion)
        served += [i for batch in DataLoader(loader, num_workers=2) for i in _ids(batch.numpy())]
    bad = set(excluded_samples(seqs, np.asarray([0, 7, 33])).tolist())
    single = Loader(seqs, batch_size=8, seed=5, epochs=1)
    step3 = set(single.indices(24).tolist()) | set(
        Loader(seqs, batch_size=8, seed=5, epochs=1, rank=1, world_size=2).indices(24).tolist()
    )
    good = set(range(NUM_SAMPLES)) - bad - step3
    assert len(served) == len(set(served))
    assert set(served) <= good and len(good) - len(served) < 8


def test_a_mixture_excludes_per_source_through_a_weight_change(
    numbered: streampack.Cache, other: streampack.Cache
) -> None:
    sources = {"a": numbered.sequences(SEQ_LEN), "b": other.sequences(SEQ_LEN)}
    exclusion = Exclusions(documents={"a": [1, 2], "b": [4]})
    bad = {("a", s) for s in excluded_samples(sources["a"], np.asarray([1, 2])).tolist()} | {
        ("b", s) for s in excluded_samples(sources["b"], np.asarray([4])).tolist()
    }

    def picks(loader: Loader, steps: int) -> list[tuple[str, int]]:
        out = []
        for position in itertools.islice(loader.schedule(), steps):
            src, smp = loader.picks(position)
            out += [(loader.order.names[s], int(i)) for s, i in zip(src.tolist(), smp.tolist(), strict=True)]
        return out

    mix = Mixture(sources, weights={"a": 1, "b": 1}, seed=3, block_size=16)
    run = Loader(mix, batch_size=8, exclude=exclusion)
    head = picks(run, 10)
    run.advance(10)
    state = run.state_dict()
    changed = Loader(
        Mixture(sources, weights={"a": 3, "b": 1}, seed=3, block_size=16), batch_size=8, exclude=exclusion
    )
    changed.load_state_dict(state)
    tail = picks(changed, 30)
    served = head + tail
    assert not set(served) & bad
    for name in ("a", "b"):  # within each source's first epoch, nothing twice
        mine = [s for n, s in served if n == name]
        size = len(sources[name]) - sum(1 for n, _ in bad if n == name)
        first = mine[:size]
        assert len(first) == len(set(first))
    # the past is kept: a loader with the old weights serves the same 10 steps
    assert (
        picks(
            Loader(
                Mixture(sources, weights={"a": 1, "b": 1}, seed=3, block_size=16),
                batch_size=8,
                exclude=exclusion,
            ),
            10,
        )
        == head
    )


def test_documents_by_token_hash_and_packed_layouts(numbered: streampack.Cache) -> None:
    hashes = [token_hash(numbered.doc(i)) for i in (4, 20)]
    seqs = numbered.sequences(SEQ_LEN)
    by_hash = Loader(seqs, batch_size=6, seed=1, epochs=1, exclude=Exclusions(hashes=hashes))
    by_index = Loader(seqs, batch_size=6, seed=1, epochs=1, exclude=Exclusions(documents=[4, 20]))
    assert [_ids(b) for b in by_hash] == [_ids(b) for b in by_index]
    packed = numbered.packed(SEQ_LEN * 3)
    loader = Loader(
        packed, batch_size=4, seed=1, epochs=1, output="dict", exclude=Exclusions(documents=[4, 20])
    )
    seen = np.concatenate([loader.indices(p) for p in loader.schedule()])
    docs = packed.boundaries(seen).doc_ids
    assert not np.isin(docs, [4, 20]).any()
    assert len(seen) > len(packed) - 4 - 2


def test_bad_exclusions_are_refused_with_what_was_given(numbered: streampack.Cache) -> None:
    seqs = numbered.sequences(SEQ_LEN)
    with pytest.raises(OptionsError, match="mode"):
        Exclusions(mode="drop")  # type: ignore[arg-type]
    with pytest.raises(OptionsError, match="first <= last"):
        Exclusions(steps=[(5, 2)])
    with pytest.raises(OptionsError, match="documents"):
        Loader(seqs, batch_size=6, exclude=Exclusions(documents=[10**6]))
    with pytest.raises(OptionsError, match="source"):
        Loader(seqs, batch_size=6, exclude=Exclusions(documents={"web": [1]}))
    run = Loader(seqs, batch_size=6)
    run.advance(3)
    with pytest.raises(OptionsError, match="before the loader's position"):
        run.exclude(Exclusions(documents=[1], at=6))
    run.exclude(Exclusions(documents=[1]))
    assert run.exclusions_state()[0]["at"] == 18


def test_a_mixture_config_names_exclusions_globally_and_per_source(
    numbered: streampack.Cache, other: streampack.Cache, tmp_path: Path
) -> None:
    from streampack.runs.mixconfig import load_mixture, mixture_exclusions

    config = tmp_path / "mix.yaml"
    config.write_text(
        f"seq_len: {SEQ_LEN}\nseed: 2\nblock_size: 16\n"
        f"sources:\n  a: {{path: {numbered.root}, exclude: {{documents: [1, 2]}}}}\n  b: {other.root}\n"
        "weights: {a: 1, b: 1}\n"
        "exclude:\n  - steps: [[2, 3]]\n  - documents: {b: [4]}\n    mode: skip\n"
    )
    found = mixture_exclusions(config)
    assert [e.counts() for e in found] == [
        {"documents": 0, "hashes": 0, "steps": 1, "positions": 0},
        {"documents": 1, "hashes": 0, "steps": 0, "positions": 0},
        {"documents": 2, "hashes": 0, "steps": 0, "positions": 0},
    ]
    loader = Loader(load_mixture(config), batch_size=8, exclude=found)
    bad_a = set(excluded_samples(numbered.sequences(SEQ_LEN), np.asarray([1, 2])).tolist())
    for position in itertools.islice(loader.schedule(), 40):
        sources, samples = loader.picks(position)
        assert not {int(s) for s, src in zip(samples, sources, strict=True) if src == 0} & bad_a
    with pytest.raises(OptionsError, match=r"exclude\[0\]"):
        mixture_exclusions({"sources": {}, "exclude": [{"step": [1, 2]}]})


def test_the_epoch_under_skip_exclusions_is_the_one_of_the_order_they_filter(
    numbered: streampack.Cache,
) -> None:
    seqs = numbered.sequences(SEQ_LEN)
    docs = [4, 20, 21, 90, 140]
    bad = set(excluded_samples(seqs, np.asarray(docs)).tolist())
    plain = Loader(seqs, batch_size=6, seed=1, epochs=2, drop_last=False)
    served = [(p + k, s) for p in plain.schedule() for k, s in enumerate(plain.indices(p).tolist())]
    kept = [(base, s) for base, s in served if s not in bad]  # the run without them, a list filtered
    loader = Loader(seqs, batch_size=6, seed=1, epochs=2, drop_last=False, exclude=Exclusions(documents=docs))
    epochs = []
    for batch in loader:
        position = loader.position - len(batch)
        assert _ids(batch) == [s for _, s in kept[position : position + len(batch)]]
        loader_at = Loader(
            seqs, batch_size=6, seed=1, epochs=2, drop_last=False, exclude=Exclusions(documents=docs)
        )
        loader_at.load_state_dict({**loader.state_dict(), "position": position})
        epochs.append((loader_at.epoch, kept[position][0] // len(seqs)))
    assert all(mine == expected for mine, expected in epochs) and {e for e, _ in epochs} == {0, 1}
    assert loader.epoch == 2  # the end of the run


# --- steps are the trainer's: counted through the run's history ---------------------------------------------


def _indices(loader: Loader, start: int, stop: int) -> list[int]:
    """The sample ids ``loader`` serves at positions ``start`` to ``stop`` (a multiple of its batch size)."""
    step = loader.options.batch_size
    return [s for p in range(start, stop, step) for s in loader.indices(p).tolist()]


def test_steps_are_the_trainers_under_gradient_accumulation(numbered: streampack.Cache) -> None:
    """The review's case (1): a trainer accumulating 3 batches a step, checkpointed at step 10; its loss
    spike at steps 12-13 is the 24 positions 144-168, not 12 * 4 to 14 * 4 (before the resume, so nothing)."""
    from streampack.runs.audit import audit

    seqs = numbered.sequences(SEQ_LEN)
    run = Loader(seqs, batch_size=4, seed=1)
    run.batches_per_step = 3  # as streampack.hf and streampack.lightning set it
    run.advance(10 * 3)
    state = run.state_dict()
    reference = Loader(seqs, batch_size=4, seed=1)
    spike = Exclusions(steps=[(12, 13)])
    expected = _indices(reference, 120, 144) + _indices(reference, 168, 288)
    for before in (True, False):  # set by hand before the resume, or after it, as streampack.hf does
        again = Loader(seqs, batch_size=4, seed=1, exclude=spike)
        if before:
            again.batches_per_step = 3
        again.load_state_dict(state, step=10)
        if not before:
            again.batches_per_step = 3
        assert _indices(again, 120, 264) == expected
        assert again.exclusions_state()[0] | {"digest": None} == {
            "digest": None, "mode": "skip", "at": 120, "legs": 2, "documents": 0, "hashes": 0, "steps": 1,
            "positions": 0,
        }  # fmt: skip
    again.advance(12)
    later = again.state_dict()
    resumed = Loader(seqs, batch_size=4, seed=1, exclude=spike)  # batches_per_step not set: the state has it
    resumed.load_state_dict(later, step=14)
    assert _indices(resumed, 168, 264) == expected[48:]
    report = audit(resumed.state_dict(), seqs, exclude=[spike])
    assert report.clean, report.text()
    assert report.sources[0].excluded == 24 and report.legs[1].steps == (10, 14)


def test_steps_are_counted_through_a_change_of_batch_size(numbered: streampack.Cache) -> None:
    """The review's case (2): 20 steps of 4, then of 8 from step 20 (position 80): steps 27-28 are positions
    136-152, not 27 * 8 to 29 * 8; a range over both legs takes out each leg's part."""
    seqs = numbered.sequences(SEQ_LEN)
    run = Loader(seqs, batch_size=4, seed=2)
    run.advance(20)
    wider = Loader(seqs, batch_size=8, seed=2)
    wider.load_state_dict(run.state_dict(), step=20)
    wider.advance(5)
    state = wider.state_dict()
    again = Loader(seqs, batch_size=8, seed=2, exclude=Exclusions(steps=[(27, 28)]))
    again.load_state_dict(state, step=25)
    reference = Loader(seqs, batch_size=8, seed=2)
    assert _indices(again, 120, 200) == _indices(reference, 120, 136) + _indices(reference, 152, 216)
    counted = StepCount.of_history(again.history)  # steps 0-19 of 4, 20-24 of 8, from 25 of 8
    assert Exclusions(steps=[(18, 21)]).ranges(counted) == [(72, 80), (80, 96)]  # each leg's part
    assert Exclusions(steps=[(18, 21)]).ranges(8) == [(144, 176)]  # at one batch size, as before


def test_a_range_wholly_before_where_the_exclusion_takes_effect_is_refused(
    numbered: streampack.Cache,
) -> None:
    """A range the run has passed could never take anything out: refused, naming it, its positions and
    where the exclusion takes effect; a range partly after it is taken."""
    seqs = numbered.sequences(SEQ_LEN)
    run = Loader(seqs, batch_size=4, seed=1)
    run.advance(10)
    state = run.state_dict()
    with pytest.raises(
        OptionsError, match=r"steps=\[\(3, 5\)\]\) takes out positions 12-24 .*before position 40"
    ):
        Loader(seqs, batch_size=4, seed=1, exclude=Exclusions(steps=[(3, 5)])).load_state_dict(state)
    with pytest.raises(OptionsError, match=r"positions=\[\(0, 40\)\]\) lies wholly before position 40"):
        Loader(seqs, batch_size=4, seed=1, exclude=Exclusions(positions=[(0, 40)])).load_state_dict(state)
    partly = Loader(seqs, batch_size=4, seed=1, exclude=Exclusions(steps=[(8, 11)]))
    partly.load_state_dict(state)
    assert _indices(partly, 40, 48) == _indices(Loader(seqs, batch_size=4, seed=1), 48, 56)
    with pytest.raises(OptionsError, match=r"positions=\[\(10, 20\)\]\) lies wholly before position 40"):
        run.exclude(Exclusions(positions=[(10, 20)]))
    assert run.exclusions_state() == []  # nothing put in force
    ahead = Loader(seqs, batch_size=4, seed=1, exclude=Exclusions(steps=[(20, 21)], at=100))
    ahead.batches_per_step = 1  # a resume may still count its steps again (the checkpoint's own exclusion)
    with pytest.raises(OptionsError, match="before position 100"):
        next(iter(ahead))  # its steps are positions 80-88: the check runs before the first batch
    served = Loader(seqs, batch_size=4, seed=1, exclude=Exclusions(steps=[(5, 6)]))
    served.advance(2)
    with pytest.raises(OptionsError, match="set batches_per_step before the first batch"):
        served.batches_per_step = 2
    plain = Loader(seqs, batch_size=4, seed=1)
    assert served.batches_per_step == 1 and _indices(served, 20, 24) == _indices(plain, 28, 32)  # as it was


def test_batches_per_step_set_before_a_resume_keeps_the_checkpoints_exclusions(
    numbered: streampack.Cache,
) -> None:
    """The checkpoint's exclusion given again with its at=: setting batches_per_step before
    load_state_dict (a loop of one's own) counts its steps at the fresh loader's stride for a moment (step
    4 at positions 16-20, before its at=24); it is not refused then, and the resume counts them again
    through the history, as the run did (step 3 at position 24 after three batches of 8: step 4 is 28-32)."""
    seqs = numbered.sequences(SEQ_LEN)
    first = Loader(seqs, batch_size=8, seed=1)
    first.advance(3)
    second = Loader(seqs, batch_size=4, seed=1, exclude=[Exclusions(steps=[(4, 4)])])
    second.load_state_dict(first.state_dict(), step=3)
    state = second.state_dict()
    again = Loader(seqs, batch_size=4, seed=1, exclude=[Exclusions(steps=[(4, 4)], at=24)])
    again.batches_per_step = 1
    again.load_state_dict(state, step=3)
    plain = Loader(seqs, batch_size=4, seed=1)
    assert _indices(again, 24, 28) == _indices(plain, 24, 28)
    assert _indices(again, 28, 32) == _indices(plain, 32, 36)


def test_a_state_saved_before_steps_were_counted_through_the_history_resumes_as_it_counted(
    numbered: streampack.Cache,
) -> None:
    """An exclusion recorded with the batch size its steps were counted at (no ``legs``) keeps that
    meaning: steps of that many positions from position 0."""
    seqs = numbered.sequences(SEQ_LEN)
    steps = Exclusions(steps=[(12, 13)])
    run = Loader(seqs, batch_size=4, seed=1, exclude=steps)
    run.advance(5)
    state = run.state_dict()
    record = state["exclusions"][0]
    del record["legs"]
    record["batch_size"] = 2  # steps 12-13 at 2 positions a step: positions 24-28
    old = Loader(seqs, batch_size=4, seed=1, exclude=steps)
    old.load_state_dict(state)
    assert old.exclusions_state()[0]["batch_size"] == 2
    same = Loader(seqs, batch_size=4, seed=1, exclude=Exclusions(positions=[(24, 28)]))
    assert _indices(old, 20, 60) == _indices(same, 20, 60)


def test_skipped_positions_are_the_same_when_a_prefetch_thread_maps_positions_at_once() -> None:
    """A remote cache's prefetch thread maps the positions of batches ahead while the trainer's thread
    reads: both extend the skip exclusion's chunk counts, which must not count a chunk twice (every
    position after it would serve another sample) nor lose a kept chunk under the other (an IndexError)."""
    size = 1 << 22
    base = Shuffled(size, seed=3, shuffle=True, epochs=None, data=None, name="data")
    keys = np.unique(np.random.default_rng(0).integers(0, size, 200_000)).astype(np.int64)
    no_ranges = (np.zeros(0, np.int64), np.zeros(0, np.int64))
    stop = 1_500_000
    expected = Skipping(base, 10, keys, no_ranges)(np.arange(stop, dtype=np.int64))[1]
    problems: list[str] = []

    def read(order: Skipping, stride: int) -> None:
        try:
            for lo in range(0, stop, stride):
                got = order(np.arange(lo, min(lo + stride, stop), dtype=np.int64))[1]
                if not np.array_equal(got, expected[lo : lo + len(got)]):
                    problems.append(f"positions {lo}-{lo + len(got)} differ")
        except Exception as error:  # a thread's failure is reported by the test
            problems.append(repr(error))

    for _ in range(3):
        order = Skipping(base, 10, keys, no_ranges)
        in_threads(read, [(order, 4096 * k) for k in (1, 2, 3)])
    assert problems == []

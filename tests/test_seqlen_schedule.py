"""Sequence-length schedules: units of the largest length served as sub-windows, positions counted in units,
so no token of an epoch is served twice or skipped across a change, at a resume too, in a mixture, with
DataLoader workers, and an audit of such a run is clean (and catches a planted repeat).

The caches hold token ``t`` at stream position ``t``: every row says which tokens of the stream it served.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import streampack
from streampack import Loader, Mixture
from streampack.errors import LoaderStateError, OptionsError
from streampack.loader.seqlen import SeqLenSchedule
from streampack.runs.audit import audit
from streampack.testing.caches import write_cache

TOKENS = 20_000
UNIT = 64


def numbered_cache(
    root: Path, tokens: int = TOKENS, first: int = 0, vocab: int = TOKENS + 1
) -> streampack.Cache:
    """A cache whose token at stream position ``t`` is ``first + t``, in two shards of a few documents."""
    half = tokens // 2
    ends = np.array([700, 3_000, half])
    shards = [(first + np.arange(half), ends), (first + half + np.arange(tokens - half), ends)]
    return streampack.open(write_cache(root, shards, vocab_size=vocab, eos_id=vocab - 1))


@pytest.fixture(scope="module")
def numbered(tmp_path_factory: pytest.TempPathFactory) -> streampack.Cache:
    return numbered_cache(tmp_path_factory.mktemp("seqlen") / "cache")


def cores(batch: np.ndarray, overlap: int) -> np.ndarray:
    """The stream positions a batch's rows serve as inputs (without the overlap tail), row after row; each
    unit's part of a row (all of it, or a joined row's every ``UNIT`` tokens) is contiguous text."""
    batch = np.asarray(batch)
    width = batch.shape[1] - overlap
    body = batch[:, :width].reshape(-1, min(width, UNIT))
    assert (np.diff(body, axis=1) == 1).all(), "a unit's part of a row is not contiguous text"
    tail = batch[:, width:] - batch[:, width - 1 : width]
    assert (tail == np.arange(1, overlap + 1)).all(), "the overlap does not continue the row"
    return body.reshape(-1)


def unit_tokens(units: np.ndarray, unit: int) -> np.ndarray:
    """The input tokens of windows ``units`` of ``unit`` tokens, unit after unit."""
    return (units[:, None] * unit + np.arange(unit)).reshape(-1)


def test_a_warmup_serves_every_token_of_the_epoch_once(numbered: streampack.Cache) -> None:
    seqs = numbered.sequences(UNIT, overlap=1)
    schedule = [(0, 16), (UNIT * 8 * 10, 32), (UNIT * 8 * 20, UNIT)]
    loader = Loader(seqs, batch_size=8, seed=3, epochs=1, seq_len_schedule=schedule)
    shapes, served = [], []
    for position, batch in zip(loader.schedule(), loader, strict=False):
        assert batch.shape == loader.batch_shape(position)
        shapes.append(batch.shape)
        np.testing.assert_array_equal(cores(batch, 1), unit_tokens(loader.indices(position), UNIT))
        served.append(cores(batch, 1))
    assert shapes[0] == (32, 17) and shapes[10] == (16, 33) and shapes[-1] == (8, 65)
    everything = np.concatenate(served)
    np.testing.assert_array_equal(np.sort(everything), np.arange(len(seqs) // 8 * 8 * UNIT))


def test_schedules_are_checked() -> None:
    with pytest.raises(OptionsError, match="token 0"):
        SeqLenSchedule([(5, 16)])
    with pytest.raises(OptionsError, match="must increase"):
        SeqLenSchedule([(0, 16), (0, 32)])
    assert (
        SeqLenSchedule([(0, 16), (100, 32)]).at(99) == 16
        and SeqLenSchedule([(0, 16), (100, 32)]).at(100) == 32
    )


def test_a_length_that_does_not_divide_the_units_is_refused(numbered: streampack.Cache) -> None:
    with pytest.raises(OptionsError, match="seq_len 48, which does not divide the units' length 64"):
        Loader(numbered.sequences(UNIT), batch_size=4, seq_len_schedule=[(0, 48)])
    with pytest.raises(OptionsError, match="sub-windows of fixed windows"):
        Loader(numbered.documents(UNIT), batch_size=4, seq_len_schedule=[(0, 16)])


LENGTHS = st.sampled_from([8, 16, 32, UNIT])


@st.composite
def legs(draw: Any) -> list[dict[str, Any]]:
    """A run's legs: each with its world size, rows per rank, steps, and either a schedule over the units
    or (after the first) a loader of another seq_len resuming the units (sub-windows, or two joined)."""
    count = draw(st.integers(1, 4))
    out = []
    for index in range(count):
        world = draw(st.sampled_from([1, 2, 4]))
        leg: dict[str, Any] = {
            "world": world,
            "rows": draw(st.integers(1, 3)),
            "steps": draw(st.integers(0, 8)),
        }
        if index and draw(st.booleans()):
            leg["length"] = draw(st.sampled_from([8, 16, 32, 2 * UNIT]))
        else:
            firsts = sorted(draw(st.lists(st.integers(1, 60), max_size=3, unique=True)))
            lengths = draw(st.lists(LENGTHS, min_size=len(firsts) + 1, max_size=len(firsts) + 1))
            leg["schedule"] = list(zip([0, *(f * UNIT * 4 for f in firsts)], lengths, strict=True))
        out.append(leg)
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(run=legs(), overlap=st.sampled_from([0, 1]), seed=st.integers(0, 3))
def test_no_token_of_an_epoch_twice_nor_skipped(
    numbered: streampack.Cache, run: list[dict[str, Any]], overlap: int, seed: int
) -> None:
    """Ranks x resumes x schedules x lengths: what every rank served, leg after leg, is each unit of the
    epoch's order up to where the run stopped, in that order, each token once."""
    # Joins (a resume at a longer length) need labels to mask them (output="dict"; tests/
    # test_reference_model.py runs them): with this numpy output they are refused.
    assume(all(leg.get("length", 0) <= UNIT for leg in run))
    units = numbered.sequences(UNIT, overlap=overlap)
    state: dict[str, Any] | None = None
    served: list[np.ndarray] = []
    expected: list[np.ndarray] = []
    for index, leg in enumerate(run):
        last = index == len(run) - 1
        world = leg["world"]
        ranks = []
        for rank in range(world):
            if "length" in leg:
                k = max(1, UNIT // leg["length"])
                data, schedule = numbered.sequences(leg["length"], overlap=overlap), None
                batch = leg["rows"] * world * k
            else:
                data, batch, schedule = units, leg["rows"] * world, leg["schedule"]
            loader = Loader(data, batch_size=batch, rank=rank, world_size=world, seed=seed, epochs=1,
                            seq_len_schedule=schedule)  # fmt: skip
            if state is not None:
                loader.load_state_dict(state)
            ranks.append(loader)
        iterators = [iter(loader) for loader in ranks]
        steps = 0
        while last or steps < leg["steps"]:
            position = ranks[0].position
            batches = [next(it, None) for it in iterators]
            if batches[0] is None:
                break
            for loader, batch in zip(ranks, batches, strict=True):
                served.append(cores(batch, overlap))
                expected.append(unit_tokens(loader.indices(position), UNIT))
            steps += 1
        state = ranks[0].state_dict()
    got, want = np.concatenate(served), np.concatenate(expected)
    np.testing.assert_array_equal(got, want)  # the epoch's units, in its order, each as its sub-windows
    assert len(np.unique(got)) == len(got)  # no token twice
    left = len(units) - state["position"]
    assert 0 <= left < max(leg["rows"] * leg["world"] * max(1, leg.get("length", 0) // UNIT) for leg in run)
    assert len(got) == state["position"] * UNIT  # none skipped: every unit up to the end, in full


def run_batches(loader: Loader, steps: int | None = None) -> list[np.ndarray]:
    out = []
    for batch in loader:
        out.append(np.asarray(batch))
        if steps is not None and len(out) == steps:
            break
    return out


@pytest.mark.parametrize("stop", [3, 5, 6, 9])
def test_a_resume_across_a_change_is_byte_exact(numbered: streampack.Cache, stop: int) -> None:
    seqs = numbered.sequences(UNIT, overlap=1)
    options = {"batch_size": 8, "seed": 1, "epochs": 1, "seq_len_schedule": [(0, 16), (UNIT * 8 * 5, UNIT)]}
    whole = run_batches(Loader(seqs, **options))
    first = Loader(seqs, **options)
    before = run_batches(first, stop)
    again = Loader(seqs, **options)
    again.load_state_dict(first.state_dict())
    after = run_batches(again)
    assert len(before + after) == len(whole)
    assert all(np.array_equal(a, b) for a, b in zip(before + after, whole, strict=True))


def test_a_resume_at_a_shorter_seq_len_is_the_run_with_that_change(numbered: streampack.Cache) -> None:
    """A loader of cache.sequences(16) resuming a checkpoint of windows of 64 serves the same batches as the
    uninterrupted run whose schedule changes to 16 there; a length that divides neither way is refused."""
    whole = run_batches(
        Loader(
            numbered.sequences(UNIT),
            batch_size=8,
            seed=2,
            epochs=1,
            seq_len_schedule=[(0, UNIT), (UNIT * 8 * 4, 16)],
        )
    )
    first = Loader(numbered.sequences(UNIT), batch_size=8, seed=2, epochs=1)
    before = run_batches(first, 4)
    state = first.state_dict()
    shorter = Loader(numbered.sequences(16), batch_size=32, seed=2, epochs=1)
    shorter.load_state_dict(state)
    after = run_batches(shorter)
    assert all(np.array_equal(a, b) for a, b in zip(before + after, whole, strict=True))
    assert len(before + after) == len(whole)
    assert shorter.history[-1]["served"] == {"seq_len": 16, "schedule": None}
    assert shorter.history[-1]["data"]["seq_len"] == UNIT
    odd = Loader(numbered.sequences(48), batch_size=8, seed=2, epochs=1)
    with pytest.raises(LoaderStateError, match="windows of 64 tokens, this loader serves seq_len 48"):
        odd.load_state_dict(state)
    assert odd.position == 0 and odd.width == 48  # unchanged by the refusal
    uneven = Loader(numbered.sequences(16), batch_size=6, seed=2, epochs=1)
    with pytest.raises(LoaderStateError, match="multiple of 4"):
        uneven.load_state_dict(state)


def test_a_resume_at_a_longer_seq_len_joins_the_units_in_their_order(numbered: streampack.Cache) -> None:
    """A loader of cache.sequences(128) resuming a checkpoint of windows of 64 serves two units a row, in
    the order's order, each starting a segment of its own (output="dict": no loss across the join); a
    numpy output, which has no labels to mask the join, is refused."""
    first = Loader(numbered.sequences(UNIT), batch_size=8, seed=2, epochs=1)
    before = run_batches(first, 3)
    state = first.state_dict()
    longer = Loader(numbered.sequences(2 * UNIT), batch_size=4, seed=2, epochs=1, output="dict")
    longer.load_state_dict(state)
    assert longer.options.batch_size == 8 and longer.width == 2 * UNIT  # 8 units a step, 4 rows of 128
    position = longer.position
    fields = longer.batch(position)
    batch = fields["input_ids"]
    np.testing.assert_array_equal(batch.reshape(-1), unit_tokens(longer.indices(position), UNIT))
    rest = [b["input_ids"] for b in longer]
    served = np.concatenate([cores(b, 0) for b in before + rest])
    assert len(np.unique(served)) == len(served) == longer.position * UNIT
    assert (fields["position_ids"][:, [0, UNIT]] == 0).all() and (
        fields["labels"][:, [0, UNIT]] == -100
    ).all()
    with pytest.raises(LoaderStateError, match="output='numpy' has no labels to mask the joins"):
        Loader(numbered.sequences(2 * UNIT), batch_size=4, seed=2, epochs=1).load_state_dict(state)
    with pytest.raises(LoaderStateError, match="drop_last=True"):
        Loader(
            numbered.sequences(2 * UNIT), batch_size=4, seed=2, epochs=1, drop_last=False, output="dict"
        ).load_state_dict(state)


def test_a_resume_at_a_longer_seq_len_with_an_overlap_is_refused_naming_the_fixes(
    numbered: streampack.Cache,
) -> None:
    """Joined units with an overlap would train the last input of each unit on the next unit's first token
    (a row A[:64] + B[:65]): refused, naming what resumes instead; nothing changes."""
    first = Loader(numbered.sequences(UNIT, overlap=1), batch_size=8, seed=3)
    run_batches(first, 2)
    state = first.state_dict()
    longer = Loader(numbered.sequences(2 * UNIT, overlap=1), batch_size=4, seed=3)
    with pytest.raises(LoaderStateError) as info:
        longer.load_state_dict(state)
    message = str(info.value)
    assert "joins 2 of them a row" in message and "overlap=1" in message
    assert "seq_len 64 or a length that divides it" in message and "output='dict'" in message
    assert longer.position == 0 and longer.width == 2 * UNIT + 1  # unchanged by the refusal
    shorter = Loader(numbered.sequences(UNIT // 2, overlap=1), batch_size=16, seed=3)
    shorter.load_state_dict(state)  # a divisor still resumes: each unit's sub-windows keep their own tokens
    batch = shorter.batch(shorter.position)
    cores(batch, 1)  # every row continues its own text, overlap included
    joined = Loader(numbered.sequences(2 * UNIT), batch_size=4, seed=3, output="dict")
    joined.load_state_dict(Loader(numbered.sequences(UNIT), batch_size=8, seed=3).state_dict())
    assert (joined.batch(0)["labels"][:, UNIT] == -100).all()  # the fix named: the join is not a target


def test_a_mixture_with_a_schedule_serves_each_sources_units_once(tmp_path: Path) -> None:
    web = numbered_cache(tmp_path / "web", 12_000, vocab=200_000).sequences(UNIT, overlap=1)
    code = numbered_cache(tmp_path / "code", 8_000, first=100_000, vocab=200_000).sequences(UNIT, overlap=1)
    mixture = Mixture({"web": web, "code": code}, {"web": 2, "code": 1}, block_size=6, seed=4)
    loader = Loader(mixture, batch_size=6, seq_len_schedule=[(0, 16), (UNIT * 6 * 12, 32)])
    served = np.concatenate([cores(batch, 1) for batch in run_batches(loader, 24)])
    assert len(np.unique(served)) == len(served) == loader.position * UNIT
    for (name, data), count in zip(
        mixture.sources_and_order()[0].items(), loader.order.consumed(loader.position)
    ):
        assert count < len(data), name  # within the first epoch of each source
        mine = served[(served >= 100_000) == (name == "code")]
        assert len(mine) == count * UNIT


def test_dataloader_workers_serve_the_schedule(numbered: streampack.Cache) -> None:
    from streampack.torch import DataLoader

    seqs = numbered.sequences(UNIT, overlap=1)
    options = {"batch_size": 6, "seed": 3, "epochs": 1, "seq_len_schedule": [(0, 16), (UNIT * 6 * 7, UNIT)]}
    expected = run_batches(Loader(seqs, **options))
    got = list(DataLoader(Loader(seqs, **options), num_workers=2))
    assert [tuple(t.shape) for t in got] == [b.shape for b in expected]
    assert all(np.array_equal(t.numpy(), b) for t, b in zip(got, expected, strict=True))


def test_dict_output_gives_each_sub_window_its_own_boundaries(numbered: streampack.Cache) -> None:
    loader = Loader(numbered.sequences(UNIT), batch_size=4, seed=1, output="dict", seq_len_schedule=[(0, 16)])
    batch = loader.batch(0)
    units = loader.indices(0)
    windows = numbered.sequences(16)
    expected = windows.boundaries((units[:, None] * 4 + np.arange(4)).reshape(-1))
    np.testing.assert_array_equal(batch["position_ids"], expected.position_ids)
    assert batch["input_ids"].shape == (16, 16) and (batch["position_ids"][:, 0] == 0).all()


def test_mask_mode_exclusions_mask_the_sub_windows_of_an_excluded_document(
    numbered: streampack.Cache,
) -> None:
    from streampack.loader import Exclusions

    excluded = Exclusions(documents=[1], mode="mask")  # stream tokens [700, 3000)
    options = {"batch_size": 8, "seed": 1, "output": "dict", "seq_len_schedule": [(0, 16)]}
    loader = Loader(numbered.sequences(UNIT), exclude=excluded, **options)
    plain = Loader(numbered.sequences(UNIT), **options)
    hits = 0
    for position in itertools.islice(loader.schedule(), 40):  # an endless run: its first 40 batches
        batch, unmasked = loader.batch(position), plain.batch(position)
        np.testing.assert_array_equal(batch["input_ids"], unmasked["input_ids"])
        inside = (batch["input_ids"] >= 700) & (batch["input_ids"] < 3000)
        assert (batch["labels"][inside] == -100).all()
        np.testing.assert_array_equal(batch["labels"][~inside], unmasked["labels"][~inside])
        hits += int(inside.sum())
    assert hits


def test_the_audit_of_a_run_with_a_schedule_is_clean_and_catches_a_repeat(numbered: streampack.Cache) -> None:
    seqs = numbered.sequences(UNIT)
    schedule = [(0, 16), (UNIT * 8 * 6, UNIT)]
    first = Loader(seqs, batch_size=8, seed=5, seq_len_schedule=schedule)
    first.advance(4)
    at_4 = first.state_dict()
    first.advance(5)
    shorter = Loader(numbered.sequences(32), batch_size=8, seed=5)  # 4 units a step, at 32
    shorter.load_state_dict(first.state_dict())
    shorter.advance(10)
    report = audit(shorter.state_dict(), seqs.path)
    assert report.clean, report.text()
    assert report.sources[0].samples == 9 * 8 + 10 * 4
    assert report.sources[0].tokens == report.sources[0].samples * UNIT
    assert audit(shorter.state_dict(), seqs.path, seq_len=16).clean  # a length the run served at
    with pytest.raises(OptionsError, match=r"records seq_len \[16, 32, 64\]"):
        audit(shorter.state_dict(), seqs.path, seq_len=48)
    replayed = Loader(seqs, batch_size=8, seed=5, seq_len_schedule=schedule)
    replayed.load_state_dict(at_4, step=9)  # the model had trained 9 steps; the data state is of 4
    replayed.advance(8)
    report = audit(replayed.state_dict(), seqs.path)
    (finding,) = report.findings
    assert finding.kind == "twice" and finding.positions == (32, 72)

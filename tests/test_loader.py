"""Tests for `streampack.loader`: global batches over ranks, exact O(1) resume, validation, memory."""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from itertools import chain, islice
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import streampack
from streampack.errors import CacheError, LoaderStateError, OptionsError
from streampack.loader import STATE_VERSION, Loader, LoaderOptions
from streampack.loader.history import history_digest
from streampack.order.mixture import Mixture
from streampack.order.permutation import Permutation
from streampack.testing.caches import write_cache, write_random_cache
from tests.conftest import run_cli


class IndexSource:
    """A data source whose sample ``i`` is the row ``[i]``, so every batch names the samples it holds."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.reads = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, indices: np.ndarray) -> np.ndarray:
        self.reads += 1
        return np.asarray(indices)[:, None]


def leaves_a_rank_empty(n: int, batch_size: int, world: int, epochs: int = 1) -> bool:
    """Whether the run's last partial global batch has fewer rows than ranks (refused, drop_last=False)."""
    return 0 < epochs * n % batch_size < world


def flat(batches: list[list[int]]) -> list[int]:
    return list(chain.from_iterable(batches))


def served(loader: Loader, batches: int | None = None) -> list[list[int]]:
    """The sample indices of the next ``batches`` batches (all remaining ones by default)."""
    return [batch[:, 0].tolist() for batch in islice(loader, batches)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> streampack.Cache:
    root = tmp_path_factory.mktemp("loader")
    texts = [f"document {i} " + "xyz" * (i % 17) for i in range(400)]
    half = len(texts) // 2
    for name, part in (("a", texts[:half]), ("b", texts[half:])):
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    streampack.build([root / "a.jsonl", root / "b.jsonl"], root / "cache", tokenizer="bytes", workers=1)
    return streampack.open(root / "cache")


# --- order: global batches, ranks, epochs ---------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    world=st.integers(1, 4),
    rows=st.integers(1, 6),
    seed=st.integers(0, 2**64 - 1),
    shuffle=st.booleans(),
)
def test_ranks_see_every_sample_once_with_equal_batch_counts(
    n: int, world: int, rows: int, seed: int, shuffle: bool
) -> None:
    batch_size = world * rows
    if leaves_a_rank_empty(n, batch_size, world):
        loader = Loader(IndexSource(n), batch_size=batch_size, world_size=world, drop_last=False, epochs=1)
        with pytest.raises(OptionsError, match="ranks an empty last batch"):
            next(iter(loader))  # checked before the first batch: a resume would first move the position
        return
    per_rank = []
    for rank in range(world):
        loader = Loader(
            IndexSource(n), batch_size=batch_size, seed=seed, shuffle=shuffle, rank=rank, world_size=world,
            drop_last=False, epochs=1,
        )  # fmt: skip
        per_rank.append(served(loader))
    assert len({len(batches) for batches in per_rank}) == 1  # no rank waits for a batch that never comes
    assert all(batch for batches in per_rank for batch in batches)  # and none gets an empty one
    everything = [i for batches in per_rank for batch in batches for i in batch]
    assert sorted(everything) == list(range(n))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300), world=st.integers(1, 4), rows=st.integers(1, 6), seed=st.integers(0, 2**32))
def test_drop_last_serves_whole_global_batches_of_distinct_samples(
    n: int, world: int, rows: int, seed: int
) -> None:
    batch_size = world * rows
    if n < batch_size:
        with pytest.raises(ValueError, match="fewer than one global batch"):
            Loader(IndexSource(n), batch_size=batch_size)
        return
    per_rank = [
        served(Loader(IndexSource(n), batch_size=batch_size, seed=seed, rank=r, world_size=world, epochs=1))
        for r in range(world)
    ]
    assert all(len(batches) == n // batch_size for batches in per_rank)
    assert all(len(batch) == rows for batches in per_rank for batch in batches)
    everything = [i for batches in per_rank for batch in batches for i in batch]
    assert len(set(everything)) == len(everything) == n // batch_size * batch_size


@settings(max_examples=30, deadline=None)
@given(n=st.integers(8, 200), seed=st.integers(0, 2**64 - 1), world=st.sampled_from([1, 2, 4]))
def test_global_order_does_not_depend_on_world_size(n: int, seed: int, world: int) -> None:
    assume(not leaves_a_rank_empty(n, 4, world, epochs=2))
    single = served(Loader(IndexSource(n), batch_size=4, seed=seed, epochs=2, drop_last=False))
    ranks = [
        served(
            Loader(
                IndexSource(n), batch_size=4, seed=seed, epochs=2, drop_last=False, rank=r, world_size=world
            )
        )
        for r in range(world)
    ]
    joined = [flat([ranks[r][step] for r in range(world)]) for step in range(len(single))]
    assert joined == single


def test_epochs_are_shuffled_differently_and_unshuffled_is_stream_order() -> None:
    loader = Loader(IndexSource(100), batch_size=10, seed=3, epochs=2)
    batches = served(loader)
    first, second = flat(batches[:10]), flat(batches[10:])
    assert sorted(first) == sorted(second) == list(range(100)) and first != second
    assert flat(served(Loader(IndexSource(100), batch_size=10, shuffle=False, epochs=1))) == list(range(100))
    other_seed = flat(served(Loader(IndexSource(100), batch_size=10, seed=4, epochs=1)))
    assert other_seed != first


def test_epochs_none_runs_forever_and_epochs_stop() -> None:
    assert len(served(Loader(IndexSource(10), batch_size=5), 1000)) == 1000
    loader = Loader(IndexSource(10), batch_size=5, epochs=3)
    assert len(served(loader)) == 6 and loader.finished and loader.epoch == 3
    assert served(loader) == []


def test_steps_per_epoch_and_the_last_partial_batch() -> None:
    loader = Loader(
        IndexSource(10), batch_size=4, world_size=2, rank=1, drop_last=False, shuffle=False, epochs=1
    )
    assert loader.steps_per_epoch == 3
    assert served(loader) == [[2, 3], [6, 7], [9]]  # the partial batch [8, 9] splits 1 + 1
    assert Loader(IndexSource(10), batch_size=4).steps_per_epoch == 2


def test_drop_last_false_refuses_a_last_batch_with_fewer_rows_than_ranks() -> None:
    # 1,257 samples in global batches of 8 leave 1 for the last batch: 7 of 8 ranks would get 0 rows.
    for rank in (0, 7):
        loader = Loader(IndexSource(1257), batch_size=8, world_size=8, rank=rank, drop_last=False, epochs=1)
        with pytest.raises(OptionsError) as refused:
            loader.batch(0)
        message = str(refused.value)
        assert "7 of the 8 ranks an empty last batch" in message and "1257 mod 8 = 1 sample" in message
        assert "world_size=8" in message and "drop_last=True" in message and "batch_size=16" in message
    assert isinstance(refused.value, ValueError)
    with pytest.raises(OptionsError, match=r"5 mod 8 = 5 samples.*Use fewer ranks, or more samples"):
        next(iter(Loader(IndexSource(5), batch_size=8, world_size=8, drop_last=False, epochs=1)))
    # Allowed: an endless run (no last batch), one rank, drop_last=True, or a batch size whose remainder
    # (1257 mod 16 = 9) covers the ranks.
    assert Loader(IndexSource(1257), batch_size=8, world_size=8, drop_last=False).position == 0
    assert Loader(IndexSource(1257), batch_size=8, drop_last=False).steps_per_epoch == 158
    assert Loader(IndexSource(1257), batch_size=8, world_size=8).steps_per_epoch == 157
    options = {"batch_size": 16, "drop_last": False, "epochs": 1}
    last = [Loader(IndexSource(1257), world_size=8, rank=r, **options).indices(78 * 16) for r in range(8)]
    assert [len(rows) for rows in last] == [1, 1, 1, 1, 1, 1, 1, 2]
    whole = Loader(IndexSource(1257), **options).indices(78 * 16)
    assert np.array_equal(np.concatenate(last), whole)
    # Resuming with another batch size re-checks from the saved position: 1249 samples are left.
    small = Loader(IndexSource(1257), batch_size=8, drop_last=False, epochs=1)
    small.advance(1)
    resumed = Loader(IndexSource(1257), batch_size=16, world_size=8, drop_last=False, epochs=1)
    with pytest.raises(OptionsError, match="1249 mod 16 = 1 sample"):
        resumed.load_state_dict(small.state_dict())
    assert resumed.position == 0  # a refused state changes nothing


def test_len_is_the_batches_of_the_run_on_every_rank() -> None:
    # 2 epochs of 1257 samples in global batches of 16: 2514 // 16 = 157 full batches and 2 samples over.
    for drop_last, steps, per_epoch in ((True, 157, 78), (False, 158, 79)):
        loaders = [
            Loader(IndexSource(1257), batch_size=16, world_size=2, rank=r, drop_last=drop_last, epochs=2)
            for r in range(2)
        ]
        assert {len(loader) for loader in loaders} == {steps}
        assert {loader.steps_per_epoch for loader in loaders} == {per_epoch}
        assert len(served(loaders[1])) == steps  # len() batches from a fresh loader
        assert len(loaders[1]) == steps  # the position does not change it
    with pytest.raises(TypeError, match="an endless Loader has no len"):
        len(Loader(IndexSource(1257), batch_size=16))


def test_a_list_of_arrays_is_refused_at_creation_and_a_stacked_array_works() -> None:
    samples = [np.arange(4) + 10 * i for i in range(10)]
    with pytest.raises(TypeError, match=r"got a list of 10 items.*np\.stack\(samples\)"):
        Loader(samples, batch_size=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got int, which has no __len__ or __getitem__"):
        Loader(7, batch_size=2)  # type: ignore[arg-type]
    loader = Loader(np.stack(samples), batch_size=2, seed=1, epochs=1)
    batches = list(loader)
    assert len(batches) == len(loader) == 5 and all(batch.shape == (2, 4) for batch in batches)
    assert sorted(row[0] for batch in batches for row in batch.tolist()) == list(range(0, 100, 10))


# --- resume -----------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 120),
    world=st.integers(1, 4),
    rows=st.integers(1, 5),
    seed=st.integers(0, 2**64 - 1),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    data=st.data(),
)
def test_resume_continues_the_uninterrupted_stream(
    n: int, world: int, rows: int, seed: int, shuffle: bool, drop_last: bool, data: st.DataObject
) -> None:
    batch_size = world * rows
    if (drop_last and n < batch_size) or (not drop_last and leaves_a_rank_empty(n, batch_size, world, 3)):
        return
    rank = data.draw(st.integers(0, world - 1), label="rank")
    options = {
        "batch_size": batch_size, "seed": seed, "shuffle": shuffle, "rank": rank, "world_size": world,
        "drop_last": drop_last, "epochs": 3,
    }  # fmt: skip
    uninterrupted = served(Loader(IndexSource(n), **options))
    stop = data.draw(st.integers(0, len(uninterrupted)), label="stop")
    first = Loader(IndexSource(n), **options)
    head = served(first, stop)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = Loader(IndexSource(n), **options)
    resumed.load_state_dict(state)
    assert head + served(resumed) == uninterrupted


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(16, 150), seed=st.integers(0, 2**64 - 1), stop=st.integers(0, 40), drop_last=st.booleans()
)
def test_resume_with_fewer_ranks_keeps_the_global_order(
    n: int, seed: int, stop: int, drop_last: bool
) -> None:
    assume(drop_last or not leaves_a_rank_empty(n, 8, 4, epochs=2))

    def loaders(world: int) -> list[Loader]:
        return [
            Loader(
                IndexSource(n),
                batch_size=8,
                seed=seed,
                rank=r,
                world_size=world,
                epochs=2,
                drop_last=drop_last,
            )
            for r in range(world)
        ]

    reference = served(Loader(IndexSource(n), batch_size=8, seed=seed, epochs=2, drop_last=drop_last))
    stop = min(stop, len(reference))
    four = loaders(4)
    for loader in four:
        served(loader, stop)
    states = [json.loads(json.dumps(loader.state_dict())) for loader in four]
    assert all(state["world_size"] == 4 and state["position"] == min(8 * stop, 2 * n) for state in states)
    two = loaders(2)
    for loader in two:
        loader.load_state_dict(states[0])
    rest = [served(loader) for loader in two]
    assert [a + b for a, b in zip(*rest)] == reference[stop:]


def test_resume_in_a_new_process(cache: streampack.Cache, tmp_path: Path) -> None:
    options = {"batch_size": 6, "seed": 12345, "world_size": 3, "rank": 2, "epochs": 2}
    seqs = cache.sequences(24, overlap=1)
    uninterrupted = list(Loader(seqs, **options))
    first = Loader(seqs, **options)
    head = list(islice(first, 7))
    (tmp_path / "state.json").write_text(json.dumps(first.state_dict()))
    script = textwrap.dedent(
        f"""
        import json, sys
        import numpy as np
        import streampack
        from streampack.loader import Loader
        loader = Loader(streampack.open({str(cache.root)!r}).sequences(24, overlap=1), **{options!r})
        loader.load_state_dict(json.loads(open(sys.argv[1]).read()))
        np.save(sys.argv[2], np.stack(list(loader)))
        """
    )
    subprocess.run([sys.executable, "-c", script, tmp_path / "state.json", tmp_path / "rest.npy"], check=True)
    rest = np.load(tmp_path / "rest.npy")
    assert len(head) + len(rest) == len(uninterrupted)
    assert np.array_equal(np.stack(head + list(rest)), np.stack(uninterrupted))


def test_resume_is_o1_far_into_a_huge_epoch() -> None:
    source = IndexSource(10**12)
    loader = Loader(source, batch_size=32, seed=9)
    position = 5 * 10**12 + 32 * 10**6
    loader.load_state_dict(loader.state_dict() | {"position": position})
    probed = source.reads  # a source without width and dtype is read once at creation to learn them
    batch = next(iter(loader))
    assert source.reads == probed + 1  # nothing replayed
    assert batch[:, 0].tolist() == loader.indices(position).tolist()
    assert loader.state_dict()["position"] == position + 32 and loader.epoch == 5


def test_load_state_dict_takes_effect_at_the_next_batch() -> None:
    loader = Loader(IndexSource(50), batch_size=5, seed=1)
    saved = loader.state_dict()
    iterator = iter(loader)
    first = next(iterator)[:, 0].tolist()
    next(iterator)
    loader.load_state_dict(saved)
    assert next(iterator)[:, 0].tolist() == first


def test_advance_matches_consuming() -> None:
    consumed = Loader(IndexSource(50), batch_size=5, seed=1)
    served(consumed, 23)
    jumped = Loader(IndexSource(50), batch_size=5, seed=1)
    jumped.advance(23)
    assert jumped.state_dict() == consumed.state_dict() and (jumped.epoch, jumped.position) == (2, 115)
    ending = Loader(IndexSource(50), batch_size=20, drop_last=False, epochs=1)
    ending.advance(10**9)  # stops at the end: two full batches and the partial one
    assert ending.position == 50 and ending.finished


def test_state_is_small_versioned_json(cache: streampack.Cache) -> None:
    loader = Loader(cache.sequences(16), batch_size=4, seed=7, world_size=2, rank=1)
    served(loader, 3)
    state = loader.state_dict()
    history = state.pop("history")
    assert state.pop("history_digest") == history_digest(history)  # checked at load
    assert state == {
        "format": "streampack.Loader",
        "version": STATE_VERSION,
        "position": 12,
        "order": {"kind": "shuffled", "seed": 7, "shuffle": True, "data": cache.sequences(16).fingerprint()},
        "batch_size": 4,
        "world_size": 2,
    }
    assert len(json.dumps(state)) < 400
    assert len(history) == 1 and history[0]["position"] == 0  # the run's start: one small entry a resume
    assert len(json.dumps(history)) < 600


def test_state_is_json_when_options_are_numpy_integers() -> None:
    options = {
        "batch_size": np.int64(8), "seed": np.uint64(2**64 - 1), "world_size": np.int32(2),
        "rank": np.uint8(1), "epochs": np.int16(3),
    }  # fmt: skip
    loader = Loader(IndexSource(100), **options)  # type: ignore[arg-type]
    served(loader, 2)
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["order"]["seed"] == 2**64 - 1 and state["batch_size"] == 8 and state["world_size"] == 2
    assert all(type(getattr(loader.options, name)) is int for name in options)
    resumed = Loader(IndexSource(100), batch_size=8, seed=2**64 - 1, world_size=2, rank=1, epochs=3)
    resumed.load_state_dict(state)
    assert served(resumed) == served(loader)


def order_change(**change: object) -> Callable[[dict], dict]:
    return lambda state: state | {"order": state["order"] | change}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (order_change(seed=8), "seed in checkpoint: 8 / seed in this loader: 7"),
        (order_change(shuffle=False), "shuffle in checkpoint: False / shuffle in this loader: True"),
        (order_change(data={"num_samples": 99}), "data in checkpoint: {'num_samples': 99} / data in this"),
        (order_change(kind="mixture"), "over a 'mixture' order, this loader reads one dataset"),
        (lambda s: s | {"version": 99}, "version 99 is not supported"),
        (lambda s: s | {"format": "other"}, "not a streampack loader state"),
        (lambda s: s | {"position": -1}, r"Expected `int` >= 0, got `-1` - at `\$\.position`"),
        (lambda s: s | {"position": "3"}, r"Expected `int`, got `str` - at `\$\.position`"),
        (lambda s: s | {"position": 2**62 + 1}, r"<= 4611686018427387904, got `4611686018427387905`"),
        (lambda s: {k: v for k, v in s.items() if k != "order"}, r"missing required field `order` - at `\$`"),
    ],
)
def test_mismatched_or_damaged_state_is_refused_naming_both_sides(
    change: Callable[[dict], dict], message: str
) -> None:
    loader = Loader(IndexSource(100), batch_size=4, seed=7)
    with pytest.raises(LoaderStateError, match=message):
        loader.load_state_dict(change(loader.state_dict()))


def test_batch_size_world_size_and_drop_last_may_change_on_resume() -> None:
    first = Loader(IndexSource(100), batch_size=4, seed=7, world_size=2, drop_last=False, epochs=2)
    served(first, 5)
    single = Loader(IndexSource(100), batch_size=1, seed=7, epochs=2)
    reference = flat(served(single))
    resumed = Loader(IndexSource(100), batch_size=7, seed=7, drop_last=False, epochs=2)
    resumed.load_state_dict(first.state_dict())
    rest = served(resumed)
    assert [len(batch) for batch in rest] == [7] * 25 + [5]  # 180 samples left: 25 batches of 7, and 5
    assert flat(rest) == reference[20:]  # the next global batch starts at the saved position


def test_a_version_1_state_resumes_at_the_same_place_of_the_same_epoch() -> None:
    loader = Loader(IndexSource(100), batch_size=4, seed=7, epochs=3)
    version_1 = {
        "format": "streampack.Loader", "version": 1, "seed": 7, "shuffle": True, "batch_size": 4,
        "drop_last": True, "dataset": {"num_samples": 100}, "epoch": 1, "samples_in_epoch": 36,
        "world_size": 1,
    }  # fmt: skip
    loader.load_state_dict(version_1)
    assert loader.position == 136 and loader.epoch == 1
    expected = Permutation(100, seed=7, epoch=1)(np.arange(36, 40)).tolist()
    assert served(loader, 1) == [expected]
    with pytest.raises(LoaderStateError, match="seed in checkpoint: 8"):
        loader.load_state_dict(version_1 | {"seed": 8})
    with pytest.raises(LoaderStateError, match="not a place in an epoch of 100 samples"):
        loader.load_state_dict(version_1 | {"samples_in_epoch": 100})


@pytest.mark.parametrize("shuffle", [True, False])
def test_the_largest_position_a_state_may_hold_serves_batches(shuffle: bool) -> None:
    loader = Loader(IndexSource(100), batch_size=4, seed=7, shuffle=shuffle)
    last = 2**62 - 4
    loader.load_state_dict(loader.state_dict() | {"position": last})
    batch = next(iter(loader))[:, 0].tolist()
    assert batch == loader.indices(last).tolist() and len(set(batch)) == 4
    assert loader.finished  # an endless run ends there


def test_state_of_other_data_is_refused(cache: streampack.Cache) -> None:
    state = Loader(cache.sequences(16), batch_size=4).state_dict()
    with pytest.raises(LoaderStateError, match="windows of 16 tokens, this loader serves seq_len 24"):
        Loader(cache.sequences(24), batch_size=4).load_state_dict(state)  # 32 would join them two a row
    with pytest.raises(
        LoaderStateError, match=r"data in checkpoint: \{.*'overlap': 0.*\} / data in this loader"
    ):
        Loader(cache.sequences(16, overlap=1), batch_size=4).load_state_dict(state)
    with pytest.raises(LoaderStateError, match="not a streampack loader state"):
        Loader(cache.sequences(16), batch_size=4).load_state_dict([1, 2])  # type: ignore[arg-type]


def test_a_refused_resume_leaves_the_loader_as_it_was(cache: streampack.Cache) -> None:
    """A resume builds the loader's next Run and swaps it in whole: one refused late (here after it took over
    the checkpoint's units of another length) leaves the run, its position and its batches as they were."""
    from streampack.loader import Exclusions

    saved = Loader(cache.sequences(32), batch_size=4, exclude=Exclusions(positions=[(100, 104)])).state_dict()
    loader = Loader(cache.sequences(16), batch_size=8)
    loader.advance(2)
    run, position, batch = loader.run, loader.position, loader.batch(loader.position)
    with pytest.raises(LoaderStateError, match="exclusion"):
        loader.load_state_dict(saved)
    assert loader.run is run and loader.position == position and loader.width == 16
    assert np.array_equal(loader.batch(position), batch)


# --- options and outputs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"batch_size": 10, "world_size": 4},
            r"batch_size=10 does not divide by world_size=4.*e\.g\. 8 or 12",
        ),
        ({"batch_size": 2, "world_size": 4}, r"does not divide by world_size=4.*e\.g\. 4"),
        ({"batch_size": 0}, r"batch_size must be an integer in \[1, 2\*\*62\] \(got batch_size=0\)"),
        (
            {"batch_size": 4, "rank": 2, "world_size": 2},
            r"rank must be an integer in \[0, 2\) \(got rank=2\)",
        ),
        ({"batch_size": 4, "seed": -1}, r"seed must be an integer in \[0, 2\*\*64\)"),
        ({"batch_size": 4, "epochs": 0}, r"epochs must be an integer in \[1, 2\*\*63\], or None"),
        ({"batch_size": 4, "shuffle": 1}, "shuffle must be True, False or a BlockShuffle"),
        ({"batch_size": 4, "output": "torch"}, "output must be one of 'numpy', 'dict', 'varlen'"),
        ({"batch_size": 4, "dtype": np.float32}, "dtype must be an integer dtype"),
    ],
)
def test_bad_options_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(OptionsError, match=message):
        Loader(IndexSource(100), **kwargs)


def test_options_are_a_frozen_dataclass() -> None:
    options = LoaderOptions(batch_size=8, world_size=2)
    assert options.rows == 4 and options.dtype == np.dtype(np.int64)
    with pytest.raises(AttributeError):
        options.seed = 3  # type: ignore[misc]


def test_numpy_output_dtypes(cache: streampack.Cache) -> None:
    seqs = cache.sequences(16, overlap=1)
    default = next(iter(Loader(seqs, batch_size=4, seed=1)))
    assert default.dtype == np.int64 and default.shape == (4, 17)
    raw = next(iter(Loader(seqs, batch_size=4, seed=1, dtype=None)))
    assert raw.dtype == cache.dtype and np.array_equal(raw, default)
    assert next(iter(Loader(seqs, batch_size=4, seed=1, dtype="int32"))).dtype == np.int32
    # Narrower than uint16 where the vocabulary (bytes: 257 ids) fits, not where it does not.
    assert np.array_equal(next(iter(Loader(seqs, batch_size=4, seed=1, dtype=np.int16))), default)
    with pytest.raises(ValueError, match="cannot hold every id of the cache's uint16 tokens: the vocab"):
        Loader(seqs, batch_size=4, dtype=np.int8)


def test_a_narrower_dtype_is_allowed_where_the_vocabulary_fits_it(tmp_path: Path) -> None:
    """int32 for a uint32 cache of cl100k's 100,277 ids; refused where the vocabulary does not fit."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 100_277, 4096).astype(np.uint32)
    cache = streampack.open(
        write_cache(tmp_path / "c", [(tokens, np.array([1000, 4096]))], vocab_size=100_277, eos_id=100_276)
    )
    seqs = cache.sequences(16, overlap=1)
    wide = Loader(seqs, batch_size=8, seed=1, epochs=1)
    narrow = Loader(seqs, batch_size=8, seed=1, epochs=1, dtype="int32")
    pairs = list(zip(wide, narrow, strict=True))
    assert all(b.dtype == np.int32 and np.array_equal(a, b) for a, b in pairs)
    into = np.empty((8, 17), dtype=np.int32)
    assert narrow.batch(0, out=into) is into and np.array_equal(into, pairs[0][0])
    with pytest.raises(OptionsError, match=r"dtype=uint16 cannot .* vocabulary has 100,277 ids, and uint16"):
        Loader(seqs, batch_size=8, dtype="uint16")
    with pytest.raises(OptionsError, match=r"dtype=int32 cannot .* int64 tokens \(the source has no vocab"):
        Loader(np.zeros((8, 4), dtype=np.int64), batch_size=8, dtype="int32")


def test_a_narrowing_loader_checks_every_batch_and_names_the_id(tmp_path: Path) -> None:
    """Another format's files are only declared to keep to their vocabulary: each batch's ids are checked
    as they are cast, and one that does not fit is named, with its sample and file."""
    tokens = np.array([1, 2, 3, 50256, 70000, 5, 6, 50256, 7, 3_000_000_000, 8, 50256], dtype="<u4")
    tokens.tofile(tmp_path / "train.bin")
    cache = streampack.open(tmp_path / "train.bin", eos_id=50256, dtype="uint32", vocab_size=50257)
    seqs = cache.sequences(4)
    served = list(Loader(seqs, batch_size=1, shuffle=False, epochs=1))  # int64: every id as it is
    assert [b.tolist() for b in served] == [[tokens[i : i + 4].tolist()] for i in (0, 4, 8)]
    short = Loader(seqs, batch_size=1, shuffle=False, epochs=1, dtype="uint16")
    assert short.batch(0).tolist() == [[1, 2, 3, 50256]]
    file = re.escape(str(tmp_path / "train.bin"))
    with pytest.raises(
        CacheError,
        match=rf"position 1: sample 1 of .* holds the id 70,000 \(column 0: {file}, document 1, token 0\), "
        r"which dtype=uint16 cannot hold .* make it 4,464; its vocabulary has 50,257 ids",
    ):
        short.batch(1)
    signed = Loader(seqs, batch_size=1, shuffle=False, epochs=1, dtype="int32")
    assert signed.batch(1).tolist() == [[70000, 5, 6, 50256]]
    with pytest.raises(CacheError, match=r"holds the id 3,000,000,000 \(column 1: .*, document 2, token 1\)"):
        signed.batch(2)


def test_dict_output_for_hugging_face_models(cache: streampack.Cache) -> None:
    seqs = cache.sequences(32)
    loader = Loader(seqs, batch_size=4, seed=2, output="dict")
    batch = next(iter(loader))
    indices = loader.indices(0)
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert np.array_equal(batch["input_ids"], seqs[indices]) and batch["input_ids"].dtype == np.int64
    bounds = seqs.boundaries(indices)
    assert np.array_equal(batch["position_ids"], bounds.position_ids)
    # No loss across documents: -100 exactly where a document (or a row) starts, the tokens elsewhere.
    starts = bounds.position_ids == 0
    assert batch["labels"].dtype == np.int64 and (batch["labels"][starts] == -100).all()
    assert np.array_equal(batch["labels"][~starts], batch["input_ids"][~starts])
    assert starts[:, 1:].any()  # documents do start inside these rows
    copy = pickle.loads(pickle.dumps(loader))  # the format goes with the loader, e.g. to spawned workers
    assert all(np.array_equal(value, copy.batch(0)[key]) for key, value in batch.items())
    with pytest.raises(ValueError, match="samples need no overlap"):
        Loader(cache.sequences(32, overlap=1), batch_size=4, output="dict")
    with pytest.raises(ValueError, match="IndexSource does not provide"):
        Loader(IndexSource(100), batch_size=4, output="dict")


def test_varlen_output_gives_the_segments_of_the_flattened_batch(cache: streampack.Cache) -> None:
    seqs = cache.sequences(32)
    loader = Loader(seqs, batch_size=4, seed=2, output="varlen", dtype=None)
    batch = loader.batch(8)
    bounds = seqs.boundaries(loader.indices(8))
    assert set(batch) == {"input_ids", "labels", "position_ids", "cu_seqlens", "max_seqlen"}
    assert batch["cu_seqlens"].dtype == np.int32 and np.array_equal(batch["cu_seqlens"], bounds.cu_seqlens)
    assert batch["max_seqlen"] == bounds.max_seqlen and isinstance(batch["max_seqlen"], int)
    assert batch["input_ids"].dtype == cache.dtype and batch["labels"].dtype == np.int64  # -100 fits
    assert np.array_equal(
        batch["labels"], Loader(seqs, batch_size=4, seed=2, output="dict").batch(8)["labels"]
    )
    # Refusals name the output asked for, not another one.
    with pytest.raises(ValueError, match=r"^output='varlen' labels the input tokens themselves"):
        Loader(cache.sequences(32, overlap=1), batch_size=4, output="varlen")
    with pytest.raises(ValueError, match=r"^output='varlen' needs position ids, which IndexSource"):
        Loader(IndexSource(100), batch_size=4, output="varlen")


def test_collate_is_applied_to_every_batch() -> None:
    loader = Loader(IndexSource(20), batch_size=5, seed=0, collate=lambda b: b[:, 0].tolist(), epochs=1)
    assert sorted(flat(list(loader))) == list(range(20))


def test_batch_is_a_pure_function_of_the_position(cache: streampack.Cache) -> None:
    loader = Loader(cache.sequences(16), batch_size=4, seed=5, epochs=1)
    out = np.zeros((4, 16), dtype=np.int64)
    assert loader.batch(40, out=out) is out
    assert np.array_equal(out, Loader(cache.sequences(16), batch_size=4, seed=5).batch(40))
    assert loader.epoch == loader.position == 0
    end = len(cache.sequences(16))
    with pytest.raises(IndexError, match=rf"no batch at position {end}: .* the run ends at {end}"):
        loader.indices(end)
    assert "batch_size=4" in repr(loader) and "seed=5" in repr(loader) and "PackedSequences(" in repr(loader)


def test_batch_refuses_an_out_it_does_not_fit(cache: streampack.Cache) -> None:
    # Checked once per batch by the loader, for every kind of source: an array source used to be copied
    # into any out (int8 wrapped its ids), and a mixture took an out with extra rows.
    array = np.arange(40 * 16, dtype=np.int64).reshape(40, 16) + 1000
    mixture = Mixture({"cache": cache.sequences(16), "array": array}, {"cache": 1, "array": 1})
    datasets = [cache.sequences(16), array, mixture]
    for dataset in datasets:
        loader = Loader(dataset, batch_size=4)
        for bad in (np.zeros((4, 16), dtype=np.int8), np.zeros((5, 16), dtype=np.int64), [[0] * 16] * 4):
            with pytest.raises(
                ValueError, match=r"out must be a numpy array of shape \(4, 16\) and an integer"
            ):
                loader.batch(0, out=bad)  # type: ignore[arg-type]
        out = np.zeros((4, 16), dtype=np.int64)
        assert loader.batch(0, out=out) is out and np.array_equal(out, loader.batch(0))


def test_loader_pickles_without_its_caches(cache: streampack.Cache) -> None:
    import pickle

    loader = Loader(cache.sequences(16), batch_size=4, seed=5)
    served(loader, 3)
    copy = pickle.loads(pickle.dumps(loader))
    assert np.array_equal(next(iter(copy)), next(iter(loader)))


# --- memory ------------------------------------------------------------------------------------------------

_READ_EPOCH = """
import json, sys
import streampack
from streampack.loader import Loader

def rss_anon_mb():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024

loader = Loader(streampack.open(sys.argv[1]).sequences(2048, overlap=1), batch_size=32, seed=0, epochs=1)
peak, batches = 0.0, 0
for batches, batch in enumerate(loader, 1):
    if batches % 50 == 0:
        peak = max(peak, rss_anon_mb())
print(json.dumps({"batches": batches, "peak": max(peak, rss_anon_mb())}))
"""


@pytest.mark.slow
def test_anonymous_memory_does_not_grow_with_the_cache(tmp_path: Path) -> None:
    if "RssAnon" not in Path("/proc/self/status").read_text():
        pytest.skip("needs /proc/self/status with RssAnon (Linux)")
    results = {}
    for megabytes in (20, 200):
        root = write_random_cache(tmp_path / f"c{megabytes}", megabytes * 10**6 // 2, num_shards=3)
        run = subprocess.run(
            [sys.executable, "-c", _READ_EPOCH, root], check=True, capture_output=True, text=True
        )
        results[megabytes] = json.loads(run.stdout)
    assert results[200]["batches"] > 9 * results[20]["batches"]  # a full epoch of each was read
    assert results[200]["peak"] - results[20]["peak"] < 16, results


@pytest.mark.slow
def test_cli_bench_prints_rates_and_memory(cache: streampack.Cache) -> None:
    out = run_cli("bench", cache.root, "--seq-len", "16", "--batch-size", "4", "--steps", "20").stdout
    packed = run_cli("bench", cache.root, "--seq-len", "64", "--batch-size", "4", "--layout", "packed").stdout
    assert re.search(r"packed, seq_len 64, \d+\.\d% padding", packed), packed
    assert "samples/s" in out and "M tokens/s" in out and "RssAnon main" in out
    result = run_cli(
        "bench", cache.root, "--seq-len", "16", "--batch-size", "4", "--seq-len", "10**9", check=False
    )
    assert result.returncode == 2
    result = run_cli("bench", cache.root, "--seq-len", "100000", "--batch-size", "4", check=False)
    assert result.returncode == 1 and "fewer than one global batch" in result.stderr


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 80),
    seed=st.integers(0, 2**64 - 1),
    first=st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(0, 30)),  # ranks, rows, steps
    second=st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 3)),  # ranks, rows, workers
    epochs=st.integers(1, 3),
)
def test_resume_with_any_ranks_workers_and_batch_size_continues_the_stream(
    n: int, seed: int, first: tuple[int, int, int], second: tuple[int, int, int], epochs: int
) -> None:
    (world, rows, steps), (world2, rows2, workers) = first, second
    stream = flat(served(Loader(IndexSource(n), batch_size=1, seed=seed, epochs=epochs)))

    def loaders(world: int, rows: int) -> list[Loader]:
        options = {"seed": seed, "epochs": epochs, "drop_last": False, "batch_size": world * rows}
        return [Loader(IndexSource(n), rank=r, world_size=world, **options) for r in range(world)]  # type: ignore[arg-type]

    # Runs whose last batch would leave a rank empty are refused up front: tested above.
    assume(not leaves_a_rank_empty(n, world * rows, world, epochs))
    assume(not leaves_a_rank_empty(n, world2 * rows2, world2, epochs))
    before = loaders(world, rows)
    head = flat([flat(step) for step in zip(*(served(loader, steps) for loader in before), strict=True)])
    state = json.loads(json.dumps(before[0].state_dict()))
    assume(not 0 < (epochs * n - state["position"]) % (world2 * rows2) < world2)  # likewise
    after = []
    for loader in loaders(world2, rows2):
        loader.load_state_dict(state)
        # The DataLoader's way: worker k of n makes batches k, k + n, ... of the schedule.
        positions = list(loader.schedule())
        made = {k: [loader.batch(p)[:, 0].tolist() for p in positions[k::workers]] for k in range(workers)}
        after.append([made[i % workers][i // workers] for i in range(len(positions))])
    tail = flat([flat(step) for step in zip(*after, strict=True)])
    assert head + tail == stream


def test_a_source_with_its_own_read_fills_the_batch_itself() -> None:
    class Reading(IndexSource):
        def read(self, indices: np.ndarray, *, out: np.ndarray) -> np.ndarray:
            self.filled = getattr(self, "filled", 0) + 1
            out[:, 0] = indices
            return out

    source = Reading(40)
    batches = served(Loader(source, batch_size=4, seed=1, epochs=1))
    assert sorted(flat(batches)) == list(range(40)) and source.filled == 10


def _digest_before_format_2(cache: streampack.Cache) -> str:
    """The shard table's digest as streampack computed it before format version 2 (its code verbatim)."""
    import hashlib

    table = [[s.name, s.num_docs, s.num_tokens, s.tokens_checksum, s.offsets_checksum] for s in cache.shards]
    return hashlib.sha256(json.dumps(table).encode()).hexdigest()[:16]


def test_a_checkpoint_saved_before_format_2_resumes(cache: streampack.Cache) -> None:
    """Checkpoints hold the shard table's digest, which format version 2 computes from its columns: one
    saved with the old digest of the same cache resumes exactly; another cache's digest is still refused."""
    samples = cache.sequences(16)
    old_digest = _digest_before_format_2(cache)
    assert old_digest != samples.fingerprint()["shards"]
    uninterrupted = [b.tolist() for b in islice(Loader(samples, batch_size=4, seed=3), 12)]
    first = Loader(samples, batch_size=4, seed=3)
    head = [b.tolist() for b in islice(first, 5)]
    state = json.loads(json.dumps(first.state_dict()))
    state["order"]["data"]["shards"] = old_digest
    resumed = Loader(samples, batch_size=4, seed=3)
    resumed.load_state_dict(state)
    assert head + [b.tolist() for b in islice(resumed, 7)] == uninterrupted
    mixture = Mixture({"web": samples, "code": cache.packed(16)}, weights={"web": 1, "code": 1}, seed=1)
    mixed = json.loads(json.dumps(Loader(mixture, batch_size=4).state_dict()))
    mixed["order"]["sources"]["web"]["data"]["shards"] = old_digest
    Loader(mixture, batch_size=4).load_state_dict(mixed)
    state["order"]["data"]["shards"] = "0123456789abcdef"
    with pytest.raises(LoaderStateError, match="0123456789abcdef"):
        Loader(samples, batch_size=4, seed=3).load_state_dict(state)


def test_samples_pickled_before_format_2_reopen(cache: streampack.Cache) -> None:
    samples = cache.sequences(16)
    state = samples.__getstate__()
    state["cache"] = dataclasses.replace(state["cache"], content=_digest_before_format_2(cache))
    copy = type(samples).__new__(type(samples))
    copy.__setstate__(state)
    assert np.array_equal(copy[[0, 5]], samples[[0, 5]])


# --- the order given: Loader(source, order=...) ----------------------------------------------------------


class Reversed(streampack.order.OneSource):
    """An order of our own: each epoch serves the samples last to first."""

    resumes = ("reversed",)

    def __init__(self, size: int) -> None:
        super().__init__(size, seed=0, epochs=None, data=None, name="data")

    def samples(self, positions: np.ndarray) -> np.ndarray:
        return self.size - 1 - positions % self.size

    def fingerprint(self) -> dict:
        return {"kind": "reversed", "data": self.data}

    def resumed(self, saved, position: int) -> Reversed:  # type: ignore[no-untyped-def]
        return self


def test_a_loader_reads_the_order_it_is_given() -> None:
    """Any Order goes in ``order=``: the one the Loader makes from its options serves the same batches
    and states given explicitly; an order of one's own is served, ranks and resume included."""
    made = Loader(IndexSource(50), batch_size=4, seed=3, epochs=2, drop_last=False)
    order = streampack.order.Shuffled(50, seed=3, epochs=2, data={"num_samples": 50})
    given = Loader(IndexSource(50), order=order, batch_size=4, drop_last=False)
    assert served(given) == served(made) and given.state_dict() == made.state_dict()
    assert len(given) == len(made) == 25

    mine = Loader(IndexSource(10), order=Reversed(10), batch_size=4)
    assert served(mine, 3) == [[9, 8, 7, 6], [5, 4, 3, 2], [1, 0, 9, 8]]
    ranks = [Loader(IndexSource(10), order=Reversed(10), batch_size=4, rank=r, world_size=2) for r in (0, 1)]
    assert [served(rank, 1) for rank in ranks] == [[[9, 8]], [[7, 6]]]
    resumed = Loader(IndexSource(10), order=Reversed(10), batch_size=4)
    resumed.load_state_dict(mine.state_dict())
    assert served(resumed, 1) == [[7, 6, 5, 4]]
    with pytest.raises(TypeError, match="endless Loader has no len"):
        len(mine)


def test_several_sources_with_an_order_read_as_a_mixture_of_them() -> None:
    sources = {"a": IndexSource(30), "b": IndexSource(40)}
    mix = Mixture(sources, weights={"a": 1, "b": 3}, block_size=8, seed=2)
    assert mix.sources_and_order() == (mix.sources, mix)
    given = Loader(dict(sources), order=mix, batch_size=8)
    sugar = Loader(mix, batch_size=8)
    assert all(np.array_equal(a, b) for a, b in zip(given.picks(0), sugar.picks(0), strict=True))
    assert served(given, 5) == served(sugar, 5) and given.state_dict() == sugar.state_dict()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Loader(IndexSource(9), order=Reversed(9), batch_size=3, seed=1), r"Reversed\(\.\.\., seed="),
        (lambda: Loader(IndexSource(9), order=Reversed(9), batch_size=3, epochs=1), "the order's own end"),
        (lambda: Loader({"a": IndexSource(9)}, batch_size=3), "are read in an order: pass order="),
        (
            lambda: Loader({"b": IndexSource(9)}, order=Reversed(9), batch_size=3),
            r"named as the order names them.*\['data'\] \(got \['b'\]\)",
        ),
        (
            lambda: Loader(Mixture({"a": IndexSource(9)}, weights={"a": 1}), order=Reversed(9), batch_size=3),
            "not both",
        ),
        (
            lambda: Loader(
                IndexSource(9),
                order=Mixture({"a": IndexSource(9), "b": IndexSource(9)}, weights={"a": 1, "b": 1}),
                batch_size=3,
            ),
            "the order reads 2 sources",
        ),
    ],
)
def test_an_order_that_does_not_fit_its_sources_is_refused(make, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(OptionsError, match=message):
        make()


def test_options_come_as_one_object_or_as_keywords() -> None:
    """``options=LoaderOptions(...)`` and keywords make the same loader; keywords given with the object
    replace its fields; an unknown keyword is refused with the nearest name."""
    options = LoaderOptions(batch_size=4, seed=3, drop_last=False, epochs=2)
    given = Loader(IndexSource(30), options=options)
    keywords = Loader(IndexSource(30), batch_size=4, seed=3, drop_last=False, epochs=2)
    assert given.options == keywords.options == options
    assert served(given) == served(keywords) and given.state_dict() == keywords.state_dict()
    other = Loader(IndexSource(30), options=options, seed=4)
    assert other.options == dataclasses.replace(options, seed=4) and options.seed == 3
    with pytest.raises(
        TypeError, match="unexpected keyword argument 'batch_sise'; did you mean 'batch_size'"
    ):
        Loader(IndexSource(30), batch_sise=4)
    with pytest.raises(OptionsError, match="does not divide by world_size=3"):
        Loader(IndexSource(30), options=options, world_size=3)

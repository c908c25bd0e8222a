"""Tests for `streampack.order.mixture`: exact blocks, own epochs per source, staged weights, elastic
resume."""

from __future__ import annotations

import json
from collections import Counter
from itertools import islice
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import streampack
from streampack.errors import LoaderStateError, OptionsError
from streampack.loader import Loader
from streampack.order import schedule
from streampack.order.blockshuffle import BlockShuffle
from streampack.order.mixture import Mixture
from tests.conftest import in_threads

OFFSETS = (0, 10**6, 2 * 10**6, 3 * 10**6, 4 * 10**6)  # sample i of source j is the row [OFFSETS[j] + i]


def source(j: int, n: int) -> np.ndarray:
    """A dataset whose rows name themselves: source ``j``, sample ``i`` is ``[OFFSETS[j] + i]``."""
    return (OFFSETS[j] + np.arange(n, dtype=np.int64))[:, None]


def decode(rows: np.ndarray) -> list[tuple[int, int]]:
    """``(source, sample)`` of each served row."""
    values = np.asarray(rows)[:, 0].tolist()
    return [(v // 10**6, v % 10**6) for v in values]


def stream(order: Mixture, start: int, stop: int) -> list[tuple[int, int]]:
    sources, samples = order(np.arange(start, stop, dtype=np.int64))
    return list(zip(sources.tolist(), samples.tolist(), strict=True))


def global_batches(loaders: list[Loader], steps: int | None = None) -> list[tuple[int, int]]:
    """The samples of the next ``steps`` global batches, joining the ranks' rows in rank order."""
    out = []
    for batches in zip(*(islice(loader, steps) for loader in loaders), strict=True):
        for batch in batches:
            out += decode(batch)
    return out


block_shuffles = st.builds(BlockShuffle, block=st.integers(1, 16), window=st.integers(1, 4))
weights_strategy = st.lists(st.integers(0, 20), min_size=1, max_size=4).filter(lambda w: sum(w) > 0)


@st.composite
def mixtures(draw: st.DrawFn, stop: str = "never") -> Mixture:
    weights = draw(weights_strategy, label="weights")
    block = draw(st.integers(sum(1 for w in weights if w), 64), label="block_size")
    fits = all(not w or w * block >= sum(weights) for w in weights)  # one position per block each
    if not fits:
        block = sum(weights)
    smallest = block if stop == "first_exhausted" else 1  # else it would stop before its first block
    sizes = draw(st.lists(st.integers(smallest, 300), min_size=len(weights), max_size=len(weights)))
    return Mixture(
        {f"s{j}": source(j, n) for j, n in enumerate(sizes)},
        weights={f"s{j}": w for j, w in enumerate(weights)},
        seed=draw(st.integers(0, 2**64 - 1), label="seed"),
        shuffle=draw(st.one_of(st.booleans(), block_shuffles), label="shuffle"),
        block_size=block,
        stop=stop,
    )


# --- the order -----------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(mix=mixtures(), blocks=st.integers(1, 6))
def test_every_block_holds_each_source_in_its_exact_count(mix: Mixture, blocks: int) -> None:
    counts = mix._schedule[0][1]
    sources, _ = mix(np.arange(blocks * mix.block_size, dtype=np.int64))
    for block in sources.reshape(blocks, mix.block_size):
        assert np.bincount(block, minlength=len(counts)).tolist() == list(counts)
    assert sum(counts) == mix.block_size
    exact = [c / mix.block_size for c in counts]
    assert mix.weights(0) == exact


@settings(max_examples=60, deadline=None)
@given(mix=mixtures(), stop=st.integers(0, 500))
def test_every_prefix_is_within_one_block_of_the_weights(mix: Mixture, stop: int) -> None:
    sources, _ = mix(np.arange(stop, dtype=np.int64))
    served = np.bincount(sources, minlength=len(mix.names)).tolist()
    assert mix.consumed(stop) == served
    for count, weight in zip(served, mix.weights(0), strict=True):
        assert abs(count - stop * weight) <= weight * mix.block_size


@settings(max_examples=60, deadline=None)
@given(mix=mixtures(), stop=st.integers(1, 800))
def test_each_source_runs_through_its_own_epochs_without_repeats(mix: Mixture, stop: int) -> None:
    served = Counter(stream(mix, 0, stop))
    per_source = mix.consumed(stop)
    for j, (n, count) in enumerate(zip(mix.sizes(), per_source, strict=True)):
        times = [served[(j, i)] for i in range(n)]
        # Every sample of an epoch is served once before any is served again.
        assert max(times) - min(times) <= 1 and sum(times) == count


@settings(max_examples=40, deadline=None)
@given(mix=mixtures(stop="first_exhausted"))
def test_first_exhausted_stops_at_the_block_a_source_cannot_fill(mix: Mixture) -> None:
    end = mix.end
    assert end is not None and end % mix.block_size == 0
    served = Counter(stream(mix, 0, end))
    assert max(served.values()) == 1  # nothing from a second epoch
    counts = mix._schedule[0][1]
    after = mix.consumed(end)
    assert any(c and a + c > n for a, c, n in zip(after, counts, mix.sizes(), strict=True))


def test_sources_of_very_different_sizes_wrap_on_their_own() -> None:
    mix = Mixture(
        {"big": source(0, 100_000), "tiny": source(1, 3)}, weights={"big": 1, "tiny": 1}, block_size=2
    )
    rows = stream(mix, 0, 600)
    tiny = [i for j, i in rows if j == 1]
    assert len(tiny) == 300 and all(sorted(tiny[k : k + 3]) == [0, 1, 2] for k in range(0, 300, 3))
    assert len({i for j, i in rows if j == 0}) == 300  # the big one is still in its first epoch


def test_the_order_is_a_pure_function_of_the_position() -> None:
    make = lambda: Mixture({"a": source(0, 50), "b": source(1, 70)}, weights={"a": 3, "b": 1}, seed=4)  # noqa: E731
    whole = stream(make(), 0, 10_000)
    pieces = stream(make(), 7_000, 10_000) + stream(make(), 0, 7_000)
    assert pieces[3000:] + pieces[:3000] == whole
    assert stream(make(), 0, 100) != stream(
        Mixture({"a": source(0, 50), "b": source(1, 70)}, weights={"a": 3, "b": 1}, seed=5), 0, 100
    )


def test_unshuffled_blocks_are_in_source_order() -> None:
    mix = Mixture(
        {"a": source(0, 5), "b": source(1, 5)}, weights={"a": 1, "b": 1}, block_size=4, shuffle=False
    )
    assert stream(mix, 0, 8) == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]


# --- in the loader: ranks, batch sizes, resume -------------------------------------------------------------


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(
    mix=mixtures(),
    first=st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(0, 12)),  # ranks, rows, steps
    second=st.tuples(st.integers(1, 3), st.integers(1, 4)),
)
def test_resume_with_other_ranks_and_batch_size_continues_the_stream(
    mix: Mixture, first: tuple[int, int, int], second: tuple[int, int]
) -> None:
    world, rows, steps = first
    loaders = [Loader(mix, batch_size=world * rows, rank=r, world_size=world) for r in range(world)]
    head = global_batches(loaders, steps)
    state = json.loads(json.dumps(loaders[0].state_dict()))
    world2, rows2 = second
    resumed = [Loader(mix, batch_size=world2 * rows2, rank=r, world_size=world2) for r in range(world2)]
    for loader in resumed:
        loader.load_state_dict(state)
    tail = global_batches(resumed, 5)
    assert head + tail == [(j, OFFSETS[j] + i - OFFSETS[j]) for j, i in stream(mix, 0, len(head) + len(tail))]


def test_new_weights_and_a_new_source_after_a_checkpoint() -> None:
    a, b, c = source(0, 400), source(1, 90), source(2, 1000)
    before = Mixture({"a": a, "b": b}, weights={"a": 1, "b": 1}, block_size=8, seed=2)
    loader = Loader(before, batch_size=6)
    head = [pair for batch in islice(loader, 7) for pair in decode(batch)]  # position 42: block 5 begun
    state = json.loads(json.dumps(loader.state_dict()))
    after = Mixture(
        {"a": a, "b": b, "c": c},
        stages=[(0, {"a": 1, "b": 1}), (40, {"a": 1, "b": 1, "c": 2})],
        block_size=8,
        seed=2,
    )
    resumed = Loader(after, batch_size=6)
    resumed.load_state_dict(state)
    tail = [pair for batch in islice(resumed, 50) for pair in decode(batch)]
    served = head + tail
    assert len(served) == 342
    # The block in progress (positions 40-47) keeps the old counts; from block 6 on, the new weights.
    assert Counter(j for j, _ in served[40:48]) == {0: 4, 1: 4}
    for block in range(6, 42):
        assert Counter(j for j, _ in served[8 * block : 8 * block + 8]) == {0: 2, 1: 2, 2: 4}
    # Every source continues its epochs: no sample twice before all were served once.
    for j, n in enumerate((400, 90, 1000)):
        times = Counter(i for k, i in served if k == j)
        assert max(times.values()) - min(times.get(i, 0) for i in range(n)) <= 1
    # The resumed loader's checkpoint carries the history: a third run resumes it exactly.
    again = Loader(after, batch_size=3)
    again.load_state_dict(resumed.state_dict())
    check = Loader(after, batch_size=3)
    check.load_state_dict(state)
    check.advance(100)
    assert again.state_dict()["order"] == check.state_dict()["order"] | {}
    assert decode(next(iter(again))) == decode(next(iter(check)))
    report = {p.name: p for p in resumed.realised()}
    assert report["c"].weight == 0.5 and report["c"].served == sum(1 for j, _ in served if j == 2)


def test_a_loader_that_resumed_once_resumes_the_next_state_like_a_fresh_one() -> None:
    a, b, c = source(0, 400), source(1, 90), source(2, 1000)
    old = Mixture({"a": a, "b": b}, weights={"a": 1, "b": 1}, block_size=8, seed=2)
    new = Mixture({"a": a, "b": b, "c": c}, weights={"a": 1, "b": 2, "c": 3}, block_size=8, seed=2)
    states = []
    for steps in (10, 3):  # old-run checkpoints at positions 60 and 18
        loader = Loader(old, batch_size=6)
        loader.advance(steps)
        states.append(loader.state_dict())
    fresh_new = Loader(new, batch_size=6)
    fresh_new.advance(4)
    states.append(fresh_new.state_dict())  # a checkpoint of the new mixture alone, at position 24
    reused = Loader(new, batch_size=6)
    for state in states:
        reused.load_state_dict(state)
        fresh = Loader(new, batch_size=6)
        fresh.load_state_dict(state)
        # Resumed from the mixture given, not from the order the previous state made of it.
        assert reused.state_dict() == fresh.state_dict()
        assert global_batches([reused], 20) == global_batches([fresh], 20)


def test_a_single_dataset_checkpoint_continues_as_a_mixture_source() -> None:
    a, b = source(0, 100), source(1, 100)
    single = Loader(a, batch_size=10, seed=9)
    head = [pair for batch in islice(single, 3) for pair in decode(batch)]
    mixed = Loader(Mixture({"a": a, "b": b}, weights={"a": 1, "b": 1}, block_size=10, seed=1), batch_size=10)
    mixed.load_state_dict(single.state_dict())
    tail = [pair for batch in islice(mixed, 14) for pair in decode(batch)]
    firsts = [i for j, i in head + tail if j == 0]
    assert len(firsts) == 100 and sorted(firsts) == list(range(100))  # a's epoch completes, no repeats
    assert Counter(j for j, _ in tail[:10]) == {0: 5, 1: 5}  # the new weights from the next block


def test_changes_that_would_break_the_stream_are_refused() -> None:
    a, b = source(0, 100), source(1, 100)
    loader = Loader(Mixture({"a": a, "b": b}, weights={"a": 1, "b": 1}, block_size=10), batch_size=10)
    next(iter(loader))
    state = loader.state_dict()
    cases = [
        (Mixture({"a": a}, weights={"a": 1}, block_size=10), "reads source 'b', which this mixture does not"),
        (Mixture({"a": a, "b": b}, weights={"a": 1, "b": 1}, block_size=20), "block_size in checkpoint: 10"),
        (Mixture({"a": a, "b": b}, weights={"a": 1, "b": 1}, block_size=10, seed=3), "seed in checkpoint: 0"),
        (
            Mixture({"a": a, "b": source(1, 99)}, weights={"a": 1, "b": 1}, block_size=10),
            "data of source 'b'",
        ),
    ]
    for mix, message in cases:
        with pytest.raises(LoaderStateError, match=message):
            Loader(mix, batch_size=10).load_state_dict(state)
    with pytest.raises(LoaderStateError, match="over a 'mixture' order, this loader reads one dataset"):
        Loader(a, batch_size=10).load_state_dict(state)


def test_a_stopping_mixture_has_a_length_and_ends() -> None:
    mix = Mixture(
        {"a": source(0, 30), "b": source(1, 1000)},
        weights={"a": 1, "b": 2},
        block_size=3,
        stop="first_exhausted",
    )
    loader = Loader(mix, batch_size=4, drop_last=False)
    assert mix.end == 90 and len(loader) == 23
    batches = list(loader)
    assert len(batches) == 23 and len(batches[-1]) == 2 and loader.finished
    with pytest.raises(TypeError, match="not defined for a mixture"):
        _ = loader.steps_per_epoch


def test_mixture_over_real_caches(tmp_path) -> None:  # type: ignore[no-untyped-def]
    roots = []
    for name, word in (("web", "web"), ("code", "def")):
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(json.dumps({"text": f"{word} {i} " * 9}) + "\n" for i in range(60))
        )
        streampack.build([tmp_path / f"{name}.jsonl"], tmp_path / name, tokenizer="bytes", workers=1)
        roots.append(streampack.open(tmp_path / name))
    seqs = {name: cache.sequences(16) for name, cache in zip(("web", "code"), roots, strict=True)}
    mix = Mixture(seqs, weights={"web": 3, "code": 1}, block_size=4, seed=1)
    loader = Loader(mix, batch_size=8, output="dict")
    batch = next(iter(loader))
    sources, samples = loader.picks(0)
    for row, (j, i) in enumerate(zip(sources.tolist(), samples.tolist(), strict=True)):
        data = seqs[mix.names[j]]
        assert np.array_equal(batch["input_ids"][row], data[i])
        assert np.array_equal(batch["position_ids"][row], data.boundaries(np.array([i])).position_ids[0])
    assert Counter(sources.tolist()) == {0: 6, 1: 2}


# --- bad input -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Mixture({}, weights={}), "takes a dict of name -> dataset"),
        (lambda: Mixture({"a": source(0, 5)}), "either weights=.* or stages="),
        (
            lambda: Mixture({"a": source(0, 5)}, weights={"b": 1}),
            r"name sources the mixture does not have: \['b'\]",
        ),
        (lambda: Mixture({"a": source(0, 5)}, weights={"a": -1}), "must be a non-negative number"),
        (lambda: Mixture({"a": source(0, 5)}, weights={"a": 0}), "the weights are all zero"),
        (
            lambda: Mixture(
                {"a": source(0, 5), "b": source(1, 5)}, weights={"a": 999, "b": 1}, block_size=100
            ),
            r"'b' \(0.001 of the mixture\) is less than one position per block of block_size=100; "
            "use block_size=1000",
        ),
        (
            lambda: Mixture({"a": source(0, 5)}, stages=[(5, {"a": 1})]),
            "first stage must start at position 0",
        ),
        (lambda: Mixture({"a": source(0, 5)}, stages=[(0, {"a": 1}), (0, {"a": 2})]), "increasing order"),
        (lambda: Mixture({"a": source(0, 5), "b": np.zeros((4, 3))}, weights={"a": 1}), "one width"),
        (lambda: Mixture({"a": source(0, 5), "b": np.zeros((0, 1))}, weights={"a": 1}), "'b' has no samples"),
        (lambda: Mixture({"a": source(0, 5)}, weights={"a": 1}, stop="never!"), "stop must be"),
        (
            lambda: Loader(Mixture({"a": source(0, 5)}, weights={"a": 1}), batch_size=2, seed=3),
            r"Mixture\(\.\.\., seed=",
        ),
        (
            lambda: Loader(Mixture({"a": source(0, 5)}, weights={"a": 1}), batch_size=2, epochs=3),
            "first_exhausted",
        ),
    ],
)
def test_bad_mixtures_are_refused_with_the_fix(make, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(OptionsError, match=message):
        make()


@settings(max_examples=40, deadline=None)
@given(
    mix=mixtures(),
    stop=st.integers(0, 300),
    new_weights=st.lists(st.integers(0, 3), min_size=1, max_size=5),
    added=st.integers(0, 1),
    batch=st.integers(1, 9),
    workers=st.integers(1, 3),
)
def test_any_change_of_weights_or_sources_on_resume_repeats_and_skips_nothing(
    mix: Mixture, stop: int, new_weights: list[int], added: int, batch: int, workers: int
) -> None:
    before = stream(mix, 0, stop)
    saved = Loader(mix, batch_size=1)
    saved.advance(stop)
    names = [*mix.names, *(["new"] if added else [])][: len(new_weights)]
    weights = dict(zip(names, new_weights, strict=False))
    if not any(weights.values()):
        weights[names[0]] = 1
    sources = dict(mix.sources) | ({"new": source(len(mix.names), 57)} if added else {})
    block = mix.block_size  # another block size would be another order: refused, tested elsewhere
    assume(all(not w or w * block >= sum(weights.values()) for w in weights.values()))
    # Only the weights after the checkpoint matter: the checkpoint's schedule decides the blocks before.
    changed = Mixture(sources, weights, seed=mix.seed, shuffle=mix.shuffle, block_size=block)
    # The DataLoader's way: worker k of n makes batches k, k + n, ... of the schedule, in order.
    resumed = Loader(changed, batch_size=batch)
    resumed.load_state_dict(json.loads(json.dumps(saved.state_dict())))
    positions = list(islice(resumed.schedule(), 20))
    per_worker = [[resumed.batch(p) for p in positions[k::workers]] for k in range(workers)]
    after = [pair for i in range(len(positions)) for pair in decode(per_worker[i % workers][i // workers])]
    served = before + [(j, i) for j, i in after]
    started = -(-stop // mix.block_size) * mix.block_size
    assert served[:stop] == before and len(after) == 20 * batch
    assert served[: min(started, len(served))] == stream(mix, 0, min(started, len(served)))
    for j, n in enumerate(changed.sizes()):
        times = Counter(i for k, i in served if k == j)
        assert not times or max(times.values()) - min(times.get(i, 0) for i in range(n)) <= 1
    new_counts = schedule.counts(weights, changed.names, changed.block_size)
    for first in range(started, len(served) - block + 1, block):
        counts = Counter(k for k, _ in served[first : first + block])
        assert [counts.get(j, 0) for j in range(len(new_counts))] == list(new_counts)


def test_caches_of_several_shards_read_as_one_token_space(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from streampack.testing.caches import write_random_cache

    seqs = {
        name: streampack.open(
            write_random_cache(tmp_path / name, tokens, num_shards=shards, seed=seed)
        ).sequences(100, overlap=1)
        for name, tokens, shards, seed in (("a", 20_011, 3, 1), ("b", 5_003, 4, 2), ("c", 999, 1, 3))
    }
    mix = Mixture(seqs, weights={"a": 4, "b": 2, "c": 1}, block_size=7, seed=5)
    loader = Loader(mix, batch_size=14, dtype=None)
    assert loader.run.rows.joined is not None  # the one-pass read is the one under test
    for position in range(0, 14 * 30, 14):
        batch = loader.batch(position)
        sources, samples = loader.picks(position)
        expected = [seqs[mix.names[j]][i] for j, i in zip(sources.tolist(), samples.tolist(), strict=True)]
        assert np.array_equal(batch, np.stack(expected))


def test_caches_cut_at_other_seq_lens_of_one_width_read_their_own_windows(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """seq_len 8 + overlap 1 and seq_len 9 + overlap 0 are both 9 wide: each cache keeps its own stride."""
    from streampack.testing.caches import write_random_cache

    seqs = {
        "a": streampack.open(write_random_cache(tmp_path / "a", 5_000, num_shards=3, seed=1)).sequences(
            8, overlap=1
        ),
        "b": streampack.open(write_random_cache(tmp_path / "b", 7_000, num_shards=2, seed=2)).sequences(9),
    }
    mix = Mixture(seqs, weights={"a": 1, "b": 1}, block_size=16)
    loader = Loader(mix, batch_size=8)
    assert loader.run.rows.joined is not None
    for position in (0, 8, 800, 16, 4000):
        sources, samples = loader.picks(position)
        expected = [seqs[mix.names[j]][i] for j, i in zip(sources.tolist(), samples.tolist(), strict=True)]
        assert np.array_equal(loader.batch(position), np.stack(expected))


def _damaged(order: dict, key: str, value: object) -> None:  # type: ignore[type-arg]
    if key == "seed of a":
        order["sources"]["a"]["seed"] = value
    else:
        order[key] = value


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("schedule", []),
        ("schedule", [[0, {"a": 4, "b": 4}], [0, {"a": 2, "b": 6}]]),
        ("schedule", [[-3, {"a": 4, "b": 4}], [5, {"a": 2, "b": 6}]]),
        ("schedule", [[5, {"a": 2, "b": 6}], [0, {"a": 4, "b": 4}]]),
        ("schedule", [[2, {"a": 4, "b": 4}]]),
        ("schedule", [[True, {"a": 4, "b": 4}]]),
        ("schedule", [[0, {"a": 5, "b": 4}]]),
        ("schedule", [[0, {"a": -4, "b": 12}]]),
        ("schedule", [[0, {"a": 4, "zz": 4}]]),
        ("schedule", [[0, {"a": 4.5, "b": 3.5}]]),
        ("seed of a", -1),
        ("seed of a", 2**70),
    ],
)
def test_a_damaged_mixture_schedule_is_refused_and_changes_nothing(key: str, value: object) -> None:
    mix = Mixture(
        {"a": source(0, 100), "b": source(1, 200)},
        stages=[(0, {"a": 1, "b": 1}), (40, {"a": 1, "b": 3})],
        block_size=8,
    )
    state = Loader(mix, batch_size=4).state_dict() | {"position": 20}
    _damaged(state["order"], key, value)
    loader = Loader(mix, batch_size=4)
    loader.advance(3)
    before = loader.position, loader.order.fingerprint(), loader.batch(loader.position)
    with pytest.raises(LoaderStateError, match="damaged"):
        loader.load_state_dict(json.loads(json.dumps(state)))
    assert loader.position == before[0] and loader.order.fingerprint() == before[1]
    assert np.array_equal(loader.batch(loader.position), before[2])


def test_sources_of_mixed_signedness_give_integer_batches() -> None:
    mix = Mixture(
        {"a": source(0, 50), "b": source(1, 50).astype(np.uint64)}, weights={"a": 1, "b": 1}, block_size=2
    )
    batch = Loader(mix, batch_size=4, dtype=None).batch(0)
    assert batch.dtype == np.int64 and sorted(j for j, _ in decode(batch)) == [0, 0, 1, 1]


def test_a_mixture_order_read_by_two_threads_at_once_serves_what_one_thread_serves() -> None:
    """A remote cache's prefetch thread maps the positions of the batches ahead while the trainer's thread
    reads: the mixture's cache of recent blocks is shared by both (evicted in place, two threads popped
    one block: a KeyError)."""
    data = {"a": np.zeros((100_000, 2), np.int32), "b": np.ones((70_000, 2), np.int32)}

    def order() -> Any:
        return Loader(Mixture(data, {"a": 2, "b": 1}, block_size=8, seed=5), batch_size=8).order

    stop = 40_000
    sources, samples = order()(np.arange(stop, dtype=np.int64))
    problems: list[str] = []

    def read(mixed: Any, stride: int) -> None:
        try:
            for lo in range(0, stop, stride):
                got = mixed(np.arange(lo, min(lo + stride, stop), dtype=np.int64))
                want = (sources[lo : lo + stride], samples[lo : lo + stride])
                if not (np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])):
                    problems.append(f"positions from {lo} differ")
        except Exception as error:  # a thread's failure is reported by the test
            problems.append(repr(error))

    for _ in range(3):
        mixed = order()
        in_threads(read, [(mixed, k) for k in (64, 96, 128)])
    assert problems == []

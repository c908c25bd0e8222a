"""The block shuffle: every sample once per epoch, a bounded set of blocks per window, exact resume."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import streampack
from streampack.errors import LoaderStateError, OptionsError
from streampack.loader import Loader
from streampack.order.blockshuffle import BlockShuffle, BlockShuffled
from streampack.order.mixture import Mixture
from streampack.testing.caches import write_random_cache
from tests.conftest import run_cli
from tests.test_loader import IndexSource, flat, leaves_a_rank_empty, served


def epoch_of(order: BlockShuffled, epoch: int) -> np.ndarray:
    n = order.size
    return order.samples(np.arange(epoch * n, (epoch + 1) * n, dtype=np.int64))


def runs_of_at_most(blocks: np.ndarray, window: int) -> int:
    """The fewest runs of consecutive positions, each from at most ``window`` blocks, covering ``blocks``."""
    runs, seen = 1, set()
    for block in blocks.tolist():
        if block not in seen and len(seen) == window:
            runs, seen = runs + 1, set()
        seen.add(block)
    return runs


# --- the order ------------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 400),
    block=st.integers(1, 40),
    window=st.integers(1, 12),
    seed=st.integers(0, 2**64 - 1),
    epoch=st.integers(0, 2**20),
)
def test_every_sample_is_served_once_per_epoch(
    n: int, block: int, window: int, seed: int, epoch: int
) -> None:
    order = BlockShuffled(n, seed=seed, block=block, window=window)
    stream = epoch_of(order, epoch)
    assert sorted(stream.tolist()) == list(range(n))
    # Any split of the positions into calls gives the same samples (a rank or a worker asks for its own).
    cut = n // 3
    positions = np.arange(epoch * n, (epoch + 1) * n, dtype=np.int64)
    parts = np.concatenate([order.samples(positions[:cut]), order.samples(positions[cut:][::-1])[::-1]])
    assert parts.tolist() == stream.tolist()


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 400),
    block=st.integers(1, 40),
    window=st.integers(1, 12),
    seed=st.integers(0, 2**64 - 1),
    data=st.data(),
)
def test_a_reader_needs_only_a_window_of_blocks_at_a_time(
    n: int, block: int, window: int, seed: int, data: st.DataObject
) -> None:
    order = BlockShuffled(n, seed=seed, block=block, window=window)
    blocks = epoch_of(order, data.draw(st.integers(0, 100), label="epoch")) // block
    # The epoch is cut into its windows: runs of positions, each from at most `window` blocks.
    assert runs_of_at_most(blocks, window) <= order.num_windows
    # So any window * block consecutive positions straddle at most two windows, or three when the
    # shorter window holding the short block lies between them (n=233, block=29, window=1 did).
    span = window * block
    start = data.draw(st.integers(0, max(0, n - 1)), label="start")
    bound = 2 * window if n % block == 0 else 3 * window
    assert len(set(blocks[start : start + span].tolist())) <= bound
    if n % block == 0:  # no short block: the windows start at multiples of window * block
        for first in range(0, n, span):
            assert len(set(blocks[first : first + span].tolist())) <= window


def test_window_one_serves_each_block_whole_and_blocks_in_a_new_order_each_epoch() -> None:
    order = BlockShuffled(1000, seed=5, block=10, window=1)
    first, second = epoch_of(order, 0), epoch_of(order, 1)
    for stream in (first, second):
        runs = stream.reshape(100, 10) // 10
        assert (runs == runs[:, :1]).all()  # each run of 10 positions is one block
        assert sorted(runs[:, 0].tolist()) == list(range(100))
    assert first[::10].tolist() != second[::10].tolist()
    assert (np.diff(first.reshape(100, 10), axis=1) != 1).any()  # shuffled within the block too


def test_epochs_are_shuffled_differently() -> None:
    order = BlockShuffled(5000, seed=3, block=64, window=4)
    epochs = [epoch_of(order, e) for e in range(3)]
    assert all(not np.array_equal(a, b) for a, b in [(epochs[0], epochs[1]), (epochs[1], epochs[2])])
    assert (epochs[0][:256] // 64).tolist() != (epochs[1][:256] // 64).tolist()  # other blocks first


def test_a_window_of_every_block_shuffles_the_epoch_as_a_whole() -> None:
    n, block = 10_000, 100
    order = BlockShuffled(n, seed=11, block=block, window=100)
    stream = epoch_of(order, 0)
    assert sorted(stream.tolist()) == list(range(n))
    # Like a global shuffle: the first 100 positions come from ~63 of the 100 blocks (1 - 1/e), not from
    # one, and position and sample are uncorrelated.
    assert 50 <= len(set((stream[:block] // block).tolist())) <= 75
    assert abs(np.corrcoef(np.arange(n), stream)[0, 1]) < 0.05
    # The same window over more blocks than it holds keeps each window's 100 blocks together instead.
    narrow = epoch_of(BlockShuffled(n, seed=11, block=block, window=10), 0)
    assert len(set((narrow[:1000] // block).tolist())) == 10


def test_the_order_is_pinned() -> None:
    # The output is part of the resume contract, like the Feistel permutation's: a change to the block
    # order, the short block's slot or the window permutations must show up here.
    order = BlockShuffled(1003, seed=20240601, block=10, window=4)
    assert order.samples(np.arange(12)).tolist() == [881, 438, 46, 887, 48, 886, 432, 435, 40, 43, 44, 525]


def test_it_pickles_small_and_equal() -> None:
    order = BlockShuffled(10**9, seed=1, block=4096, window=32, data={"num_samples": 10**9})
    positions = np.array([0, 5, 10**9 - 1, 10**9, 5 * 10**9 + 7], dtype=np.int64)
    first = order.samples(positions)
    copy = pickle.loads(pickle.dumps(order))
    assert len(pickle.dumps(order)) < 1000  # no per-sample or per-block state
    assert copy.samples(positions).tolist() == first.tolist()
    assert copy.fingerprint() == order.fingerprint()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: BlockShuffle(block=0), r"block must be an integer in \[1, 2\*\*40\] \(got block=0\)"),
        (lambda: BlockShuffle(window=-1), r"window must be an integer .*\(got window=-1\)"),
        (lambda: BlockShuffle(block=True), "block must be an integer"),
        (lambda: Loader(IndexSource(10), batch_size=2, shuffle="blocks"), "shuffle must be True, False or a"),
    ],
)
def test_bad_block_shuffles_are_refused(make: Callable[[], object], message: str) -> None:
    with pytest.raises(OptionsError, match=message):
        make()


# --- in the loader --------------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 200),
    world=st.integers(1, 4),
    rows=st.integers(1, 5),
    seed=st.integers(0, 2**64 - 1),
    block=st.integers(1, 20),
    window=st.integers(1, 6),
    workers=st.integers(1, 3),
)
def test_ranks_and_workers_split_an_epoch_without_duplicates(
    n: int, world: int, rows: int, seed: int, block: int, window: int, workers: int
) -> None:
    batch_size = world * rows
    assume(not leaves_a_rank_empty(n, batch_size, world))
    shuffle = BlockShuffle(block=block, window=window)
    single = flat(served(Loader(IndexSource(n), batch_size=1, seed=seed, shuffle=shuffle, epochs=1)))
    assert sorted(single) == list(range(n))
    per_rank = []
    for rank in range(world):
        loader = Loader(
            IndexSource(n), batch_size=batch_size, seed=seed, shuffle=shuffle, rank=rank, world_size=world,
            drop_last=False, epochs=1,
        )  # fmt: skip
        # The DataLoader's way: worker k of n makes batches k, k + n, ... of the schedule.
        positions = list(loader.schedule())
        made = {k: [loader.batch(p)[:, 0].tolist() for p in positions[k::workers]] for k in range(workers)}
        per_rank.append([made[i % workers][i // workers] for i in range(len(positions))])
    assert len({len(batches) for batches in per_rank}) == 1
    joined = flat([flat(step) for step in zip(*per_rank, strict=True)])
    assert joined == single  # the ranks' rows, step by step, are the one global stream


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 150),
    rows=st.integers(1, 5),
    seed=st.integers(0, 2**64 - 1),
    block=st.integers(1, 20),
    window=st.integers(1, 6),
    data=st.data(),
)
def test_resume_mid_epoch_continues_the_uninterrupted_stream(
    n: int, rows: int, seed: int, block: int, window: int, data: st.DataObject
) -> None:
    options = {
        "batch_size": rows, "seed": seed, "shuffle": BlockShuffle(block=block, window=window),
        "drop_last": False, "epochs": 3,
    }  # fmt: skip
    uninterrupted = served(Loader(IndexSource(n), **options))  # type: ignore[arg-type]
    stop = data.draw(st.integers(0, len(uninterrupted)), label="stop")
    first = Loader(IndexSource(n), **options)  # type: ignore[arg-type]
    head = served(first, stop)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["order"] == {
        "kind": "blocks", "seed": seed, "block": block, "window": window, "data": {"num_samples": n},
    }  # fmt: skip
    resumed = Loader(IndexSource(n), **options)  # type: ignore[arg-type]
    resumed.load_state_dict(state)
    assert head + served(resumed) == uninterrupted


def blocks_loader(**change: object) -> Loader:
    options: dict = {"batch_size": 4, "seed": 7, "shuffle": BlockShuffle(block=8, window=2)} | change
    return Loader(IndexSource(100), **options)


@pytest.mark.parametrize(
    ("saver", "message"),
    [
        (
            blocks_loader(shuffle=BlockShuffle(block=16, window=2)),
            "block in checkpoint: 16 / block in this loader: 8",
        ),
        (
            blocks_loader(shuffle=BlockShuffle(block=8, window=3)),
            "window in checkpoint: 3 / window in this loader: 2",
        ),
        (blocks_loader(seed=8), "seed in checkpoint: 8 / seed in this loader: 7"),
        (
            blocks_loader(shuffle=True),
            r"reading in a global shuffle, this loader block-shuffles \(block=8, window=2\); resume it "
            "with shuffle=True",
        ),
        (blocks_loader(shuffle=False), r"in stream order \(shuffle=False\)"),
    ],
)
def test_a_checkpoint_of_another_order_is_refused_naming_both(saver: Loader, message: str) -> None:
    served(saver, 3)
    with pytest.raises(LoaderStateError, match=message):
        blocks_loader().load_state_dict(saver.state_dict())


def test_a_global_shuffle_refuses_a_block_shuffled_checkpoint() -> None:
    state = blocks_loader().state_dict()
    with pytest.raises(
        LoaderStateError,
        match=r"block-shuffles \(BlockShuffle\(block=8, window=2\)\), this loader reads in a global "
        r"shuffle; resume it with shuffle=BlockShuffle\(block=8, window=2\)",
    ):
        blocks_loader(shuffle=True).load_state_dict(state)
    mixture = state | {"order": state["order"] | {"kind": "mixture"}}
    with pytest.raises(LoaderStateError, match="over a 'mixture' order"):
        blocks_loader().load_state_dict(mixture)


def test_block_shuffled_batches_of_a_real_cache(tmp_path) -> None:  # type: ignore[no-untyped-def]
    texts = [f"document {i} " + "abc" * (i % 13) for i in range(300)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    streampack.build([tmp_path / "a.jsonl"], tmp_path / "cache", tokenizer="bytes", workers=1)
    seqs = streampack.open(tmp_path / "cache").sequences(16, overlap=1)
    loader = Loader(seqs, batch_size=8, seed=2, shuffle=BlockShuffle(block=32, window=2), epochs=1)
    seen = []
    for position in loader.schedule():
        indices = loader.indices(position)
        assert np.array_equal(loader.batch(position), seqs[indices])
        seen += indices.tolist()
    assert len(seen) == len(set(seen)) == len(seqs) // 8 * 8


# --- in a mixture, a config and the CLI -------------------------------------------------------------------


def test_a_mixture_reads_each_source_in_block_shuffled_order() -> None:
    a, b = (np.arange(n, dtype=np.int64)[:, None] + offset for n, offset in ((1000, 0), (600, 10**6)))
    shuffle = BlockShuffle(block=20, window=3)
    mix = Mixture({"a": a, "b": b}, weights={"a": 1, "b": 1}, block_size=10, seed=4, shuffle=shuffle)
    sources, samples = mix(np.arange(1200, dtype=np.int64))
    for j in (0, 1):
        mine = samples[sources == j]
        assert len(mine) == 600 and len(set(mine.tolist())) == 600  # b: its whole epoch, a: 600 of 1000
        # Each source's cursor runs through its own BlockShuffled order: 10 windows of 3 blocks of 20.
        assert runs_of_at_most(mine // 20, 3) <= 10
    state = Loader(mix, batch_size=10).state_dict()
    assert state["order"]["shuffle"] == {"block": 20, "window": 3}
    with pytest.raises(LoaderStateError, match=r"shuffle in checkpoint: \{'block': 20, 'window': 3\}"):
        Loader(
            Mixture({"a": a, "b": b}, weights={"a": 1, "b": 1}, block_size=10, seed=4), batch_size=10
        ).load_state_dict(state)


def test_a_block_shuffled_checkpoint_continues_as_a_mixture_source() -> None:
    a, b = np.arange(100, dtype=np.int64)[:, None], np.arange(10**6, 10**6 + 100, dtype=np.int64)[:, None]
    shuffle = BlockShuffle(block=8, window=2)
    single = Loader(a, batch_size=10, seed=9, shuffle=shuffle)
    head = flat(served(single, 3))
    mix = Mixture({"a": a, "b": b}, weights={"a": 1, "b": 1}, block_size=10, seed=1, shuffle=shuffle)
    mixed = Loader(mix, batch_size=10)
    mixed.load_state_dict(single.state_dict())
    firsts = head + [i for i in flat(served(mixed, 14)) if i < 10**6]
    assert sorted(firsts) == list(range(100))  # a's epoch completes in its block-shuffled order
    with pytest.raises(
        LoaderStateError, match=r"shuffle in checkpoint: \{'block': 8, 'window': 2\} / shuffle"
    ):
        Loader(
            Mixture({"a": a, "b": b}, weights={"a": 1, "b": 1}, block_size=10), batch_size=10
        ).load_state_dict(single.state_dict())


def test_a_mixture_config_takes_a_block_shuffle(tmp_path: Path) -> None:
    write_random_cache(tmp_path / "web", 5_000, seed=1)
    config = {
        "seq_len": 16,
        "sources": {"web": "web"},
        "weights": {"web": 1},
        "shuffle": {"block": 8, "window": 2},
    }
    (tmp_path / "mix.json").write_text(json.dumps(config))
    mix = streampack.load_mixture(tmp_path / "mix.json")
    assert mix.shuffle == BlockShuffle(block=8, window=2)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(config | {"shuffle": {"block": 8, "windows": 2}}))
    with pytest.raises(
        OptionsError, match=r"bad.json: Object contains unknown field `windows` - at `\$.shuffle`"
    ):
        streampack.load_mixture(bad)
    bad.write_text(json.dumps(config | {"shuffle": {"block": 0}}))
    with pytest.raises(OptionsError, match=r"bad.json: Expected `int` >= 1, got `0` - at `\$.shuffle.block`"):
        streampack.load_mixture(bad)


def test_the_cli_takes_a_block_shuffle(tmp_path: Path) -> None:
    texts = [f"document {i} " + "abc" * (i % 13) for i in range(200)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    streampack.build([tmp_path / "a.jsonl"], tmp_path / "cache", tokenizer="bytes", workers=1)
    cache = tmp_path / "cache"
    out = run_cli(
        "bench", cache, "--seq-len", "16", "--batch-size", "4", "--steps", "5", "--shuffle-block", "8"
    )
    assert "block-shuffled (8 x 32)" in out.stdout
    flags = [
        "--seq-len",
        "16",
        "--batch-size",
        "4",
        "--seed",
        "3",
        "--shuffle-block",
        "8",
        "--shuffle-window",
        "2",
    ]
    shown = json.loads(run_cli("which", cache, *flags, "--step", "5", "--json").stdout)
    seqs = streampack.open(cache).sequences(16)
    loader = Loader(seqs, batch_size=4, seed=3, shuffle=BlockShuffle(block=8, window=2))
    expected = streampack.which(loader, 5)
    assert [(d["doc"], d["location"]) for d in shown["documents"]] == [(d.doc, d.location) for d in expected]
    refused = run_cli("which", cache, *flags, "--no-shuffle", "--step", "5", check=False)
    assert refused.returncode == 2 and "--no-shuffle reads in stream order" in refused.stderr

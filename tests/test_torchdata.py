"""Tests for `streampack.torchdata`: torchdata's StatefulDataLoader resumes exactly from its own state."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchdata", reason="needs pip install 'streampack[torchdata]'")

import streampack  # noqa: E402
from streampack.errors import LoaderStateError  # noqa: E402
from streampack.torchdata import LoaderBatches, LoaderSampler, stateful_dataloader  # noqa: E402
from tests.frameworks import numbered_cache, sample_ids  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> streampack.Cache:
    return numbered_cache(tmp_path_factory.mktemp("torchdata") / "c")


def through_disk(state: dict) -> dict:
    """The state as a new process reads it back from a checkpoint file."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_stateful_dataloader_state_resumes_at_the_next_batch(cache: streampack.Cache, workers: int) -> None:
    def loader() -> streampack.Loader:
        seqs = cache.sequences(8)
        return streampack.Loader(seqs, batch_size=6, seed=7, rank=1, world_size=2, output="dict")

    reference = [sample_ids(loader().batch(6 * step)) for step in range(9)]
    data = stateful_dataloader(loader(), num_workers=workers)
    batches = iter(data)
    first = [next(batches) for _ in range(4)]
    state = through_disk(data.state_dict())
    assert set(first[0]) == {"input_ids", "labels", "position_ids"}
    assert first[0]["labels"].dtype == torch.int64 and bool((first[0]["labels"] == -100).any())
    del batches
    resumed = stateful_dataloader(loader(), num_workers=workers)  # a new process: everything anew
    resumed.load_state_dict(state)
    rest = [sample_ids(batch) for _, batch in zip(range(5), resumed)]
    assert [sample_ids(batch) for batch in first] + rest == reference


def test_stateful_dataloader_ends_with_the_run_and_its_state_says_so(cache: streampack.Cache) -> None:
    loader = streampack.Loader(cache.sequences(8), batch_size=40, seed=1, epochs=1, drop_last=False)
    data = stateful_dataloader(loader, num_workers=2)
    assert len(data) == 4  # 150 samples: three batches of 40 and one of 30
    ids = [sample_ids(batch) for batch in data]
    assert sorted(i for batch in ids for i in batch) == list(range(150))
    assert loader.position == 0  # the loader passed in stays where it was: the sampler advances a copy
    again = streampack.Loader(cache.sequences(8), batch_size=40, seed=1, epochs=1, drop_last=False)
    again = stateful_dataloader(again, num_workers=2)  # StatefulDataLoader resumes with as many workers
    again.load_state_dict(through_disk(data.state_dict()))
    assert list(again) == []


def test_a_mixture_resumed_with_new_weights_reaches_the_workers(
    cache: streampack.Cache, tmp_path: Path
) -> None:
    other = numbered_cache(tmp_path / "other")
    sources = {"a": cache.sequences(8), "b": other.sequences(8)}
    before = streampack.Mixture(sources, {"a": 0.2, "b": 0.8}, seed=3, block_size=10)
    data = stateful_dataloader(streampack.Loader(before, batch_size=10), num_workers=2)
    batches = iter(data)
    for _ in range(3):
        next(batches)
    state = through_disk(data.state_dict())
    del batches
    # Blocks served before the checkpoint keep their 2:8 counts, so the resumed order is not this one.
    after = streampack.Mixture(sources, {"a": 0.9, "b": 0.1}, seed=3, block_size=10)
    expected = streampack.Loader(after, batch_size=10)
    expected.load_state_dict(state["_snapshot"]["_main_snapshot"]["_index_sampler_state"])
    resumed = stateful_dataloader(streampack.Loader(after, batch_size=10), num_workers=2)
    resumed.load_state_dict(state)
    got = [batch.numpy() for _, batch in zip(range(4), resumed)]
    want = [expected.batch(expected.position + 10 * k) for k in range(4)]
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))


def test_the_pieces_refuse_what_they_cannot_serve(cache: streampack.Cache) -> None:
    loader = streampack.Loader(cache.sequences(8), batch_size=4)
    with pytest.raises(LoaderStateError, match=r"indexed by loader states.*got 3"):
        LoaderBatches(loader)[3]
    with pytest.raises(ValueError, match=r"takes no batch_size="):
        stateful_dataloader(loader, batch_size=4)
    sampler = LoaderSampler(loader)
    with pytest.raises(TypeError, match="endless"):
        len(sampler)
    with pytest.raises(LoaderStateError):
        sampler.load_state_dict({"format": "streampack.Loader", "version": 2, "position": 0, "order": {}})


@pytest.mark.parametrize(("saved", "resumed"), [(2, 0), (2, 3), (0, 2)])
def test_a_state_resumed_with_another_num_workers_is_refused_naming_both(
    cache: streampack.Cache, saved: int, resumed: int
) -> None:
    def loader() -> streampack.Loader:
        return streampack.Loader(cache.sequences(8), batch_size=6, seed=3)

    reference = [sample_ids(loader().batch(6 * step)) for step in range(8)]
    data = stateful_dataloader(loader(), num_workers=saved)
    batches = iter(data)
    first = [sample_ids(next(batches)) for _ in range(4)]
    state = through_disk(data.state_dict())
    del batches
    other = stateful_dataloader(loader(), num_workers=resumed)
    rule = (
        rf"saved with num_workers={saved}, this DataLoader has num_workers={resumed}: torchdata's "
        "StatefulDataLoader resumes a state only with the num_workers that saved it"
    )
    with pytest.raises(LoaderStateError, match=rule):
        other.load_state_dict(state)
    # What the message says to do: the loader state inside resumes with any number of workers.
    inner = state["_snapshot"]["_main_snapshot"] if saved else state
    moved = loader()
    moved.load_state_dict(inner["_index_sampler_state"])
    rest = [sample_ids(batch) for _, batch in zip(range(4), stateful_dataloader(moved, num_workers=resumed))]
    assert first + rest == reference
    with pytest.raises(LoaderStateError, match=r"a streampack loader state.*not a StatefulDataLoader state"):
        other.load_state_dict(inner["_index_sampler_state"])

"""Batches: the arithmetic of positions, global batches and ranks, asked alone (no loader, no data)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from streampack.errors import OptionsError
from streampack.loader.batches import Batches
from streampack.loader.options import LoaderOptions
from streampack.order import Shuffled


def batches(size: int, epochs: int | None, **options: object) -> Batches:
    """One dataset of ``size`` samples, run for ``epochs``."""
    order = Shuffled(size, seed=3, epochs=epochs)
    return Batches(LoaderOptions(epochs=epochs, **options), order)  # type: ignore[arg-type]


def test_full_batches_then_the_partial_last_one_or_none() -> None:
    kept = batches(10, 1, batch_size=4, drop_last=False)
    assert [kept.rows(p) for p in (0, 4, 8, 10)] == [4, 4, 2, 0]
    dropped = batches(10, 1, batch_size=4)
    assert [dropped.rows(p) for p in (0, 4, 8)] == [4, 4, 0]
    assert (kept.count(), dropped.count(), kept.steps_per_epoch(), dropped.steps_per_epoch()) == (3, 2, 3, 2)


def test_advanced_counts_the_partial_last_batch_only_when_it_is_served() -> None:
    assert batches(10, 1, batch_size=4, drop_last=False).advanced(0, 5) == 10
    assert batches(10, 1, batch_size=4).advanced(0, 5) == 8
    assert batches(10, None, batch_size=4).advanced(2, 5) == 22


@given(
    size=st.integers(1, 200),
    world=st.sampled_from([1, 2, 3, 4]),
    per_rank=st.integers(1, 5),
    epochs=st.sampled_from([1, 2, None]),
    drop_last=st.booleans(),
)
def test_the_ranks_slices_cover_each_global_batch_once(
    size: int, world: int, per_rank: int, epochs: int | None, drop_last: bool
) -> None:
    common = {"batch_size": world * per_rank, "world_size": world, "drop_last": drop_last}
    ranks = [batches(size, epochs, rank=rank, **common) for rank in range(world)]
    position = 0
    for _ in range(50):
        rows = ranks[0].rows(position)
        if rows == 0:
            break
        spans = [r.span(position) for r in ranks]
        assert spans[0][0] == position and spans[-1][1] == position + rows
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        position = ranks[0].advanced(position, 1)
    picks = np.concatenate([r.picks(0)[1] for r in ranks]) if ranks[0].rows(0) else np.zeros(0)
    assert np.array_equal(picks, ranks[0].served(0, ranks[0].rows(0))[1])


def test_a_last_batch_that_leaves_a_rank_none_is_refused_with_a_batch_size_that_fits() -> None:
    with pytest.raises(OptionsError, match="batch_size=6"):
        batches(9, 1, batch_size=4, world_size=2, drop_last=False).check_last_batch(0)
    batches(9, 1, batch_size=4, world_size=2, drop_last=False).check_last_batch(1)
    assert "run ends at 10" in str(batches(10, 1, batch_size=4).missing(12))

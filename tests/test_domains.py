"""Each row's source and the per-token loss weights of a mixture's dict batches (the reference model checks
them over generated runs: tests/test_reference_model.py); here the options' errors and the sub-windows."""

from __future__ import annotations

import random
from itertools import islice

import numpy as np
import pytest

import streampack
from streampack.errors import OptionsError
from streampack.loader import Loader
from streampack.order.mixture import Mixture
from tests.conftest import write_jsonl


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> streampack.Cache:
    root = tmp_path_factory.mktemp("domains")
    rng = random.Random(3)
    words = ["alpha", "beta", "gamma", "delta", "tokens"]
    records = [{"text": " ".join(rng.choices(words, k=rng.randint(3, 60)))} for _ in range(150)]
    streampack.build([write_jsonl(root / "in.jsonl", records)], root / "cache", progress=False)
    return streampack.open(root / "cache")


def _mixture(cache: streampack.Cache, seq_len: int = 16) -> Mixture:
    return Mixture(
        {"web": cache.sequences(seq_len), "code": cache.packed(seq_len, too_long="split")},
        weights={"web": 0.5, "code": 0.5},
        block_size=8,
        seed=2,
    )


def test_a_mixtures_dict_batches_say_each_rows_source_and_weigh_its_tokens(cache: streampack.Cache) -> None:
    loader = Loader(_mixture(cache), batch_size=8, output="varlen", loss_weights={"code": 2.5})
    for batch in islice(loader, 4):
        sources = loader.picks(loader.position - 8)[0]
        assert batch["source_ids"].dtype == np.int64 and batch["source_ids"].tolist() == sources.tolist()
        weights = batch["loss_weights"]
        assert weights.dtype == np.float32 and weights.shape == batch["labels"].shape
        expected = np.where(
            batch["labels"] != -100, np.array([1.0, 2.5], dtype=np.float32)[sources][:, None], 0
        )
        assert np.array_equal(weights, expected)
    plain = next(iter(Loader(_mixture(cache), batch_size=8, output="dict")))
    assert "source_ids" in plain and "loss_weights" not in plain
    single = next(iter(Loader(cache.sequences(16), batch_size=8, output="dict")))
    assert "source_ids" not in single


def test_sub_windows_of_a_mixtures_units_keep_their_units_source(cache: streampack.Cache) -> None:
    mix = Mixture(
        {"a": cache.sequences(32), "b": cache.sequences(32)}, weights={"a": 1, "b": 1}, block_size=8
    )
    loader = Loader(mix, batch_size=4, output="dict", seq_len_schedule=[(0, 8)], loss_weights={"b": 0.5})
    batch = next(iter(loader))
    sources = loader.picks(0)[0]
    assert batch["input_ids"].shape == (16, 8)
    assert batch["source_ids"].tolist() == np.repeat(sources, 4).tolist()
    assert np.array_equal(batch["loss_weights"] != 0, batch["labels"] != -100)


def test_loss_weights_that_do_not_fit_are_refused_saying_why(cache: streampack.Cache) -> None:
    cases = [
        ({"code": 2.0}, "numpy", "output='numpy'"),
        ({"docs": 2.0}, "dict", "'docs', which the mixture does not read"),
        ({"code": -1.0}, "dict", "finite number >= 0"),
        ({"code": float("nan")}, "dict", "finite number >= 0"),
        ({"code": "2"}, "dict", "maps source names to numbers"),
        ([("code", 2.0)], "dict", "takes a dict of source name"),
    ]
    for weights, output, message in cases:
        with pytest.raises(OptionsError, match=message):
            Loader(_mixture(cache), batch_size=8, output=output, loss_weights=weights)  # type: ignore[arg-type]
    with pytest.raises(OptionsError, match="reads one dataset"):
        Loader(cache.sequences(16), batch_size=8, output="dict", loss_weights={"data": 2.0})


def test_a_resume_may_change_the_loss_weights_and_serves_the_same_tokens(cache: streampack.Cache) -> None:
    first = Loader(_mixture(cache), batch_size=8, output="dict", loss_weights={"code": 2.0})
    list(islice(first, 3))
    resumed = Loader(_mixture(cache), batch_size=8, output="dict", loss_weights={"web": 0.0})
    resumed.load_state_dict(first.state_dict())
    a, b = next(iter(first)), next(iter(resumed))
    assert np.array_equal(a["input_ids"], b["input_ids"]) and np.array_equal(a["source_ids"], b["source_ids"])
    assert np.array_equal(b["loss_weights"] == 0, (b["source_ids"][:, None] == 0) | (b["labels"] == -100))


def test_a_resume_that_changes_the_loss_weights_is_in_the_history_and_the_audit(
    cache: streampack.Cache,
) -> None:
    """The weights change no sample served, so only the history can say a resume changed them; a history
    saved before they were recorded (no ``loss_weights``) reads as none given."""
    from streampack.runs.audit import audit

    legs = [None, {"code": 2.0}, {"web": 0.0}, {"web": 0.0, "code": 1.0}]
    state = None
    for weights in legs:
        loader = Loader(_mixture(cache), batch_size=8, output="dict", loss_weights=weights)
        if state is not None:
            loader.load_state_dict(state)
        loader.advance(3)
        state = loader.state_dict()
    assert state is not None
    recorded = [entry.get("loss_weights") for entry in state["history"]]
    assert recorded == [None, {"web": 1.0, "code": 2.0}, {"web": 0.0, "code": 1.0}, {"web": 0.0, "code": 1.0}]
    report = audit(state, _mixture(cache))
    assert report.clean, report.text()
    assert [leg.loss_weights for leg in report.legs] == recorded
    changes = [line.strip() for line in report.text().splitlines() if "loss weights" in line]
    assert changes == [
        "loss weights changed at position 24 (step 3): none (every source 1) -> web 1, code 2",
        "loss weights changed at position 48 (step 6): web 1, code 2 -> web 0, code 1",
    ]

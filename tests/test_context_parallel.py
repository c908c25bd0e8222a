"""Long context: pieces padded to a multiple in the plan, rows split over context-parallel ranks, and a
global batch's rows spread over data-parallel ranks by attention cost, each against the reference model
(tests/reference_model.py, its last section), with resumes at other world sizes, ``which`` and ``audit``."""

from __future__ import annotations

import json
from itertools import islice, pairwise
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from streampack.errors import OptionsError
from streampack.loader import Loader
from streampack.runs.audit import audit
from streampack.runs.provenance import which

from .reference_model import (
    Corpus,
    ParallelLeg,
    ParallelModel,
    Refused,
    Run,
    Whole,
    _samples,
    balanced,
)
from .test_reference_model import _as_numpy, _same, caches, generated

__all__ = ["caches"]  # the fixture, shared with the reference model's tests


def _real(cache: Any, samples: Whole) -> Any:
    make = cache.packed if samples.packed else cache.documents
    return make(
        samples.seq_len,
        too_long=samples.too_long,
        no_target=samples.no_target,
        pad_id=samples.pad_id,
        pad_multiple=samples.pad_multiple,
    )


def _loader(cache: Any, run: Run, leg: ParallelLeg, rank: int, cp_rank: int, state: dict | None) -> Loader:
    loader = Loader(
        _real(cache, leg.samples),  # type: ignore[arg-type]
        batch_size=leg.batch_size,
        seed=run.seed,
        shuffle=run.shuffle,
        epochs=run.epochs,
        drop_last=run.drop_last,
        output=run.output,
        rank=rank,
        world_size=leg.world_size,
        cp_size=leg.cp_size,
        cp_rank=cp_rank,
        balance=leg.balance,  # type: ignore[arg-type]
    )
    if state is not None:
        loader.load_state_dict(state)
    return loader


@st.composite
def parallel_runs(draw: st.DrawFn, corpora: dict[str, Corpus]) -> Run:
    corpus = corpora[draw(st.sampled_from(sorted(corpora)))]
    cp = draw(st.sampled_from([1, 2, 4]))
    multiple = 2 * cp * draw(st.sampled_from([1, 2]))
    samples = Whole(
        draw(st.sampled_from([16, 32, 64])),
        packed=draw(st.booleans()),
        too_long=draw(st.sampled_from(["split", "truncate"])),
        pad_id=draw(st.sampled_from([None, 7])),
        pad_multiple=multiple,
    )
    n = len(_samples(corpus, samples))
    epochs = draw(st.sampled_from([None, 1, 2]))
    run = Run(
        corpus,
        seed=draw(st.integers(0, 2**64 - 1)),
        shuffle=draw(st.booleans()),
        epochs=epochs,
        drop_last=True if epochs is None else draw(st.booleans()),
        output=draw(st.sampled_from(["dict", "varlen"])),
        legs=[],
    )
    for _ in range(draw(st.integers(1, 3))):
        world = draw(st.sampled_from([1, 2, 3]))
        batch = world * draw(st.integers(1, max(1, min(4, n // (2 * world)))))
        balance = draw(st.sampled_from(["rows", "attention", "attention"]))
        run.legs.append(
            ParallelLeg(samples, batch, world, draw(st.integers(0, 3)), cp_size=cp, balance=balance)
        )
    return run


def check_parallel_run(cache: Any, run: Run, workers: int | None = None) -> None:
    """Every (DP rank, CP rank) of every leg against the model, resuming each leg from the last state (at
    another world size, or balance); every rank saves the same state; ``which`` of one batch a leg serves
    names each document's rank and row; the run audits clean."""
    model = ParallelModel(run)
    state: dict[str, Any] | None = None
    for index, leg in enumerate(run.legs):
        assert isinstance(leg, ParallelLeg)
        try:
            model.start_leg(leg, index)
        except Refused:
            with pytest.raises(OptionsError):
                next(iter(_loader(cache, run, leg, 0, 0, state)))
            return
        saved = set()
        for rank in range(leg.world_size):
            for cp_rank in range(leg.cp_size):
                loader = _loader(cache, run, leg, rank, cp_rank, state)
                if workers is None:
                    served = list(islice(iter(loader), leg.batches))
                else:
                    from streampack.torch import DataLoader

                    data = DataLoader(loader, num_workers=workers)
                    served = [_as_numpy(batch) for batch in islice(iter(data), leg.batches)]
                    loader = data  # type: ignore[assignment]
                expected = model.batches(leg, rank, cp_rank)
                assert len(served) == len(expected), f"leg {index} rank {rank}/{cp_rank}"
                for number, (real, want) in enumerate(zip(served, expected)):
                    _same(real, want, f"leg {index} rank {rank} cp {cp_rank} batch {number}")
                saved.add(json.dumps(loader.state_dict(), sort_keys=True))
        assert len(saved) == 1, f"leg {index}: the ranks saved different states"
        positions = model.positions(leg)
        if positions and workers is None:
            step = len(positions) // 2
            position, rows = positions[step]
            found = which(_loader(cache, run, leg, 0, 0, None), step, state=state)
            got = {(0, p.doc): [(q.rank, q.row, q.columns, q.tokens) for q in p.placements] for p in found}
            want = model.placements(leg, position, rows)
            assert got == want, f"which at position {position}:\n real {got}\n model {want}"
        state = json.loads(saved.pop())
        model.advance(leg)
        assert state["position"] == model.position
    if state is not None:
        report = audit(state, _real(cache, run.legs[0].samples))  # type: ignore[arg-type]
        assert report.clean, report.text()
        assert sum(source.samples for source in report.sources) == model.position
        balanced = any(getattr(leg, "balance", "rows") == "attention" for leg in run.legs)
        assert ("rows balanced by attention cost" in report.text()) == balanced, report.text()


@pytest.mark.slow
def test_random_parallel_runs_serve_what_the_model_says(caches: dict) -> None:
    corpora = {name: corpus for name, (_, corpus) in caches.items()}

    @generated(60)
    @given(parallel_runs(corpora))
    def check(run: Run) -> None:
        name = next(n for n, c in corpora.items() if c is run.corpus)
        check_parallel_run(caches[name][0], run)

    check()


def test_dataloader_workers_serve_each_cp_rank_what_the_model_says(caches: dict) -> None:
    """Each (DP, CP) rank's batches through ``streampack.torch.DataLoader`` worker processes, balanced by
    attention cost, with a resume at another world size."""
    pytest.importorskip("torch")
    cache, corpus = caches["sft"]
    samples = Whole(32, packed=True, too_long="split", pad_multiple=4)
    run = Run(corpus, seed=5, shuffle=True, epochs=None, drop_last=True, output="varlen", legs=[])
    run.legs = [
        ParallelLeg(samples, 4, 2, 3, cp_size=2, balance="attention"),
        ParallelLeg(samples, 6, 3, 2, cp_size=2, balance="attention"),
    ]
    check_parallel_run(cache, run, workers=2)


# --- the parts on their own -----------------------------------------------------------------------------


def test_pieces_are_padded_to_the_multiple_inside_the_plan(caches: dict) -> None:
    cache = caches["plain"][0]
    samples = cache.packed(32, pad_multiple=8)
    layout = samples.layout
    for i in range(len(samples)):
        lengths = layout.lengths[layout.starts[i] : layout.starts[i + 1]]
        assert int(np.sum(-(-lengths // 8) * 8)) <= 32
    found = samples.boundaries(np.arange(len(samples)))
    assert np.all(found.lengths % 8 == 0)  # every segment, the rows' padding too
    assert samples.fingerprint()["pad_multiple"] == 8
    assert "pad_multiple" not in cache.packed(32).fingerprint()  # plans without it keep their key


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda c: c.packed(30, pad_multiple=4), "must divide seq_len"),
        (
            lambda c: Loader(c.packed(32, pad_multiple=4), batch_size=2, output="dict", cp_size=4),
            "pad_multiple=8",
        ),
        (lambda c: Loader(c.packed(32), batch_size=2, output="dict", cp_size=2), "pad_multiple=4"),
        (lambda c: Loader(c.sequences(32), batch_size=2, output="dict", cp_size=2), "FixedWindows"),
        (lambda c: Loader(c.packed(32, pad_multiple=4), batch_size=2, cp_size=2), "output='dict'"),
        (lambda c: Loader(c.packed(32), batch_size=2, cp_size=2, cp_rank=2), "cp_rank"),
        (lambda c: Loader(np.zeros((8, 4), dtype=np.int64), batch_size=2, balance="attention"), "boundaries"),
        (lambda c: Loader(c.packed(32), batch_size=2, balance="cost"), "balance"),
    ],
)
def test_what_does_not_fit_is_refused_with_the_fix(caches: dict, make: Any, message: str) -> None:
    with pytest.raises(OptionsError, match=message):
        make(caches["plain"][0])


@st.composite
def rank_inputs(draw: st.DrawFn) -> tuple[np.ndarray, Any, np.ndarray | None, int, int]:
    """A batch as :class:`RankColumns` takes it: rows cut into segments of multiples of ``2 * cp_size``,
    some padding, some ending in a fill, with or without marks and segments taken off."""
    from streampack.samples.boundaries import Boundaries

    cp = draw(st.sampled_from([2, 3, 4]))
    parts, rows = 2 * cp, draw(st.integers(0, 4))
    columns = parts * draw(st.integers(1, 6))
    starts, docs, fills = [], [], []
    for row in range(rows):
        chunks = columns // parts
        cuts = sorted(draw(st.sets(st.integers(1, chunks), max_size=4)) - {chunks})
        bounds = [row * columns + parts * cut for cut in [0, *cuts]] + [(row + 1) * columns]
        for start, stop in pairwise(bounds):
            starts.append(start)
            docs.append(draw(st.integers(-1, 3)))
            fill = draw(st.integers(0, stop - start - 1))
            if fill and docs[-1] >= 0:
                fills.append((stop - fill, stop))
    shape = (rows, columns)
    marks = np.array(draw(st.lists(st.booleans(), min_size=rows * columns, max_size=rows * columns)), bool)
    found = Boundaries(
        shape,
        np.array(starts, dtype=np.int64),
        np.array(docs, dtype=np.int64),
        marks.reshape(shape) if draw(st.booleans()) else None,
        np.array(fills, dtype=np.int64).reshape(-1, 2) if fills else None,
    )
    off = np.array(draw(st.lists(st.booleans(), min_size=len(starts), max_size=len(starts))), dtype=bool)
    dtype = draw(st.sampled_from([np.uint16, np.int32, np.int64]))
    tokens = np.arange(rows * columns, dtype=dtype).reshape(shape) + 1
    return tokens, found, off if draw(st.booleans()) else None, cp, draw(st.integers(0, cp - 1))


def test_the_compiled_rank_loop_fills_what_the_numpy_path_does(monkeypatch: pytest.MonkeyPatch) -> None:
    from streampack.loader import parallel

    if parallel._rank_loop() is None:
        pytest.skip("no compiled loops here (numba missing, or STREAMPACK_COMPILED=0)")

    @generated(150)
    @given(rank_inputs())
    def check(inputs: tuple[np.ndarray, Any, np.ndarray | None, int, int]) -> None:
        compiled = parallel.RankColumns(*inputs)
        with monkeypatch.context() as patch:
            patch.setattr(parallel, "_rank_loop", lambda: None)
            reference = parallel.RankColumns(*inputs)
        for name in ("input_ids", "labels", "shift_labels", "position_ids", "cu_seqlens"):
            mine, theirs = getattr(compiled, name), getattr(reference, name)
            assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, name
            assert np.array_equal(mine, theirs), name
        assert compiled.max_seqlen == reference.max_seqlen

    check()


def test_balance_is_longest_processing_time_first_with_even_counts() -> None:
    assert balanced([9, 1, 1, 9], 2) == [0, 0, 1, 1]
    assert balanced([5, 4, 3, 3, 2, 1], 3) == [0, 1, 2, 2, 1, 0]
    from streampack.loader.parallel import balanced_ranks

    rng = np.random.default_rng(3)
    for _ in range(50):
        costs = rng.integers(0, 1000, size=int(rng.integers(1, 40)))
        world = int(rng.integers(1, 9))
        assert balanced_ranks(costs, world).tolist() == balanced(costs.tolist(), world)


@pytest.mark.parametrize("cp", [2, 4])
def test_a_mixtures_loss_weights_are_split_with_the_tokens(caches: dict, cp: int) -> None:
    """Every key of a mixture's CP rank is its chunks of the whole rows a loader without CP serves of the
    same samples (chunks from the whole batch's ``cu_seqlens``); ``loss_weights`` sit where the rank computes
    each loss, at the token that predicts it (``shift_labels``), so the weighted loss and the token counts
    summed over the CP ranks are those of the whole rows (:func:`streampack.torch.token_losses`)."""
    torch = pytest.importorskip("torch")
    from streampack.order.mixture import Mixture
    from streampack.torch import SourceLosses, targets_counted, token_losses

    cache = caches["sft"][0]

    def loader(cp_size: int, cp_rank: int) -> Loader:
        mix = Mixture(
            {"a": cache.packed(32, pad_multiple=2 * cp), "b": cache.documents(32, pad_multiple=2 * cp)},
            {"a": 0.5, "b": 0.5},
            seed=4,
        )
        weights = {"a": 0.25, "b": 3.0}
        return Loader(
            mix, batch_size=4, output="varlen", cp_size=cp_size, cp_rank=cp_rank, loss_weights=weights
        )

    def tensors(batch: dict) -> dict:
        return {k: torch.from_numpy(np.asarray(v)) for k, v in batch.items() if isinstance(v, np.ndarray)}

    whole = list(islice(iter(loader(1, 0)), 3))
    vocab = cache.vocab_size
    logits = [torch.randn(*full["labels"].shape, vocab) for full in whole]  # a model's, over the whole rows
    weighted, counted = np.zeros(len(whole)), np.zeros(len(whole))
    per_source = SourceLosses(("a", "b"))
    for cp_rank in range(cp):
        for step, (full, part) in enumerate(zip(whole, islice(iter(loader(cp, cp_rank)), 3), strict=True)):
            columns: list[int] = []
            bounds = full["cu_seqlens"].tolist()
            for start, stop in pairwise(bounds):
                chunk = (stop - start) // (2 * cp)
                for k in (cp_rank, 2 * cp - 1 - cp_rank):
                    columns += range(start + k * chunk, start + (k + 1) * chunk)
            for key in ("input_ids", "labels", "position_ids"):
                want = np.asarray(full[key]).reshape(-1)[columns].reshape(len(full[key]), -1)
                assert part[key].dtype == full[key].dtype and np.array_equal(part[key], want), key
            assert np.array_equal(part["source_ids"], full["source_ids"])
            weight_of_row = np.array([0.25, 3.0], dtype=np.float32)[part["source_ids"]][:, None]
            assert np.array_equal(part["loss_weights"], weight_of_row * (part["shift_labels"] != -100))
            mine = tensors(part)
            rank_logits = logits[step].flatten(0, 1)[columns].view(*part["labels"].shape, vocab)
            losses = token_losses(rank_logits, mine["labels"], mine["shift_labels"])
            weighted[step] += float((losses * mine["loss_weights"]).sum())
            counted[step] += int(targets_counted(mine["labels"], mine["shift_labels"]).sum())
            per_source.add(losses, mine["labels"], mine["source_ids"], mine["shift_labels"])
    whole_sources = SourceLosses(("a", "b"))
    for step, full in enumerate(whole):
        rows = tensors(full)
        losses = token_losses(logits[step], rows["labels"])
        assert weighted[step] == pytest.approx(float((losses * rows["loss_weights"]).sum()), rel=1e-5)
        assert counted[step] == int(targets_counted(rows["labels"]).sum())
        whole_sources.add(losses, rows["labels"], rows["source_ids"])
    cp_report, whole_report = per_source.report(), whole_sources.report()
    assert cp_report.keys() == whole_report.keys()
    assert all(cp_report[k] == pytest.approx(whole_report[k], rel=1e-5) for k in whole_report)

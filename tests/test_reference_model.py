"""The real Loader against the reference model (tests/reference_model.py): random runs, token by token.

Hypothesis makes runs of random settings (layouts, lengths, orders, epochs, outputs), with random resumes
that change the batch size, the world size, the sequence length and the exclusions; every rank's every
batch must be what the model says, and every rank must save the same state.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import streampack
from streampack.errors import LoaderStateError, OptionsError
from streampack.loader import Exclusions, Loader
from streampack.loader.audit import audit
from streampack.loader.provenance import which
from streampack.order.mixture import Mixture

from .reference_model import (
    Corpus,
    Exclusion,
    Leg,
    MixLeg,
    MixSpec,
    Model,
    Refused,
    Run,
    Whole,
    Windows,
    _samples,
    record_documents,
)

WORDS = ["data", "token", "cache", "loader", "rank", "shard", "a", "of", "the", "epoch", "ünï", "漢字"]


def _text(rng: random.Random) -> str:
    size = rng.choice([0, 1, 2, 5, 10, 20, 40, 80])
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, size)))


def _write_inputs(root: Path, sft: bool) -> list[str]:
    """Two Parquet files around one JSON Lines file: three work units, three shards."""
    rng = random.Random(7 if sft else 3)

    def record() -> dict[str, str]:
        if sft:
            return {"prompt": _text(rng) or "q", "response": _text(rng)}
        return {"text": _text(rng)}

    paths = []
    for index, kind in enumerate(["parquet", "jsonl", "parquet"]):
        path = root / f"part{index}.{kind}"
        records = [record() for _ in range(rng.randint(15, 30))]
        if kind == "parquet":
            pq.write_table(pa.Table.from_pylist(records), path)
        else:
            with open(path, "w", encoding="utf-8") as file:
                for r in records:
                    file.write(json.dumps(r, ensure_ascii=False) + "\n")
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Corpus]]:
    out = {}
    for name, sft in (("plain", False), ("sft", True)):
        root = tmp_path_factory.mktemp(f"reference-{name}")
        inputs = _write_inputs(root, sft)
        options: dict[str, Any] = {"fields": ["prompt", "response"], "on_bad_record": "skip"} if sft else {}
        streampack.build(inputs, root / "cache", progress=False, **options)
        cache = streampack.open(root / "cache")
        corpus = Corpus.read(cache)
        corpus.records = record_documents(inputs, corpus, options.get("fields", ["text"]))
        out[name] = (cache, corpus)
    return out


def test_the_fixture_caches_have_several_shards_and_what_the_model_needs(caches: dict) -> None:
    for name, (cache, corpus) in caches.items():
        assert cache.num_shards == 3, name
        assert len(corpus.docs) == cache.num_docs > 40
        assert (corpus.marks is not None) == (name == "sft")
        assert max(map(len, corpus.docs)) > 128  # some documents are cut by every too_long policy


# --- random runs ----------------------------------------------------------------------------------------


@st.composite
def runs(draw: st.DrawFn, corpora: dict[str, Corpus]) -> Run:
    name = draw(st.sampled_from(sorted(corpora)))
    corpus = corpora[name]
    output = draw(st.sampled_from(["numpy", "dict", "varlen"]))
    kind = draw(st.sampled_from(["windows", "packed", "documents"]))
    if kind == "windows":
        overlap = 0 if output != "numpy" else draw(st.sampled_from([0, 1]))
        samples: Windows | Whole = Windows(draw(st.sampled_from([8, 16, 32, 64])), overlap)
    else:
        samples = Whole(
            draw(st.sampled_from([16, 32, 64, 128])),
            packed=kind == "packed",
            too_long=draw(st.sampled_from(["split", "truncate", "drop"])),
            no_target=draw(st.sampled_from(["keep", "drop"])),
            pad_id=draw(st.sampled_from([None, 7])),
        )
    n = len(_samples(corpus, samples))
    epochs = draw(st.sampled_from([None, 1, 2, 3]))
    run = Run(
        corpus,
        seed=draw(st.integers(0, 2**64 - 1)),
        shuffle=draw(st.booleans()),
        epochs=epochs,
        drop_last=True if epochs is None else draw(st.booleans()),
        output=output,
        legs=[],
    )
    position_hint = 0
    for index in range(draw(st.integers(1, 4))):
        world = draw(st.sampled_from([1, 2, 3]))
        batch = world * draw(st.integers(1, max(1, min(4, n // (2 * world)))))
        leg_samples = samples
        schedule = None
        if isinstance(samples, Windows) and draw(st.integers(0, 3)) == 0:
            if index == 0:  # a schedule of divisors of the units
                lengths = [n for n in (2, 4, 8, 16, 32) if samples.seq_len % n == 0]
                first = draw(st.sampled_from(lengths))
                change = draw(st.integers(1, 6)) * batch * samples.seq_len
                schedule = ((0, first), (change, samples.seq_len))
            else:  # a resume at a divisor or a multiple
                factor = draw(st.sampled_from([2, 4]))
                longer = draw(st.booleans())
                length = samples.seq_len * factor if longer else max(1, samples.seq_len // factor)
                leg_samples = Windows(length, samples.overlap)
                if not longer:
                    batch = batch * factor
        ga = draw(st.sampled_from([1, 1, 2, 3]))
        exclusions = []
        if draw(st.integers(0, 2)) == 0:
            mode = "mask" if output != "numpy" and draw(st.booleans()) else "skip"
            docs = draw(st.lists(st.integers(0, len(corpus.docs) - 1), max_size=4))
            start = draw(st.integers(-2 * batch, 3 * batch))  # from the leg's position (before it: refused)
            ranges = [(start, start + draw(st.integers(1, 2 * batch)))] if draw(st.booleans()) else []
            first = draw(st.integers(-2, 4))  # trainer steps from the leg's first (before it: refused)
            steps = [(first, first + draw(st.integers(0, 2)))] if draw(st.booleans()) else []
            named = draw(st.lists(st.sampled_from(sorted(corpus.records)), max_size=3))
            exclusions.append(
                Exclusion(0, mode, {0: set(docs)} if docs else {}, ranges, steps, records={0: named})
            )
        leg = Leg(leg_samples, batch, world, ga * draw(st.integers(0, 3)), schedule, exclusions, ga=ga)
        run.legs.append(leg)
        position_hint += leg.batches * batch
    return run


@st.composite
def mixture_runs(draw: st.DrawFn, corpora: dict[str, Corpus]) -> Run:
    """Mixtures of up to three sources of one width, with stages, and resumes that change the weights or
    add a source."""
    output = draw(st.sampled_from(["numpy", "dict", "varlen"]))
    length = draw(st.sampled_from([16, 32]))

    def layout() -> Windows | Whole:
        kind = draw(st.sampled_from(["windows", "packed", "documents"]))
        if kind == "windows":
            return Windows(length)
        return Whole(length, packed=kind == "packed", too_long=draw(st.sampled_from(["split", "truncate"])))

    sources = {
        "web": (corpora["plain"], layout()),
        "chat": (corpora["sft"], layout()),
        "more": (corpora["plain"], layout()),
    }
    block = draw(st.sampled_from([16, 32, 64]))
    stop = draw(st.sampled_from(["never", "first_exhausted"]))
    run = Run(
        corpora["plain"],
        seed=0,
        shuffle=True,
        epochs=None,
        drop_last=True if stop == "never" else draw(st.booleans()),
        output=output,
        legs=[],
        sources=sources,
        mix=MixSpec(draw(st.integers(0, 2**64 - 1)), draw(st.booleans()), block, stop),
    )
    names: tuple[str, ...] = tuple(draw(st.sampled_from([("web",), ("web", "chat"), ("chat", "web")])))
    weights = st.integers(0, 3)

    def stages(names: tuple[str, ...]) -> tuple[tuple[int, dict[str, float]], ...]:
        firsts = sorted(set(draw(st.lists(st.integers(1, 4), max_size=2))))
        out = []
        for position in [0, *(f * block for f in firsts)]:
            w = {n: float(draw(weights)) for n in names}
            if not any(w.values()):
                w[names[0]] = 1.0
            out.append((position, w))
        return tuple(out)

    position_hint = 0
    mixture = MixLeg(names, stages(names))
    for index in range(draw(st.integers(1, 4))):
        if index and draw(st.booleans()):
            if "more" not in names and draw(st.booleans()):
                names = (*names, "more")
            mixture = MixLeg(names, stages(names))
        world = draw(st.sampled_from([1, 2, 3]))
        batch = world * draw(st.integers(1, 4))
        exclusions = []
        if draw(st.integers(0, 2)) == 0:
            mode = "mask" if output != "numpy" and draw(st.booleans()) else "skip"
            source = draw(st.integers(0, len(names) - 1))
            corpus = sources[names[source]][0]
            docs = draw(st.lists(st.integers(0, len(corpus.docs) - 1), max_size=4))
            start = draw(st.integers(0, 3 * batch))
            ranges = [(start, start + draw(st.integers(1, 2 * batch)))] if draw(st.booleans()) else []
            exclusions.append(Exclusion(0, mode, {source: set(docs)} if docs else {}, ranges))
        leg = Leg(sources[names[0]][1], batch, world, draw(st.integers(0, 5)), None, exclusions, mixture)
        run.legs.append(leg)
        position_hint += leg.batches * batch
    return run


def _real_samples(cache: Any, samples: Windows | Whole) -> Any:
    if isinstance(samples, Windows):
        return cache.sequences(samples.seq_len, overlap=samples.overlap)
    make = cache.packed if samples.packed else cache.documents
    return make(
        samples.seq_len, too_long=samples.too_long, no_target=samples.no_target, pad_id=samples.pad_id
    )


def _real_exclusion(entry: Exclusion, names: tuple[str, ...] = ()) -> Exclusions:
    """What the run's Loader is given: documents by index, records by name."""
    named = {source: set(records) for source, records in entry.records.items() if records}
    by_index = entry.documents
    documents: Any = sorted(by_index.get(0, ()))
    records: Any = sorted(named.get(0, ()))
    if names:
        documents = {names[source]: sorted(docs) for source, docs in by_index.items() if docs}
        records = {names[source]: sorted(r) for source, r in named.items()}
    return Exclusions(
        documents=documents,
        records=records,
        positions=entry.ranges,
        steps=entry.steps,
        mode=entry.mode,
        at=entry.at,
    )


def _as_numpy(batch: Any) -> Any:
    """A DataLoader's batch (a tensor, or a dict of tensors and ints) as the Loader's numpy."""
    if isinstance(batch, dict):
        return {key: value if isinstance(value, int) else value.numpy() for key, value in batch.items()}
    return batch.numpy()


def _same(real: Any, expected: Any, where: str) -> None:
    if isinstance(expected, np.ndarray):
        assert isinstance(real, np.ndarray), where
        assert real.shape == expected.shape, f"{where}: shape {real.shape}, model {expected.shape}"
        bad = np.argwhere(real != expected)
        assert not len(bad), f"{where}: {len(bad)} tokens differ, first at {bad[0].tolist()}"
        return
    assert sorted(real) == sorted(expected), f"{where}: keys {sorted(real)}, model {sorted(expected)}"
    for key, value in expected.items():
        got = np.asarray(real[key]).tolist()
        assert got == value, f"{where}: {key} differs:\n real {got}\n model {value}"


def check_run(
    cache: Any, run: Run, plant: bool = False, which_too: bool = False, workers: Sequence[int] | None = None
) -> None:
    """Run ``run`` on the real Loader, leg by leg and rank by rank, against the model; then audit it:
    clean, and (``plant``) not clean once a resume replays or skips a leg. With ``which_too``, ``which``
    must name where every document of one batch a leg of the run serves sits. With ``workers`` (one
    count a leg), each rank reads through a ``streampack.torch.DataLoader`` with that many workers."""
    model = Model(run)
    state: dict[str, Any] | None = None
    states: list[tuple[dict[str, Any], int]] = []  # (state, trainer step) at each resume
    step = 0
    for index, leg in enumerate(run.legs):
        for entry in leg.exclusions:
            entry.at = model.position
            entry.ranges = [
                (max(0, model.position + a), model.position + b)
                for a, b in entry.ranges
                if model.position + b > 0
            ]
            entry.steps = [(max(0, step + a), step + b) for a, b in entry.steps if step + b >= 0]
        try:
            model.start_leg(leg, index, step)
        except Refused:
            with pytest.raises((OptionsError, LoaderStateError)):  # made, resumed, or its first batch
                given = [*model.given, *leg.exclusions]
                next(iter(_loader(cache, run, leg, 0, model, state, given, step=step)))
            return
        saved = []
        for rank in range(leg.world_size):
            loader = _loader(cache, run, leg, rank, model, state, step=step)
            if workers is None:
                served = list(islice(iter(loader), leg.batches))
            else:  # the rank's batches through real DataLoader worker processes, in order
                from streampack.torch import DataLoader

                data = DataLoader(loader, num_workers=workers[index])
                served = [_as_numpy(batch) for batch in islice(iter(data), leg.batches)]
                loader = data  # its state is the batches it handed out
            expected = model.batches(leg, rank)
            assert len(served) == len(expected), (
                f"leg {index} rank {rank}: {len(served)} batches, model {len(expected)}"
            )
            for number, (real, want) in enumerate(zip(served, expected)):
                _same(real, want, f"leg {index} rank {rank} batch {number}")
            saved.append(json.dumps(loader.state_dict(), sort_keys=True))
        assert len(set(saved)) == 1, f"leg {index}: the ranks saved different states"
        if which_too and served:
            _check_which(cache, run, model, leg, state, len(served) // 2)
        if state is not None:
            states.append((state, step))
        state = json.loads(saved[0])
        step += -(-len(served) // leg.ga)
        model.advance(leg)
        assert state["position"] == model.position
    if state is None:
        return
    report = audit(
        state, _audit_data(cache, run), exclude=[_real_exclusion(e, model.names) for e in model.given]
    )
    assert report.clean, report.text()
    served_rows = sum(source.samples for source in report.sources)
    assert served_rows == model.position, (
        f"audit: {served_rows} samples, model {model.position}\n{report.text()}"
    )
    if plant and states and run.legs[-1].batches and state["position"] > states[-1][0]["position"]:
        _plant(cache, run, model, states[-1], state, step)


def _plant(
    cache: Any, run: Run, model: Model, before: tuple[dict[str, Any], int], last: dict[str, Any], step: int
) -> None:
    """A resume from the state before the last leg with the last leg's step (the model got further than
    the data state: a replay), and from the last state with the earlier step (a skip): each found.

    The replay resumes as the leg before the last read (its loader and exclusions), so that it serves what
    the history says that leg trained."""
    earlier = model.given[: len(model.given) - len(run.legs[-1].exclusions)]
    plants = (
        (before[0], step, "twice", run.legs[-2], earlier),
        (last, before[1], "skipped", run.legs[-1], model.given),
    )
    for state, at, kind, leg, exclusions in plants:
        loader = _loader(cache, run, leg, 0, model, state, exclusions, step=at)
        if not list(islice(iter(loader), 1)):  # the run had ended: nothing is trained again
            continue
        report = audit(
            loader.state_dict(),
            _audit_data(cache, run),
            exclude=[_real_exclusion(e, model.names) for e in exclusions],
        )
        assert not report.clean, f"a planted {kind} was not found:\n{report.text()}"
        assert sum(getattr(source, kind) for source in report.sources) > 0, report.text()


def _check_which(cache: Any, run: Run, model: Model, leg: Leg, state: dict | None, step: int) -> None:
    """``which`` of the ``step``-th batch of ``leg`` names every document the model serves there, where it
    sits (rank, row, columns) and which of its tokens."""
    position, rows = model.positions(leg)[step]
    expected = model.placements(leg, position, rows)
    loader = _loader(cache, run, leg, 0, model, None)
    found = which(loader, step, state=state)
    names = model.names or ("data",)
    got = {
        (names.index(p.source), p.doc): [(q.rank, q.row, q.columns, q.tokens) for q in p.placements]
        for p in found
    }
    assert got == expected, f"which at position {position}:\n real {got}\n model {expected}"


def _audit_data(cache: Any, run: Run) -> Any:
    """What ``audit`` is given: the first leg's samples, or the mixture's sources (the last leg's: every
    source the run read)."""
    leg = run.legs[0]
    if leg.mixture is None:
        return _real_samples(cache, leg.samples)
    names = max((leg.mixture.names for leg in run.legs if leg.mixture is not None), key=len)
    return Mixture(
        {n: _real_samples(cache[id(run.sources[n][0])], run.sources[n][1]) for n in names},
        weights={names[0]: 1.0},
    )


def _loader(
    cache: Any,
    run: Run,
    leg: Leg,
    rank: int,
    model: Model,
    state: dict | None,
    given: list | None = None,
    step: int | None = None,
) -> Loader:
    given = model.given if given is None else given
    if leg.mixture is not None:
        spec = run.mix
        assert spec is not None
        mixture = Mixture(
            {n: _real_samples(cache[id(run.sources[n][0])], run.sources[n][1]) for n in leg.mixture.names},
            stages=list(leg.mixture.stages),
            seed=spec.seed,
            shuffle=spec.shuffle,
            block_size=spec.block_size,
            stop=spec.stop,
        )
        names = leg.mixture.names
        loader = Loader(
            mixture,
            batch_size=leg.batch_size,
            drop_last=run.drop_last,
            output=run.output,
            rank=rank,
            world_size=leg.world_size,
            exclude=[_real_exclusion(e, names) for e in given],
        )
    else:
        loader = Loader(
            _real_samples(cache, leg.samples),
            batch_size=leg.batch_size,
            seed=run.seed,
            shuffle=run.shuffle,
            epochs=run.epochs,
            drop_last=run.drop_last,
            output=run.output,
            rank=rank,
            world_size=leg.world_size,
            seq_len_schedule=leg.schedule,
            exclude=[_real_exclusion(e) for e in given],
        )
    if state is not None:
        loader.load_state_dict(state, step=step)
    loader.batches_per_step = leg.ga  # as the trainer adapters set it, after the resume
    return loader


def test_random_runs_serve_what_the_model_says(caches: dict) -> None:
    corpora = {name: corpus for name, (_, corpus) in caches.items()}

    @settings(
        max_examples=300,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(runs(corpora))
    def check(run: Run) -> None:
        name = next(n for n, c in corpora.items() if c is run.corpus)
        check_run(caches[name][0], run, plant=run.seed % 4 == 0, which_too=run.seed % 3 == 1)

    check()


def test_random_mixture_runs_serve_what_the_model_says(caches: dict) -> None:
    corpora = {name: corpus for name, (_, corpus) in caches.items()}
    by_corpus = {id(corpus): cache for cache, corpus in caches.values()}

    @settings(
        max_examples=150,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(mixture_runs(corpora))
    def check(run: Run) -> None:
        spec = run.mix
        assert spec is not None
        check_run(
            {id(c): by_corpus[id(c)] for c, _ in run.sources.values()},
            run,
            plant=spec.seed % 4 == 0,
            which_too=spec.seed % 3 == 1,
        )

    check()


# Runs read through real DataLoader worker processes (a few: each starts processes), with other worker
# counts at each resume. (A leg's workers, its world size and the run's settings.)
WORKER_RUNS = [
    ("plain", "dict", [(Windows(16), 4, 2, 3, 2), (Windows(8), 8, 1, 4, 2), (Windows(16), 2, 1, 2, 0)]),
    ("sft", "numpy", [(Whole(32, packed=True, too_long="split"), 6, 3, 4, 2), (None, 3, 1, 5, 1)]),
    ("plain", "varlen", [(Whole(64, packed=False, too_long="truncate"), 2, 1, 5, 1), (None, 4, 2, 3, 2)]),
]


@pytest.mark.parametrize(("name", "output", "legs"), WORKER_RUNS)
def test_dataloader_workers_serve_what_the_model_says(
    caches: dict, name: str, output: str, legs: list
) -> None:
    """Each rank's batches through ``streampack.torch.DataLoader`` workers (0-2, another count at every
    resume, with an exclusion put in force at the first resume) are the model's, in order."""
    pytest.importorskip("torch")
    cache, corpus = caches[name]
    run = Run(corpus, seed=11, shuffle=True, epochs=None, drop_last=True, output=output, legs=[])
    samples = legs[0][0]
    for index, (made, batch, world, batches, _) in enumerate(legs):
        mode = "mask" if output != "numpy" else "skip"
        exclusions = [Exclusion(0, mode, {0: {1, 2, 3}}, [(2, 5)])] if index == 1 else []
        run.legs.append(Leg(made or samples, batch, world, batches, None, exclusions))
    check_run(cache, run, workers=[leg[4] for leg in legs])

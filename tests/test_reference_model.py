"""The real Loader against the reference model (tests/reference_model.py): random runs, token by token.

Hypothesis makes runs of random settings (layouts, lengths, orders, epochs, outputs), with random resumes
that change the batch size, the world size, the sequence length and the exclusions; every rank's every
batch must be what the model says, and every rank must save the same state.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from collections.abc import Sequence
from itertools import islice
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import streampack
from streampack.errors import BuildStalledError, LoaderStateError, OptionsError
from streampack.follow import Follow
from streampack.format.ledger import LedgerEntry
from streampack.format.manifest import ShardTable
from streampack.format.names import mask_path, offsets_path, shard_name, tokens_path, with_checksum
from streampack.loader import Exclusions, Loader
from streampack.order.mixture import Mixture
from streampack.runs.audit import audit
from streampack.runs.provenance import which
from streampack.store import encode_json
from streampack.store.files import load_manifest

from .reference_model import (
    Corpus,
    Exclusion,
    FimSpec,
    FollowLeg,
    FollowMixModel,
    FollowMixRun,
    FollowModel,
    FollowRun,
    FollowSpec,
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


def _write_inputs(root: Path, sft: bool, kinds: Sequence[str] = ("parquet", "jsonl", "parquet")) -> list[str]:
    """Two Parquet files around one JSON Lines file (or files of ``kinds``): a work unit, a shard each."""
    rng = random.Random(7 if sft else 3)

    def record() -> dict[str, str]:
        if sft:
            return {"prompt": _text(rng) or "q", "response": _text(rng)}
        return {"text": _text(rng)}

    paths = []
    for index, kind in enumerate(kinds):
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


def generated(count: int) -> Any:
    """Hypothesis settings for ``count`` generated runs: the same runs each time, however long each takes."""
    return settings(
        max_examples=count,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


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
        leg.loss_weights = draw(loss_weights(names)) if output != "numpy" else None
        run.legs.append(leg)
        position_hint += leg.batches * batch
    return run


def _real_samples(cache: Any, samples: Windows | Whole, fim: FimSpec | None = None) -> Any:
    if isinstance(samples, Windows):
        real = cache.sequences(samples.seq_len, overlap=samples.overlap)
    else:
        make = cache.packed if samples.packed else cache.documents
        real = make(
            samples.seq_len, too_long=samples.too_long, no_target=samples.no_target, pad_id=samples.pad_id
        )
    return real if fim is None else _real_fim(real, fim)


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
        return _real_samples(cache, leg.samples, run.fim)
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
            loss_weights=leg.loss_weights,
            batch_size=leg.batch_size,
            drop_last=run.drop_last,
            output=run.output,
            rank=rank,
            world_size=leg.world_size,
            exclude=[_real_exclusion(e, names) for e in given],
        )
    else:
        loader = Loader(
            _real_samples(cache, leg.samples, run.fim),
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


@pytest.mark.slow
def test_random_runs_serve_what_the_model_says(caches: dict) -> None:
    corpora = {name: corpus for name, (_, corpus) in caches.items()}

    @generated(300)
    @given(runs(corpora))
    def check(run: Run) -> None:
        name = next(n for n, c in corpora.items() if c is run.corpus)
        check_run(caches[name][0], run, plant=run.seed % 4 == 0, which_too=run.seed % 3 == 1)

    check()


@pytest.mark.slow
def test_random_mixture_runs_serve_what_the_model_says(caches: dict) -> None:
    corpora = {name: corpus for name, (_, corpus) in caches.items()}
    by_corpus = {id(corpus): cache for cache, corpus in caches.values()}

    @generated(150)
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


# --- follow: training while the build runs --------------------------------------------------------------


class StagedBuild:
    """A finished build replayed into ``out`` as its builder writes it: the incomplete manifest first; then
    commit by commit, each unit's shard files growing (appended to, never rewritten) to hold the documents
    it commits, and the next one (written, not committed yet), before its ledger entry says so; the finished
    build's entry once the unit is done; the complete manifest last. Deterministic, in this process: a
    follower reads it between two commits exactly as it reads a real build there."""

    def __init__(self, finished: Path, out: Path) -> None:
        manifest = load_manifest(finished)
        self.finished, self.out, self.mask = finished, out, manifest.loss_mask
        self.units = list(manifest.units)
        self.docs = [int(n) for n in manifest.table.num_docs]
        self.progress = [0] * len(self.units)
        self.done = [False] * len(self.units)
        (out / "shards").mkdir(parents=True)
        (out / "ledger").mkdir()
        running = dataclasses.replace(manifest, complete=False, table=ShardTable.empty())
        _put(out / "manifest.json", encode_json(with_checksum(running.to_json())))
        self.itemsize = np.dtype(manifest.dtype).itemsize

    @property
    def complete(self) -> bool:
        return all(self.done)

    def commit(self, unit: int, docs: int) -> None:
        """Unit ``unit`` commits its first ``docs`` documents (no fewer than it has)."""
        docs = min(max(docs, self.progress[unit]), self.docs[unit])
        if self.done[unit] or (docs == self.progress[unit] and docs < self.docs[unit]):
            return
        name = shard_name(unit)
        ends = np.fromfile(offsets_path(self.finished, name), dtype="<u8")
        written = min(docs + 1, len(ends))
        self._grow(offsets_path, name, written * 8)
        tokens = int(ends[written - 1]) if written else 0
        self._grow(tokens_path, name, tokens * self.itemsize)
        if self.mask:
            self._grow(mask_path, name, tokens)
        entry = self.out / "ledger" / f"{name}.json"
        if docs == self.docs[unit]:
            _put(entry, (self.finished / "ledger" / f"{name}.json").read_bytes())
            self.done[unit] = True
        else:
            tokens = int(ends[docs - 1]) if docs else 0
            made = LedgerEntry(self.units[unit], records=docs, docs=docs, tokens=tokens)
            _put(entry, encode_json(with_checksum(msgspec.structs.asdict(made))))
        self.progress[unit] = docs

    def mover(self, data: st.DataObject) -> Any:
        """``move_on(moves)``: the build's next ``moves`` commits as ``data`` draws them, each of a few
        documents by the first unit not done or one after it (units run in parallel); ``"wait"``: one by
        the first unit not done (what a follower that waits needs); or (``"end"``, or once every unit is
        done) its end."""

        def move_on(moves: int | str) -> None:
            if moves == "wait" and not self.complete:
                unit = self.done.index(False)
                self.commit(unit, self.progress[unit] + data.draw(st.integers(1, 16)))
            for _ in range(moves if isinstance(moves, int) else 0):
                if self.complete:
                    break
                after = data.draw(st.sampled_from([0, 0, 1, 2]))
                unit = min(self.done.index(False) + after, len(self.units) - 1)
                self.commit(unit, self.progress[unit] + data.draw(st.integers(1, 8)))
            if moves == "end" or self.complete:
                self.finish()

        return move_on

    def finish(self) -> None:
        """Every unit done, then the complete manifest."""
        for unit, docs in enumerate(self.docs):
            self.commit(unit, docs)
        _put(self.out / "manifest.json", (self.finished / "manifest.json").read_bytes())

    def _grow(self, where: Any, name: str, size: int) -> None:
        source, target = where(self.finished, name), where(self.out, name)
        have = target.stat().st_size if target.exists() else 0
        if size > have:
            with open(source, "rb") as file:
                file.seek(have)
                data = file.read(size - have)
            with open(target, "ab") as file:
                file.write(data)


def _put(path: Path, data: bytes) -> None:
    """Replace ``path`` atomically (readers see the old file or the new one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@st.composite
def follow_runs(draw: st.DrawFn, corpora: dict[str, tuple[Corpus, tuple[int, ...]]]) -> FollowRun:
    """Follows of every layout over a build of six units, with resumes that change the batch size, the
    world size and ``then``."""
    name = draw(st.sampled_from(sorted(corpora)))
    corpus, unit_docs = corpora[name]
    output = draw(st.sampled_from(["numpy", "dict", "varlen"]))
    kind = draw(st.sampled_from(["windows", "packed", "documents"]))
    if kind == "windows":
        overlap = 0 if output != "numpy" else draw(st.sampled_from([0, 1]))
        samples: Windows | Whole = Windows(draw(st.sampled_from([8, 16, 32])), overlap)
        first = draw(st.integers(1, 24))
    else:
        samples = Whole(
            draw(st.sampled_from([16, 32, 64])),
            packed=kind == "packed",
            too_long=draw(st.sampled_from(["split", "truncate", "drop"])),
            no_target=draw(st.sampled_from(["keep", "drop"])),
            pad_id=draw(st.sampled_from([None, 7])),
        )
        first = draw(st.integers(1, 4))
    largest = first * 2 ** draw(st.integers(0, 2)) + draw(st.integers(0, first))
    spec = FollowSpec(samples, draw(st.integers(0, 2**64 - 1)), first, largest)
    run = FollowRun(corpus, unit_docs, spec, output, drop_last=draw(st.booleans()), legs=[])
    for _ in range(draw(st.integers(1, 4))):
        world = draw(st.sampled_from([1, 2, 3]))
        batch = world * draw(st.integers(1, 3))
        then = draw(st.sampled_from(["end", "epochs"]))
        run.legs.append(FollowLeg(batch, world, draw(st.integers(0, 8)), then))
    return run


def _follow(path: Path, run: FollowRun, leg: FollowLeg, rank: int, timeout: float | None = None) -> Follow:
    """The real Follow of a leg's rank (by default, a build that stalls is given up on quickly)."""
    samples = run.spec.samples
    if isinstance(samples, Windows):
        layout: dict[str, Any] = {"seq_len": samples.seq_len, "overlap": samples.overlap}
    else:
        layout = {"layout": "packed" if samples.packed else "documents", "seq_len": samples.seq_len}
        layout.update(too_long=samples.too_long, no_target=samples.no_target, pad_id=samples.pad_id)
    return Follow(
        path,
        batch_size=leg.batch_size,
        world_size=leg.world_size,
        rank=rank,
        seed=run.spec.seed,
        drop_last=run.drop_last,
        output=run.output,
        then=leg.then,
        first_era=run.spec.first_era,
        largest_era=run.spec.largest_era,
        timeout=timeout or STALL_SECONDS,
        poll=STALL_SECONDS / 5,
        **layout,
    )


STALL_SECONDS = 0.04  # a Follow waits this long for a build that commits nothing before it gives up


def check_follow_run(finished: Path, out: Path, run: FollowRun, data: st.DataObject) -> None:
    """Run ``run`` on real Follows of a build ``data`` replays (:class:`StagedBuild`) against the model:
    every rank's every batch is the model's, served as soon as the model says the build holds it (a batch
    the model says waits stalls: ``BuildStalledError``); every rank saves the same state; ``which`` names
    where each document of a batch sits (some runs); the audit of the last state is clean, and finds a
    planted replay and skip. The build moves on between batches as ``data`` draws, and whenever the model says
    the next batch waits for it."""
    build = StagedBuild(finished, out)
    move_on = build.mover(data)
    move_on(data.draw(st.sampled_from([0, 1, 2, 4, "end"])))  # "end": a Follow of a finished build
    model = FollowModel(run)
    state: dict[str, Any] | None = None
    states: list[tuple[dict[str, Any], int]] = []  # (state, trainer step) at each resume
    step = 0
    for index, leg in enumerate(run.legs):
        try:
            model.start_leg(leg, build.progress)
        except Refused:
            with pytest.raises(OptionsError):  # made, or its first batch
                follow = _follow(out, run, leg, 0)
                if state is not None:
                    follow.load_state_dict(state)
                next(iter(follow))
            return
        follows = [_follow(out, run, leg, rank) for rank in range(leg.world_size)]
        if state is not None:
            for follow in follows:
                follow.load_state_dict(state)
        batches = [iter(follow) for follow in follows]
        stalled = False  # once a leg at most: a stall takes STALL_SECONDS
        served: list[tuple[int, int]] = []  # (position, rows) of each global batch of the leg
        for number in range(leg.batches):
            where = f"leg {index} batch {number} (position {model.position}, build {build.progress})"
            move_on(data.draw(st.sampled_from([0] * 9 + [1, 1, 1, 2, 2, 3, "end"])))
            try:
                rows = model.next_rows(leg, build.progress)
                while rows is None:  # it waits for the build
                    if not stalled and data.draw(st.booleans()):
                        with pytest.raises(BuildStalledError):
                            next(batches[0])
                        batches[0] = iter(follows[0])  # the same Follow goes on once the build does
                        stalled = True
                    move_on("wait")
                    rows = model.next_rows(leg, build.progress)
            except Refused:
                with pytest.raises(OptionsError):
                    next(batches[0])
                return
            if rows == 0:
                assert all(next(batch, None) is None for batch in batches), f"{where}: the run goes on"
                break
            for rank, batch in enumerate(batches):
                _same(next(batch), model.batch(leg, rows, rank), f"{where} rank {rank}")
            served.append((model.position, rows))
            model.position += rows
        if served and run.spec.seed % 3 == 1:  # which names where each document of a batch sits
            number = len(served) // 2
            found = which(_follow(out, run, leg, 0), number, state=state)
            got = {(0, p.doc): [(q.rank, q.row, q.columns, q.tokens) for q in p.placements] for p in found}
            assert got == model.placements(leg, *served[number]), f"which of leg {index} batch {number}"
        saved = {json.dumps(follow.state_dict(), sort_keys=True) for follow in follows}
        assert len(saved) == 1, f"leg {index}: the ranks saved different states"
        if state is not None:
            states.append((state, step))
        state = json.loads(saved.pop())
        step += (state["position"] - (states[-1][0]["position"] if states else 0)) // leg.batch_size
        assert state["position"] == model.position
    assert state is not None
    # The audit reads the build from its path (as `streampack audit` does), or through a Follow of it.
    report = audit(state, out if run.spec.seed % 2 else follows[0])
    assert report.clean, report.text()
    assert sum(source.samples for source in report.sources) == model.position, report.text()
    if states and state["position"] > states[-1][0]["position"]:
        build.finish()  # the planted resumes below read their batch at once
        _plant_follow(out, run, states[-1], (state, step))


def _plant_follow(
    out: Path, run: FollowRun, before: tuple[dict[str, Any], int], last: tuple[dict[str, Any], int]
) -> None:
    """A resume from the state before the last leg at the last leg's step (a replay), and from the last
    state at the earlier step (a skip): the audit finds each (as :func:`_plant` for a Loader)."""
    plants = ((before[0], last[1], "twice", run.legs[-2]), (last[0], before[1], "skipped", run.legs[-1]))
    for state, step, kind, leg in plants:
        follow = _follow(out, run, leg, 0)
        try:
            follow.load_state_dict(state, step=step)
            if next(iter(follow), None) is None:  # the run had ended: nothing is trained again
                continue
        except OptionsError:  # drop_last=False: this batch size leaves a rank no row at the end from here
            continue
        report = audit(follow.state_dict(), out)
        assert not report.clean, f"a planted {kind} was not found:\n{report.text()}"
        assert sum(getattr(source, kind) for source in report.sources) > 0, report.text()


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Corpus, tuple[int, ...]]]:
    """Finished builds of six units each, plain and SFT, which :class:`StagedBuild` replays: each with its
    corpus and its units' documents."""
    out = {}
    for name, sft in (("plain", False), ("sft", True)):
        root = tmp_path_factory.mktemp(f"follow-{name}")
        inputs = _write_inputs(root, sft, ["jsonl", "parquet"] * 3)
        options: dict[str, Any] = {"fields": ["prompt", "response"], "on_bad_record": "skip"} if sft else {}
        streampack.build(inputs, root / "cache", progress=False, **options)
        cache = streampack.open(root / "cache")
        out[name] = (root / "cache", Corpus.read(cache), tuple(int(n) for n in cache.manifest.table.num_docs))
    return out


@pytest.mark.slow
def test_random_follow_runs_serve_what_the_model_says(
    builds: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    corpora = {name: (corpus, units) for name, (_, corpus, units) in builds.items()}
    root = tmp_path_factory.mktemp("follow")
    runs_made = iter(range(10**6))

    @generated(150)
    @given(follow_runs(corpora), st.data())
    def check(run: FollowRun, data: st.DataObject) -> None:
        name = next(n for n, (c, _) in corpora.items() if c is run.corpus)
        out = root / str(next(runs_made))
        try:
            check_follow_run(builds[name][0], out, run, data)
        finally:
            shutil.rmtree(out, ignore_errors=True)

    check()


@st.composite
def follow_mixture_runs(draw: st.DrawFn, builds: dict[str, tuple[Path, Corpus, tuple[int, ...]]]) -> Any:
    """A finished cache and a followed build mixed by stages, resumed with other batch and world sizes,
    other stages and mask exclusions."""
    web_name, fresh_name = draw(st.sampled_from([("plain", "sft"), ("sft", "plain")]))
    length = draw(st.sampled_from([16, 32]))
    output = draw(st.sampled_from(["numpy", "dict", "varlen"]))

    def layout() -> Windows | Whole:
        kind = draw(st.sampled_from(["windows", "packed", "documents"]))
        if kind == "windows":
            return Windows(length)
        return Whole(length, packed=kind == "packed", too_long=draw(st.sampled_from(["split", "truncate"])))

    _, fresh_corpus, unit_docs = builds[fresh_name]
    first = draw(st.integers(1, 6))
    spec = FollowSpec(layout(), draw(st.integers(0, 2**64 - 1)), first, first * 2 ** draw(st.integers(0, 3)))
    fresh = FollowRun(fresh_corpus, unit_docs, spec, "numpy", drop_last=True, legs=[])
    block = draw(st.sampled_from([4, 8, 16]))

    def stages() -> tuple[tuple[int, dict[str, float]], ...]:
        out = []
        for position in [0, *sorted(set(draw(st.lists(st.integers(1, 6), max_size=2))))]:
            weights = {"web": float(draw(st.integers(0, 3))), "fresh": float(draw(st.integers(0, 3)))}
            out.append((position * block, weights if any(weights.values()) else {"fresh": 1.0}))
        return tuple(out)

    mix = MixSpec(draw(st.integers(0, 2**64 - 1)), draw(st.booleans()), block, "never")
    run = FollowMixRun((builds[web_name][1], layout()), fresh, stages(), mix, output, legs=[])
    for index in range(draw(st.integers(1, 3))):
        world = draw(st.sampled_from([1, 2, 3]))
        batch = world * draw(st.integers(1, 3))
        exclusions = []
        if output != "numpy" and draw(st.integers(0, 2)) == 0:  # mask mode: skip mode is refused
            source = draw(st.integers(0, 1))
            corpus = run.web[0] if source == 0 else fresh_corpus
            docs = draw(st.lists(st.integers(0, len(corpus.docs) - 1), max_size=6))
            start = draw(st.integers(0, 3 * batch))  # from the leg's position
            ranges = [(start, start + draw(st.integers(1, 2 * batch)))] if draw(st.booleans()) else []
            exclusions.append(Exclusion(0, "mask", {source: set(docs)} if docs else {}, ranges))
        changed = stages() if index and draw(st.booleans()) else None  # new weights at the resume
        run.legs.append(
            FollowLeg(batch, world, draw(st.integers(0, 10)), exclusions=exclusions, stages=changed)
        )
    return run, web_name, fresh_name


def check_follow_mixture_run(
    web: Path, finished: Path, out: Path, run: FollowMixRun, data: st.DataObject
) -> None:
    """Run ``run`` on real Loaders of a Mixture of the finished cache ``web`` and a Follow of a build
    ``data`` replays into ``out`` against the model, as :func:`check_follow_run` does, with the mask
    exclusions its legs add; then audit it."""
    build = StagedBuild(finished, out)
    move_on = build.mover(data)
    move_on(data.draw(st.sampled_from([0, 1, 2, 4, "end"])))
    model = FollowMixModel(run)
    web_samples = _real_samples(streampack.open(web), run.web[1])
    follow_leg = FollowLeg(1, 1, 0)  # the Follow given to the mixture: one sample is a global batch

    def mixture(stages: Any) -> Mixture:
        fresh = _follow(out, run.fresh, follow_leg, 0)
        spec = run.mix
        settings = {"seed": spec.seed, "shuffle": spec.shuffle, "block_size": spec.block_size}
        return Mixture({"web": web_samples, "fresh": fresh}, **stages, **settings)  # type: ignore[arg-type]

    state: dict[str, Any] | None = None
    stages = run.stages
    for index, leg in enumerate(run.legs):
        for entry in leg.exclusions:
            entry.at = model.position
            entry.ranges = [(model.position + a, model.position + b) for a, b in entry.ranges]
        model.start_leg(leg, build.progress)
        exclude = [_real_exclusion(entry, model.NAMES) for entry in model.masks]
        stages = leg.stages or stages
        loaders = []
        for rank in range(leg.world_size):
            made = mixture({"stages": list(stages)})
            sizes = {"batch_size": leg.batch_size, "rank": rank, "world_size": leg.world_size}
            loader = Loader(made, **sizes, output=run.output, exclude=exclude)
            if state is not None:
                loader.load_state_dict(state)
            loaders.append(loader)
        batches = [iter(loader) for loader in loaders]
        stalled = False
        for number in range(leg.batches):
            where = f"leg {index} batch {number} (position {model.position}, build {build.progress})"
            move_on(data.draw(st.sampled_from([0] * 9 + [1, 1, 1, 2, 2, 3, "end"])))
            rows = model.next_rows(leg, build.progress)
            while rows is None:  # it waits for the build
                if not stalled and data.draw(st.booleans()):
                    with pytest.raises(BuildStalledError):
                        next(batches[0])
                    batches[0] = iter(loaders[0])
                    stalled = True
                move_on("wait")
                rows = model.next_rows(leg, build.progress)
            for rank, batch in enumerate(batches):
                _same(next(batch), model.batch(leg, rows, rank), f"{where} rank {rank}")
            model.position += rows
        saved = {json.dumps(loader.state_dict(), sort_keys=True) for loader in loaders}
        assert len(saved) == 1, f"leg {index}: the ranks saved different states"
        state = json.loads(saved.pop())
        assert state["position"] == model.position
    assert state is not None
    report = audit(state, mixture({"weights": {"web": 1.0}}), exclude=exclude)
    assert report.clean, report.text()
    assert sum(source.samples for source in report.sources) == model.position, report.text()


@pytest.mark.slow
def test_random_follow_mixture_runs_serve_what_the_model_says(
    builds: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp("follow-mixture")
    runs_made = iter(range(10**6))

    @generated(50)
    @given(follow_mixture_runs(builds), st.data())
    def check(made: Any, data: st.DataObject) -> None:
        run, web, fresh = made
        out = root / str(next(runs_made))
        try:
            check_follow_mixture_run(builds[web][0], builds[fresh][0], out, run, data)
        finally:
            shutil.rmtree(out, ignore_errors=True)

    check()


@pytest.mark.slow
def test_a_follow_of_a_real_running_build_serves_what_the_model_says(
    tmp_path: Path, bpe_tokenizer: Path
) -> None:
    """A real ``streampack build``, held once its first unit has committed a few eras, followed by two
    ranks; resumed while it is held over three ranks with another batch size, then let go and followed
    to the end: every batch is the model's, computed from the finished cache."""
    from tests.test_follow import corpus, follow_args, release
    from tests.test_follow_layouts import hold_at
    from tests.test_resume import start_build

    out = tmp_path / "c"
    proc = start_build(follow_args(corpus(tmp_path, 2500), out, bpe_tokenizer), out)
    hold_at(proc, out, 40)
    spec = FollowSpec(Windows(48, overlap=1), seed=9, first_era=16, largest_era=256)
    legs = [FollowLeg(8, 2, 5), FollowLeg(12, 3, 10**6, then="end")]
    run = FollowRun(Corpus((), None, None), (), spec, "numpy", drop_last=True, legs=legs)
    served: list[list[tuple[np.ndarray, ...]]] = []  # per leg, per batch, per rank
    state: dict[str, Any] | None = None
    try:
        for index, leg in enumerate(legs):
            follows = [_follow(out, run, leg, rank, timeout=60) for rank in range(leg.world_size)]
            for follow in follows:
                if state is not None:
                    follow.load_state_dict(state)
            assert proc.poll() is None, "the build ended before the resume"
            if index:
                release(proc)
            served.append(list(islice(zip(*follows, strict=True), leg.batches)))
            state = follows[0].state_dict()
    finally:
        release(proc)
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr.decode()

    finished = streampack.open(out)
    run.corpus = Corpus.read(finished)
    run.unit_docs = tuple(int(n) for n in finished.manifest.table.num_docs)
    model = FollowModel(run)
    for index, leg in enumerate(legs):
        model.start_leg(leg, run.unit_docs)
        for number, batches in enumerate(served[index]):
            rows = model.next_rows(leg, run.unit_docs)
            assert rows, f"leg {index} batch {number}: the model's run has ended"
            for rank, batch in enumerate(batches):
                _same(batch, model.batch(leg, rows, rank), f"leg {index} batch {number} rank {rank}")
            model.position += rows
        assert index == 0 or model.next_rows(leg, run.unit_docs) == 0, "the run ended early"
    assert state is not None and state["position"] == model.position


def test_dataloader_workers_follow_a_build_as_the_model_says(builds: dict, tmp_path: Path) -> None:
    """Two ranks, each through ``streampack.torch.DataLoader`` workers (another count at each resume),
    follow a build that a thread commits a few documents at a time while they wait for it: every batch is
    the model's, whenever each worker read the ledger."""
    pytest.importorskip("torch")
    import threading
    import time

    from streampack.torch import DataLoader

    finished, corpus, units = builds["sft"]
    build = StagedBuild(finished, tmp_path / "c")
    spec = FollowSpec(Whole(32, packed=True, too_long="split"), seed=5, first_era=2, largest_era=16)
    legs = [FollowLeg(4, 2, 6), FollowLeg(6, 2, 4), FollowLeg(2, 1, 10**6, then="end")]
    run = FollowRun(corpus, units, spec, "varlen", drop_last=True, legs=legs)
    rng = random.Random(0)

    def commits() -> None:
        while not build.complete:
            unit = min(build.done.index(False) + rng.choice([0, 0, 1]), len(units) - 1)
            build.commit(unit, build.progress[unit] + rng.randint(1, 3))
            time.sleep(0.02)
        build.finish()

    thread = threading.Thread(target=commits)
    served: list[list[tuple[Any, ...]]] = []  # per leg, per batch, per rank
    state: dict[str, Any] | None = None
    try:
        for leg, workers in zip(legs, [2, 1, 0], strict=True):
            ranks = []
            for rank in range(leg.world_size):
                follow = _follow(build.out, run, leg, rank, timeout=60)
                if state is not None:
                    follow.load_state_dict(state)
                ranks.append(DataLoader(follow, num_workers=workers))
            steps = zip(*(iter(data) for data in ranks), strict=True)  # workers start
            if not thread.is_alive() and not build.complete:
                thread.start()  # the build moves on while the first workers wait for it
            served.append([tuple(map(_as_numpy, step)) for step in islice(steps, leg.batches)])
            state = ranks[0].state_dict()
    finally:
        if thread.is_alive():
            thread.join()
    model = FollowModel(run)
    for index, leg in enumerate(legs):
        model.start_leg(leg, units)
        for number, batches in enumerate(served[index]):
            rows = model.next_rows(leg, units)
            assert rows, f"leg {index} batch {number}: the model's run has ended"
            for rank, batch in enumerate(batches):
                _same(batch, model.batch(leg, rows, rank), f"leg {index} batch {number} rank {rank}")
            model.position += rows
    assert model.next_rows(legs[-1], units) == 0 and state is not None and state["position"] == model.position


# --- sources of a mixture's dict batches (per-domain loss) ------------------------------------------------


def loss_weights(names: Sequence[str]) -> Any:
    """No loss weights, or weights (exact in float32) for some of ``names``: each leg of a mixture run draws
    its own, so resumes change them (they are not in the state)."""
    weight = st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.25])
    return st.none() | st.dictionaries(st.sampled_from(list(names)), weight, max_size=len(names))


def test_dataloader_workers_serve_a_mixtures_sources_as_the_model_says(caches: dict) -> None:
    """A mixture's ``source_ids`` and ``loss_weights`` through real DataLoader workers (2, then 1 at a resume
    that adds a source and changes the weights) are the model's, in order."""
    pytest.importorskip("torch")
    plain, sft = caches["plain"][1], caches["sft"][1]
    sources = {"web": (plain, Windows(16)), "chat": (sft, Windows(16)), "more": (plain, Windows(16))}
    run = Run(plain, 0, True, None, True, "dict", [], sources, MixSpec(5, True, 16, "never"))
    first = MixLeg(("web", "chat"), ((0, {"web": 1.0, "chat": 1.0}),))
    second = MixLeg(("web", "chat", "more"), ((0, {"web": 1.0, "chat": 2.0, "more": 1.0}),))
    run.legs = [
        Leg(Windows(16), 4, 2, 3, mixture=first, loss_weights={"chat": 2.0}),
        Leg(Windows(16), 6, 1, 4, mixture=second, loss_weights={"web": 0.5, "more": 0.0}),
    ]
    check_run({id(c): caches[n][0] for n, (_, c) in caches.items()}, run, workers=[2, 1])


# --- fill-in-the-middle for code ------------------------------------------------------------------------


def _real_fim(samples: Any, fim: FimSpec) -> Any:
    return samples.fim(
        rate=fim.rate, spm_rate=fim.spm_rate, seed=fim.seed, min_length=fim.min_length, sentinels=fim.ids
    )


@st.composite
def fim_runs(draw: st.DrawFn, corpora: dict[str, Corpus]) -> Run:
    """The runs of :func:`runs` at one length (FIM decides per sample: no schedule, no other seq_len),
    their samples FIM'd."""
    run = draw(runs(corpora))
    first = run.legs[0].samples
    for leg in run.legs:
        leg.samples, leg.schedule = first, None
    run.fim = FimSpec(
        rate=draw(st.sampled_from([0.0, 0.5, 1.0])),
        spm_rate=draw(st.sampled_from([0.0, 0.5, 1.0])),
        seed=draw(st.integers(0, 2**64 - 1)),
        min_length=draw(st.sampled_from([4, 5, 8, 16])),
        ids=(1, 2, 3),  # bytes the texts do not hold
    )
    return run


@pytest.mark.slow
def test_random_fim_runs_serve_what_the_model_says(caches: dict) -> None:
    """Windows and packed or whole documents, plain and SFT, numpy and dict outputs, resumes at other
    batch and world sizes with exclusions: every FIM'd token, label and position is the model's."""
    corpora = {name: corpus for name, (_, corpus) in caches.items()}

    @generated(60)
    @given(fim_runs(corpora))
    def check(run: Run) -> None:
        name = next(n for n, c in corpora.items() if c is run.corpus)
        check_run(caches[name][0], run, plant=run.seed % 4 == 0)

    check()


def test_fim_runs_through_dataloader_workers_serve_what_the_model_says(caches: dict) -> None:
    pytest.importorskip("torch")
    cache, corpus = caches["sft"]
    fim = FimSpec(rate=0.7, spm_rate=0.5, seed=5, min_length=6, ids=(1, 2, 3))
    run = Run(corpus, seed=3, shuffle=True, epochs=None, drop_last=True, output="dict", legs=[], fim=fim)
    samples = Whole(32, packed=True, too_long="split")
    run.legs = [Leg(samples, 4, 2, 3, None), Leg(samples, 6, 1, 3, None)]
    check_run(cache, run, workers=[2, 0])


def test_the_fim_model_moves_tokens_of_long_segments_only(caches: dict) -> None:
    """The model's rule does what it says on a row it can be read from: a FIM'd segment holds the three
    sentinels once each, its document's tokens less three, and its EOS last."""
    _, corpus = caches["plain"]
    spec = FimSpec(rate=1.0, spm_rate=0.5, seed=1, min_length=4, ids=(1, 2, 3))
    model = Model(Run(corpus, 0, False, None, True, "numpy", [Leg(Windows(64), 1, 1, 1)], fim=spec))
    rows, _ = model.rows(model.run.legs[0], 0, range(0, 20))
    moved = 0
    for row in rows:
        for doc, start, count, first, _, _ in row.segments:
            got = row.tokens[start : start + count]
            plain = list(corpus.docs[doc][first : first + count])
            ends = first + count == len(corpus.docs[doc])
            if count - ends < spec.min_length:
                assert got == plain
                continue
            moved += 1
            assert sorted(t for t in got if t in spec.ids) == [1, 2, 3]
            assert sorted(t for t in got if t not in spec.ids) == sorted(
                plain[: count - ends - 3] + plain[count - ends :]
            )
            assert got[0] == 1 and (not ends or got[-1] == corpus.eos)
    assert moved > 10


def test_a_resume_with_other_fim_settings_is_refused(caches: dict) -> None:
    cache, _ = caches["plain"]
    fim = cache.sequences(16).fim(rate=0.5, sentinels=(1, 2, 3))
    loader = Loader(fim, batch_size=4, seed=1)
    next(iter(loader))
    state = loader.state_dict()
    for other in (
        cache.sequences(16),
        cache.sequences(16).fim(rate=0.25, sentinels=(1, 2, 3)),
        cache.sequences(16).fim(rate=0.5, sentinels=(1, 2, 3), seed=1),
        cache.sequences(16).fim(rate=0.5, sentinels=(1, 2, 4)),
    ):
        with pytest.raises(LoaderStateError, match=r"fim|data"):
            Loader(other, batch_size=4, seed=1).load_state_dict(state)
    again = Loader(cache.sequences(16).fim(rate=0.5, sentinels=(1, 2, 3)), batch_size=4, seed=1)
    again.load_state_dict(state)
    assert np.array_equal(next(iter(again)), next(islice(iter(loader), 0, 1)))


def test_fim_samples_at_another_length_are_refused(caches: dict) -> None:
    cache, _ = caches["plain"]
    fim = cache.sequences(16).fim(sentinels=(1, 2, 3))
    with pytest.raises(OptionsError, match="FIM"):
        Loader(fim, batch_size=4, seq_len_schedule=[(0, 8), (64, 16)])

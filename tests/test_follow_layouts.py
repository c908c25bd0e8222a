"""Follow over whole documents: ``layout="packed"`` and ``"documents"`` served while a real build runs.

Eras count documents; each era is planned on its own once committed, so a served sample never changes.
The checks here are independent of the planner: the pieces of the samples served tile every shard's
tokens exactly once, each inside its own era's documents, and the rows are those tokens, then padding.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import streampack
from streampack.errors import LoaderStateError, OptionsError
from streampack.follow import Eras, Follow, FollowOrder
from streampack.follow.eras import era_plan
from streampack.format.ledger import LedgerEntry
from streampack.format.names import shard_name
from streampack.store import open_store
from streampack.store.files import read_entry
from streampack.testing.caches import write_cache
from tests.test_follow import corpus, follow_args, hold, release
from tests.test_resume import start_build

SEQ_LEN, BATCH = 64, 8
ERAS = {"first_era": 8, "largest_era": 256}  # documents


def make(out: Path | str, layout: str, **kwargs: Any) -> Follow:
    options: dict[str, Any] = {"layout": layout, "seq_len": SEQ_LEN, "batch_size": BATCH, "seed": 7, **ERAS}
    options.update(then="end", timeout=60.0, poll=0.02)
    options.update(kwargs)
    return Follow(out, **options)


def hold_at(proc: Any, out: Path, docs: int) -> None:
    """Hold the build (:func:`~tests.test_follow.hold`) once its first unit has committed ``docs``
    documents: the eras they complete are served while it is held, whatever the machine's speed."""
    manifest = streampack.open(out, allow_incomplete=True).manifest
    deadline = time.monotonic() + 120
    while read_entry(out, shard_name(0), manifest.units[0]).docs < docs:
        assert proc.poll() is None and time.monotonic() < deadline, "the build ended or stalled"
        time.sleep(0.002)
    hold(proc)


def check_exact(follow: Follow, served: np.ndarray) -> None:
    """Over the finished cache: positions ``[0, N)`` serve each sample of the eras' plans once, each in
    its own era; the pieces of the samples tile every shard (``too_long="split"``: every token once), each
    in a document of its sample's era; and ``served`` (the rows of the first positions) are those pieces'
    tokens, then padding."""
    cache = streampack.open(follow.path)
    order = follow.follow_order
    assert order.bounds is not None and order.total == order.bounds[-1]
    n = order.total
    samples = order.samples(np.arange(n, dtype=np.int64))
    assert np.array_equal(np.sort(samples), np.arange(n))  # an exact epoch
    bounds = np.asarray(order.bounds)
    era_of_position = np.searchsorted(bounds, np.arange(n), side="right") - 1
    assert np.array_equal(np.searchsorted(bounds, samples, side="right") - 1, era_of_position)

    layout = follow.dataset.view().layout
    pieces = layout.spans(np.arange(n, dtype=np.int64))
    sample_era = np.searchsorted(bounds, pieces.rows, side="right") - 1
    for shard in range(cache.num_shards):
        mine = np.flatnonzero(pieces.shards == shard)
        lo, hi = pieces.lo[mine], pieces.hi[mine]
        by_lo = np.argsort(lo)
        assert lo[by_lo][0] == 0 and np.array_equal(lo[by_lo][1:], hi[by_lo][:-1])  # no gap, no overlap
        assert hi[by_lo][-1] == cache.shard_tokens(shard).size
        docs = cache.doc_starts[shard] + np.searchsorted(cache.shard_offsets(shard), lo, side="right")
        assert np.array_equal(follow.follow_options.eras.of(docs), sample_era[mine])  # one era per doc

    rows = order.samples(np.arange(len(served), dtype=np.int64))
    spans = layout.spans(rows)
    expected = np.full(served.shape, layout.pad_id, dtype=served.dtype)
    for row, shard, lo, hi, col in zip(spans.rows, spans.shards, spans.lo, spans.hi, spans.col, strict=True):
        expected[row, col : col + hi - lo] = cache.shard_tokens(int(shard))[lo:hi]
    assert np.array_equal(served, expected)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["packed", "documents"])
def test_whole_documents_follow_a_running_build_exactly_and_resume_mid_build_and_after(
    layout: str, tmp_path: Path, bpe_tokenizer: Path
) -> None:
    """A Follow, two ranks and (packed) a DataLoader with two workers read a running build in lockstep;
    a state saved mid-build resumes in a second Follow made while the build still runs, and in a third
    after it ended, to the same batches; over the finished cache the samples served are an exact epoch of
    the eras' plans (every token of the cache once with ``too_long="split"``)."""
    out = tmp_path / "c"
    proc = start_build(follow_args(corpus(tmp_path, 4000), out, bpe_tokenizer), out)
    hold_at(proc, out, 64)  # eras 0-2 (56 documents) are committed
    extra = {"too_long": "split"}
    try:
        follow = make(out, layout, **extra)
        ranks = [make(out, layout, rank=r, world_size=2, **extra) for r in (0, 1)]
        loaders: list[Any] = [follow, *ranks]
        if layout == "packed":
            torch_data = pytest.importorskip("streampack.torch", reason="the DataLoader part needs torch")
            loaders.append(torch_data.DataLoader(make(out, layout, **extra), num_workers=2))
        batches, running, saved, resumed = [], [], None, None
        for step, (batch, left, right, *workers) in enumerate(zip(*loaders, strict=True)):
            batches.append(batch)
            running.append(proc.poll() is None)
            assert np.array_equal(np.concatenate([left, right]), batch)
            assert step > 2 or running[-1]  # the first three batches are served while the build is held
            if workers:
                assert np.array_equal(workers[0].numpy(), batch)
            if step == 2:
                saved = json.loads(json.dumps(follow.state_dict()))
                resumed = make(out, layout, **extra)  # made while the build is held: mid-build
                resumed.load_state_dict(saved)
                again = iter(resumed)
                release(proc)
            if resumed is not None and step > 2:
                assert np.array_equal(next(again), batch)
    finally:
        release(proc)
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr.decode()
    assert saved is not None and running[0] and sum(running) >= 2, "no batch was served while building"
    assert next(again, None) is None

    after = make(out, layout, **extra)
    assert len(after) == len(batches)
    after.load_state_dict(saved)
    assert all(np.array_equal(a, b) for a, b in zip(after, batches[3:], strict=True))
    assert follow.follow_order.bounds == after.follow_order.bounds  # the same eras, however read
    check_exact(follow, np.concatenate(batches))


def test_settings_are_checked_and_states_name_the_layout(tmp_path: Path, bpe_tokenizer: Path) -> None:
    """Whole-document settings fit whole documents only; a state saved over one layout resumes only that
    layout; output="dict" works over a followed plan."""
    built = streampack.build(corpus(tmp_path, 600), tmp_path / "c", tokenizer=str(bpe_tokenizer),
                             unit_bytes=1 << 16).out  # fmt: skip
    with pytest.raises(OptionsError, match="apply to whole documents"):
        make(built, "sequences", too_long="drop")
    with pytest.raises(OptionsError, match="overlap applies to layout='sequences' only"):
        make(built, "packed", overlap=1)
    with pytest.raises(OptionsError, match="layout"):
        make(built, "bins")
    with pytest.raises(OptionsError, match="pad_id"):
        next(iter(make(built, "packed", pad_id=2**20)))
    packed = make(built, "packed")
    assert packed.follow_options.too_long == "split"
    assert make(built, "documents").follow_options.too_long == "truncate"
    next(iter(packed))
    state = packed.state_dict()
    assert state["order"]["data"]["layout"] == "packed"
    with pytest.raises(LoaderStateError, match="data in checkpoint"):
        make(built, "documents").load_state_dict(state)
    with pytest.raises(LoaderStateError, match="data in checkpoint"):
        make(built, "packed", too_long="drop").load_state_dict(state)
    with pytest.raises(LoaderStateError, match="data in checkpoint"):
        make(built, "sequences").load_state_dict(state)
    as_dict = next(iter(make(built, "documents", output="dict")))
    plain = next(iter(make(built, "documents")))
    assert np.array_equal(as_dict["input_ids"], plain)
    assert (as_dict["labels"][plain == packed.dataset.pad_id] == -100).any()
    endless = make(built, "packed", then="epochs")
    n = endless.follow_order.total
    assert n is not None  # the build is complete: then="epochs" goes on past the eras with their samples
    epoch = endless.follow_order.samples(np.arange(n, 2 * n, dtype=np.int64))
    assert np.array_equal(np.sort(epoch), np.arange(n))


@settings(max_examples=40, deadline=None)
@given(
    first=st.integers(1, 8),
    growth=st.integers(0, 4),
    sizes=st.lists(st.integers(0, 60), min_size=1, max_size=12),
    seed=st.integers(0, 2**64 - 1),
)
def test_the_document_era_order_is_an_exact_epoch_and_eras_do_not_change_once_complete(
    first: int, growth: int, sizes: list[int], seed: int
) -> None:
    """Eras of documents whose plans hold ``sizes`` samples: positions ``[0, N)`` visit each sample once,
    each in its own era, and the positions of the eras known map the same before the rest are learnt,
    and after the build is complete."""
    eras = Eras(first, first * 2**growth)
    done = FollowOrder(seed=seed, eras=eras, then="end", data={}, by="documents")
    for size in sizes:
        done.learn(size)
    total = sum(sizes)
    done.finish(total)
    positions = np.arange(total, dtype=np.int64)
    samples = done.samples(positions)
    assert np.array_equal(np.sort(samples), positions)
    bounds = np.asarray(done.bounds)
    assert np.array_equal(
        np.searchsorted(bounds, samples, "right"), np.searchsorted(bounds, positions, "right")
    )
    for k in range(len(sizes)):
        running = FollowOrder(seed=seed, eras=eras, then="end", data={}, by="documents")
        for size in sizes[:k]:
            running.learn(size)
        known = positions[: running.known]
        assert np.array_equal(running.samples(known), samples[: len(known)])


@settings(max_examples=25, deadline=None)
@example(lengths=[0, 0, 0, 0], cut=1, first=1, layout="packed", too_long="split")  # empty documents
@given(
    lengths=st.lists(st.integers(0, 90), min_size=1, max_size=60),
    cut=st.integers(0, 60),
    first=st.integers(1, 6),
    layout=st.sampled_from(["packed", "documents"]),
    too_long=st.sampled_from(["split", "truncate", "drop"]),
)
def test_an_eras_plan_is_the_same_from_any_committed_prefix_that_holds_it(
    tmp_path_factory: pytest.TempPathFactory,
    lengths: list[int],
    cut: int,
    first: int,
    layout: str,
    too_long: str,
) -> None:
    """An era's plan, made from the committed part of a build that holds its documents, equals the plan
    made from the finished cache: it depends on its documents alone. Over every era, the pieces are the
    documents of the era in full (``"split"``), cut (``"truncate"``) or without the long ones (``"drop"``).
    """
    seq_len = 32
    root = tmp_path_factory.mktemp("eras")
    halves = [lengths[: len(lengths) // 2], lengths[len(lengths) // 2 :]]
    shards = []
    for part in halves:
        ends = np.cumsum(part, dtype=np.int64)
        shards.append((np.arange(int(ends[-1]) if len(ends) else 0) % 50, ends))
    shards = [s for s in shards if len(s[1])]
    out = write_cache(root / "c", shards, vocab_size=64, eos_id=63)
    cache = streampack.open(out)
    docs = cache.num_docs
    cut = min(cut, docs)
    # The committed prefix of ``cut`` documents, as a follower opens it.
    progress, left = [], cut
    for shard in range(cache.num_shards):
        take = min(left, int(cache.doc_starts[shard + 1] - cache.doc_starts[shard]))
        offsets = cache.shard_offsets(shard)
        tokens = int(offsets[take - 1]) if take else 0
        entry = LedgerEntry(cache.manifest.units[shard], docs=take, tokens=tokens)
        progress.append(entry)
        left -= take
    running = dataclasses.replace(cache.manifest, complete=False)  # a follower's: the build runs
    prefix = streampack.reader.open_committed(open_store(out), running, progress)
    eras = Eras(first, first * 4)
    era, covered = 0, []
    while eras.start(era) < docs:
        lo, hi = eras.start(era), min(eras.start(era + 1), docs)
        settings: dict[str, Any] = {"kind": layout, "seq_len": seq_len, "too_long": too_long}
        plan = era_plan(cache, lo, hi, no_target="keep", **settings)
        if hi <= cut:
            again = era_plan(prefix, lo, hi, no_target="keep", **settings)
            for name in ("starts", "shards", "lo", "lengths"):
                assert np.array_equal(getattr(plan, name), getattr(again, name))
        assert (np.add.reduceat(plan.lengths, plan.starts[:-1]) <= seq_len).all() if len(plan) else True
        if layout == "documents":
            assert np.array_equal(np.diff(plan.starts), np.ones(len(plan), dtype=np.int64))
        expected = np.array(lengths[lo:hi], dtype=np.int64)
        expected = expected[expected > 0]
        served = {"split": expected.sum(), "truncate": np.minimum(expected, seq_len).sum(),
                  "drop": expected[expected <= seq_len].sum()}[too_long]  # fmt: skip
        assert plan.lengths.sum() == served
        covered.append(len(plan))
        era += 1
    assert len(covered) == era


def test_a_mixture_with_a_following_source_keeps_its_weights_and_resumes_mid_build_and_after(
    tmp_path: Path, bpe_tokenizer: Path
) -> None:
    """A finished cache and a running build mixed half and half: two ranks serve their slices of each
    global batch while the build is held, a state saved mid-build resumes in a loader made while it still
    runs and in one made after it ended (with the mixture from a config that says ``follow: true``), to
    the same batches; each source serves each of its samples once, the following one in its follow order.
    """
    from streampack.order.mixture import Mixture
    from streampack.runs.mixconfig import load_mixture

    web_path = streampack.build(corpus(tmp_path / "w", 600), tmp_path / "web", tokenizer=str(bpe_tokenizer),
                                unit_bytes=1 << 16).out  # fmt: skip
    web = streampack.open(web_path).sequences(SEQ_LEN)
    out = tmp_path / "c"
    follow = {"seq_len": SEQ_LEN, "batch_size": BATCH, "seed": 2, "first_era": 64, "largest_era": 2048}
    follow.update(timeout=60.0, poll=0.02)
    mix = {"weights": {"web": 0.5, "fresh": 0.5}, "block_size": 16, "seed": 2}

    def loader(**kwargs: Any) -> streampack.Loader:
        mixture = Mixture({"web": web, "fresh": Follow(out, **follow)}, **mix)  # type: ignore[arg-type]
        return streampack.Loader(mixture, batch_size=BATCH, **kwargs)

    proc = start_build(follow_args(corpus(tmp_path, 4000), out, bpe_tokenizer), out)
    hold_at(proc, out, 64)  # ~200 windows: eras 0 and 1 (192 windows) are committed
    try:
        main, ranks = loader(), [loader(rank=r, world_size=2) for r in (0, 1)]
        batches, saved = [], None
        for step, (batch, left, right) in enumerate(zip(main, *ranks, strict=False)):
            batches.append(batch)
            assert np.array_equal(np.concatenate([left, right]), batch)
            assert step > 2 or proc.poll() is None
            if step == 2:
                saved = json.loads(json.dumps(main.state_dict()))
                resumed = loader()  # made while the build is held: mid-build
                resumed.load_state_dict(saved)
                again = iter(resumed)
                release(proc)
            if step > 2:
                assert np.array_equal(next(again), batch)
            if step == 60:
                break
    finally:
        release(proc)
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr.decode()
    assert saved is not None

    fresh_config = {"path": str(out), "follow": True, "first_era": 64, "largest_era": 2048, "timeout": 60}
    config = {"seq_len": SEQ_LEN, "sources": {"web": str(web_path), "fresh": fresh_config}, **mix}
    after = streampack.Loader(load_mixture(config), batch_size=BATCH)
    after.load_state_dict(saved)
    assert all(np.array_equal(a, b) for a, b in zip(after, batches[3:], strict=False))

    positions = np.arange(len(batches) * BATCH, dtype=np.int64)
    sources, samples = main.order(positions)
    fresh = main.dataset.sources["fresh"]
    finished = streampack.open(out).sequences(SEQ_LEN)
    tables = [web, finished]
    expected = np.stack([tables[s][int(i)] for s, i in zip(sources, samples, strict=True)])
    assert np.array_equal(np.concatenate(batches), expected)
    for source in (0, 1):
        mine = samples[sources == source]
        assert len(np.unique(mine)) == len(mine) > 0  # each sample once
    served = int((sources == 1).sum())
    assert np.array_equal(samples[sources == 1], fresh.order.samples(np.arange(served, dtype=np.int64)))
    assert [share.served for share in main.realised()] == [int((sources == s).sum()) for s in (0, 1)]
    with pytest.raises(OptionsError, match="stop='first_exhausted' does not apply"):
        Mixture({"web": web, "fresh": Follow(out, **follow)}, stop="first_exhausted", **mix)  # type: ignore[arg-type]

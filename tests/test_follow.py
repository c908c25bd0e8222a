"""Follow mode: a loader trains on the committed part of a cache while a real build writes it."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import streampack
from streampack.errors import BuildStalledError, LoaderStateError, OptionsError
from streampack.follow import Follow
from streampack.layout import Spans
from streampack.reader import Cache
from tests.conftest import write_jsonl
from tests.test_resume import build_args, start_build

SEQ_LEN, OVERLAP, BATCH = 48, 1, 8


def corpus(tmp_path: Path) -> Path:
    """~8 MB of JSONL: 8 units of 1 MB, built one after the other by one worker over a few seconds."""
    rng = random.Random(3)
    words = ["alpha", "beta", "gamma", "delta", "tokens", "cache", "Ünïcödé"]
    docs = [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(1, 300)))} for _ in range(9000)]
    return write_jsonl(tmp_path / "in.jsonl", docs)


def follow_args(src: Path, out: Path, tokenizer: Path) -> list[str]:
    args = build_args([src], out, tokenizer)
    args[args.index("--workers") + 1] = "1"
    return args


def make_follow(out: Path | str, **kwargs: object) -> Follow:
    settings: dict = {"seq_len": SEQ_LEN, "overlap": OVERLAP, "batch_size": BATCH, "seed": 5}
    settings.update(timeout=60.0, poll=0.02)
    settings.update(kwargs)
    return Follow(out, **settings)


def test_a_loader_follows_a_running_build(tmp_path: Path, bpe_tokenizer: Path) -> None:
    """Every sample is committed data, at its place in the finished cache; none repeats; a state saved
    mid-way resumes to the same batches; the eras grow while the build runs."""
    out = tmp_path / "c"
    proc = start_build(follow_args(corpus(tmp_path), out, bpe_tokenizer), out)
    try:
        follow = make_follow(out)
        batches, spans, running = [], [], []
        saved: dict | None = None
        for step, batch in enumerate(follow):
            positions = np.arange(step * BATCH, (step + 1) * BATCH, dtype=np.int64)
            batches.append(batch)
            spans.append(follow.spans(positions))
            running.append(proc.poll() is None)
            if step == 20:
                saved = json.loads(json.dumps(follow.state_dict()))
    finally:
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr.decode()
    assert saved is not None and running[0], "the build ended before the loader started following"
    assert len(follow.eras) >= 3 and sum(running) >= 2

    final = streampack.open(out)
    assert final.num_shards == len(follow.eras[-1].stops)
    check_served(batches, spans, final)

    resumed = make_follow(out)
    resumed.load_state_dict(saved)
    fixed = (resumed.covered - resumed.position) // BATCH  # batches inside the saved eras
    assert fixed >= 1
    again, again_spans = [], []
    for step, batch in enumerate(resumed, start=21):
        again.append(batch)
        again_spans.append(resumed.spans(np.arange(step * BATCH, (step + 1) * BATCH, dtype=np.int64)))
    assert all(np.array_equal(a, b) for a, b in zip(again[:fixed], batches[21:], strict=False))
    # Later eras are read from the ledger of now: other samples, still committed and never repeated.
    check_served(batches[:21] + again, spans[:21] + again_spans, final)


def check_served(batches: list[np.ndarray], spans: list[Spans], final: Cache) -> None:
    """Each row holds the tokens its spans name in the finished cache, and no token is served twice."""
    served = []
    for batch, batch_spans in zip(batches, spans, strict=True):
        expected = np.full_like(batch, -1)
        where = (batch_spans.rows, batch_spans.shards, batch_spans.lo, batch_spans.hi, batch_spans.col)
        for row, shard, lo, hi, col in zip(*where, strict=True):
            expected[row, col : col + hi - lo] = final.shard_tokens(int(shard))[lo:hi]
        assert np.array_equal(batch, expected)  # also: every column of every row is covered
        head = batch_spans.head(SEQ_LEN)  # the overlap token is the next window's first: not a repeat
        served += list(zip(head.shards.tolist(), head.lo.tolist(), head.hi.tolist(), strict=True))
    served.sort()
    for (shard, _, hi), (next_shard, next_lo, _) in itertools.pairwise(served):
        assert shard != next_shard or hi <= next_lo, "a token was served twice"
    tokens = sum(hi - lo for _, lo, hi in served)
    assert tokens > final.num_tokens - BATCH * SEQ_LEN - OVERLAP  # all but the dropped tail


def test_a_stalled_build_raises_after_the_timeout(tmp_path: Path, bpe_tokenizer: Path) -> None:
    """A killed build: the committed part is served, then the wait ends in a clear error."""
    out = tmp_path / "c"
    proc = start_build(follow_args(corpus(tmp_path), out, bpe_tokenizer), out)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    committed = streampack.open(out, allow_incomplete=True).num_tokens
    follow = make_follow(out, timeout=0.5)
    started = time.monotonic()
    with pytest.raises(BuildStalledError, match=r"committed no new samples for 0.5 s"):
        for _ in follow:
            pass
    assert time.monotonic() - started < 30
    assert follow.position * SEQ_LEN <= committed

    other = make_follow(out, seed=6)
    with pytest.raises(LoaderStateError, match="seed in state: 5 / seed here: 6"):
        other.load_state_dict(follow.state_dict())
    state = follow.state_dict()
    state["eras"][-1] = [tokens + 1 for tokens in state["eras"][-1]]  # more than was ever committed
    with pytest.raises(LoaderStateError, match="hold data this cache has not committed"):
        make_follow(out).load_state_dict(state)


def test_then_epochs_goes_on_with_the_loaders_full_permutations(tmp_path: Path, bpe_tokenizer: Path) -> None:
    """Once the build is complete and its eras served, then="epochs" continues with exactly the samples of
    a Loader over the complete cache, from its position 0."""
    rng = random.Random(4)
    docs = [
        {"text": " ".join(rng.choice(["a", "bb", "ccc"]) for _ in range(rng.randint(1, 80)))}
        for _ in range(3000)
    ]
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    built = streampack.build(src, tmp_path / "c", tokenizer=str(bpe_tokenizer), unit_bytes=1 << 16)
    follow = make_follow(built.out, then="epochs")
    steps = iter(follow)
    first = next(steps)
    end = follow.covered  # one era: the whole complete cache
    samples = streampack.open(built.out).sequences(SEQ_LEN, overlap=OVERLAP)
    assert end == len(samples) and not follow.finished
    rows = np.concatenate([first] + [next(steps) for _ in range(2 * end // BATCH + 1)])
    loader = streampack.Loader(samples, batch_size=1, seed=5)
    for position in (end, end + 1, 2 * end - 1, 2 * end, 2 * end + 3):  # epochs 0 and 1 of the loader
        assert np.array_equal(rows[position], loader.batch(position - end)[0])
    seen = {row.tobytes() for row in rows[:end]}
    assert len(seen) == end  # the era serves every window once

    ended = make_follow(built.out)
    assert sum(len(batch) for batch in ended) == end // BATCH * BATCH


def test_ranks_sharing_rank_0s_snapshots_split_each_global_batch(tmp_path: Path, bpe_tokenizer: Path) -> None:
    """Two ranks following a running build with share= (rank 0's snapshot for both, as a broadcast
    would give): their rows side by side are the global batch of one rank reading the same eras."""
    out = tmp_path / "c"
    proc = start_build(follow_args(corpus(tmp_path), out, bpe_tokenizer), out)
    snapshots: list[dict] = []
    calls = [0, 0]

    def share(rank: int) -> Callable[[dict], dict]:
        def broadcast(mine: dict) -> dict:
            calls[rank] += 1
            if rank == 0:
                snapshots.append(mine)
            return snapshots[calls[rank] - 1]

        return broadcast

    try:
        ranks = [make_follow(out, rank=r, world_size=2, share=share(r)) for r in (0, 1)]
        pairs = list(zip(*ranks, strict=True))  # rank 0 reads the ledger first at every step
    finally:
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr.decode()
    assert ranks[0].state_dict() == ranks[1].state_dict() and len(ranks[0].eras) >= 2
    whole = make_follow(out)
    whole.load_state_dict({**ranks[0].state_dict(), "position": 0})
    for (left, right), batch in zip(pairs, whole, strict=True):
        assert left.shape == right.shape == (BATCH // 2, SEQ_LEN + OVERLAP)
        assert np.array_equal(np.concatenate([left, right]), batch)

    with pytest.raises(OptionsError, match="pass share="):
        make_follow(out, rank=1, world_size=2)
    with pytest.raises(OptionsError, match="local caches only"):
        make_follow("s3://bucket/cache")

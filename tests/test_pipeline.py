"""A unit's pipeline: batches that finish out of order are written in order, and every commit is exact."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

import streampack
from streampack.build import BuildOptions
from streampack.ledger import UnitProgress
from streampack.pipeline import UnitTask, _UnitPipeline
from streampack.sources import ReadOptions, expand_inputs, plan_units
from streampack.tokenize import BytesTokenizer, EosPolicy, default_max_piece_chars
from streampack.writer import ShardWriter
from tests.conftest import write_jsonl


class SlowFirstBatches(BytesTokenizer):
    """The bytes tokenizer, except that its first batches take longer than the ones after them."""

    def __init__(self, slow_batches: int) -> None:
        self.calls = 0
        self.slow_batches = slow_batches
        self.finished: list[int] = []
        self.lock = threading.Lock()

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        with self.lock:
            call, self.calls = self.calls, self.calls + 1
        if call < self.slow_batches:
            time.sleep(0.3)
        with self.lock:
            self.finished.append(call)
        return super().encode_batch(texts)


class RecordingWriter(ShardWriter):
    """A shard writer that remembers what every commit recorded."""

    commits: list[UnitProgress]

    def commit(self, *, records: int, skipped: int, done: bool = False) -> UnitProgress:
        progress = super().commit(records=records, skipped=skipped, done=done)
        self.commits.append(progress)
        return progress


def _texts() -> list[str | None]:
    rng = np.random.default_rng(0)
    texts: list[str | None] = []
    for i in range(300):
        words = " ".join(f"w{i}x{j}" for j in range(int(rng.integers(1, 400))))
        texts.append(None if i % 50 == 7 else words)  # some records without text: skipped
    return texts


@pytest.mark.parametrize("slow_batches", [1, 3])
def test_out_of_order_batches_are_written_in_order_and_commits_are_exact(
    tmp_path: Path, slow_batches: int
) -> None:
    texts = _texts()
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": t} if t is not None else {"x": 1} for t in texts])
    tokenizer = SlowFirstBatches(slow_batches)
    opts = BuildOptions(
        on_bad_record="skip", batch_chars=2_000, max_piece_chars=700, commit_bytes=1, commit_seconds=0
    )
    (unit,) = plan_units(expand_inputs([str(path)]), ReadOptions())
    task = UnitTask(str(tmp_path / "out"), unit, opts, EosPolicy(True, 256), "uint16")
    (tmp_path / "out" / "ledger").mkdir(parents=True)
    (tmp_path / "out" / "shards").mkdir()
    with RecordingWriter(Path(task.root), "000000", np.dtype("uint16"), UnitProgress(unit.describe())) as w:
        w.commits = []
        final = _UnitPipeline(task, tokenizer, w, lambda event: None).run()

    assert tokenizer.finished[:slow_batches] != list(range(slow_batches)), "no batch finished out of order"
    expected = [[*t.encode(), 256] for t in texts if t is not None]
    tokens = np.fromfile(tmp_path / "out" / "shards" / "000000.tokens", np.uint16).tolist()
    assert tokens == [t for doc in expected for t in doc]
    assert (final.records, final.docs, final.skipped, final.done) == (len(texts), len(expected), 6, True)
    assert len(w.commits) > 10
    for commit in w.commits:  # each commit's counts describe exactly its first `records` records
        done = [t for t in texts[: commit.records] if t is not None]
        assert commit.docs == len(done)
        assert commit.tokens == sum(len(t.encode()) + 1 for t in done)
        assert commit.skipped == texts[: commit.records].count(None)


def test_default_piece_size_is_recorded(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "a b c"}])
    streampack.build(path, tmp_path / "c")
    settings = streampack.open(tmp_path / "c").manifest.settings
    assert settings["max_piece_chars"] == default_max_piece_chars(BytesTokenizer()) == 100_000

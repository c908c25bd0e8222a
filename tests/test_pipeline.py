"""The units' pipeline: batches that finish out of order are written in order, every commit is exact, and
the next unit starts encoding while the last batches of the one before it still encode."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

import streampack
from streampack.builder.options import RunOptions
from streampack.builder.pipeline import run_units
from streampack.builder.tasks import TokenizerRef, UnitResult, UnitSpec, UnitTask
from streampack.builder.writer import ShardWriter
from streampack.errors import BadRecordError
from streampack.format.ledger import Counts, LedgerEntry
from streampack.inputs.discovery import expand_inputs
from streampack.inputs.records import ReadOptions, WorkUnit
from streampack.inputs.units import plan_units
from streampack.store.files import read_entry
from streampack.tokenizer.bytes import BytesTokenizer
from streampack.tokenizer.engines import FlatIds
from streampack.tokenizer.pieces import EXACT_CUT_PIECE_CHARS, PieceRule
from streampack.tokenizer.specials import EosPolicy
from tests.conftest import write_jsonl

SPEC = "slow-test-tokenizer"


class SlowBatches(BytesTokenizer):
    """The bytes tokenizer, except that chosen batches take 0.3 s; it logs when each call starts and ends."""

    def __init__(self, is_slow: Callable[[int, list[str]], bool]) -> None:
        self.is_slow = is_slow
        self.calls = 0
        self.log: list[tuple[str, int]] = []  # ("start" | "end", call)
        self.first_text: dict[int, str] = {}
        self.slow_calls: list[int] = []
        self.lock = threading.Lock()

    def encode_flat(self, texts: list[str]) -> FlatIds:
        with self.lock:
            call, self.calls = self.calls, self.calls + 1
            self.log.append(("start", call))
            self.first_text[call] = texts[0]
        if self.is_slow(call, texts):
            self.slow_calls.append(call)
            time.sleep(0.3)
        with self.lock:
            self.log.append(("end", call))
        return super().encode_flat(texts)

    def finished(self) -> list[int]:
        return [call for event, call in self.log if event == "end"]

    def started_while(self, call: int) -> list[str]:
        """The first texts of the calls that started while ``call`` ran."""
        during = self.log[self.log.index(("start", call)) + 1 : self.log.index(("end", call))]
        return [self.first_text[c] for event, c in during if event == "start"]


class RecordingWriter(ShardWriter):
    """A shard writer that remembers what every commit of every shard recorded."""

    commits: ClassVar[dict[str, list[LedgerEntry]]] = {}

    def commit(self, counts: Counts, *, done: bool = False) -> LedgerEntry:
        progress = super().commit(counts, done=done)
        self.commits.setdefault(self.name, []).append(progress)
        return progress


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[LedgerEntry]]:
    commits: ClassVar[dict[str, list[LedgerEntry]]] = {}
    monkeypatch.setattr(RecordingWriter, "commits", commits)
    monkeypatch.setattr("streampack.builder.writer.ShardWriter", RecordingWriter)  # an open unit's writer
    return commits


def _texts(seed: int, prefix: str) -> list[str | None]:
    rng = np.random.default_rng(seed)
    texts: list[str | None] = []
    for i in range(300):
        words = " ".join(f"{prefix}{i}x{j}" for j in range(int(rng.integers(1, 400))))
        texts.append(None if i % 50 == 7 else words)  # some records without text: skipped
    return texts


def _spec(root: Path, **options: object) -> UnitSpec:
    ref = TokenizerRef(SPEC, "text", "no-file")
    run = RunOptions(**{"verify_tokens": "none", **options})  # type: ignore[arg-type]
    return UnitSpec(str(root), ref, ReadOptions(), EosPolicy(True, 256), "uint16", PieceRule(700), run=run)


def _tasks(tmp_path: Path, files: Sequence[Sequence[str | None]]) -> list[UnitTask]:
    """One unit per file of ``files`` (None: a record without text)."""
    paths = [
        str(
            write_jsonl(
                tmp_path / f"in{i}.jsonl", [{"text": t} if t is not None else {"x": 1} for t in texts]
            )
        )
        for i, texts in enumerate(files)
    ]
    spec = _spec(tmp_path / "out", on_bad_record="skip", batch_chars=2_000, commit_bytes=1, commit_seconds=0)
    units = [WorkUnit(i, file) for i, file in enumerate(expand_inputs(paths))]  # one unit per file
    (tmp_path / "out" / "ledger").mkdir(parents=True)
    (tmp_path / "out" / "shards").mkdir()
    return [UnitTask(spec, u) for u in units]


def _check_unit(
    root: Path, name: str, texts: Sequence[str | None], final: LedgerEntry, commits: list[LedgerEntry]
) -> None:
    """The shard holds every text's bytes + EOS in order, and each commit describes exactly its records."""
    expected = [[*t.encode(), 256] for t in texts if t is not None]
    tokens = np.fromfile(root / "shards" / f"{name}.tokens", np.uint16).tolist()
    assert tokens == [t for doc in expected for t in doc]
    assert (final.records, final.docs, final.skipped, final.done) == (len(texts), len(expected), 6, True)
    assert len(commits) > 10
    for commit in commits:
        done = [t for t in texts[: commit.records] if t is not None]
        assert commit.docs == len(done)
        assert commit.tokens == sum(len(t.encode()) + 1 for t in done)
        assert commit.skipped == texts[: commit.records].count(None)


@pytest.mark.parametrize("slow_batches", [1, 3])
def test_out_of_order_batches_are_written_in_order_and_commits_are_exact(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    recording: dict[str, list[LedgerEntry]],
    slow_batches: int,
) -> None:
    texts = _texts(0, "w")
    tokenizer = SlowBatches(lambda call, _: call < slow_batches)
    (result,) = run_units(_tasks(tmp_path, [texts]), lambda event: None, tokenizer)

    assert tokenizer.finished()[:slow_batches] != list(range(slow_batches)), "no batch finished out of order"
    _check_unit(tmp_path / "out", "000000", texts, result.entry, recording["000000"])


@pytest.mark.slow
def test_next_unit_encodes_while_the_last_batch_of_the_one_before_still_does(
    tmp_path: Path, recording: dict[str, list[LedgerEntry]]
) -> None:
    files = [_texts(seed, prefix) for seed, prefix in enumerate("abc")]
    last_of_a = next(t for t in reversed(files[0]) if t is not None)
    tokenizer = SlowBatches(lambda _, texts: last_of_a.endswith(texts[-1]))
    results = list(run_units(_tasks(tmp_path, files), lambda event: None, tokenizer))

    assert [r.unit_index for r in results] == [0, 1, 2]
    (slow_call,) = tokenizer.slow_calls
    assert any(text.startswith("b") for text in tokenizer.started_while(slow_call)), "unit 1 waited"
    for result, texts in zip(results, files):
        name = f"{result.unit_index:06d}"
        _check_unit(tmp_path / "out", name, texts, result.entry, recording[name])


def test_a_bad_record_finishes_the_unit_before_and_commits_its_own_unit_up_to_it(
    tmp_path: Path, recording: dict[str, list[LedgerEntry]]
) -> None:
    first, second = ([t for t in _texts(seed, prefix) if t is not None] for seed, prefix in enumerate("ab"))
    last_of_first = next(t for t in reversed(first) if t is not None)
    tokenizer = SlowBatches(lambda _, texts: last_of_first.endswith(texts[-1]))
    tasks = _tasks(tmp_path, [first, second])
    path = Path(tasks[1].unit.file.path)  # type: ignore[union-attr]
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join([*lines[:5], b"{not json\n", *lines[5:]]))
    strict = [UnitTask(_spec(tmp_path / "out", batch_chars=2_000), t.unit) for t in tasks]

    results: list[UnitResult] = []
    with pytest.raises(BadRecordError, match=r"in1\.jsonl:6"):
        for result in run_units(strict, lambda event: None, tokenizer):
            results.append(result)

    (slow_call,) = tokenizer.slow_calls
    assert any(text.startswith("b") for text in tokenizer.started_while(slow_call)), "unit 1 waited"
    root = tmp_path / "out"
    done = read_entry(root, "000000", tasks[0].unit.describe())
    partial = read_entry(root, "000001", tasks[1].unit.describe())
    assert done.done and done.records == len(first)
    assert not partial.done and partial.records == 5
    assert partial.docs == 5
    size = np.fromfile(root / "shards" / "000001.tokens", np.uint16).size
    assert size == partial.tokens == sum(len(t.encode()) + 1 for t in second[:5])


def test_a_run_of_files_reports_every_byte_it_reads(tmp_path: Path) -> None:
    paths = [
        write_jsonl(tmp_path / "in" / f"{i}.jsonl", [{"text": f"doc {i}.{j} " * j} for j in range(300)])
        for i in range(3)
    ]
    paths.insert(1, tmp_path / "in" / "small.txt")
    paths[1].write_text("a whole-file document")
    (unit,) = plan_units(expand_inputs([str(tmp_path / "in")]), ReadOptions())
    assert len(unit.files) == 4
    (tmp_path / "out" / "ledger").mkdir(parents=True)
    (tmp_path / "out" / "shards").mkdir()
    events: list[dict[str, int]] = []
    spec = _spec(tmp_path / "out", batch_chars=5_000)
    list(run_units([UnitTask(spec, unit)], events.append, BytesTokenizer()))
    assert len(events) > 10
    assert sum(e["bytes"] for e in events) == sum(p.stat().st_size for p in paths)


def test_default_piece_size_is_recorded(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "a b c"}])
    streampack.build(path, tmp_path / "c")
    settings = streampack.open(tmp_path / "c").manifest.settings
    assert settings.max_piece_chars == EXACT_CUT_PIECE_CHARS == 100_000


def test_the_build_fixes_the_c_allocators_thresholds_where_it_is_glibc() -> None:
    """A fixed mmap threshold keeps a long build's RSS flat (``streampack.builder.tasks``); only glibc's
    malloc is set, and only once."""
    import platform

    from streampack.builder.tasks import steady_allocator

    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert steady_allocator() is glibc
    assert steady_allocator() is glibc  # idempotent

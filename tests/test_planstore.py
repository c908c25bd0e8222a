"""Stored plans (``CACHE/layouts/KEY/``) are checked before use: a damaged one is planned again where the
cache is writable and refused, naming it, where it is not; ``verify`` checks every plan file."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import subprocess
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import streampack
from streampack.errors import CacheError
from streampack.format import with_checksum
from tests.conftest import run_cli, write_jsonl

SEQ_LEN = 256


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory, gpt2_tokenizer: Path) -> tuple[Path, np.ndarray]:
    """A real GPT-2 cache of several shards with a stored packed plan, and the rows that plan serves."""
    root = tmp_path_factory.mktemp("plans")
    words = [
        "the",
        "plan",
        "decides",
        "which",
        "tokens",
        "every",
        "sample",
        "holds",
        "on",
        "every",
        "rank",
        "and",
        "in",
        "every",
        "run",
    ]
    records = [
        {"text": " ".join(words[(i + j) % len(words)] for j in range(5 + i * 7 % 300))} for i in range(600)
    ]
    streampack.build(
        write_jsonl(root / "in.jsonl", records),
        root / "cache",
        tokenizer=str(gpt2_tokenizer),
        unit_bytes=1 << 16,
    )
    samples = streampack.open(root / "cache").packed(SEQ_LEN)
    assert streampack.open(root / "cache").num_shards >= 3 and samples.layout.directory is not None
    return root / "cache", np.asarray(samples[np.arange(len(samples))]).copy()


@pytest.fixture
def cache(pristine: tuple[Path, np.ndarray], tmp_path: Path) -> Path:
    shutil.copytree(pristine[0], tmp_path / "cache")
    return tmp_path / "cache"


def plan_dir(cache: Path) -> Path:
    (found,) = (cache / "layouts").glob(f"packed-{SEQ_LEN}-*")
    return found


def poke(name: str, change: Callable[[np.ndarray], None], *, forge: bool = False) -> Callable[[Path], None]:
    """Change one array of the plan; with ``forge``, record its new checksum too (a plan whose files all
    match their checksums but whose values lie)."""
    dtype = "<i4" if name == "lengths" else "<i8"

    def damage(plan: Path) -> None:
        values = np.fromfile(plan / f"{name}.bin", dtype=dtype)
        change(values)
        values.tofile(plan / f"{name}.bin")
        if forge:
            facts = json.loads((plan / "plan.json").read_text())
            facts["files"][f"{name}.bin"]["crc32"] = f"crc32:{zlib.crc32(values.tobytes()):08x}"
            (plan / "plan.json").write_text(json.dumps(with_checksum(facts)))

    return damage


def set_at(index: int, value: int | None = None, add: int = 0) -> Callable[[np.ndarray], None]:
    def change(values: np.ndarray) -> None:
        values[index] = values[index] + add if value is None else value

    return change


def edit_json(change: Callable[[dict], None], *, rechecksum: bool) -> Callable[[Path], None]:
    def damage(plan: Path) -> None:
        facts = json.loads((plan / "plan.json").read_text())
        change(facts)
        (plan / "plan.json").write_text(json.dumps(with_checksum(facts) if rechecksum else facts))

    return damage


DAMAGES: dict[str, Callable[[Path], None]] = {
    "lo shifted, in range": poke("lo", set_at(5, add=100)),
    "lo far out of range": poke("lo", set_at(5, value=10**12)),
    "lo out of range, checksums forged": poke("lo", set_at(5, value=10**12), forge=True),
    "a sample over seq_len, checksums forged": poke("lengths", set_at(0, add=SEQ_LEN), forge=True),
    "a shard out of range, checksums forged": poke("shards", set_at(3, value=99), forge=True),
    "an empty sample, checksums forged": poke("starts", set_at(1, value=0), forge=True),
    "lengths truncated": lambda plan: os.truncate(plan / "lengths.bin", 100),
    "starts grown": lambda plan: (plan / "starts.bin").open("ab").write(b"\0" * 8),
    "shards deleted": lambda plan: (plan / "shards.bin").unlink(),
    "plan.json deleted": lambda plan: (plan / "plan.json").unlink(),
    "plan.json truncated": lambda plan: os.truncate(plan / "plan.json", 40),
    "plan.json edited": edit_json(lambda f: f.update(dropped=3), rechecksum=False),
    "plan.json of other settings": edit_json(lambda f: f.update(seq_len=128), rechecksum=True),
    "a plan written before checksums": lambda plan: (plan / "plan.json").write_text(
        json.dumps(
            {
                "counts": {
                    k: v["count"] for k, v in json.loads((plan / "plan.json").read_text())["files"].items()
                },
                "dropped": 0,
            }
        )
    ),
    "a folder where the plan was": lambda plan: (shutil.rmtree(plan), plan.mkdir()),  # type: ignore[func-returns-value]
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_plan_is_found_by_verify_and_planned_again_by_a_reader(
    cache: Path, pristine: tuple[Path, np.ndarray], damage: str
) -> None:
    """A2/B3: verify names the plan; a reader re-plans it (the cache is writable) and serves every sample
    as the sound plan did; the next verify finds the new plan sound."""
    DAMAGES[damage](plan_dir(cache))
    report = streampack.verify(cache)
    assert not report.ok and all(str(plan_dir(cache)) in p and "delete" in p for p in report.problems), report
    result = run_cli("verify", cache, check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr and "layouts" in result.stderr
    samples = streampack.open(cache).packed(SEQ_LEN)
    assert np.array_equal(samples[np.arange(len(samples))], pristine[1])
    assert streampack.verify(cache).ok, streampack.verify(cache).problems
    assert [p.name for p in (cache / "layouts").iterdir()] == [plan_dir(cache).name]  # nothing left aside


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """``path`` read-only for this process: without write permission, or (for root, whom permissions do
    not stop) a read-only bind mount of it on itself."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [path, *path.rglob("*")]}
        for p in modes:
            p.chmod(modes[p] & ~0o222)
        try:
            yield
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
        return
    mounted = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot make a read-only directory here: {mounted.stderr.decode().strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], check=True, capture_output=True)
        yield
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True)  # maps may still be open


def test_a_damaged_plan_in_a_read_only_cache_is_refused_naming_it_and_the_fix(cache: Path) -> None:
    plan = plan_dir(cache)
    DAMAGES["lo shifted, in range"](plan)
    with read_only(cache):
        with pytest.raises(CacheError, match=rf"{plan}/lo\.bin: checksum .*not writable.* delete {plan}"):
            streampack.open(cache).packed(SEQ_LEN)
        assert streampack.open(cache).packed(SEQ_LEN // 2).layout.directory is None  # a new plan: in memory


def test_a_copy_in_another_process_maps_the_checked_plan_and_refuses_one_damaged_since(
    cache: Path, pristine: tuple[Path, np.ndarray]
) -> None:
    samples = streampack.open(cache).packed(SEQ_LEN)
    state = pickle.dumps(samples)
    assert len(state) < 4000  # the plan's folder and checksum travel, not its arrays
    assert np.array_equal(pickle.loads(state)[np.arange(len(samples))], pristine[1])
    code = (
        "import pickle, sys, numpy as np; s = pickle.loads(sys.stdin.buffer.read()); "
        "print(int(np.asarray(s[np.arange(len(s))]).sum()))"
    )
    fresh = subprocess.run(["python", "-c", code], input=state, capture_output=True, check=True)
    assert int(fresh.stdout) == int(pristine[1].astype(np.int64).sum())
    DAMAGES["lo shifted, in range"](plan_dir(cache))  # rewritten: another file, checked again
    with pytest.raises(CacheError, match=r"lo\.bin: checksum"):
        pickle.loads(state)


def test_verify_lists_what_it_does_not_know_and_leftovers(cache: Path) -> None:
    (cache / "notes.txt").write_text("mine")
    (cache / "shards" / "000099.tokens").write_bytes(b"")
    (cache / "ledger" / "000000.json.tmp").write_text("{")
    (cache / "layouts" / ".planning-x1").mkdir()
    (plan_dir(cache) / "extra.bin").write_bytes(b"1")
    (cache / "layouts" / "somewhere").mkdir()
    report = streampack.verify(cache)
    assert report.ok, report.problems
    listed = "\n".join(report.notes)
    for name in ("notes.txt", "000099.tokens", "000000.json.tmp", ".planning-x1", "extra.bin", "somewhere"):
        assert name in listed, listed
    result = run_cli("verify", cache)
    assert result.stdout.count("note: ") == 6 and "ok: " in result.stdout


def test_verify_checks_the_plans_and_ledger_in_its_byte_count(
    cache: Path, pristine: tuple[Path, np.ndarray]
) -> None:
    with_plan = streampack.verify(cache)
    shutil.rmtree(cache / "layouts")
    without = streampack.verify(cache)
    assert with_plan.ok and without.ok
    plan_bytes = sum(p.stat().st_size for p in plan_dir(pristine[0]).glob("*.bin"))
    assert with_plan.bytes_checked - without.bytes_checked == plan_bytes


@contextlib.contextmanager
def full_filesystem(path: Path, room: int) -> Iterator[Path]:
    """A tmpfs of ``room`` bytes mounted at ``path`` (root only), and a function that fills what is left of
    it: a disk full for real, not a mock of one."""
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={room}", "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True)  # maps may still be open


def fill(path: Path) -> None:
    """Write ``path/filler`` until the file system it is on is full."""
    with open(path / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)


def test_a_plan_on_a_full_disk_is_kept_in_memory_with_a_warning_naming_the_folder(
    pristine: tuple[Path, np.ndarray], tmp_path: Path
) -> None:
    """A plan that cannot be written (ENOSPC) is the in-memory plan a read-only cache gets, the same as the
    stored one (its counts too: planned again, not counted twice), with a warning naming the folder;
    nothing of it is left in ``layouts/``. A damaged plan there is refused, naming it and the fix."""
    writable = tmp_path / "writable"
    shutil.copytree(pristine[0], writable, ignore=shutil.ignore_patterns("layouts"))
    stored = streampack.open(writable).packed(64, too_long="drop")
    assert stored.layout.directory is not None and stored.layout.dropped > 0
    size = sum(p.stat().st_size for p in writable.rglob("*") if p.is_file())
    with full_filesystem(tmp_path / "small", size + (1 << 20)) as small:
        shutil.copytree(writable, small / "cache", ignore=shutil.ignore_patterns("layouts"))
        fill(small)
        layouts = small / "cache" / "layouts"
        with pytest.warns(
            RuntimeWarning, match=rf"{layouts}: cannot store the plan packed-64-\w+ there \(No space"
        ):
            held = streampack.open(small / "cache").packed(64, too_long="drop")
        assert held.layout.directory is None and list(layouts.iterdir()) == []
        assert (held.layout.dropped, held.layout.no_target) == (
            stored.layout.dropped,
            stored.layout.no_target,
        )
        np.testing.assert_array_equal(held[np.arange(len(held))], stored[np.arange(len(stored))])
        os.remove(small / "filler")
        plan = Path(streampack.open(small / "cache").packed(SEQ_LEN).layout.directory)  # type: ignore[arg-type]
        DAMAGES["lo shifted, in range"](plan)
        fill(small)
        with pytest.raises(
            CacheError, match=rf"{plan}/lo\.bin: checksum .*No space.* delete {plan}.*free space"
        ):
            streampack.open(small / "cache").packed(SEQ_LEN)

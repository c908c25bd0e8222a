"""Data-wait metrics (``Loader.metrics()``) from real runs: a slow source, real DataLoader workers, a cache in
a real S3 server (moto's). Metrics are not data: only relations are asserted, never a wall-clock bound."""

from __future__ import annotations

import random
import time
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import streampack
from streampack.loader import Loader
from streampack.loader.metrics import METRICS, per_step
from streampack.order.mixture import Mixture
from tests.conftest import s3_options, write_jsonl

from .reference_model import Corpus, Whole, _samples

ROWS, WIDTH = 4, 33


class SlowSource:
    """Samples of ``WIDTH`` tokens (``i`` repeated) that take ``delay`` seconds a read: a slow disk."""

    def __init__(self, size: int, delay: float) -> None:
        self.size, self.delay = size, delay
        self.dtype, self.width = np.dtype(np.uint16), WIDTH

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, indices: np.ndarray) -> np.ndarray:
        time.sleep(self.delay)
        return np.repeat(np.asarray(indices, dtype=np.uint16)[:, None], WIDTH, axis=1)


def _check_totals(metrics: dict[str, Any], lasts: list[dict[str, Any]]) -> None:
    """Each total is the sum of the batches' values, and ``batches`` their count."""
    assert metrics["batches"] == len(lasts)
    for name in METRICS:
        assert metrics[f"total_{name}"] == pytest.approx(sum(last[name] for last in lasts)), name


def test_a_loop_waits_for_what_the_loader_makes_and_not_for_its_own_work() -> None:
    loader = Loader(SlowSource(64, 0.01), batch_size=ROWS, seed=1)
    lasts, working = [], 0.0
    started = time.perf_counter()
    for batch in islice(loader, 6):
        lasts.append(loader.metrics())
        busy = time.perf_counter()
        time.sleep(0.02)  # the trainer's step: not a wait
        working += time.perf_counter() - busy
        assert batch.shape == (ROWS, WIDTH)
    elapsed = time.perf_counter() - started
    for last in lasts:
        # In one process the loop waits while the batch is made, and a little more (the position moves).
        assert last["data_wait_s"] >= last["make_s"] > 0
        assert last["bytes_read"] == ROWS * WIDTH * 2  # uint16 rows, every token read
        assert last["prefetch_hits"] == last["prefetch_misses"] == 0  # a local source
    metrics = loader.metrics()
    _check_totals(metrics, lasts)
    assert metrics["total_data_wait_s"] <= elapsed - working


def test_dataloader_workers_report_their_reads_and_the_main_process_its_wait() -> None:
    torch_module = pytest.importorskip("streampack.torch")
    loader = Loader(SlowSource(256, 0.02), batch_size=ROWS, seed=2, output="numpy")
    data = torch_module.DataLoader(loader, num_workers=2, prefetch_factor=4)
    lasts = []
    for batch in islice(data, 10):
        lasts.append(loader.metrics())
        time.sleep(0.2)  # a slow trainer: the workers make the next batches meanwhile
        assert tuple(batch.shape) == (ROWS, WIDTH)
    metrics = loader.metrics()
    _check_totals(metrics, lasts)
    assert all(last["make_s"] > 0 and last["bytes_read"] == ROWS * WIDTH * 2 for last in lasts)
    # Made ahead by the workers while the trainer worked, the later batches cost it less than their making.
    waited = sum(last["data_wait_s"] for last in lasts[2:])
    assert 0 < waited < sum(last["make_s"] for last in lasts[2:])


def test_dict_batches_through_a_dataloader_are_counted_with_and_without_workers(tmp_path: Path) -> None:
    torch_module = pytest.importorskip("streampack.torch")
    cache = _cache(tmp_path)
    loader = Loader(cache.sequences(16), batch_size=ROWS, seed=3, output="dict")
    served = list(islice(torch_module.DataLoader(loader, num_workers=1), 5))
    assert len(served) == 5 and set(served[0]) == {"input_ids", "labels", "position_ids"}
    metrics = loader.metrics()
    assert metrics["batches"] == 5 and metrics["total_bytes_read"] == 5 * ROWS * 16 * cache.dtype.itemsize
    loader = Loader(cache.sequences(16), batch_size=ROWS, seed=3, output="dict")
    list(islice(torch_module.DataLoader(loader, num_workers=0), 3))
    metrics = loader.metrics()
    assert metrics["batches"] == 3 and metrics["data_wait_s"] >= metrics["make_s"] > 0


def _cache(root: Path) -> streampack.Cache:
    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", "tokens", "cache"]
    records = [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(3, 80)))} for _ in range(120)]
    streampack.build([write_jsonl(root / "in.jsonl", records)], root / "cache", progress=False)
    return streampack.open(root / "cache")


def test_bytes_read_are_the_tokens_of_the_samples_without_their_padding(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    samples = _samples(Corpus.read(cache), Whole(32, packed=True, too_long="split"))
    mix = Mixture(
        {"packed": cache.packed(32, too_long="split"), "windows": cache.sequences(32)},
        weights={"packed": 0.5, "windows": 0.5},
        block_size=8,
        seed=4,
    )
    loader = Loader(mix, batch_size=ROWS, output="dict")
    for batch in islice(loader, 12):
        expected = sum(
            32 - samples[sample].pad if source == 0 else 32
            for source, sample in zip(*loader.picks(loader.position - ROWS), strict=True)
        )
        assert loader.metrics()["bytes_read"] == expected * cache.dtype.itemsize
        assert batch["input_ids"].shape == (ROWS, 32)


def test_per_step_divides_what_the_steps_since_the_last_log_added() -> None:
    loader = Loader(SlowSource(64, 0.0), batch_size=ROWS, seed=1)
    list(islice(loader, 2))
    before = loader.metrics()
    list(islice(loader, 4))
    now = loader.metrics()
    logged = per_step(now, before, 2)  # 4 batches in 2 trainer steps (gradient accumulation 2)
    assert logged["data/bytes_read"] == 2 * ROWS * WIDTH * 2
    assert logged["data/wait_s"] == pytest.approx(
        (now["total_data_wait_s"] - before["total_data_wait_s"]) / 2
    )
    assert per_step(now, None, 6)["data/bytes_read"] == ROWS * WIDTH * 2
    assert per_step(now, before, 0) == {}


@pytest.mark.slow
def test_prefetch_hits_over_object_storage_are_the_files_found_fetched_ahead(
    tmp_path: Path, s3_endpoint: str
) -> None:
    pytest.importorskip("s3fs", reason="reading from S3 needs s3fs (the dev extra has it)")
    import s3fs

    rng = random.Random(5)
    words = ["alpha", "beta", "gamma", "delta"]
    texts = [[{"text": " ".join(rng.choices(words, k=40))} for _ in range(60)] for _ in range(40)]
    inputs = [write_jsonl(tmp_path / f"{i:02d}.jsonl", records) for i, records in enumerate(texts)]
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True)
    fs.mkdir("metrics")
    options = s3_options(s3_endpoint)
    build = {"unit_bytes": 1 << 16, "workers": 1, "commit_seconds": 0, "progress": False}
    streampack.build(
        inputs, "s3://metrics/c", staging_dir=str(tmp_path / "stage"), storage_options=options, **build
    )
    remote = streampack.open(
        "s3://metrics/c", local_dir=tmp_path / "copy", storage_options=options, prefetch_steps=4
    )
    assert remote.num_shards >= 6, "the test needs several shards"
    store = remote.store
    loader = Loader(remote.sequences(64), batch_size=2, seed=3, epochs=1)
    batches = iter(loader)
    next(batches)
    prefetcher = loader._prefetcher
    assert prefetcher is not None
    deadline = time.monotonic() + 30
    while prefetcher.fetched == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    rest = list(batches)
    metrics = loader.metrics()
    assert metrics["batches"] == 1 + len(rest)
    # Every shard file the loop mapped was found local (fetched ahead) or waited for; the first batch waits.
    assert metrics["total_prefetch_hits"] == store.prefetch_hits > 0
    assert metrics["total_prefetch_misses"] == store.prefetch_misses > 0
    assert (
        store.prefetch_hits <= prefetcher.fetched
    )  # a fresh local copy: only the prefetcher made files ahead
    assert store.downloads <= store.prefetch_misses + prefetcher.fetched
    assert metrics["total_bytes_read"] == metrics["batches"] * 2 * 64 * remote.dtype.itemsize
    loader.close()
    # Through DataLoader workers, each worker's maps come back with its batches: every shard is read.
    torch_module = pytest.importorskip("streampack.torch")
    again = streampack.open("s3://metrics/c", local_dir=tmp_path / "again", storage_options=options)
    loader = Loader(again.sequences(64), batch_size=2, seed=3, epochs=1)
    list(torch_module.DataLoader(loader, num_workers=2))
    metrics = loader.metrics()
    assert metrics["total_prefetch_hits"] + metrics["total_prefetch_misses"] >= again.num_shards
    assert metrics["total_prefetch_misses"] > 0 and metrics["batches"] == len(loader)

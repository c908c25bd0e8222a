"""Reading a cache in object storage through a bounded local copy: a real S3 server (moto's, on
127.0.0.1) driven through s3fs, real subprocesses and DataLoader workers, no mocks."""

from __future__ import annotations

import gc
import json
import os
import pickle
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import streampack
from streampack.errors import CacheError, OptionsError
from streampack.loader import Exclusions, prefetch
from streampack.loader.exclusions import token_hash
from streampack.store.localcopy import BLOCK, CachedStore, default_local_dir
from tests.conftest import CREDENTIALS, run_cli, s3_options, write_jsonl

pytest.importorskip("s3fs", reason="reading from S3 needs s3fs (the dev extra has it)")

BUILD = {"unit_bytes": 1 << 16, "workers": 2, "commit_seconds": 0}
SEQ_LEN = 64
LONG = 2048  # an epoch of a few hundred steps


@pytest.fixture(scope="module")
def built(
    tmp_path_factory: pytest.TempPathFactory, bpe_tokenizer: Path, s3_endpoint: str
) -> tuple[str, Path, int, int]:
    """One cache of many small shards, built to S3 and locally: its URL, the local build, the total
    and the largest size of its shard files (in blocks, as the bound counts them)."""
    import s3fs

    root = tmp_path_factory.mktemp("remote-read")
    rng = random.Random(5)
    words = ["alpha", "beta", "gamma", "delta", "Ünïcödé", "🙂", "tokens", "cache", "\n"]
    inputs = [
        write_jsonl(
            root / f"{i:02d}.jsonl",
            [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(5, 150)))} for _ in range(60)],
        )
        for i in range(96)
    ]  # small files, grouped into small units (hence shards)
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True)
    fs.mkdir("reads")
    url = "s3://reads/c"
    streampack.build(
        inputs,
        url,
        tokenizer=str(bpe_tokenizer),
        staging_dir=str(root / "stage"),
        storage_options=s3_options(s3_endpoint),
        **BUILD,
    )
    local = root / "local"
    streampack.build(inputs, local, tokenizer=str(bpe_tokenizer), **BUILD)
    sizes: dict[str, int] = {}
    for path in (local / "shards").iterdir():
        blocks = -(-path.stat().st_size // BLOCK) * BLOCK
        sizes[path.stem] = sizes.get(path.stem, 0) + blocks
    assert len(sizes) >= 40, "the test needs many small shards"
    return url, local, sum(sizes.values()), max(sizes.values())


def shard_disk_use(local_dir: Path) -> int:
    """What the shard files of a local copy take: their lengths and their allocated blocks, the larger.

    Files are told apart by inode: a scan that runs while a download is renamed into place may list it
    under both names."""
    found = {}
    with os.scandir(local_dir / "shards") as entries:
        for entry in entries:
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            found[st.st_ino] = max(-(-st.st_size // BLOCK) * BLOCK, st.st_blocks * 512)
    return sum(found.values())


class DiskSampler:
    """Samples the disk use of a local copy every few milliseconds, in a thread, while running."""

    def __init__(self, local_dir: Path) -> None:
        self.local_dir, self.peak, self.samples = local_dir, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> DiskSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, shard_disk_use(self.local_dir))
            self.samples += 1


def epoch(seqs: Any, workers: int | None = None) -> list[np.ndarray]:
    # Two windows a step: a step reads at most four shards, in each process.
    loader = streampack.Loader(seqs, batch_size=2, seed=3, epochs=1)
    if workers is None:
        return [np.asarray(batch) for batch in loader]
    from streampack.torch import DataLoader

    return [batch.numpy() for batch in DataLoader(loader, num_workers=workers)]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [None, 2], ids=["in-process", "2-dataloader-workers"])
def test_an_epoch_through_a_local_copy_at_a_quarter_of_the_cache_stays_in_the_bound_and_equals_local(
    tmp_path: Path, built: tuple[str, Path, int, int], s3_endpoint: str, workers: int | None
) -> None:
    url, local, total, largest = built
    if workers:
        pytest.importorskip("torch")
    bound = total // 4
    assert bound >= 3 * largest
    remote = streampack.open(
        url, local_dir=tmp_path / "copy", max_local_bytes=bound, storage_options=s3_options(s3_endpoint)
    )
    with DiskSampler(tmp_path / "copy") as disk:
        got = epoch(remote.sequences(LONG, overlap=1), workers)
    expected = epoch(streampack.open(local).sequences(LONG, overlap=1))
    assert len(got) == len(expected) > 20
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
    assert disk.samples > 10
    assert 0 < disk.peak <= bound
    assert shard_disk_use(tmp_path / "copy") <= bound


def test_packed_samples_through_a_small_local_copy_equal_the_local_caches(
    tmp_path: Path, built: tuple[str, Path, int, int], s3_endpoint: str
) -> None:
    url, local, total, _ = built
    remote = streampack.open(
        url, local_dir=tmp_path / "copy", max_local_bytes=total // 4, storage_options=s3_options(s3_endpoint)
    )
    got = remote.packed(SEQ_LEN)
    expected = streampack.open(local).packed(SEQ_LEN)
    picks = np.random.default_rng(0).permutation(len(expected))[:200]
    assert np.array_equal(got[picks], expected[picks])
    assert shard_disk_use(tmp_path / "copy") <= total // 4


READ_ALL = """
import json, sys
import streampack
cache = streampack.open(sys.argv[1], local_dir=sys.argv[2], storage_options=json.loads(sys.argv[3]))
total = sum(int(cache.doc(i).sum()) for i in range(cache.num_docs))
print(json.dumps({"downloads": cache.store.downloads, "total": total}))
"""


def read_all_in_processes(count: int, url: str, local_dir: Path, endpoint: str) -> list[dict[str, int]]:
    env = {**os.environ, **CREDENTIALS, "PYTHONPATH": os.getcwd()}
    args = [sys.executable, "-c", READ_ALL, url, str(local_dir), json.dumps(s3_options(endpoint))]
    procs = [
        subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) for _ in range(count)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()
        results.append(json.loads(out))
    return results


@pytest.mark.slow
def test_processes_sharing_a_local_copy_download_each_file_once(
    tmp_path: Path, built: tuple[str, Path, int, int], s3_endpoint: str
) -> None:
    url, local, _, _ = built
    files = len(list((local / "shards").iterdir()))
    together = read_all_in_processes(2, url, tmp_path / "copy", s3_endpoint)
    assert together[0]["total"] == together[1]["total"]
    assert sum(r["downloads"] for r in together) == files  # concurrent readers: never the same file twice
    (later,) = read_all_in_processes(1, url, tmp_path / "copy", s3_endpoint)
    assert later == {"downloads": 0, "total": together[0]["total"]}  # a later process downloads nothing


def test_a_damaged_object_is_refused_naming_its_key_and_nothing_is_kept(
    tmp_path: Path, built: tuple[str, Path, int, int], s3_endpoint: str, bucket: tuple[Any, str]
) -> None:
    fs, name = bucket
    fs.cp("reads/c", f"{name}/c", recursive=True)
    key = f"{name}/c/shards/000002.tokens"
    data = bytearray(fs.cat_file(key))
    data[len(data) // 2] ^= 0x01  # one flipped bit, same size
    fs.pipe_file(key, bytes(data))
    cache = streampack.open(
        f"s3://{name}/c", local_dir=tmp_path / "copy", storage_options=s3_options(s3_endpoint)
    )
    first = int(cache.doc_starts[2])
    cache.doc(0)  # another shard reads fine
    with pytest.raises(
        CacheError, match=rf"s3://{name}/c/shards/000002\.tokens: the object's checksum is crc32:"
    ):
        cache.doc(first)
    assert not [p for p in (tmp_path / "copy" / "shards").iterdir() if p.name.startswith("000002.tokens")]


def test_a_bound_smaller_than_the_largest_shard_is_refused(
    tmp_path: Path, built: tuple[str, Path, int, int], s3_endpoint: str
) -> None:
    url, _, _, largest = built
    refused = rf"max_local_bytes=4096 is smaller than the largest shard of {url} \({largest} bytes"
    with pytest.raises(OptionsError, match=refused):
        streampack.open(
            url, local_dir=tmp_path / "c", max_local_bytes=4096, storage_options=s3_options(s3_endpoint)
        )
    with pytest.raises(OptionsError, match="apply to caches in object storage"):
        streampack.open(tmp_path, max_local_bytes=1 << 20)


def test_samples_of_a_remote_cache_pickle_its_url_and_reopen_through_the_same_local_copy(
    tmp_path: Path, built: tuple[str, Path, int, int], s3_endpoint: str
) -> None:
    url, local, _, _ = built
    secret = {**s3_options(s3_endpoint), "secret": "hunter2"}
    remote = streampack.open(url, local_dir=tmp_path / "copy", storage_options=s3_options(s3_endpoint))
    seqs = remote.sequences(SEQ_LEN)
    ref = seqs.cache_ref
    assert ref.uri == url and seqs.path == url
    shown = repr(streampack.store.CacheRef(url, ref.content, reading={"storage_options": secret}))
    assert "hunter2" not in shown
    copy = pickle.loads(pickle.dumps(seqs))
    assert np.array_equal(copy[:5], streampack.open(local).sequences(SEQ_LEN)[:5])
    assert (
        isinstance(copy.cache.store, CachedStore) and copy.cache.store.root == (tmp_path / "copy").absolute()
    )


def prefetching_copy(url: str, tmp_path: Path, total: int, endpoint: str) -> streampack.Cache:
    """The remote cache through a local copy of half its size, prefetching 4 steps ahead."""
    return streampack.open(
        url,
        local_dir=tmp_path / "copy",
        max_local_bytes=total // 2,
        storage_options=s3_options(endpoint),
        prefetch_steps=4,
    )


@pytest.mark.slow
def test_prefetch_fetches_the_next_steps_shards_in_the_background(
    tmp_path: Path, built: tuple[str, Path, int, int], s3_endpoint: str
) -> None:
    url, local, total, _ = built
    remote = prefetching_copy(url, tmp_path, total, s3_endpoint)
    loader = streampack.Loader(remote.sequences(LONG), batch_size=2, seed=3, epochs=1)
    batches = iter(loader)
    first = next(batches)
    prefetcher = loader._prefetcher
    assert prefetcher is not None
    deadline = time.monotonic() + 30
    while prefetcher.fetched == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert prefetcher.fetched > 0  # fetched while the loop was idle
    rest = list(batches)
    expected = list(streampack.Loader(streampack.open(local).sequences(LONG), batch_size=2, seed=3, epochs=1))
    assert all(np.array_equal(a, b) for a, b in zip([first, *rest], expected, strict=True))
    assert shard_disk_use(tmp_path / "copy") <= total // 2
    # What the prefetcher asked: the files of the next steps' shards, each once, of the local copy only.
    files = loader.lookahead(0, 4)
    assert loader.prefetch_steps == 4 and files and len(set(files)) == len(files)
    assert all(isinstance(store, CachedStore) and store.exists(key) for store, key in files)
    local_loader = streampack.Loader(streampack.open(local).sequences(LONG), batch_size=2, seed=3)
    assert local_loader.prefetch_steps == 0 and local_loader.lookahead(0, 4) == []


@pytest.mark.slow
def test_skip_exclusions_over_a_remote_cache_with_prefetch_serve_the_local_batches_through_a_resume(
    tmp_path: Path, built: tuple[str, Path, int, int], s3_endpoint: str
) -> None:
    """Documents, positions and hashes taken out (mode skip) of a cache in object storage, read for an
    epoch while the prefetch thread fetches the next steps' shards into a copy of half the cache's size (so
    shards are evicted and fetched again), resumed from a state in the middle in a new local copy: every
    batch is the one the same cache gives locally."""
    url, local, total, _ = built
    here = streampack.open(local)
    documents = list(range(5, here.num_docs, here.num_docs // 7))  # a few, in every part of the cache
    hashes = [token_hash(here.doc(i)) for i in (here.num_docs // 3, here.num_docs - 2)]  # found by reading
    exclude = [Exclusions(documents=documents), Exclusions(positions=[(20, 26)]), Exclusions(hashes=hashes)]

    def loader(cache: streampack.Cache) -> streampack.Loader:
        return streampack.Loader(cache.sequences(LONG), batch_size=2, seed=3, epochs=1, exclude=exclude)

    expected = [np.asarray(batch) for batch in loader(here)]
    half = len(expected) // 2
    with loader(prefetching_copy(url, tmp_path / "first", total, s3_endpoint)) as first:
        batches = iter(first)
        head = [np.asarray(next(batches)) for _ in range(half)]
        assert first._prefetcher is not None and first._prefetcher.fetched > 0  # the thread ran meanwhile
        state = json.loads(json.dumps(first.state_dict()))
    assert state["exclusions"] and state["position"] == 2 * half
    with loader(prefetching_copy(url, tmp_path / "second", total, s3_endpoint)) as resumed:
        resumed.load_state_dict(state)
        tail = [np.asarray(batch) for batch in resumed]
    # The exclusions took something out: the epoch without them is longer.
    plain = streampack.Loader(here.sequences(LONG), batch_size=2, seed=3, epochs=1)
    assert len(expected) > 20 and len(plain) > len(expected)
    assert len(head) + len(tail) == len(expected)
    for step, (got, want) in enumerate(zip(head + tail, expected, strict=True)):
        np.testing.assert_array_equal(got, want, err_msg=f"step {step}")


def prefetch_threads() -> list[threading.Thread]:
    """The streampack prefetch threads alive in this process."""
    return [t for t in threading.enumerate() if t.name.startswith(prefetch.THREAD_PREFIX) and t.is_alive()]


def no_prefetch_threads_left() -> None:
    """Let the threads of loaders that earlier tests dropped end (their finalizers stop them)."""
    gc.collect()
    for thread in prefetch_threads():
        thread.join(timeout=30)
    assert prefetch_threads() == []


@pytest.mark.slow
def test_close_stops_the_prefetch_thread_and_a_later_batch_starts_a_new_one(
    tmp_path: Path, built: tuple[str, Path, int, int], s3_endpoint: str
) -> None:
    url, local, total, _ = built
    no_prefetch_threads_left()
    remote = prefetching_copy(url, tmp_path, total, s3_endpoint)
    expected = list(streampack.Loader(streampack.open(local).sequences(LONG), batch_size=2, seed=3, epochs=1))
    with streampack.Loader(remote.sequences(LONG), batch_size=2, seed=3, epochs=1) as loader:
        batches = iter(loader)
        head = [next(batches) for _ in range(3)]
        (first,) = prefetch_threads()
        assert loader._prefetcher is not None and first.name == loader._prefetcher.name
    assert not first.is_alive() and prefetch_threads() == []  # close() joined it
    loader.close()  # again: nothing more to do
    # The loader stays usable after close(): the next batch starts a new thread, from where it stood.
    rest = list(batches)
    (second,) = prefetch_threads()
    assert second.name != first.name
    loader.close()
    assert not second.is_alive() and prefetch_threads() == []
    assert all(np.array_equal(a, b) for a, b in zip([*head, *rest], expected, strict=True))


def test_a_loader_dropped_without_close_stops_its_prefetch_thread(
    tmp_path: Path, built: tuple[str, Path, int, int], s3_endpoint: str
) -> None:
    url, _, total, _ = built
    no_prefetch_threads_left()
    remote = prefetching_copy(url, tmp_path, total, s3_endpoint)
    loader = streampack.Loader(remote.sequences(LONG), batch_size=2, seed=3)
    loader.batch(0)
    (thread,) = prefetch_threads()
    del loader
    gc.collect()
    thread.join(timeout=30)  # the finalizer told it to stop: it ends without being joined by anyone
    assert not thread.is_alive()


@pytest.mark.slow
def test_verify_of_a_url_reads_the_objects_not_a_local_copy(
    tmp_path: Path,
    built: tuple[str, Path, int, int],
    s3_endpoint: str,
    bucket: tuple[Any, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """B1: a damaged object is found although an earlier read left its good copy where the CLI looks."""
    fs, name = bucket
    fs.cp("reads/c", f"{name}/c", recursive=True)
    url = f"s3://{name}/c"
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the CLI's default local copies go under tmp_path
    sound = run_cli("verify", url)
    assert sound.stdout.startswith(f"ok: {url} (") and "from object storage" in sound.stdout
    assert not (tmp_path / "streampack-read").exists()  # streamed through the checks, nothing kept
    default_copy = tmp_path / "streampack-read" / default_local_dir(url).name
    cache = streampack.open(url, local_dir=default_copy, storage_options=s3_options(s3_endpoint))
    for shard in range(cache.num_shards):
        cache.shard_tokens(shard)  # the good copies are local now
    key = f"{name}/c/shards/000002.tokens"
    data = bytearray(fs.cat_file(key))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(key, bytes(data))
    damaged = run_cli("verify", url, check=False)
    assert damaged.returncode == 1, damaged.stdout
    assert damaged.stderr.startswith(f"error: {url}/shards/000002.tokens: checksum crc32:"), damaged.stderr
    report = streampack.verify(url, storage_options=s3_options(s3_endpoint))
    assert report.path == url and len(report.problems) == 1 and report.problems[0].startswith(url)


@pytest.mark.slow
def test_info_of_a_url_shows_the_url_as_the_path_and_the_local_copy_apart(
    tmp_path: Path, built: tuple[str, Path, int, int], s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, local, _, _ = built
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    copy = tmp_path / "streampack-read" / default_local_dir(url).name
    stats = json.loads(run_cli("info", url, "--json").stdout)
    assert stats["path"] == url and stats["local_copy"] == str(copy)
    assert stats["bytes"] == json.loads(run_cli("info", local, "--json").stdout)["bytes"]
    assert "local_copy" not in json.loads(run_cli("info", local, "--json").stdout)
    text = run_cli("info", url).stdout
    assert re.search(rf"^path\s+{re.escape(url)}$", text, re.M) and re.search(
        rf"^local_copy\s+{copy}$", text, re.M
    )
    assert not [p for p in (copy / "shards").iterdir() if ".tokens." in p.name]  # info reads no token file


def test_a_batch_that_its_own_process_cannot_fit_in_the_bound_is_refused_at_once(
    tmp_path: Path, bpe_tokenizer: Path, s3_endpoint: str, bucket: tuple[Any, str]
) -> None:
    """C2: the copies the waiting read itself maps are the ones that leave no room: no other process can
    free them, so it says so at once rather than after WAIT_SECONDS."""
    _, name = bucket
    inputs = [
        write_jsonl(tmp_path / f"{i}.jsonl", [{"text": f"alpha beta {i} gamma " * 30} for _ in range(150)])
        for i in range(2)
    ]
    url = f"s3://{name}/two"
    streampack.build(
        inputs,
        url,
        tokenizer=str(bpe_tokenizer),
        staging_dir=str(tmp_path / "stage"),
        storage_options=s3_options(s3_endpoint),
        unit_bytes=inputs[0].stat().st_size,
        workers=1,
        commit_seconds=0,
    )
    probe = streampack.open(url, local_dir=tmp_path / "probe", storage_options=s3_options(s3_endpoint))
    assert probe.num_shards == 2
    store = probe.store
    assert isinstance(store, CachedStore)
    largest = max(sum(store.expected_blocks(key) for key in probe.shard_keys(s)) for s in range(2))
    cache = streampack.open(
        url,
        local_dir=tmp_path / "copy",
        max_local_bytes=largest,
        prefetch_steps=0,
        storage_options=s3_options(s3_endpoint),
    )
    boundary = int(cache.token_starts[1])
    samples = cache.sequences(SEQ_LEN)
    crossing = boundary // SEQ_LEN
    assert crossing * SEQ_LEN < boundary < (crossing + 1) * SEQ_LEN, "the window must cross the shards"
    with pytest.raises(CacheError, match=r"this process itself maps \d+ bytes .* raise max_local_bytes"):
        samples[crossing]
    assert np.array_equal(samples[crossing - 1], probe.sequences(SEQ_LEN)[crossing - 1])  # one shard fits

"""The lifecycle of a cache read through a local copy (streampack.store.localcopy): no thread
outlives what owns it, and the watcher still does what it is for. A real S3 server (moto's, on 127.0.0.1)
through s3fs, and a real second process; no mocks."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import streampack
from streampack.errors import CacheError
from streampack.store.localcopy import BLOCK, THREAD_NAME, WATCHER, CachedStore
from streampack.testing.caches import write_random_cache
from tests.conftest import CREDENTIALS, s3_options

pytest.importorskip("s3fs", reason="reading from S3 needs s3fs (the dev extra has it)")

SHARDS = 12


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory, s3_endpoint: str) -> tuple[str, int, int]:
    """A cache of a dozen shards in S3: its URL, the blocks of its largest shard, and of them all."""
    import s3fs

    local = write_random_cache(tmp_path_factory.mktemp("lifecycle") / "c", 600_000, num_shards=SHARDS, seed=2)
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True)
    fs.mkdir("life")
    fs.put(str(local) + "/", "life/c", recursive=True)
    sizes: dict[str, int] = {}
    for path in (local / "shards").iterdir():
        sizes[path.stem] = sizes.get(path.stem, 0) + -(-path.stat().st_size // BLOCK) * BLOCK
    return "s3://life/c", max(sizes.values()), sum(sizes.values())


def streampack_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("streampack")]


@pytest.fixture(autouse=True)
def no_thread_before() -> Iterator[None]:
    gc.collect()  # caches of earlier tests, garbage but not yet collected, take their watch back
    assert streampack_threads() == []
    yield


def read_every_shard(cache: streampack.Cache) -> int:
    return sum(int(cache.doc(int(cache.doc_starts[s])).sum()) for s in range(cache.num_shards))


def open_bounded(remote: tuple[str, int, int], local_dir: Path, endpoint: str) -> streampack.Cache:
    url, largest, _ = remote
    return streampack.open(
        url, local_dir=local_dir, max_local_bytes=4 * largest, storage_options=s3_options(endpoint)
    )


@pytest.mark.slow
def test_close_ends_the_watcher_thread_refuses_reads_and_a_second_close_does_nothing(
    tmp_path: Path, remote: tuple[str, int, int], s3_endpoint: str
) -> None:
    cache = open_bounded(remote, tmp_path / "copy", s3_endpoint)
    assert streampack_threads() == []  # opening starts nothing: the first map does
    total = read_every_shard(cache)
    (watcher,) = streampack_threads()
    assert watcher.name == THREAD_NAME and watcher is WATCHER.thread
    cache.close()
    assert not watcher.is_alive() and streampack_threads() == [] and WATCHER.thread is None
    cache.close()
    store = cache.store
    assert isinstance(store, CachedStore)
    store.close()  # closed with the cache already: nothing happens
    with pytest.raises(CacheError, match=r"s3://life/c: the cache was closed; open it again"):
        cache.doc(0)
    with pytest.raises(CacheError, match="the cache was closed"):
        store.map_array("shards/000000.tokens", cache.dtype, 1)
    assert streampack_threads() == []
    with open_bounded(remote, tmp_path / "copy", s3_endpoint) as again:  # a new open reads again
        assert read_every_shard(again) == total


def test_a_with_block_closes_the_cache_and_its_thread(
    tmp_path: Path, remote: tuple[str, int, int], s3_endpoint: str
) -> None:
    with open_bounded(remote, tmp_path / "copy", s3_endpoint) as cache:
        total = read_every_shard(cache)
        assert [t.name for t in streampack_threads()] == [THREAD_NAME]
    assert total > 0 and streampack_threads() == []
    cache.close()  # after the block: nothing happens


def test_one_watcher_thread_serves_every_copy_of_the_process_until_the_last_closes(
    tmp_path: Path, remote: tuple[str, int, int], s3_endpoint: str
) -> None:
    first = open_bounded(remote, tmp_path / "one", s3_endpoint)
    second = open_bounded(remote, tmp_path / "two", s3_endpoint)
    read_every_shard(first)
    read_every_shard(second)
    (watcher,) = streampack_threads()
    first.close()
    assert streampack_threads() == [watcher]  # the second copy is still watched
    second.close()
    assert streampack_threads() == []


def test_a_cache_garbage_collected_without_close_ends_its_thread(
    tmp_path: Path, remote: tuple[str, int, int], s3_endpoint: str
) -> None:
    cache = open_bounded(remote, tmp_path / "copy", s3_endpoint)
    read_every_shard(cache)
    (watcher,) = streampack_threads()
    del cache
    gc.collect()
    assert not watcher.is_alive() and streampack_threads() == []


def test_an_unbounded_copy_starts_no_thread(
    tmp_path: Path, remote: tuple[str, int, int], s3_endpoint: str
) -> None:
    url, _, _ = remote
    with streampack.open(url, local_dir=tmp_path / "copy", storage_options=s3_options(s3_endpoint)) as cache:
        read_every_shard(cache)
        assert streampack_threads() == []


READ_ALL = """
import json, sys
import streampack
from streampack.errors import CacheError
import streampack.store.localcopy
streampack.store.localcopy.WAIT_SECONDS = 20.0  # fail sooner than 60 s if no one releases
cache = streampack.open(sys.argv[1], local_dir=sys.argv[2], max_local_bytes=int(sys.argv[3]),
                        storage_options=json.loads(sys.argv[4]))
total = sum(int(cache.doc(i).sum()) for i in range(cache.num_docs))
print(json.dumps({"downloads": cache.store.downloads, "total": total}))
"""


def read_all_in_a_process(url: str, local_dir: Path, bound: int, endpoint: str) -> dict[str, Any]:
    env = {**os.environ, **CREDENTIALS, "PYTHONPATH": os.getcwd()}
    args = [sys.executable, "-c", READ_ALL, url, str(local_dir), str(bound), json.dumps(s3_options(endpoint))]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_an_idle_process_drops_its_kept_maps_when_another_process_needs_their_room(
    tmp_path: Path, remote: tuple[str, int, int], s3_endpoint: str
) -> None:
    """What the watcher is for: this process keeps maps of the copies that fill the bound, and sits idle
    (in subprocess.run) while another process reads the whole cache through the same copy; only this
    process's watcher thread can drop them, without which the other process gives up."""
    url, largest, total = remote
    bound = 4 * largest
    assert total > 2 * bound
    with open_bounded(remote, tmp_path / "copy", s3_endpoint) as cache:
        for shard in range(4):
            cache.shard_tokens(shard)
            cache.shard_offsets(shard)  # kept in the reader's maps: pinned
        assert len(cache.files._tokens) == 4
        other = read_all_in_a_process(url, tmp_path / "copy", bound, s3_endpoint)
        assert other["downloads"] >= SHARDS * 2 - 8
        assert len(cache.files._tokens) == 0  # dropped by the watcher while the main thread waited
        # and this process still reads, fetching again what the other evicted
        sums = sum(int(cache.doc(i).sum()) for i in range(cache.num_docs))
    assert sums == other["total"]

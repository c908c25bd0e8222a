"""Tests for `streampack.store`: the local store's contract, caches named by URI, and the cache reference
that picklable views carry instead of a local path."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import streampack
from streampack.errors import CacheError
from streampack.grain import DocumentSource
from streampack.store import CacheRef, LocalStore, encode_json, open_store
from streampack.testing.caches import write_cache


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shards = [(np.arange(40) % 50, np.arange(4, 41, 4)) for _ in range(3)]  # 3 shards of 10 documents
    return write_cache(tmp_path_factory.mktemp("store") / "c", shards, vocab_size=50, eos_id=49)


def test_local_store_publishes_whole_objects_and_reads_ranges(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.makedirs("ledger")
    store.put_atomic("ledger/000001.json", encode_json({"b": 1, "a": [1, 2]}))
    store.put_atomic("ledger/000001.json", encode_json({"a": 2}))  # replaced whole, no temp file left
    assert store.list("ledger") == ["000001.json"] and store.list("missing") == []
    assert store.read("ledger/000001.json") == b'{\n  "a": 2\n}\n'
    assert store.read("ledger/000001.json", 4, 7) == b'"a"' and store.size("ledger/000001.json") == 13
    assert store.read_json("ledger/000001.json", what="entry") == {"a": 2}
    with pytest.raises(CacheError, match=r"000002.json: entry not found"):
        store.read_json("ledger/000002.json", what="entry")
    np.arange(5, dtype="<u2").tofile(tmp_path / "a.tokens")
    mapped = store.map_array("a.tokens", np.dtype("<u2"), 3)
    assert type(mapped) is np.ndarray and mapped.tolist() == [0, 1, 2] and not mapped.flags.writeable


def test_shard_arrays_stay_the_same_memory_mapped_views(root: Path) -> None:
    # The loader's batch read slices these directly: the store adds no per-read indirection.
    cache = streampack.open(root)
    tokens = cache.shard_tokens(1)
    assert cache.shard_tokens(1) is tokens and type(tokens) is np.ndarray
    assert isinstance(tokens.base, np.memmap)


def test_a_cache_opens_by_its_file_uri(root: Path) -> None:
    by_uri = streampack.open(root.resolve().as_uri())
    by_path = streampack.open(root)
    assert by_uri.num_shards == by_path.num_shards > 1
    assert [by_uri.doc(i).tolist() for i in range(by_uri.num_docs)] == [
        by_path.doc(i).tolist() for i in range(by_path.num_docs)
    ]
    assert open_store(str(root)).uri == open_store(root.resolve().as_uri()).uri == root.resolve().as_uri()


def test_a_local_store_of_an_object_storage_url_is_refused_with_what_to_do() -> None:
    # streampack.open reads such a cache through a local copy (tests/test_remote_read.py)
    with pytest.raises(CacheError, match=r"s3://bucket/cache: a cache in s3:// storage is read through"):
        open_store("s3://bucket/cache")


def test_samples_pickle_a_cache_reference_not_a_path(root: Path) -> None:
    seqs = streampack.open(root).sequences(8)
    state = seqs.__getstate__()
    assert "path" not in state
    assert state["cache"] == CacheRef(root.resolve().as_uri(), seqs.fingerprint()["shards"], False)
    copy = pickle.loads(pickle.dumps(seqs))
    assert (
        copy.path == seqs.path == str(root.resolve())
        and copy[np.arange(5)].tolist() == seqs[np.arange(5)].tolist()
    )


def test_views_made_from_a_relative_path_reopen_in_a_process_elsewhere(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A DataLoader or grain worker may run in another directory: what it unpickles names the cache
    # absolutely (DocumentSource used to keep the path as given, which then named nothing).
    monkeypatch.chdir(root.parent)
    cache = streampack.open(root.name)
    blob = tmp_path / "views.pickle"
    blob.write_bytes(pickle.dumps((DocumentSource(cache), cache.sequences(8))))
    script = textwrap.dedent(
        """
        import pickle, sys
        docs, seqs = pickle.loads(open(sys.argv[1], "rb").read())
        print(docs[7].tolist(), seqs[2].tolist())
        """
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = subprocess.run(
        [sys.executable, "-c", script, str(blob)], cwd=elsewhere, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{cache.doc(7).tolist()} {cache.sequences(8)[2].tolist()}"


def test_an_append_files_checksum_is_kept_as_it_is_written_and_read_back_once_resumed(tmp_path: Path) -> None:
    """A file appended from empty keeps its CRC-32 as it is written (no read-back at the end); one resumed
    from a committed length (its uncommitted tail cut off) reads its file back: both equal the CRC-32 of
    the bytes on disk."""
    import zlib

    store = LocalStore(tmp_path)
    (tmp_path / "shards").mkdir()
    rng = np.random.default_rng(0)
    pieces = [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 1, 4096, 100_000, 7)]
    fresh = store.append_file("shards/a.bin", 0)
    for piece in pieces:
        fresh.write(piece.data)
    fresh.sync()
    assert fresh.crc32() == zlib.crc32((tmp_path / "shards/a.bin").read_bytes())
    fresh.close()
    with open(tmp_path / "shards/a.bin", "ab") as f:
        f.write(b"an uncommitted tail a crash left")
    resumed = store.append_file("shards/a.bin", 104_104)
    resumed.write(b"more")
    expected = b"".join(p.tobytes() for p in pieces) + b"more"
    assert (tmp_path / "shards/a.bin").read_bytes()[:104_104] == expected[:104_104]
    assert resumed.crc32() == zlib.crc32(expected)
    resumed.close()

"""Tests for `streampack.reader.shards`: the `Shards` protocol a cache reads its shards through, and the
shard files of a native cache (`ShardFiles`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import streampack
from streampack.errors import CacheError
from streampack.reader import Cache, ShardFiles, Shards
from streampack.testing.caches import write_cache

SHARDS = [(np.arange(k * 40, k * 40 + 40), np.array([10, 25, 40])) for k in range(3)]


class InMemory:
    """Another source of the same shards: arrays held in memory (what a foreign format's reader would
    serve), counting what it is asked."""

    def __init__(self, shards: list[tuple[np.ndarray, np.ndarray]], dtype: np.dtype) -> None:
        self._tokens = [tokens.astype(dtype) for tokens, _ in shards]
        self._offsets = [np.asarray(ends, dtype=np.uint64) for _, ends in shards]
        self.asked: list[str] = []

    def tokens(self, shard: int) -> np.ndarray:
        self.asked.append("tokens")
        return self._tokens[shard]

    def offsets(self, shard: int) -> np.ndarray:
        self.asked.append("offsets")
        return self._offsets[shard]

    def raw_offsets(self, shard: int) -> np.ndarray:
        return self._offsets[shard]

    def mask(self, shard: int) -> np.ndarray:
        raise CacheError("no loss mask")

    def identity(self) -> str:
        return ""  # the native cache's shards, which its table's checksums cover

    def drop(self) -> None:
        self.asked.append("drop")

    def close(self) -> None:
        self.asked.append("close")


@pytest.fixture
def native(tmp_path: Path) -> Cache:
    return streampack.open(write_cache(tmp_path / "c", SHARDS, vocab_size=2000, eos_id=1999))


def test_a_cache_reads_its_shards_through_the_protocol(native: Cache) -> None:
    source = InMemory(SHARDS, native.dtype)
    files: Shards = source
    other = Cache(native.store, native.manifest, native.table, files=files)
    assert other.doc(4).tolist() == native.doc(4).tolist() == list(range(50, 65))
    assert other.tokens(30, 90).tolist() == native.tokens(30, 90).tolist()
    index = np.array([5, 0, 16])
    assert np.array_equal(other.sequences(7, overlap=1)[index], native.sequences(7, overlap=1)[index])
    assert np.array_equal(other.packed(16)[:], native.packed(16)[:])
    assert {"tokens", "offsets"} <= set(source.asked)
    other.drop_maps()
    assert source.asked[-1] == "drop"
    with other:
        pass
    assert source.asked[-1] == "close"


def test_shard_files_are_the_default_and_keep_their_maps(native: Cache) -> None:
    assert isinstance(native.files, ShardFiles)
    assert native.files.tokens(1) is native.shard_tokens(1)  # kept, not mapped again
    assert native.shard_offsets(-1).tolist() == [10, 25, 40]  # negative shards count from the end
    with pytest.raises(IndexError):
        native.shard_tokens(3)
    with pytest.raises(CacheError, match="no loss mask"):
        native.shard_loss_mask(0)
    native.drop_maps()
    assert native.files.tokens(1) is not None
    native.close()
    with pytest.raises(CacheError, match="the cache was closed"):
        native.shard_tokens(1)


def test_a_shard_file_of_the_wrong_size_is_refused_when_first_mapped(native: Cache) -> None:
    path = native.root / "shards" / "000002.tokens"
    path.write_bytes(path.read_bytes()[:-2])
    reopened = streampack.open(native.root)  # opening maps nothing
    assert reopened.doc(0).tolist() == list(range(10))
    with pytest.raises(CacheError, match=r"000002\.tokens: 78 bytes, but the manifest says 40 items"):
        reopened.shard_tokens(2)

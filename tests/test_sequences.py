"""Tests for `streampack.samples.sequences`: packed windows of the token stream and their document
boundaries."""

from __future__ import annotations

import base64
import gzip
import json
import pickle
import random
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import streampack
from streampack.errors import CacheError, OptionsError
from streampack.samples.layout import Spans, boundaries, read_spans
from streampack.samples.sequences import PackedSequences
from streampack.testing.caches import write_cache
from tests.conftest import run_cli


def _texts(rng: random.Random, count: int) -> list[str]:
    # Lengths from 0 (a document that is only its EOS) to well past the window sizes tested.
    return [
        "".join(rng.choice("abcdef") for _ in range(rng.choice([0, 1, 3, 9, 30, 80]))) for _ in range(count)
    ]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> streampack.Cache:
    """A cache of four shards, one of them empty, built with the bytes tokenizer."""
    root = tmp_path_factory.mktemp("seq")
    rng = random.Random(0)
    files = []
    for name, count in (("a", 60), ("b", 0), ("c", 3), ("d", 90)):
        records = [{"text": t} for t in _texts(rng, count)]
        if records:  # incompressible padding: a file larger than a unit is a unit of its own
            records[0]["pad"] = base64.b64encode(rng.randbytes(96 << 10)).decode()
        path = root / f"{name}.jsonl.gz"
        path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode()))
        files.append(path)
    streampack.build(files, root / "cache", tokenizer="bytes", workers=1, unit_bytes=1 << 16)
    opened = streampack.open(root / "cache")
    assert opened.num_shards == 4 and 0 in {s.num_tokens for s in opened.shards}
    return opened


@pytest.fixture(scope="module")
def stream(cache: streampack.Cache) -> np.ndarray:
    return cache.tokens(0, cache.num_tokens)


def reference_boundaries(cache: streampack.Cache, index: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Position ids and document ids of one sample, token by token."""
    ends = np.cumsum(cache.doc_lengths())
    docs = [
        int(np.searchsorted(ends, t, side="right")) for t in range(index * seq_len, (index + 1) * seq_len)
    ]
    positions = [0]
    for previous, current in pairwise(docs):
        positions.append(positions[-1] + 1 if current == previous else 0)
    return np.array(positions), np.array(docs)


@pytest.mark.parametrize(("seq_len", "overlap"), [(1, 0), (5, 0), (7, 1), (64, 0), (64, 3)])
def test_every_sample_is_its_window_of_the_stream(
    cache: streampack.Cache, stream: np.ndarray, seq_len: int, overlap: int
) -> None:
    seqs = cache.sequences(seq_len, overlap=overlap)
    assert len(seqs) == (cache.num_tokens - overlap) // seq_len
    batch = seqs[np.arange(len(seqs))[::-1]]
    assert batch.dtype == cache.dtype and batch.shape == (len(seqs), seq_len + overlap)
    for row, i in zip(batch, range(len(seqs) - 1, -1, -1)):
        assert np.array_equal(row, stream[i * seq_len : i * seq_len + seq_len + overlap])
    assert np.array_equal(seqs[len(seqs) - 1], batch[0])


def test_windows_cross_shard_boundaries(cache: streampack.Cache, stream: np.ndarray) -> None:
    seqs = cache.sequences(16, overlap=1)
    crossing = [
        i
        for i in range(len(seqs))
        if np.searchsorted(cache.token_starts, i * 16, "right")
        != np.searchsorted(cache.token_starts, i * 16 + 16, "right")
    ]
    assert crossing, "the fixture should have windows spanning shards"
    for i in crossing:
        assert np.array_equal(seqs[i], stream[i * 16 : i * 16 + 17])


def test_only_the_final_partial_window_is_dropped(tmp_path: Path) -> None:
    tokens = np.arange(10, dtype=np.int64)
    cache = streampack.open(write_cache(tmp_path / "c", [(tokens, [4, 10])], vocab_size=50, eos_id=49))
    assert len(cache.sequences(3)) == 3  # [0,3) [3,6) [6,9); token 9 is left over
    assert len(cache.sequences(3, overlap=1)) == 3  # the last window [6, 10) just fits
    assert len(cache.sequences(5, overlap=1)) == 1
    assert len(cache.sequences(11)) == 0
    assert cache.sequences(3, overlap=1)[2].tolist() == [6, 7, 8, 9]


def test_index_forms(cache: streampack.Cache) -> None:
    seqs = cache.sequences(8)
    n = len(seqs)
    assert np.array_equal(seqs[-1], seqs[n - 1])
    assert np.array_equal(seqs[2:9:3], seqs[np.array([2, 5, 8])])
    grid = seqs[np.array([[0, 1], [-1, 3]])]
    assert grid.shape == (2, 2, 8) and np.array_equal(grid[1, 0], seqs[n - 1])
    assert seqs[np.zeros(0, dtype=np.int64)].shape == (0, 8)
    assert seqs[[np.int32(4)]].shape == (1, 8)


@pytest.mark.parametrize("bad", [10**9, -(10**9), np.array([0, 10**9])])
def test_out_of_range_index_names_the_range(cache: streampack.Cache, bad: object) -> None:
    seqs = cache.sequences(8)
    with pytest.raises(IndexError, match=rf"out of range for {len(seqs)} samples"):
        seqs[bad]


@pytest.mark.parametrize(
    "bad",
    [
        np.array([2**64 - 1], dtype=np.uint64),  # wrapped to -1 (the last sample) when cast first
        np.array([0, 2**63], dtype=np.uint64),  # wrapped to -2**63
        [2**63 + 5],
        np.uint64(2**64 - 1),
    ],
)
def test_huge_unsigned_indices_are_refused_naming_their_value(cache: streampack.Cache, bad: object) -> None:
    seqs = cache.sequences(8)
    value = int(np.max(bad))
    message = rf"sample {value} out of range for {len(seqs)} samples"
    with pytest.raises(IndexError, match=message):
        seqs[bad]
    with pytest.raises(IndexError, match=message):
        seqs.boundaries(bad)
    if np.ndim(bad) == 1:
        with pytest.raises(IndexError, match=message):
            seqs.read(bad)  # type: ignore[arg-type]
    assert np.array_equal(seqs[np.array([len(seqs) - 1], dtype=np.uint64)], seqs[[-1]])
    assert np.array_equal(seqs[np.array([-1], dtype=np.int8)], seqs[[len(seqs) - 1]])


@pytest.mark.parametrize("bad", [1.5, np.array([0.0, 1.0]), np.array([True, False]), "3"])
def test_non_integer_index_is_refused(cache: streampack.Cache, bad: object) -> None:
    with pytest.raises(TypeError, match="must be an int, a slice or an integer array"):
        cache.sequences(8)[bad]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seq_len": 0}, r"seq_len must be an integer >= 1 \(got seq_len=0\)"),
        ({"seq_len": 2.0}, r"seq_len must be an integer >= 1 \(got seq_len=2.0\)"),
        ({"seq_len": True}, r"seq_len must be an integer >= 1 \(got seq_len=True\)"),
        ({"seq_len": 8, "overlap": -1}, r"overlap must be an integer >= 0 \(got overlap=-1\)"),
    ],
)
def test_bad_settings_are_refused(cache: streampack.Cache, kwargs: dict, message: str) -> None:
    with pytest.raises(OptionsError, match=message):
        PackedSequences(cache, **kwargs)


def test_read_casts_into_the_given_array(cache: streampack.Cache) -> None:
    seqs = cache.sequences(16, overlap=1)
    indices = np.array([3, 0, len(seqs) - 1, 3])
    out = np.full((4, 17), -1, dtype=np.int64)
    assert seqs.read(indices, out=out) is out
    assert np.array_equal(out, seqs[indices].astype(np.int64))
    with pytest.raises(ValueError, match=r"out has shape \(4, 16\)"):
        seqs.read(indices, out=np.empty((4, 16), dtype=np.int64))
    with pytest.raises(ValueError, match="1-D array"):
        seqs.read(indices.reshape(2, 2))


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.float32, np.float64, np.bool_])
def test_read_refuses_an_out_dtype_that_cannot_hold_every_id(cache: streampack.Cache, dtype: type) -> None:
    assert cache.dtype == np.uint16  # ids up to 65535: int16 would wrap the upper half
    seqs = cache.sequences(16)
    with pytest.raises(ValueError, match=rf"out has dtype {np.dtype(dtype)}, which cannot hold every id of "):
        seqs.read(np.array([0, 1]), out=np.zeros((2, 16), dtype=dtype))
    for fine in (np.uint16, np.int32, np.uint32, np.int64):
        out = seqs.read(np.array([0, 1]), out=np.zeros((2, 16), dtype=fine))
        assert np.array_equal(out, seqs[:2])
    with pytest.raises(TypeError, match="out must be a numpy array"):
        seqs.read(np.array([0]), out=[[0] * 16])  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
@given(seq_len=st.integers(1, 70), data=st.data())
def test_boundaries_match_the_documents_token_by_token(
    cache: streampack.Cache, seq_len: int, data: st.DataObject
) -> None:
    seqs = cache.sequences(seq_len)
    indices = np.array(data.draw(st.lists(st.integers(0, len(seqs) - 1), min_size=1, max_size=6)))
    got = seqs.boundaries(indices)
    assert got.position_ids.shape == got.doc_ids.shape == (len(indices), seq_len)
    for row, i in enumerate(indices):
        positions, docs = reference_boundaries(cache, int(i), seq_len)
        assert np.array_equal(got.position_ids[row], positions)
        assert np.array_equal(got.doc_ids[row], docs)
        for t in (0, seq_len - 1):  # doc ids name the document that really holds the token
            token = cache.tokens(i * seq_len + t, i * seq_len + t + 1)[0]
            doc = got.doc_ids[row, t]
            assert token in cache.doc(int(doc))
    # cu_seqlens: segments tile the flattened batch, each a run of positions 0, 1, 2, ...
    cu = got.cu_seqlens
    assert cu.dtype == np.int32 and cu[0] == 0 and cu[-1] == len(indices) * seq_len
    assert np.all(np.diff(cu) > 0) and got.max_seqlen == int(np.diff(cu).max())
    flat = got.position_ids.reshape(-1)
    assert np.array_equal(np.flatnonzero(flat == 0), cu[:-1])
    assert set(range(0, len(indices) * seq_len, seq_len)) <= set(cu.tolist())  # rows never share a segment


@pytest.mark.parametrize("overlap", [1, 3])
def test_boundaries_ignore_the_overlap_tail(cache: streampack.Cache, overlap: int) -> None:
    # The windows are split at shard boundaries with their tail; the boundaries cut it off again.
    for seq_len in (1, 7, 40):
        plain, tailed = cache.sequences(seq_len), cache.sequences(seq_len, overlap=overlap)
        indices = np.arange(len(tailed))
        want, got = plain.boundaries(indices), tailed.boundaries(indices)
        assert np.array_equal(got.position_ids, want.position_ids)
        assert np.array_equal(got.doc_ids, want.doc_ids)
        assert np.array_equal(got.cu_seqlens, want.cu_seqlens) and got.max_seqlen == want.max_seqlen


def test_reading_and_boundaries_take_any_spans(cache: streampack.Cache) -> None:
    # The seam a packing layout uses: spans of several documents, padding left where no span writes.
    lengths_of = cache.doc_lengths().astype(np.int64)
    ends = np.cumsum(lengths_of)
    shard_of_doc = np.repeat(np.arange(cache.num_shards), [s.num_docs for s in cache.shards])
    token_starts = np.asarray(cache.token_starts, dtype=np.int64)
    docs = [d for d in range(len(ends)) if 3 <= lengths_of[d] <= 6][:3]
    lo = np.array([ends[d - 1] if d else 0 for d in docs]) - token_starts[shard_of_doc[docs]]
    lengths = lengths_of[docs]
    spans = Spans(
        rows=np.array([0, 0, 1]),
        shards=shard_of_doc[docs],
        lo=lo,
        hi=lo + lengths,
        col=np.array([0, lengths[0], 0]),
    )
    out = np.full((2, 16), -1, dtype=np.int64)
    read_spans(spans, out, cache.shard_tokens)
    first = np.concatenate([cache.doc(docs[0]), cache.doc(docs[1])])
    assert out[0, : len(first)].tolist() == first.tolist() and (out[0, len(first) :] == -1).all()
    assert out[1, : lengths[2]].tolist() == cache.doc(docs[2]).tolist()
    doc_starts = np.concatenate([[0], np.cumsum([s.num_docs for s in cache.shards])])
    found = boundaries(spans, 2, 16, cache.shard_offsets, doc_starts)
    used = lengths[0] + lengths[1]
    assert found.doc_ids[0].tolist() == [docs[0]] * lengths[0] + [docs[1]] * lengths[1] + [-1] * (16 - used)
    assert found.position_ids[0].tolist() == [*range(lengths[0]), *range(lengths[1]), *range(16 - used)]
    assert found.doc_ids[1].tolist() == [docs[2]] * lengths[2] + [-1] * (16 - lengths[2])
    # Padding is a segment of its own, and no training target.
    assert found.loss_mask.tolist() == (found.doc_ids >= 0).tolist()
    assert found.cu_seqlens.tolist() == [0, lengths[0], used, 16, 16 + lengths[2], 32]


def test_boundaries_of_one_sample_and_of_none(cache: streampack.Cache) -> None:
    seqs = cache.sequences(32)
    one = seqs.boundaries(5)
    assert one.position_ids.shape == (32,)
    assert np.array_equal(one.position_ids, seqs.boundaries(np.array([5])).position_ids[0])
    none = seqs.boundaries(np.zeros(0, dtype=np.int64))
    assert none.position_ids.shape == (0, 32) and none.cu_seqlens.tolist() == [0] and none.max_seqlen == 0


def test_boundaries_skip_empty_documents(tmp_path: Path) -> None:
    # Documents of 0 tokens (a build without EOS can make them) hold no token and start no segment.
    tokens = np.arange(12)
    ends = np.array([3, 3, 3, 7, 12, 12])
    seqs = streampack.open(write_cache(tmp_path / "c", [(tokens, ends)], vocab_size=50, eos_id=49)).sequences(
        6
    )
    got = seqs.boundaries(np.array([0, 1]))
    assert got.doc_ids.tolist() == [[0, 0, 0, 3, 3, 3], [3, 4, 4, 4, 4, 4]]
    assert got.position_ids.tolist() == [[0, 1, 2, 0, 1, 2], [0, 0, 1, 2, 3, 4]]
    assert got.cu_seqlens.tolist() == [0, 3, 6, 7, 12]


def test_pickles_the_path_not_the_maps(cache: streampack.Cache) -> None:
    seqs = cache.sequences(16, overlap=1)
    indices = np.arange(0, len(seqs), 7)
    expected = seqs[indices]
    blob = pickle.dumps(seqs)
    assert len(blob) < 1000  # settings and a path, whatever the cache size
    copy = pickle.loads(blob)
    assert copy._cache is None  # reopened on first use
    assert np.array_equal(copy[indices], expected)
    assert np.array_equal(copy.boundaries(indices).doc_ids, seqs.boundaries(indices).doc_ids)
    assert repr(copy) == repr(seqs)
    assert str(cache.root.resolve()) in repr(seqs) and "seq_len=16, overlap=1" in repr(seqs)


def test_a_copy_refuses_a_cache_that_changed_on_disk(tmp_path: Path) -> None:
    root = tmp_path / "c"
    streampack.build(streampack.Documents(["abc" * 20]), root, tokenizer="bytes", workers=1)
    blob = pickle.dumps(streampack.open(root).sequences(4))
    streampack.build(streampack.Documents(["xyz" * 20]), root, tokenizer="bytes", workers=1, overwrite=True)
    with pytest.raises(CacheError, match="changed on disk"):
        pickle.loads(blob)[0]


def test_fingerprint_identifies_the_samples(cache: streampack.Cache) -> None:
    fingerprint = cache.sequences(16, overlap=1).fingerprint()
    assert fingerprint == {
        "num_samples": (cache.num_tokens - 1) // 16,
        "num_tokens": cache.num_tokens,
        "shards": fingerprint["shards"],
        "seq_len": 16,
        "overlap": 1,
    }
    assert json.loads(json.dumps(fingerprint)) == fingerprint
    assert fingerprint == streampack.open(cache.root).sequences(16, overlap=1).fingerprint()


def test_fingerprint_tells_other_data_of_the_same_size_apart(tmp_path: Path) -> None:
    a = streampack.build(streampack.Documents(["abcd"] * 10), tmp_path / "a", tokenizer="bytes", workers=1)
    b = streampack.build(streampack.Documents(["wxyz"] * 10), tmp_path / "b", tokenizer="bytes", workers=1)
    first, second = (streampack.open(x.out).sequences(4).fingerprint() for x in (a, b))
    assert first["num_tokens"] == second["num_tokens"] and first["shards"] != second["shards"]


def test_uint32_caches_read_as_uint32(tmp_path: Path) -> None:
    tokens = np.array([70_000, 1, 2, 99_999, 5, 6], dtype=np.int64)
    cache = streampack.open(
        write_cache(tmp_path / "c", [(tokens, [3, 6])], vocab_size=100_000, eos_id=99_999)
    )
    batch = cache.sequences(2)[np.array([0, 1, 2])]
    assert batch.dtype == np.dtype("<u4") and batch.tolist() == [[70_000, 1], [2, 99_999], [5, 6]]


@pytest.mark.slow
def test_cli_decodes_a_packed_sample(cache: streampack.Cache, stream: np.ndarray) -> None:
    ids = run_cli("decode", cache.root, "--sample", "3", "--seq-len", "10", "--ids").stdout.split()
    assert [int(i) for i in ids] == stream[30:40].tolist()
    text = run_cli("decode", cache.root, "--sample", "3", "--seq-len", "10").stdout
    assert text.rstrip("\n") == bytes(t for t in stream[30:40] if t < 256).decode().rstrip("\n")
    for args, message in [
        (["--sample", "3"], "--sample needs --seq-len"),
        (["--sample", "3", "--seq-len", "10", "--doc", "1"], "exactly one of --doc I or --sample I"),
        ([], "exactly one of --doc I or --sample I"),
    ]:
        result = run_cli("decode", cache.root, *args, check=False)
        assert result.returncode == 2 and message in result.stderr
    result = run_cli("decode", cache.root, "--sample", "999999", "--seq-len", "10", check=False)
    assert result.returncode == 1 and result.stderr.startswith("error: sample 999999 out of range")


def test_many_shards_stay_within_a_low_file_descriptor_limit(tmp_path: Path) -> None:
    """Each mapped shard holds a descriptor; the reader keeps only a bounded number of maps open."""
    import subprocess
    import sys

    from streampack.testing.caches import write_cache

    shards = [(np.full(10, i % 250, dtype=np.uint16), np.array([5, 10])) for i in range(600)]
    root = write_cache(tmp_path / "c", shards, vocab_size=257, eos_id=256)
    code = (
        "import resource, sys, streampack\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))\n"
        "cache = streampack.open(sys.argv[1])\n"
        "total = sum(int(cache.doc(i)[0]) for i in range(cache.num_docs))\n"
        "assert total == sum(2 * (i % 250) for i in range(600))\n"
        "print(len(cache.sequences(7)[list(range(0, 857, 3))]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@settings(max_examples=25, deadline=None)
@given(
    shard_tokens=st.lists(st.integers(0, 3000), min_size=1, max_size=4),
    seq_len=st.integers(1, 64),
    overlap=st.integers(0, 1),
    batch_size=st.sampled_from([1, 8, 32, 64]),
    dtype=st.sampled_from([np.int64, np.uint16, np.int32]),
)
def test_loader_batches_are_the_windows_of_the_stream(
    tmp_path_factory: pytest.TempPathFactory,
    shard_tokens: list[int],
    seq_len: int,
    overlap: int,
    batch_size: int,
    dtype: type,
) -> None:
    # Row takes (many rows of one shard in a batch) and slice copies (the rest) against plain slicing.
    assume(sum(shard_tokens) - overlap >= seq_len * batch_size)
    rng = np.random.default_rng(len(shard_tokens) * 7 + seq_len)
    shards = []
    for size in shard_tokens:
        tokens = rng.integers(0, 50_000, size=size)
        shards.append((tokens, np.array([size], dtype=np.int64) if size else np.zeros(0, dtype=np.int64)))
    root = write_cache(tmp_path_factory.mktemp("w") / "c", shards, vocab_size=50_257, eos_id=50_256)
    cache = streampack.open(root)
    seqs = cache.sequences(seq_len, overlap=overlap)
    loader = streampack.Loader(seqs, batch_size=batch_size, seed=1, dtype=dtype)
    stream = cache.tokens(0, cache.num_tokens).astype(np.int64)
    for _, position in zip(range(6), loader.schedule()):
        batch = loader.batch(position)
        assert batch.dtype == dtype
        for row, index in zip(batch, loader.indices(position).tolist()):
            start = index * seq_len
            assert row.tolist() == stream[start : start + seq_len + overlap].tolist()


def test_threads_share_a_cache_beyond_its_open_maps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # grain reads from a thread pool: shard maps evicted by one thread while another looks them up.
    from concurrent.futures import ThreadPoolExecutor

    from streampack.reader import shards as shard_files

    monkeypatch.setattr(shard_files, "MAX_OPEN_MAPS", 3)
    shards = [(np.arange(k * 40, k * 40 + 40), np.array([10, 25, 40])) for k in range(24)]
    cache = streampack.open(write_cache(tmp_path / "c", shards, vocab_size=2000, eos_id=1999))
    seqs = cache.sequences(7)

    def read(seed: int) -> bool:
        rng = np.random.default_rng(seed)
        for _ in range(150):
            doc = int(rng.integers(cache.num_docs))
            ok = cache.doc(doc)[0] == (doc // 3) * 40 + (0, 10, 25)[doc % 3]
            index = rng.integers(len(seqs), size=5)
            ok &= bool((seqs[index][:, 0] == index * 7).all())
            if not ok:
                return False
        return True

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(read, range(16)))

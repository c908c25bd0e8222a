"""``streampack.open`` over datatrove folders and MDS shards (streampack/reader/foreign/datatrove.py, mds.py).

Each format both ways: a cache exported and opened again equals the original document by document, its
windows and a Loader over them equal the native cache's; files written by the format's own writer
(datatrove's ``DocumentTokenizer`` step with the GPT-2 tokenizer.json, mosaicml-streaming's
``MDSWriter``) open with the same documents; damaged files are a ``CacheError`` naming the file and field.
"""

from __future__ import annotations

import io
import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard

import streampack
from streampack.errors import CacheError, OptionsError
from streampack.reader.foreign import opening as reading
from streampack.testing.caches import write_cache
from tests.conftest import SAMPLE_CORPUS

GPT2_EOS = 50256


def docs_of(cache: streampack.Cache) -> list[np.ndarray]:
    return [np.asarray(cache.doc(i)) for i in range(cache.num_docs)]


def assert_same_documents(opened: streampack.Cache, native: streampack.Cache) -> None:
    assert (opened.num_docs, opened.num_tokens) == (native.num_docs, native.num_tokens)
    for i in range(native.num_docs):
        np.testing.assert_array_equal(opened.doc(i), native.doc(i))


def assert_same_windows_and_batches(opened: streampack.Cache, native: streampack.Cache) -> None:
    ours, theirs = opened.sequences(512), native.sequences(512)
    assert len(ours) == len(theirs)
    for i in range(0, len(theirs), 37):
        np.testing.assert_array_equal(ours[i], theirs[i])
    loaders = [streampack.Loader(s, batch_size=8, seed=3) for s in (ours, theirs)]
    for got, expected in itertools.islice(zip(*loaders), 5):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def real_records(count: int) -> list[dict[str, Any]]:
    if not SAMPLE_CORPUS.exists():
        pytest.skip(f"sample corpus not found at {SAMPLE_CORPUS}")
    stream = zstandard.ZstdDecompressor().stream_reader(SAMPLE_CORPUS.open("rb"))
    lines = itertools.islice(io.TextIOWrapper(stream, encoding="utf-8"), count)
    return [json.loads(line) for line in lines]


@pytest.fixture
def small(tmp_path: Path) -> streampack.Cache:
    """Three shards of random documents (ids below 1000, EOS 0)."""
    rng = np.random.default_rng(0)
    shards = []
    for _ in range(3):
        lengths = rng.integers(1, 700, size=40)
        tokens = rng.integers(1, 1000, size=int(lengths.sum())).astype(np.uint16)
        shards.append((tokens, np.cumsum(lengths)))
    return streampack.open(write_cache(tmp_path / "small", shards, vocab_size=1000, eos_id=0))


# ----------------------------------------------------------------------------- datatrove


def test_a_datatrove_export_opens_with_every_document(natural: streampack.Cache, tmp_path: Path) -> None:
    natural.export("datatrove", tmp_path / "dt")
    opened = streampack.open(tmp_path / "dt", eos_id=GPT2_EOS)
    assert opened.manifest.settings.to_json()["foreign"] == "datatrove"
    assert opened.manifest.tokenizer.name == natural.manifest.tokenizer.name
    assert opened.dtype == np.uint16 and opened.num_shards == natural.num_shards
    assert opened.files.token_file(0) == (tmp_path / "dt" / "00000.ds", 0)
    assert_same_documents(opened, natural)
    assert_same_windows_and_batches(opened, natural)
    one = streampack.open(tmp_path / "dt" / "00001.ds")
    np.testing.assert_array_equal(one.doc(0), natural.doc(int(natural.table.num_docs[0])))


def test_the_sft_loss_mask_round_trips_through_ds_loss(sft: streampack.Cache, tmp_path: Path) -> None:
    sft.export("datatrove", tmp_path / "dt")
    opened = streampack.open(tmp_path / "dt")
    assert opened.has_loss_mask
    assert_same_documents(opened, sft)
    for i in range(sft.num_docs):
        np.testing.assert_array_equal(opened.doc_loss_mask(i), sft.doc_loss_mask(i))


def test_datatroves_tokenizer_step_files_open(gpt2_tokenizer: Path, tmp_path: Path) -> None:
    """``DocumentTokenizer`` run locally (it loads a tokenizer.json path as it is) on real documents,
    one with a range kept out of the loss, unshuffled so the order is the input's."""
    pytest.importorskip("datatrove")
    from datatrove.data import Document
    from datatrove.pipeline.tokens import DocumentTokenizer
    from tokenizers import Tokenizer

    records = real_records(30)
    docs = [Document(text=r["text"], id=str(i)) for i, r in enumerate(records)]
    docs[2].metadata["no_loss_ranges"] = [(0, 40)]
    step = DocumentTokenizer(
        str(tmp_path / "dt"),
        tokenizer_name_or_path=str(gpt2_tokenizer),
        eos_token="<|endoftext|>",
        shuffle_documents=False,
        save_loss_metadata=True,
    )
    list(step.run(iter(docs), rank=0, world_size=1) or [])
    opened = streampack.open(tmp_path / "dt", eos_id=GPT2_EOS)
    assert opened.manifest.tokenizer.name == str(gpt2_tokenizer)
    assert opened.manifest.eos.id == GPT2_EOS and opened.has_loss_mask
    tokenizer = Tokenizer.from_file(str(gpt2_tokenizer))
    assert opened.num_docs == len(records)
    for i, record in enumerate(records):
        encoded = tokenizer.encode(record["text"])
        np.testing.assert_array_equal(opened.doc(i), [*encoded.ids, GPT2_EOS])
        mask = np.asarray(opened.doc_loss_mask(i))
        if i == 2:
            assert not mask[: encoded.char_to_token(40)].any() and mask[encoded.char_to_token(40) :].all()
        else:
            assert mask.all()


def test_the_token_width_comes_from_the_metadata_else_dtype(small: streampack.Cache, tmp_path: Path) -> None:
    small.export("datatrove", tmp_path / "dt")
    for meta in (tmp_path / "dt").glob("*.metadata"):
        meta.unlink()
    assert streampack.open(tmp_path / "dt").dtype == np.uint16  # datatrove's default width
    wrong_width = r"00000\.ds: .* 4-byte tokens|00000\.ds\.index: the last document ends at token"
    with pytest.raises(CacheError, match=wrong_width):
        streampack.open(tmp_path / "dt", dtype="uint32")
    small.export("datatrove", tmp_path / "meta")
    with pytest.raises(OptionsError, match=r"dtype='uint32' is 4 bytes.*TOKEN_SIZE 2"):
        streampack.open(tmp_path / "meta", dtype="uint32")


def cut(path: Path, nbytes: int) -> None:
    path.write_bytes(path.read_bytes()[:-nbytes])


def put_u64(path: Path, at: int, value: int) -> None:
    data = bytearray(path.read_bytes())
    data[8 * at : 8 * at + 8] = np.array([value], dtype="<u8").tobytes()
    path.write_bytes(bytes(data))


DATATROVE_DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "a decreasing index": (
        lambda d: put_u64(d / "00001.ds.index", 5, 3),
        r"00001\.ds\.index: document end 5 is 3, before the previous one",
    ),
    "a truncated .ds": (
        lambda d: cut(d / "00000.ds", 1),
        r"00000\.ds: .* not a whole number of 2-byte tokens",
    ),
    "a .ds cut by a token": (
        lambda d: cut(d / "00002.ds", 2),
        r"00002\.ds\.metadata: the token count is .* but 00002\.ds holds",
    ),
    "an index not of uint64": (
        lambda d: cut(d / "00000.ds.index", 3),
        r"00000\.ds\.index: .* not a whole number of uint64 document ends",
    ),
    "an index cut short": (
        lambda d: cut(d / "00000.ds.index", 8),
        r"00000\.ds\.index: the last document ends at token .* but the \.ds file holds",
    ),
    "a missing index": (lambda d: (d / "00001.ds.index").unlink(), r"00001\.ds\.index: missing"),
    "a loss mask of the wrong size": (
        lambda d: cut(d / "00000.ds.loss", 1),
        r"00000\.ds\.loss: .* bytes, but the loss mask of the .* tokens of 00000\.ds",
    ),
    "a loss mask beside some files only": (
        lambda d: (d / "00001.ds.loss").unlink(),
        r"00001\.ds\.loss: missing, though other \.ds files",
    ),
    "bad metadata": (
        lambda d: (d / "00000.ds.metadata").write_text("gpt2\n12\n"),
        r"00000\.ds\.metadata: the first line is 'gpt2', expected TOKENIZER\|TOKEN_SIZE",
    ),
}


@pytest.mark.parametrize("damage", DATATROVE_DAMAGE)
def test_damaged_datatrove_files_are_refused(small: streampack.Cache, tmp_path: Path, damage: str) -> None:
    small.export("datatrove", tmp_path / "dt")
    if "loss" in damage:
        for i in range(small.num_shards):
            (tmp_path / "dt" / f"{i:05d}.ds.loss").write_bytes(b"\x01" * int(small.table.num_tokens[i]))
    change, message = DATATROVE_DAMAGE[damage]
    change(tmp_path / "dt")
    with pytest.raises(CacheError, match=message):
        streampack.open(tmp_path / "dt")


# ----------------------------------------------------------------------------- MDS


def test_an_mds_export_opens_with_every_document(natural: streampack.Cache, tmp_path: Path) -> None:
    natural.export("mds", tmp_path / "docs", size_limit=1 << 20)
    opened = streampack.open(tmp_path / "docs", eos_id=GPT2_EOS)
    assert opened.num_shards > 1 and opened.files.token_file(0) is None  # gathered from the samples
    assert_same_documents(opened, natural)
    assert_same_windows_and_batches(opened, natural)


def test_mds_fixed_windows_open_as_one_document_each(natural: streampack.Cache, tmp_path: Path) -> None:
    natural.export("mds", tmp_path / "windows", seq_len=1024)
    opened = streampack.open(tmp_path / "windows")
    windows = natural.sequences(1024)
    assert opened.num_docs == len(windows) and opened.num_tokens == len(windows) * 1024
    path, offset = opened.files.token_file(0)  # type: ignore[misc]
    assert path.name == "shard.00000.mds" and offset > 0  # mapped where the samples start
    for i in range(0, len(windows), 53):
        np.testing.assert_array_equal(opened.doc(i), windows[i])


def test_mdswriter_shards_open_with_the_same_documents(
    natural: streampack.Cache, tmp_path: Path, streaming: Any
) -> None:
    docs = docs_of(natural)[:3000]
    with streaming.MDSWriter(
        out=str(tmp_path / "var"), columns={"input_ids": "ndarray:uint16"}, size_limit=1 << 20
    ) as writer:
        for doc in docs:
            writer.write({"input_ids": doc.astype(np.uint16)})
    opened = streampack.open(tmp_path / "var")
    assert opened.num_docs == len(docs) and opened.num_shards > 1
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(opened.doc(i), doc)
    stream = np.concatenate(docs[:200]).astype(np.uint32)
    with streaming.MDSWriter(
        out=str(tmp_path / "fixed"), columns={"input_ids": "ndarray:uint32:100"}
    ) as writer:
        for row in stream[: len(stream) // 100 * 100].reshape(-1, 100):
            writer.write({"input_ids": row})
    fixed = streampack.open(tmp_path / "fixed")
    assert fixed.dtype == np.uint32
    np.testing.assert_array_equal(np.concatenate(docs_of(fixed)), stream[: len(stream) // 100 * 100])


def test_mds_copies_kept_are_bounded(small: streampack.Cache, tmp_path: Path, monkeypatch: Any) -> None:
    small.export("mds", tmp_path / "mds", size_limit=1 << 12)
    opened = streampack.open(tmp_path / "mds")
    monkeypatch.setattr(reading, "MAX_COPY_BYTES", 3 << 12)
    for shard in range(opened.num_shards):
        opened.shard_tokens(shard)
    kept = opened.files._kept["c"]  # type: ignore[attr-defined]
    assert opened.num_shards > 8 and max(kept) == opened.num_shards - 1
    assert 1 <= len(kept) < opened.num_shards and sum(a.nbytes for a in kept.values()) <= 3 << 12


def edit_index(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        index = json.loads((folder / "index.json").read_text())
        change(index)
        (folder / "index.json").write_text(json.dumps(index))

    return edit


def put_u32(path: Path, at: int, value: int) -> None:
    data = bytearray(path.read_bytes())
    data[at : at + 4] = np.array([value], dtype="<u4").tobytes()
    path.write_bytes(bytes(data))


def flip_shape_of_sample(folder: Path, sample: int) -> None:
    path = folder / "shard.00000.mds"
    offset = int(np.fromfile(path, dtype="<u4", count=sample + 2)[sample + 1])
    data = bytearray(path.read_bytes())
    data[offset + 5] ^= 1  # the first byte of the sample's shape
    path.write_bytes(bytes(data))


def set_shard(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda index: index["shards"][0].update({field: value})


MDS_DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "index.json not JSON": (
        lambda d: (d / "index.json").write_text('{"version": 2, "shards": ['),
        r"index\.json: not JSON \(.*\); streampack reads the index\.json of MDS version 2",
    ),
    "another index version": (
        edit_index(lambda i: i.update(version=1)),
        r"index\.json: Invalid enum value 1 - at `\$\.version`; .*MDS version 2",
    ),
    "a shard entry without samples": (
        edit_index(set_shard("samples", "many")),
        r"index\.json: Expected `int`, got `str` - at `\$\.shards\[0\]\.samples`; .*write the shards again",
    ),
    "other columns": (
        edit_index(set_shard("column_names", ["tokens"])),
        r"index\.json: shards\[0\] has columns \['tokens'\].*one column 'input_ids'",
    ),
    "another encoding": (
        edit_index(set_shard("column_encodings", ["bytes"])),
        r"index\.json: shards\[0\]\.column_encodings is \['bytes'\]",
    ),
    "a basename outside the folder": (
        edit_index(lambda i: i["shards"][0]["raw_data"].update(basename="../x.mds")),
        r"shards\[0\]\.raw_data\.basename is '\.\./x\.mds'",
    ),
    "compressed without its raw file": (
        lambda d: (
            edit_index(set_shard("compression", "zstd:7"))(d),
            (d / "shard.00000.mds").rename(d / "shard.00000.mds.zstd"),
        ),
        r"shards\[0\] is compressed \(zstd:7\).*decompress",
    ),
    "a shard cut short": (
        lambda d: cut(d / "shard.00001.mds", 10),
        r"shard\.00001\.mds: .* bytes, but the .* samples of shards\[1\] \(raw_data\.bytes",
    ),
    "a sample count that disagrees": (
        lambda d: put_u32(d / "shard.00000.mds", 0, 7),
        r"shard\.00000\.mds: num_samples is 7, but index\.json says",
    ),
    "offsets that go back": (
        lambda d: put_u32(d / "shard.00000.mds", 4 * 4, 20),
        r"shard\.00000\.mds: offsets\[3\] is 20, not after offsets\[2\]",
    ),
}


@pytest.mark.parametrize("damage", MDS_DAMAGE)
def test_damaged_mds_files_are_refused(small: streampack.Cache, tmp_path: Path, damage: str) -> None:
    small.export("mds", tmp_path / "mds", size_limit=1 << 14)
    change, message = MDS_DAMAGE[damage]
    change(tmp_path / "mds")
    with pytest.raises(CacheError, match=message):
        streampack.open(tmp_path / "mds")


def test_a_sample_header_that_disagrees_is_refused_on_first_read(
    small: streampack.Cache, tmp_path: Path
) -> None:
    small.export("mds", tmp_path / "mds", size_limit=1 << 14)
    flip_shape_of_sample(tmp_path / "mds", 3)
    opened = streampack.open(tmp_path / "mds")  # the offsets table alone is read at open
    with pytest.raises(CacheError, match=r"shard\.00000\.mds: sample 3's shape is .* implies"):
        opened.doc(0)


def write_with_mdswriter(streaming: Any, out: Path, docs: list[np.ndarray], **options: Any) -> None:
    columns = {"input_ids": "ndarray:uint16"}
    with streaming.MDSWriter(out=str(out), columns=columns, size_limit=1 << 14, **options) as writer:
        for doc in docs:
            writer.write({"input_ids": doc.astype(np.uint16)})


def test_verify_checks_the_digests_mdswriter_recorded(
    small: streampack.Cache, tmp_path: Path, streaming: Any
) -> None:
    """``MDSWriter(hashes=["sha1", "xxh64"])`` records each shard's digests in index.json: ``verify``
    checks both (hashlib, xxhash) and names the shard file whose bytes changed and the digest that
    differs; shards written without hashes get a note that none are recorded."""
    from tests.conftest import run_cli

    docs = docs_of(small)
    write_with_mdswriter(streaming, tmp_path / "hashed", docs, hashes=["sha1", "xxh64"])
    index = json.loads((tmp_path / "hashed" / "index.json").read_text())
    assert len(index["shards"]) > 2 and set(index["shards"][1]["raw_data"]["hashes"]) == {"sha1", "xxh64"}
    report = streampack.verify(tmp_path / "hashed")
    assert report.ok, report.problems
    assert any(f"{len(index['shards'])} of {len(index['shards'])} shard files against the sha1, xxh64" in n
               for n in report.notes)  # fmt: skip
    shard = tmp_path / "hashed" / index["shards"][1]["raw_data"]["basename"]
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1  # the last token of its last sample: the headers and the offsets still agree
    shard.write_bytes(bytes(raw))
    damaged = run_cli("verify", tmp_path / "hashed", check=False)
    assert damaged.returncode == 1
    for algo in ("sha1", "xxh64"):
        assert f"{shard}: its {algo} digest is " in damaged.stderr
        assert index["shards"][1]["raw_data"]["hashes"][algo] in damaged.stderr
    assert damaged.stderr.count("digest is") == 2  # the other shards are sound
    write_with_mdswriter(streaming, tmp_path / "plain", docs)
    plain = run_cli("verify", tmp_path / "plain")
    assert "mds files: their headers and indexes were checked (index.json; " in plain.stdout
    assert "; no digest of them is recorded" in plain.stdout


def test_a_digest_of_an_algorithm_not_known_here_is_noted_not_checked(
    small: streampack.Cache, tmp_path: Path
) -> None:
    small.export("mds", tmp_path / "mds", size_limit=1 << 14)
    edit_index(lambda index: index["shards"][0]["raw_data"].update(hashes={"nohash9": "00"}))(
        tmp_path / "mds"
    )
    report = streampack.verify(tmp_path / "mds")
    assert report.ok and any("its nohash9 digest is recorded but not checked" in n for n in report.notes)
    edit_index(lambda index: index["shards"][0]["raw_data"].update(hashes=["sha1"]))(tmp_path / "mds")
    with pytest.raises(
        CacheError, match=r"Expected `object \| null`, got `array` - at `\$\.shards\[0\]\.raw_data\.hashes`"
    ):
        streampack.open(tmp_path / "mds")


def test_verify_of_a_foreign_folder_says_what_a_foreign_cache_needs(
    natural: streampack.Cache, tmp_path: Path
) -> None:
    """A file in a datatrove folder that is none of its files is listed as not part of the cache (no
    native format to name it against); an EOS id inside a document is the declared id's or the writer's
    doing, not a build to redo with ``overwrite=True``."""
    natural.export("datatrove", tmp_path / "dt")
    (tmp_path / "dt" / "notes.txt").write_text("a file of the user's")
    (tmp_path / "dt" / "extra").mkdir()
    report = streampack.verify(tmp_path / "dt", eos_id=GPT2_EOS)
    assert report.ok, report.problems
    unread = [n for n in report.notes if "not one of the datatrove files" in n]
    assert [n.split(":")[0] for n in unread] == [
        str(tmp_path / "dt" / name) for name in ("extra", "notes.txt")
    ]
    assert not any("cache format" in n or "rebuild" in n for n in report.notes)
    tokens = np.memmap(tmp_path / "dt" / "00000.ds", dtype=np.uint16, mode="r+")
    tokens[3] = GPT2_EOS  # inside the first document
    tokens.flush()
    del tokens
    problems = streampack.verify(tmp_path / "dt", eos_id=GPT2_EOS).problems
    assert len(problems) == 1 and "1 EOS id 50256 inside documents" in problems[0]
    assert "declare the right eos_id=" in problems[0] and "overwrite=True" not in problems[0]

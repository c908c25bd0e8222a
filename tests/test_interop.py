"""Exports to the other ecosystems' token formats, read back by those ecosystems' own readers.

Where the reader is a package (megatron-core, datatrove, datasets, mosaicml-streaming) the test calls it;
where it is a script (llm.c, modded-nanogpt, nanoGPT) the test reproduces its loader's few lines, and says
from which file; OLMo-core does not install beside this environment's packages (it would change
huggingface-hub and filelock), so its reading rule is reproduced from its source, and said so.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import streampack
from streampack.errors import CacheError, OptionsError
from streampack.testing.caches import write_cache
from tests.conftest import SAMPLE_CORPUS, run_cli, s3_options


def docs_of(cache: streampack.Cache) -> list[np.ndarray]:
    return [np.asarray(cache.doc(i)) for i in range(cache.num_docs)]


# ----------------------------------------------------------------------------- megatron


def test_megatron_indexed_dataset_reads_every_document(natural: streampack.Cache, tmp_path: Path) -> None:
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    done = natural.export("megatron", tmp_path / "corpus")
    assert done.files == [str(tmp_path / "corpus.bin"), str(tmp_path / "corpus.idx")]
    dataset = indexed.IndexedDataset(str(tmp_path / "corpus"))
    assert len(dataset) == natural.num_docs
    assert dataset.index.dtype == np.uint16  # optimal_dtype(50,257)
    assert list(dataset.document_indices) == list(range(natural.num_docs + 1))
    for i, doc in enumerate(docs_of(natural)):
        np.testing.assert_array_equal(dataset[i], doc)
    assert not list(tmp_path.glob(".*"))  # no staging area left


def test_megatron_bytes_equal_indexed_dataset_builder(natural: streampack.Cache, tmp_path: Path) -> None:
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    import torch

    natural.export("megatron", tmp_path / "ours")
    dtype = indexed.DType.optimal_dtype(natural.vocab_size)
    builder = indexed.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=dtype)
    for doc in docs_of(natural):
        builder.add_item(torch.from_numpy(doc.astype(np.int64)))
        builder.end_document()
    builder.finalize(str(tmp_path / "theirs.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"theirs{suffix}").read_bytes(), (
            suffix
        )


def test_megatron_int32_for_a_large_vocabulary(tmp_path: Path) -> None:
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    tokens = np.array([5, 70000, 99999, 3, 99999], dtype=np.uint32)
    cache = streampack.open(
        write_cache(tmp_path / "c", [(tokens, np.array([3, 5]))], vocab_size=100000, eos_id=99999)
    )
    cache.export("megatron", tmp_path / "m")
    dataset = indexed.IndexedDataset(str(tmp_path / "m"))
    assert dataset.index.dtype == np.int32
    np.testing.assert_array_equal(dataset[0], tokens[:3])
    np.testing.assert_array_equal(dataset[1], tokens[3:])


# ----------------------------------------------------------------------------- llm.c / modded-nanogpt


def llmc_load_data_shard(filename: Path) -> np.ndarray:
    """karpathy/llm.c ``train_gpt2.py`` ``_load_data_shard``, as written there (numpy)."""
    with open(filename, "rb") as f:
        header = np.frombuffer(f.read(256 * 4), dtype=np.int32)
        assert header[0] == 20240520, "magic number mismatch in the data .bin file"
        assert header[1] == 1, "unsupported version"
        ntok = header[2]
        tokens = np.frombuffer(f.read(), dtype=np.uint16)
    assert len(tokens) == ntok, "number of tokens read does not match header?"
    return tokens


def modded_nanogpt_load_data_shard(file: Path) -> np.ndarray:
    """KellerJordan/modded-nanogpt ``train_gpt.py`` ``_load_data_shard`` (without ``pin_memory=True``,
    which needs CUDA)."""
    import torch

    header = torch.from_file(str(file), False, 256, dtype=torch.int32)
    assert header[0] == 20240520, "magic number mismatch in the data .bin file"
    assert header[1] == 1, "unsupported version"
    num_tokens = int(header[2])
    with file.open("rb", buffering=0) as f:
        tokens = torch.empty(num_tokens, dtype=torch.uint16)
        f.seek(256 * 4)
        nbytes = f.readinto(tokens.numpy())
        assert nbytes == 2 * num_tokens, "number of tokens read does not match header"
    return tokens.numpy()


def test_llmc_shards_put_eot_before_every_document(natural: streampack.Cache, tmp_path: Path) -> None:
    natural.export("llmc", tmp_path / "fineweb", shard_tokens=1_000_000)
    files = sorted((tmp_path / "fineweb").glob("train_*.bin"))
    assert len(files) == -(-natural.num_tokens // 1_000_000)
    stream = np.concatenate([llmc_load_data_shard(f) for f in files])
    np.testing.assert_array_equal(stream, np.concatenate([modded_nanogpt_load_data_shard(f) for f in files]))
    eot = natural.eos_id
    expected = np.concatenate([np.concatenate([[eot], doc[:-1]]) for doc in docs_of(natural)])
    np.testing.assert_array_equal(stream, expected)
    # modded-nanogpt's BOS alignment finds every document at the EOT id (BOS_ID = 50256).
    assert np.count_nonzero(stream == 50256) == natural.num_docs


# ----------------------------------------------------------------------------- nanoGPT


def nanogpt_get_batch(data_dir: Path, split: str, block_size: int, batch_size: int) -> tuple:
    """karpathy/nanoGPT ``train.py`` ``get_batch`` (CPU branch), as written there."""
    import torch

    if split == "train":
        data = np.memmap(os.path.join(data_dir, "train.bin"), dtype=np.uint16, mode="r")
    else:
        data = np.memmap(os.path.join(data_dir, "val.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy((data[i : i + block_size]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i + 1 : i + 1 + block_size]).astype(np.int64)) for i in ix])
    return x, y, ix


def test_nanogpt_train_and_val_bins(natural: streampack.Cache, tmp_path: Path) -> None:
    import torch

    natural.export("nanogpt", tmp_path / "owt", val=0.05)
    train, validation = natural.split(0.05)
    by_side = {"train": train.chosen, "val": validation.chosen}
    docs = docs_of(natural)
    for split, chosen in by_side.items():
        keep = np.concatenate([chosen.in_shard(s) for s in range(natural.num_shards)])
        expected = np.concatenate([d for d, k in zip(docs, keep) if k])
        data = np.memmap(tmp_path / "owt" / f"{split}.bin", dtype=np.uint16, mode="r")
        np.testing.assert_array_equal(data, expected)
        torch.manual_seed(0)
        x, y, ix = nanogpt_get_batch(tmp_path / "owt", split, 64, 4)
        for row, i in enumerate(ix.tolist()):
            np.testing.assert_array_equal(x[row].numpy(), expected[i : i + 64])
            np.testing.assert_array_equal(y[row].numpy(), expected[i + 1 : i + 65])
    with open(tmp_path / "owt" / "meta.pkl", "rb") as f:
        assert pickle.load(f)["vocab_size"] == natural.vocab_size


# ----------------------------------------------------------------------------- datatrove


@pytest.mark.slow
def test_datatrove_folder_dataset_reads_tokens_and_positions(
    natural: streampack.Cache, tmp_path: Path
) -> None:
    dataset_module = pytest.importorskip("datatrove.utils.dataset")
    natural.export("datatrove", tmp_path / "dt")
    seq_len = 255
    dataset = dataset_module.DatatroveFolderDataset(
        str(tmp_path / "dt"), seq_len, filename_pattern="*.ds", token_size=2, return_positions=True
    )
    files = sorted((tmp_path / "dt").glob("*.ds"))
    assert len(files) == natural.num_shards
    expected_len = sum(int(n) // (seq_len + 1) for n in natural.table.num_tokens)
    assert len(dataset) == expected_len
    item = 0
    for shard, path in enumerate(files):
        tokens = np.asarray(natural.shard_tokens(shard))
        ends = np.asarray(natural.shard_offsets(shard), dtype=np.int64)
        np.testing.assert_array_equal(np.fromfile(f"{path}.index", dtype="<u8"), ends)
        assert (path.parent / f"{path.name}.metadata").read_text().splitlines()[:2] == [
            f"{natural.manifest.tokenizer.name}|2",
            str(len(tokens)),
        ]
        for window in range(len(tokens) // (seq_len + 1)):
            sample = dataset[item]
            lo = window * (seq_len + 1)
            np.testing.assert_array_equal(sample["input_ids"].numpy(), tokens[lo : lo + seq_len + 1])
            starts = np.concatenate([[0], ends[:-1]])
            doc_start = starts[np.searchsorted(ends, np.arange(lo, lo + seq_len + 1), side="right")]
            expected_pos = np.arange(lo, lo + seq_len + 1) - np.maximum(doc_start, lo)
            # datatrove counts positions from the window start, and restarts them after each document end.
            np.testing.assert_array_equal(sample["positions"].numpy(), expected_pos)
            item += 1


def test_datatrove_keeps_the_loss_mask(sft: streampack.Cache, tmp_path: Path) -> None:
    sft.export("datatrove", tmp_path / "dt")
    loss = np.fromfile(tmp_path / "dt" / "00000.ds.loss", dtype=np.bool_)
    np.testing.assert_array_equal(loss, np.asarray(sft.shard_loss_mask(0)).astype(bool))


# ----------------------------------------------------------------------------- OLMo-core


def olmo_iter_document_indices_local(
    data_path: Path, eos_token_id: int, dtype: type
) -> list[tuple[int, int]]:
    """allenai/OLMo-core ``src/olmo_core/data/utils.py`` ``iter_document_indices``, its local-array branch
    (``use_array_if_local``), as written there: a document ends at each EOS."""
    mmap = np.memmap(data_path, mode="r", dtype=dtype)
    doc_boundaries = (mmap == eos_token_id).nonzero()[0]
    out, start_idx = [], 0
    for idx in doc_boundaries:
        end_idx = idx + 1
        out.append((start_idx, int(end_idx)))
        start_idx = end_idx
    return out


def olmo_iter_document_indices_metadata(data_path: Path) -> list[tuple[int, int]]:
    """The same function's metadata branch (a remote array): the ``.csv.gz`` beside the ``.npy``."""
    metadata_path = data_path.parent / data_path.name.replace(".npy", ".csv.gz")
    out = []
    with gzip.open(metadata_path, "rt") as f:
        for line in f:
            start_index_str, end_index_str, *_ = line.split(",")
            out.append((int(start_index_str), int(end_index_str)))
    return out


def test_olmo_memmaps_find_every_document(
    natural: streampack.Cache, sft: streampack.Cache, tmp_path: Path
) -> None:
    for cache, name in ((natural, "natural"), (sft, "sft")):
        cache.export("olmo", tmp_path / name)
        config = json.loads((tmp_path / name / "olmo.json").read_text())
        assert config["dtype"] == "uint16" and config["eos_token_id"] == cache.eos_id
        docs = docs_of(cache)
        found = []
        for path in config["paths"]:
            data = np.memmap(tmp_path / name / path, mode="r", dtype=np.uint16)
            spans = olmo_iter_document_indices_local(tmp_path / name / path, cache.eos_id, np.uint16)
            assert spans == olmo_iter_document_indices_metadata(tmp_path / name / path)
            found += [np.asarray(data[a:b]) for a, b in spans]
        assert len(found) == len(docs)
        for ours, theirs in zip(docs, found):
            np.testing.assert_array_equal(ours, theirs)
    masks = json.loads((tmp_path / "sft" / "olmo.json").read_text())["label_mask_paths"]
    mask = np.memmap(tmp_path / "sft" / masks[0], mode="r", dtype=np.bool_)
    np.testing.assert_array_equal(mask, np.asarray(sft.shard_loss_mask(0)).astype(bool))


# ----------------------------------------------------------------------------- Hugging Face


def test_hf_documents_in_arrow_and_parquet(natural: streampack.Cache, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    natural.export("hf", tmp_path / "hf", files="both", file_tokens=1_000_000)
    docs = docs_of(natural)
    from_disk = datasets.load_from_disk(str(tmp_path / "hf"))
    parquet = datasets.load_dataset("parquet", data_dir=str(tmp_path / "hf" / "data"), split="train")
    for dataset in (from_disk, parquet):
        assert len(dataset) == len(docs)
        for row, doc in zip(dataset.with_format("numpy")["input_ids"], docs):
            np.testing.assert_array_equal(row, doc)
    assert len(list((tmp_path / "hf").glob("data-*-of-*.arrow"))) > 1


@pytest.mark.slow
def test_the_hf_tests_write_nothing_into_the_users_hugging_face_cache(tmp_path: Path) -> None:
    """``load_dataset("parquet", ...)`` caches its Arrow files under ``HF_HOME``: the suite points every
    Hugging Face cache at a folder of its own (tests/conftest.py), so a run leaves the user's alone. Run in
    a session of its own whose user's cache is an empty folder, the test that calls it leaves it empty."""
    pytest.importorskip("datasets")
    home = tmp_path / "users-cache"
    home.mkdir()
    users = {
        "HF_HOME": str(home),
        "HF_DATASETS_CACHE": str(home / "datasets"),
        "HF_HUB_CACHE": str(home / "hub"),
    }
    test = f"{Path(__file__)}::test_hf_sft_documents_carry_labels"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        env=os.environ | users,
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr
    assert sorted(home.rglob("*")) == []


def test_hf_packed_samples_equal_the_loaders_dicts(natural: streampack.Cache, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    natural.export("hf", tmp_path / "packed", seq_len=512, packed=True, files="arrow")
    dataset = datasets.load_from_disk(str(tmp_path / "packed")).with_format("numpy")
    samples = natural.packed(512)
    loader = streampack.Loader(
        samples, batch_size=64, shuffle=False, output="dict", drop_last=False, epochs=1
    )
    rows = 0
    for batch in loader:
        got = dataset[rows : rows + len(batch["input_ids"])]
        for key in ("input_ids", "labels", "position_ids"):
            np.testing.assert_array_equal(np.stack(got[key]), np.asarray(batch[key]), err_msg=key)
        rows += len(batch["input_ids"])
    assert rows == len(dataset) == len(samples)


def test_hf_sft_documents_carry_labels(sft: streampack.Cache, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    sft.export("hf", tmp_path / "sft")
    dataset = datasets.load_dataset("parquet", data_dir=str(tmp_path / "sft" / "data"), split="train")
    loader = streampack.Loader(sft.documents(64), batch_size=1, shuffle=False, output="dict", epochs=1)
    for row, batch in zip(dataset.with_format("numpy"), loader):
        n = len(row["input_ids"])
        np.testing.assert_array_equal(row["labels"], np.asarray(batch["labels"])[0, :n])


# ----------------------------------------------------------------------------- MDS


def test_mds_streaming_dataset_reads_documents_and_windows(
    natural: streampack.Cache, tmp_path: Path, streaming: object
) -> None:
    docs = docs_of(natural)
    natural.export("mds", tmp_path / "docs", size_limit=1 << 20)
    dataset = streaming.StreamingDataset(local=str(tmp_path / "docs"), shuffle=False, batch_size=1)
    assert len(dataset) == len(docs)
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(dataset[i]["input_ids"], doc)
    natural.export("mds", tmp_path / "windows", seq_len=1024)
    windows = streaming.StreamingDataset(local=str(tmp_path / "windows"), shuffle=False, batch_size=1)
    seqs = natural.sequences(1024)
    assert len(windows) == len(seqs)
    for i in range(0, len(seqs), 97):
        np.testing.assert_array_equal(windows[i]["input_ids"], seqs[i])


@pytest.mark.parametrize("seq_len", [None, 1000])
def test_mds_matches_mdswriter_shards(
    seq_len: int | None, natural: streampack.Cache, tmp_path: Path, streaming: object
) -> None:
    """Ours and MDSWriter's: the same index and shard bytes, for documents and for fixed windows (the
    stream's spans, copied from a cache of several shards, so that windows cross shard ends)."""
    natural.export("streampack", tmp_path / "sharded", shard_tokens=30_000)
    source = streampack.open(tmp_path / "sharded")
    assert source.num_shards > 3
    source.export("mds", tmp_path / "ours", size_limit=1 << 16, seq_len=seq_len)
    encoding = "ndarray:uint16" + ("" if seq_len is None else f":{seq_len}")
    samples = docs_of(natural) if seq_len is None else list(natural.sequences(seq_len))
    with streaming.MDSWriter(
        out=str(tmp_path / "theirs"), columns={"input_ids": encoding}, size_limit=1 << 16
    ) as writer:
        for sample in samples:
            writer.write({"input_ids": np.asarray(sample, dtype=np.uint16)})
    ours = json.loads((tmp_path / "ours" / "index.json").read_text())
    theirs = json.loads((tmp_path / "theirs" / "index.json").read_text())
    assert ours == theirs
    for shard in theirs["shards"]:
        name = shard["raw_data"]["basename"]
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "theirs" / name).read_bytes()


# ----------------------------------------------------------------------------- what a format cannot hold


def test_pieces_gathered_by_the_kernel_are_written_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``write_pieces`` (MDS samples: headers and documents' values) gives a local file, a file that takes
    less than asked at a time, and a writer without a descriptor the same bytes, in order."""
    from streampack.interop import copying

    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 50_000, dtype=np.uint8)
    cuts = np.sort(rng.choice(np.arange(1, len(data)), 2_999, replace=False)).tolist()
    pieces = [data[a:b].data for a, b in zip([0, *cuts], [*cuts, len(data)])]
    expected = data.tobytes()
    with open(tmp_path / "whole", "wb") as out:
        out.write(b"head")
        copying.write_pieces(out, pieces)
        out.write(b"tail")
    assert (tmp_path / "whole").read_bytes() == b"head" + expected + b"tail"
    real = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, batch: real(fd, batch[: len(batch) // 2]))  # short writes
    with open(tmp_path / "short", "wb") as out:
        copying.write_pieces(out, pieces)
    assert (tmp_path / "short").read_bytes() == expected
    buffer = io.BytesIO()
    copying.write_pieces(buffer, pieces)
    assert buffer.getvalue() == expected


def test_a_byte_range_is_copied_by_the_kernel_or_left_to_the_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``copy_range`` appends a file's byte range to a local file (after what the buffered writer holds),
    falls back to ``sendfile`` where ``copy_file_range`` is refused, copies what there is of a file cut
    short, and leaves a writer without a descriptor to the caller."""
    import errno

    from streampack.interop import copying

    source = tmp_path / "source"
    source.write_bytes(bytes(range(256)) * 40)
    expected = source.read_bytes()[1000:9000]
    with open(source, "rb") as src, open(tmp_path / "out", "wb") as out:
        out.write(b"head")  # buffered, not yet on disk: must land first
        assert copying.copy_range(src, 1000, 8000, out) == 8000
        out.write(b"tail")
    assert (tmp_path / "out").read_bytes() == b"head" + expected + b"tail"

    def refused(*args: object) -> int:
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", refused)
    with open(source, "rb") as src, open(tmp_path / "sent", "wb") as out:
        assert copying.copy_range(src, 1000, 8000, out) == 8000
    assert (tmp_path / "sent").read_bytes() == expected
    monkeypatch.undo()
    with open(source, "rb") as src, open(tmp_path / "short", "wb") as out:
        assert copying.copy_range(src, 10_000, 500, out) == 240  # the file has 10,240 bytes
    with open(source, "rb") as src:
        assert copying.copy_range(src, 0, 100, io.BytesIO()) == 0


def test_a_loss_mask_into_megatron_is_refused(sft: streampack.Cache, tmp_path: Path) -> None:
    for format in ("megatron", "llmc", "nanogpt", "mds"):
        with pytest.raises(OptionsError, match=r"loss mask.*datatrove.*olmo.*hf.*drop_loss_mask") as e:
            sft.export(format, tmp_path / format)
        assert f"the {format} format cannot hold one" in str(e.value)
    assert not list(tmp_path.iterdir())  # refused before anything was written
    sft.export("megatron", tmp_path / "m", drop_loss_mask=True)
    assert (tmp_path / "m.idx").exists()


def test_nanogpt_refuses_a_cache_without_an_eos(tmp_path: Path) -> None:
    """nanoGPT's files keep boundaries as the EOS ids alone: a BOS cache (or one with neither) would open as
    one document."""
    src = tmp_path / "docs.txt"
    src.write_text("first document\nsecond one\n")
    streampack.build(src, tmp_path / "bos", split_lines=True, eos=False, bos_id=256)
    streampack.build(src, tmp_path / "none", split_lines=True, eos=False)
    for name in ("bos", "none"):
        with pytest.raises(OptionsError, match=r"appends no EOS, and nanoGPT's files keep document"):
            streampack.open(tmp_path / name).export("nanogpt", tmp_path / f"{name}-n")
        assert not (tmp_path / f"{name}-n").exists()
    streampack.open(tmp_path / "bos").export("llmc", tmp_path / "bos-l")  # the delimiter keeps them
    assert streampack.open(tmp_path / "bos-l").num_docs == 2


def test_olmo_and_nanogpt_refuse_a_cache_whose_bos_is_its_eos(tmp_path: Path) -> None:
    """A build with ``bos_id`` its EOS: a reader that ends a document at each EOS ends one at each BOS too
    (OLMo's files read back as ``[EOS]``, ``[tokens, EOS]``, which verify refused)."""
    src = tmp_path / "docs.txt"
    src.write_text("first document\nsecond one\n")
    streampack.build(src, tmp_path / "c", split_lines=True, bos_id=256)  # the bytes tokenizer's EOS is 256
    cache = streampack.open(tmp_path / "c")
    assert cache.bos_id == cache.eos_id == 256
    for format in ("olmo", "nanogpt"):
        with pytest.raises(OptionsError, match=r"the cache's BOS is its EOS \(256\)"):
            cache.export(format, tmp_path / format)
        assert not (tmp_path / format).exists()
    cache.export("datatrove", tmp_path / "dt")  # an index keeps them
    opened = streampack.open(tmp_path / "dt", eos_id=256, bos_id=256)
    assert [d.tolist() for d in docs_of(opened)] == [d.tolist() for d in docs_of(cache)]


def test_a_vocabulary_too_large_for_the_dtype_is_refused(tmp_path: Path) -> None:
    tokens = np.array([1, 99999, 70000, 99999], dtype=np.uint32)
    cache = streampack.open(
        write_cache(tmp_path / "c", [(tokens, np.array([2, 4]))], vocab_size=100000, eos_id=99999)
    )
    with pytest.raises(OptionsError, match=r"100,000 ids does not fit the nanogpt format's uint16.*llmc"):
        cache.export("nanogpt", tmp_path / "n")
    with pytest.raises(OptionsError, match=r"100,000 ids does not fit the megatron format's uint16"):
        cache.export("megatron", tmp_path / "m", dtype="uint16")
    cache.export("nanogpt", tmp_path / "n", dtype="cache")
    np.testing.assert_array_equal(np.fromfile(tmp_path / "n" / "train.bin", dtype="<u4"), tokens)


def test_megatron_refusal_of_an_undeclared_uint32_vocabulary_says_to_declare_it(tmp_path: Path) -> None:
    """Another format's uint32 files record no vocabulary: theirs is 2**32 ids, more than Megatron's int32
    holds, and the refusal names vocab_size= (not dtype="int32", the dtype it had chosen)."""
    tokens = np.array([1, 70000, 100257, 5, 100257], dtype="<u4")
    tokens.tofile(tmp_path / "train.bin")
    opened = streampack.open(tmp_path / "train.bin", eos_id=100257, dtype="uint32")
    with pytest.raises(OptionsError, match=r"no wider token dtype.*open the cache with vocab_size=") as e:
        opened.export("megatron", tmp_path / "m")
    assert 'Use dtype="optimal" or "int32"' not in str(e.value)
    declared = streampack.open(tmp_path / "train.bin", eos_id=100257, dtype="uint32", vocab_size=100277)
    declared.export("megatron", tmp_path / "m")
    assert [d.tolist() for d in docs_of(streampack.open(tmp_path / "m"))] == [[1, 70000, 100257], [5, 100257]]


def _foreign_with_ids_above_its_vocabulary(tmp_path: Path) -> streampack.Cache:
    """A nanoGPT uint32 file (GPT-2 ids, EOS 50256) declared as GPT-2's 50,257 ids, holding 70000 and 3e9."""
    tokens = np.array([1, 2, 50256, 70000, 5, 50256, 6, 3_000_000_000, 50256], dtype="<u4")
    tokens.tofile(tmp_path / "train.bin")
    return streampack.open(tmp_path / "train.bin", eos_id=50256, dtype="uint32", vocab_size=50257)


def test_an_export_to_uint16_refuses_an_id_the_declared_vocabulary_does_not_cover(tmp_path: Path) -> None:
    cache = _foreign_with_ids_above_its_vocabulary(tmp_path)
    where = re.escape(f"{tmp_path / 'train.bin'}, document 1, token 0: the id 70,000 does not fit")
    for format, options in (("nanogpt", {}), ("nanogpt", {"val": 1}), ("megatron", {})):
        with pytest.raises(CacheError, match=where + r" the export's uint16 tokens .* read as 4,464") as e:
            cache.export(format, tmp_path / format, **options)
        assert 'dtype="cache"' in str(e.value) and "kept nothing" in str(e.value)
        assert not list(tmp_path.glob(f"*{format}*"))  # nothing left, not even the staging area
    # The cache's own width keeps every id as the files hold it.
    cache.export("nanogpt", tmp_path / "n", dtype="cache")
    assert np.fromfile(tmp_path / "n" / "train.bin", dtype="<u4")[3] == 70000


def test_a_negative_megatron_id_is_refused_by_a_narrowing_export(tmp_path: Path) -> None:
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    import torch

    builder = indexed.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.int32)
    for doc in ([1, 2, 50256], [7, -5, 50256]):
        builder.add_document(torch.tensor(doc), [len(doc)])
    builder.finalize(str(tmp_path / "m.idx"))
    cache = streampack.open(tmp_path / "m", eos_id=50256, vocab_size=50257)
    with pytest.raises(CacheError, match=r"m.bin, document 1, token 1: the id 4,294,967,291 does not fit"):
        cache.export("nanogpt", tmp_path / "n")


def test_an_mds_export_of_samples_refuses_ids_past_uint16_too(tmp_path: Path) -> None:
    """MDS samples are read from the array its reader made, not a span of a file: checked the same."""
    tokens = np.array([1, 70000, 99999, 3, 99999], dtype=np.uint32)
    wide = streampack.open(
        write_cache(tmp_path / "c", [(tokens, np.array([3, 5]))], vocab_size=100000, eos_id=99999)
    )
    wide.export("mds", tmp_path / "mds")
    declared = streampack.open(tmp_path / "mds", eos_id=99999, vocab_size=50000)
    with pytest.raises(CacheError, match=r"shard.00000.mds, document 0, token 1: the id 70,000 does not fit"):
        declared.export("nanogpt", tmp_path / "n")


def test_hf_samples_of_a_uint32_cache_are_written(tmp_path: Path) -> None:
    tokens = np.array([5, 70000, 99999, 3, 99998, 99999], dtype=np.uint32)
    cache = streampack.open(
        write_cache(tmp_path / "c", [(tokens, np.array([3, 6]))], vocab_size=100000, eos_id=99999)
    )
    cache.export("hf", tmp_path / "hf", seq_len=3)
    import pyarrow.parquet as pq

    (path,) = (tmp_path / "hf" / "data").glob("*.parquet")
    assert pq.read_table(path)["input_ids"].to_pylist() == [[5, 70000, 99999], [3, 99998, 99999]]


def test_offsets_past_their_width_are_refused_not_wrapped(natural: streampack.Cache, tmp_path: Path) -> None:
    """An MDS shard's offsets are uint32, an hf list's int32: a shard or row past them is refused."""
    from streampack.interop.hf import _lists

    with pytest.raises(OptionsError, match=r"size_limit must be between 64 and 4,294,967,295"):
        natural.export("mds", tmp_path / "mds", size_limit=1 << 32)
    with pytest.raises(OptionsError, match=r"a row of 2,147,483,648 tokens is longer than a list of the hf"):
        _lists(np.zeros(4, dtype=np.int32), np.array([0, 1 << 31]))


def test_an_existing_destination_is_refused_unless_overwritten(
    natural: streampack.Cache, tmp_path: Path
) -> None:
    natural.export("datatrove", tmp_path / "dt")
    with pytest.raises(OptionsError, match=r"the destination exists .*pass overwrite=True to replace"):
        natural.export("datatrove", tmp_path / "dt")
    (tmp_path / "dt" / "stale.ds").write_bytes(b"x")
    natural.export("datatrove", tmp_path / "dt", overwrite=True)
    assert not (tmp_path / "dt" / "stale.ds").exists()
    with pytest.raises(
        OptionsError, match=r"takes no option seq_len; its options are: dtype, drop_loss_mask"
    ):
        natural.export("megatron", tmp_path / "m", seq_len=8)
    with pytest.raises(OptionsError, match=r"unknown export format 'parquet'; choose one of megatron"):
        natural.export("parquet", tmp_path / "p")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # IndexedDataset.__del__
def test_a_killed_export_leaves_nothing_a_reader_takes_then_a_rerun_completes(tmp_path: Path) -> None:
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    rng = np.random.default_rng(0)
    shards = [
        (rng.integers(0, 50000, 4_000_000).astype(np.uint16), np.arange(1, 41) * 100_000) for _ in range(12)
    ]
    cache = write_cache(tmp_path / "big", shards, vocab_size=50257, eos_id=50256)
    prefix = tmp_path / "out" / "corpus"
    prefix.parent.mkdir()
    staging = prefix.parent / ".corpus.streampack-export"
    cmd = [
        sys.executable,
        "-m",
        "streampack",
        "export",
        str(cache),
        "--to",
        "megatron",
        "--out",
        str(prefix),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            staged = staging / "corpus.bin"
            if staged.exists() and staged.stat().st_size > 0:
                break
            time.sleep(0.002)
        assert proc.poll() is None, f"the export ended before it could be killed: {proc.stderr.read()!r}"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert not prefix.with_suffix(".idx").exists() and not prefix.with_suffix(".bin").exists()
    with pytest.raises((FileNotFoundError, AssertionError)):
        indexed.IndexedDataset(str(prefix))
    run_cli("export", cache, "--to", "megatron", "--out", prefix)
    assert not staging.exists()
    dataset = indexed.IndexedDataset(str(prefix))
    assert len(dataset) == 12 * 40
    np.testing.assert_array_equal(dataset[41], shards[1][0][100_000:200_000])


def test_a_durable_export_writes_the_same_files(natural: streampack.Cache, tmp_path: Path) -> None:
    """durable=True (fsync of every file and folder before the move) changes when, not what, is written."""
    for format, options in (("megatron", {}), ("hf", {"seq_len": 256}), ("nanogpt", {"val": 0.1})):
        plain = natural.export(format, tmp_path / f"{format}-plain", **options)
        durable = natural.export(format, tmp_path / f"{format}-durable", durable=True, **options)
        assert len(plain.files) == len(durable.files)
        for a, b in zip(plain.files, durable.files):
            assert Path(a).read_bytes() == Path(b).read_bytes(), (a, b)
    done = run_cli(
        "export",
        natural.root,
        "--to",
        "datatrove",
        "--out",
        tmp_path / "dt",
        "--durable",
        "--no-progress",
    )
    assert "as datatrove" in done.stdout and not list(tmp_path.glob(".*streampack-export*"))


# ----------------------------------------------------------------------------- the CLI, and object storage


@pytest.mark.slow
def test_cli_exports_megatron_and_hf(natural: streampack.Cache, tmp_path: Path) -> None:
    done = run_cli("export", natural.root, "--to", "megatron", "--out", tmp_path / "m", "--no-progress")
    assert (
        f"exported {natural.num_docs:,} documents, {natural.num_tokens:,} tokens as megatron" in done.stdout
    )
    assert (tmp_path / "m.bin").stat().st_size == natural.num_tokens * 2
    done = run_cli("export", natural.root, "--to", "hf", "--out", tmp_path / "hf", "--seq-len", "128")
    assert "rows" in done.stdout and (tmp_path / "hf" / "data" / "train-00000-of-00001.parquet").exists()
    again = run_cli("export", natural.root, "--to", "hf", "--out", tmp_path / "hf", check=False)
    assert (
        again.returncode == 1 and "the destination exists" in again.stderr and "--overwrite" in again.stderr
    )
    refused = run_cli("export", natural.root, "--to", "hf", "--out", tmp_path / "x", "--packed", check=False)
    assert refused.returncode == 1 and "give seq_len" in refused.stderr


def test_megatron_export_to_object_storage(
    natural: streampack.Cache, s3_endpoint: str, bucket: tuple, tmp_path: Path
) -> None:
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    fs, name = bucket
    done = natural.export("megatron", f"s3://{name}/megatron/corpus", storage_options=s3_options(s3_endpoint))
    assert done.files[-1] == f"{name}/megatron/corpus.idx"
    assert sorted(fs.ls(f"{name}/megatron")) == [f"{name}/megatron/corpus.bin", f"{name}/megatron/corpus.idx"]
    assert not fs.exists(f"{name}/megatron/corpus.streampack-export")
    fs.get(f"{name}/megatron/corpus.bin", str(tmp_path / "corpus.bin"))
    fs.get(f"{name}/megatron/corpus.idx", str(tmp_path / "corpus.idx"))
    dataset = indexed.IndexedDataset(str(tmp_path / "corpus"))
    for i in range(0, natural.num_docs, 37):
        np.testing.assert_array_equal(dataset[i], natural.doc(i))


@pytest.mark.slow
def test_the_export_benchmark_runs_quick(tmp_path: Path) -> None:
    """benchmarks/bench_export.py --quick, the smoke run of the benchmark: every row reports."""
    if not SAMPLE_CORPUS.exists():
        pytest.skip(f"sample corpus not found at {SAMPLE_CORPUS}")
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_export.py"
    out = tmp_path / "report.md"
    cmd = [sys.executable, str(bench), "--quick", "--tmp", str(tmp_path / "work"), "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    report = out.read_text()
    for row in (
        "| megatron |",
        "| llmc |",
        "| datatrove |",
        "| olmo |",
        "| hf (parquet, documents) |",
        "| mds",
        "| convert from megatron |",
    ):
        assert row in report


# ----------------------------------------------------------------------------- ids past a signed dtype


def _cache_with_ids_past_int32(tmp_path: Path, vocab_size: int = 1 << 32) -> streampack.Cache:
    """A native uint32 cache of ``vocab_size`` ids whose second document holds the id 3e9 (past int32)."""
    tokens = np.array([5, 70000, 7, 3, 3_000_000_000, 7], dtype=np.uint32)
    root = write_cache(tmp_path / "wide", [(tokens, np.array([3, 6]))], vocab_size=vocab_size, eos_id=7)
    return streampack.open(root)


def test_hf_documents_refuse_an_id_past_int32_not_write_it_negative(tmp_path: Path) -> None:
    cache = _cache_with_ids_past_int32(tmp_path)
    where = re.escape("document 1, token 1: the id 3,000,000,000 does not fit the export's int32 tokens")
    with pytest.raises(CacheError, match=where + r".*read as -1,294,967,296") as e:
        cache.export("hf", tmp_path / "hf")
    assert "4,294,967,296 ids" in str(e.value) and "datatrove" in str(e.value)
    assert not list(tmp_path.glob("hf*"))


def test_hf_samples_refuse_an_id_past_int32_not_write_it_negative(tmp_path: Path) -> None:
    cache = _cache_with_ids_past_int32(tmp_path)
    where = re.escape("sample 1 (column 1: ") + ".*" + re.escape("document 1, token 1): the id 3,000,000,000")
    with pytest.raises(CacheError, match=where):
        cache.export("hf", tmp_path / "hf", seq_len=3)
    assert not list(tmp_path.glob("hf*"))


def test_a_uint32_cache_whose_ids_fit_int32_exports_to_hf_whatever_its_vocabulary(tmp_path: Path) -> None:
    tokens = np.array([5, 70000, 7, 3, 2**31 - 1, 7], dtype=np.uint32)
    root = write_cache(tmp_path / "wide", [(tokens, np.array([3, 6]))], vocab_size=1 << 32, eos_id=7)
    streampack.open(root).export("hf", tmp_path / "hf")
    import pyarrow.parquet as pq

    (path,) = (tmp_path / "hf" / "data").glob("*.parquet")
    assert pq.read_table(path)["input_ids"].to_pylist() == [[5, 70000, 7], [3, 2**31 - 1, 7]]


def test_megatron_int32_refuses_an_id_past_int32_its_declared_vocabulary_leaves_out(tmp_path: Path) -> None:
    """The ids are copied as they lie between equal widths; a uint32 id of 2**31 or more would be a
    negative int32 in Megatron's reader: checked as written where the vocabulary does not prove it fits."""
    cache = _foreign_with_ids_above_its_vocabulary(tmp_path)
    where = re.escape(f"{tmp_path / 'train.bin'}, document 2, token 1: the id 3,000,000,000 does not fit")
    with pytest.raises(CacheError, match=where + r" the export's int32 tokens .* read as -1,294,967,296"):
        cache.export("megatron", tmp_path / "m", dtype="int32")
    assert not list(tmp_path.glob("m*"))


def test_megatron_int32_of_a_native_cache_whose_vocabulary_fits_keeps_every_id(tmp_path: Path) -> None:
    tokens = np.array([5, 70000, 7, 3, 2**31 - 1, 7], dtype=np.uint32)
    root = write_cache(tmp_path / "wide", [(tokens, np.array([3, 6]))], vocab_size=1 << 31, eos_id=7)
    streampack.open(root).export("megatron", tmp_path / "m")
    bin = np.fromfile(tmp_path / "m.bin", dtype="<i4")
    np.testing.assert_array_equal(bin, tokens.astype(np.int64))


# ----------------------------------------------------------------------------- a cache without documents


def _empty_caches(tmp_path: Path) -> list[streampack.Cache]:
    """A cache with no shard, and one whose only shard holds nothing."""
    none = write_cache(tmp_path / "none", [], vocab_size=50257, eos_id=50256)
    hollow = write_cache(
        tmp_path / "hollow", [(np.zeros(0, np.uint16), np.zeros(0, np.int64))], vocab_size=50257, eos_id=50256
    )
    return [streampack.open(none), streampack.open(hollow)]


def test_llmc_export_of_an_empty_cache_is_refused_naming_why(tmp_path: Path) -> None:
    """llm.c's dataloader.h refuses a folder without shards ("no files found matching the pattern") and a
    shard without tokens (``assert(ntok > 0)``): no llm.c files say "no documents"."""
    for cache in _empty_caches(tmp_path):
        with pytest.raises(OptionsError, match=r"holds no tokens.*llm.c's format cannot hold an empty data"):
            cache.export("llmc", tmp_path / "llmc")
        assert not (tmp_path / "llmc").exists()


def test_datatrove_export_of_an_empty_cache_is_an_empty_dataset(tmp_path: Path) -> None:
    dataset_module = pytest.importorskip("datatrove.utils.dataset")
    for k, cache in enumerate(_empty_caches(tmp_path)):
        dest = tmp_path / f"dt{k}"
        assert cache.export("datatrove", dest).rows == 0
        dataset = dataset_module.DatatroveFolderDataset(str(dest), 4, filename_pattern="*.ds", token_size=2)
        assert len(dataset) == 0
        assert (dest / "00000.ds.metadata").read_text().splitlines()[1] == "0"
        opened = streampack.open(dest, eos_id=50256)
        assert (opened.num_docs, opened.num_tokens) == (0, 0)

"""``streampack convert``: another format's token files made into a native cache, checked by ``verify``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import streampack
from streampack.errors import CacheError, OptionsError
from streampack.interop import convert
from streampack.reader.foreign import nanogpt
from streampack.reader.foreign.scanning import scan_plan
from streampack.testing.caches import write_cache
from tests.conftest import run_cli


def test_a_converted_megatron_pair_is_the_cache_it_came_from(
    natural: streampack.Cache, tmp_path: Path, gpt2_tokenizer: Path
) -> None:
    """Exported to Megatron and converted back: the same documents, a manifest that says where they came
    from and with which (declared) tokenizer, checksums that ``verify`` checks, and an export of it that
    is byte for byte the first."""
    natural.export("megatron", tmp_path / "m")
    done = convert(tmp_path / "m", tmp_path / "back", eos_id=50256, tokenizer=str(gpt2_tokenizer))
    assert (done.rows, done.num_tokens) == (natural.num_docs, natural.num_tokens)
    back = streampack.open(tmp_path / "back")
    assert back.num_docs == natural.num_docs and back.eos_id == 50256
    for i in range(natural.num_docs):
        np.testing.assert_array_equal(back.doc(i), natural.doc(i))
    manifest = back.manifest
    assert manifest.tokenizer.identity == natural.manifest.tokenizer.identity
    assert manifest.settings.to_json()["foreign"] == "megatron"
    assert [Path(i.path).name for i in manifest.inputs] == ["m.bin", "m.idx"]
    verified = run_cli("verify", str(tmp_path / "back"))
    assert verified.returncode == 0 and "ok:" in verified.stdout, verified.stderr
    back.export("megatron", tmp_path / "again")
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"again{suffix}").read_bytes() == (tmp_path / f"m{suffix}").read_bytes()


def test_shards_are_cut_between_documents(tmp_path: Path) -> None:
    """``shard_tokens`` bounds each shard, cut between documents; a longer document is a shard alone."""
    tokens = np.arange(1, 41, dtype=np.uint16) % 9
    ends = np.array([3, 5, 20, 22, 30, 40])  # the third document (15 tokens) is longer than a shard
    cache = streampack.open(write_cache(tmp_path / "c", [(tokens, ends)], vocab_size=10, eos_id=9))
    cache.export("megatron", tmp_path / "m")
    convert(tmp_path / "m", tmp_path / "n", shard_tokens=8)
    native = streampack.open(tmp_path / "n")
    assert list(native.table.num_tokens) == [5, 15, 2, 8, 10]
    assert list(native.table.num_docs) == [2, 1, 1, 1, 1]
    assert native.manifest.units[1] == "megatron:m.bin[documents 2:3]"
    np.testing.assert_array_equal(native.tokens(0, 40), tokens)
    assert run_cli("verify", str(tmp_path / "n")).returncode == 0


def test_an_sft_cache_keeps_its_loss_mask(sft: streampack.Cache, tmp_path: Path) -> None:
    """The native export of a cache (here one with a loss mask) re-shards it, masks and all."""
    sft.export("streampack", tmp_path / "n", shard_tokens=1000)
    copy = streampack.open(tmp_path / "n")
    assert copy.has_loss_mask and copy.num_shards > sft.num_shards
    for i in range(sft.num_docs):
        np.testing.assert_array_equal(copy.doc(i), sft.doc(i))
        np.testing.assert_array_equal(copy.doc_loss_mask(i), sft.doc_loss_mask(i))
    assert run_cli("verify", str(tmp_path / "n")).returncode == 0


def test_the_cli_converts_and_refuses_clearly(natural: streampack.Cache, tmp_path: Path) -> None:
    """``streampack convert`` with the source's options; a damaged source is one line naming its file,
    with nothing at ``--out``; an existing ``--out`` is kept unless ``--overwrite``."""
    natural.export("megatron", tmp_path / "m")
    done = run_cli("convert", str(tmp_path / "m"), "--out", str(tmp_path / "n"), "--eos-id", "50256")
    assert done.returncode == 0, done.stderr
    assert f"converted {natural.num_docs:,} documents" in done.stdout
    assert streampack.open(tmp_path / "n").eos_id == 50256
    again = run_cli("convert", str(tmp_path / "m"), "--out", str(tmp_path / "n"), check=False)
    assert again.returncode == 1 and "the destination exists" in again.stderr
    assert "pass --overwrite to replace it" in again.stderr
    with pytest.raises(OptionsError, match="the destination exists"):
        convert(tmp_path / "m", tmp_path / "n")

    cut = tmp_path / "cut"
    (tmp_path / "cut.idx").write_bytes((tmp_path / "m.idx").read_bytes())
    (tmp_path / "cut.bin").write_bytes((tmp_path / "m.bin").read_bytes()[:1000])
    failed = run_cli("convert", str(cut), "--out", str(tmp_path / "x"), check=False)
    assert failed.returncode == 1 and "Traceback" not in failed.stderr
    assert f"{cut}.bin: 1,000 bytes, but the" in failed.stderr
    assert not (tmp_path / "x").exists()


def test_export_takes_another_formats_files_with_their_options(
    natural: streampack.Cache, tmp_path: Path
) -> None:
    """``streampack export SOURCE`` of a Megatron pair: to a cache, with ``--eos-id`` and ``--format``."""
    natural.export("megatron", tmp_path / "m")
    done = run_cli(
        "export", str(tmp_path / "m"), "--format", "megatron", "--eos-id", "50256",
        "--to", "streampack", "--out", str(tmp_path / "n"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert streampack.open(tmp_path / "n").num_docs == natural.num_docs


@pytest.mark.parametrize("format", ["nanogpt", "llmc", "olmo"])
@pytest.mark.filterwarnings("ignore::streampack.errors.DocumentBoundaryWarning")  # documents over a shard
def test_a_scanned_format_converts_in_one_read_to_the_files_of_an_open_and_export(
    format: str,
    natural: streampack.Cache,
    sft: streampack.Cache,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A format without an index (its documents found by a scan) converts with the copy and the scan side
    by side (:func:`streampack.interop.native.write_scanned`): the same bytes, file for file, as an export
    of the opened cache, over several shards (and OLMo's label masks), which ``verify`` passes."""
    source = natural
    if format == "olmo":  # an SFT cache in several shards: several token files, and their label masks
        sft.export("streampack", tmp_path / "sharded", shard_tokens=1000)
        source = streampack.open(tmp_path / "sharded")
    monkeypatch.setattr(nanogpt, "SHARD_TOKENS", 50_000)
    source.export(format, tmp_path / "src", **({"shard_tokens": 40_000} if format == "llmc" else {}))
    declared = {} if format == "llmc" else {"eos_id": source.eos_id}
    plan = scan_plan(tmp_path / "src", declared)
    assert plan is not None and len(plan.spans) > 1
    convert(tmp_path / "src", tmp_path / "scanned", **declared)
    with streampack.open(tmp_path / "src", **declared) as opened:
        opened.export("streampack", tmp_path / "opened")
    files = sorted(
        p.relative_to(tmp_path / "opened") for p in (tmp_path / "opened").rglob("*") if p.is_file()
    )
    assert files == sorted(
        p.relative_to(tmp_path / "scanned") for p in (tmp_path / "scanned").rglob("*") if p.is_file()
    )
    for name in files:
        assert (tmp_path / "scanned" / name).read_bytes() == (tmp_path / "opened" / name).read_bytes(), name
    converted = streampack.open(tmp_path / "scanned")
    assert converted.num_shards == len(plan.spans) and converted.has_loss_mask == (format == "olmo")
    # llm.c cuts its shards at a token count: the manifest says a shard's first document may continue
    assert converted.manifest.settings.extra.get("continued_documents", False) == (format == "llmc")
    for checked, given in (("scanned", {}), ("src", declared)):  # llm.c's documents continue across shards
        verified = run_cli("verify", str(tmp_path / checked), *(f"--eos-id={v}" for v in given.values()))
        assert verified.returncode == 0, verified.stdout + verified.stderr


def test_mds_samples_convert_where_they_lie(natural: streampack.Cache, tmp_path: Path) -> None:
    """MDS samples (a header before each document's values) convert without a copy of the shard first:
    each document's values written from the shard's map, cut into shards between documents, the same
    documents, checksums that ``verify`` checks; a damaged header is refused before anything is kept."""
    natural.export("mds", tmp_path / "mds", size_limit=1 << 20)
    convert(tmp_path / "mds", tmp_path / "n", eos_id=natural.eos_id, shard_tokens=100_000)
    native = streampack.open(tmp_path / "n")
    assert native.num_shards > streampack.open(tmp_path / "mds").num_shards
    assert native.num_docs == natural.num_docs
    for i in range(0, natural.num_docs, 7):
        np.testing.assert_array_equal(native.doc(i), natural.doc(i))
    assert run_cli("verify", str(tmp_path / "n")).returncode == 0
    shard = tmp_path / "mds" / "shard.00000.mds"
    raw = bytearray(shard.read_bytes())
    first = int(np.frombuffer(raw, dtype="<u4", count=2)[1])  # where sample 0 starts
    raw[first + 4] ^= 0xFF  # its ndim and shape dtype code
    shard.write_bytes(bytes(raw))
    with pytest.raises(CacheError, match=r"shard\.00000\.mds: sample 0's ndim and shape dtype is"):
        convert(tmp_path / "mds", tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_ids_past_the_declared_vocabulary_are_refused_and_nothing_is_kept(tmp_path: Path) -> None:
    """A converted cache records the vocabulary declared for the files: an id at or past it is refused, in
    the scanned formats (nanoGPT) and in the opened ones (Megatron), naming the file and token; the same
    files with the vocabulary that covers them convert."""
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    import torch

    tokens = np.array([1, 2, 3, 50256, 5, 60000, 7, 50256], dtype=np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    builder = indexed.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.int32)
    for doc in (tokens[:4], tokens[4:]):
        builder.add_document(torch.tensor(doc.astype(np.int32)), [len(doc)])
    builder.finalize(str(tmp_path / "m.idx"))
    nano = {"format": "nanogpt", "eos_id": 50256, "dtype": "uint16"}
    for source, declared, where in (
        (tmp_path / "train.bin", nano, r"train.bin: token 5: the id 60,000"),
        (tmp_path / "m", {"eos_id": 50256}, r"m.bin, document 1, token 1: the id 60,000"),
    ):
        out = tmp_path / f"{source.name}-out"
        with pytest.raises(CacheError, match=f"{where} is not below the vocabulary of 50,257 ids"):
            convert(source, out, vocab_size=50257, **declared)
        assert not out.exists()
        convert(source, out, vocab_size=60001, **declared)
        assert streampack.open(out).doc(1).tolist() == [5, 60000, 7, 50256]
    flags = ["--format", "nanogpt", "--eos-id", "50256", "--dtype", "uint16", "--vocab-size", "50257"]
    refused = run_cli("convert", tmp_path / "train.bin", "--out", tmp_path / "cli", *flags, check=False)
    assert refused.returncode != 0 and "Nothing was kept" in refused.stderr

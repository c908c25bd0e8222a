"""What holds for every format ``streampack.open`` reads: ``which`` names each document by its file and its
index there, and a mixture takes a foreign cache beside a native one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import streampack
from tests.conftest import run_cli

EOS = {"eos_id": 50256}
#: (format, what opening it needs, what opening one of its files alone needs: None if one cannot be)
FORMATS = [
    ("megatron", EOS, EOS),
    ("datatrove", EOS, EOS),
    ("olmo", {}, EOS),  # olmo.json says the EOS; one token file does not
    ("nanogpt", EOS, EOS),
    ("llmc", {}, {}),
    ("mds", {}, None),  # a shard needs its index.json
]


@pytest.mark.parametrize(("name", "declared", "alone"), FORMATS, ids=[f[0] for f in FORMATS])
def test_which_names_each_document_by_its_file_and_index_there(
    natural: streampack.Cache, tmp_path: Path, name: str, declared: dict, alone: dict | None
) -> None:
    """The documents of a step's batch: ``location`` is ``FILE[i]``, and the i-th document of FILE opened
    alone is the batch's document."""
    dest = tmp_path / name
    natural.export(name, dest)
    opened = streampack.open(dest, **declared)
    loader = streampack.Loader(opened.sequences(256), batch_size=16, seed=4)
    found = streampack.which(loader, 7)
    assert found and all(doc.line is None and doc.row is not None for doc in found)
    for doc in found:
        assert doc.location == f"{doc.path}[{doc.row}]"
        if alone is not None:
            single = streampack.open(doc.path, **alone)
            np.testing.assert_array_equal(single.doc(doc.row), opened.doc(doc.doc))
        else:
            assert Path(doc.path).parent == dest and doc.row < opened.num_docs
    if name == "megatron":
        flags = ["--eos-id", "50256"]
        shown = run_cli(
            "which", dest, "--seq-len", "256", "--batch-size", "16", "--seed", "4", "--step", "7", *flags
        )
        assert f"{found[0].path}[{found[0].row}]" in shown.stdout


def test_a_mixture_reads_a_foreign_cache_beside_a_native_one(
    natural: streampack.Cache, tmp_path: Path
) -> None:
    """A Loader over a mixture of the native cache and its Megatron export: every row is a window of one
    of them, both are read, and ``which`` names the source of each document."""
    natural.export("megatron", tmp_path / "m")
    foreign = streampack.open(tmp_path / "m", eos_id=50256)
    sources = {"native": natural.sequences(128), "megatron": foreign.sequences(128)}
    mixture = streampack.Mixture(sources, weights={"native": 1, "megatron": 1}, seed=2)
    loader = streampack.Loader(mixture, batch_size=8)
    windows = {tuple(row) for row in natural.sequences(128)[np.arange(len(natural.sequences(128)))]}
    for _, batch in zip(range(10), loader, strict=False):
        assert all(tuple(row) in windows for row in batch)  # the same tokens either way
    names = {doc.source for step in range(10) for doc in streampack.which(loader, step)}
    assert names == {"native", "megatron"}


#: (format, the files of the first shard that export writes: tokens, then document ends; its loss mask's)
SHARD_FILES = [
    ("megatron", ("m.bin", "m.idx"), None),
    ("datatrove", ("00000.ds", "00000.ds.index"), "00000.ds.loss"),
    ("olmo", ("token_ids_part_000000.npy",), "labels_mask_part_000000.npy"),
]


@pytest.mark.parametrize(("name", "files", "mask"), SHARD_FILES, ids=[f[0] for f in SHARD_FILES])
def test_a_foreign_cache_names_its_own_files_for_each_shard(
    natural: streampack.Cache,
    sft: streampack.Cache,
    tmp_path: Path,
    name: str,
    files: tuple,
    mask: str | None,
) -> None:
    """``shard_paths``, ``shard_keys`` and ``shard_mask_path`` answer with the format's files (what a
    prefetcher fetches), through the cache's ``Shards``: never with a native shard's names."""
    source = natural if mask is None else sft
    dest = tmp_path / ("m" if name == "megatron" else name)
    source.export(name, dest)
    opened = streampack.open(dest, eos_id=source.eos_id)
    folder = dest.parent if name == "megatron" else dest
    paths = opened.shard_paths(0)
    assert [p.name for p in paths] == list(files) and all(p.parent == folder and p.is_file() for p in paths)
    keys = opened.shard_keys(0)
    assert (
        keys[: len(files)] == [str(p) for p in paths] and opened.shard_keys(0, boundaries=False) == keys[:1]
    )
    if mask is None:
        assert opened.shard_mask_path(0) is None and len(keys) == len(files)
    else:
        assert opened.shard_mask_path(0) == folder / mask and keys[-1] == str(folder / mask)
        assert (folder / mask).stat().st_size >= int(opened.table.num_tokens[0])
    assert opened.shard_paths(-1) == opened.shard_paths(opened.num_shards - 1)
    with pytest.raises(IndexError):
        opened.shard_paths(opened.num_shards)

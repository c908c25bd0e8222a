"""Other formats' token files in object storage (streampack/reader/foreign/opening.py, files.py): opened
through the bounded local copy a native remote cache is read through, against a real S3 server (moto's, on
127.0.0.1, through s3fs) and a real HTTP server; no mocks."""

from __future__ import annotations

import itertools
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import streampack
from streampack.errors import CacheError, OptionsError
from streampack.store.localcopy import CachedStore
from tests.conftest import s3_options

pytest.importorskip("s3fs", reason="reading from S3 needs s3fs (the dev extra has it)")

GPT2_EOS = 50256


def upload(fs: Any, local: Path, url_path: str) -> None:
    """``local`` (a file or a folder's files) to ``bucket/...`` as objects."""
    if local.is_dir():
        for path in sorted(local.iterdir()):
            fs.put_file(str(path), f"{url_path}/{path.name}")
    else:
        fs.put_file(str(local), url_path)


def assert_same_documents(opened: streampack.Cache, local: streampack.Cache) -> None:
    assert (opened.num_docs, opened.num_tokens, opened.num_shards) == (
        local.num_docs,
        local.num_tokens,
        local.num_shards,
    )
    for i in range(0, local.num_docs, 7):
        np.testing.assert_array_equal(opened.doc(i), local.doc(i))


def test_a_megatron_pair_in_s3_opens_through_the_local_copy(
    megatron_export: Path, bucket: tuple[Any, str], s3_endpoint: str, tmp_path: Path
) -> None:
    """``open("s3://b/data/corpus", format="megatron")``: the same documents, windows and batches as the
    local pair; the files are fetched into local_dir (once), the cache names them by their URLs (which
    and its shard keys), and its samples reopen it from the URL when unpickled."""
    fs, name = bucket
    for suffix in (".bin", ".idx"):
        upload(fs, Path(f"{megatron_export}{suffix}"), f"{name}/data/corpus{suffix}")
    url = f"s3://{name}/data/corpus"
    options = {"storage_options": s3_options(s3_endpoint), "local_dir": tmp_path / "copy"}
    local = streampack.open(megatron_export, eos_id=GPT2_EOS)
    with streampack.open(url, format="megatron", eos_id=GPT2_EOS, **options) as opened:
        assert isinstance(opened.store, CachedStore) and opened.store.uri == url
        assert opened.shard_keys(0) == ["corpus.bin", "corpus.idx"]
        assert opened.files.describe(0, "tokens") == f"{url}.bin"
        assert opened.files.token_file(0) is None  # no local file to copy from in an export
        assert_same_documents(opened, local)
        # What the files hold, not where: a state saved over the local pair resumes over the bucket's.
        assert opened.content_digest == local.content_digest
        copies = sorted(p.name for p in (tmp_path / "copy" / "shards").iterdir())
        assert [c.rsplit(".", 1)[0] for c in copies] == ["corpus.bin", "corpus.idx"]
        assert opened.shard_paths(0)[0].parent == tmp_path / "copy" / "shards"
        ours, theirs = opened.sequences(512), local.sequences(512)
        loaders = [streampack.Loader(s, batch_size=8, seed=3) for s in (ours, theirs)]
        for got, expected in itertools.islice(zip(*loaders), 5):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
        found = streampack.which(loaders[0], 2)
        assert found and all(doc.location.startswith(f"{url}.bin[") for doc in found)
        again = pickle.loads(pickle.dumps(ours))  # how DataLoader workers get it
        np.testing.assert_array_equal(again[np.arange(20)], theirs[np.arange(20)])
        downloads = opened.store.downloads
    with streampack.open(url, eos_id=GPT2_EOS, **options) as recognised:  # no manifest.json: a pair
        assert recognised.declared == {"eos_id": GPT2_EOS, "format": "megatron"}
        np.testing.assert_array_equal(recognised.doc(-1), local.doc(-1))
        assert recognised.store.downloads == 0 and downloads == 2  # the copies are reused


def test_a_datatrove_folder_in_s3_opens_with_its_loss_mask_within_the_bound(
    natural: streampack.Cache, bucket: tuple[Any, str], s3_endpoint: str, tmp_path: Path
) -> None:
    """A datatrove folder of several ``.ds`` files (with ``.ds.loss``): its documents and loss mask as the
    local folder's, the index files fetched at open, the token files when read, never more than
    ``max_local_bytes`` of copies; a Loader over it lists the ``.ds`` files of its next steps to prefetch."""
    fs, name = bucket
    folder = tmp_path / "dt"
    natural.export("datatrove", folder)
    upload(fs, folder, f"{name}/dt")
    local = streampack.open(folder, eos_id=GPT2_EOS)
    assert local.num_shards > 3
    largest = max(p.stat().st_size for p in folder.glob("*.ds"))
    bound = 3 * largest
    url = f"s3://{name}/dt"
    with streampack.open(
        url,
        eos_id=GPT2_EOS,
        storage_options=s3_options(s3_endpoint),
        local_dir=tmp_path / "copy",
        max_local_bytes=bound,
    ) as opened:
        assert opened.declared == {"eos_id": GPT2_EOS, "format": "datatrove"}
        assert opened.store.downloads == opened.num_shards  # the .ds.index files, at open
        assert_same_documents(opened, local)
        assert opened.content_digest == local.content_digest  # what the files hold, read by range
        used = opened.store.local_bytes()
        assert used <= bound and opened.store.downloads > opened.num_shards
        loader = streampack.Loader(opened.sequences(256), batch_size=4, seed=1)
        ahead = loader.lookahead(0, 6)
        assert ahead and all(store is opened.store for store, _ in ahead)
        assert {key for _, key in ahead} <= {f"dt/{p.name}" for p in folder.iterdir()}
        assert any(key.endswith(".ds") for _, key in ahead)


def test_a_datatrove_sft_folder_in_s3_keeps_its_loss_mask(
    sft: streampack.Cache, bucket: tuple[Any, str], s3_endpoint: str, tmp_path: Path
) -> None:
    fs, name = bucket
    sft.export("datatrove", tmp_path / "dt")
    upload(fs, tmp_path / "dt", f"{name}/sft")
    options = {"storage_options": s3_options(s3_endpoint), "local_dir": tmp_path / "copy"}
    with streampack.open(f"s3://{name}/sft", eos_id=sft.eos_id, **options) as opened:
        assert opened.has_loss_mask and opened.shard_keys(0)[-1] == "sft/00000.ds.loss"
        for i in range(0, sft.num_docs, 11):
            np.testing.assert_array_equal(opened.doc(i), sft.doc(i))
            np.testing.assert_array_equal(opened.doc_loss_mask(i), sft.doc_loss_mask(i))


def test_damaged_files_in_s3_are_named_by_their_urls(
    megatron_export: Path, bucket: tuple[Any, str], s3_endpoint: str, tmp_path: Path
) -> None:
    fs, name = bucket
    upload(fs, Path(f"{megatron_export}.idx"), f"{name}/cut.idx")
    fs.pipe_file(f"{name}/cut.bin", Path(f"{megatron_export}.bin").read_bytes()[:-2])
    options = {"storage_options": s3_options(s3_endpoint), "local_dir": tmp_path / "copy"}
    with pytest.raises(CacheError) as error:
        streampack.open(f"s3://{name}/cut", **options)
    assert str(error.value).startswith(f"s3://{name}/cut.bin: ") and str(tmp_path) not in str(error.value)


@pytest.mark.parametrize("fmt", ["llmc", "olmo", "nanogpt", "mds"])
def test_formats_read_locally_only_are_refused_in_object_storage_saying_which_are_not(
    natural: streampack.Cache, bucket: tuple[Any, str], s3_endpoint: str, tmp_path: Path, fmt: str
) -> None:
    fs, name = bucket
    natural.export(fmt, tmp_path / fmt)
    upload(fs, tmp_path / fmt, f"{name}/{fmt}")
    options = {"storage_options": s3_options(s3_endpoint), "local_dir": tmp_path / "copy"}
    with pytest.raises(OptionsError, match=rf"{fmt} files are read from a local path; from object storage "
                       "streampack opens megatron and datatrove files"):  # fmt: skip
        streampack.open(f"s3://{name}/{fmt}", format=fmt, **options)
    with pytest.raises(
        CacheError,
        match=r"manifest.json: not found: no streampack cache there, nor the token files of a format read "
        r"from object storage \(megatron: .*datatrove",
    ):
        streampack.open(f"s3://{name}/{fmt}", **options)  # not recognised among those


def test_a_megatron_pair_over_http_opens_too(
    megatron_export: Path, http_root: tuple[Path, str], tmp_path: Path
) -> None:
    pytest.importorskip("aiohttp", reason="fsspec's HTTP filesystem needs aiohttp (the dev extra has it)")
    root, base = http_root
    for suffix in (".bin", ".idx"):
        (root / f"corpus{suffix}").write_bytes(Path(f"{megatron_export}{suffix}").read_bytes())
    local = streampack.open(megatron_export)
    with streampack.open(f"{base}/corpus", format="megatron", local_dir=tmp_path / "copy") as opened:
        assert_same_documents(opened, local)


def test_an_object_replaced_under_its_url_is_fetched_again_and_verified_as_it_is_now(
    megatron_export: Path, bucket: tuple[Any, str], s3_endpoint: str, tmp_path: Path
) -> None:
    """A foreign file records no checksum: its copy is named by its size and ETag, so a ``.bin``
    rewritten with other tokens of the same size is fetched again, never served from the old copy; verify
    checks the tokens as they are now, naming the object."""
    fs, name = bucket
    for suffix in (".bin", ".idx"):
        upload(fs, Path(f"{megatron_export}{suffix}"), f"{name}/p{suffix}")
    url = f"s3://{name}/p"
    options = {"storage_options": s3_options(s3_endpoint), "local_dir": tmp_path / "copy"}
    with streampack.open(url, **options) as first:
        before = np.array(first.doc(0))
    tokens = np.fromfile(f"{megatron_export}.bin", dtype=np.uint16)
    tokens[0] ^= 1
    fs.pipe_file(f"{name}/p.bin", tokens.tobytes())
    with streampack.open(url, **options) as second:
        assert int(second.doc(0)[0]) == int(before[0]) ^ 1
        assert second.store.downloads == 1  # the .bin again; the .idx is unchanged
    report = streampack.verify(url, storage_options=s3_options(s3_endpoint), eos_id=50256)
    assert report.ok, report.problems  # the tokens as they are now, through a local copy of them
    assert any("megatron files: their headers and indexes were checked" in note for note in report.notes)
    tokens[-1] ^= 1  # the last document no longer ends with the EOS
    fs.pipe_file(f"{name}/p.bin", tokens.tobytes())
    report = streampack.verify(url, storage_options=s3_options(s3_endpoint), eos_id=50256)
    assert not report.ok and report.problems[0].startswith(f"{url}.bin: document ")
    assert "does not end with EOS 50256" in report.problems[0]
    missing = streampack.verify(f"s3://{name}/nothing", storage_options=s3_options(s3_endpoint))
    assert missing.problems == [f"s3://{name}/nothing: no object or folder there"]


@pytest.mark.slow
def test_a_datatrove_folder_over_http_opens_where_the_server_lists_it(
    natural: streampack.Cache, http_root: tuple[Path, str], tmp_path: Path
) -> None:
    """A datatrove folder served by a plain HTTP server (Python's, which lists a folder as a page of
    links, as fsspec's HTTP filesystem reads it): the same documents."""
    pytest.importorskip("aiohttp", reason="fsspec's HTTP filesystem needs aiohttp (the dev extra has it)")
    root, base = http_root
    natural.export("datatrove", root / "dt")
    url = f"{base}/dt/"
    with streampack.open(url, format="datatrove", eos_id=50256, local_dir=tmp_path / "copy") as opened:
        assert_same_documents(opened, natural)
    assert streampack.verify(url, format="datatrove", eos_id=50256).ok

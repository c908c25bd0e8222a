"""Remote inputs through fsspec, served by a real HTTP server on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import pytest

import streampack
from streampack.errors import InputError
from tests.conftest import shard_bytes, write_jsonl

pytest.importorskip("aiohttp", reason="fsspec's HTTP filesystem needs aiohttp (the dev extra has it)")


def test_http_inputs_build_the_same_cache_as_local_files(tmp_path: Path, http_root: tuple[Path, str]) -> None:
    root, url = http_root
    records = [{"text": f"remote document {i} " * (i % 13)} for i in range(2000)]
    write_jsonl(root / "a.jsonl.gz", records)
    write_jsonl(root / "b.jsonl", records[:500])
    streampack.build([f"{url}/a.jsonl.gz", f"{url}/b.jsonl"], tmp_path / "remote", workers=2)
    streampack.build([root / "a.jsonl.gz", root / "b.jsonl"], tmp_path / "local", workers=2)
    remote, local = streampack.open(tmp_path / "remote"), streampack.open(tmp_path / "local")
    empty = sum(i % 13 == 0 for i in range(2000)) + sum(i % 13 == 0 for i in range(500))
    assert remote.num_docs == local.num_docs == 2500 - empty
    assert remote.manifest.empty_docs == empty
    assert [remote.doc(i).tolist() for i in (0, 1999, 2306)] == [
        local.doc(i).tolist() for i in (0, 1999, 2306)
    ]
    shards = {k: v for k, v in shard_bytes(tmp_path / "remote").items() if k.startswith("shards/")}
    assert shards == {k: v for k, v in shard_bytes(tmp_path / "local").items() if k.startswith("shards/")}


def test_missing_url_is_a_clear_error(tmp_path: Path, http_root: tuple[Path, str]) -> None:
    _, url = http_root
    with pytest.raises(InputError, match=r"missing\.jsonl"):
        streampack.build(f"{url}/missing.jsonl", tmp_path / "c")


def test_url_errors_say_why(tmp_path: Path, http_root: tuple[Path, str]) -> None:
    _, url = http_root
    with pytest.raises(InputError, match=r"missing\.jsonl: cannot read \(.*404"):
        streampack.build(f"{url}/missing.jsonl", tmp_path / "c")
    closed = url.rsplit(":", 1)[0] + ":1"  # nothing listens on port 1
    with pytest.raises(InputError, match=r"x\.jsonl: cannot read \(.*Cannot connect to host"):
        streampack.build(f"{closed}/x.jsonl", tmp_path / "c")

"""Builds to object storage: a real S3 server (moto's, on 127.0.0.1) driven through s3fs, no mocks."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import streampack
from streampack.errors import CacheError, ConfigMismatchError
from streampack.testing.linkproxy import LinkProxy
from tests.conftest import CREDENTIALS, s3_options, shard_bytes, write_jsonl

pytest.importorskip("s3fs", reason="builds to S3 need s3fs (the dev extra has it)")
pytest.importorskip(
    "moto.server", reason="the S3 tests need moto[server] (the dev extra has it): pip install 'moto[server]'"
)
options = s3_options


def make_inputs(root: Path, docs: int = 3000) -> list[Path]:
    """A JSONL file split into many small units, and a gzip file that is one unit."""
    rng = random.Random(3)
    words = ["alpha", "beta", "gamma", "delta", "Ünïcödé", "🙂", "tokens", "cache", "\n"]

    def text() -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(0, 200)))

    return [
        write_jsonl(root / "a.jsonl", [{"text": text()} for _ in range(docs)]),
        write_jsonl(root / "b.jsonl.gz", [{"text": text()} for _ in range(docs // 4)]),
    ]


def remote_bytes(fs: Any, prefix: str) -> dict[str, bytes]:
    """Every object under ``prefix``, by key relative to it."""
    fs.invalidate_cache()
    return {path[len(prefix) + 1 :]: fs.cat_file(path) for path in sorted(fs.find(prefix))}


BUILD = {"unit_bytes": 1 << 16, "workers": 2, "commit_seconds": 0}


@pytest.mark.slow
def test_a_build_to_s3_is_byte_identical_to_a_local_build_and_reads_back(
    tmp_path: Path, bpe_tokenizer: Path, bucket: tuple[Any, str], s3_endpoint: str
) -> None:
    fs, name = bucket
    inputs = make_inputs(tmp_path / "in", docs=600)
    url = f"s3://{name}/caches/c1"
    summary = streampack.build(
        inputs,
        url,
        tokenizer=str(bpe_tokenizer),
        staging_dir=str(tmp_path / "stage"),
        storage_options=options(s3_endpoint),
        **BUILD,
    )
    streampack.build(inputs, tmp_path / "local", tokenizer=str(bpe_tokenizer), **BUILD)
    local = shard_bytes(tmp_path / "local")
    assert summary.out == url and summary.num_shards > 3
    assert remote_bytes(fs, f"{name}/caches/c1") == local  # every object, the manifest and ledger too
    again = streampack.build(
        inputs, url, tokenizer=str(bpe_tokenizer), storage_options=options(s3_endpoint), **BUILD
    )
    assert again.num_docs == summary.num_docs  # complete: nothing rebuilt, nothing staged
    fs.get(f"{name}/caches/c1", str(tmp_path / "copy"), recursive=True)
    copy, straight = streampack.open(tmp_path / "copy"), streampack.open(tmp_path / "local")
    assert copy.num_docs == straight.num_docs
    assert [copy.doc(i).tolist() for i in (0, 7, copy.num_docs - 1)] == [
        straight.doc(i).tolist() for i in (0, 7, copy.num_docs - 1)
    ]
    assert streampack.verify(tmp_path / "copy").ok


def start_cli_build(args: list[str], endpoint: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
    return subprocess.Popen(
        [sys.executable, "-m", "streampack", "build", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.parametrize("stage_kept", [True, False], ids=["stage-kept", "stage-gone"])
def test_a_build_killed_mid_upload_resumes_against_the_remote_ledger(
    tmp_path: Path, bpe_tokenizer: Path, bucket: tuple[Any, str], s3_endpoint: str, stage_kept: bool
) -> None:
    """SIGKILL a real CLI build once some units are up: the manifest up names no shard, every ledger entry
    up has its shard's files up, and the rerun (with the stage kept or deleted) ends byte-identical to a
    local build without redoing the units that were up."""
    fs, name = bucket
    inputs = make_inputs(tmp_path / "in", docs=12000)
    url, stage = f"s3://{name}/c", tmp_path / "stage"
    args = [*map(str, inputs), "--out", url, "--staging-dir", str(stage), "--tokenizer", str(bpe_tokenizer)]
    args += ["--unit-mb", "1", "--workers", "1", "--commit-seconds", "0"]
    proc = start_cli_build(args, s3_endpoint)
    up: list[str] = []
    deadline = time.monotonic() + 120
    while proc.poll() is None and len(up) < 2 and time.monotonic() < deadline:
        fs.invalidate_cache()
        up = fs.ls(f"{name}/c/ledger") if fs.exists(f"{name}/c/ledger") else []
        time.sleep(0.05)
    assert proc.poll() is None, "the build finished before it could be killed: make the corpus larger"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)

    objects = remote_bytes(fs, f"{name}/c")
    manifest = streampack.store.files.load_manifest(
        streampack.store.remote.RemoteStore(url, options(s3_endpoint))
    )
    assert not manifest.complete and manifest.shards == []
    for key in (k for k in objects if k.startswith("ledger/")):
        stem = key.split("/")[1].removesuffix(".json")
        assert f"shards/{stem}.tokens" in objects and f"shards/{stem}.offsets" in objects
    if not stage_kept:
        shutil.rmtree(stage)
    resumed = start_cli_build(args, s3_endpoint)
    stdout, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr.decode()
    done = re.search(r"resumed: (\d+) units already done", stdout.decode())
    assert done and int(done[1]) >= sum(k.startswith("ledger/") for k in objects) >= 2, stdout.decode()
    streampack.build(inputs, tmp_path / "local", tokenizer=str(bpe_tokenizer), unit_bytes=1 << 20)
    assert remote_bytes(fs, f"{name}/c") == shard_bytes(tmp_path / "local")


def test_a_resumed_build_with_other_settings_is_refused_naming_the_url(
    tmp_path: Path, bpe_tokenizer: Path, bucket: tuple[Any, str], s3_endpoint: str
) -> None:
    _, name = bucket
    inputs = make_inputs(tmp_path / "in", docs=100)
    url = f"s3://{name}/c"
    streampack.build(inputs, url, tokenizer=str(bpe_tokenizer), storage_options=options(s3_endpoint))
    mismatch = rf"{url} holds a cache built with other settings"
    with pytest.raises(ConfigMismatchError, match=mismatch):
        streampack.build(inputs, url, tokenizer="bytes", storage_options=options(s3_endpoint))


def test_an_unreachable_store_is_a_clear_error_after_retries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    unreachable = {
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:1"},  # nothing listens on port 1
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    inputs = make_inputs(tmp_path / "in", docs=10)
    with pytest.raises(CacheError, match=r"s3://nowhere/c/manifest\.json: cannot check after 4 "):
        streampack.build(
            inputs, "s3://nowhere/c", storage_options=unreachable, staging_dir=str(tmp_path / "s")
        )
    with pytest.raises(CacheError, match=r"nowhere/c/manifest\.json: cannot check \(TypeError"):
        streampack.build(
            inputs, "s3://nowhere/c", storage_options={"bogus": 1}, staging_dir=str(tmp_path / "s")
        )


@pytest.mark.slow
def test_a_build_through_a_link_that_resets_connections_completes_byte_identical(
    tmp_path: Path, bpe_tokenizer: Path, bucket: tuple[Any, str], s3_endpoint: str
) -> None:
    fs, name = bucket
    host, port = s3_endpoint.removeprefix("http://").split(":")
    proxy = LinkProxy((host, int(port)), reset_every=3)
    try:
        flaky = {
            "client_kwargs": {"endpoint_url": proxy.url},
            "config_kwargs": {"retries": {"max_attempts": 1}},  # botocore gives up: s3fs or we retry
            "skip_instance_cache": True,
        }
        inputs = make_inputs(tmp_path / "in", docs=400)
        url = f"s3://{name}/c"
        streampack.build(inputs, url, tokenizer=str(bpe_tokenizer), storage_options=flaky, **BUILD)
    finally:
        proxy.close()
    assert proxy.connections > 3  # some were reset
    streampack.build(inputs, tmp_path / "local", tokenizer=str(bpe_tokenizer), **BUILD)
    assert remote_bytes(fs, f"{name}/c") == shard_bytes(tmp_path / "local")


def test_a_range_past_the_end_of_a_cut_object_fails_at_once_without_retries(s3_endpoint: str) -> None:
    import s3fs

    from streampack.errors import CacheError
    from streampack.store.remote import RemoteStore

    s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}).mkdir("cut-objects")
    store = RemoteStore("s3://cut-objects/c", s3_options(s3_endpoint), attempts=4, backoff=5.0)
    store.put_atomic("x", b"0123456789")
    with pytest.raises(CacheError, match="cannot read") as refused:
        store.read("x", 12, 20)  # the store refuses the range: asking again gives the same answer
    assert "attempts" not in str(refused.value)

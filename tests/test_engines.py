"""Engines only schedule: a build on a real local Ray cluster gives the same bytes as the process pool."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import streampack
from tests.conftest import shard_bytes, write_bytes, write_jsonl

ray = pytest.importorskip("ray", reason="the ray extra is not installed")


@pytest.fixture(scope="module")
def local_cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_ray_engine_matches_local(
    tmp_path: Path, bpe_tokenizer: Path, local_cluster: None, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = [
        write_jsonl(
            tmp_path / "in" / f"{i}.jsonl.gz", [{"text": f"doc {i}.{j} " * (j % 40)} for j in range(2000)]
        )
        for i in range(3)
    ]
    inputs.append(
        write_jsonl(tmp_path / "in" / "big.jsonl", [{"text": "word " * (j % 90)} for j in range(3000)])
    )
    options = {"tokenizer": str(bpe_tokenizer), "unit_bytes": 1 << 16}
    streampack.build(inputs, tmp_path / "ray", engine="ray", progress=True, **options)
    assert "9,000 docs" in capsys.readouterr().err.splitlines()[-1]  # the tasks' progress reached the bar
    streampack.build(inputs, tmp_path / "local", workers=2, **options)
    assert streampack.open(tmp_path / "ray").num_shards > 4
    assert shard_bytes(tmp_path / "ray") == shard_bytes(tmp_path / "local")


@pytest.mark.slow
def test_ray_engine_reports_bad_records_like_local(tmp_path: Path, local_cluster: None) -> None:
    src = write_bytes(tmp_path / "bad.jsonl", b'{"text": "ok"}\n{"oops": 1}\n')
    with pytest.raises(streampack.BadRecordError, match=r"bad\.jsonl:2: no 'text' field"):
        streampack.build(src, tmp_path / "c", engine="ray")

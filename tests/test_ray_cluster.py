"""The Ray executor on a simulated two-node cluster (two raylets of one CPU each on this machine): the units
spread over both nodes, the cache is byte-identical to a local build, and a node lost mid-build costs at
most a rerun of the same command."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import streampack
from tests.conftest import SAMPLE_CORPUS, run_cli, shard_bytes

CORPUS_MB = 6  # six units of 1 MB (the CLI's smallest --unit-mb): enough for both nodes to run several

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample corpus' first documents, up to 6 MiB, as plain JSONL (a compressed input is one unit)."""
    zstandard = pytest.importorskip("zstandard")
    if not SAMPLE_CORPUS.exists():
        pytest.skip(f"sample corpus not found at {SAMPLE_CORPUS} (../shared/data is absent)")
    lines, size = [], 0
    with open(SAMPLE_CORPUS, "rb") as f:
        for line in io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(f)):
            if size + len(line) > CORPUS_MB << 20:
                break
            lines.append(line)
            size += len(line)
    path = tmp_path_factory.mktemp("corpus") / "natural.jsonl"
    path.write_bytes(b"".join(lines))
    return path


class TwoNodes:
    """A head and a second node of one CPU each; this process is connected to it as a Ray driver."""

    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        # Fast health checks: a removed node is declared dead (and its tasks failed) within ~1 s, not ~30 s.
        checks = {"health_check_period_ms": 500, "health_check_failure_threshold": 2}
        head = {"num_cpus": 1, "_system_config": {**checks, "health_check_initial_delay_ms": 0}}
        self.cluster = Cluster(initialize_head=True, connect=True, head_node_args=head)
        self.second = self.add()

    @property
    def address(self) -> str:
        """The head node's GCS address, as ``--ray-address`` takes it."""
        return str(self.cluster.address)

    def add(self) -> Any:
        """Start a second node of one CPU and wait until the cluster sees it."""
        node = self.cluster.add_node(num_cpus=1)
        self.cluster.wait_for_nodes()
        return node

    def node_ids(self) -> set[str]:
        """The ids of the nodes alive now."""
        import ray

        return {node["NodeID"] for node in ray.nodes() if node["Alive"]}

    def shutdown(self) -> None:
        """Disconnect this driver and stop every node's processes."""
        import ray

        ray.shutdown()
        self.cluster.shutdown()


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[TwoNodes]:
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    assert not ray.is_initialized()
    nodes = TwoNodes()
    try:
        yield nodes
    finally:
        nodes.shutdown()


def test_a_build_spreads_over_two_nodes_and_matches_local(
    tmp_path: Path, corpus: Path, gpt2_tokenizer: Path, two_nodes: TwoNodes, caplog: pytest.LogCaptureFixture
) -> None:
    options: dict[str, Any] = {"tokenizer": str(gpt2_tokenizer), "unit_bytes": 1 << 20}
    with caplog.at_level(logging.DEBUG, logger="streampack.builder.executors"):
        streampack.build(corpus, tmp_path / "ray", executor="ray", **options)
    ran_on = [r.getMessage().rsplit(" ", 1)[1] for r in caplog.records if "ran on Ray node" in r.message]
    assert len(ran_on) == CORPUS_MB
    assert set(ran_on) == two_nodes.node_ids()  # both nodes ran units
    streampack.build(corpus, tmp_path / "local", workers=1, **options)
    assert streampack.open(tmp_path / "ray").num_shards == CORPUS_MB
    assert shard_bytes(tmp_path / "ray") == shard_bytes(tmp_path / "local")  # shards, ledger, manifest


def _running_a_unit(node: Any) -> bool:
    """Whether a worker of ``node`` (a child of its raylet) is running a unit's task now."""
    import psutil
    from ray._private import ray_constants

    raylet = psutil.Process(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
    for child in raylet.children(recursive=True):
        try:
            if child.cmdline()[:1] == ["ray::_run_ray_task"]:  # the title Ray gives a worker in a task
                return True
        except psutil.Error:
            continue
    return False


def test_a_node_lost_mid_build_costs_a_rerun_at_most(
    tmp_path: Path, corpus: Path, gpt2_tokenizer: Path, two_nodes: TwoNodes
) -> None:
    """The second node is removed while it runs a unit: the CLI build completes or stops with the
    resumable error, and the same command run again completes it byte-identical to a local build."""
    # The reference engine: ~10x slower than the default, so that the units outlast the polling below.
    args = [corpus, "--tokenizer", gpt2_tokenizer, "--unit-mb", "1", "--tokenizer-engine", "tokenizers"]
    ray_args = [*args, "--out", tmp_path / "ray", "--executor", "ray", "--ray-address", two_nodes.address]
    cmd = [sys.executable, "-m", "streampack", "build", *map(str, ray_args)]
    build = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not _running_a_unit(two_nodes.second):
            assert build.poll() is None, "the build ended before the second node ran a unit"
            assert time.monotonic() < deadline, "the second node ran no unit within 120 s"
            time.sleep(0.05)
        two_nodes.cluster.remove_node(two_nodes.second)
        _, stderr = build.communicate(timeout=300)
    finally:
        if build.poll() is None:
            build.kill()
            build.wait()
    print(f"the build that lost a node exited with status {build.returncode}")
    try:
        if build.returncode != 0:
            assert "a Ray worker of the build failed" in stderr, stderr
            assert "rerun the same command to resume" in stderr
            assert "Traceback" not in stderr
            run_cli("build", *ray_args)  # on the head node alone
        run_cli("build", *args, "--out", tmp_path / "local", "--workers", "1")
        assert shard_bytes(tmp_path / "ray") == shard_bytes(tmp_path / "local")
    finally:
        two_nodes.second = two_nodes.add()  # the module's cluster has two nodes again

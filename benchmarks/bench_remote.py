"""Loader throughput from a cache in object storage: `python benchmarks/bench_remote.py [--quick]`.

One command, one run: a synthetic cache (random tokens, many shards) is written locally and uploaded to
an S3-compatible server on 127.0.0.1 (moto's, through s3fs), then the same shuffled Loader is timed
(samples/s) reading

* the local cache (page cache warm): the reference;
* the remote cache through a warm local copy (every shard already fetched): the goal is >= 0.9 of local;
* the remote cache through a cold local copy over a link throttled to 100 MB/s (a TCP proxy in front of
  the server, `streampack.testing.linkproxy`), without prefetching and with it (``prefetch_steps=8``).

Rows alternate between kinds (the machine is shared); each figure is the median of ``--repeats`` runs.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import streampack
from benchmarks._report import environment, goal, parser, publish
from streampack.testing.caches import write_random_cache
from streampack.testing.linkproxy import LinkProxy

SEQ_LEN = 2048
BATCH = 16
LINK = 100e6  # bytes per second
STEP = 0.05  # seconds of "training" per batch in the cold rows: what prefetching overlaps downloads with


def samples_per_second(cache: streampack.Cache, batches: int, step: float = 0.0) -> float:
    """Samples/s of a shuffled loader over ``cache``, with ``step`` seconds of training per batch."""
    loader = streampack.Loader(cache.sequences(SEQ_LEN, overlap=1), batch_size=BATCH, seed=1)
    it = iter(loader)
    next(it)  # the first batch outside the timing: opening, planning
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
        time.sleep(step)
    return batches * BATCH / (time.perf_counter() - start)


def main() -> None:
    args = parser(__doc__ or "", "remote", repeats=3, batches=200).parse_args()
    tokens, shards = (4 << 20, 16) if args.quick else (32 << 20, 64)
    batches = 40 if args.quick else args.batches
    cold_batches = 20 if args.quick else 60
    os.environ.update(
        {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    )
    import s3fs
    from moto.server import ThreadedMotoServer

    tmp = Path(args.tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    proxy = LinkProxy((host, port), rate=LINK)
    try:
        local = write_random_cache(tmp / "local", tokens, num_shards=shards, seed=1)
        direct = {"client_kwargs": {"endpoint_url": f"http://{host}:{port}"}}
        fs = s3fs.S3FileSystem(**direct)
        fs.mkdir("bench")
        fs.put(str(local) + "/", "bench/c", recursive=True)
        url = "s3://bench/c"
        slow = {
            "client_kwargs": {"endpoint_url": proxy.url},
            "skip_instance_cache": True,
        }
        warm_dir = tmp / "warm"
        warmed = streampack.open(url, local_dir=warm_dir, storage_options=direct, prefetch_steps=0)
        for shard in range(warmed.num_shards):
            warmed.shard_tokens(shard)
        rows: dict[str, list[float]] = {"local": [], "warm": [], "cold": [], "cold+prefetch": []}
        for repeat in range(args.repeats):
            rows["local"].append(samples_per_second(streampack.open(local), batches))
            warm = streampack.open(url, local_dir=warm_dir, storage_options=direct, prefetch_steps=0)
            rows["warm"].append(samples_per_second(warm, batches))
            for kind, steps in (("cold", 0), ("cold+prefetch", 8)):
                cold_dir = tmp / f"cold-{repeat}-{steps}"
                cold = streampack.open(url, local_dir=cold_dir, storage_options=slow, prefetch_steps=steps)
                rows[kind].append(samples_per_second(cold, cold_batches, STEP))
            print(
                f"[bench_remote] repeat {repeat + 1}: "
                + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in rows.items()),
                file=sys.stderr,
                flush=True,
            )
    finally:
        proxy.close()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    report = render(rows, tokens, shards, batches, cold_batches, args)
    publish(report, "remote", args)


def render(
    rows: dict[str, list[float]], tokens: int, shards: int, batches: int, cold_batches: int, args: Any
) -> str:
    median = {kind: statistics.median(values) for kind, values in rows.items()}
    shard_mb = tokens * 2 / shards / 1e6
    lines = [
        "# Loader from a cache in object storage",
        "",
        environment(),
        "",
        f"Synthetic cache: {tokens:,} uint16 tokens in {shards} shards ({shard_mb:.1f} MB each) on a moto S3 "
        f"server on 127.0.0.1; Loader(seq_len={SEQ_LEN}, overlap=1, batch_size={BATCH}, shuffled), in "
        f"process. Median of {args.repeats} alternating runs; {batches} batches timed (warm), {cold_batches} "
        f"(cold, each followed by {STEP * 1000:.0f} ms of simulated training, which prefetching overlaps).",
        "",
        "| read from | samples/s | vs local |",
        "|---|---:|---:|",
    ]
    labels = {
        "local": "local cache (page cache warm)",
        "warm": "S3, warm local copy",
        "cold": f"S3, cold local copy, {LINK / 1e6:.0f} MB/s link, no prefetch",
        "cold+prefetch": f"S3, cold local copy, {LINK / 1e6:.0f} MB/s link, prefetch_steps=8",
    }
    for kind, label in labels.items():
        lines.append(f"| {label} | {median[kind]:,.0f} | {median[kind] / median['local']:.2f} |")
    lines += [
        "",
        "Goals:",
        "",
        goal("warm local copy / local cache", median["warm"] / median["local"], ">=", 0.9),
        "",
        f"Prefetch effect on a cold copy: {median['cold+prefetch'] / median['cold']:.2f}x.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

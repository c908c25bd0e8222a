"""Worker of ``bench_layouts.py``: one measurement per process, printed as one JSON line.

Every mode takes ``--cache DIR``, ``--layout`` and ``--seq-len``. Layouts: ``windows``
(``cache.sequences(seq_len)``: concat windows, no overlap, so that every layout's rows are ``seq_len``
wide and ``output="dict"`` accepts them), ``packed`` (``cache.packed(seq_len)``: best-fit decreasing,
documents longer than ``seq_len`` split) and ``documents`` (``cache.documents(seq_len)``: one document per
sample, truncated).

Modes:

* ``plan``: seconds of the first call that makes the samples (planning and storing the plan, when the
  caller removed any stored one) and of a second call (the stored plan, mapped), with the samples per
  epoch, the tokens they hold (padding excluded), the padding fraction and the plan's size on disk.
* ``throughput --output numpy|dict --workers N``: samples/s of ``Loader(samples, batch_size=32, seed=0,
  output=...)``, shuffled, over one timed run after a warm-up (at least ``--batches`` batches and
  ``--seconds`` seconds, so that fast rows are timed as long as slow ones); in this process
  (``--workers 0``) or through ``streampack.torch.DataLoader(num_workers=N)``. Also samples per CPU
  second of this process and its workers over the same run, and the tokens per sample (padding
  excluded, averaged over the epoch).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from typing import Any

from _procfs import children, cpu_seconds

import streampack
from streampack.loader import Loader
from streampack.samples import PackedSequences

BATCH = 32


def make_samples(cache: streampack.Cache, layout: str, seq_len: int) -> PackedSequences:
    """The samples of ``layout`` (see the module docstring)."""
    if layout == "windows":
        return cache.sequences(seq_len)
    if layout == "packed":
        return cache.packed(seq_len, too_long="split")
    return cache.documents(seq_len, too_long="truncate")


def real_tokens(samples: PackedSequences) -> int:
    """Tokens the samples hold, padding excluded (windows have none)."""
    layout = samples.layout
    return int(getattr(layout, "tokens", len(samples) * samples.width))


def plan(args: argparse.Namespace) -> dict[str, Any]:
    cache = streampack.open(args.cache)
    start = time.perf_counter()
    make_samples(cache, args.layout, args.seq_len)
    first = time.perf_counter() - start
    start = time.perf_counter()
    samples = make_samples(cache, args.layout, args.seq_len)
    second = time.perf_counter() - start
    directory = getattr(samples.layout, "directory", None)
    plan_bytes = sum(path.stat().st_size for path in directory.iterdir()) if directory else 0
    return {
        "first_s": first,
        "second_s": second,
        "samples": len(samples),
        "tokens": real_tokens(samples),
        "cache_tokens": cache.num_tokens,
        "padding": float(getattr(samples.layout, "padding", 0.0)),
        "plan_bytes": plan_bytes,
    }


def batches(args: argparse.Namespace, samples: PackedSequences) -> Iterator[Any]:
    """Endless shuffled batches of ``samples`` (the loader runs epoch after epoch)."""
    loader = Loader(samples, batch_size=BATCH, seed=0, output=args.output)
    if not args.workers:
        return iter(loader)
    from streampack.torch import DataLoader

    return iter(DataLoader(loader, num_workers=args.workers, persistent_workers=True))


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    samples = make_samples(streampack.open(args.cache), args.layout, args.seq_len)
    it = batches(args, samples)
    for _ in range(args.warmup):
        next(it)
    workers = children()
    # This process's own clock (ns resolution); /proc's clock ticks (10 ms) for the workers.
    cpu_before = time.process_time() + sum(cpu_seconds(pid) for pid in workers)
    start = time.perf_counter()
    count, seconds = 0, 0.0
    while count < args.batches or seconds < args.seconds:
        next(it)
        count += 1
        seconds = time.perf_counter() - start
    cpu = time.process_time() + sum(cpu_seconds(pid) for pid in workers) - cpu_before
    return {
        "samples_per_s": count * BATCH / seconds,
        "samples_per_cpu_s": count * BATCH / cpu,
        "tokens_per_sample": real_tokens(samples) / len(samples),
        "batches": count,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["plan", "throughput"])
    parser.add_argument("--cache", required=True)
    parser.add_argument("--layout", choices=["windows", "packed", "documents"], required=True)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--output", choices=["numpy", "dict"], default="numpy")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--batches", type=int, default=100, help="at least this many timed batches")
    parser.add_argument("--seconds", type=float, default=2.0, help="and at least this long")
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    run = {"plan": plan, "throughput": throughput}[args.mode]
    print(json.dumps(run(args)))
    os._exit(0)  # skip tearing down persistent DataLoader workers: the measurement is done


if __name__ == "__main__":
    main()

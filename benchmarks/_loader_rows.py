"""Worker of ``bench_loader.py``: one measurement per process, printed as one JSON line.

Modes:

* ``throughput --kind K``: samples/s of a batch source, best of ``--repeats`` runs of ``--batches``
  batches after a warm-up, and the peak ``RssAnon`` of this process and of its largest worker. Kinds:
  ``rowtake`` (the limit: 32 random windows taken as rows of a sliding-window view of the first shard's
  flat ``np.memmap``, ``.astype(int64)``), ``rowtake-cache`` (the same take, cache dtype out, no cast),
  ``gather`` (one vectorised 2-D fancy-index gather of the same windows, cache dtype out), ``nanogpt``
  (nanoGPT's ``get_batch``: per-row slices, ``astype(int64)``, ``torch.stack`` of x and y), ``loader``
  (streampack ``Loader``, int64 out), ``loader-uint16`` (``dtype=None``: cache dtype out),
  ``loader-tensors`` (workers send one shared-memory tensor per batch instead of shared slots). With
  ``--workers N > 0`` the baselines run in a plain ``torch.utils.data.DataLoader(batch_size=None)`` over
  an IterableDataset yielding their batches as tensors, and the loader through
  ``streampack.torch.DataLoader``; with 0 workers the numpy baselines yield numpy arrays (no torch).
* ``profile --kind K``: the same batches (0 workers) under ``cProfile`` after the warm-up; the top
  ``--top`` functions by own time (tottime), as text.
* ``rss``: peak anonymous RSS (``RssAnon``) of this process and of each DataLoader worker while reading
  ``--batches`` shuffled batches.
* ``first-batch --step S``: seconds from ``load_state_dict`` of a state ``S`` batches in to the first
  batch in hand (a fresh process, so it includes worker start-up).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from _procfs import children, rss_anon_mb, time_batches

import streampack
from streampack.loader import Loader

BATCH = 32
BASELINES = ("rowtake", "rowtake-cache", "gather", "nanogpt")


def flat_tokens(cache: streampack.Cache) -> np.ndarray:
    """The first shard's token file as a flat ``np.memmap``: nanoGPT's ``train.bin`` layout exactly."""
    return np.memmap(cache.root / "shards" / "000000.tokens", dtype=cache.dtype, mode="r")


class Baseline:
    """An endless batch source in the style of a baseline; iterable in a DataLoader worker too.

    The numpy kinds yield numpy arrays, or tensors (``torch.from_numpy``, no copy) when ``tensors``.
    """

    def __init__(self, kind: str, path: str, seq_len: int, *, tensors: bool = False) -> None:
        self.kind, self.path, self.seq_len, self.tensors = kind, path, seq_len, tensors

    def __iter__(self) -> Iterator[Any]:
        if self.kind == "nanogpt":
            return self._nanogpt()
        batches = self._numpy()
        if not self.tensors:
            return batches
        import torch

        return map(torch.from_numpy, batches)

    def _numpy(self) -> Iterator[np.ndarray]:
        rng = np.random.default_rng(os.getpid())
        data = flat_tokens(streampack.open(self.path))
        width = self.seq_len + 1
        windows = (len(data) - 1) // self.seq_len
        if self.kind == "gather":
            columns = np.arange(width)
            while True:
                yield data[rng.integers(0, windows, BATCH)[:, None] * self.seq_len + columns]
        rows = np.lib.stride_tricks.sliding_window_view(data, width)  # row i: the window starting at i
        if self.kind == "rowtake-cache":
            while True:
                yield rows[rng.integers(0, windows, BATCH) * self.seq_len]
        while True:
            yield rows[rng.integers(0, windows, BATCH) * self.seq_len].astype(np.int64)

    def _nanogpt(self) -> Iterator[Any]:
        import torch

        cache = streampack.open(self.path)
        while True:
            # nanoGPT train.py get_batch, verbatim in substance (it re-opens the memmap every batch)
            data = np.memmap(cache.root / "shards" / "000000.tokens", dtype=np.uint16, mode="r")
            ix = torch.randint(len(data) - self.seq_len, (BATCH,))
            x = torch.stack([torch.from_numpy(data[i : i + self.seq_len].astype(np.int64)) for i in ix])
            y = torch.stack(
                [torch.from_numpy(data[i + 1 : i + 1 + self.seq_len].astype(np.int64)) for i in ix]
            )
            yield x, y


def batches(kind: str, path: str, seq_len: int, workers: int, seed: int = 0) -> Iterator[Any]:
    """An endless iterator of batches of the given kind."""
    if kind in BASELINES:
        source = Baseline(kind, path, seq_len, tensors=workers > 0)
        if not workers:
            return iter(source)
        import torch.utils.data as data

        class Iterable(data.IterableDataset):
            def __iter__(self) -> Iterator[Any]:
                return iter(source)

        return iter(
            data.DataLoader(Iterable(), batch_size=None, num_workers=workers, persistent_workers=True)
        )
    dtype = None if kind == "loader-uint16" else np.int64
    loader = Loader(
        streampack.open(path).sequences(seq_len, overlap=1), batch_size=BATCH, seed=seed, dtype=dtype
    )
    if not workers:
        return iter(loader)
    from streampack.torch import DataLoader

    shared_slots = kind != "loader-tensors"
    return iter(DataLoader(loader, num_workers=workers, persistent_workers=True, shared_slots=shared_slots))


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    it = batches(args.kind, args.cache, args.seq_len, args.workers)
    return time_batches(it, batch=BATCH, warmup=args.warmup, repeats=args.repeats, batches=args.batches)


def profile(args: argparse.Namespace) -> dict[str, Any]:
    """The top functions by own time over ``--batches`` batches (0 workers), after the warm-up."""
    it = batches(args.kind, args.cache, args.seq_len, 0)
    for _ in range(args.warmup):
        next(it)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(args.batches):
        next(it)
    profiler.disable()
    seconds = time.perf_counter() - start
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).strip_dirs().sort_stats("tottime").print_stats(args.top)
    table = text.getvalue()
    table = table[table.index("   ncalls") :].rstrip()  # the column header on; drop pstats' preamble
    return {"seconds": seconds, "batches": args.batches, "profile": table}


def rss(args: argparse.Namespace) -> dict[str, Any]:
    it = batches("loader", args.cache, args.seq_len, args.workers)
    main_peak, worker_peak = 0.0, 0.0
    for count in range(1, args.batches + 1):
        next(it)
        if count % 100 == 0 or count == args.batches:
            main_peak = max(main_peak, rss_anon_mb())
            worker_peak = max([worker_peak, *(rss_anon_mb(pid) for pid in children())])
    return {"main_mb": main_peak, "worker_mb": worker_peak, "batches": args.batches}


def first_batch(args: argparse.Namespace) -> dict[str, Any]:
    seqs = streampack.open(args.cache).sequences(args.seq_len, overlap=1)
    saved = Loader(seqs, batch_size=BATCH, seed=0)
    saved.advance(args.step)
    state = json.loads(json.dumps(saved.state_dict()))
    if args.workers:
        from streampack.torch import DataLoader  # imported before the clock starts, like torch itself
    start = time.perf_counter()
    loader = Loader(seqs, batch_size=BATCH, seed=0)
    loader.load_state_dict(state)
    if args.workers:
        next(iter(DataLoader(loader, num_workers=args.workers)))
    else:
        next(iter(loader))
    return {"seconds": time.perf_counter() - start, "position": state["position"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["throughput", "profile", "rss", "first-batch"])
    parser.add_argument("--cache", required=True)
    parser.add_argument("--kind", default="loader")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step", type=int, default=0)
    parser.add_argument("--top", type=int, default=15, help="functions listed by the profile mode")
    args = parser.parse_args()
    run = {"throughput": throughput, "profile": profile, "rss": rss, "first-batch": first_batch}[args.mode]
    print(json.dumps(run(args)))
    os._exit(0)  # skip tearing down persistent DataLoader workers: the measurement is done


if __name__ == "__main__":
    main()

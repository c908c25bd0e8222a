"""Worker of ``bench_loader.py``: one measurement per process, printed as one JSON line.

Modes:

* ``throughput --kind K``: samples/s of a batch source, best of ``--repeats`` runs of ``--batches``
  batches after a warm-up, and the peak ``RssAnon`` of this process and of its largest worker. Kinds:
  ``gather`` (the limit: one vectorised numpy gather of 32 random windows from a flat ``np.memmap``),
  ``nanogpt`` (nanoGPT's ``get_batch``: per-row slices, ``astype(int64)``, ``torch.stack`` of x and y),
  ``loader`` (streampack ``Loader``, int64 out), ``loader-uint16`` (cache dtype out), ``loader-tensors``
  (workers send one shared-memory tensor per batch instead of shared slots). With ``--workers N > 0``
  the baselines run in a plain ``torch.utils.data.DataLoader(batch_size=None)`` over an IterableDataset
  yielding their batches, and the loader through ``streampack.torch.DataLoader``.
* ``rss``: peak anonymous RSS (``RssAnon``) of this process and of each DataLoader worker while reading
  ``--batches`` shuffled batches.
* ``first-batch --step S``: seconds from ``load_state_dict`` of a state ``S`` batches in to the first
  batch in hand (a fresh process, so it includes worker start-up).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from _procfs import children, rss_anon_mb, time_batches

import streampack
from streampack.loader import Loader

BATCH = 32


def flat_tokens(cache: streampack.Cache) -> np.ndarray:
    """The first shard's token file as a flat ``np.memmap``: nanoGPT's ``train.bin`` layout exactly."""
    return np.memmap(cache.root / "shards" / "000000.tokens", dtype=cache.dtype, mode="r")


class Baseline:
    """An endless batch source in the style of a baseline; iterable in a DataLoader worker too."""

    def __init__(self, kind: str, path: str, seq_len: int) -> None:
        self.kind, self.path, self.seq_len = kind, path, seq_len

    def __iter__(self) -> Iterator[Any]:
        import torch

        cache = streampack.open(self.path)
        rng = np.random.default_rng(os.getpid())
        width = np.arange(self.seq_len + 1)
        data = flat_tokens(cache)
        windows = (len(data) - 1) // self.seq_len
        while True:
            if self.kind == "gather":
                starts = rng.integers(0, windows, BATCH) * self.seq_len
                yield torch.from_numpy(data[starts[:, None] + width])
            else:
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
    if kind in ("gather", "nanogpt"):
        source = Baseline(kind, path, seq_len)
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
    parser.add_argument("mode", choices=["throughput", "rss", "first-batch"])
    parser.add_argument("--cache", required=True)
    parser.add_argument("--kind", default="loader")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step", type=int, default=0)
    args = parser.parse_args()
    run = {"throughput": throughput, "rss": rss, "first-batch": first_batch}[args.mode]
    print(json.dumps(run(args)))
    os._exit(0)  # skip tearing down persistent DataLoader workers: the measurement is done


if __name__ == "__main__":
    main()

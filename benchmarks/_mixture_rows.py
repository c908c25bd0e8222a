"""Worker of ``bench_mixture.py``: one measurement per process, printed as one JSON line.

Every mode takes ``--caches DIR [DIR ...]`` (a source named after each directory) and ``--kind``:
``single`` (``Loader(cache.sequences(seq_len, overlap=1), batch_size=32)`` over the first cache, the
baseline) or ``mixture`` (``Loader(Mixture({name: sequences, ...}, weights=...), batch_size=32)``, the
weights from ``--weights 5,3,2``, equal when omitted). With ``--workers N > 0`` the loader runs in
``streampack.torch.DataLoader(num_workers=N)``.

Modes:

* ``throughput``: samples/s, best of ``--repeats`` runs of ``--batches`` batches after a warm-up, and the
  peak ``RssAnon`` of this process and of its largest worker.
* ``rss``: ``RssAnon`` of this process (and of each worker) once the loader is built, and its peak while
  reading ``--batches`` batches.
* ``first-batch --position P``: seconds from building the loader (the mixture too; the caches are
  opened before the clock starts) and ``load_state_dict`` of a real state
  whose ``position`` is set to ``P`` (its order, the schedule included, kept as saved) to the first batch
  in hand; a fresh process, so it includes worker start-up. Also whether that imported ``numpy.ma``.
* ``numpy-ma``: seconds to ``import numpy.ma`` in a fresh process that has imported numpy and streampack.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _procfs import children, rss_anon_mb, time_batches

import streampack
from streampack.loader import Loader
from streampack.order.mixture import Mixture

BATCH = 32


def open_sources(args: argparse.Namespace) -> dict[str, Any]:
    """``--caches`` as ``name -> cache.sequences(seq_len, overlap=1)``, named after their directories."""
    return {Path(path).name: streampack.open(path).sequences(args.seq_len, overlap=1) for path in args.caches}


def make_loader(args: argparse.Namespace, seqs: dict[str, Any]) -> Loader:
    """The loader of ``--kind`` over the sources, global batch 32, shuffled, int64 out."""
    if args.kind == "single":
        (only,) = seqs.values()
        return Loader(only, batch_size=BATCH)
    weights = [float(w) for w in args.weights.split(",")] if args.weights else [1.0] * len(seqs)
    mix = Mixture(seqs, weights=dict(zip(seqs, weights, strict=True)), seed=0)
    return Loader(mix, batch_size=BATCH)


def iterate(loader: Loader, workers: int) -> Iterator[Any]:
    """Batches of ``loader``, in this process or through ``streampack.torch.DataLoader``."""
    if not workers:
        return iter(loader)
    from streampack.torch import DataLoader

    return iter(DataLoader(loader, num_workers=workers, persistent_workers=True))


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    it = iterate(make_loader(args, open_sources(args)), args.workers)
    return time_batches(it, batch=BATCH, warmup=args.warmup, repeats=args.repeats, batches=args.batches)


def rss(args: argparse.Namespace) -> dict[str, Any]:
    loader = make_loader(args, open_sources(args))
    start_mb = rss_anon_mb()
    it = iterate(loader, args.workers)
    main_peak, worker_peak = start_mb, 0.0
    for count in range(1, args.batches + 1):
        next(it)
        if count % 100 == 0 or count == args.batches:
            main_peak = max(main_peak, rss_anon_mb())
            worker_peak = max([worker_peak, *(rss_anon_mb(pid) for pid in children())])
    return {"start_mb": start_mb, "main_mb": main_peak, "worker_mb": worker_peak, "batches": args.batches}


def first_batch(args: argparse.Namespace) -> dict[str, Any]:
    seqs = open_sources(args)  # opened before the clock starts, as bench_loader's first-batch row does
    state = json.loads(json.dumps(make_loader(args, seqs).state_dict()))  # a real state, as saved to disk
    state["position"] = args.position
    if args.workers:
        from streampack.torch import DataLoader  # imported before the clock starts, like torch itself
    had_ma = "numpy.ma" in sys.modules
    start = time.perf_counter()
    loader = make_loader(args, seqs)
    loader.load_state_dict(state)
    if args.workers:
        next(iter(DataLoader(loader, num_workers=args.workers)))
    else:
        next(iter(loader))
    seconds = time.perf_counter() - start
    # numpy imports numpy.ma lazily, on the first np.unique call: a one-off cost, worth naming apart.
    imported_ma = "numpy.ma" in sys.modules and not had_ma
    return {"seconds": seconds, "position": args.position, "imported_numpy_ma": imported_ma}


def numpy_ma(args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    import numpy.ma  # noqa: F401

    return {"seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["throughput", "rss", "first-batch", "numpy-ma"])
    parser.add_argument("--caches", nargs="+", required=True)
    parser.add_argument("--kind", choices=["single", "mixture"], default="mixture")
    parser.add_argument("--weights", help="comma-separated, one per cache (default: equal)")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batches", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--position", type=int, default=0)
    args = parser.parse_args()
    run = {"throughput": throughput, "rss": rss, "first-batch": first_batch, "numpy-ma": numpy_ma}[args.mode]
    print(json.dumps(run(args)))
    os._exit(0)  # skip tearing down persistent DataLoader workers: the measurement is done


if __name__ == "__main__":
    main()

"""Iterate a loader over a cache, for timing from outside (``farm-bench``), e.g. with and without glibc's
allocator options::

    python benchmarks/_dict_batches.py CACHE packed        # 3,000 packed dict batches, seq_len 2048, batch 32
    python benchmarks/_dict_batches.py CACHE windows       # 3,000 numpy windows of 2048 + 1

CACHE is any cache (e.g. one built from ``../shared/data/corpus/natural-sample.jsonl.zst`` with GPT-2).
"""

from __future__ import annotations

import argparse

import streampack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache")
    parser.add_argument("kind", choices=["packed", "windows"])
    parser.add_argument("--batches", type=int, default=3000)
    args = parser.parse_args()
    cache = streampack.open(args.cache)
    if args.kind == "windows":
        loader = streampack.Loader(cache.sequences(2048, overlap=1), batch_size=32, seed=0)
    else:
        loader = streampack.Loader(cache.packed(2048), batch_size=32, seed=0, output="dict")
    batches = iter(loader)
    for _ in range(args.batches):
        next(batches)


if __name__ == "__main__":
    main()

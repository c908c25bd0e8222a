"""Worker (peers' venv): the same packed samples through Hugging Face datasets, MosaicML streaming, litdata.

Reads the streampack cache's first shard with numpy alone (its token file is a flat little-endian array),
so it needs no streampack. Samples are the Loader's: windows of 2049 tokens starting every 2048.

* ``prepare --kind K --cache DIR --out DIR``: write the samples in the peer's own format (HF
  ``save_to_disk`` of a ``input_ids`` column; mosaic ``MDSWriter`` with an ``ndarray:uint16`` column;
  litdata ``optimize`` of the token stream with ``TokensLoader``, read back in blocks of 2049 tokens with
  stride 2049, the closest it offers).
* ``throughput --kind K --data DIR --workers N``: samples/s of a shuffled loader of global batch 32, best of
  ``--repeats`` runs of ``--batches`` batches after a warm-up, and the peak ``RssAnon`` of this process
  and of its largest worker. One JSON line.

HF: ``load_from_disk(...).with_format("torch")`` in a ``torch.utils.data.DataLoader(batch_size=32,
shuffle=True)``; mosaic: ``StreamingDataset(local=..., shuffle=True, batch_size=32)`` in a DataLoader;
litdata: ``StreamingDataset(..., item_loader=TokensLoader(2049), shuffle=True)`` in its
``StreamingDataLoader``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.machinery
import json
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from _procfs import time_batches

SEQ_LEN = 2048
WIDTH = SEQ_LEN + 1
BATCH = 32


def tokens(cache: str) -> np.ndarray:
    return np.memmap(Path(cache) / "shards" / "000000.tokens", dtype="<u2", mode="r")


def windows(cache: str) -> Iterator[np.ndarray]:
    data = tokens(cache)
    for i in range((len(data) - 1) // SEQ_LEN):
        yield np.asarray(data[i * SEQ_LEN : i * SEQ_LEN + WIDTH])


def stub_torchvision() -> None:
    """mosaic's streaming imports torchvision at import time; the CPU torch here has none."""
    for name in (
        "torchvision",
        "torchvision.datasets",
        "torchvision.transforms",
        "torchvision.transforms.functional",
    ):
        module = types.ModuleType(name)
        module.__path__ = []  # type: ignore[attr-defined]
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        sys.modules.setdefault(name, module)
    sys.modules["torchvision.datasets"].VisionDataset = object  # type: ignore[attr-defined]
    sys.modules["torchvision.transforms.functional"].to_tensor = None  # type: ignore[attr-defined]


def prepare(kind: str, cache: str, out: str) -> None:
    if kind == "hf":
        import pyarrow as pa
        from datasets import Dataset

        rows = np.stack(list(windows(cache)))
        column = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), WIDTH)
        Dataset(pa.table({"input_ids": column})).save_to_disk(out)
    elif kind == "mosaic":
        stub_torchvision()
        from streaming import MDSWriter

        with MDSWriter(out=out, columns={"input_ids": "ndarray:uint16"}, size_limit=1 << 26) as writer:
            for row in windows(cache):
                writer.write({"input_ids": row})
    else:
        from litdata import TokensLoader, optimize

        step = 64 * WIDTH  # one input per 64 samples' worth of tokens
        optimize(
            fn=functools.partial(token_chunk, cache, step),
            inputs=list(range(0, len(tokens(cache)) - step, step)),
            output_dir=out,
            chunk_size=WIDTH * 4096,
            item_loader=TokensLoader(),
            num_workers=1,
        )


def token_chunk(cache: str, step: int, start: int) -> Iterator[Any]:
    """litdata's input function: one run of ``step`` tokens of the stream, as a tensor."""
    import torch

    yield torch.from_numpy(np.asarray(tokens(cache)[start : start + step]).astype(np.int32))


def loader(kind: str, data: str, workers: int) -> Any:
    import torch.utils.data

    if kind == "hf":
        from datasets import load_from_disk

        dataset = load_from_disk(data).with_format("torch")
        return torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=workers)
    if kind == "mosaic":
        stub_torchvision()
        from streaming import StreamingDataset

        dataset = StreamingDataset(local=data, shuffle=True, batch_size=BATCH)
        return torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=workers)
    from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

    dataset = StreamingDataset(data, item_loader=TokensLoader(block_size=WIDTH), shuffle=True)
    return StreamingDataLoader(dataset, batch_size=BATCH, num_workers=workers)


def endless(batches: Any) -> Iterator[Any]:
    while True:
        yield from batches


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    it = endless(loader(args.kind, args.data, args.workers))
    return time_batches(it, batch=BATCH, warmup=args.warmup, repeats=args.repeats, batches=args.batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["prepare", "throughput"])
    parser.add_argument("--kind", choices=["hf", "mosaic", "litdata"], required=True)
    parser.add_argument("--cache", help="streampack cache to read (prepare)")
    parser.add_argument("--out", help="where to write the peer's format (prepare)")
    parser.add_argument("--data", help="the peer's prepared data (throughput)")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    if args.mode == "prepare":
        prepare(args.kind, args.cache, args.out)
        print(json.dumps({"prepared": args.out}))
    else:
        print(json.dumps(throughput(args)))
    sys.stdout.flush()
    os._exit(0)  # skip tearing down workers: the measurement is done


if __name__ == "__main__":
    main()

"""Worker (bench venv): nanoGPT's ``prepare.py`` approach, re-implemented from its description.

``load_dataset("json")``; a non-batched ``.map(num_proc=2)`` that tiktoken-encodes each document with
``encode_ordinary`` and appends the end-of-text token, keeping ``ids`` and ``len``; the total length
sizes one ``np.memmap`` uint16 ``.bin`` file, which is then filled shard by shard (``--shards``
contiguous shards, each concatenated with numpy). nanoGPT also splits off a small validation set;
that costs nothing extra and is left out, so all tokens land in one file.

Prints one JSON line: ``{"num_tokens"}``, the length of the ``.bin`` file in tokens.
Usage: ``python benchmarks/_peer_nanogpt.py --corpus FILE --out FILE.bin`` with HF_* cache variables set.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
from _backends import TIKTOKEN_GPT2, load_tiktoken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokenizer", default=TIKTOKEN_GPT2)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--shards", type=int, default=1024)
    args = parser.parse_args()

    from datasets import load_dataset

    enc = load_tiktoken(args.tokenizer)

    def encode(example: dict[str, Any]) -> dict[str, Any]:
        ids = enc.encode_ordinary(example["text"])
        ids.append(enc.eot_token)
        return {"ids": ids, "len": len(ids)}

    raw = load_dataset("json", data_files=args.corpus, split="train")
    tokenized = raw.map(encode, num_proc=args.num_proc, remove_columns=raw.column_names)
    total = int(np.sum(tokenized.with_format("numpy")["len"], dtype=np.uint64))
    out = np.memmap(args.out, dtype=np.uint16, mode="w+", shape=(total,))
    shards = min(args.shards, len(tokenized))
    pos = 0
    for index in range(shards):
        shard = tokenized.shard(num_shards=shards, index=index, contiguous=True).with_format("numpy")
        ids = np.concatenate(shard["ids"])
        out[pos : pos + len(ids)] = ids
        pos += len(ids)
    out.flush()
    print(json.dumps({"num_tokens": pos}))


if __name__ == "__main__":
    main()

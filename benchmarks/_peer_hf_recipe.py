"""Worker (bench venv): the seed's recipe, Hugging Face ``datasets`` map + group + save_to_disk.

The usual ``run_clm``-style pipeline: ``load_dataset("json")``; ``.map(tokenize, batched=True,
num_proc=2)`` producing ``input_ids`` and ``attention_mask`` exactly as a fast tokenizer's
``__call__`` does (``Tokenizer.encode_batch``; for GPT-2 no special tokens are added); ``.map(group_texts,
batched=True, num_proc=2)`` concatenating each map batch and cutting it into blocks of ``--block-size``
(dropping the remainder of each batch) with ``labels`` a copy of ``input_ids``; ``save_to_disk``.

Prints one JSON line: ``{"num_tokens"}``, the tokens in the saved blocks (blocks x block size).
Usage: ``python benchmarks/_peer_hf_recipe.py --corpus FILE --out DIR`` with HF_* cache variables set.
"""

from __future__ import annotations

import argparse
import json
from itertools import chain
from typing import Any

from _backends import TOKENIZERS_GPT2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokenizer", default=TOKENIZERS_GPT2)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=1024)
    args = parser.parse_args()

    from datasets import load_dataset
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(args.tokenizer)
    block = args.block_size

    def tokenize(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        encodings = tokenizer.encode_batch(batch["text"])
        return {
            "input_ids": [e.ids for e in encodings],
            "attention_mask": [e.attention_mask for e in encodings],
        }

    def group_texts(batch: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        joined = {key: list(chain.from_iterable(rows)) for key, rows in batch.items()}
        usable = len(joined["input_ids"]) // block * block
        out = {key: [ids[i : i + block] for i in range(0, usable, block)] for key, ids in joined.items()}
        out["labels"] = list(out["input_ids"])
        return out

    raw = load_dataset("json", data_files=args.corpus, split="train")
    tokenized = raw.map(tokenize, batched=True, num_proc=args.num_proc, remove_columns=raw.column_names)
    grouped = tokenized.map(group_texts, batched=True, num_proc=args.num_proc)
    grouped.save_to_disk(args.out)
    print(json.dumps({"num_tokens": len(grouped) * block}))


if __name__ == "__main__":
    main()

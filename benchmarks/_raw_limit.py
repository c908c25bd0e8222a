"""Worker: the raw limit of one tokenizer backend over texts already in memory.

Loads every text of the corpus first, then times only the fastest batch-encode call of the backend
(``tokenizers``: ``encode_batch_fast``, default rayon threads; ``tiktoken``: ``encode_ordinary_batch``,
default thread pool), in batches of ``--batch`` documents. Counting tokens and freeing the results
happen outside the timed region. Prints one JSON line: ``{"num_tokens", "encode_s", "docs"}``.

Usage: ``python benchmarks/_raw_limit.py --backend tokenizers|tiktoken --corpus FILE``
"""

from __future__ import annotations

import argparse
import json
import time

from _backends import TIKTOKEN_GPT2, TOKENIZERS_GPT2, iter_texts, load_tiktoken


def time_tokenizers(texts: list[str], path: str, batch: int) -> tuple[float, int]:
    """Return (seconds spent in ``encode_batch_fast``, tokens produced)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    seconds, tokens = 0.0, 0
    for i in range(0, len(texts), batch):
        start = time.perf_counter()
        encodings = tok.encode_batch_fast(texts[i : i + batch], add_special_tokens=False)
        seconds += time.perf_counter() - start
        tokens += sum(len(e) for e in encodings)
        del encodings  # free here, not inside the next timed call
    return seconds, tokens


def time_tiktoken(texts: list[str], path: str, batch: int) -> tuple[float, int]:
    """Return (seconds spent in ``encode_ordinary_batch``, tokens produced)."""
    enc = load_tiktoken(path)
    seconds, tokens = 0.0, 0
    for i in range(0, len(texts), batch):
        start = time.perf_counter()
        ids = enc.encode_ordinary_batch(texts[i : i + batch])
        seconds += time.perf_counter() - start
        tokens += sum(len(x) for x in ids)
        del ids
    return seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["tokenizers", "tiktoken"], required=True)
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--tokenizer", help="tokenizer.json or .tiktoken file (default: GPT-2)")
    parser.add_argument("--batch", type=int, default=1000, help="documents per encode call")
    args = parser.parse_args()

    texts = list(iter_texts(args.corpus))
    if args.backend == "tokenizers":
        seconds, tokens = time_tokenizers(texts, args.tokenizer or TOKENIZERS_GPT2, args.batch)
    else:
        seconds, tokens = time_tiktoken(texts, args.tokenizer or TIKTOKEN_GPT2, args.batch)
    print(json.dumps({"num_tokens": tokens, "encode_s": seconds, "docs": len(texts)}))


if __name__ == "__main__":
    main()

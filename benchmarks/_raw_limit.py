"""Worker: the raw limit of one tokenizer backend over texts already in memory.

Loads every text of the corpus first, then times only the fastest batch-encode call of the backend
(``tokenizers``: ``encode_batch_fast``, default rayon threads, one per core; ``tiktoken``:
``encode_ordinary_batch`` with ``num_threads`` = cores; ``fastokens-json`` / ``fastokens-tiktoken``: the fast
engine on the same ``tokenizer.json`` / ranks, ``encode_batch_flat`` with special tokens as text, threads
from ``FASTOKENS_BPE_THREADS``, set to ``--threads`` unless already set), in batches of ``--batch`` documents.

Why not tiktoken's default ``num_threads=8``: its batch call holds the GIL while it turns each result into
a Python list, so on 2 cores 8 threads measured no faster than a serial loop (3.46 vs 3.46 M tokens/s on
the natural corpus) while one thread per core reached 4.6. The limit should be the fastest call.

Counting tokens and freeing the results happen outside the timed region. With ``--build-pieces``, the
texts are first cut as ``streampack build`` cuts them (:func:`streampack.tokenizer.pieces.piece_rule`),
for a
reference row: the raw call over the same pieces as the build.
Prints one JSON line: ``{"num_tokens", "encode_s", "docs"}``.

With ``--calls 2 --batch-chars 1048576 --threads 1`` the fast engine is called as a build calls it: two
calls at once, one thread each, on batches of ~1 MiB of text (on 2 cores its fastest way: 1.3-1.5x the
speed of one call of two threads on 1000 documents).

``gigatoken-json`` / ``gigatoken-tiktoken``: gigatoken's ``encode_batch`` on the same file, as a text-mode
build loads it, on all cores.

Usage: ``python benchmarks/_raw_limit.py --backend tokenizers|tiktoken|fastokens-json|fastokens-tiktoken|
gigatoken-json|gigatoken-tiktoken --corpus FILE``
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from _backends import TIKTOKEN_GPT2, TOKENIZERS_GPT2, iter_texts, load_tiktoken

BACKENDS = (
    "tokenizers",
    "tiktoken",
    "fastokens-json",
    "fastokens-tiktoken",
    "gigatoken-json",
    "gigatoken-tiktoken",
)


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


def time_tiktoken(texts: list[str], path: str, batch: int, threads: int) -> tuple[float, int]:
    """Return (seconds spent in ``encode_ordinary_batch``, tokens produced)."""
    enc = load_tiktoken(path)
    seconds, tokens = 0.0, 0
    for i in range(0, len(texts), batch):
        start = time.perf_counter()
        ids = enc.encode_ordinary_batch(texts[i : i + batch], num_threads=threads)
        seconds += time.perf_counter() - start
        tokens += sum(len(x) for x in ids)
        del ids
    return seconds, tokens


def time_fastokens(
    texts: list[str], path: str, batch: int, ranks: bool, calls: int = 1, batch_chars: int = 0
) -> tuple[float, int]:
    """Return (seconds spent in fastokens' ``encode_batch_flat``, tokens produced).

    ``calls`` > 1: that many calls at once, on threads of their own, each of ``FASTOKENS_BPE_THREADS``
    threads (as a build calls it), timed from the first call's start to the last one's end; ``batch_chars``:
    batches of about that many characters rather than of ``batch`` documents.

    ``ranks``: ``path`` is a ``.tiktoken`` file, with its ``pat_str`` and ``special_tokens`` in the ``.json``
    beside it, loaded as streampack loads it (GPT-2's pattern as the equivalent ``tokenizer.json``, cl100k's
    and o200k's by ``from_tiktoken`` with the caseless spelling of their pattern, which fastokens splits with
    hand-written code: see :mod:`streampack.tokenizer.fast_forms`; texts holding U+017F, which builds send to
    tiktoken, are encoded by fastokens here); else a ``tokenizer.json``.
    """
    import fastokens

    if ranks:  # as builds load it: streampack.tokenizer.fast_forms
        from tiktoken.load import load_tiktoken_bpe

        from streampack.tokenizer.fast_forms import load_fast_tiktoken

        meta = json.loads(Path(path).with_suffix(".json").read_text())
        table = load_tiktoken_bpe(path)
        tok = load_fast_tiktoken(fastokens, Path(path), table, meta["pat_str"], meta["special_tokens"])
    else:
        tok = fastokens.Tokenizer.from_file(path)
    batches = (
        _by_chars(texts, batch_chars)
        if batch_chars
        else [texts[i : i + batch] for i in range(0, len(texts), batch)]
    )

    def encode(texts: list[str]) -> int:
        ids, _offsets = tok.encode_batch_flat(texts, add_special_tokens=False, split_special_tokens=True)
        return len(ids) // 4  # uint32 ids

    if calls > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(calls) as pool:
            start = time.perf_counter()
            tokens = sum(pool.map(encode, batches))
            return time.perf_counter() - start, tokens
    seconds, tokens = 0.0, 0
    for texts_of_batch in batches:
        start = time.perf_counter()
        tokens += encode(texts_of_batch)
        seconds += time.perf_counter() - start
    return seconds, tokens


def time_gigatoken(texts: list[str], path: str, batch: int, ranks: bool) -> tuple[float, int]:
    """Return (seconds spent in gigatoken's ``encode_batch``, tokens produced), on all cores, loaded as a
    build loads it in text mode: a ``tokenizer.json`` without its added tokens, or ranks split by
    gigatoken's scheme for their pattern, with no special tokens."""
    import gigatoken

    from streampack.tokenizer.hf import gigatoken_form
    from streampack.tokenizer.proofs import GIGATOKEN_SCHEMES

    if ranks:
        pattern = json.loads(Path(path).with_suffix(".json").read_text())["pat_str"]
        tok = gigatoken.Tokenizer.from_tiktoken(
            path, pretokenizer=GIGATOKEN_SCHEMES[pattern], special_tokens={}
        )
    else:
        tok = gigatoken.Tokenizer.from_json(gigatoken_form(Path(path).read_text(), parse_special=False))
    seconds, tokens = 0.0, 0
    for i in range(0, len(texts), batch):
        start = time.perf_counter()
        ids = tok.encode_batch(texts[i : i + batch], parallel=True)
        seconds += time.perf_counter() - start
        tokens += len(ids.layout.content)
        del ids
    return seconds, tokens


def _by_chars(texts: list[str], size: int) -> list[list[str]]:
    """``texts`` in batches of about ``size`` characters (as a build's blocks)."""
    batches: list[list[str]] = [[]]
    chars = 0
    for text in texts:
        batches[-1].append(text)
        chars += len(text)
        if chars >= size:
            batches.append([])
            chars = 0
    return [b for b in batches if b]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=BACKENDS, required=True)
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--tokenizer", help="tokenizer.json or .tiktoken file (default: GPT-2)")
    parser.add_argument("--batch", type=int, default=1000, help="documents per encode call")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="tiktoken num_threads, fastokens threads"
    )
    parser.add_argument("--build-pieces", action="store_true", help="cut the texts as the build does")
    parser.add_argument("--calls", type=int, default=1, help="fastokens: calls at once, each on a thread")
    parser.add_argument("--batch-chars", type=int, default=0, help="fastokens: batches of N characters")
    args = parser.parse_args()
    if args.build_pieces and args.backend.startswith("fastokens"):
        parser.error("--build-pieces takes --backend tokenizers or tiktoken")

    tokenizers = args.backend in ("tokenizers", "fastokens-json", "gigatoken-json")
    path = args.tokenizer or (TOKENIZERS_GPT2 if tokenizers else TIKTOKEN_GPT2)
    texts = list(iter_texts(args.corpus))
    if args.build_pieces:
        from streampack.tokenizer.load import load_tokenizer
        from streampack.tokenizer.pieces import piece_rule

        # The pieces of the build with this reference engine (each engine cuts its own: fast_piece_chars).
        engine = "tokenizers" if tokenizers else "tiktoken"
        tokenizer = load_tokenizer(path if tokenizers else f"tiktoken:{path}", engine=engine)
        rule = piece_rule(tokenizer.cut_safety, tokenizer.fast_piece_chars)
        texts = [piece for text in texts for piece in rule.split(text)]
    if args.backend.startswith("fastokens"):
        os.environ.setdefault("FASTOKENS_BPE_THREADS", str(args.threads))  # read when its pool starts
        seconds, tokens = time_fastokens(
            texts, path, args.batch, ranks=not tokenizers, calls=args.calls, batch_chars=args.batch_chars
        )
    elif args.backend.startswith("gigatoken"):
        seconds, tokens = time_gigatoken(texts, path, args.batch, ranks=not tokenizers)
    elif tokenizers:
        seconds, tokens = time_tokenizers(texts, path, args.batch)
    else:
        seconds, tokens = time_tiktoken(texts, path, args.batch, args.threads)
    print(json.dumps({"num_tokens": tokens, "encode_s": seconds, "docs": len(texts)}))


if __name__ == "__main__":
    main()

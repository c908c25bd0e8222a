"""Load the GPT-2 tokenizers from local files, read a JSONL corpus or cut its head, for the benchmarks.

Imported by worker scripts running in either venv (the project's, or the peers' bench venv), so it
depends only on what both have: ``orjson``, ``tokenizers``, ``tiktoken``. No hub download anywhere.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

if TYPE_CHECKING:
    import tiktoken

# ../shared/data beside the project (or $STREAMPACK_SHARED_DATA): real tokenizers, never downloaded.
SHARED_DATA = Path(
    os.environ.get("STREAMPACK_SHARED_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data"
)
TOKENIZERS_GPT2 = str(SHARED_DATA / "tokenizers" / "gpt2" / "tokenizer.json")
TIKTOKEN_GPT2 = str(SHARED_DATA / "tokenizers" / "tiktoken" / "gpt2.tiktoken")


def load_tiktoken(ranks_path: str) -> tiktoken.Encoding:
    """Build a tiktoken encoding from a ``.tiktoken`` ranks file and the ``.json`` beside it.

    The JSON holds ``pat_str`` and ``special_tokens``; the encoding is named after the file stem.
    """
    import tiktoken
    import tiktoken.load

    meta = json.loads(Path(ranks_path).with_suffix(".json").read_text())
    return tiktoken.Encoding(
        Path(ranks_path).stem,
        pat_str=meta["pat_str"],
        mergeable_ranks=tiktoken.load.load_tiktoken_bpe(ranks_path),
        special_tokens=meta["special_tokens"],
    )


def iter_texts(corpus: str) -> Iterator[str]:
    """Yield the ``text`` field of every line of a JSONL corpus."""
    with open(corpus, "rb") as f:
        for line in f:
            if line.strip():
                yield orjson.loads(line)["text"]


def head_lines(src: str, dst: Path, max_bytes: int) -> str:
    """Copy whole lines of ``src`` to ``dst`` until ``max_bytes`` would be exceeded."""
    written = 0
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        for line in fin:
            if written + len(line) > max_bytes and written:
                break
            fout.write(line)
            written += len(line)
    return str(dst)

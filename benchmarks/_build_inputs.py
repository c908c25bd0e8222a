"""The same texts in every input format ``streampack build`` reads, written once per benchmark run.

``bench_build.py``'s format rows build each of these and divide by the build of the plain JSONL they come
from, so every file here holds exactly the JSONL's documents (or, for the SFT inputs, each document cut in
two at the space nearest its middle):

- ``parquet``: one ``text`` column, row groups of 1000 rows (~8 MB of this corpus's text each; ``datasets``
  aims at row groups of up to 100 MB, which a work unit reads whole);
- ``zst`` / ``gz``: the JSONL file itself compressed, one file (zstandard level 3, gzip level 6);
- ``text``: one ``.txt`` file per document (``streampack build DIR``'s default, a document per file: the
  texts hold newlines, so one document per line could not hold the same documents), 1000 to a folder;
- ``hf``: a Hugging Face dataset, ``Dataset.from_dict({"text": ...}).save_to_disk(DIR)``, which
  ``_build_python.py`` opens with ``load_from_disk`` and hands to ``streampack.build``;
- ``fields``: JSONL of ``{"prompt": first half, "response": second half}``, built with
  ``--fields prompt,response``;
- ``chat``: JSONL of ``{"messages": [user: first half, assistant: second half]}``, built with
  ``--chat messages`` and GPT-2 with ChatML's two special tokens added and its template beside it
  (``tokenizer_config.json``).
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
from _backends import iter_texts

FORMATS = ("parquet", "zst", "gz", "text", "hf", "fields", "chat")
ROW_GROUP_ROWS = 1000
FILES_PER_FOLDER = 1000
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
)
CHATML_TOKENS = ["<|im_start|>", "<|im_end|>"]


def halves(text: str) -> tuple[str, str]:
    """``text`` cut in two at the space nearest its middle (at the middle if it has none near it)."""
    middle = len(text) // 2
    left, right = text.rfind(" ", 0, middle + 1), text.find(" ", middle)
    candidates = [i for i in (left, right) if i > 0]
    cut = min(candidates, key=lambda i: abs(i - middle)) if candidates else middle
    return text[:cut], text[cut:]


def write_parquet(corpus: str, out: Path) -> Path:
    """The texts as a Parquet file with one ``text`` column, in row groups of :data:`ROW_GROUP_ROWS`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("text", pa.string())])
    with pq.ParquetWriter(out, schema) as writer:
        batch: list[str] = []
        for text in iter_texts(corpus):
            batch.append(text)
            if len(batch) == ROW_GROUP_ROWS:
                writer.write_table(pa.table({"text": batch}, schema=schema))
                batch = []
        if batch:
            writer.write_table(pa.table({"text": batch}, schema=schema))
    return out


def write_zst(corpus: str, out: Path) -> Path:
    """The JSONL file compressed with zstandard (level 3, its default)."""
    import zstandard

    with open(corpus, "rb") as fin, open(out, "wb") as fout:
        zstandard.ZstdCompressor(level=3).copy_stream(fin, fout)
    return out


def write_gz(corpus: str, out: Path) -> Path:
    """The JSONL file compressed with gzip (level 6, gzip's own default)."""
    with open(corpus, "rb") as fin, gzip.open(out, "wb", compresslevel=6) as fout:
        while chunk := fin.read(16 << 20):
            fout.write(chunk)
    return out


def write_text(corpus: str, out: Path) -> Path:
    """One UTF-8 ``.txt`` file per document, named in corpus order, :data:`FILES_PER_FOLDER` to a folder."""
    for i, text in enumerate(iter_texts(corpus)):
        folder = out / f"{i // FILES_PER_FOLDER:04d}"
        if i % FILES_PER_FOLDER == 0:
            folder.mkdir(parents=True)
        (folder / f"{i:07d}.txt").write_bytes(text.encode("utf-8"))
    return out


def write_hf(corpus: str, out: Path) -> Path:
    """The texts as a Hugging Face dataset saved with ``save_to_disk`` (``datasets`` imported here only)."""
    import datasets

    datasets.Dataset.from_dict({"text": list(iter_texts(corpus))}).save_to_disk(str(out))
    return out


def _write_jsonl(out: Path, records: Iterator[object]) -> Path:
    with open(out, "wb") as f:
        for record in records:
            f.write(orjson.dumps(record) + b"\n")
    return out


def write_fields(corpus: str, out: Path) -> Path:
    """JSONL of ``{"prompt", "response"}``: each text cut in two (:func:`halves`)."""
    pairs = (halves(text) for text in iter_texts(corpus))
    return _write_jsonl(out, ({"prompt": a, "response": b} for a, b in pairs))


def write_chat(corpus: str, out: Path) -> Path:
    """JSONL of ``{"messages": [user, assistant]}``: each text cut in two (:func:`halves`)."""
    pairs = (halves(text) for text in iter_texts(corpus))
    return _write_jsonl(
        out,
        (
            {"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": b}]}
            for a, b in pairs
        ),
    )


def chat_tokenizer(tokenizer_json: str, folder: Path) -> Path:
    """GPT-2 with ChatML's special tokens added, its ``tokenizer_config.json`` holding the template."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    tok.add_special_tokens(CHATML_TOKENS)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return folder / "tokenizer.json"


WRITERS: dict[str, tuple[str, Callable[[str, Path], Path]]] = {
    "parquet": ("corpus.parquet", write_parquet),
    "zst": ("corpus.jsonl.zst", write_zst),
    "gz": ("corpus.jsonl.gz", write_gz),
    "text": ("corpus-txt", write_text),
    "hf": ("corpus-hf", write_hf),
    "fields": ("corpus-fields.jsonl", write_fields),
    "chat": ("corpus-chat.jsonl", write_chat),
}


def convert(corpus: str, fmt: str, tmp: Path) -> Path:
    """Write ``corpus`` (JSONL, a ``text`` field per line) in format ``fmt`` under ``tmp``."""
    name, writer = WRITERS[fmt]
    return writer(corpus, tmp / name)


def size_mb(path: Path) -> float:
    """The size of a file, or of all files under a folder, in 10**6 bytes."""
    if path.is_file():
        return path.stat().st_size / 1e6
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


def files_under(path: Path) -> int:
    """How many files a path is (1) or holds."""
    return 1 if path.is_file() else sum(1 for _, _, files in os.walk(path) for _ in files)

"""OLMo-core's numpy token files (dolma's layout): headerless memmaps, label masks, and their sidecars.

What allenai/OLMo-core ``src/olmo_core/data/numpy_dataset.py`` (``NumpyDatasetConfig``: ``paths``,
``dtype``, ``label_mask_paths``) and ``src/olmo_core/data/utils.py`` read, as allenai/dolma
``python/dolma/tokenizer/memmap_writer.py`` writes it:

* ``token_ids_part_NNNNNN.npy``: the tokens, a headerless little-endian array (uint16 or uint32, the
  cache's dtype; despite the name, no ``.npy`` header), each document followed by the EOS id;
* ``labels_mask_part_NNNNNN.npy``: (an SFT cache) one bool byte a token, True where the token is a
  training target (``label_mask_paths``);
* ``token_ids_part_NNNNNN.csv.gz``: one line ``start,end,id`` a document (token offsets in the file, and
  its index in the cache): ``iter_document_indices`` reads the first two fields from this file for a
  remote array, and finds documents at the EOS ids (each one ends a document) in a local one;
* ``olmo.json``: what a ``NumpyDatasetConfig`` needs: ``paths``, ``label_mask_paths``, ``dtype``,
  ``eos_token_id``, ``bos_token_id``, ``vocab_size`` (written last: the export's index).

One file per non-empty shard. OLMo-core finds documents by their EOS, so a cache without one is refused.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

import numpy as np

from streampack.errors import OptionsError
from streampack.interop.writing import Destination, Progress, shard_docs, shard_mask, write_tokens

if TYPE_CHECKING:
    from streampack.reader import Cache

LAYOUT = "directory"
CONFIG = "olmo.json"


@dataclass(frozen=True)
class Options:
    """The OLMo export has no options: the layout follows the cache."""


def token_file(index: int) -> str:
    """The token file of the ``index``-th non-empty shard."""
    return f"token_ids_part_{index:06d}.npy"


def mask_file(index: int) -> str:
    """The label mask file of the ``index``-th non-empty shard."""
    return f"labels_mask_part_{index:06d}.npy"


def check(cache: Cache, options: Options) -> None:
    """Refuse a cache without an EOS: OLMo-core finds documents at the EOS ids."""
    if cache.eos_id is None:
        raise OptionsError(
            f"{cache.root}: the cache appends no EOS, and OLMo-core finds documents at the EOS ids: the "
            "document boundaries would be lost. Rebuild with an EOS, or export to megatron, datatrove or hf"
        )


def write(
    cache: Cache, dest: Destination, options: Options, progress: bool
) -> tuple[int, int, Sequence[str]]:
    """Write the token files (and masks and sidecars) per non-empty shard, then ``olmo.json``."""
    little = cache.dtype.newbyteorder("<")
    paths: list[str] = []
    masks: list[str] = []
    with Progress(progress, cache.num_tokens, "olmo") as bar:
        for docs in shard_docs(cache):
            if not len(docs.ends) or not docs.ends[-1]:
                continue
            index = len(paths)
            name = token_file(index)
            with dest.open(name) as out:
                bar.update(write_tokens(out, cache, docs.shard, little))
            if cache.has_loss_mask:
                with dest.open(mask_file(index)) as out:
                    out.write((shard_mask(cache, docs.shard) != 0).astype(np.uint8).tobytes())
                masks.append(mask_file(index))
            with dest.open(name.removesuffix(".npy") + ".csv.gz") as out:
                _write_sidecar(out, docs.ends, docs.first_doc)
            paths.append(name)
    config = {
        "paths": paths,
        "label_mask_paths": masks or None,
        "dtype": cache.dtype.name,
        "eos_token_id": cache.eos_id,
        "bos_token_id": cache.bos_id,
        "vocab_size": cache.vocab_size,
        "num_docs": cache.num_docs,
        "num_tokens": cache.num_tokens,
    }
    with dest.open(CONFIG) as out:
        out.write(json.dumps(config, indent=2).encode())
    return cache.num_docs, cache.num_tokens, [CONFIG]


def _write_sidecar(out: IO[bytes], ends: np.ndarray, first_doc: int) -> None:
    """dolma's ``start,end,id`` lines, gzipped, 65,536 documents at a time.

    gzip's fastest level (1): the default (9) took ten times as long for a file a fifth smaller (measured on
    200,000 rows), more than writing the shard's tokens, for a file only a remote array's reader opens."""
    starts = np.concatenate([[0], ends[:-1]])
    ids = np.arange(first_doc, first_doc + len(ends), dtype=np.int64)
    step = 1 << 16
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, compresslevel=1) as z:
        for first in range(0, len(ends), step):
            z.write(csv_rows([c[first : first + step] for c in (starts, ends, ids)]))


#: 10, 100, ..., 10**18: a non-negative int64 has 1 + (how many of these it reaches) digits.
_POWERS = 10 ** np.arange(1, 19, dtype=np.int64)


def csv_rows(columns: Sequence[np.ndarray]) -> bytes:
    """Rows of non-negative integers as decimal text, ``a,b,c\n`` a row, without a Python loop per row:
    each row is laid out in a table of fixed-width fields (right-aligned digits, unused bytes 0), whose
    non-zero bytes, in order, are the text."""
    rows = len(columns[0])
    if not rows:
        return b""
    digits = [1 + np.searchsorted(_POWERS, c, side="right") for c in columns]
    widths = [int(d.max()) for d in digits]
    table = np.zeros((rows, sum(widths) + len(columns)), dtype=np.uint8)
    at = 0
    for column, count, width in zip(columns, digits, widths):
        left = np.asarray(column, dtype=np.int64).copy()
        for k in range(width):  # the k-th digit from the right, where the number has one
            table[:, at + width - 1 - k] = np.where(count > k, left % 10 + ord("0"), 0)
            left //= 10
        at += width
        table[:, at] = ord(",")
        at += 1
    table[:, -1] = ord("\n")
    return table[table != 0].tobytes()

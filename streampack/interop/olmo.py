"""OLMo-core's numpy token files (dolma's layout) written from a cache, one token file (and label mask,
and ``.csv.gz`` sidecar) per non-empty shard, then ``olmo.json`` (the layout:
:mod:`streampack.reader.foreign.olmo`).

OLMo-core ends a document at each EOS id, so a cache without an EOS is refused, and so is one whose BOS is
its EOS or whose documents hold the EOS id inside them.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from streampack.errors import OptionsError
from streampack.interop.destination import Destination
from streampack.interop.writing import (
    inner_token,
    may_hold_specials,
    progress_bar,
    require_eos,
    shard_docs,
    shard_mask,
    write_tokens,
)
from streampack.reader.foreign.olmo import CONFIG

if TYPE_CHECKING:
    from streampack.reader import Cache

LAYOUT = "directory"


@dataclass(frozen=True)
class Options:
    """The OLMo export has no options: the layout follows the cache."""


def check(cache: Cache, options: Options) -> None:
    """Refuse a cache whose documents are not delimited by its EOS ids alone: OLMo-core finds them there."""
    keeps = "megatron, datatrove or hf, which keep boundaries in an index"
    eos = require_eos(cache, "OLMo-core ends a document at each EOS id", keeps)
    if may_hold_specials(cache) and (found := inner_token(cache, eos)) is not None:
        doc, position = found
        raise OptionsError(
            f"{cache.root}: document {doc} holds the EOS id {eos} at its token {position}, not only at its "
            "end (a chat template's end of turn, or special tokens parsed in the text), and OLMo-core ends a "
            f"document at each EOS id: it would be read cut there. Export to {keeps}"
        )


def write(
    cache: Cache, dest: Destination, options: Options, progress: bool
) -> tuple[int, int, Sequence[str]]:
    """Write the token files (and masks and sidecars) per non-empty shard, then ``olmo.json``."""
    little = cache.dtype.newbyteorder("<")
    paths: list[str] = []
    masks: list[str] = []
    # The sidecars (text, gzipped) are written on a thread while the kernel copies the next shard's tokens.
    with progress_bar(progress, cache.num_tokens, "olmo") as bar, ThreadPoolExecutor(1) as sidecars:
        written: list[Future[None]] = []
        for docs in shard_docs(cache, nonempty=True):
            name = f"token_ids_part_{len(paths):06d}.npy"
            with dest.open(name) as out:
                bar.update(write_tokens(out, cache, docs.shard, little))
            if cache.has_loss_mask:
                masks.append(f"labels_mask_part_{len(paths):06d}.npy")
                with dest.open(masks[-1]) as out:
                    out.write((shard_mask(cache, docs.shard) != 0).astype(np.uint8).tobytes())
            sidecar = name.removesuffix(".npy") + ".csv.gz"
            written.append(sidecars.submit(_write_sidecar, dest, sidecar, docs.ends, docs.first_doc))
            paths.append(name)
        for done in written:
            done.result()  # raises what a sidecar's writing raised
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


def _write_sidecar(dest: Destination, name: str, ends: np.ndarray, first_doc: int) -> None:
    """dolma's ``start,end,id`` lines in ``name``, gzipped, 65,536 documents at a time.

    gzip's fastest level (1): the default (9) took ten times as long for a file a fifth smaller (measured on
    200,000 rows), more than writing the shard's tokens, for a file only a remote array's reader opens."""
    starts = np.concatenate([[0], ends[:-1]])
    ids = np.arange(first_doc, first_doc + len(ends), dtype=np.int64)
    step = 1 << 16
    with dest.open(name) as out, gzip.GzipFile(fileobj=out, mode="wb", mtime=0, compresslevel=1) as z:
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

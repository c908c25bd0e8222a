"""Megatron's indexed dataset written from a cache: ``PREFIX.bin`` and ``PREFIX.idx`` (the layout:
:mod:`streampack.reader.foreign.megatron`).

One streampack document (with its BOS and EOS) is one Megatron sequence and one document:
``document_indices = [0, 1, ..., N]``, as ``tools/preprocess_data.py`` writes a corpus without sentence
splitting, in the dtype ``DType.optimal_dtype(vocab_size)`` picks (uint16 below 65,500 ids, else int32);
``dtype="cache"`` keeps the cache's own (a uint32 cache as int32: Megatron has no uint32).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Literal

import numpy as np

from streampack.errors import OptionsError
from streampack.interop.destination import Destination
from streampack.interop.writing import check_ids_fit, progress_bar, refuse_loss_mask, shard_docs, write_tokens
from streampack.reader.foreign.megatron import DTYPE_CODES, MAGIC, VERSION
from streampack.reader.foreign.megatron import SUFFIXES as SUFFIXES  # the pair's, that the Destination stages

if TYPE_CHECKING:
    from streampack.reader import Cache

LAYOUT = "prefix"
#: ``DType.optimal_dtype``: uint16 for a cardinality below this, else int32.
OPTIMAL_UINT16_BELOW = 65500

Dtype = Literal["optimal", "cache", "uint16", "int32"]


@dataclass(frozen=True)
class Options:
    """Options of the Megatron export.

    Attributes:
        dtype: ``"optimal"`` (Megatron's choice for the vocabulary, the default), ``"cache"`` (the cache's,
            a uint32 cache as int32: Megatron has no uint32), or ``"uint16"`` / ``"int32"``.
        drop_loss_mask: export an SFT cache's tokens without its loss mask (refused otherwise).
    """

    dtype: Dtype = "optimal"
    drop_loss_mask: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in ("optimal", "cache", "uint16", "int32"):
            raise OptionsError(f"megatron dtype must be optimal, cache, uint16 or int32 (got {self.dtype!r})")


def token_dtype(cache: Cache, options: Options) -> np.dtype:
    """The ``.bin`` dtype for ``cache``."""
    if options.dtype == "optimal":
        name = "uint16" if cache.vocab_size < OPTIMAL_UINT16_BELOW else "int32"
    elif options.dtype == "cache":
        name = "uint16" if cache.dtype.itemsize == 2 else "int32"
    else:
        name = options.dtype
    return np.dtype(name).newbyteorder("<")


def check(cache: Cache, options: Options) -> None:
    """Refuse a loss mask, and ids the chosen dtype cannot hold."""
    refuse_loss_mask(cache, "megatron", options.drop_loss_mask)
    dtype = token_dtype(cache, options)
    if dtype.itemsize < 4:
        keeps = 'Use dtype="optimal" or "int32".'
    else:  # Megatron has no wider dtype; another format's files have their dtype's vocabulary unless told
        keeps = (
            "Megatron has no wider token dtype. If the ids are of a smaller vocabulary (files that do not "
            "record theirs have their dtype's), open the cache with vocab_size= (--vocab-size) the "
            "tokenizer's, then export it."
        )
    check_ids_fit(cache, dtype, "megatron", keeps)


def write(
    cache: Cache, dest: Destination, options: Options, progress: bool
) -> tuple[int, int, Sequence[str]]:
    """Write ``.bin`` then ``.idx`` (committed last)."""
    dtype = token_dtype(cache, options)
    with progress_bar(progress, cache.num_tokens, "megatron") as bar, dest.open(".bin") as out:
        for shard in range(cache.num_shards):
            bar.update(write_tokens(out, cache, shard, dtype))
    with dest.open(".idx") as out:
        write_index(out, cache, dtype)
    return cache.num_docs, cache.num_tokens, [".idx"]


def write_index(out: IO[bytes], cache: Cache, dtype: np.dtype) -> None:
    """The ``.idx`` of one sequence per document, a shard's table in memory at a time."""
    write = out.write
    count = cache.num_docs
    write(MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", DTYPE_CODES[dtype.name]))
    write(struct.pack("<Q", count) + struct.pack("<Q", count + 1))
    for docs in shard_docs(cache):
        lengths = np.diff(docs.ends, prepend=0)
        if len(lengths) and int(lengths.max()) > np.iinfo(np.int32).max:
            raise OptionsError(
                f"{cache.root}: a document of {int(lengths.max()):,} tokens is longer than Megatron's int32 "
                "sequence lengths hold"
            )
        write(lengths.astype("<i4").tobytes())
    pointer = 0
    for docs in shard_docs(cache):
        starts = np.concatenate([[0], docs.ends[:-1]]) if len(docs.ends) else docs.ends
        write(((starts + pointer) * dtype.itemsize).astype("<i8").tobytes())
        pointer += int(docs.ends[-1]) if len(docs.ends) else 0
    step = 1 << 20
    for first in range(0, count + 1, step):
        write(np.arange(first, min(first + step, count + 1), dtype="<i8").tobytes())

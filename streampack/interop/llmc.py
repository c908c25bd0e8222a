"""llm.c and modded-nanogpt token shards written from a cache: ``DEST/train_NNNNNN.bin`` (the layout:
:mod:`streampack.reader.foreign.llmc`).

Those readers expect a delimiter *before* every document (llm.c's ``fineweb.py`` writes ``[eot] +
tokens``, 50256 for GPT-2, ``<|begin_of_text|>`` for Llama 3). The export writes ``[delimiter] + tokens``:
the delimiter is the cache's BOS where it prepends one (and an appended EOS is dropped), else its EOS
(``tokens, EOS`` become ``EOS, tokens``: the stream shifted by one), recorded in the header. A cache with
neither is refused. The stream fills shards of ``shard_tokens`` tokens (llm.c's 10**8) one after the
other, so a document may continue into the next shard.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from streampack.errors import OptionsError
from streampack.interop.destination import Destination
from streampack.interop.writing import (
    check_int_option,
    progress_bar,
    refuse_loss_mask,
    shard_docs,
    token_chunks,
    write_stream,
)
from streampack.reader.foreign.llmc import DELIMITER_SLOT, DELIMITER_TAG, HEADER_INTS, HEADERS

if TYPE_CHECKING:
    from streampack.reader import Cache

LAYOUT = "directory"
MAX_SHARD_TOKENS = 2**31 - 1
SHARD_TOKENS = 10**8


@dataclass(frozen=True)
class Options:
    """Options of the llm.c export.

    Attributes:
        shard_tokens: tokens a shard holds (the last holds the rest); at most 2**31 - 1.
        drop_loss_mask: export an SFT cache's tokens without its loss mask (refused otherwise).
    """

    shard_tokens: int = SHARD_TOKENS
    drop_loss_mask: bool = False

    def __post_init__(self) -> None:
        check_int_option("shard_tokens", self.shard_tokens, low=1, high=MAX_SHARD_TOKENS)


def header(num_tokens: int, itemsize: int, delimiter: int) -> bytes:
    """The 256 x int32 header of a shard of ``num_tokens`` tokens, each document behind ``delimiter``
    (recorded in the reserved ints :data:`DELIMITER_SLOT` and after: llm.c's readers read none of them)."""
    magic, version = HEADERS[itemsize]
    values = np.zeros(HEADER_INTS, dtype="<u4")
    values[:3] = (magic, version, num_tokens)
    values[DELIMITER_SLOT : DELIMITER_SLOT + 2] = (DELIMITER_TAG, delimiter)
    return values.tobytes()


def check(cache: Cache, options: Options) -> None:
    """Refuse a loss mask, a cache with no delimiter to put before its documents, and one without tokens:
    llm.c's reader takes neither a folder without shards nor a shard without tokens (``dataloader.h``:
    "no files found matching the pattern", ``assert(ntok > 0)``), so no files say "no documents"."""
    refuse_loss_mask(cache, "llmc", options.drop_loss_mask)
    if cache.bos_id is None and cache.eos_id is None:
        raise OptionsError(
            f"{cache.root}: the cache has no EOS or BOS id, and llm.c's readers find documents at the "
            "delimiter before each one: the document boundaries would be lost. Rebuild with an EOS, or "
            "export to megatron, datatrove or hf, which keep boundaries without a delimiter"
        )
    if not cache.num_tokens:
        raise OptionsError(
            f"{cache.root}: the cache holds no tokens ({cache.num_docs:,} documents), and llm.c's format "
            "cannot hold an empty dataset (its reader refuses a folder without shards and a shard without "
            "tokens). Build or choose a cache with documents, or export to datatrove (one empty .ds, which "
            "its reader takes as no samples) or streampack"
        )


def _without_eos(cache: Cache) -> Iterator[np.ndarray]:
    """The tokens of a cache with a BOS and an EOS, in chunks, without each document's EOS (the next
    document's BOS delimits it)."""
    for docs in shard_docs(cache):
        pos = 0
        for chunk in token_chunks(cache, docs.shard):
            stop = pos + len(chunk)
            ends = docs.ends[(docs.ends > pos) & (docs.ends <= stop)]
            keep = np.ones(len(chunk), dtype=bool)
            keep[ends - 1 - pos] = False
            yield chunk[keep]
            pos = stop


def write(
    cache: Cache, dest: Destination, options: Options, progress: bool
) -> tuple[int, int, Sequence[str]]:
    """Write the shards, each document behind the delimiter; each header counts its shard's tokens."""
    bos, eos = cache.bos_id, cache.eos_id
    delimiter = bos if bos is not None else eos
    assert delimiter is not None  # refused by check()
    dropped = cache.num_docs if bos is not None and eos is not None else 0  # each EOS, behind a BOS
    total, size = cache.num_tokens - dropped, options.shard_tokens
    counts = [min(size, total - start) for start in range(0, total, size)]
    little, itemsize = cache.dtype.newbyteorder("<"), cache.dtype.itemsize
    with progress_bar(progress, total, "llmc") as bar:
        if bos is None or eos is None:
            # The stream is the cache's tokens, shifted right by one behind an EOS where the EOS delimits
            # (``tokens, EOS`` become ``EOS, tokens``): each shard is a span of them, copied as it lies.
            shift = int(bos is None)
            for index, count in enumerate(counts):
                with dest.open(f"train_{index:06d}.bin") as out:
                    out.write(header(count, itemsize, delimiter))
                    first = index * size
                    if shift and first == 0:
                        out.write(np.array([eos], dtype=little).tobytes())
                        first = 1
                    write_stream(cache, first - shift, index * size + count - shift, out)
                    bar.update(count)
            return cache.num_docs, total, []
        chunks = _without_eos(cache)
        pending = np.zeros(0, dtype=cache.dtype)
        for index, count in enumerate(counts):
            with dest.open(f"train_{index:06d}.bin") as out:
                out.write(header(count, itemsize, delimiter))
                left = count
                while left:
                    if not len(pending):
                        pending = next(chunks)
                        continue
                    take = pending[:left]
                    out.write(np.ascontiguousarray(take, dtype=little).data)
                    bar.update(len(take))
                    left -= len(take)
                    pending = pending[len(take) :]
    return cache.num_docs, total, []

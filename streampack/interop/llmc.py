"""llm.c and modded-nanogpt token shards: ``DEST/train_NNNNNN.bin``, a 256 x int32 header, then tokens.

The layout, as karpathy/llm.c ``dev/data/data_common.py`` (``write_datafile``, ``HEADERS_INFO``) writes
it and ``llmc/dataloader.h`` / ``train_gpt2.py`` (``_load_data_shard``) and KellerJordan/modded-nanogpt
``train_gpt.py`` (``_load_data_shard``) read it: ``header[0]`` the magic, ``header[1]`` the version,
``header[2]`` the number of tokens (below 2**31); the rest of the 256 int32 zero; then the tokens,
little-endian. uint16 tokens: magic 20240520, version 1 (GPT-2); uint32 tokens: magic 20240801,
version 7 (Llama 3). modded-nanogpt reads only the first kind.

**Documents.** Those readers expect every document to be *preceded* by a delimiter: llm.c's
``fineweb.py`` writes ``[eot] + tokens`` (GPT-2's ``<|endoftext|>``, 50256), or ``<|begin_of_text|>`` for
Llama 3, and modded-nanogpt aligns its sequences to that id (``BOS_ID = 50256``). The export writes each
document as ``[delimiter] + its tokens``: the delimiter is the cache's BOS id where it prepends one (the
document is then written as it is, without an EOS the cache appended), else its EOS id (the cache's
``tokens, EOS`` become ``EOS, tokens``: the stream shifted by one). A cache with neither is refused. The
stream fills shards of ``shard_tokens`` tokens (llm.c's ``shard_size``, 10**8) one after the other; as in
llm.c, a document may continue into the next shard.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

import numpy as np

from streampack.errors import OptionsError
from streampack.interop.writing import (
    Destination,
    Progress,
    check_int_option,
    refuse_loss_mask,
    shard_docs,
    token_chunks,
    write_tokens,
)

if TYPE_CHECKING:
    from streampack.reader import Cache

LAYOUT = "directory"
HEADER_INTS = 256
#: (magic, version) by token width in bytes.
HEADERS = {2: (20240520, 1), 4: (20240801, 7)}
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


def shard_file(index: int) -> str:
    """The name of shard ``index``."""
    return f"train_{index:06d}.bin"


def header(num_tokens: int, itemsize: int) -> bytes:
    """The 256 x int32 header of a shard of ``num_tokens`` tokens."""
    magic, version = HEADERS[itemsize]
    values = np.zeros(HEADER_INTS, dtype="<i4")
    values[:3] = (magic, version, num_tokens)
    return values.tobytes()


def check(cache: Cache, options: Options) -> None:
    """Refuse a loss mask, and a cache with no delimiter to put before its documents."""
    refuse_loss_mask(cache, "llmc", options.drop_loss_mask)
    if cache.bos_id is None and cache.eos_id is None:
        raise OptionsError(
            f"{cache.root}: the cache has no EOS or BOS id, and llm.c's readers find documents at the "
            "delimiter before each one: the document boundaries would be lost. Rebuild with an EOS, or "
            "export to megatron, datatrove or hf, which keep boundaries without a delimiter"
        )


def stream(cache: Cache) -> Iterator[np.ndarray]:
    """The llm.c token stream of the cache, in chunks: each document preceded by the delimiter."""
    bos, eos = cache.bos_id, cache.eos_id
    if bos is None:
        assert eos is not None
        # tokens, EOS per document becomes EOS, tokens: the stream shifted right by one.
        yield np.array([eos], dtype=cache.dtype)
        held: np.ndarray | None = None
        for shard in range(cache.num_shards):
            for chunk in token_chunks(cache, shard):
                if held is not None:
                    yield held
                held = chunk
        if held is not None:
            yield held[:-1]  # the last document's EOS, now before it
        return
    for docs in shard_docs(cache):
        if eos is None:
            yield from token_chunks(cache, docs.shard)
            continue
        # BOS, tokens, EOS per document: drop each EOS (the next document's BOS delimits it).
        pos = 0
        for chunk in token_chunks(cache, docs.shard):
            stop = pos + len(chunk)
            ends = docs.ends[(docs.ends > pos) & (docs.ends <= stop)]
            keep = np.ones(len(chunk), dtype=bool)
            keep[ends - 1 - pos] = False
            yield chunk[keep]
            pos = stop


def stream_length(cache: Cache) -> int:
    """Tokens of :func:`stream`: the cache's, less one EOS a document where a BOS is the delimiter."""
    dropped = cache.num_docs if cache.bos_id is not None and cache.eos_id is not None else 0
    return cache.num_tokens - dropped


def write(
    cache: Cache, dest: Destination, options: Options, progress: bool
) -> tuple[int, int, Sequence[str]]:
    """Write the shards; each header counts its shard's tokens, known before it is written."""
    total, size = stream_length(cache), options.shard_tokens
    counts = [min(size, total - start) for start in range(0, total, size)]
    little = cache.dtype.newbyteorder("<")
    with Progress(progress, total, "llmc") as bar:
        if cache.bos_id is None or cache.eos_id is None:
            # The stream is the cache's tokens (shifted right by one behind an EOS where the EOS delimits):
            # each llm.c shard is a span of them, copied as the file holds them.
            shift = int(cache.bos_id is None)
            for index, count in enumerate(counts):
                with dest.open(shard_file(index)) as out:
                    out.write(header(count, cache.dtype.itemsize))
                    first = index * size
                    if shift and first == 0:
                        out.write(np.array([cache.eos_id], dtype=little).tobytes())
                        first = 1
                    _write_stream(out, cache, first - shift, index * size + count - shift, little)
                    bar.update(count)
            return cache.num_docs, total, []
        chunks = stream(cache)
        pending = np.zeros(0, dtype=cache.dtype)
        for index, count in enumerate(counts):
            with dest.open(shard_file(index)) as out:
                out.write(header(count, cache.dtype.itemsize))
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


def _write_stream(out: IO[bytes], cache: Cache, start: int, stop: int, dtype: np.dtype) -> None:
    """Tokens ``[start, stop)`` of the cache's whole stream, shard by shard."""
    starts = np.asarray(cache.token_starts, dtype=np.int64)
    shard = max(0, int(np.searchsorted(starts, start, side="right")) - 1)
    while shard < cache.num_shards and starts[shard] < stop:
        base = int(starts[shard])
        write_tokens(out, cache, shard, dtype, max(start - base, 0), min(stop, int(starts[shard + 1])) - base)
        shard += 1

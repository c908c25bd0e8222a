"""What every exporter shares besides its destination (:mod:`~streampack.interop.destination`): reading
a cache in bounded memory, the progress bar, and the refusals.

**Bounded memory, and copies in the kernel.** Where a format's token file holds a shard's bytes as they are
(the same width: datatrove's ``.ds``, OLMo's ``.npy``, nanoGPT's ``train.bin``, Megatron's ``.bin`` in
the cache's width), :func:`write_tokens` has the kernel copy them (:mod:`~streampack.interop.copying`),
so they never pass through this process. Elsewhere token files are read with plain reads of
:data:`CHUNK_TOKENS` tokens (not through memory maps, whose touched pages would count towards the
process's memory until unmapped); offset tables (8 bytes a document) and loss masks are read a shard at a
time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from streampack.errors import CacheError, OptionsError
from streampack.interop.copying import copy_range
from streampack.store.localcopy import CachedStore

if TYPE_CHECKING:
    from streampack.reader import Cache

#: Tokens read at once from a shard's token file (16 MiB of uint32, 8 MiB of uint16).
CHUNK_TOKENS = 1 << 22
# ----------------------------------------------------------------------------- reading the cache


@dataclass(frozen=True)
class ShardDocs:
    """One shard's document table: where each document ends (cumulative tokens, int64) and the global
    index of its first document."""

    shard: int
    ends: np.ndarray
    first_doc: int

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of each document (int64)."""
        return np.diff(self.ends, prepend=0)


def shard_docs(cache: Cache) -> Iterator[ShardDocs]:
    """Every shard's document table, in stream order (one table in memory at a time)."""
    for shard in range(cache.num_shards):
        ends = np.array(cache.shard_offsets(shard), dtype=np.int64)
        yield ShardDocs(shard, ends, int(cache.doc_starts[shard]))


def token_chunks(cache: Cache, shard: int, start: int = 0, stop: int | None = None) -> Iterator[np.ndarray]:
    """Tokens ``[start, stop)`` of shard ``shard`` (all of them by default), in new arrays of at most
    :data:`CHUNK_TOKENS` tokens, read from the file (a remote cache's shard is fetched first)."""
    count = int(cache.table.num_tokens[shard])
    stop = count if stop is None else stop
    if stop <= start:
        return
    tokens = cache.shard_tokens(shard)  # checks the file's size (and fetches a remote cache's copy)
    where = cache.files.token_file(shard)
    if where is None:  # not one span of a file (MDS samples): from the array its reader made
        for pos in range(start, stop, CHUNK_TOKENS):
            yield np.array(tokens[pos : min(pos + CHUNK_TOKENS, stop)])
        return
    del tokens
    path, base = where
    itemsize = cache.dtype.itemsize
    with open(path, "rb") as f:
        pos = start
        while pos < stop:
            n = min(CHUNK_TOKENS, stop - pos)
            f.seek(base + pos * itemsize)
            yield np.fromfile(f, dtype=cache.dtype, count=n)
            pos += n
    release_maps(cache)


def write_tokens(
    out: IO[bytes], cache: Cache, shard: int, dtype: np.dtype, start: int = 0, stop: int | None = None
) -> int:
    """Write tokens ``[start, stop)`` of shard ``shard`` (all of them by default) to ``out`` as ``dtype``
    (little-endian); returns how many. See :func:`write_spans`."""
    stop = int(cache.table.num_tokens[shard]) if stop is None else stop
    write_spans(cache, shard, dtype, [(out, start, stop)])
    return max(0, stop - start)


def write_spans(
    cache: Cache, shard: int, dtype: np.dtype, spans: Iterable[tuple[IO[bytes], int, int]]
) -> None:
    """Write each span ``(out, start, stop)`` of shard ``shard``'s tokens to its ``out``, in order, as
    ``dtype`` (little-endian), the shard file opened (and its size checked) once.

    Where ``dtype`` has the cache's width and ``out`` is a local file, the kernel copies the bytes from
    the shard file (a uint32 id below 2**31 has the bytes of the int32; see :func:`narrows` for those
    above); otherwise they are read in chunks of :data:`CHUNK_TOKENS` and written, cast where the width
    differs. A narrowing cast (uint32 to uint16) has each chunk's ids checked first (:func:`check_fits`):
    the exporters refuse a vocabulary that does not fit ``dtype``, but another format's files are only
    declared to keep to theirs.

    Raises:
        CacheError: a token file was cut short, or holds an id that ``dtype`` cannot (naming it).
    """
    itemsize = cache.dtype.itemsize
    same = dtype.itemsize == itemsize and _little(cache.dtype)
    narrowing = narrows(cache.dtype, dtype)
    opened: IO[bytes] | None = None
    where = cache.files.token_file(shard)
    if where is None:  # not one span of a file (MDS samples): from the array its reader made
        tokens = cache.shard_tokens(shard)
        for out, start, stop in spans:
            for pos in range(start, stop, CHUNK_TOKENS):
                chunk = tokens[pos : min(pos + CHUNK_TOKENS, stop)]
                if narrowing:
                    check_fits(cache, shard, chunk, pos, dtype)
                out.write(np.ascontiguousarray(chunk, dtype=dtype).data)
        return
    path, base = where
    try:
        for out, start, stop in spans:
            if stop <= start:
                continue
            if opened is None:
                cache.shard_tokens(shard)  # checks the file's size (and fetches a remote cache's copy)
                opened = open(path, "rb")  # noqa: SIM115 (closed below)
            if same:
                copied = copy_range(opened, base + start * itemsize, (stop - start) * itemsize, out)
                start += copied // itemsize
            while start < stop:
                n = min(CHUNK_TOKENS, stop - start)
                opened.seek(base + start * itemsize)
                chunk = np.fromfile(opened, dtype=cache.dtype, count=n)
                if len(chunk) < n:
                    raise CacheError(
                        f"{path}: ended at token {start + len(chunk):,}, not {stop:,}: the token file was "
                        "cut short while it was read; run `streampack verify`"
                    )
                if narrowing:
                    check_fits(cache, shard, chunk, start, dtype)
                out.write(np.ascontiguousarray(chunk, dtype=dtype).data)
                start += n
    finally:
        if opened is not None:
            opened.close()
            release_maps(cache)


def write_stream(cache: Cache, start: int, stop: int, out: IO[bytes]) -> None:
    """Tokens ``[start, stop)`` of the cache's stream to ``out`` (little-endian), shard by shard."""
    little, starts = cache.dtype.newbyteorder("<"), cache.token_starts
    shard = int(np.searchsorted(starts, start, side="right")) - 1
    while start < stop:
        base, end = int(starts[shard]), min(stop, int(starts[shard + 1]))
        write_spans(cache, shard, little, [(out, start - base, end - base)])
        start, shard = end, shard + 1


def narrows(source: np.dtype, dest: np.dtype) -> bool:
    """Whether writing ``source`` ids as ``dest`` can change one: ``dest`` is narrower.

    Between equal widths the bytes are written as they are (by the kernel, where it can): a uint32 id of
    2**31 or more, which no vocabulary has, becomes a negative int32, which no embedding takes, and reads
    back into streampack as the same uint32 id (a Megatron int32 file is read as uint32).
    """
    return dest.itemsize < source.itemsize


def check_fits(cache: Cache, shard: int, chunk: np.ndarray, start: int, dtype: np.dtype) -> None:
    """Refuse tokens ``chunk`` of shard ``shard`` (from its token ``start``) that hold an id ``dtype``
    cannot: the cast would wrap it to another id. A maximum (and a minimum, for signed tokens) over the
    chunk: about the speed of memory.

    Raises:
        CacheError: naming the id, its document and file, and what to do.
    """
    if not len(chunk):
        return
    info = np.iinfo(dtype)
    if chunk.max() <= info.max and (chunk.dtype.kind == "u" or chunk.min() >= info.min):
        return
    from streampack.loader.reading import token_place

    at = int(np.flatnonzero((chunk > info.max) | (chunk < info.min))[0])
    value = int(chunk[at])
    raise CacheError(
        f"{token_place(cache, shard, start + at)}: the id {value:,} does not fit the export's {dtype.name} "
        f"tokens (at most {info.max:,}): written, it would read as {int(np.array(value).astype(dtype)):,}. "
        f"The cache declares a vocabulary of {cache.vocab_size:,} ids, which its files do not keep to "
        "(`streampack verify` lists every such id). The export stopped and kept nothing: fix the files, or "
        'export with a dtype that holds the id (dtype="cache", --out-dtype cache: the cache\'s own)'
    )


def _little(dtype: np.dtype) -> bool:
    return dtype == dtype.newbyteorder("<")


def shard_mask(cache: Cache, shard: int) -> np.ndarray:
    """Shard ``shard``'s loss mask (uint8, one byte a token) as a new array read from the file."""
    mask = np.array(cache.shard_loss_mask(shard), dtype=np.uint8)
    release_maps(cache)
    return mask


def release_maps(cache: Cache) -> None:
    """Drop the maps the size checks made: an export reads every shard once."""
    if not isinstance(cache.store, CachedStore):
        cache.drop_maps()


def doc_chunks(cache: Cache, docs: ShardDocs, max_tokens: int = CHUNK_TOKENS) -> Iterator[tuple[int, int]]:
    """Runs ``[first, stop)`` of a shard's documents of about ``max_tokens`` tokens each (a longer document
    is a run of its own)."""
    ends = docs.ends
    first = 0
    while first < len(ends):
        base = int(ends[first - 1]) if first else 0
        stop = int(np.searchsorted(ends, base + max_tokens, side="right"))
        stop = max(stop, first + 1)
        yield first, stop
        first = stop


# ----------------------------------------------------------------------------- progress and refusals


class Progress:
    """A tqdm bar over the tokens an export writes, on stderr; silent when disabled."""

    def __init__(self, enabled: bool, total: int, what: str) -> None:
        self.bar: Any = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, unit="tok", unit_scale=True, desc=f"export {what}", dynamic_ncols=True
            )

    def update(self, tokens: int) -> None:
        """Count ``tokens`` more tokens written."""
        if self.bar is not None:
            self.bar.update(tokens)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def may_hold_specials(cache: Cache) -> bool:
    """Whether the cache's documents may hold special ids inside them: a build that parsed special tokens
    in its text or rendered conversations, or files a build did not write (their settings unknown). A
    build in the default text mode encodes a special token's text as text."""
    settings = cache.manifest.settings
    return settings.special_tokens != "text" or settings.chat is not None


def inner_token(cache: Cache, token: int) -> tuple[int, int] | None:
    """``(document, position in it)`` of the first ``token`` inside a document (anywhere but its last
    token), or None: read a chunk of a shard at a time."""
    for docs in shard_docs(cache):
        last = docs.ends - 1  # each document's last token
        pos = 0
        for chunk in token_chunks(cache, docs.shard):
            hits = np.flatnonzero(chunk == token) + pos
            inner = hits[~np.isin(hits, last)]
            if len(inner):
                doc = int(np.searchsorted(docs.ends, inner[0], side="right"))
                start = int(docs.ends[doc - 1]) if doc else 0
                return docs.first_doc + doc, int(inner[0]) - start
            pos += len(chunk)
    return None


def refuse_loss_mask(cache: Cache, format: str, drop: bool) -> None:
    """Refuse an SFT cache's loss mask into a format that cannot hold one, unless ``drop`` is set.

    Raises:
        OptionsError: naming the mask, the formats that keep it and how to drop it deliberately.
    """
    if cache.has_loss_mask and not drop:
        raise OptionsError(
            f"{cache.root}: this SFT cache has a loss mask (which tokens are training targets), and the "
            f"{format} format cannot hold one: the export would lose it. Export to datatrove (.ds.loss), "
            "olmo (label mask files) or hf (labels) to keep it, or pass drop_loss_mask=True "
            "(--drop-loss-mask) to export the tokens alone"
        )


def check_ids_fit(cache: Cache, dtype: np.dtype, format: str, keeps: str) -> None:
    """Refuse a vocabulary whose ids a format's token dtype cannot hold.

    Raises:
        OptionsError: naming the vocabulary, the dtype and a format (or option) that holds the ids.
    """
    top = np.iinfo(dtype).max
    if cache.vocab_size - 1 > top:
        raise OptionsError(
            f"{cache.root}: a vocabulary of {cache.vocab_size:,} ids does not fit the {format} format's "
            f"{dtype.name} tokens (at most {top:,}): ids would wrap. {keeps}"
        )


def check_int_option(name: str, value: object, *, low: int, high: int | None = None) -> int:
    """An integer option in ``[low, high]``.

    Raises:
        OptionsError: it is not an integer in range.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise OptionsError(f"{name} must be an integer (got {value!r})")
    if value < low or (high is not None and value > high):
        allowed = f"between {low:,} and {high:,}" if high is not None else f"at least {low:,}"
        raise OptionsError(f"{name} must be {allowed} (got {value:,})")
    return int(value)

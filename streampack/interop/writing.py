"""What every exporter shares besides its destination: reading a cache in bounded memory, the progress
bar, and the refusals.

Token files are copied by the kernel where the widths match, else read in plain reads of
:data:`CHUNK_TOKENS` tokens (a memory map's pages would count towards the process's memory until
unmapped); offset tables and loss masks a shard at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from streampack.errors import CacheError, OptionsError
from streampack.interop.copying import copy_range
from streampack.store.localcopy import CachedStore

if TYPE_CHECKING:
    from streampack.reader import Cache

#: A tqdm progress bar (tqdm is untyped).
Progress = Any

#: Tokens read at once from a shard's token file (16 MiB of uint32, 8 MiB of uint16).
CHUNK_TOKENS = 1 << 22


@dataclass(frozen=True)
class ShardDocs:
    """One shard's document ends (cumulative, int64) and the global index of its first document."""

    shard: int
    ends: np.ndarray
    first_doc: int


def shard_docs(cache: Cache, *, nonempty: bool = False) -> Iterator[ShardDocs]:
    """Every shard's document table (with ``nonempty``, of those that hold tokens), in stream order, one
    table in memory at a time."""
    for shard in range(cache.num_shards):
        ends = np.array(cache.shard_offsets(shard), dtype=np.int64)
        if not nonempty or (len(ends) and ends[-1]):
            yield ShardDocs(shard, ends, int(cache.doc_starts[shard]))


def token_chunks(cache: Cache, shard: int, start: int = 0, stop: int | None = None) -> Iterator[np.ndarray]:
    """Tokens ``[start, stop)`` of a shard (all by default), in new arrays of at most :data:`CHUNK_TOKENS`."""
    stop = int(cache.table.num_tokens[shard]) if stop is None else stop
    if stop <= start:
        return
    tokens = cache.shard_tokens(shard)  # checks the file's size (and fetches a remote cache's copy)
    where = cache.files.token_file(shard)
    if where is None:  # not one span of a file (MDS samples): from the array its reader made
        yield from (np.array(chunk) for _, chunk in _array_chunks(tokens, start, stop))
        return
    del tokens
    with open(where[0], "rb") as f:
        yield from (chunk for _, chunk in _file_chunks(f, where, cache.dtype, start, stop))
    release_maps(cache)


def _array_chunks(tokens: np.ndarray, start: int, stop: int) -> Iterator[tuple[int, np.ndarray]]:
    for pos in range(start, stop, CHUNK_TOKENS):
        yield pos, tokens[pos : min(pos + CHUNK_TOKENS, stop)]


def _file_chunks(
    f: IO[bytes], where: tuple[Path, int], dtype: np.dtype, start: int, stop: int
) -> Iterator[tuple[int, np.ndarray]]:
    """``(pos, tokens)`` of ``[start, stop)`` of the token file ``f`` (its path and byte offset ``where``)."""
    path, base = where
    for pos in range(start, stop, CHUNK_TOKENS):
        n = min(CHUNK_TOKENS, stop - pos)
        f.seek(base + pos * dtype.itemsize)
        chunk = np.fromfile(f, dtype=dtype, count=n)
        if len(chunk) < n:
            raise CacheError(
                f"{path}: ended at token {pos + len(chunk):,}, not {stop:,}: the token file was cut short "
                "while it was read; run `streampack verify`"
            )
        yield pos, chunk


def write_tokens(out: IO[bytes], cache: Cache, shard: int, dtype: np.dtype) -> int:
    """Write a shard's tokens to ``out`` as ``dtype``; return how many."""
    count = int(cache.table.num_tokens[shard])
    write_spans(cache, shard, dtype, [(out, 0, count)])
    return count


def write_spans(
    cache: Cache, shard: int, dtype: np.dtype, spans: Iterable[tuple[IO[bytes], int, int]]
) -> None:
    """Write each span ``(out, start, stop)`` of a shard's tokens to its ``out``, in order, as little-endian
    ``dtype``.

    Equal widths keep the bytes as they are, copied by the kernel into a local file, where every id is
    known to fit ``dtype``; a ``dtype`` that may not hold one (:func:`must_check`) has each chunk checked
    as it is written (:func:`check_fits`).

    Raises:
        CacheError: a token file was cut short, or holds an id that ``dtype`` cannot (naming it).
    """
    itemsize = cache.dtype.itemsize
    checked = must_check(cache, dtype)
    same = dtype.itemsize == itemsize and cache.dtype == cache.dtype.newbyteorder("<") and not checked
    where = cache.files.token_file(shard)
    opened: IO[bytes] | None = None
    try:
        for out, start, stop in spans:
            if stop <= start:
                continue
            if where is None:  # MDS samples: from the array its reader made
                chunks = _array_chunks(cache.shard_tokens(shard), start, stop)
            else:
                if opened is None:
                    cache.shard_tokens(shard)  # checks the file's size (and fetches a remote cache's copy)
                    opened = open(where[0], "rb")  # noqa: SIM115 (closed below)
                if same:
                    copied = copy_range(opened, where[1] + start * itemsize, (stop - start) * itemsize, out)
                    start += copied // itemsize
                chunks = _file_chunks(opened, where, cache.dtype, start, stop)
            for pos, chunk in chunks:
                if checked:
                    check_fits(cache, shard, chunk, pos, dtype)
                out.write(np.ascontiguousarray(chunk, dtype=dtype).data)
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


def must_check(cache: Cache, dtype: np.dtype) -> bool:
    """Whether the cache's ids, written as ``dtype``, must each be checked to fit (:func:`check_fits`).

    A narrower ``dtype`` (uint32 to uint16) always is: the chunks are cast anyway, and another format's
    files are only declared to keep to their vocabulary. The same width of another sign (uint32 to int32,
    where an id of 2**31 or more would read back negative) is not where the vocabulary proves every id
    fits: a native cache's ids came from its tokenizer (`streampack verify` checks each against it), and
    the check would cost the kernel's copy of the bytes.
    """
    if np.can_cast(cache.dtype, dtype, "safe"):
        return False
    if dtype.itemsize < cache.dtype.itemsize:
        return True
    return cache.declared is not None or cache.vocab_size - 1 > np.iinfo(dtype).max


def first_unfit(ids: np.ndarray, dtype: np.dtype) -> int | None:
    """The flat index of the first of ``ids`` that ``dtype`` cannot hold, or None (a maximum, and a minimum
    for signed ids, over the array: about the speed of memory)."""
    if not ids.size:
        return None
    info = np.iinfo(dtype)
    if ids.max() <= info.max and (ids.dtype.kind == "u" or ids.min() >= info.min):
        return None
    return int(np.flatnonzero((ids > info.max) | (ids < info.min))[0])


def unfit_error(cache: Cache, place: str, value: int, dtype: np.dtype) -> CacheError:
    """The error for the id ``value`` at ``place`` (a file, document and token), which the export's
    ``dtype`` cannot hold: what it would read as, whether the cache's vocabulary covers it, and what to do."""
    top = np.iinfo(dtype).max
    wrapped = int(np.array(value).astype(dtype))
    if value >= cache.vocab_size or value < 0:
        why = (
            f"The cache declares a vocabulary of {cache.vocab_size:,} ids, which its files do not keep to "
            "(`streampack verify` lists every such id). The export stopped and kept nothing: fix the files, "
            "or "
        )
    else:
        why = (
            f"The cache's vocabulary has {cache.vocab_size:,} ids, more than {dtype.name} holds. The export "
            "stopped and kept nothing: "
        )
    if dtype.kind == "i" and dtype.itemsize == cache.dtype.itemsize:  # no wider dtype in this format
        what = (
            f"export to a format that keeps {cache.dtype.name} ids (datatrove, olmo, mds, llmc, native, or "
            'nanogpt with dtype="cache")'
        )
    else:
        what = 'export with a dtype that holds the id (dtype="cache", --out-dtype cache: the cache\'s own)'
    return CacheError(
        f"{place}: the id {value:,} does not fit the export's {dtype.name} tokens (at most {top:,}): "
        f"written, it would read as {wrapped:,}. {why}{what}"
    )


def check_fits(cache: Cache, shard: int, chunk: np.ndarray, start: int, dtype: np.dtype) -> None:
    """Refuse (:class:`CacheError`) a chunk of a shard's tokens, from its token ``start``, holding an id
    ``dtype`` would wrap, naming where it lies."""
    at = first_unfit(chunk, dtype)
    if at is None:
        return
    from streampack.loader.reading import token_place

    raise unfit_error(cache, token_place(cache, shard, start + at), int(chunk[at]), dtype)


def shard_mask(cache: Cache, shard: int) -> np.ndarray:
    """Shard ``shard``'s loss mask (uint8) as a new array."""
    mask = np.array(cache.shard_loss_mask(shard), dtype=np.uint8)
    release_maps(cache)
    return mask


def release_maps(cache: Cache) -> None:
    """Drop the maps the size checks made: an export reads every shard once."""
    if not isinstance(cache.store, CachedStore):
        cache.drop_maps()


def doc_chunks(docs: ShardDocs, max_tokens: int = CHUNK_TOKENS) -> Iterator[tuple[int, int]]:
    """Runs ``[first, stop)`` of a shard's documents of at most ``max_tokens`` tokens (a longer one alone)."""
    ends = docs.ends
    first = 0
    while first < len(ends):
        base = int(ends[first - 1]) if first else 0
        stop = int(np.searchsorted(ends, base + max_tokens, side="right"))
        stop = max(stop, first + 1)
        yield first, stop
        first = stop


def progress_bar(enabled: bool, total: int, what: str) -> Progress:
    """A tqdm bar on stderr over the tokens an export writes (silent unless ``enabled``)."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="tok",
        unit_scale=True,
        desc=f"export {what}",
        dynamic_ncols=True,
        disable=not enabled,
    )


def may_hold_specials(cache: Cache) -> bool:
    """Whether the documents may hold special ids (parsed special tokens or rendered conversations); the
    default text mode encodes them as text."""
    settings = cache.manifest.settings
    return settings.special_tokens != "text" or settings.chat is not None


def inner_token(cache: Cache, token: int) -> tuple[int, int] | None:
    """``(document, position in it)`` of the first ``token`` anywhere but at a document's end, or None."""
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


def require_eos(cache: Cache, reader: str, keeps: str) -> int:
    """The EOS id of a cache whose documents it delimits, else an :class:`OptionsError` (no EOS, or a BOS
    that is the EOS); ``reader`` says how the format finds documents, ``keeps`` which formats to use."""
    if cache.eos_id is None:
        raise OptionsError(
            f"{cache.root}: the cache appends no EOS, and {reader}: the document boundaries would be lost. "
            f"Rebuild with an EOS, or export to {keeps}"
        )
    if cache.bos_id == cache.eos_id:
        raise OptionsError(
            f"{cache.root}: the cache's BOS is its EOS ({cache.eos_id}), and {reader}: each BOS would end a "
            f"document too, every document read as two. Rebuild without bos_id, or export to {keeps}"
        )
    return cache.eos_id


def refuse_loss_mask(cache: Cache, format: str, drop: bool) -> None:
    """Refuse (:class:`OptionsError`) to lose an SFT cache's loss mask, unless ``drop`` is set."""
    if cache.has_loss_mask and not drop:
        raise OptionsError(
            f"{cache.root}: this SFT cache has a loss mask (which tokens are training targets), and the "
            f"{format} format cannot hold one: the export would lose it. Export to datatrove (.ds.loss), "
            "olmo (label mask files) or hf (labels) to keep it, or pass drop_loss_mask=True "
            "(--drop-loss-mask) to export the tokens alone"
        )


def check_ids_fit(cache: Cache, dtype: np.dtype, format: str, keeps: str) -> None:
    """Refuse (:class:`OptionsError`) a vocabulary whose ids ``dtype`` cannot hold; ``keeps`` says what
    does."""
    top = np.iinfo(dtype).max
    if cache.vocab_size - 1 > top:
        raise OptionsError(
            f"{cache.root}: a vocabulary of {cache.vocab_size:,} ids does not fit the {format} format's "
            f"{dtype.name} tokens (at most {top:,}): ids would wrap. {keeps}"
        )


def check_int_option(name: str, value: object, *, low: int, high: int | None = None) -> int:
    """An integer option in ``[low, high]``, else an :class:`OptionsError`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise OptionsError(f"{name} must be an integer (got {value!r})")
    if value < low or (high is not None and value > high):
        allowed = f"between {low:,} and {high:,}" if high is not None else f"at least {low:,}"
        raise OptionsError(f"{name} must be {allowed} (got {value:,})")
    return int(value)

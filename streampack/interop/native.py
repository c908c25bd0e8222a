"""streampack's own cache as an export format: what ``streampack convert`` writes from another format.

A native cache (``docs/FORMAT.md``) whose manifest, written last, holds every file's CRC-32 and keeps what
the source's said (tokenizer, EOS, BOS, inputs and ``settings.foreign``); a source shard becomes shards of
at most ``shard_tokens`` tokens, cut between documents. The kernel copies the tokens while another thread
computes their CRC-32, so a convert runs at about the speed of a plain copy; :func:`write_scanned` does the
same for files whose documents are found by a scan, scanning each span as it is copied (one read for both).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import msgspec
import numpy as np

from streampack.errors import CacheError
from streampack.format.ledger import LedgerEntry
from streampack.format.manifest import ShardTable
from streampack.format.names import (
    MANIFEST,
    checksum_text,
    crc32,
    ledger_key,
    mask_key,
    offsets_key,
    shard_name,
    tokens_key,
    with_checksum,
)
from streampack.interop.copying import copy_range, write_pieces
from streampack.interop.destination import Destination
from streampack.interop.writing import (
    ShardDocs,
    check_int_option,
    doc_chunks,
    progress_bar,
    release_maps,
    shard_docs,
    write_spans,
)
from streampack.loader.reading import token_place
from streampack.reader.foreign.opening import Foreign, ForeignOptions, ForeignShards, foreign_cache
from streampack.reader.foreign.scanning import ScanPlan, TokenSpan, open_plan, scanned
from streampack.store import encode_json

if TYPE_CHECKING:
    from streampack.reader import Cache

LAYOUT = "directory"
#: Tokens a shard holds at most by default (512 MiB of uint16).
SHARD_TOKENS = 1 << 28
#: Bytes a CRC read takes at a time: a buffer that stays in the CPU's cache (16 MiB ones were 15% slower).
_CRC_BYTES = 1 << 20


@dataclass(frozen=True)
class Options:
    """Options of the native export.

    Attributes:
        shard_tokens: tokens a shard holds at most (cut between documents).
    """

    shard_tokens: int = SHARD_TOKENS

    def __post_init__(self) -> None:
        check_int_option("shard_tokens", self.shard_tokens, low=1)


def check(cache: Cache, options: Options) -> None:
    """Nothing to refuse: a native cache keeps tokens, boundaries, masks and the manifest's policies."""


def write(
    cache: Cache, dest: Destination, options: Options, progress: bool
) -> tuple[int, int, Sequence[str]]:
    """Write the shards, then the manifest (committed last)."""
    written = _Written(cache, dest)
    with progress_bar(progress, cache.num_tokens, "streampack") as bar:
        for docs in shard_docs(cache):
            unit = cache.manifest.units[docs.shard]
            tokens = scanned(cache.shard_tokens(docs.shard))
            _check_vocabulary(cache, tokens, partial(token_place, cache, docs.shard))
            for first, stop in doc_chunks(docs, options.shard_tokens):
                with dest.open(tokens_key(shard_name(len(written.units)))) as out:
                    tokens_crc = _copy_with_crc(cache, docs, first, stop, out)
                whole = first == 0 and stop == len(docs.ends)
                named = unit if whole else f"{unit}[documents {first}:{stop}]"
                written.add(docs, first, stop, named, tokens_crc)
                bar.update(written.tokens[-1])
            release_maps(cache)  # one source shard's arrays at a time (an MDS shard's is a copy)
    return written.commit()


def write_scanned(
    plan: ScanPlan, declared: Mapping[str, Any], dest: Destination, progress: bool
) -> tuple[int, int, Sequence[str]]:
    """Write the native cache of a foreign one read by a scan (``declared``: what :func:`streampack.open`
    was told of it), one shard a span of ``plan``: the same files as :func:`write` of the opened cache."""
    crcs: list[int] = []
    outcome: list[Foreign | BaseException] = []

    def scan() -> None:
        try:
            outcome.append(open_plan(plan, threads=1, crcs=crcs))
        except BaseException as e:  # raised again on the main thread
            outcome.append(e)

    scanner = threading.Thread(target=scan, name="streampack-convert-scan", daemon=True)
    scanner.start()
    spans = [span for span in plan.spans if span.count]  # an empty one has no documents: no shard
    with progress_bar(progress, sum(span.count for span in spans), "streampack") as bar:
        for index, span in enumerate(spans):
            with dest.open(tokens_key(shard_name(index))) as out:
                _copy_span(span, out)
            bar.update(span.count)
    scanner.join()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    cache = foreign_cache(outcome[0], ForeignOptions(**declared))
    for span in spans:
        _check_vocabulary(cache, span.chunks(), partial(_in_file, span.path))
    written = _Written(cache, dest)
    for docs, tokens_crc in zip(shard_docs(cache), crcs, strict=True):
        if len(docs.ends):
            written.add(docs, 0, len(docs.ends), cache.manifest.units[docs.shard], tokens_crc)
    return written.commit()


def _check_vocabulary(
    cache: Cache, chunks: Iterable[tuple[int, np.ndarray]], place: Callable[[int], str]
) -> None:
    """Refuse ``(start, chunk)`` tokens holding an id outside the cache's declared vocabulary, which the
    native cache would record, naming it at ``place(token index)``."""
    vocab = cache.vocab_size
    if vocab > np.iinfo(cache.dtype).max:
        return
    for start, chunk in chunks:
        if len(chunk) and int(chunk.max()) >= vocab:
            at = int(np.flatnonzero(chunk >= vocab)[0])
            raise CacheError(
                f"{place(start + at)}: the id {int(chunk[at]):,} is not below the vocabulary of {vocab:,} "
                "ids declared for these files, which the converted cache would record. Nothing was kept: "
                "give the vocab_size of the tokenizer that made them (--vocab-size), or fix the files "
                "(`streampack verify` of them lists every such id)"
            )


def _in_file(path: Path, pos: int) -> str:
    return f"{path}: token {pos:,}"


class _Written:
    """The shards written so far to ``dest`` from ``cache``: each one's documents, tokens, CRC-32s (tokens,
    offsets, mask) and unit."""

    def __init__(self, cache: Cache, dest: Destination) -> None:
        self.cache, self.dest = cache, dest
        self.docs: list[int] = []
        self.tokens: list[int] = []
        self.crcs: list[list[int]] = []
        self.units: list[str] = []

    def add(self, docs: ShardDocs, first: int, stop: int, unit: str, tokens_crc: int) -> None:
        """Write the document ends (and mask) and ledger entry of documents ``[first, stop)`` of ``docs``,
        whose tokens are written."""
        cache, dest, name = self.cache, self.dest, shard_name(len(self.units))
        start, end = (int(docs.ends[first - 1]) if first else 0), int(docs.ends[stop - 1]) if stop else 0
        offsets = (docs.ends[first:stop] - start).astype("<u8")
        with dest.open(offsets_key(name)) as out:
            out.write(offsets.tobytes())
        sums = [tokens_crc, crc32(offsets.data), 0]
        if cache.has_loss_mask:
            mask = np.ascontiguousarray(cache.shard_loss_mask(docs.shard)[start:end], dtype=np.uint8)
            with dest.open(mask_key(name)) as out:
                out.write(mask.data)
            sums[2] = crc32(mask.data)
        self.docs.append(stop - first)
        self.tokens.append(end - start)
        self.crcs.append(sums)
        self.units.append(unit)
        entry = LedgerEntry(unit, records=stop - first, docs=stop - first, tokens=end - start, done=True,
                            tokens_checksum=checksum_text(sums[0]), offsets_checksum=checksum_text(sums[1]),
                            mask_checksum=checksum_text(sums[2]) if cache.has_loss_mask else "")  # fmt: skip
        with dest.open(ledger_key(name)) as out:  # as a build leaves a finished unit's
            out.write(encode_json(with_checksum(msgspec.structs.asdict(entry))))

    def commit(self) -> tuple[int, int, Sequence[str]]:
        """Write the manifest (the last file, committed last)."""
        cache = self.cache
        columns = np.array(self.crcs, dtype=np.uint32).reshape(-1, 3)
        table = ShardTable(
            np.array(self.docs, dtype=np.int64),
            np.array(self.tokens, dtype=np.int64),
            tokens_crc32=columns[:, 0],
            offsets_crc32=columns[:, 1],
            mask_crc32=columns[:, 2] if cache.has_loss_mask else None,
        )
        manifest = replace(cache.manifest, units=self.units, table=table, complete=True)
        with self.dest.open(MANIFEST) as out:
            out.write(encode_json(with_checksum(manifest.to_json())))
        return cache.num_docs, cache.num_tokens, [MANIFEST]


def _copy_with_crc(cache: Cache, docs: ShardDocs, first: int, stop: int, out: IO[bytes]) -> int:
    """Copy the tokens of documents ``[first, stop)`` of ``docs`` to ``out`` while another thread
    computes their CRC-32."""
    shard, start, end = docs.shard, int(docs.ends[first - 1]) if first else 0, int(docs.ends[stop - 1])
    where = cache.files.token_file(shard)
    pieces = cache.files.pieces(shard) if where is None and isinstance(cache.files, ForeignShards) else None
    if pieces is not None:  # MDS samples: each document's values written where they lie, no copy first
        mine = pieces[first:stop]
        return _beside(partial(_crc_of_pieces, mine), partial(write_pieces, out, mine))
    copy = partial(write_spans, cache, shard, cache.dtype.newbyteorder("<"), [(out, start, end)])
    if where is not None:
        return _beside(partial(_crc_of_file, where, cache.dtype.itemsize, start, end), copy)
    raw = np.ascontiguousarray(cache.shard_tokens(shard)[start:end], dtype=cache.dtype.newbyteorder("<"))
    chunks = [raw.view(np.uint8)[at : at + _CRC_BYTES].data for at in range(0, raw.nbytes, _CRC_BYTES)]
    return _beside(partial(_crc_of_pieces, chunks), copy)


def _beside(checksum: Callable[[], int], write: Callable[[], object]) -> int:
    """``write()`` on this thread while another computes ``checksum()``; the checksum."""
    with ThreadPoolExecutor(1, "streampack-convert-crc") as pool:
        summed = pool.submit(checksum)
        write()
        return summed.result()


def _crc_of_file(where: tuple[Path, int], itemsize: int, start: int, end: int) -> int:
    """The CRC-32 of tokens ``[start, end)`` of a token file, by plain reads (a map's pages would count
    towards the process's memory until unmapped)."""
    span = TokenSpan(where[0], np.dtype(np.uint8), where[1] + start * itemsize, (end - start) * itemsize)
    return _crc_of_pieces(chunk.data for _, chunk in span.chunks(_CRC_BYTES))


def _crc_of_pieces(pieces: Iterable[memoryview]) -> int:
    """The CRC-32 of ``pieces`` end to end."""
    crc = 0
    for piece in pieces:
        crc = crc32(piece, crc)
    return crc


def _copy_span(span: TokenSpan, out: IO[bytes]) -> None:
    """Copy the tokens of ``span`` to ``out``: by the kernel where ``out`` is a local file."""
    nbytes = span.count * span.dtype.itemsize
    with open(span.path, "rb") as source:
        done = copy_range(source, span.offset, nbytes, out)
    for _, chunk in span.chunks(first=done // span.dtype.itemsize):  # the rest (an fsspec file: all)
        out.write(chunk.data)

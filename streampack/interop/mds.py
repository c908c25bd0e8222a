"""MosaicML Streaming's MDS written from a cache: ``DEST/shard.NNNNN.mds`` files and ``DEST/index.json``
(the layout: :mod:`streampack.reader.foreign.mds`).

One document a sample (``ndarray:uint16``, uint32 for a uint32 cache), or with ``seq_len=L`` fixed windows
of the stream (``ndarray:uint16:L``). A shard holds at most ``size_limit`` bytes (64 MiB by default), cut
where ``MDSWriter`` cuts. Empty documents are left out: MDS cannot encode an empty array.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from streampack.errors import OptionsError
from streampack.interop.copying import write_pieces
from streampack.interop.destination import Destination
from streampack.interop.writing import (
    Progress,
    check_int_option,
    doc_chunks,
    progress_bar,
    refuse_loss_mask,
    release_maps,
    shard_docs,
    write_stream,
)
from streampack.reader.foreign.mds import INDEX, SHAPE_CODES

if TYPE_CHECKING:
    from streampack.reader import Cache

LAYOUT = "directory"
SIZE_LIMIT = 1 << 26
#: A shard's offsets are uint32: no byte of it lies past this.
MAX_OFFSET = (1 << 32) - 1


@dataclass(frozen=True)
class Options:
    """Options of the MDS export.

    Attributes:
        seq_len: one fixed window of this many tokens a sample; one document a sample when None.
        size_limit: bytes a shard holds at most (``MDSWriter``'s ``size_limit``); below 4 GiB, which the
            shard's uint32 offsets reach.
        packed: not supported (MDS has no column for the boundaries of packed documents); refused.
        drop_loss_mask: export an SFT cache's tokens without its loss mask (refused otherwise).
    """

    seq_len: int | None = None
    size_limit: int = SIZE_LIMIT
    packed: bool = False
    drop_loss_mask: bool = False

    def __post_init__(self) -> None:
        if self.seq_len is not None:
            check_int_option("seq_len", self.seq_len, low=1)
        check_int_option("size_limit", self.size_limit, low=64, high=MAX_OFFSET)
        if self.packed:
            raise OptionsError(
                "the mds export writes documents or fixed windows: packed samples would lose where each "
                "document starts (their position ids and labels); export packed samples to hf (--packed)"
            )


def config(cache: Cache, options: Options) -> dict[str, Any]:
    """A shard's config, as ``MDSWriter.get_config`` gives it."""
    encoding, size = f"ndarray:{cache.dtype.name}", None
    if options.seq_len is not None:
        encoding, size = f"{encoding}:{options.seq_len}", options.seq_len * cache.dtype.itemsize
    return {
        "column_encodings": [encoding],
        "column_names": ["input_ids"],
        "column_sizes": [size],
        "compression": None,
        "format": "mds",
        "hashes": [],
        "size_limit": options.size_limit,
        "version": 2,
    }


def check(cache: Cache, options: Options) -> None:
    """Refuse a loss mask."""
    refuse_loss_mask(cache, "mds", options.drop_loss_mask)


@dataclass(frozen=True)
class Encoded:
    """Consecutive documents as samples: their sizes, their tokens, and their bytes as pieces (a header
    and the values, for ``writev`` to gather without a copy)."""

    sizes: np.ndarray
    lengths: np.ndarray
    pieces: list[memoryview]


def encode_documents(tokens: np.ndarray, bounds: np.ndarray) -> Encoded:
    """Documents ``tokens[bounds[i]:bounds[i + 1]]`` (none empty) as samples of the variable ``ndarray``
    encoding, their headers built as one table."""
    lengths = np.diff(bounds).astype(np.int64)
    codes = np.searchsorted([limit for limit, _, _ in SHAPE_CODES], lengths, side="right")
    shape_bytes = np.array([np.dtype(d).itemsize for _, _, d in SHAPE_CODES])[codes]
    heads = 4 + 1 + shape_bytes  # size, ndim << 2 | code, shape
    sizes = heads + lengths * tokens.dtype.itemsize
    table = np.zeros((len(lengths), 9), dtype=np.uint8)
    table[:, :4] = (sizes - 4).astype("<u4").view(np.uint8).reshape(-1, 4)
    table[:, 4] = (1 << 2) | codes
    table[:, 5:] = lengths.astype("<u4").view(np.uint8).reshape(-1, 4)  # little-endian: the first w bytes
    header, values = table.reshape(-1).data, tokens.view(np.uint8).data
    cuts = (bounds * tokens.dtype.itemsize).tolist()
    pieces: list[memoryview] = []
    for row, head, lo, hi in zip(range(0, table.size, 9), heads.tolist(), cuts[:-1], cuts[1:]):
        pieces += (header[row : row + head], values[lo:hi])
    return Encoded(sizes, lengths, pieces)


def document_samples(cache: Cache) -> Iterator[tuple[Encoded, int]]:
    """Every document as an encoded sample, in groups, with each group's tokens."""
    little = cache.dtype.newbyteorder("<")
    for docs in shard_docs(cache):
        mapped = cache.shard_tokens(docs.shard)
        for first, stop in doc_chunks(docs):
            lo, hi = (int(docs.ends[first - 1]) if first else 0), int(docs.ends[stop - 1])
            bounds = np.concatenate([[lo], docs.ends[first:stop]]) - lo
            bounds = bounds[np.concatenate([[True], np.diff(bounds) > 0])]  # no empty documents
            yield encode_documents(np.ascontiguousarray(mapped[lo:hi], dtype=little), bounds), hi - lo
        release_maps(cache)  # its pages leave this process with the last pieces written of them


def write(
    cache: Cache, dest: Destination, options: Options, progress: bool
) -> tuple[int, int, Sequence[str]]:
    """Write the shards, then ``index.json``.

    A shard is cut where ``MDSWriter`` cuts it: before the sample that would take its samples and offsets
    past ``size_limit`` less the header and config (a larger sample alone in a shard)."""
    shard = _ShardWriter(dest, config(cache, options))
    with progress_bar(progress, cache.num_tokens, "mds") as bar:
        if options.seq_len is None:
            _write_documents(cache, shard, bar)
        else:
            _write_windows(cache, options.seq_len, shard, bar)
    with dest.open(INDEX) as out:
        out.write(json.dumps({"version": 2, "shards": shard.index}, sort_keys=True).encode())
    return sum(s["samples"] for s in shard.index), shard.tokens, [INDEX]


class _ShardWriter:
    """Writes MDS shards one after the other, keeping each one's entry of ``index.json``."""

    def __init__(self, dest: Destination, shard_config: dict[str, Any]) -> None:
        self.dest, self.shard_config = dest, shard_config
        self.config_bytes = json.dumps(shard_config, sort_keys=True).encode()
        self.room = shard_config["size_limit"] - (4 + 4 + len(self.config_bytes))  # as MDSWriter's
        self.index: list[dict[str, Any]] = []
        self.tokens = 0

    def write(self, sizes: np.ndarray, tokens: int, samples: Callable[[IO[bytes]], None]) -> None:
        """One shard of samples of ``sizes`` bytes (``tokens`` in all), whose bytes ``samples`` writes."""
        name = f"shard.{len(self.index):05d}.mds"
        offsets = np.concatenate([[0], np.cumsum(sizes)]) + 4 + 4 * (len(sizes) + 1) + len(self.config_bytes)
        if offsets[-1] > MAX_OFFSET:  # one sample of 4 GiB, alone in its shard
            raise OptionsError(
                f"{name}: a sample of {int(sizes.max()):,} bytes does not fit an MDS shard, whose uint32 "
                "offsets reach 4 GiB: export fixed windows (seq_len) instead of whole documents"
            )
        with self.dest.open(name) as out:
            out.write(np.array([len(sizes)], dtype="<u4").tobytes() + offsets.astype("<u4").tobytes())
            out.write(self.config_bytes)
            samples(out)
        raw = {"basename": name, "bytes": int(offsets[-1]), "hashes": {}}
        self.index.append({"samples": len(sizes), "raw_data": raw, "zip_data": None, **self.shard_config})
        self.tokens += tokens


def _write_documents(cache: Cache, shard: _ShardWriter, bar: Progress) -> None:
    """One document a sample, each shard's cut found in a group's cumulative sizes."""
    pending: list[memoryview] = []  # the pending samples' bytes, in pieces
    pending_sizes: list[np.ndarray] = []
    used = tokens = 0  # bytes the pending samples take, with their 4-byte offsets; their tokens

    def flush() -> None:
        shard.write(np.concatenate(pending_sizes), tokens, partial(write_pieces, pieces=pending))

    for group, count in document_samples(cache):
        sizes = group.sizes
        taken = np.concatenate([[0], np.cumsum(sizes + 4)])  # with each sample's offset
        pos = 0
        while pos < len(sizes):
            fit = int(np.searchsorted(taken, taken[pos] + shard.room - used, side="right")) - 1 - pos
            if fit <= 0:
                if pending:
                    flush()
                    pending, pending_sizes, used, tokens = [], [], 0, 0
                    continue
                fit = 1  # larger than a shard holds: alone in one, as MDSWriter does
            pending += group.pieces[2 * pos : 2 * (pos + fit)]
            pending_sizes.append(sizes[pos : pos + fit])
            used += int(taken[pos + fit] - taken[pos])
            tokens += int(group.lengths[pos : pos + fit].sum())
            pos += fit
        bar.update(count)
    if pending:
        flush()


def _write_windows(cache: Cache, seq_len: int, shard: _ShardWriter, bar: Progress) -> None:
    """Fixed windows: each shard's samples are a span of the stream, copied by the kernel where it can."""
    row_bytes = seq_len * cache.dtype.itemsize
    per_shard = max(1, shard.room // (row_bytes + 4))
    windows = cache.num_tokens // seq_len
    for first in range(0, windows, per_shard):
        count = min(per_shard, windows - first)
        start, stop = first * seq_len, (first + count) * seq_len
        shard.write(np.full(count, row_bytes), stop - start, partial(write_stream, cache, start, stop))
        bar.update(stop - start)

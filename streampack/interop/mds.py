"""MosaicML Streaming's MDS: ``DEST/shard.NNNNN.mds`` files and ``DEST/index.json``.

The layout, as mosaicml/streaming ``streaming/base/format/mds/writer.py`` (``MDSWriter.encode_sample``,
``encode_joint_shard``), ``mds/encodings.py`` (``NDArray``) and ``base/writer.py`` (``flush_shard``,
``_write_index``) write it and ``StreamingDataset`` reads it:

* a shard: ``uint32 num_samples``, ``uint32 offsets[num_samples + 1]`` (from the file's start), the
  shard's config as JSON (``sort_keys``), then the samples;
* a sample of one column ``input_ids``: for the variable-length encoding ``ndarray:uint16`` (one
  document a sample), ``uint32 size`` then ``(ndim << 2 | shape dtype code)`` as one byte, the shape in
  that dtype, and the values; for the fixed encoding ``ndarray:uint16:L`` (``seq_len=L``: fixed windows of
  the stream, :meth:`Cache.sequences(L) <streampack.Cache.sequences>`, as llm-foundry's
  ``--concat_tokens`` rows), the values alone (uint32 for a uint32 cache);
* ``index.json``: ``{"version": 2, "shards": [...]}``, each shard's config with ``samples`` and
  ``raw_data`` (basename, bytes, hashes), written last.

A shard holds at most ``size_limit`` bytes (the writer's default, 64 MiB) of samples and offsets, as
``MDSWriter`` cuts them. Empty documents are left out: MDS cannot encode an array of no element.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from streampack.errors import OptionsError
from streampack.interop.writing import (
    Destination,
    Progress,
    check_int_option,
    doc_chunks,
    refuse_loss_mask,
    shard_docs,
    token_chunks,
)

if TYPE_CHECKING:
    from streampack.reader import Cache

LAYOUT = "directory"
INDEX = "index.json"
SIZE_LIMIT = 1 << 26
#: ``NDArray``'s shape dtype codes, by the largest dimension they hold.
SHAPE_CODES = ((1 << 8, 0, "<u1"), (1 << 16, 1, "<u2"), (1 << 32, 2, "<u4"))


@dataclass(frozen=True)
class Options:
    """Options of the MDS export.

    Attributes:
        seq_len: one fixed window of this many tokens a sample; one document a sample when None.
        size_limit: bytes a shard holds at most (``MDSWriter``'s ``size_limit``).
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
        check_int_option("size_limit", self.size_limit, low=64)
        if self.packed:
            raise OptionsError(
                "the mds export writes documents or fixed windows: packed samples would lose where each "
                "document starts (their position ids and labels); export packed samples to hf (--packed)"
            )


def encoding(cache: Cache, options: Options) -> str:
    """The ``input_ids`` column's encoding."""
    name = cache.dtype.name
    return f"ndarray:{name}" if options.seq_len is None else f"ndarray:{name}:{options.seq_len}"


def config(cache: Cache, options: Options) -> dict[str, Any]:
    """A shard's config, as ``MDSWriter.get_config`` gives it."""
    size = None if options.seq_len is None else options.seq_len * cache.dtype.itemsize
    return {
        "column_encodings": [encoding(cache, options)],
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


def encode_document(tokens: np.ndarray) -> bytes:
    """One document as a sample of the variable ``ndarray`` encoding: its size header, shape, values."""
    data, _ = encode_documents(tokens, np.array([0, len(tokens)]))
    return data.tobytes()


def encode_documents(tokens: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Documents ``tokens[bounds[i]:bounds[i + 1]]`` (none empty) as consecutive samples of the variable
    ``ndarray`` encoding: the bytes (uint8) and each sample's size. The headers (size, shape code, shape)
    are built as one table; a document's bytes move by one slice copy each."""
    lengths = np.diff(bounds).astype(np.int64)
    codes = np.searchsorted([limit for limit, _, _ in SHAPE_CODES], lengths, side="right")
    shape_bytes = np.array([np.dtype(d).itemsize for _, _, d in SHAPE_CODES])[codes]
    heads = 4 + 1 + shape_bytes  # size, ndim << 2 | code, shape
    sizes = heads + lengths * tokens.dtype.itemsize
    table = np.zeros((len(lengths), 9), dtype=np.uint8)
    table[:, :4] = (sizes - 4).astype("<u4").view(np.uint8).reshape(-1, 4)
    table[:, 4] = (1 << 2) | codes
    table[:, 5:] = lengths.astype("<u4").view(np.uint8).reshape(-1, 4)  # little-endian: the first w bytes
    data = np.empty(int(sizes.sum()), dtype=np.uint8)
    values = tokens.view(np.uint8)
    itemsize = tokens.dtype.itemsize
    at = 0
    for i, (head, lo, hi) in enumerate(zip(heads.tolist(), bounds[:-1].tolist(), bounds[1:].tolist())):
        data[at : at + head] = table[i, :head]
        stop = at + head + (hi - lo) * itemsize
        data[at + head : stop] = values[lo * itemsize : hi * itemsize]
        at = stop
    return data, sizes


def samples(cache: Cache, options: Options) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """The encoded samples, in groups: each group's bytes (uint8), its samples' sizes and its tokens."""
    little = cache.dtype.newbyteorder("<")
    if options.seq_len is None:
        for docs in shard_docs(cache):
            for first, stop in doc_chunks(cache, docs):
                lo, hi = (int(docs.ends[first - 1]) if first else 0), int(docs.ends[stop - 1])
                parts = list(token_chunks(cache, docs.shard, lo, hi))
                tokens = np.concatenate(parts).astype(little, copy=False) if parts else np.zeros(0, little)
                bounds = np.concatenate([[lo], docs.ends[first:stop]]) - lo
                bounds = bounds[np.concatenate([[True], np.diff(bounds) > 0])]  # no empty documents
                yield (*encode_documents(tokens, bounds), hi - lo)
        return
    windows = cache.sequences(options.seq_len)
    rows = max(1, (1 << 22) // options.seq_len)
    row_bytes = options.seq_len * cache.dtype.itemsize
    for first in range(0, len(windows), rows):
        block = windows.read(np.arange(first, min(first + rows, len(windows)))).astype(little, copy=False)
        cache.drop_maps()
        sizes = np.full(len(block), row_bytes, dtype=np.int64)
        yield np.ascontiguousarray(block).view(np.uint8).reshape(-1), sizes, block.size


def write(
    cache: Cache, dest: Destination, options: Options, progress: bool
) -> tuple[int, int, Sequence[str]]:
    """Write the shards, then ``index.json``.

    A shard is cut where ``MDSWriter`` cuts it: before the sample that would take its samples and offsets
    past ``size_limit`` less the header and config (a sample larger than that alone in a shard); the cut
    is found in each group's cumulative sizes, not a sample at a time."""
    shard_config = config(cache, options)
    config_bytes = json.dumps(shard_config, sort_keys=True).encode()
    room = options.size_limit - (4 + 4 + len(config_bytes))  # less MDSWriter's extra bytes per shard
    shards: list[dict[str, Any]] = []
    pending: list[np.ndarray] = []  # the pending samples' bytes, in pieces
    pending_sizes: list[np.ndarray] = []
    used = 0  # bytes the pending samples take, with their 4-byte offsets
    rows = tokens = 0

    def flush() -> None:
        name = f"shard.{len(shards):05d}.mds"
        sizes = np.concatenate(pending_sizes)
        offsets = np.concatenate([[0], np.cumsum(sizes)]) + 4 + 4 * (len(sizes) + 1) + len(config_bytes)
        with dest.open(name) as out:
            out.write(np.array([len(sizes)], dtype="<u4").tobytes() + offsets.astype("<u4").tobytes())
            out.write(config_bytes)
            for piece in pending:
                out.write(piece.data)
        raw = {"basename": name, "bytes": int(offsets[-1]), "hashes": {}}
        shards.append({"samples": len(sizes), "raw_data": raw, "zip_data": None, **shard_config})

    with Progress(progress, cache.num_tokens, "mds") as bar:
        for data, sizes, count in samples(cache, options):
            starts = np.concatenate([[0], np.cumsum(sizes)])
            taken = np.concatenate([[0], np.cumsum(sizes + 4)])  # with each sample's offset
            pos = 0
            while pos < len(sizes):
                fit = int(np.searchsorted(taken, taken[pos] + room - used, side="right")) - 1 - pos
                if fit <= 0:
                    if pending:
                        flush()
                        pending, pending_sizes, used = [], [], 0
                        continue
                    fit = 1  # larger than a shard holds: alone in one, as MDSWriter does
                pending.append(data[starts[pos] : starts[pos + fit]])
                pending_sizes.append(sizes[pos : pos + fit])
                used += int(taken[pos + fit] - taken[pos])
                pos += fit
            rows += len(sizes)
            tokens += count
            bar.update(count)
        if pending:
            flush()
    with dest.open(INDEX) as out:
        out.write(json.dumps({"version": 2, "shards": shards}, sort_keys=True).encode())
    return rows, tokens, [INDEX]

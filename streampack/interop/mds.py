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

import itertools
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
    code, shape_dtype = next((c, d) for limit, c, d in SHAPE_CODES if len(tokens) < limit)
    body = bytes([(1 << 2) | code]) + np.array([len(tokens)], dtype=shape_dtype).tobytes() + tokens.tobytes()
    return np.array([len(body)], dtype="<u4").tobytes() + body


def samples(cache: Cache, options: Options) -> Iterator[tuple[list[bytes], int]]:
    """The encoded samples, in groups, with the tokens of each group."""
    little = cache.dtype.newbyteorder("<")
    if options.seq_len is None:
        for docs in shard_docs(cache):
            for first, stop in doc_chunks(cache, docs):
                lo, hi = (int(docs.ends[first - 1]) if first else 0), int(docs.ends[stop - 1])
                parts = list(token_chunks(cache, docs.shard, lo, hi))
                tokens = np.concatenate(parts).astype(little, copy=False) if parts else np.zeros(0, little)
                bounds = np.concatenate([[0], docs.ends[first:stop] - lo]).tolist()
                encoded = [encode_document(tokens[a:b]) for a, b in itertools.pairwise(bounds) if b > a]
                yield encoded, hi - lo
        return
    windows = cache.sequences(options.seq_len)
    rows = max(1, (1 << 22) // options.seq_len)
    for first in range(0, len(windows), rows):
        block = windows.read(np.arange(first, min(first + rows, len(windows)))).astype(little, copy=False)
        cache.drop_maps()
        yield [row.tobytes() for row in block], block.size


def write(
    cache: Cache, dest: Destination, options: Options, progress: bool
) -> tuple[int, int, Sequence[str]]:
    """Write the shards, then ``index.json``."""
    shard_config = config(cache, options)
    config_bytes = json.dumps(shard_config, sort_keys=True).encode()
    fixed = 4 + 4 + len(config_bytes)  # MDSWriter's extra bytes per shard; 4 more per sample (its offset)
    shards: list[dict[str, Any]] = []
    pending: list[bytes] = []
    size = 0
    rows = tokens = 0

    def flush() -> None:
        name = f"shard.{len(shards):05d}.mds"
        offsets = np.cumsum([0] + [len(s) for s in pending], dtype=np.int64)
        offsets += 4 + 4 * (len(pending) + 1) + len(config_bytes)
        head = np.array([len(pending)], dtype="<u4").tobytes() + offsets.astype("<u4").tobytes()
        with dest.open(name) as out:
            out.write(head + config_bytes)
            for sample in pending:
                out.write(sample)
        raw = {"basename": name, "bytes": int(offsets[-1]), "hashes": {}}
        shards.append({"samples": len(pending), "raw_data": raw, "zip_data": None, **shard_config})

    with Progress(progress, cache.num_tokens, "mds") as bar:
        for group, count in samples(cache, options):
            for sample in group:
                if pending and size + len(sample) + 4 > options.size_limit - fixed:
                    flush()
                    pending, size = [], 0
                pending.append(sample)
                size += len(sample) + 4
            rows += len(group)
            tokens += count
            bar.update(count)
        if pending:
            flush()
    with dest.open(INDEX) as out:
        out.write(json.dumps({"version": 2, "shards": shards}, sort_keys=True).encode())
    return rows, tokens, [INDEX]

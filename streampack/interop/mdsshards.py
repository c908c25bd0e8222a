"""An MDS shard's files checked as ``StreamingDataset`` reads them, without a Python loop over samples: the
offsets table, and each variable sample's size and header as one table (:mod:`streampack.interop.mds`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from streampack.errors import CacheError
from streampack.interop.filechecks import check_size
from streampack.interop.files import map_tokens

INDEX = "index.json"
#: ``NDArray``'s shape dtype codes, by the largest dimension they hold.
SHAPE_CODES = ((1 << 8, 0, "<u1"), (1 << 16, 1, "<u2"), (1 << 32, 2, "<u4"))


def shard_offsets(shard_path: Path, samples: int, nbytes: int) -> np.ndarray:
    """A shard's offsets table (``samples + 1`` uint32 after its sample count), checked."""
    table = 4 + 4 * (samples + 1)
    if nbytes < table:
        raise CacheError(
            f"{shard_path}: {nbytes:,} bytes, shorter than the {table:,}-byte sample count and offsets of "
            f"its {samples:,} samples"
        )
    head = np.fromfile(shard_path, dtype="<u4", count=samples + 2)
    if int(head[0]) != samples:
        raise CacheError(
            f"{shard_path}: num_samples is {int(head[0]):,}, but {INDEX} says {samples:,} samples: the shard "
            "does not belong to this index"
        )
    offsets = head[1:].astype(np.int64)
    if int(offsets[0]) < table:
        raise CacheError(
            f"{shard_path}: offsets[0] is {int(offsets[0]):,}, inside the {table:,}-byte offsets table"
        )
    back = np.flatnonzero(np.diff(offsets) <= 0)
    if len(back):
        j = int(back[0])
        raise CacheError(
            f"{shard_path}: offsets[{j + 1}] is {int(offsets[j + 1]):,}, not after offsets[{j}] "
            f"({int(offsets[j]):,}): the offsets must increase (every sample has bytes)"
        )
    if int(offsets[-1]) != nbytes:
        raise CacheError(
            f"{shard_path}: offsets[{samples}] (the end of the last sample) is {int(offsets[-1]):,}, but the "
            f"file is {nbytes:,} bytes"
        )
    return offsets


def sample_lengths(shard_path: Path, offsets: np.ndarray, itemsize: int) -> tuple[np.ndarray, np.ndarray]:
    """Each variable sample's token count ``n`` and shape width ``w``, from its size alone: ``4 + 1 + w +
    n * itemsize`` bytes, ``w`` the narrowest of :data:`SHAPE_CODES` that holds ``n``."""
    sizes = np.diff(offsets)
    lengths = np.full(len(sizes), -1, dtype=np.int64)
    widths = np.zeros(len(sizes), dtype=np.int64)
    low = 1
    for limit, _, shape_dtype in (*SHAPE_CODES, (np.iinfo(np.int64).max, 3, "<u8")):
        width = np.dtype(shape_dtype).itemsize
        rest = sizes - 5 - width
        n = rest // itemsize
        fits = (rest % itemsize == 0) & (n >= low) & (n < limit) & (lengths < 0)
        lengths[fits], widths[fits] = n[fits], width
        low = limit
    bad = np.flatnonzero(lengths < 0)
    if len(bad):
        j = int(bad[0])
        raise CacheError(
            f"{shard_path}: sample {j} is {int(sizes[j]):,} bytes (offsets[{j}] to offsets[{j + 1}]), which "
            f"no size, shape and {itemsize}-byte values of a 1-dimensional ndarray add up to"
        )
    return lengths, widths


def sample_values(
    shard_path: Path, offsets: np.ndarray, lengths: np.ndarray, widths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """A shard's bytes (mapped) and where each sample's values start in them, every header checked."""
    check_size(shard_path, int(offsets[-1]), "the samples its offsets table (read at open) ends at")
    data = map_tokens(shard_path, np.dtype(np.uint8), 0, int(offsets[-1]))
    starts = offsets[:-1]
    size = np.ascontiguousarray(data[starts[:, None] + np.arange(4)]).view("<u4")[:, 0]
    _check_field(shard_path, "size", size, np.diff(offsets) - 4)
    code_of = np.zeros(9, dtype=np.int64)  # shape width in bytes -> NDArray's shape dtype code
    code_of[[1, 2, 4, 8]] = [0, 1, 2, 3]
    _check_field(shard_path, "ndim and shape dtype", data[starts + 4], (1 << 2) | code_of[widths])
    shape = np.zeros(len(starts), dtype=np.int64)
    for byte in range(8):  # little-endian: byte b of the shape where the width has one
        has = widths > byte
        shape[has] |= data[starts[has] + 5 + byte].astype(np.int64) << (8 * byte)
    _check_field(shard_path, "shape", shape, lengths)
    return data, starts + 5 + widths


def _check_field(shard_path: Path, name: str, found: np.ndarray, expected: np.ndarray) -> None:
    """Refuse the first sample whose header field ``name`` is not what its size implies."""
    wrong = np.flatnonzero(found.astype(np.int64) != expected.astype(np.int64))
    if len(wrong):
        j = int(wrong[0])
        raise CacheError(
            f"{shard_path}: sample {j}'s {name} is {int(found[j]):,}, but its size in the offsets table "
            f"implies {int(expected[j]):,}: the sample's header disagrees with the offsets table"
        )

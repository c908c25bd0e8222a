"""MosaicML Streaming's MDS read as a cache: ``shard.NNNNN.mds`` files and ``index.json``.

As mosaicml/streaming's ``MDSWriter`` writes it (``mds/writer.py``, ``mds/encodings.py``'s ``NDArray``)
and ``StreamingDataset`` reads it:

* a shard: ``uint32 num_samples``, ``uint32 offsets[num_samples + 1]``, the shard's config as JSON, then
  the samples;
* a sample of the one column ``input_ids``: with ``ndarray:uint16`` (one document a sample) ``uint32
  size``, one byte ``ndim << 2 | shape dtype code``, the shape, then the values; with
  ``ndarray:uint16:L`` (fixed windows of ``L`` tokens, as llm-foundry's ``--concat_tokens``) the values
  alone (uint32 for uint32 tokens);
* ``index.json``: ``{"version": 2, "shards": [...]}``, each shard's config with ``samples`` and
  ``raw_data``, written last.

``streampack.open(FOLDER)`` with an ``index.json``: each shard of the index is a shard of the cache, of one
``input_ids`` column of one of those encodings (a window read as a document). A sample's token count
follows from its size, and every sample's header is checked as one table. Fixed windows lie end to end and
are mapped; variable samples do not, so a shard's tokens are joined into one copy on first use (a convert
writes each sample's values from the map instead). A compressed shard is read from the raw file
``StreamingDataset`` leaves. MDS records no EOS id (``eos_id=`` declares it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import numpy as np

from streampack.errors import CacheError, OptionsError, read_json
from streampack.reader.foreign.files import check_size, map_tokens
from streampack.reader.foreign.opening import Foreign, ForeignOptions, ForeignShard

INDEX = "index.json"
#: ``NDArray``'s shape dtype codes, by the largest dimension they hold.
SHAPE_CODES = ((1 << 8, 0, "<u1"), (1 << 16, 1, "<u2"), (1 << 32, 2, "<u4"))
LOOKS_FOR = "mds: a folder with index.json (MDS version 2, an input_ids column)"
#: What reading the files checks of them, as ``verify`` reports it.
OPENED_CHECKS = (
    "their headers and indexes were checked (index.json; each shard's size, sample count and offsets; each "
    "sample's header)"
)
COLUMN = "input_ids"
READ_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_INDEX_FIX = (
    "streampack reads the index.json of MDS version 2, as MDSWriter writes it after the shards: write the "
    "shards again"
)
_Count = Annotated[int, msgspec.Meta(ge=0)]


class _File(msgspec.Struct):
    """A shard's file in ``index.json`` (``raw_data``, ``zip_data``)."""

    basename: str
    bytes: _Count
    hashes: dict[str, str] | None = None


class _Shard(msgspec.Struct):
    """A shard's entry in ``index.json``, as ``MDSWriter`` writes it."""

    format: Literal["mds"]
    column_names: list[str]
    column_encodings: list[str]
    column_sizes: list[int | None]
    samples: _Count
    raw_data: _File
    compression: str | None = None
    zip_data: _File | None = None


class _Index(msgspec.Struct):
    version: Literal[2]
    shards: list[_Shard]


@dataclass(frozen=True)
class Column:
    """The ``input_ids`` column of a shard: its dtype, and the window length of a fixed encoding."""

    dtype: np.dtype
    seq_len: int | None


def recognise(path: Path) -> bool:
    """Whether ``path`` is a folder with an ``index.json`` (or that file)."""
    return (path / INDEX).is_file() or (path.name == INDEX and path.is_file())


def read(path: Path, options: ForeignOptions) -> Foreign:
    """The shards ``index.json`` lists, one document a sample.

    Raises:
        CacheError: ``index.json``, a shard's entry or its file is not what MDS version 2 writes for one
            column of tokens (naming the file, the sample and the field).
        OptionsError: ``dtype=`` (the encodings record it).
    """
    if options.dtype is not None:
        raise OptionsError(f"{path}: MDS encodings record their dtype; dtype= applies to headerless files")
    root = path.parent if path.name == INDEX and path.is_file() else path
    index_path = root / INDEX
    try:
        raw = index_path.read_bytes()
    except FileNotFoundError:
        raise CacheError(f"{index_path}: missing") from None
    index = read_json(raw, _Index, CacheError, str(index_path), _INDEX_FIX)
    shards, files, dtypes = [], [index_path], set()
    for i, entry in enumerate(index.shards):
        shard, column = _shard(root, index_path, i, entry)
        dtypes.add(column.dtype)
        shards.append(shard)
        files.append(shard.path)
    if len(dtypes) > 1:
        raise CacheError(
            f"{index_path}: the shards' input_ids are of dtypes {sorted(d.name for d in dtypes)}: a cache "
            "has one token dtype; open the shards of each dtype apart"
        )
    dtype = dtypes.pop() if dtypes else READ_DTYPES["uint16"]
    return Foreign("mds", root, dtype, shards, options.eos_id, options.bos_id, files=files)


def _column(index_path: Path, i: int, entry: _Shard) -> Column:
    """The shard's ``input_ids`` column, refusing any other layout."""
    names, encodings, sizes = entry.column_names, entry.column_encodings, entry.column_sizes
    if names != [COLUMN] or len(encodings) != 1 or len(sizes) != 1:
        raise CacheError(
            f"{index_path}: shards[{i}] has columns {names!r} ({encodings!r}); streampack reads MDS of one "
            f"column {COLUMN!r} of tokens (ndarray:uint16 or ndarray:uint32, :L for fixed windows)"
        )
    encoding = re.fullmatch(r"ndarray:(uint16|uint32)(?::(0*[1-9][0-9]*))?", encodings[0])
    if encoding is None:
        raise CacheError(
            f"{index_path}: shards[{i}].column_encodings is {encodings!r}; streampack reads input_ids of "
            "ndarray:uint16 or ndarray:uint32 (one document a sample), or of ndarray:uint16:L / "
            "ndarray:uint32:L (fixed windows of L tokens)"
        )
    dtype = READ_DTYPES[encoding[1]]
    seq_len = int(encoding[2]) if encoding[2] else None
    expected = None if seq_len is None else seq_len * dtype.itemsize
    if sizes[0] != expected:
        raise CacheError(
            f"{index_path}: shards[{i}].column_sizes is {sizes!r}, expected [{expected}] for {encodings[0]}"
        )
    return Column(dtype, seq_len)


def _shard(root: Path, index_path: Path, i: int, entry: _Shard) -> tuple[ForeignShard, Column]:
    """Shard ``i`` of the index: its entry, its file's size and its offsets table checked."""
    column = _column(index_path, i, entry)
    samples, basename, nbytes = entry.samples, entry.raw_data.basename, entry.raw_data.bytes
    hashes = {algo: digest.lower() for algo, digest in (entry.raw_data.hashes or {}).items()}
    shard_path = root / basename
    if Path(basename).is_absolute() or ".." in Path(basename).parts:
        raise CacheError(
            f"{index_path}: shards[{i}].raw_data.basename is {basename!r}, expected a file under {root}"
        )
    if entry.compression and not shard_path.is_file():
        zipped = entry.zip_data.basename if entry.zip_data else "its zip_data file"
        raise CacheError(
            f"{index_path}: shards[{i}] is compressed ({entry.compression}) and its raw file {basename} is "
            f"not there: decompress {zipped} to {basename} "
            "(StreamingDataset does so when it reads it), or export the shards uncompressed"
        )
    check_size(shard_path, nbytes, f"the {samples:,} samples of shards[{i}] (raw_data.bytes in {INDEX})")
    offsets = shard_offsets(shard_path, samples, nbytes)
    if column.seq_len is None:
        lengths, widths = sample_lengths(shard_path, offsets, column.dtype.itemsize)
        ends = np.cumsum(lengths, dtype=np.uint64)
        total = int(ends[-1]) if len(ends) else 0

        def pieces() -> list[memoryview]:
            data, firsts = sample_values(shard_path, offsets, lengths, widths)
            view, nbytes = data.data, (lengths * column.dtype.itemsize).tolist()
            return [view[a : a + n] for a, n in zip(firsts.tolist(), nbytes)]

        def gather() -> np.ndarray:  # one copy of every sample's values, joined
            return np.frombuffer(b"".join(pieces()), dtype=column.dtype)

        shard = ForeignShard(
            shard_path, samples, total, tokens=gather, ends=lambda: ends, hashes=hashes, pieces=pieces
        )
        return shard, column
    window = column.seq_len * column.dtype.itemsize
    wrong = np.flatnonzero(np.diff(offsets.astype(np.int64)) != window)
    if len(wrong):
        j = int(wrong[0])
        raise CacheError(
            f"{shard_path}: sample {j} is {int(offsets[j + 1]) - int(offsets[j]):,} bytes, but its encoding "
            f"{column.dtype.name}:{column.seq_len} takes {window:,} (offsets[{j}] and offsets[{j + 1}])"
        )
    total = samples * column.seq_len
    first = int(offsets[0])
    fixed_ends = np.arange(1, samples + 1, dtype=np.uint64) * np.uint64(column.seq_len)
    shard = ForeignShard(
        shard_path,
        samples,
        total,
        tokens=lambda: map_tokens(shard_path, column.dtype, first, total),
        ends=lambda: fixed_ends,
        token_file=(shard_path, first),
        hashes=hashes,
    )
    return shard, column


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

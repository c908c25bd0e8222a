"""Megatron's indexed dataset read as a cache: ``PREFIX.bin`` (the tokens) and ``PREFIX.idx`` (MMIDIDX
version 1), from a local path or object storage.

The layout, as NVIDIA/Megatron-LM ``megatron/core/datasets/indexed_dataset.py`` writes it
(``_IndexWriter``, ``IndexedDatasetBuilder``) and reads it (``_IndexReader``, ``IndexedDataset``), all
little-endian:

``.idx``: the magic ``b"MMIDIDX\\x00\\x00"``; version ``<Q`` 1; the dtype code ``<B``
(:data:`DTYPE_CODES`); ``sequence_count`` ``<Q``; ``document_count`` ``<Q`` (sequences + 1); then
``sequence_lengths`` int32[sequence_count], ``sequence_pointers`` int64[sequence_count] (byte offsets into
``.bin``) and ``document_indices`` int64[document_count] (0, then the sequence index at each document's
end). ``.bin``: the tokens of every sequence, end to end.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from streampack.errors import CacheError, OptionsError
from streampack.reader.foreign.files import LOCAL, ForeignFiles, check_size
from streampack.reader.foreign.opening import Foreign, ForeignOptions, ForeignShard

SUFFIXES = (".bin", ".idx")
MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
#: Megatron's ``DType`` codes.
DTYPE_CODES = dict(uint8=1, int8=2, int16=3, int32=4, int64=5, float64=6, float32=7, uint16=8)
LOOKS_FOR = "megatron: PREFIX.bin + PREFIX.idx"
#: What reading the files checks of them, as ``verify`` reports it.
OPENED_CHECKS = (
    "their headers and indexes were checked (the .idx's magic, version, dtype and counts; its sequences "
    "end to end in a .bin of their length; its document indices)"
)
#: The token dtype streampack reads each Megatron dtype code as (int32 ids are non-negative: uint32 bytes).
READ_DTYPES: dict[int, np.dtype] = {
    DTYPE_CODES["uint16"]: np.dtype("<u2"),
    DTYPE_CODES["int32"]: np.dtype("<u4"),
}
HEADER = struct.Struct("<9sQBQQ")


def prefix_of(path: Path) -> Path:
    """The prefix of ``path`` (``x``, ``x.bin`` or ``x.idx`` all name the pair ``x.bin`` + ``x.idx``)."""
    return path.with_suffix("") if path.suffix in SUFFIXES else path


def recognise(path: Path, files: ForeignFiles = LOCAL) -> bool:
    """Whether ``path`` names a Megatron pair (its ``.idx`` exists)."""
    return files.is_file(Path(f"{prefix_of(path)}.idx"))


def read(path: Path, options: ForeignOptions, files: ForeignFiles = LOCAL) -> Foreign:
    """The pair ``PREFIX.bin`` + ``PREFIX.idx`` as one shard whose documents are Megatron's documents.

    Raises:
        CacheError: the index is not MMIDIDX version 1 of uint16 or int32 tokens end to end in ``.bin``.
        OptionsError: ``dtype=`` (the index records it).
    """
    if options.dtype is not None:
        raise OptionsError(f"{path}: a Megatron index records its dtype; dtype= applies to headerless files")
    prefix = prefix_of(path)
    idx, bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    magic, version, code, sequences, documents = _header(idx, files)
    if magic != MAGIC:
        raise CacheError(f"{idx}: magic {magic!r}, expected {MAGIC!r}: not a Megatron MMIDIDX index")
    if version != VERSION:
        raise CacheError(f"{idx}: version {version}, expected {VERSION}: an index streampack cannot read")
    if code not in READ_DTYPES:
        names = {c: n for n, c in DTYPE_CODES.items()}
        raise CacheError(
            f"{idx}: dtype code {code} ({names.get(code, 'unknown')}), expected 8 (uint16) or 4 (int32): "
            "streampack reads token ids of those dtypes"
        )
    if documents < 1:
        raise CacheError(f"{idx}: document_count {documents}, expected at least 1 (the indices start at 0)")
    dtype = READ_DTYPES[code]
    check_size(idx, HEADER.size + 12 * sequences + 8 * documents,
               f"the header, {sequences:,} sequences and {documents:,} document indices", files)  # fmt: skip
    lengths = files.map(idx, np.dtype("<i4"), HEADER.size, sequences)
    pointers = files.map(idx, np.dtype("<i8"), HEADER.size + 4 * sequences, sequences)
    doc_indices = files.map(idx, np.dtype("<i8"), HEADER.size + 12 * sequences, documents)
    ends = _sequence_ends(idx, lengths, pointers, dtype.itemsize)
    total = int(ends[-1]) if len(ends) else 0
    _check_documents(idx, doc_indices, sequences)
    check_size(bin_path, total * dtype.itemsize, f"the {total:,} tokens of {idx.name}", files)

    def document_ends() -> np.ndarray:
        return np.concatenate([[0], ends]).astype(np.uint64)[np.asarray(doc_indices[1:])]

    shard = ForeignShard(
        bin_path,
        documents - 1,
        total,
        tokens=lambda: files.map(bin_path, dtype, 0, total),
        ends=document_ends,
        token_file=(bin_path, 0),
        index_files=(idx,),
    )
    return Foreign("megatron", prefix, dtype, [shard], options.eos_id, options.bos_id, files=[bin_path, idx])


def _header(idx: Path, files: ForeignFiles) -> tuple[bytes, int, int, int, int]:
    try:
        raw = files.read(idx, 0, HEADER.size)
    except FileNotFoundError:
        raise CacheError(f"{idx}: missing") from None
    if len(raw) < HEADER.size:
        raise CacheError(f"{idx}: {len(raw)} bytes, shorter than the {HEADER.size}-byte MMIDIDX header")
    return HEADER.unpack(raw)


def _sequence_ends(idx: Path, lengths: np.ndarray, pointers: np.ndarray, itemsize: int) -> np.ndarray:
    """The cumulative end of each sequence, refusing negative lengths and sequences not end to end."""
    if len(lengths) and int(lengths.min()) < 0:
        first = int(np.flatnonzero(np.asarray(lengths) < 0)[0])
        raise CacheError(f"{idx}: sequence_lengths[{first}] is {int(lengths[first])}, below 0")
    ends = np.cumsum(lengths, dtype=np.int64)
    starts = (ends - lengths) * itemsize
    off = np.flatnonzero(starts != pointers)
    if len(off):
        i = int(off[0])
        raise CacheError(
            f"{idx}: sequence_pointers[{i}] is {int(pointers[i]):,}, expected {int(starts[i]):,} (the "
            "sequences end to end, as IndexedDatasetBuilder writes them): streampack reads contiguous ones"
        )
    return ends


def _check_documents(idx: Path, doc_indices: np.ndarray, sequences: int) -> None:
    """``document_indices`` start at 0, never decrease and end at the sequence count."""
    first, last = int(doc_indices[0]), int(doc_indices[-1])
    if first != 0 or last != sequences:
        raise CacheError(
            f"{idx}: document_indices run from {first} to {last}, expected 0 to the sequence count "
            f"{sequences}"
        )
    back = np.flatnonzero(np.diff(doc_indices) < 0)
    if len(back):
        raise CacheError(f"{idx}: document_indices[{int(back[0]) + 1}] decreases: they must not")

"""Megatron's indexed dataset: ``PREFIX.bin`` (the tokens) and ``PREFIX.idx`` (MMIDIDX version 1).

The layout, as NVIDIA/Megatron-LM ``megatron/core/datasets/indexed_dataset.py`` writes it
(``_IndexWriter``, ``IndexedDatasetBuilder``) and reads it (``_IndexReader``, ``IndexedDataset``), all
little-endian:

``.idx``: the magic ``b"MMIDIDX\\x00\\x00"``; version ``<Q`` 1; the dtype code ``<B``
(:data:`DTYPE_CODES`); ``sequence_count`` ``<Q``; ``document_count`` ``<Q`` (sequences + 1); then
``sequence_lengths`` int32[sequence_count], ``sequence_pointers`` int64[sequence_count] (byte offsets into
``.bin``) and ``document_indices`` int64[document_count] (0, then the sequence index at each document's
end). ``.bin``: the tokens of every sequence, end to end.

One streampack document (with its BOS and EOS) is one Megatron sequence and one document:
``document_indices = [0, 1, ..., N]``, as ``tools/preprocess_data.py`` writes a corpus without sentence
splitting, in the dtype ``DType.optimal_dtype(vocab_size)`` picks (uint16 below 65,500 ids, else int32);
``dtype="cache"`` keeps the cache's own (a uint32 cache as int32: Megatron has no uint32).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Literal

import numpy as np

from streampack.errors import CacheError, OptionsError
from streampack.interop.destination import Destination
from streampack.interop.filechecks import check_size
from streampack.interop.files import LOCAL, ForeignFiles
from streampack.interop.reading import Foreign, ForeignOptions, ForeignShard
from streampack.interop.writing import (
    check_ids_fit,
    progress_bar,
    refuse_loss_mask,
    shard_docs,
    write_tokens,
)

if TYPE_CHECKING:
    from streampack.reader import Cache

LAYOUT = "prefix"
#: Read from object storage too (through a local copy: :mod:`streampack.interop.files`).
REMOTE = True
SUFFIXES = (".bin", ".idx")
MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
#: Megatron's ``DType`` codes.
DTYPE_CODES = dict(uint8=1, int8=2, int16=3, int32=4, int64=5, float64=6, float32=7, uint16=8)
#: ``DType.optimal_dtype``: uint16 for a cardinality below this, else int32.
OPTIMAL_UINT16_BELOW = 65500

Dtype = Literal["optimal", "cache", "uint16", "int32"]


@dataclass(frozen=True)
class Options:
    """Options of the Megatron export.

    Attributes:
        dtype: ``"optimal"`` (Megatron's choice for the vocabulary, the default), ``"cache"`` (the cache's,
            a uint32 cache as int32: Megatron has no uint32), or ``"uint16"`` / ``"int32"``.
        drop_loss_mask: export an SFT cache's tokens without its loss mask (refused otherwise).
    """

    dtype: Dtype = "optimal"
    drop_loss_mask: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in ("optimal", "cache", "uint16", "int32"):
            raise OptionsError(f"megatron dtype must be optimal, cache, uint16 or int32 (got {self.dtype!r})")


def token_dtype(cache: Cache, options: Options) -> np.dtype:
    """The ``.bin`` dtype for ``cache``."""
    if options.dtype == "optimal":
        name = "uint16" if cache.vocab_size < OPTIMAL_UINT16_BELOW else "int32"
    elif options.dtype == "cache":
        name = "uint16" if cache.dtype.itemsize == 2 else "int32"
    else:
        name = options.dtype
    return np.dtype(name).newbyteorder("<")


def check(cache: Cache, options: Options) -> None:
    """Refuse a loss mask, and ids the chosen dtype cannot hold."""
    refuse_loss_mask(cache, "megatron", options.drop_loss_mask)
    dtype = token_dtype(cache, options)
    if dtype.itemsize < 4:
        keeps = 'Use dtype="optimal" or "int32".'
    else:  # Megatron has no wider dtype; another format's files have their dtype's vocabulary unless told
        keeps = (
            "Megatron has no wider token dtype. If the ids are of a smaller vocabulary (files that do not "
            "record theirs have their dtype's), open the cache with vocab_size= (--vocab-size) the "
            "tokenizer's, then export it."
        )
    check_ids_fit(cache, dtype, "megatron", keeps)


def write(
    cache: Cache, dest: Destination, options: Options, progress: bool
) -> tuple[int, int, Sequence[str]]:
    """Write ``.bin`` then ``.idx`` (committed last)."""
    dtype = token_dtype(cache, options)
    with progress_bar(progress, cache.num_tokens, "megatron") as bar, dest.open(".bin") as out:
        for shard in range(cache.num_shards):
            bar.update(write_tokens(out, cache, shard, dtype))
    with dest.open(".idx") as out:
        write_index(out, cache, dtype)
    return cache.num_docs, cache.num_tokens, [".idx"]


def write_index(out: IO[bytes], cache: Cache, dtype: np.dtype) -> None:
    """The ``.idx`` of one sequence per document, a shard's table in memory at a time."""
    write = out.write
    count = cache.num_docs
    write(MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", DTYPE_CODES[dtype.name]))
    write(struct.pack("<Q", count) + struct.pack("<Q", count + 1))
    for docs in shard_docs(cache):
        lengths = docs.lengths
        if len(lengths) and int(lengths.max()) > np.iinfo(np.int32).max:
            raise OptionsError(
                f"{cache.root}: a document of {int(lengths.max()):,} tokens is longer than Megatron's int32 "
                "sequence lengths hold"
            )
        write(lengths.astype("<i4").tobytes())
    pointer = 0
    for docs in shard_docs(cache):
        starts = np.concatenate([[0], docs.ends[:-1]]) if len(docs.ends) else docs.ends
        write(((starts + pointer) * dtype.itemsize).astype("<i8").tobytes())
        pointer += int(docs.ends[-1]) if len(docs.ends) else 0
    step = 1 << 20
    for first in range(0, count + 1, step):
        write(np.arange(first, min(first + step, count + 1), dtype="<i8").tobytes())


# Reading ---------------------------------------------------------------------------------------------

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
        CacheError: the index's magic, version, dtype or counts are wrong, its sequences are not end to
            end in ``.bin``, or ``.bin`` is not as long as the index says.
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

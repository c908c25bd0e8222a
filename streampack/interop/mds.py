"""MosaicML Streaming's MDS: ``DEST/shard.NNNNN.mds`` files and ``DEST/index.json``.

As mosaicml/streaming's ``MDSWriter`` writes it (``mds/writer.py``, ``mds/encodings.py``'s ``NDArray``)
and ``StreamingDataset`` reads it:

* a shard: ``uint32 num_samples``, ``uint32 offsets[num_samples + 1]``, the shard's config as JSON, then
  the samples;
* a sample of the one column ``input_ids``: with ``ndarray:uint16`` (one document a sample) ``uint32
  size``, one byte ``ndim << 2 | shape dtype code``, the shape, then the values; with
  ``ndarray:uint16:L`` (``seq_len=L``: fixed windows of the stream, as llm-foundry's
  ``--concat_tokens``) the values alone (uint32 for a uint32 cache);
* ``index.json``: ``{"version": 2, "shards": [...]}``, each shard's config with ``samples`` and
  ``raw_data``, written last.

A shard holds at most ``size_limit`` bytes (64 MiB by default), cut where ``MDSWriter`` cuts. Empty
documents are left out: MDS cannot encode an empty array.

**Reading** (``streampack.open(FOLDER)`` with an ``index.json``): each shard of the index is a shard of
the cache, of one ``input_ids`` column encoded ``ndarray:uint16``/``uint32`` (a document a sample) or
``ndarray:uint16:L``/``uint32:L`` (a window of ``L`` tokens a sample, read as a document); anything else
is refused, naming it. The open reads ``index.json`` and each shard's offsets table; a sample's token
count follows from its size. Fixed windows lie end to end and are mapped as they are. Variable samples
do not, so a shard's tokens are joined into one copy on first use (a convert writes each sample's values
from the map instead), and :class:`~streampack.interop.reading.ForeignShards` keeps at most
:data:`~streampack.interop.reading.MAX_COPY_BYTES` of copies. A compressed shard is read from the raw file
``StreamingDataset`` leaves, else refused. MDS records no EOS id (``eos_id=`` declares it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from streampack.errors import CacheError, OptionsError
from streampack.interop.copying import write_pieces
from streampack.interop.destination import Destination
from streampack.interop.filechecks import check_size
from streampack.interop.files import map_tokens
from streampack.interop.mdsshards import (
    INDEX,
    SHAPE_CODES,
    sample_lengths,
    sample_values,
    shard_offsets,
)
from streampack.interop.reading import Foreign, ForeignOptions, ForeignShard
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
from streampack.reader.filehashes import recorded_hashes

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
        for first, stop in doc_chunks(cache, docs):
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


# Reading ---------------------------------------------------------------------------------------------

LOOKS_FOR = "mds: a folder with index.json (MDS version 2, an input_ids column)"
#: What reading the files checks of them, as ``verify`` reports it.
OPENED_CHECKS = (
    "their headers and indexes were checked (index.json; each shard's size, sample count and offsets; each "
    "sample's header)"
)
COLUMN = "input_ids"
READ_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


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
        CacheError: ``index.json`` or a shard's entry is not what MDS version 2 writes for one column of
            tokens, a compressed shard has no raw file, the shards' dtypes differ, or a shard's file
            disagrees with its entry (naming the file, the sample and the field).
        OptionsError: ``dtype=`` (the encodings record it).
    """
    if options.dtype is not None:
        raise OptionsError(f"{path}: MDS encodings record their dtype; dtype= applies to headerless files")
    root = path.parent if path.name == INDEX and path.is_file() else path
    index_path = root / INDEX
    entries = _index(index_path)
    shards, files, dtypes = [], [index_path], set()
    for i, entry in enumerate(entries):
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


def _index(index_path: Path) -> list[Any]:
    """The ``shards`` of an ``index.json`` of version 2."""
    try:
        index = json.loads(index_path.read_bytes())
    except FileNotFoundError:
        raise CacheError(f"{index_path}: missing") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise CacheError(f"{index_path}: not JSON ({error}); an MDS index.json is written last") from None
    if not isinstance(index, dict) or index.get("version") != 2:
        got = index.get("version") if isinstance(index, dict) else type(index).__name__
        raise CacheError(f'{index_path}: version {got!r}, expected an object with "version": 2 (MDS)')
    shards = index.get("shards")
    if not isinstance(shards, list):
        raise CacheError(f'{index_path}: "shards" is {type(shards).__name__}, expected a list of shards')
    return shards


KINDS = {int: "an integer", str: "a string", dict: "an object", list: "a list"}


def _field(index_path: Path, where: str, entry: Any, name: str, kind: type) -> Any:
    """``entry[name]`` (``where`` in the index), of type ``kind``."""
    value = entry.get(name) if isinstance(entry, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise CacheError(f"{index_path}: {where}.{name} is {value!r}, expected {KINDS[kind]}")
    return value


def _column(index_path: Path, i: int, entry: Any) -> Column:
    """The shard's ``input_ids`` column, refusing any other layout."""
    where = f"shards[{i}]"
    names = _field(index_path, where, entry, "column_names", list)
    encodings = _field(index_path, where, entry, "column_encodings", list)
    sizes = _field(index_path, where, entry, "column_sizes", list)
    if names != [COLUMN] or len(encodings) != 1 or len(sizes) != 1:
        raise CacheError(
            f"{index_path}: shards[{i}] has columns {names!r} ({encodings!r}); streampack reads MDS of one "
            f"column {COLUMN!r} of tokens (ndarray:uint16 or ndarray:uint32, :L for fixed windows)"
        )
    parts = str(encodings[0]).split(":")
    dtype = READ_DTYPES.get(parts[1]) if len(parts) in (2, 3) and parts[0] == "ndarray" else None
    seq_len = int(parts[2]) if len(parts) == 3 and parts[2].isdigit() and int(parts[2]) > 0 else None
    if dtype is None or (len(parts) == 3 and seq_len is None):
        raise CacheError(
            f"{index_path}: shards[{i}].column_encodings is {encodings!r}; streampack reads input_ids of "
            "ndarray:uint16 or ndarray:uint32 (one document a sample), or of ndarray:uint16:L / "
            "ndarray:uint32:L (fixed windows of L tokens)"
        )
    expected = None if seq_len is None else seq_len * dtype.itemsize
    if sizes[0] != expected:
        raise CacheError(
            f"{index_path}: shards[{i}].column_sizes is {sizes!r}, expected [{expected}] for {encodings[0]}"
        )
    return Column(dtype, seq_len)


def _shard(root: Path, index_path: Path, i: int, entry: Any) -> tuple[ForeignShard, Column]:
    """Shard ``i`` of the index: its entry, its file's size and its offsets table checked."""
    where = f"shards[{i}]"
    if _field(index_path, where, entry, "format", str) != "mds":
        raise CacheError(f"{index_path}: {where}.format is {entry['format']!r}, expected 'mds'")
    column = _column(index_path, i, entry)
    samples = _field(index_path, where, entry, "samples", int)
    raw = _field(index_path, where, entry, "raw_data", dict)
    basename = _field(index_path, f"{where}.raw_data", raw, "basename", str)
    nbytes = _field(index_path, f"{where}.raw_data", raw, "bytes", int)
    hashes = recorded_hashes(f"{index_path}: {where}.raw_data.hashes", raw.get("hashes"))
    shard_path = root / basename
    if Path(basename).is_absolute() or ".." in Path(basename).parts:
        raise CacheError(
            f"{index_path}: shards[{i}].raw_data.basename is {basename!r}, expected a file under {root}"
        )
    compression = entry.get("compression")
    if compression and not shard_path.is_file():
        zipped = entry.get("zip_data") or {}
        raise CacheError(
            f"{index_path}: shards[{i}] is compressed ({compression}) and its raw file {basename} is not "
            f"there: decompress {zipped.get('basename', 'its zip_data file')} to {basename} "
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

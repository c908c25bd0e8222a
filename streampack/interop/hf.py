"""A Hugging Face dataset: ``save_to_disk``'s Arrow files and/or Parquet, with ``input_ids`` a row.

Layouts (huggingface/datasets ``arrow_dataset.py``: ``save_to_disk`` and ``to_parquet``):

* ``files="arrow"``: ``DEST/data-NNNNN-of-MMMMM.arrow`` (Arrow IPC streams), ``DEST/dataset_info.json``
  and ``DEST/state.json``, written last (``datasets.load_from_disk(DEST)``);
* ``files="parquet"`` (the default): ``DEST/data/train-NNNNN-of-MMMMM.parquet``, the Hub's layout
  (``datasets.load_dataset(DEST)``);
* ``files="both"``: both in ``DEST``.

Rows: one document a row (``input_ids`` with its BOS and EOS; an SFT cache adds ``labels``, the ids with
-100 at the first token and wherever the loss mask says no target), or with ``seq_len`` one sample a row
as the :class:`~streampack.Loader` gives them with ``output="dict"`` (``input_ids``, ``labels``,
``position_ids``): of :meth:`Cache.sequences(seq_len) <streampack.Cache.sequences>`, or with
``packed=True`` of :meth:`Cache.packed(seq_len) <streampack.Cache.packed>`. ``input_ids`` are int32,
``labels`` and ``position_ids`` int64.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from streampack.errors import OptionsError
from streampack.interop.destination import Destination
from streampack.interop.writing import (
    ShardDocs,
    check_fits,
    check_int_option,
    doc_chunks,
    first_unfit,
    must_check,
    progress_bar,
    shard_docs,
    shard_mask,
    token_chunks,
    unfit_error,
)
from streampack.loader.collate import CausalLMDict

if TYPE_CHECKING:
    from streampack.reader import Cache
    from streampack.samples.sequences import PackedSequences

LAYOUT = "directory"
Files = Literal["arrow", "parquet", "both"]
#: Tokens a file holds, about (a new file starts at the next row past it).
FILE_TOKENS = 1 << 28
#: Each column's value type.
TYPES = {"input_ids": "int32", "labels": "int64", "position_ids": "int64"}
#: Tokens a record batch holds, about (a Parquet row group; a longer document is a batch of its own).
BATCH_TOKENS = 1 << 20


@dataclass(frozen=True)
class Options:
    """Options of the Hugging Face export.

    Attributes:
        files: ``"parquet"`` (the default), ``"arrow"`` (``save_to_disk``) or ``"both"``.
        seq_len: one sample of this many tokens a row (as the Loader's ``output="dict"``); one document
            a row when None (the default).
        packed: (with ``seq_len``) whole documents packed into the samples (:meth:`Cache.packed`), not
            fixed windows of the stream (:meth:`Cache.sequences`).
        file_tokens: start a new file past this many tokens.
    """

    files: Files = "parquet"
    seq_len: int | None = None
    packed: bool = False
    file_tokens: int = FILE_TOKENS

    def __post_init__(self) -> None:
        if self.files not in ("arrow", "parquet", "both"):
            raise OptionsError(f"hf files must be arrow, parquet or both (got {self.files!r})")
        if self.seq_len is not None:
            check_int_option("seq_len", self.seq_len, low=1)
        elif self.packed:
            raise OptionsError(
                "packed=True (--packed) packs documents into samples of seq_len tokens: give seq_len"
            )
        check_int_option("file_tokens", self.file_tokens, low=1)


def check(cache: Cache, options: Options) -> None:
    """Nothing to refuse: a mask becomes ``labels``."""


def features(columns: Sequence[str]) -> dict[str, Any]:
    """The ``datasets`` features of the columns (``Sequence``, which every ``datasets`` version reads)."""
    return {c: {"feature": {"dtype": TYPES[c], "_type": "Value"}, "_type": "Sequence"} for c in columns}


def schema(columns: Sequence[str]) -> pa.Schema:
    """The Arrow schema of the rows, with the features in its ``huggingface`` metadata."""
    meta = json.dumps({"info": {"features": features(columns)}})
    fields = [(c, pa.list_(pa.from_numpy_dtype(np.dtype(TYPES[c])))) for c in columns]
    return pa.schema(fields, metadata={"huggingface": meta})


def batches(cache: Cache, options: Options) -> Iterator[tuple[pa.RecordBatch, int]]:
    """The rows, a record batch of about :data:`BATCH_TOKENS` tokens at a time, with its token count."""
    # One function call a batch, never a loop variable here, which would keep the previous batch alive (a
    # sample batch holds about 20 bytes a token: the peak stays a few tens of MB whatever the cache's size).
    if options.seq_len is None:
        for docs in shard_docs(cache):
            mask = shard_mask(cache, docs.shard) if cache.has_loss_mask else None
            for first, stop in doc_chunks(docs, BATCH_TOKENS):
                yield _document_batch(cache, docs, first, stop, mask)
        return
    samples = cache.packed(options.seq_len) if options.packed else cache.sequences(options.seq_len)
    as_dict = CausalLMDict([samples])
    rows = max(1, BATCH_TOKENS // options.seq_len)
    for first in range(0, len(samples), rows):
        yield _sample_batch(cache, samples, as_dict, first, min(first + rows, len(samples)))


def _check_sample_ids(cache: Cache, samples: PackedSequences, tokens: np.ndarray, first: int) -> None:
    """Refuse (:class:`CacheError`) samples ``tokens`` (from sample ``first``) holding an id past int32."""
    at = first_unfit(tokens, np.dtype(np.int32))
    if at is None:
        return
    from streampack.loader.reading import place_in_sample

    row, column = divmod(at, tokens.shape[1])
    where = place_in_sample(samples, first + row, column)
    place = f"{cache.root}: sample {first + row:,} (column {column:,}{where})"
    raise unfit_error(cache, place, int(tokens.flat[at]), np.dtype(np.int32))


def columns_of(cache: Cache, options: Options) -> list[str]:
    """The columns the rows have."""
    if options.seq_len is not None:
        return ["input_ids", "labels", "position_ids"]
    return ["input_ids", "labels"] if cache.has_loss_mask else ["input_ids"]


def _lists(values: np.ndarray, offsets: np.ndarray) -> pa.ListArray:
    """A list column over ``values`` (no copy of them) cut at ``offsets``.

    Raises:
        OptionsError: a row longer than a list's int32 offsets reach (``datasets``' ``Sequence``).
    """
    if len(offsets) and offsets[-1] > np.iinfo(np.int32).max:  # one document of 2**31 tokens, alone
        raise OptionsError(
            f"a row of {int(np.diff(offsets).max()):,} tokens is longer than a list of the hf format holds "
            "(int32 offsets): export samples of seq_len tokens instead of whole documents"
        )
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))


def _document_batch(
    cache: Cache, docs: ShardDocs, first: int, stop: int, mask: np.ndarray | None
) -> tuple[pa.RecordBatch, int]:
    """Documents ``[first, stop)`` of a shard: their tokens read into one int32 array, cut at their ends."""
    lo, hi = (int(docs.ends[first - 1]) if first else 0), int(docs.ends[stop - 1])
    tokens = np.empty(hi - lo, dtype=np.int32)
    checked = must_check(cache, tokens.dtype)
    at = 0
    for chunk in token_chunks(cache, docs.shard, lo, hi):
        if checked:
            check_fits(cache, docs.shard, chunk, lo + at, tokens.dtype)
        tokens[at : at + len(chunk)] = chunk
        at += len(chunk)
    offsets = np.concatenate([[0], docs.ends[first:stop] - lo])
    arrays = [_lists(tokens, offsets)]
    names = ["input_ids"]
    if mask is not None:
        labels = tokens.astype(np.int64)
        labels[mask[lo:hi] == 0] = -100
        labels[offsets[:-1][np.diff(offsets) > 0]] = -100  # each document's first token
        arrays.append(_lists(labels, offsets))
        names.append("labels")
    return pa.RecordBatch.from_arrays(arrays, names=names), hi - lo


def _sample_batch(
    cache: Cache, samples: PackedSequences, as_dict: CausalLMDict, first: int, stop: int
) -> tuple[pa.RecordBatch, int]:
    """Samples ``[first, stop)`` as the Loader's ``output="dict"`` gives them (a uint32 cache's read into
    uint32, whose bytes the int32 column holds where each id fits it: checked, unless the vocabulary says so).

    Raises:
        CacheError: an id does not fit int32, naming its sample and where it lies.
    """
    indices = np.arange(first, stop, dtype=np.int64)
    seq_len = samples.seq_len
    dtype = np.int32 if np.can_cast(cache.dtype, np.int32) else cache.dtype
    tokens = samples.read(indices, out=np.empty((len(indices), seq_len), dtype=dtype))
    if must_check(cache, np.dtype(np.int32)):
        _check_sample_ids(cache, samples, tokens, first)
    batch = as_dict(tokens, np.zeros(len(indices), dtype=np.int64), indices)
    offsets = np.arange(0, (len(indices) + 1) * seq_len, seq_len, dtype=np.int64)
    arrays = [
        _lists(np.asarray(batch["input_ids"], dtype=np.int32).reshape(-1), offsets),
        _lists(np.asarray(batch["labels"], dtype=np.int64).reshape(-1), offsets),
        _lists(np.asarray(batch["position_ids"], dtype=np.int64).reshape(-1), offsets),
    ]
    cache.drop_maps()  # the samples read through memory maps: let go of their pages
    names = ["input_ids", "labels", "position_ids"]
    return pa.RecordBatch.from_arrays(arrays, names=names), len(indices) * seq_len


class _Files:
    """The open Arrow and Parquet files of one kind, a new one past ``file_tokens`` tokens."""

    def __init__(self, dest: Destination, kind: str, schema: pa.Schema, file_tokens: int) -> None:
        self.dest, self.kind, self.schema, self.file_tokens = dest, kind, schema, file_tokens
        self.names: list[str] = []
        self._opened: Any = None
        self._writer: Any = None
        self._tokens = 0

    def name(self, index: int, count: int | None = None) -> str:
        of = f"-of-{count:05d}" if count is not None else ""
        if self.kind == "arrow":
            return f"data-{index:05d}{of}.arrow"
        return f"data/train-{index:05d}{of}.parquet"

    def write(self, batch: pa.RecordBatch, tokens: int) -> None:
        if self._writer is None:
            self._open()
        self._writer.write_batch(batch)
        self._tokens += tokens
        if self._tokens >= self.file_tokens:
            self.close()

    def _open(self) -> None:
        name = self.name(len(self.names))
        self._opened = self.dest.open(name)
        out: IO[bytes] = self._opened.__enter__()
        if self.kind == "arrow":
            self._writer = pa.ipc.new_stream(out, self.schema)
        else:
            # No dictionary: token ids (tens of thousands of values) overflow its page and fall back to
            # plain encoding after the work is done; without it, writing took a third of the time for a
            # file 3 % larger (snappy-compressed either way, the Hub's default).
            self._writer = pq.ParquetWriter(out, self.schema, use_dictionary=False)
        self.names.append(name)
        self._tokens = 0

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._opened.__exit__(None, None, None)
            self._writer = self._opened = None

    def finish(self) -> list[str]:
        """Close the last file (an empty dataset gets one empty file) and name each by the count."""
        if not self.names:
            self._open()
        self.close()
        final = [self.name(i, len(self.names)) for i in range(len(self.names))]
        for old, new in zip(self.names, final):
            self.dest.rename(old, new)
        return final


def write(
    cache: Cache, dest: Destination, options: Options, progress: bool
) -> tuple[int, int, Sequence[str]]:
    """Write the files, then (for Arrow) ``dataset_info.json`` and ``state.json`` last."""
    columns = columns_of(cache, options)
    kinds = ["arrow", "parquet"] if options.files == "both" else [options.files]
    files = {k: _Files(dest, k, schema(columns), options.file_tokens) for k in kinds}
    total, rows = 0, 0
    with progress_bar(progress, cache.num_tokens, "hf") as bar:
        for batch, tokens in batches(cache, options):
            for f in files.values():
                f.write(batch, tokens)
            total += tokens
            rows += batch.num_rows
            bar.update(tokens)
            del batch  # before the next one is built
    names = {k: f.finish() for k, f in files.items()}
    last: list[str] = []
    if "arrow" in names:
        info = {
            "citation": "",
            "description": "",
            "features": features(columns),
            "homepage": "",
            "license": "",
        }
        with dest.open("dataset_info.json") as out:
            out.write(json.dumps(info, indent=2).encode())
        state: dict[str, Any] = {
            "_data_files": [{"filename": n} for n in names["arrow"]],
            "_fingerprint": f"streampack-{cache.content_digest}"[:32],
            "_format_columns": None,
            "_format_kwargs": {},
            "_format_type": None,
            "_output_all_columns": False,
            "_split": None,
        }
        with dest.open("state.json") as out:
            out.write(json.dumps(state, indent=2).encode())
        last = ["dataset_info.json", "state.json"]
    docs = cache.num_docs if options.seq_len is None else rows
    return docs, total, last

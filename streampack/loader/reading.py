"""What a loader reads: its sources, and the plan of the rows of its next few batches.

:class:`Rows` holds a loader's sources, joined into one token space when every one is a cache, and the
**plan**: the order is asked for the rows of this process's next few batches at once (a call costs ~100
numpy dispatches whatever its size, which would dominate a small batch), and their windows are split at
shard boundaries and sorted by shard once, so a batch is a copy of planned spans. The plan is a cache:
what is read never depends on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np

from streampack.errors import CacheError
from streampack.loader.lookahead import prefetch_steps
from streampack.order import MAX_POSITION, data_fingerprint, groups

if TYPE_CHECKING:
    from streampack.loader.batches import Batches
    from streampack.reader import Cache
    from streampack.samples.copies import BatchedSpans
    from streampack.samples.sequences import JoinedSequences
    from streampack.samples.spans import Spans
    from streampack.store.localcopy import CachedStore

__all__ = ["DataSource", "Rows", "Source", "token_place", "vocab_size_of"]

# The order is computed for this many upcoming rows at once.
_PLAN_ROWS = 4096


class DataSource(Protocol):
    """What a :class:`~streampack.loader.Loader` reads: ``len()`` samples, fetched an index array at a time.

    :class:`streampack.samples.sequences.PackedSequences` is the usual one; a 2-D numpy array is one too.
    A source may also offer ``read(indices, out=...)``, ``boundaries(indices)`` (needed for
    ``output="dict"``), ``fingerprint()`` (checked against checkpoints), ``dtype`` and ``width``.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, indices: np.ndarray) -> np.ndarray: ...


class Rows:
    """A loader's sources, in source-id order, and the plan of its next rows (see the module docstring)."""

    _widens: np.dtype | None = None  # the last dtype read into that holds every id (no check needed)
    _batches: Batches | None = None  # what the plan is of (its order and options)
    _plan: _Plan | None = None
    _last_request: int | None = None

    def __init__(self, sources: list[Source]) -> None:
        from streampack.samples.sequences import JoinedSequences, PackedSequences

        self.sources = sources
        parts = [source.data for source in sources]
        joinable = all(isinstance(part, PackedSequences) for part in parts)
        self.joined = JoinedSequences(parts) if joinable else None  # type: ignore[arg-type]
        self.prefetches = prefetch_steps(self.joined) > 0  # decided once: not a check per batch
        # The stores in object storage read through a local copy, whose prefetch hits a batch counts.
        stores = [part.cache.store for part in self.joined.parts] if self.joined is not None else []
        fetching = {id(store): store for store in stores if store.fetches_copies}
        self.fetching = cast("list[CachedStore]", list(fetching.values()))

    def __getstate__(self) -> dict[str, Any]:
        """The sources; the plan is made again where unpickled."""
        return self.__dict__ | {"_batches": None, "_plan": None, "_last_request": None}

    @property
    def width(self) -> int:
        """Tokens per sample."""
        return self.sources[0].width

    def costs(self, sources: np.ndarray, samples: np.ndarray) -> np.ndarray:
        """The attention cost of each row of these picks (:func:`.parallel.attention_costs`)."""
        from streampack.loader.parallel import attention_costs

        out = np.zeros(len(samples), dtype=np.int64)
        for source, rows in groups(sources):
            found = self.sources[source].data.boundaries(samples[rows])  # type: ignore[attr-defined]
            columns = found.shape[-1]
            out[rows] = attention_costs(found.starts, found.lengths, found.docs, len(rows), columns)
        return out

    @property
    def dtype(self) -> np.dtype:
        """The dtype that holds the tokens of every source: the cache dtype, for one cache."""
        dtype = np.result_type(*(source.dtype for source in self.sources))
        # int64 with uint64 promotes to float64, which would round ids: token ids fit int64.
        return dtype if dtype.kind in "iu" else np.dtype(np.int64)

    def picks(
        self, position: int, batches: Batches, end: Callable[[], int | None]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Picks of this rank's rows of the batch at ``position``; a full batch's are planned together with
        those of the next few this process will read, at the stride seen between requests (every n-th
        batch in a DataLoader worker). ``end`` says where planning stops, asked only when a plan is made.
        """
        if batches is not self._batches:  # the order or the options changed
            self._batches, self._plan, self._last_request = batches, None, None
        if batches.costs is not None or batches.rows(position) < batches.options.batch_size:
            # balanced rows (each batch's own assignment) and the last, partial batch: on their own
            return batches.picks(position)
        plan, last = self._plan, self._last_request
        self._last_request = position
        step = plan.step(position) if plan is not None else None
        if plan is None or step is None:
            plan, step = self._make_plan(position, last, batches, end()), 0
        return plan.sources[step], plan.samples[step]

    def _make_plan(self, position: int, last: int | None, batches: Batches, end: int | None) -> _Plan:
        opts = batches.options
        stride = position - last if last is not None and position > last else opts.batch_size
        count = max(1, _PLAN_ROWS // opts.rows)
        if end is not None:
            count = max(1, min(count, (end - position - opts.batch_size) // stride + 1))
        count = min(count, (MAX_POSITION - position - opts.batch_size) // stride + 1)
        firsts = position + stride * np.arange(count, dtype=np.int64) + opts.rank * opts.rows
        rows = (firsts[:, None] + np.arange(opts.rows, dtype=np.int64)).reshape(-1)
        sources, samples = batches.order(rows)
        # The windows of the whole plan are split at shard boundaries and sorted by shard once, here.
        joined = self.joined
        spans = read_bytes = None
        if joined is not None:
            from streampack.samples.copies import BatchedSpans

            pads = joined.pads_of(sources)
            found = joined.spans(sources, samples)
            moves = joined.moves(sources, samples, found)
            spans = BatchedSpans(found, opts.rows, count, self.width, pads, moves)
            read_bytes = _span_bytes(joined, found, opts.rows, count)
        self._plan = _Plan(
            position, stride, count, sources.reshape(count, -1), samples.reshape(count, -1), spans, read_bytes
        )
        return self._plan

    def bytes_read(self, position: int, sources: np.ndarray, samples: np.ndarray) -> int:
        """Bytes of tokens the batch at ``position`` reads from the sources (not a cache's padding)."""
        plan, joined = self._plan, self.joined
        if joined is None:
            return sum(
                len(rows) * self.width * self.sources[source].dtype.itemsize
                for source, rows in groups(sources)
            )
        step = None if plan is None or plan.spans is None else plan.step(position)
        if step is not None and plan is not None and plan.read_bytes is not None:
            return int(plan.read_bytes[step])
        return int(_span_bytes(joined, joined.spans(sources, samples), max(1, len(samples)), 1)[0])

    def read(
        self, position: int, sources: np.ndarray, samples: np.ndarray, out: np.ndarray | None, dtype: np.dtype
    ) -> np.ndarray:
        """The tokens of the batch at ``position``, copied from its planned spans if any, into ``out`` or a
        new array of ``dtype``. A ``dtype`` narrower than the sources' has every id checked on the way.

        Raises:
            ValueError: ``out`` is not an array of the batch's shape and a dtype that holds every id.
            CacheError: an id does not fit a narrower dtype (the files hold an id their vocabulary does
                not); the message names the id, the sample and where it lies.
        """
        if out is not None and (
            not isinstance(out, np.ndarray)
            or out.shape != (len(samples), self.width)
            or out.dtype.kind not in "iu"
            or not (out.dtype == dtype or np.can_cast(self.dtype, out.dtype, "safe"))
        ):
            raise ValueError(
                f"out must be a numpy array of shape {(len(samples), self.width)} and an integer dtype that "
                f"holds every {self.dtype} id (got {type(out).__name__} "
                f"{getattr(out, 'shape', '')} {getattr(out, 'dtype', '')})"
            )
        target = dtype if out is None else out.dtype
        if target is not self._widens:  # decided once: a loader asks for the same dtype object every time
            if not np.can_cast(self.dtype, target, "safe"):
                return self._narrowed(position, sources, samples, out, np.dtype(target))
            self._widens = target
        return self._copy(position, sources, samples, out, target)

    def _narrowed(
        self, position: int, sources: np.ndarray, samples: np.ndarray, out: np.ndarray | None, dtype: np.dtype
    ) -> np.ndarray:
        """:meth:`read` into a narrower ``dtype``: read wide and checked before the cast, or, between equal
        widths (uint32 to int32), read straight in, where an id that did not fit is negative."""
        if dtype.itemsize == self.dtype.itemsize and self.dtype.kind == "u" and dtype.kind == "i":
            tokens = self._copy(position, sources, samples, out, dtype)
            if tokens.size and tokens.min() < 0:  # exactly the ids at or above 2**(bits - 1)
                raise self._unfit(position, sources, samples, tokens.view(self.dtype), dtype)
            return tokens
        wide = self._copy(position, sources, samples, None, self.dtype)
        info = np.iinfo(dtype)
        if wide.size and (wide.max() > info.max or (self.dtype.kind == "i" and wide.min() < info.min)):
            raise self._unfit(position, sources, samples, wide, dtype)
        if out is None:
            return wide.astype(dtype)
        np.copyto(out, wide, casting="unsafe")
        return out

    def _copy(
        self, position: int, sources: np.ndarray, samples: np.ndarray, out: np.ndarray | None, dtype: np.dtype
    ) -> np.ndarray:
        """:meth:`read`'s copy, casting on the way (``out`` already checked)."""
        plan, joined = self._plan, self.joined
        step = None if plan is None or plan.spans is None else plan.step(position)
        if out is None and step is not None and joined is not None:
            whole = plan.spans.whole(step, joined.rows, dtype)  # type: ignore[union-attr]
            if whole is not None:
                return whole
        if out is None:
            out = np.empty((len(samples), self.width), dtype=dtype)
        if joined is not None:  # every source is a cache
            if step is not None:
                plan.spans.read(step, out, joined.tokens, joined.rows)  # type: ignore[union-attr]
            else:
                joined.read(sources, samples, out)
            return out
        if len(self.sources) == 1:
            self.sources[0].read(samples, out)
            return out
        for source, rows in groups(sources):
            self.sources[source].read(samples[rows], out, rows)
        return out

    def _unfit(
        self, position: int, sources: np.ndarray, samples: np.ndarray, ids: np.ndarray, dtype: np.dtype
    ) -> CacheError:
        """The error for the first of the batch's ``ids`` (sources' dtype) that ``dtype`` cannot hold."""
        info = np.iinfo(dtype)
        row, column = (int(i) for i in np.argwhere((ids > info.max) | (ids < info.min))[0])
        value = int(ids[row, column])
        source, sample = int(sources[row]), int(samples[row])
        data = self.sources[source].data
        named = f"source {source} ({_named(data)})" if len(self.sources) > 1 else _named(data)
        where = place_in_sample(data, sample, column)
        vocab = vocab_size_of(data)
        declared = (
            f"; its vocabulary has {vocab:,} ids, which its files do not keep to (`streampack verify` lists "
            "every such id)"
            if vocab is not None
            else ""
        )
        wrapped = int(np.array(value).astype(dtype))
        return CacheError(
            f"the batch at position {position:,}: sample {sample:,} of {named} holds the id {value:,} "
            f"(column {column:,}{where}), which dtype={dtype} cannot hold (at most {np.iinfo(dtype).max:,}): "
            f"the cast would make it {wrapped:,}{declared}. Fix the files, or use a dtype that holds the id "
            "(int64, the default)"
        )


def _span_bytes(joined: JoinedSequences, spans: Spans, rows: int, count: int) -> np.ndarray:
    """Bytes of tokens the ``spans`` of ``count`` batches of ``rows`` rows each cover, per batch."""
    itemsizes = np.array([part.dtype.itemsize for part in joined.parts], dtype=np.int64)
    if len(set(itemsizes.tolist())) == 1:
        per_span = (spans.hi - spans.lo) * itemsizes[0]
    else:
        parts = np.array([joined.owner(int(shard))[0] for shard in spans.shards.tolist()], dtype=np.int64)
        per_span = (spans.hi - spans.lo) * itemsizes[parts]
    return np.bincount(spans.rows // rows, weights=per_span, minlength=count).astype(np.int64)


def vocab_size_of(data: object) -> int | None:
    """The vocabulary size of a source read from a cache (every id is below it), else None."""
    cache = getattr(data, "cache", None)
    size = getattr(cache, "vocab_size", None)
    return size if isinstance(size, int) else None


def _named(data: object) -> str:
    path = getattr(data, "path", None)
    return str(path) if isinstance(path, str) else type(data).__name__


def place_in_sample(data: object, sample: int, column: int) -> str:
    """Where column ``column`` of sample ``sample`` of a cache's samples lies in its files, for messages."""
    from streampack.samples.sequences import PackedSequences

    if not isinstance(data, PackedSequences):
        return ""
    spans = data.layout.spans(np.array([sample], dtype=np.int64))
    inside = (spans.col <= column) & (column < spans.col + spans.hi - spans.lo)
    if not inside.any():
        return ""
    k = int(np.flatnonzero(inside)[0])
    return ": " + token_place(data.cache, int(spans.shards[k]), int(spans.lo[k] + column - spans.col[k]))


def token_place(cache: Cache, shard: int, pos: int) -> str:
    """Where token ``pos`` of shard ``shard`` of ``cache`` lies, for messages: its file, its document there
    (for a native cache, the cache's document index) and its place in that document."""
    ends = np.asarray(cache.shard_offsets(shard))
    local = int(np.searchsorted(ends, pos, side="right"))
    start = int(ends[local - 1]) if local else 0
    origin = cache.files.origin(shard)
    if origin is None:
        file = cache.files.describe(shard, "tokens")
        doc = f"the cache's document {int(cache.doc_starts[shard]) + local:,}"
    else:
        file, doc = origin[0], f"document {origin[1] + local:,}"
    return f"{file}, {doc}, token {pos - start:,}"


@dataclass(frozen=True)
class _Plan:
    """The picks of ``count`` full batches at ``first``, ``first + stride``, ...: this rank's rows of each."""

    first: int
    stride: int
    count: int
    sources: np.ndarray  # (count, rows)
    samples: np.ndarray  # (count, rows)
    spans: BatchedSpans | None  # where their tokens are, when every source is a cache
    read_bytes: np.ndarray | None = None  # (count,): bytes of tokens each batch reads, with spans

    def step(self, position: int) -> int | None:
        """Which planned batch starts at ``position``, if any."""
        step, offset = divmod(position - self.first, self.stride)
        return step if offset == 0 and 0 <= step < self.count else None


class Source:
    """A :class:`DataSource` seen through the one contract the loader needs, probed once.

    Raises:
        TypeError: ``data`` cannot be read a batch of indices at a time.
    """

    def __init__(self, data: DataSource) -> None:
        from streampack.samples.sequences import PackedSequences

        _check_source(data)
        self.data = data
        self.size = len(data)
        self.fingerprint = data_fingerprint(data)
        width, dtype = getattr(data, "width", None), getattr(data, "dtype", None)
        if isinstance(data, np.ndarray) and data.ndim == 2:
            width = data.shape[1]
        if (width is None or dtype is None) and self.size:
            probe = np.asarray(data[np.zeros(1, dtype=np.int64)])
            width, dtype = (
                probe.shape[-1] if width is None else width,
                probe.dtype if dtype is None else dtype,
            )
        self.width: int = int(width or 0)
        self.dtype = np.dtype(dtype if dtype is not None else np.int64)
        # PackedSequences: read straight into the rows, skipping read()'s checks of the indices and of
        # out, which the loader made itself (in range, int64) and checked once here.
        self._read_rows = data._read if isinstance(data, PackedSequences) else None
        self._read_into = None if self._read_rows is not None else getattr(data, "read", None)

    def __len__(self) -> int:
        return self.size

    def read(self, indices: np.ndarray, out: np.ndarray, rows: np.ndarray | None = None) -> None:
        """Write sample ``indices[k]`` into ``out[rows[k]]`` (into ``out[k]`` when ``rows`` is None)."""
        if self._read_rows is not None:
            self._read_rows(indices, out, rows)
            return
        if self._read_into is not None and rows is None:
            self._read_into(indices, out=out)
            return
        tokens = np.asarray(self.data[indices])
        if rows is None:
            out[...] = tokens
        else:
            out[rows] = tokens


def _check_source(dataset: object) -> None:
    """Refuse at creation what cannot serve ``dataset[index_array]``, rather than at the first batch."""
    missing = [name for name in ("__len__", "__getitem__") if not hasattr(dataset, name)]
    if isinstance(dataset, (list, tuple)):
        got = f"a {type(dataset).__name__} of {len(dataset)} items, which cannot be indexed by an array"
        hint = " (np.stack(samples) makes one of equal-length samples)"
    elif missing:
        got = f"{type(dataset).__name__}, which has no {' or '.join(missing)}"
        hint = ""
    else:
        return
    raise TypeError(
        f"the Loader reads each batch as dataset[index_array], a (rows, width) array (got {got}). Pass "
        f"cache.sequences(seq_len), a 2-D numpy array{hint}, or an object with __len__() and "
        "__getitem__(index array) returning a 2-D array."
    )

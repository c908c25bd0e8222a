"""Which tokens make each sample: a :class:`Layout` maps sample numbers to :class:`Spans` of a token stream.

A cache is one token stream: shards laid end to end, each with its table of document ends. A layout says
which spans of that stream form sample ``i`` and where in the sample's row each one lands; everything
else is written once over :class:`Spans` and shared by every layout:

* :func:`read_spans` copies the spans of a batch into the rows of an array;
* :func:`boundaries` finds the document starts inside them (position ids, document ids, ``cu_seqlens``).

Two layouts:

* :class:`FixedWindows`, the ``group_texts`` convention: sample ``i`` is tokens
  ``[i*seq_len, i*seq_len + seq_len + overlap)`` of a stream (:class:`Runs`: a whole cache, or the
  documents of a split), cut where it crosses a run boundary;
* :class:`Bins`: whole documents laid left to right in each sample, then padding; the plans of
  :mod:`streampack.samples.packing` (best-fit packing, one document per sample) are tables of these.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

__all__ = [
    "BatchedSpans",
    "Bins",
    "Boundaries",
    "FixedWindows",
    "Layout",
    "Runs",
    "Spans",
    "boundaries",
    "read_spans",
    "split_windows",
]


class Boundaries:
    """Where documents start inside a batch of samples, in the forms attention kernels take.

    Every row starts a new segment (a model sees nothing before its window), and so does every document
    start inside a row, every piece of a document that a layout placed apart from the rest, and the
    padding at the end of a row. All arrays cover the ``seq_len`` input positions of each sample, not its
    ``overlap`` tail.

    Held as its segments (a few per row); each array below is computed on first use, so a batch pays only
    for the ones it uses.

    Attributes:
        position_ids: ``int64`` array of shape ``index_shape + (seq_len,)``: the position of each token in
            its segment, restarting at 0 at every document start and at every row start.
        doc_ids: ``int64`` array of the same shape: the global index of each token's document in the cache
            (``cache.doc(doc_ids[r, t])`` holds the token), ``-1`` at padding.
        cu_seqlens: ``int32`` array of shape ``(segments + 1,)``: cumulative segment lengths over the
            flattened batch, starting at 0 and ending at ``rows * seq_len`` (the ``cu_seqlens`` argument of
            varlen attention such as ``flash_attn_varlen_func``).
        max_seqlen: length of the longest segment.
        loss_mask: ``bool`` array of the shape of ``position_ids``: True where the token is a training
            target: inside a document (not padding) and, in a cache built with a loss mask (SFT), marked as
            one (a response, not its prompt).

    Args:
        shape: ``index_shape + (seq_len,)``.
        starts: ``int64``, where each segment starts in the flattened batch, ascending, from 0.
        docs: ``int64``, each segment's document (``-1``: padding).
        marks: the build's loss mask of every token (``bool``, of ``shape``), for caches that have one.
    """

    def __init__(
        self, shape: tuple[int, ...], starts: np.ndarray, docs: np.ndarray, marks: np.ndarray | None = None
    ) -> None:
        self.shape, self.starts, self.docs, self.marks = shape, starts, docs, marks
        self.size = int(np.prod(shape))
        self.lengths = np.diff(starts, append=self.size)

    def reshaped(self, shape: tuple[int, ...]) -> Boundaries:
        """The same boundaries, whose arrays have ``shape`` (as many elements)."""
        marks = None if self.marks is None else self.marks.reshape(shape)
        return Boundaries(shape, self.starts, self.docs, marks)

    @functools.cached_property
    def position_ids(self) -> np.ndarray:
        """See the class docstring."""
        columns = self.shape[-1] if self.shape else 1
        count = np.arange(columns, dtype=np.int64)
        positions = np.empty(self.size, dtype=np.int64)
        if self.size:
            positions.reshape(-1, columns)[...] = count  # segments that start a row: most of them
        inside = np.flatnonzero(self.starts % columns)
        for start, length in zip(self.starts[inside].tolist(), self.lengths[inside].tolist()):
            positions[start : start + length] = count[:length]
        return positions.reshape(self.shape)

    @functools.cached_property
    def doc_ids(self) -> np.ndarray:
        """See the class docstring."""
        return np.repeat(self.docs, self.lengths).reshape(self.shape)

    @functools.cached_property
    def cu_seqlens(self) -> np.ndarray:
        """See the class docstring."""
        return np.append(self.starts, self.size).astype(np.int32)

    @property
    def max_seqlen(self) -> int:
        """See the class docstring."""
        return int(self.lengths.max()) if self.lengths.size else 0

    @functools.cached_property
    def loss_mask(self) -> np.ndarray:
        """See the class docstring."""
        mask = np.ones(self.size, dtype=bool) if self.marks is None else self.marks.reshape(-1).copy()
        for start, stop in self.padding():
            mask[start:stop] = False
        return mask.reshape(self.shape)

    def padding(self) -> list[tuple[int, int]]:
        """The padding of the batch: ``[start, stop)`` ranges of the flattened batch."""
        pads = np.flatnonzero(self.docs < 0)
        return list(zip(self.starts[pads].tolist(), (self.starts[pads] + self.lengths[pads]).tolist()))


@dataclass(frozen=True)
class Spans:
    """The spans of a token stream that make a batch of samples: one entry per span.

    All arrays are integer arrays of equal length. Span ``k`` is tokens ``[lo[k], hi[k])`` of shard
    ``shards[k]``, written to row ``rows[k]`` of the batch from column ``col[k]`` on. A sample may have
    several spans (a window crossing a shard boundary); a column of a row that no span covers is left as
    it is (a layout with padding would fill it).

    Attributes:
        rows: row of the batch (the sample's place among the requested indices).
        shards: shard holding the span.
        lo: first token of the span, local to its shard.
        hi: one past its last token, local to its shard.
        col: column of the row where the span starts.
    """

    rows: np.ndarray
    shards: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    col: np.ndarray

    def head(self, columns: int) -> Spans:
        """The spans cut to the first ``columns`` columns of each row (spans past them dropped)."""
        keep = self.col < columns
        col, lo = self.col[keep], self.lo[keep]
        hi = np.minimum(self.hi[keep], lo + (columns - col))
        return Spans(self.rows[keep], self.shards[keep], lo, hi, col)


class Layout(Protocol):
    """Which spans of a token stream form each sample: a pure function of the sample number.

    A layout holds only small tables (no memory maps), so it pickles with the samples that use it.
    """

    def __len__(self) -> int:
        """Number of samples."""
        ...

    @property
    def width(self) -> int:
        """Tokens per sample row."""
        ...

    @property
    def seq_len(self) -> int:
        """Input tokens per sample: ``width`` without the ``overlap`` tail."""
        ...

    @property
    def overlap(self) -> int:
        """Tokens at the end of each row that are also the start of the next sample (0 for most layouts)."""
        ...

    @property
    def pad_id(self) -> int | None:
        """The id that fills the columns no span covers; ``None`` when every column is covered."""
        ...

    def spans(self, indices: np.ndarray) -> Spans:
        """The spans of the samples ``indices`` (1-D ``int64``, in range): row ``k`` is ``indices[k]``."""
        ...

    def fingerprint(self) -> dict[str, int | str]:
        """The layout's settings, for checking a loader checkpoint against them (JSON-able)."""
        ...


@dataclass(frozen=True)
class Runs:
    """A token stream made of runs of shards' tokens laid end to end: all of a cache, or chosen documents.

    Run ``k`` is tokens ``[offsets[k], offsets[k] + starts[k+1] - starts[k])`` of shard ``shards[k]``, and
    it starts at token ``starts[k]`` of the stream. A whole cache is one run per shard; a subset of its
    documents (a validation split) is one run per stretch of consecutive chosen documents.

    Attributes:
        starts: ``int64``, ``runs + 1``: where each run starts in the stream, then the stream's length.
        shards: ``int64``, ``runs``: the shard each run lies in.
        offsets: ``int64``, ``runs``: the run's first token, local to its shard.
    """

    starts: np.ndarray
    shards: np.ndarray
    offsets: np.ndarray

    @classmethod
    def whole(cls, token_starts: np.ndarray) -> Runs:
        """Every shard in full, in order: ``token_starts`` holds each shard's first token, then the total."""
        count = len(token_starts) - 1
        return cls(token_starts, np.arange(count, dtype=np.int64), np.zeros(count, dtype=np.int64))

    @property
    def total(self) -> int:
        """Tokens in the stream."""
        return int(self.starts[-1])

    def shifted(self, tokens: int, shards: int) -> Runs:
        """These runs placed ``tokens`` further along a longer stream whose shard ids start at ``shards``."""
        return Runs(self.starts + tokens, self.shards + shards, self.offsets)


class FixedWindows:
    """Fixed-length windows of a stream: sample ``i`` is tokens ``[i*seq_len, i*seq_len + width)``.

    Windows cross document and shard boundaries; only the final partial window is dropped.

    Args:
        runs: the stream (a whole cache, or chosen documents of it).
        seq_len: tokens per sample, at least 1.
        overlap: extra tokens at the end of each window, shared with the start of the next one.
        selection: what chose the documents, for the fingerprint (``{}``: every document).
    """

    pad_id: int | None = None

    def __init__(
        self, runs: Runs, seq_len: int, overlap: int, selection: dict[str, int | str] | None = None
    ) -> None:
        self.runs = runs
        self.seq_len = seq_len
        self.overlap = overlap
        self.width = seq_len + overlap
        self.selection = selection or {}

    def __len__(self) -> int:
        """Number of complete windows in the stream."""
        return max(0, (self.runs.total - self.overlap) // self.seq_len)

    def spans(self, indices: np.ndarray) -> Spans:
        """The spans of the windows ``indices``: one per (window, run) overlap."""
        return split_windows(self.runs, indices * self.seq_len, self.width)

    def fingerprint(self) -> dict[str, int | str]:
        """``seq_len`` and ``overlap``, and the document selection when there is one."""
        return {"seq_len": self.seq_len, "overlap": self.overlap, **self.selection}


class Bins:
    """Whole documents (or pieces of long ones) laid left to right in each sample, then padding.

    Sample ``i`` holds pieces ``starts[i]`` to ``starts[i+1]`` of the piece table, in order from column 0;
    the columns after them are padding (``pad_id`` when read). Made by the planners of
    :mod:`streampack.samples.packing`: best-fit packing, or one document per sample.

    Args:
        starts: ``int64``, ``samples + 1``: each sample's first piece, then the number of pieces.
        shards: the shard of each piece.
        lo: each piece's first token, local to its shard.
        lengths: each piece's length in tokens (at most ``seq_len``, together at most ``seq_len`` per sample).
        seq_len: tokens per sample.
        pad_id: the id that fills the padding.
        settings: what made the plan, for the fingerprint.
        directory: where the plan's arrays are mapped from (a copy in another process maps them again
            rather than pickling them); None when they are held in memory.
        dropped: documents the plan left out (``too_long="drop"``).
        no_target: pieces (documents, or pieces of split ones) with no target token, whose every label
            would be ``-100`` (a prompt truncated before its response): left out with
            ``no_target="drop"``, else served.
        checked: the stored plan's ``plan.json`` checksum and the identities of the files checked, so that
            a copy in another process maps that plan, and the same files without reading them again.
    """

    overlap = 0
    #: True for a plan unpickled from streampack 0.1 whose stored plan has no checksum: its arrays are unset
    #: until the samples that hold it plan it again (``PackedSequences``, through
    #: :func:`streampack.samples.packing.plan_again`) and :meth:`restore` them.
    needs_plan = False

    def __init__(
        self,
        starts: np.ndarray,
        shards: np.ndarray,
        lo: np.ndarray,
        lengths: np.ndarray,
        *,
        seq_len: int,
        pad_id: int,
        settings: dict[str, int | str],
        directory: Path | None = None,
        dropped: int = 0,
        no_target: int = 0,
        checked: tuple[str, tuple[tuple[int, ...], ...]] = ("", ()),
    ) -> None:
        self.starts, self.shards, self.lo, self.lengths = starts, shards, lo, lengths
        self.seq_len = self.width = seq_len
        self.pad_id = pad_id
        self.settings = settings
        self.directory = directory
        self.dropped = dropped
        self.no_target = no_target
        self.checked = checked

    def __getstate__(self) -> dict[str, Any]:
        """Pickle the plan's directory rather than its mapped arrays, when it has one."""
        state = {name: value for name, value in self.__dict__.items() if name != "needs_plan"}
        if self.directory is None:
            return state
        return {**state, "starts": None, "shards": None, "lo": None, "lengths": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore the settings; map the arrays again from the plan's directory (checked to be the same
        plan; its files are read again only where they are not the files checked before pickling).

        A plan stored by streampack 0.1 has no checksum: a damaged one is left to be planned again
        (:attr:`needs_plan`), which is the planners' work, not this table's."""
        self.no_target, self.checked = 0, ("", ())  # pickled before the count and the checks existed
        self.__dict__.update(state)
        if self.directory is None:
            return
        from streampack.store.plans import PlanDamage, load_plan

        checksum, identities = self.checked
        try:
            arrays = load_plan(self.directory, checksum, identities).arrays
        except PlanDamage:
            if checksum:
                raise
            # Pickled by streampack 0.1, whose plans had no checksums: its owner makes it again.
            self.needs_plan = True
            return
        self.restore(arrays)

    def restore(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Set the plan's tables (``starts``, ``shards``, ``lo``, ``lengths``), as loaded or planned again."""
        self.starts, self.shards = arrays["starts"], arrays["shards"]
        self.lo, self.lengths = arrays["lo"], arrays["lengths"]
        self.needs_plan = False

    @property
    def tokens(self) -> int:
        """Tokens the samples hold, padding excluded."""
        return int(np.sum(self.lengths, dtype=np.int64))

    @property
    def padding(self) -> float:
        """The fraction of the samples' columns that are padding."""
        columns = len(self) * self.seq_len
        return 1 - self.tokens / columns if columns else 0.0

    def __len__(self) -> int:
        """Number of samples."""
        return len(self.starts) - 1

    def spans(self, indices: np.ndarray) -> Spans:
        """The pieces of the samples ``indices``, each at its column."""
        first = np.asarray(self.starts[indices], dtype=np.int64)
        counts = np.asarray(self.starts[indices + 1], dtype=np.int64) - first
        pieces = _ragged_arange(first, counts)
        rows = np.repeat(np.arange(len(indices), dtype=np.int64), counts)
        lengths = np.asarray(self.lengths[pieces], dtype=np.int64)
        before = np.cumsum(lengths) - lengths  # tokens of the batch before each piece
        heads = np.cumsum(counts) - counts  # each row's first piece (every sample has one)
        lo = np.asarray(self.lo[pieces], dtype=np.int64)
        shards = np.asarray(self.shards[pieces], dtype=np.int64)
        return Spans(rows, shards, lo, lo + lengths, before - np.repeat(before[heads], counts))

    def fingerprint(self) -> dict[str, int | str]:
        """The planner's settings (strategy, ``seq_len``, policies, selection) and the padding id."""
        return {**self.settings, "seq_len": self.seq_len, "pad_id": self.pad_id}


def split_windows(runs: Runs, starts: np.ndarray, width: int) -> Spans:
    """Split the windows ``[start, start + width)`` of a stream at its run boundaries (shards, gaps).

    Args:
        runs: the stream.
        starts: index in the stream of each window's first token.
        width: tokens per window.
    """
    table = runs.starts
    if len(table) == 2:  # one run: nothing to split
        zeros = np.zeros(len(starts), dtype=np.int64)
        lo = starts + int(runs.offsets[0])
        return Spans(np.arange(len(starts)), zeros + int(runs.shards[0]), lo, lo + width, zeros)
    # side="right" skips empty runs: it picks the last run starting at or before the token.
    first = np.searchsorted(table, starts, side="right") - 1
    last = np.searchsorted(table, starts + (width - 1), side="right") - 1
    if np.array_equal(first, last):
        lo = starts - table[first] + runs.offsets[first]
        zeros = np.zeros(len(starts), dtype=np.int64)
        return Spans(np.arange(len(starts)), runs.shards[first], lo, lo + width, zeros)
    counts = last - first + 1
    rows = np.repeat(np.arange(len(starts)), counts)
    run = _ragged_arange(first, counts)
    glo = np.maximum(starts[rows], table[run])
    ghi = np.minimum(starts[rows] + width, table[run + 1])
    keep = ghi > glo  # drop the empty runs a window steps over
    rows, run, glo, ghi = rows[keep], run[keep], glo[keep], ghi[keep]
    base = table[run] - runs.offsets[run]
    return Spans(rows, runs.shards[run], glo - base, ghi - base, glo - starts[rows])


def read_spans(
    spans: Spans, out: np.ndarray, tokens_of: Callable[[int], np.ndarray], rows: np.ndarray | None = None
) -> None:
    """Copy each span into its row of ``out`` (``rows[row]`` when given), shard by shard.

    Shard by shard: one lookup of each shard's map per call rather than one per span (the cache's LRU
    bookkeeping), and one map held at a time, so open descriptors stay bounded. The spans that fill a whole
    row are copied with one row take per shard (see :class:`_Copies`).

    Args:
        spans: what to copy.
        out: destination, wide enough for every span.
        tokens_of: the tokens of a shard.
        rows: the row of ``out`` for each row of the spans; the same row when omitted.
    """
    order = np.argsort(spans.shards, kind="stable")
    targets = spans.rows if rows is None else rows[spans.rows]
    sorted_spans = Spans(
        targets[order], spans.shards[order], spans.lo[order], spans.hi[order], spans.col[order]
    )
    copies = _Copies(sorted_spans, np.zeros(len(order), dtype=np.int64), 1, out.shape[1])
    copies.apply(0, out, tokens_of, lambda shard: row_view(tokens_of(shard), out.shape[1]))


def row_view(tokens: np.ndarray, width: int) -> np.ndarray:
    """The windows of ``width`` tokens of a shard as rows of a 2-D view (no copy): row ``i`` starts at ``i``.

    A batch of windows is then one fancy-index take of rows, a single C loop of contiguous copies.
    """
    count = max(0, len(tokens) - width + 1)
    step = tokens.strides[0]
    return np.ndarray((count, width), tokens.dtype, buffer=tokens, strides=(step, step))


# Rows of one shard in one batch from which a row take beats slice copies (measured: ~8, for 2 KB rows).
_TAKE_ROWS = 8


class _Copies:
    """How to copy the spans of some batches: per batch, row takes per shard, then the other spans.

    A span that fills a whole row (column 0, ``width`` tokens) is one row of its shard's
    :func:`row_view`: where one batch holds at least :data:`_TAKE_ROWS` of them in one shard, they are copied
    by one fancy-index take, written into their rows of the output with the cast on the way. The rest (a few
    rows of a shard, a window cut by a shard boundary, a document laid beside others) are copied slice by
    slice, which costs less for a few rows.

    Args:
        spans: the spans, sorted by batch then shard.
        batch: the batch of each span.
        batches: the number of batches.
        width: columns of a row.
    """

    def __init__(self, spans: Spans, batch: np.ndarray, batches: int, width: int) -> None:
        full = (spans.col == 0) & (spans.hi - spans.lo == width)
        key = batch * (int(spans.shards.max(initial=0)) + 1) + spans.shards
        _, group_of, group_rows = np.unique(key[full], return_inverse=True, return_counts=True)
        full[np.flatnonzero(full)[group_rows[group_of] < _TAKE_ROWS]] = False
        # The takes: spans in (batch, shard) groups; per group its shard and slice of the take arrays.
        taken = np.flatnonzero(full)
        self._take_rows, self._take_lo = spans.rows[taken], spans.lo[taken]
        b, shard = batch[taken], spans.shards[taken]
        firsts = np.flatnonzero(np.diff(b, prepend=-1) | np.diff(shard, prepend=-1))
        self._groups = list(zip(shard[firsts].tolist(), firsts.tolist(), [*firsts[1:].tolist(), len(taken)]))
        self._group_bounds = np.searchsorted(b[firsts], np.arange(batches + 1)).tolist()
        # The rest, copied slice by slice: in batch then shard order, with each batch's bounds.
        rest = np.flatnonzero(~full)
        self._rows, self._shards = spans.rows[rest], spans.shards[rest]
        self._lo, self._hi, self._col = spans.lo[rest], spans.hi[rest], spans.col[rest]
        self._bounds = np.searchsorted(batch[rest], np.arange(batches + 1)).tolist()

    def taken_rows(self, batch: int) -> int:
        """Rows of batch ``batch`` that its row takes copy."""
        return sum(
            stop - first
            for _, first, stop in self._groups[self._group_bounds[batch] : self._group_bounds[batch + 1]]
        )

    def whole(self, batch: int, rows_of: Callable[[int], np.ndarray], dtype: np.dtype) -> np.ndarray | None:
        """Batch ``batch`` as a new array of ``dtype``, when it is one row take (all its rows in one shard).

        The take alone, with no copy into an output array: the plain numpy read itself.
        """
        first, stop = self._group_bounds[batch], self._group_bounds[batch + 1]
        if stop - first != 1 or self._bounds[batch] != self._bounds[batch + 1]:
            return None
        shard, lo, hi = self._groups[first]
        taken = rows_of(shard)[self._take_lo[lo:hi]]
        return taken if taken.dtype == dtype else taken.astype(dtype)

    def apply(
        self,
        batch: int,
        out: np.ndarray,
        tokens_of: Callable[[int], np.ndarray],
        rows_of: Callable[[int], np.ndarray],
    ) -> None:
        """Copy the spans of batch ``batch`` into ``out``; ``rows_of(shard)``: its :func:`row_view`."""
        for shard, first, stop in self._groups[self._group_bounds[batch] : self._group_bounds[batch + 1]]:
            out[self._take_rows[first:stop]] = rows_of(shard)[self._take_lo[first:stop]]
        part = slice(self._bounds[batch], self._bounds[batch + 1])
        current, tokens = -1, None
        for row, shard, start, stop, column in zip(
            self._rows[part].tolist(),
            self._shards[part].tolist(),
            self._lo[part].tolist(),
            self._hi[part].tolist(),
            self._col[part].tolist(),
        ):
            if shard != current:
                current, tokens = shard, tokens_of(shard)
            out[row, column : column + stop - start] = tokens[start:stop]  # type: ignore[index]


class _Tiles:
    """Each batch as one row-major run of spans and padding: one ``np.concatenate`` into the flat output.

    Spans that tile their rows (each row covered from column 0 with no gap, padding after) need no
    placement: in row order, a batch's spans and padding laid end to end ARE its flattened output. So a
    batch of many short spans (packed documents, windows spread over many shards) costs one slice per span
    to list them, then a single C-level copy with the cast on the way.

    Args:
        spans: the spans, any order; ``rows`` are the rows of the whole plan.
        rows: rows per batch.
        width: columns of a row.
        pads: the padding id of each row of the plan (None: no layout pads, every row is covered).
    """

    def __init__(self, spans: Spans, rows: int, batches: int, width: int, pads: np.ndarray | None) -> None:
        used = np.zeros(rows * batches, dtype=np.int64)
        np.maximum.at(used, spans.rows, spans.col + (spans.hi - spans.lo))
        short = np.flatnonzero(used < width)
        pad_ids = pads[short] if pads is not None else np.zeros(len(short), dtype=np.int64)
        self._pad_id = int(pad_ids[0]) if len(pad_ids) else 0
        # Padding is an entry of shard -1 (its ``lo`` holds the id to fill with).
        row = np.concatenate([spans.rows, short])
        col = np.concatenate([spans.col, used[short]])
        order = np.lexsort((col, row))
        row, col = row[order], col[order]
        self._shards = np.concatenate([spans.shards, np.full(len(short), -1, dtype=np.int64)])[order]
        self._lo = np.concatenate([spans.lo, pad_ids])[order]
        lengths = np.concatenate([spans.hi - spans.lo, width - used[short]])[order]
        self._hi = np.where(self._shards < 0, lengths, self._lo + lengths)
        # They tile when each entry starts where the previous one of its row ended, from column 0.
        ends = np.cumsum(lengths)
        self.tiles = bool(np.array_equal(ends - lengths, row * width + col)) and (
            len(ends) == 0 or int(ends[-1]) == rows * batches * width
        )
        self.tiles &= bool((pad_ids == self._pad_id).all())  # one padding id per plan (one per source)
        self._bounds = np.searchsorted(row // rows, np.arange(batches + 1)).tolist()
        self._blocks: dict[np.dtype, np.ndarray] = {}
        self._width = width

    def apply(self, batch: int, out: np.ndarray, tokens_of: Callable[[int], np.ndarray]) -> bool:
        """Copy batch ``batch`` into ``out``; False (nothing done) when ``out`` is not one block."""
        if not out.flags.c_contiguous:
            return False
        part = slice(self._bounds[batch], self._bounds[batch + 1])
        maps: dict[int, np.ndarray] = {}
        for shard in set(self._shards[part].tolist()):
            maps[shard] = tokens_of(shard) if shard >= 0 else self._block(out.dtype)
        pieces = [
            maps[shard][lo:hi] if shard >= 0 else maps[-1][:hi]
            for shard, lo, hi in zip(
                self._shards[part].tolist(), self._lo[part].tolist(), self._hi[part].tolist()
            )
        ]
        np.concatenate(pieces, out=out.reshape(-1))
        return True

    def _block(self, dtype: np.dtype) -> np.ndarray:
        """A row of padding in ``dtype`` (every padding entry's ``lo`` holds its id; one id per plan)."""
        block = self._blocks.get(dtype)
        if block is None:
            block = self._blocks[dtype] = np.full(self._width, self._pad_id, dtype=dtype)
        return block


class BatchedSpans:
    """The spans of several batches of ``rows`` rows each, planned once so that each batch only copies.

    A loader plans a few thousand rows at a time; splitting their windows, sorting their spans and grouping
    the row takes once per plan, rather than once per batch, leaves only the copy to each batch. A batch
    with row takes (:class:`_Copies`) copies that way; any other, when its spans tile their rows, in one
    concatenation (:class:`_Tiles`).

    Args:
        spans: the spans of ``batches * rows`` consecutive rows.
        rows: rows per batch.
        batches: the number of batches.
        width: columns of a row.
        pads: the padding id of each of the ``batches * rows`` rows, when some layout pads; else None.
    """

    def __init__(
        self, spans: Spans, rows: int, batches: int, width: int, pads: np.ndarray | None = None
    ) -> None:
        batch = spans.rows // rows
        order = np.lexsort((spans.shards, batch))
        ordered = Spans(
            (spans.rows % rows)[order],
            spans.shards[order],
            spans.lo[order],
            spans.hi[order],
            spans.col[order],
        )
        self._copies = _Copies(ordered, batch[order], batches, width)
        self._tiles = _Tiles(spans, rows, batches, width, pads)
        self._pads = pads
        self._rows = rows

    def read(
        self,
        batch: int,
        out: np.ndarray,
        tokens_of: Callable[[int], np.ndarray],
        rows_of: Callable[[int], np.ndarray],
    ) -> None:
        """Copy the spans of batch ``batch`` into ``out`` (its ``rows`` rows), padding included."""
        copies = self._copies
        # Row takes win where they copy most rows; otherwise one concatenation of every span does.
        mostly_taken = copies.taken_rows(batch) * 4 >= 3 * self._rows
        if not mostly_taken and self._tiles.tiles and self._tiles.apply(batch, out, tokens_of):
            return
        if self._pads is not None:
            out[...] = self._pads[batch * self._rows : (batch + 1) * self._rows, None]
        copies.apply(batch, out, tokens_of, rows_of)

    def whole(self, batch: int, rows_of: Callable[[int], np.ndarray], dtype: np.dtype) -> np.ndarray | None:
        """Batch ``batch`` as a new array, when all its rows are one row take of one shard; else None."""
        return self._copies.whole(batch, rows_of, dtype)


def boundaries(
    spans: Spans,
    rows: int,
    columns: int,
    offsets_of: Callable[[int], np.ndarray],
    doc_starts: np.ndarray,
    mask_of: Callable[[int], np.ndarray] | None = None,
) -> Boundaries:
    """Document boundaries in the first ``columns`` columns of a batch of ``rows`` rows.

    Computed from the offset tables of the shards the spans touch (two ``searchsorted`` calls per shard);
    no token is read. Columns no span covers are padding: one segment per row, of document ``-1``.

    Args:
        spans: the batch's spans.
        rows: rows of the batch.
        columns: columns to cover, e.g. ``seq_len`` (a window's ``overlap`` tail excluded).
        offsets_of: the offset table of a shard: each document's end, local to the shard.
        doc_starts: global index of each shard's first document.
        mask_of: the loss mask of a shard (1 where a token is a training target), for caches that have one.

    Returns:
        A :class:`Boundaries` whose arrays have shape ``(rows, columns)``.
    """
    if rows == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Boundaries((0, columns), empty, empty)
    spans = spans.head(columns)
    padding = _padding_starts(spans, rows, columns)
    positions, docs = [padding], [np.full(len(padding), -1, dtype=np.int64)]
    for shard in np.unique(spans.shards).tolist():
        mine = spans.shards == shard
        found = _segments_in_shard(
            offsets_of(shard),
            int(doc_starts[shard]),
            spans.lo[mine],
            spans.hi[mine],
            spans.rows[mine] * columns + spans.col[mine],
        )
        positions += [found[0], found[2]]
        docs += [found[1], found[3]]
    starts, start_docs = np.concatenate(positions), np.concatenate(docs)
    order = np.argsort(starts, kind="stable")
    starts, start_docs = starts[order], start_docs[order]
    # Empty documents (no EOS appended) end where the next starts: keep the last, which holds tokens.
    last = np.append(starts[1:] != starts[:-1], True)
    marks = None
    if mask_of is not None:
        marks = np.zeros((rows, columns), dtype=np.uint8)  # padding stays 0
        read_spans(spans, marks, mask_of)
        marks = marks.view(bool)
    return Boundaries((rows, columns), starts[last], start_docs[last], marks)


def _padding_starts(spans: Spans, rows: int, columns: int) -> np.ndarray:
    """Flat position of each row's padding, for the rows whose spans end before ``columns``."""
    used = np.zeros(rows, dtype=np.int64)
    np.maximum.at(used, spans.rows, spans.col + (spans.hi - spans.lo))
    short = np.flatnonzero(used < columns)
    return short * columns + used[short]


def _segments_in_shard(
    offsets: np.ndarray, base: int, lo: np.ndarray, hi: np.ndarray, flat: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Segment starts of the spans ``[lo, hi)`` of one shard that begin at ``flat`` in the batch.

    ``offsets`` is the shard's offset table and ``base`` the global index of its first document. Returns
    the flat position and global document id of each span start, then of each document start strictly
    inside a span.
    """
    # offsets hold each document's END: document j spans [offsets[j-1], offsets[j]). uint64 queries
    # keep searchsorted from promoting the whole table to float64.
    first = np.searchsorted(offsets, lo.astype(np.uint64), side="right").astype(np.int64)
    stop = np.searchsorted(offsets, hi.astype(np.uint64), side="left").astype(np.int64)
    counts = stop - first
    ends = _ragged_arange(first, counts)
    cut_local = offsets[ends].astype(np.int64)
    cut_pos = np.repeat(flat - lo, counts) + cut_local
    return flat, base + first, cut_pos, base + ends + 1


def _ragged_arange(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(s, s + c)`` per pair, vectorised: ``[5, 6, 7, 2]`` from ``[5, 2], [3, 1]``."""
    offsets = np.cumsum(counts) - counts
    return np.repeat(starts - offsets, counts) + np.arange(int(counts.sum()), dtype=np.int64)

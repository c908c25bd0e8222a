"""Copying the spans of a batch into the rows of an array: :func:`read_spans` for one batch,
:class:`BatchedSpans` for several batches planned at once.

Spans that fill whole rows of one shard are copied by one fancy-index take of its :func:`row_view`; a
batch whose spans tile their rows by one concatenation; the rest slice by slice. Every copy casts on the
way, with no temporary. FIM'd rows are copied in FIM order by the compiled loop where numba is installed,
else read plain and then rearranged (:mod:`streampack.samples.fim`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from streampack.samples.fim import Moves, moved_copy
from streampack.samples.spans import Spans

__all__ = ["BatchedSpans", "read_spans", "row_view"]


def read_spans(
    spans: Spans,
    out: np.ndarray,
    tokens_of: Callable[[int], np.ndarray],
    rows: np.ndarray | None = None,
    moves: Moves | None = None,
    sentinel: int | None = None,
) -> None:
    """Copy each span into its row of ``out`` (``rows[row]`` when given), shard by shard: each shard's map
    (``tokens_of(shard)``) is looked up once per call, and one map is held at a time. ``moves``: how FIM
    rearranges the rows of ``out`` (``sentinel``, see :meth:`Moves.apply`)."""
    ordered = spans.taken(np.argsort(spans.shards, kind="stable"))
    if rows is not None:
        ordered = replace(ordered, rows=rows[ordered.rows])
    batch = np.zeros(len(ordered.rows), dtype=np.int64)
    if moves is not None and moved_copy() is not None:
        _Moved(ordered, batch, 1, len(out), moves).apply(0, out, tokens_of, sentinel)
        return
    copies = _Copies(ordered, batch, 1, out.shape[1])
    copies.apply(0, out, tokens_of, lambda shard: row_view(tokens_of(shard), out.shape[1]))
    if moves is not None:
        moves.apply(out, sentinel=sentinel)


def row_view(tokens: np.ndarray, width: int) -> np.ndarray:
    """The windows of ``width`` tokens of a shard as rows of a 2-D view, without a copy: row ``i`` starts
    at token ``i``, so a batch of windows is one fancy-index take."""
    count = max(0, len(tokens) - width + 1)
    step = tokens.strides[0]
    return np.ndarray((count, width), tokens.dtype, buffer=tokens, strides=(step, step))


# Rows of one shard in one batch from which a row take beats slice copies (measured: ~8, for 2 KB rows).
_TAKE_ROWS = 8


class _Copies:
    """How to copy the ``spans`` of some batches (sorted by ``batch`` then shard): a batch's whole-row spans
    of one shard, if :data:`_TAKE_ROWS` or more, by one take of its :func:`row_view`; the rest by slices."""

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

    def whole(self, batch: int, rows_of: Callable[[int], np.ndarray]) -> np.ndarray | None:
        """Batch ``batch`` as a new array of the shard's dtype, when it is one row take of one shard."""
        first, stop = self._group_bounds[batch], self._group_bounds[batch + 1]
        if stop - first != 1 or self._bounds[batch] != self._bounds[batch + 1]:
            return None
        shard, lo, hi = self._groups[first]
        return rows_of(shard)[self._take_lo[lo:hi]]

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


class _Moved:
    """Each batch's spans (sorted by ``batch`` then shard) copied shard by shard in FIM order by the compiled
    loop (:func:`~streampack.samples.fim.moved_copy`): each token once, where a plain copy and then
    :meth:`Moves.apply` move the FIM'd ones twice."""

    def __init__(self, spans: Spans, batch: np.ndarray, batches: int, rows: int, moves: Moves) -> None:
        self._spans = np.stack([spans.rows, spans.lo, spans.hi, spans.col], axis=1).astype(np.int64)
        firsts = np.flatnonzero(np.diff(batch, prepend=-1) | np.diff(spans.shards, prepend=-1))
        bounds = [*firsts.tolist(), len(batch)]
        self._groups = list(zip(spans.shards[firsts].tolist(), bounds[:-1], bounds[1:]))
        self._group_bounds = np.searchsorted(batch[firsts], np.arange(batches + 1)).tolist()
        self._bases = (np.arange(batches + 1) * rows * moves.width).tolist()  # each batch's first position
        self._move_bounds = np.searchsorted(moves.first, self._bases).tolist()
        self._moves = moves.table

    def apply(
        self, batch: int, out: np.ndarray, tokens_of: Callable[[int], np.ndarray], sentinel: int | None = None
    ) -> None:
        """Copy the spans of batch ``batch`` into ``out``, its rows, FIM'd."""
        copy, base = moved_copy(), self._bases[batch]
        moves = self._moves[self._move_bounds[batch] : self._move_bounds[batch + 1]]
        mark = -1 if sentinel is None else sentinel
        for shard, first, stop in self._groups[self._group_bounds[batch] : self._group_bounds[batch + 1]]:
            copy(out, tokens_of(shard), self._spans[first:stop], moves, base, mark)  # type: ignore[misc]


class _Tiles:
    """Each batch as one ``np.concatenate`` of its spans and padding into the flat output, where the spans
    tile their rows (from column 0 with no gap, padding after). ``pads``: each row's padding id, if any."""

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
    """The spans of several batches of ``rows`` rows each, sorted and grouped once per plan so that each
    batch only copies, by row takes (:class:`_Copies`) or one concatenation (:class:`_Tiles`).

    ``spans`` are of ``batches * rows`` consecutive rows of ``width`` columns; ``pads``, the padding id of
    each row when some layout pads; ``moves``, how FIM rearranges the rows once read.
    """

    def __init__(
        self,
        spans: Spans,
        rows: int,
        batches: int,
        width: int,
        pads: np.ndarray | None = None,
        moves: Moves | None = None,
    ) -> None:
        batch = spans.rows // rows
        order = np.lexsort((spans.shards, batch))
        ordered = replace(spans.taken(order), rows=(spans.rows % rows)[order])
        self._pads = pads
        self._rows = rows
        self._moves = moves
        self._moved = None
        if moves is not None and moved_copy() is not None:
            self._moved = _Moved(ordered, batch[order], batches, rows, moves)
            return
        self._copies = _Copies(ordered, batch[order], batches, width)
        self._tiles = _Tiles(spans, rows, batches, width, pads)

    def read(
        self,
        batch: int,
        out: np.ndarray,
        tokens_of: Callable[[int], np.ndarray],
        rows_of: Callable[[int], np.ndarray],
    ) -> None:
        """Copy the spans of batch ``batch`` into ``out`` (its ``rows`` rows), padding included, and
        rearrange them as FIM moves them."""
        if self._moved is not None:
            if self._pads is not None:
                out[...] = self._pads[batch * self._rows : (batch + 1) * self._rows, None]
            self._moved.apply(batch, out, tokens_of)
            return
        copies = self._copies
        # Row takes win where they copy most rows; otherwise one concatenation of every span does.
        mostly_taken = copies.taken_rows(batch) * 4 >= 3 * self._rows
        if mostly_taken or not self._tiles.tiles or not self._tiles.apply(batch, out, tokens_of):
            if self._pads is not None:
                out[...] = self._pads[batch * self._rows : (batch + 1) * self._rows, None]
            copies.apply(batch, out, tokens_of, rows_of)
        self._move(batch, out)

    def whole(self, batch: int, rows_of: Callable[[int], np.ndarray], dtype: np.dtype) -> np.ndarray | None:
        """Batch ``batch`` as a new array, when all its rows are one row take of one shard."""
        if self._moved is not None:
            return None
        taken = self._copies.whole(batch, rows_of)
        if taken is None:
            return None
        self._move(batch, taken)  # in the shard's dtype, before the cast: fewer bytes to move
        return taken if taken.dtype == dtype else taken.astype(dtype)

    def _move(self, batch: int, out: np.ndarray) -> None:
        if self._moves is not None:
            self._moves.apply(out, batch * self._rows)

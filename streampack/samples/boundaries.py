"""Where documents start inside a batch of samples, found from the shards' offset tables alone, in the
forms attention kernels take: position ids, document ids, ``cu_seqlens``, the loss mask.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from streampack.samples.copies import read_spans
from streampack.samples.spans import Spans, ragged_arange

__all__ = ["Boundaries", "boundaries"]


class Boundaries:
    """Where documents start inside a batch of samples, in the forms attention kernels take.

    A new segment starts at every row, every document start, every piece of a document that a layout
    placed apart, and the padding at the end of a row. The arrays cover the ``seq_len`` input positions of
    each sample, not its ``overlap`` tail; each is computed from the segments on first use.

    A layout that pads each piece to a multiple (``pad_multiple``) leaves *fills*: padding at the end of a
    piece's last segment, which belongs to that segment (its position ids count on through it, as
    TransformerEngine's padded sequences do, and ``cu_seqlens`` include it) but is no document's
    (``doc_ids`` -1, no target).

    Attributes:
        position_ids: ``int64``, of shape ``index_shape + (seq_len,)``: each token's position in its
            segment.
        doc_ids: ``int64``, of the same shape: the global index of each token's document in the cache,
            ``-1`` at padding.
        cu_seqlens: ``int32``, of shape ``(segments + 1,)``: cumulative segment lengths over the flattened
            batch, from 0 to ``rows * seq_len`` (the argument of varlen attention such as
            ``flash_attn_varlen_func``).
        max_seqlen: length of the longest segment.
        loss_mask: ``bool``, of the shape of ``position_ids``: True at a training target, a token of a
            document (not padding) that, in an SFT cache, the loss mask marks (a response, not its prompt).

    Args:
        shape: ``index_shape + (seq_len,)``.
        starts: where each segment starts in the flattened batch, ascending from 0.
        docs: each segment's document (``-1``: padding).
        marks: the build's loss mask of every token, of ``shape``, for caches that have one.
        fills: ``(start, stop)`` ranges of the flattened batch, ``int64`` of shape ``(k, 2)``: the padding
            at the end of pieces, inside their segments; None without any.
    """

    def __init__(
        self,
        shape: tuple[int, ...],
        starts: np.ndarray,
        docs: np.ndarray,
        marks: np.ndarray | None = None,
        fills: np.ndarray | None = None,
    ) -> None:
        self.shape, self.starts, self.docs, self.marks, self.fills = shape, starts, docs, marks, fills
        self.size = int(np.prod(shape))
        self.lengths = np.diff(starts, append=self.size)

    def reshaped(self, shape: tuple[int, ...]) -> Boundaries:
        """The same boundaries, whose arrays have ``shape`` (as many elements)."""
        marks = None if self.marks is None else self.marks.reshape(shape)
        return Boundaries(shape, self.starts, self.docs, marks, self.fills)

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
        ids = np.repeat(self.docs, self.lengths)
        if self.fills is not None:
            ids[ragged_arange(self.fills[:, 0], self.fills[:, 1] - self.fills[:, 0])] = -1
        return ids.reshape(self.shape)

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
        mask[self.padding()] = False
        return mask.reshape(self.shape)

    def labels(self, tokens: np.ndarray, off: np.ndarray | None = None) -> np.ndarray:
        """Hugging Face ``labels`` of ``tokens`` (of :attr:`shape`): ``int64``, the tokens, but ``-100`` (no
        target) at every segment start, where :attr:`loss_mask` is False, and on the segments ``off`` marks
        (a boolean per segment; None: none)."""
        labels = tokens.astype(np.int64)
        flat = labels.reshape(-1)
        flat[self.starts] = -100
        if self.marks is not None:
            labels[~self.marks] = -100
        flat[self.padding()] = -100
        if off is not None:
            flat[ragged_arange(self.starts[off], self.lengths[off])] = -100
        return labels

    def padding(self) -> np.ndarray:
        """The flat positions of the batch's padding, fills included (``int64``)."""
        pads = np.flatnonzero(self.docs < 0)
        starts, counts = self.starts[pads], self.lengths[pads]
        if self.fills is not None:
            starts = np.concatenate([starts, self.fills[:, 0]])
            counts = np.concatenate([counts, self.fills[:, 1] - self.fills[:, 0]])
        return ragged_arange(starts, counts)


def boundaries(
    spans: Spans,
    rows: int,
    columns: int,
    offsets_of: Callable[[int], np.ndarray],
    doc_starts: np.ndarray,
    mask_of: Callable[[int], np.ndarray] | None = None,
    multiple: int = 1,
) -> Boundaries:
    """Document boundaries in the first ``columns`` columns of a batch of ``rows`` rows.

    Two ``searchsorted`` calls per shard the spans touch; no token is read. Columns no span covers are one
    padding segment per row (document ``-1``), but for each span's fill up to a ``multiple`` (a layout's
    ``pad_multiple``), which ends the span's last segment.

    Args:
        spans: the batch's spans.
        rows: rows of the batch.
        columns: columns to cover, e.g. ``seq_len`` (not a window's ``overlap`` tail).
        offsets_of: the offset table of a shard: each document's end, local to the shard.
        doc_starts: global index of each shard's first document.
        mask_of: the loss mask of a shard, for caches that have one.
    """
    if rows == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Boundaries((0, columns), empty, empty)
    spans = spans.head(columns)
    sizes = spans.hi - spans.lo
    fills = None
    if multiple > 1:
        sizes = -(-sizes // multiple) * multiple
        ends = spans.rows * columns + spans.col + (spans.hi - spans.lo)
        filled = np.flatnonzero(sizes > spans.hi - spans.lo)
        fills = np.stack([ends[filled], (spans.rows * columns + spans.col + sizes)[filled]], axis=1)
    padding = _padding_starts(spans, sizes, rows, columns)
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
    return Boundaries((rows, columns), starts[last], start_docs[last], marks, fills)


def _padding_starts(spans: Spans, sizes: np.ndarray, rows: int, columns: int) -> np.ndarray:
    """Flat position of the padding of each row whose spans (of ``sizes`` columns) end before ``columns``."""
    used = np.zeros(rows, dtype=np.int64)
    np.maximum.at(used, spans.rows, spans.col + sizes)
    short = np.flatnonzero(used < columns)
    return short * columns + used[short]


def _segments_in_shard(
    offsets: np.ndarray, base: int, lo: np.ndarray, hi: np.ndarray, flat: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Segment starts of the spans ``[lo, hi)`` of one shard (whose first document is ``base``) that begin at
    ``flat`` in the batch: the flat position and document of each span start, then of each document start
    inside a span."""
    # offsets hold each document's END: document j spans [offsets[j-1], offsets[j]). uint64 queries
    # keep searchsorted from promoting the whole table to float64.
    first = np.searchsorted(offsets, lo.astype(np.uint64), side="right").astype(np.int64)
    stop = np.searchsorted(offsets, hi.astype(np.uint64), side="left").astype(np.int64)
    counts = stop - first
    ends = ragged_arange(first, counts)
    cut_local = offsets[ends].astype(np.int64)
    cut_pos = np.repeat(flat - lo, counts) + cut_local
    return flat, base + first, cut_pos, base + ends + 1

"""Long context over several GPUs: a row split over context-parallel ranks, and a global batch's rows spread
over data-parallel ranks by attention cost.

**Context parallelism** (``cp_size`` ranks share each row). Every segment of a row (a document piece with
its fill, or the row's padding) is a multiple of ``2 * cp_size`` long, which ``cache.packed(...,
pad_multiple=2 * cp_size)`` plans. Each segment is cut into ``2 * cp_size`` equal chunks and CP rank ``r``
takes chunks ``r`` and ``2 * cp_size - 1 - r`` (head-tail load balancing, as TransformerEngine's THD
format and Megatron's context parallelism split sequences): under causal attention a chunk near the end
of a document attends to more tokens than one near its start, so pairing them gives every rank the same
work. A rank's row is the concatenation, segment by segment, of its two chunks: ``seq_len / cp_size``
tokens, each with its original position id and label.

**Balance** (``balance="attention"``). The rows of a global batch are assigned to the data-parallel ranks
so that the ranks' attention costs are even, each rank keeping its count of rows. A row's cost is the sum
over its documents' segments of their squared lengths (fills included: the kernel computes them; the
row's padding excluded). The assignment is longest-processing-time first: rows by decreasing cost (ties
by position), each to the rank with the least cost so far among those with rows left to fill (ties: the
lowest rank); each rank's rows then in position order. It depends on the global batch's content and the
world size alone, so a resume, also at another world size, serves what an uninterrupted run would.
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from streampack.errors import OptionsError

__all__ = ["attention_costs", "balanced_ranks", "check_context_parallel", "split_for_cp"]


def balanced_ranks(costs: np.ndarray, world_size: int) -> np.ndarray:
    """The rank of each row of a global batch of rows of ``costs`` (in position order): rank ``r`` gets as
    many rows as an even split gives it (``(r+1)*n//W - r*n//W``), by longest-processing-time first (see
    the module docstring)."""
    n = len(costs)
    room = [(r + 1) * n // world_size - r * n // world_size for r in range(world_size)]
    ranks = np.empty(n, dtype=np.int64)
    loads = [(0, r) for r in range(world_size) if room[r]]
    heapq.heapify(loads)
    for row in np.lexsort((np.arange(n), -np.asarray(costs, dtype=np.int64))).tolist():
        load, rank = heapq.heappop(loads)
        ranks[row] = rank
        room[rank] -= 1
        if room[rank]:
            heapq.heappush(loads, (load + int(costs[row]), rank))
    return ranks


def attention_costs(
    starts: np.ndarray, lengths: np.ndarray, docs: np.ndarray, rows: int, columns: int
) -> np.ndarray:
    """Per row of a batch of ``rows`` rows of ``columns``: the sum of its document segments' squared lengths
    (segments by flat ``starts``, ``lengths`` and ``docs``, ``-1`` for padding, as
    :class:`~streampack.samples.boundaries.Boundaries` holds them)."""
    mine = docs >= 0
    return np.bincount(
        starts[mine] // columns, weights=lengths[mine].astype(np.float64) ** 2, minlength=rows
    ).astype(np.int64)


def check_context_parallel(cp_size: int, sources: list[Any]) -> None:
    """Refuse context parallelism over sources whose segments are not all multiples of ``2 * cp_size``.

    Raises:
        OptionsError: a source is not whole documents planned with ``pad_multiple`` a multiple of
            ``2 * cp_size``; the message says how to make one.
    """
    need = 2 * cp_size
    for data in sources:
        multiple = getattr(getattr(data, "layout", None), "pad_multiple", None)
        if multiple is None or multiple % need:
            got = (
                f"pad_multiple={multiple}"
                if multiple is not None
                else f"a {type(getattr(data, 'layout', data)).__name__}, which pads no piece"
            )
            raise OptionsError(
                f"cp_size={cp_size} splits every segment of a row into 2 * cp_size = {need} chunks, so the "
                f"samples must be whole documents padded to a multiple of {need} (got {got}); use "
                f"cache.packed(seq_len, pad_multiple={need}) (or cache.documents), with seq_len a multiple "
                f"of {need}"
            )


def cp_columns(starts: np.ndarray, lengths: np.ndarray, size: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """Which of the ``size`` flat positions of a batch CP rank ``cp_rank`` takes (a ``bool`` mask), the
    batch's segments starting at ``starts`` (flat, ascending) with ``lengths``: per segment, chunks
    ``cp_rank`` and ``2*cp_size-1-cp_rank`` of its ``2 * cp_size``. Both lie in order in their segment, so
    the rank's tokens are the masked ones in flat order.

    Raises:
        ValueError: a segment's length is not a multiple of ``2 * cp_size``.
    """
    parts = 2 * cp_size
    if np.any(lengths % parts):
        bad = int(np.flatnonzero(lengths % parts)[0])
        raise ValueError(
            f"a segment of {int(lengths[bad])} tokens at flat position {int(starts[bad])} does not split "
            f"into {parts} equal chunks for cp_size={cp_size}"
        )
    chunk = lengths // parts
    # Per segment, five runs: chunks before the head, the head, between, the tail, after it.
    runs = np.stack([cp_rank * chunk, chunk, (parts - 2 - 2 * cp_rank) * chunk, chunk, cp_rank * chunk], 1)
    taken = np.tile(np.array([False, True, False, True, False]), len(lengths))
    mask = np.repeat(taken, runs.reshape(-1))
    if len(mask) != size or (len(starts) and starts[0] != 0):
        raise ValueError(f"the segments cover {len(mask)} positions of a batch of {size}")
    return mask


def split_for_cp(
    batch: dict[str, Any], starts: np.ndarray, lengths: np.ndarray, cp_size: int, cp_rank: int
) -> dict[str, Any]:
    """CP rank ``cp_rank``'s part of a dict batch of ``(rows, seq_len)`` arrays whose segments start at
    ``starts`` (flat) with ``lengths``: every array's columns of :func:`cp_columns`, ``(rows, seq_len /
    cp_size)``; ``shift_labels``, the next token's label at each of them (taken before the split, so that a
    model need not shift labels across chunk seams); ``cu_seqlens`` of the rank's own segments (each
    ``length / cp_size``) and their ``max_seqlen`` where the batch has them (also under Hugging Face's
    names)."""
    labels = batch["labels"]
    rows, columns = labels.shape
    shift = np.empty_like(labels)
    shift[:, :-1] = labels[:, 1:]
    shift[:, -1] = -100
    take = cp_columns(starts, lengths, rows * columns, cp_size, cp_rank).reshape(rows, columns)
    out = dict(batch)
    for key, value in (*batch.items(), ("shift_labels", shift)):
        if isinstance(value, np.ndarray) and value.shape == (rows, columns):
            out[key] = value[take].reshape(rows, columns // cp_size)
    local = lengths // cp_size
    cu = np.concatenate([[0], np.cumsum(local)]).astype(np.int32)
    longest = int(local.max()) if local.size else 0
    for cu_key, max_key in (
        ("cu_seqlens", "max_seqlen"),
        ("cu_seq_lens_q", "max_length_q"),
        ("cu_seq_lens_k", "max_length_k"),
    ):
        if cu_key in out:
            out[cu_key], out[max_key] = cu, longest
    return out

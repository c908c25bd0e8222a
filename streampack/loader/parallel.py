"""Long context over several GPUs: a row split over context-parallel ranks, and a global batch's rows spread
over data-parallel ranks by attention cost.

**Context parallelism** (``cp_size`` ranks share each row). Every segment of a row is a multiple of
``2 * cp_size`` long (``cache.packed(..., pad_multiple=2 * cp_size)``), cut into ``2 * cp_size`` equal
chunks, of which CP rank ``r`` takes chunks ``r`` and ``2 * cp_size - 1 - r`` (head-tail load balancing,
as TransformerEngine's THD format does): under causal attention a late chunk costs more than an early one,
so pairing them evens the work. Each token keeps its original position id and label.

**Balance** (``balance="attention"``). A global batch's rows are assigned to the data-parallel ranks so
that their attention costs (a row's: its segments' squared lengths, fills included, padding not) are even,
each rank keeping its count of rows: longest-processing-time first, rows by decreasing cost (ties by
position), each to the least loaded rank with room (ties: the lowest); each rank's rows then in position
order. It depends on the global batch and the world size alone, so a resume serves what a run would.
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from streampack.errors import OptionsError
from streampack.samples.spans import ragged_arange

__all__ = ["RankColumns", "attention_costs", "balanced_ranks", "check_context_parallel"]


def balanced_ranks(costs: np.ndarray, world_size: int) -> np.ndarray:
    """The rank of each row of a global batch of rows of ``costs``: each rank as many rows as an even split
    gives it, by longest-processing-time first (see the module docstring)."""
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
    (segments as :class:`~streampack.samples.boundaries.Boundaries` holds them)."""
    mine = docs >= 0
    return np.bincount(
        starts[mine] // columns, weights=lengths[mine].astype(np.float64) ** 2, minlength=rows
    ).astype(np.int64)


def check_context_parallel(cp_size: int, sources: list[Any]) -> None:
    """Refuse context parallelism over sources whose segments are not all multiples of ``2 * cp_size``."""
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


class RankColumns:
    """The columns of a batch that CP rank ``cp_rank`` of ``cp_size`` takes, in the forms a dict batch holds.

    Per segment of the batch (flat ``starts``, ascending from 0, with ``lengths``), chunks ``cp_rank`` and
    ``2*cp_size-1-cp_rank`` of its ``2 * cp_size``, found from the segments alone, at the rank's size.

    Attributes:
        flat: ``int64``, the flat positions taken, ascending.
        position_ids: ``int64``, ``(rows, seq_len / cp_size)``: each taken token's position in its segment.
        cu_seqlens: ``int32``, the rank's own segments (each ``length / cp_size``), cumulated from 0.
        max_seqlen: the longest of them.

    Raises:
        ValueError: a segment's length is not a multiple of ``2 * cp_size``, or the segments do not cover
            the batch from its start.
    """

    def __init__(
        self, starts: np.ndarray, lengths: np.ndarray, shape: tuple[int, int], cp_size: int, cp_rank: int
    ) -> None:
        parts = 2 * cp_size
        if (lengths % parts).any():
            bad = int(np.flatnonzero(lengths % parts)[0])
            raise ValueError(
                f"a segment of {int(lengths[bad])} tokens at flat position {int(starts[bad])} does not "
                f"split into {parts} equal chunks for cp_size={cp_size}"
            )
        if len(starts) and starts[0] != 0:
            raise ValueError(f"the segments start at flat position {int(starts[0])}, not 0")
        self.shape = (shape[0], shape[1] // cp_size)
        chunk = lengths // parts
        counts = np.repeat(chunk, 2)  # two runs a segment: its head chunk, then its tail chunk
        heads = counts * np.resize(np.array([cp_rank, parts - 1 - cp_rank]), len(counts))
        self._ends = np.cumsum(counts) - 1  # each run's last token, in the rank's order
        self.position_ids = ragged_arange(heads, counts).reshape(self.shape)
        self.flat = ragged_arange(np.repeat(starts, 2) + heads, counts)
        local = lengths // cp_size
        self.cu_seqlens = np.concatenate([[0], np.cumsum(local)]).astype(np.int32)
        self.max_seqlen = int(local.max()) if local.size else 0

    def take(self, array: np.ndarray) -> np.ndarray:
        """The rank's part of a ``(rows, seq_len)`` array: ``(rows, seq_len / cp_size)``, in its dtype."""
        return np.take(array.reshape(-1), self.flat).reshape(self.shape)

    def shifted(self, labels: np.ndarray, mine: np.ndarray) -> np.ndarray:
        """``shift_labels`` of a batch's whole-row ``labels``, of which ``mine`` is :meth:`take`'s part: at
        each taken token, the label of the next token of its row, ``-100`` after the row's last."""
        shift = np.empty_like(mine)
        flat, out = mine.reshape(-1), shift.reshape(-1)
        out[:-1] = flat[1:]  # inside a run, the next token is the rank's next
        if out.size:  # at a run's end, the row's next token, if any
            after = self.flat[self._ends] + 1
            row_end = after % labels.shape[1] == 0
            out[self._ends] = np.where(row_end, -100, labels.reshape(-1)[np.where(row_end, 0, after)])
        return shift

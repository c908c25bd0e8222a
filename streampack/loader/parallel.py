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
from typing import TYPE_CHECKING, Any

import numpy as np

from streampack.errors import OptionsError
from streampack.samples.compiled import compiled
from streampack.samples.spans import ragged_arange

if TYPE_CHECKING:
    from streampack.samples.boundaries import Boundaries

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
    """The fields of a dict batch that CP rank ``cp_rank`` of ``cp_size`` serves, at its size.

    Per segment of the batch (its :class:`~streampack.samples.boundaries.Boundaries`), chunks ``cp_rank``
    and ``2*cp_size-1-cp_rank`` of its ``2 * cp_size``; each token keeps its label and position id.

    Attributes:
        input_ids: the tokens taken, ``(rows, seq_len / cp_size)``, in the tokens' dtype.
        labels: ``int64``, of the same shape: the whole rows' labels (``Boundaries.labels``) taken.
        shift_labels: ``int64``: at each token taken, the whole row's label of the next token, ``-100``
            after the row's last.
        position_ids: ``int64``: each token's position in its segment.
        cu_seqlens: ``int32``, the rank's own segments (each ``length / cp_size``), cumulated from 0.
        max_seqlen: the longest of them.

    Args:
        tokens: the batch's ``(rows, seq_len)`` tokens.
        found: their boundaries.
        off: per segment of ``found``, whether it has no target (``Boundaries.labels``); None: none.
        cp_size: context-parallel ranks.
        cp_rank: this one.

    Raises:
        ValueError: a segment's length is not a multiple of ``2 * cp_size``, or the segments do not cover
            the batch from its start.
    """

    def __init__(
        self, tokens: np.ndarray, found: Boundaries, off: np.ndarray | None, cp_size: int, cp_rank: int
    ) -> None:
        starts, lengths, parts = found.starts, found.lengths, 2 * cp_size
        if (lengths % parts).any():
            bad = int(np.flatnonzero(lengths % parts)[0])
            raise ValueError(
                f"a segment of {int(lengths[bad])} tokens at flat position {int(starts[bad])} does not "
                f"split into {parts} equal chunks for cp_size={cp_size}"
            )
        if len(starts) and starts[0] != 0:
            raise ValueError(f"the segments start at flat position {int(starts[0])}, not 0")
        shape = (tokens.shape[0], tokens.shape[1] // cp_size)
        loop = _rank_loop()
        fields = (
            _numpy_fields(tokens, found, off, cp_size, cp_rank)
            if loop is None
            else _compiled_fields(loop, tokens, found, off, cp_size, cp_rank)
        )
        self.input_ids, self.labels, self.shift_labels, self.position_ids = (a.reshape(shape) for a in fields)
        local = lengths // cp_size
        self.cu_seqlens = np.concatenate([[0], np.cumsum(local)]).astype(np.int32)
        self.max_seqlen = int(local.max()) if local.size else 0


def _numpy_fields(
    tokens: np.ndarray, found: Boundaries, off: np.ndarray | None, cp_size: int, cp_rank: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:class:`RankColumns`' fields, flat, from the whole rows' labels: the reference of the compiled loop."""
    parts = 2 * cp_size
    chunk = found.lengths // parts
    # The rank's flat positions ascend: each segment is five runs, skip r chunks, take one, skip
    # 2*cp-2-2r, take one, skip r.
    runs = chunk[:, None] * np.array([cp_rank, 1, parts - 2 - 2 * cp_rank, 1, cp_rank])
    mine = np.repeat(np.resize([False, True, False, True, False], runs.size), runs.reshape(-1))
    labels = found.labels(tokens, off).reshape(-1)
    # The next token's label: past a row's end, the next row's start, whose label is -100; past the batch's,
    # -100.
    shift = np.append(labels, -100)[1:][mine]
    counts = np.repeat(chunk, 2)  # two runs a segment: its head chunk, then its tail chunk
    heads = counts * np.resize(np.array([cp_rank, parts - 1 - cp_rank]), len(counts))
    return tokens.reshape(-1)[mine], labels[mine], shift, ragged_arange(heads, counts)


def _compiled_fields(
    loop: Any, tokens: np.ndarray, found: Boundaries, off: np.ndarray | None, cp_size: int, cp_rank: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:class:`RankColumns`' fields, flat, filled by ``loop`` from each segment's targets, in one pass."""
    starts, lengths = found.starts, found.lengths
    targets = np.where(found.docs < 0, 0, lengths)  # per segment, its positions before this may be targets
    if off is not None:
        targets[off] = 0
    if found.fills is not None:  # a fill ends its segment
        at = np.searchsorted(starts, found.fills[:, 0], side="right") - 1
        targets[at] = np.minimum(targets[at], found.fills[:, 0] - starts[at])
    marks = np.ones(0, dtype=bool) if found.marks is None else found.marks.reshape(-1)
    size = tokens.size // cp_size
    ids, (labels, shift, positions) = np.empty(size, tokens.dtype), np.empty((3, size), np.int64)
    fields = (ids, labels, shift, positions)
    loop(tokens.reshape(-1), starts, lengths, targets, marks, 2 * cp_size, cp_rank, *fields)
    return fields


@compiled
def _rank_loop(
    tokens: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    targets: np.ndarray,
    marks: np.ndarray,
    parts: int,
    rank: int,
    input_ids: np.ndarray,
    labels: np.ndarray,
    shift: np.ndarray,
    positions: np.ndarray,
) -> None:
    """Fill the rank's ``input_ids``, ``labels``, ``shift`` (labels) and ``positions``, flat, from the
    whole rows' flat ``tokens`` and, per segment, its ``starts``, ``lengths`` and ``targets`` (its positions
    below that may be targets), with ``marks`` (empty: all) the tokens that may be."""
    out = 0
    for segment in range(starts.size):
        start, chunk, until = starts[segment], lengths[segment] // parts, targets[segment]
        for head in (rank * chunk, (parts - 1 - rank) * chunk):
            at, stop = start + head, out + chunk
            # Loops over views indexed from 0 vectorize (an index known >= 0 needs no wraparound check):
            # 34 us for cp 2 of a 32 x 2048 batch, against 210 us indexing the whole arrays.
            here, after = tokens[at : at + chunk], tokens[at + 1 : at + 1 + chunk]
            ids, label, shifted = input_ids[out:stop], labels[out:stop], shift[out:stop]
            place = positions[out:stop]
            for j in range(chunk):
                ids[j] = here[j]
                place[j] = head + j
            n = max(min(until - head, chunk), 0)  # this chunk's targets, then none
            for j in range(n):
                label[j] = here[j]
            for j in range(n, chunk):
                label[j] = -100
            if head == 0 and chunk:
                label[0] = -100  # a segment's start
            n = max(min(until - head - 1, chunk), 0)  # the next token's, inside the segment
            for j in range(n):
                shifted[j] = after[j]
            for j in range(n, chunk):
                shifted[j] = -100
            if marks.size:
                mark = marks[at : at + 1 + chunk]
                for j in range(chunk):
                    if not mark[j]:
                        label[j] = -100
                for j in range(n):
                    if not mark[j + 1]:
                        shifted[j] = -100
            out = stop

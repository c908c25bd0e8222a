"""Which documents a training step read, and the input record each came from, recomputed: nothing is logged.

A step's global batch is a pure function of the loader's order and its position: its rows are the
loader's picks there, each row's documents come from the layout's boundaries, and each document's input
record is found by reading its work unit's input again (:mod:`streampack.loader.origins`), once per unit
the batch touches. The input files must still be as they were at build time.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from streampack._checks import check_int
from streampack.loader import Loader
from streampack.loader.excluding import doc_ranges
from streampack.loader.origins import locate
from streampack.order import groups
from streampack.samples.fim import SLOTS, Moves
from streampack.samples.sequences import PackedSequences

__all__ = ["Placement", "Provenance", "excluded_steps", "position_of", "which"]


@dataclass(frozen=True)
class Placement:
    """Where some of a document's tokens sit in a step's batch, as the rank is served it (under a
    ``seq_len_schedule``, in rows of the length served at that step).

    Attributes:
        rank: the (data-parallel) rank whose batch holds the row (under ``balance="attention"``, the rank
            its attention cost assigned it to).
        row: the row in that rank's batch.
        columns: ``(start, stop)``: the columns of the row, among its ``seq_len`` input columns (under
            ``cp_size > 1``, of the whole row, before the context-parallel ranks' split; a piece's fill of
            ``pad_multiple`` is no document's).
        tokens: ``(start, stop)``: which of the document's own tokens they are (its EOS is its last); for a
            piece FIM'd, the tokens it was cut from (the sentinels take the columns of the last 3 before
            any EOS, which are not served).
        fim: empty for tokens served as they are; for a piece FIM'd (``samples.fim``), its prefix, middle
            and suffix in served order, each ``(name, columns, tokens)``: where it sits among the input
            columns and which of the document's tokens it is (:attr:`fim_order`).
    """

    rank: int
    row: int
    columns: tuple[int, int]
    tokens: tuple[int, int]
    fim: tuple[tuple[str, tuple[int, int], tuple[int, int]], ...] = ()

    @property
    def fim_order(self) -> str | None:
        """``"PSM"`` or ``"SPM"`` for a piece FIM'd, else None."""
        if not self.fim:
            return None
        return "PSM" if self.fim[0][0] == "prefix" else "SPM"


@dataclass(frozen=True)
class Provenance:
    """One document of a step's batch, and the input record it was built from.

    Attributes:
        source: the name of its source in a mixture (``"data"`` for a loader of one dataset).
        cache: the cache directory.
        doc: its global index in the cache: ``cache.doc(doc)`` holds its tokens.
        length: its tokens in the cache, EOS included.
        unit: the work unit (and shard) of the cache that holds it.
        path: the input file, ``python:TYPE`` for Python objects, or the file of another format that holds
            it.
        line: its line in the file, from 1 (JSONL, and text read one document per line); else None.
        row: its row from 0: of a Parquet file, a Python sequence, or another format's file (Megatron's
            ``IndexedDataset[row]``); else None, also for Python documents not given to :func:`which`
            whose unit left some records out.
        placements: where its tokens sit in the batch, in batch order (it may span several rows).
        excluded: None, or how an exclusion names it: ``"mask"`` (served with ``labels = -100``), or
            ``"skip from position P"`` / ``"mask from position P"`` (served before the exclusion took
            effect at ``P``).
    """

    source: str
    cache: str
    doc: int
    length: int
    unit: int
    path: str
    line: int | None
    row: int | None
    placements: tuple[Placement, ...]
    excluded: str | None = None

    @property
    def tokens(self) -> int:
        """How many of its tokens the batch holds (in the rows' input columns)."""
        return sum(stop - start for start, stop in (p.columns for p in self.placements))

    @property
    def location(self) -> str:
        """``path:line``, ``path[row]`` (``[?]``: row unknown), or the path alone for a whole file."""
        if self.line is not None:
            return f"{self.path}:{self.line}"
        if self.row is not None:
            return f"{self.path}[{self.row}]"
        return f"{self.path}[?]" if self.path.startswith("python:") else self.path


def position_of(loader: Loader, step: int | None = None, *, state: Mapping[str, Any] | None = None) -> int:
    """The global position of a step's batch (``step`` and ``state`` as for :func:`which`).

    Raises:
        OptionsError: ``step`` is not a non-negative integer.
        LoaderStateError: ``state`` does not resume over this loader's data and order.
    """
    return _view_at(loader, step, state)[1]


def which(
    loader: Loader,
    step: int | None = None,
    *,
    state: Mapping[str, Any] | None = None,
    documents: Any = None,
) -> list[Provenance]:
    """The documents of one step's global batch (the rows of every rank), each with its input record.

    Example::

        for doc in streampack.which(loader, 1200):  # what step 1200 (of a run from the start) read
            print(doc.location, doc.doc, doc.tokens)  # e.g. /data/web-07.jsonl:81234 5512 1783

    Args:
        loader: the training run's loader; it is not changed.
        step: the step, counted from the start of the run, or from the position of ``state``. Without
            either, the batch the loader serves next.
        state: a :meth:`Loader.state_dict` to count ``step`` from. Needed for a mixture whose weights
            changed on a resume: only the state's schedule describes its earlier blocks.
        documents: the Python documents a cache was built from, to find the rows of ``python:TYPE``
            inputs; for a mixture, a mapping of source name to them.

    Returns:
        One :class:`Provenance` per document, in the order of its first token in the global batch.

    Raises:
        IndexError: the run has no batch at that step.
        TypeError: a source is not ``cache.sequences(...)`` (a numpy array has no documents).
        InputError: an input file is missing or changed since the build, or ``documents`` are not the
            ones the cache was built from.
        LoaderStateError: ``state`` does not resume over this loader's data and order.
    """
    view, position = _view_at(loader, step, state)
    try:
        sources, samples = view.picks(position)
    except IndexError:
        raise IndexError(
            f"the run has no batch at position {position} (step {step or 0}"
            f"{' after the state' if state is not None else ''}): it ends at position {view.order.end}"
        ) from None
    datasets, names = _datasets(view), view.order.names
    placed = _placed(datasets, sources, samples, loader.run.batches.ranks(sources, samples))
    rows, _ = view.batch_shape(position)
    if rows != len(samples):  # served at another length than its samples (units): in the rows served
        unit, units = datasets[0].seq_len, len(samples)
        placed = {
            key: [(row, column, p) for row, column, run in runs for p in _served(run, unit, rows, units)]
            for key, runs in placed.items()
        }
    marks = _marks(view, position, list(placed))
    result = []
    for source in sorted({source for source, _ in placed}):
        seqs = datasets[source]
        docs = sorted(doc for s, doc in placed if s == source)
        given = documents.get(names[source]) if isinstance(documents, Mapping) else documents
        for doc, where in locate(seqs.cache, docs, given).items():
            runs = sorted(placed[source, doc], key=lambda run: run[:2])
            provenance = Provenance(
                source=names[source],
                cache=seqs.path,
                doc=doc,
                placements=tuple(placement for _, _, placement in runs),
                excluded=marks.get((source, doc)),
                **dataclasses.asdict(where),
            )
            result.append((runs[0][:2], provenance))
    return [provenance for _, provenance in sorted(result, key=lambda item: item[0])]


def excluded_steps(
    loader: Loader, step: int | None = None, *, state: Mapping[str, Any] | None = None
) -> list[str]:
    """In words, what the loader's exclusions do to one step's batch (``step`` and ``state`` as for
    :func:`which`): skip its positions or mask them. Empty for a step no exclusion names."""
    view, position = _view_at(loader, step, state)
    stop = position + view.options.batch_size
    notes = []
    for index, (entry, at, batch) in enumerate(view.run.in_force):
        for start, end in entry.ranges(batch):
            lo, hi = max(start, position, at), min(end, stop)
            if lo >= hi:
                continue
            if entry.mode == "mask":
                notes.append(
                    f"positions {lo:,}-{hi:,} of this step are excluded (mask) by exclusion {index}: served "
                    "with labels -100"
                )
            else:
                notes.append(
                    f"positions {lo:,}-{hi:,} are excluded (skip) by exclusion {index} from position {at:,}: "
                    "the run served them no more, and this step's batch is the one served in their place"
                )
    return notes


def _marks(view: Loader, position: int, batch: list[tuple[int, int]]) -> dict[tuple[int, int], str]:
    """``(source, doc) -> mark`` of the first exclusion that names each document of ``batch``."""
    marks: dict[tuple[int, int], str] = {}
    for entry, at, _ in view.run.in_force:
        found = view.run.found.get(entry.digest, {})
        label = entry.mode if at <= position else f"{entry.mode} from position {at}"
        for source, doc in batch:
            excluded = found.get(source)
            if excluded is not None and len(excluded):
                k = min(int(np.searchsorted(excluded, doc)), len(excluded) - 1)
                if int(excluded[k]) == doc:
                    marks.setdefault((source, doc), label)
    return marks


def _view_at(loader: Loader, step: int | None, state: Mapping[str, Any] | None) -> tuple[Loader, int]:
    """A copy of ``loader`` that reads every rank's rows, resumed from ``state`` when given, and the
    position of ``step``, counted from the state's position, else from 0 (no step: the copy's own).
    ``copy.copy`` goes through ``Loader.__getstate__``, which leaves the original's planned rows behind."""
    view = copy.copy(loader)
    view.options = dataclasses.replace(loader.options, rank=0, world_size=1)
    if state is not None:
        view.load_state_dict(state)
    if step is None:
        return view, view.position
    check_int("step", step, min=0, max=2**62)
    return view, (view.position if state is not None else 0) + int(step) * view.options.batch_size


def _datasets(view: Loader) -> list[PackedSequences]:
    parts = [source.data for source in view.sources]
    for name, part in zip(view.order.names, parts):
        if not isinstance(part, PackedSequences):
            raise TypeError(
                f"which() finds the documents of samples of a cache (cache.sequences(...)); source {name!r} "
                f"is a {type(part).__name__}, which has no documents"
            )
    return parts  # type: ignore[return-value]


def _placed(
    datasets: list[PackedSequences], sources: np.ndarray, samples: np.ndarray, ranks: np.ndarray
) -> dict[tuple[int, int], list[tuple[int, int, Placement]]]:
    """``(source, doc)`` -> the runs of its tokens in the global batch, ``(row, column, Placement)``;
    ``ranks[g]``: the rank that serves row ``g`` (its rows there in position order)."""
    within = np.zeros(len(ranks), dtype=np.int64)
    for rank in np.unique(ranks).tolist():
        mine = np.flatnonzero(ranks == rank)
        within[mine] = np.arange(len(mine))
    placed: dict[tuple[int, int], list[tuple[int, int, Placement]]] = {}
    for source, rows in groups(sources):
        for doc, row, column, placement in _placements(datasets[source], samples[rows], rows, ranks, within):
            placed.setdefault((source, doc), []).append((row, column, placement))
    return placed


def _placements(
    seqs: PackedSequences, samples: np.ndarray, rows: np.ndarray, ranks: np.ndarray, within: np.ndarray
) -> Iterator[tuple[int, int, int, Placement]]:
    """Per run of one document in a row: ``(doc, global row, column, Placement)``; ``rows`` are the samples'
    rows in the global batch, whose row ``g`` is row ``within[g]`` of rank ``ranks[g]``."""
    ids = seqs.boundaries(samples).doc_ids
    count, width = ids.shape
    first = np.ones((count, width), dtype=bool)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    r, c = np.nonzero(first)  # row by row, column by column
    flat = r * width + c
    stops = np.append(flat[1:], count * width) - r * width  # the next run's start, else the row's end
    docs = ids[r, c]
    keep = docs >= 0
    r, c, stops, docs = r[keep], c[keep], stops[keep], docs[keep]
    offsets = _token_offsets(seqs, samples, r, c, docs)
    moves = seqs.fim_moves(samples)
    fimmed = {} if moves is None else {int(at): k for k, at in enumerate(moves.first)}
    global_rows = rows[r]
    for k in range(len(docs)):
        start = int(offsets[k])
        g = int(global_rows[k])
        columns = (int(c[k]), int(stops[k]))
        tokens = (start, start + columns[1] - columns[0])
        piece = fimmed.get(int(r[k]) * seqs.width + columns[0])
        parts = () if piece is None or moves is None else _fim_parts(moves, piece, columns, start)
        yield int(docs[k]), g, columns[0], Placement(int(ranks[g]), int(within[g]), columns, tokens, parts)


def _fim_parts(
    moves: Moves, piece: int, columns: tuple[int, int], start: int
) -> tuple[tuple[str, tuple[int, int], tuple[int, int]], ...]:
    """The prefix, middle and suffix of FIM'd piece ``piece``, which starts at ``columns[0]`` with the
    document's token ``start``: ``(name, columns, tokens)`` in served order, cut to the run's ``columns``."""
    sizes = moves.size[piece]
    at = columns[0] + np.cumsum(sizes) - sizes
    slots = SLOTS["SPM" if moves.spm[piece] else "PSM"]
    parts = []
    for name, slot in sorted(slots.items(), key=lambda item: item[1]):
        hi = min(int(at[slot] + sizes[slot]), columns[1])
        lo = min(int(at[slot]), hi)
        first = start + int(moves.source[piece, slot])
        parts.append((name, (lo, hi), (first, first + hi - lo)))
    return tuple(parts)


def _served(p: Placement, unit: int, rows: int, units: int) -> Iterator[Placement]:
    """A run in one of ``units`` samples of ``unit`` tokens, as a batch of ``rows`` rows serves it
    (:mod:`streampack.loader.served`): each unit cut into ``rows / units`` sub-windows, or ``units / rows``
    units joined into one row."""
    if rows < units:  # joined: the unit is the (row % m)-th of its row (a rank's units are whole rows)
        m = units // rows
        shift = p.row % m * unit
        yield dataclasses.replace(p, row=p.row // m, columns=(p.columns[0] + shift, p.columns[1] + shift))
        return
    k = rows // units
    length = unit // k
    (start, stop), first = p.columns, p.tokens[0]
    for j in range(start // length, (stop - 1) // length + 1):  # the sub-windows the run reaches
        lo, hi = max(start, j * length), min(stop, (j + 1) * length)
        at = first + lo - start
        yield Placement(p.rank, p.row * k + j, (lo - j * length, hi - j * length), (at, at + hi - lo))


def _token_offsets(
    seqs: PackedSequences, samples: np.ndarray, r: np.ndarray, c: np.ndarray, docs: np.ndarray
) -> np.ndarray:
    """Which token of document ``docs[k]`` is at column ``c[k]`` of sample ``samples[r[k]]``."""
    cache = seqs.cache
    spans = seqs.layout.spans(samples)
    order = np.lexsort((spans.col, spans.rows))
    keys = spans.rows[order] * seqs.width + spans.col[order]
    k = order[np.searchsorted(keys, r * seqs.width + c, side="right") - 1]
    token_starts = np.asarray(cache.token_starts)
    at = token_starts[spans.shards[k]] + spans.lo[k] + (c - spans.col[k])
    return at - doc_ranges(cache, docs)[0]

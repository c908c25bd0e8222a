"""Which documents a training step read, and the input file and line each one came from; nothing logged.

A step's global batch is a pure function of the loader's order and the step's position, so it is
recomputed here rather than recorded during training:

1. **Samples**: the rows of every rank, from :meth:`Loader.picks` at the step's position.
2. **Documents**: each row's tokens mapped to documents by ``boundaries(indices).doc_ids``, and the
   document's own tokens that the row holds.
3. **Records**: a document is the ``k``-th one of its shard, which is one work unit of the build; the unit's
   input is read again with :func:`streampack.inputs.units.read_unit`, counting records as the build did
   (blank
   lines, empty documents and skipped bad records are records that make no document), up to its ``k``-th
   document. Each unit a batch touches is read once, up to its last document in the batch.

The input files must still be where and as they were at build time (their size and modification time
are checked against the manifest). Documents given as Python objects (``python:TYPE`` inputs) have no
file to read again: pass them as ``documents=``, or their row is known only in units where every record
made a document.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import re
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from streampack._checks import check_int
from streampack.errors import InputError
from streampack.inputs.discovery import discover_inputs
from streampack.inputs.inputfile import InputFile
from streampack.inputs.records import Documents, Item, ReadOptions, TextStream, WorkUnit
from streampack.inputs.units import plan_python_units, plan_units, read_unit, records_before
from streampack.loader import Loader
from streampack.order import groups
from streampack.reader import Cache
from streampack.samples.sequences import PackedSequences
from streampack.store.files import read_entry

__all__ = ["Placement", "Provenance", "position_of", "which"]


@dataclass(frozen=True)
class Placement:
    """Where some of a document's tokens sit in a step's batch.

    Attributes:
        rank: the rank whose batch holds the row.
        row: the row in that rank's batch.
        columns: ``(start, stop)``: the columns of the row, among its ``seq_len`` input columns.
        tokens: ``(start, stop)``: which of the document's own tokens they are (its EOS is its last).
    """

    rank: int
    row: int
    columns: tuple[int, int]
    tokens: tuple[int, int]


@dataclass(frozen=True)
class Provenance:
    """One document of a step's batch, and the input record it was built from.

    Attributes:
        source: the name of its source in a mixture (``"data"`` for a loader of one dataset).
        cache: the cache directory.
        doc: its global index in the cache: ``cache.doc(doc)`` holds its tokens.
        length: its tokens in the cache, EOS included.
        unit: the work unit (and shard) of the cache that holds it.
        path: the input file, or ``python:TYPE`` for documents given as Python objects; for a cache of
            another format's files (:func:`streampack.open`), the file that holds the document.
        line: its line in the file, counted from 1: JSONL, and text read one document per line; else None.
        row: its row counted from 0: of a Parquet file (``table.slice(row, 1)``), its index in a Python
            sequence, or in another format's file (Megatron's ``IndexedDataset[row]``, the ``row``-th
            document of a datatrove ``.ds``...); else None. None too for Python documents that were not
            given to :func:`which` when their unit left some records out (the row cannot be known then).
        placements: where its tokens sit in the batch, in batch order (a document may span several rows).
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

    @property
    def tokens(self) -> int:
        """How many of its tokens the batch holds (in the rows' input columns)."""
        return sum(stop - start for start, stop in (p.columns for p in self.placements))

    @property
    def location(self) -> str:
        """``path:line``, ``path[row]``, or the path alone for a whole file (``[?]``: row unknown)."""
        if self.line is not None:
            return f"{self.path}:{self.line}"
        if self.row is not None:
            return f"{self.path}[{self.row}]"
        return f"{self.path}[?]" if self.path.startswith("python:") else self.path


def position_of(loader: Loader, step: int | None = None, *, state: Mapping[str, Any] | None = None) -> int:
    """The global position of a step's batch (see :func:`which` for what ``step`` and ``state`` mean).

    Raises:
        OptionsError: ``step`` is not a non-negative integer.
        LoaderStateError: ``state`` does not resume over this loader's data and order.
    """
    return _position(_global_view(loader, state), step, state)


def which(
    loader: Loader,
    step: int | None = None,
    *,
    state: Mapping[str, Any] | None = None,
    documents: Any = None,
) -> list[Provenance]:
    """The documents of one step's global batch (the rows of every rank), each with its input record.

    Computed, not logged: the batch is a pure function of the loader's order and position, and each
    document's record is found by reading its work unit's input again (once per unit the batch touches).

    Example::

        for doc in streampack.which(loader, 1200):  # what step 1200 (of a run from the start) read
            print(doc.location, doc.doc, doc.tokens)  # e.g. /data/web-07.jsonl:81234 5512 1783

    Args:
        loader: the training run's loader (its dataset or mixture, batch size, seed, world size); it is
            not changed.
        step: the step, counted from the start of the run (its batch is at position ``step *
            batch_size``); with ``state``, counted from the state's position instead. Without either, the
            batch the loader serves next.
        state: a :meth:`Loader.state_dict`: the batch that a run resumed from it serves first (``step``
            batches later with ``step``). Needed for a mixture whose weights changed on a resume, whose
            earlier blocks only the state's schedule describes.
        documents: the Python documents a cache was built from (what was passed to ``build``), to find
            the rows of ``python:TYPE`` inputs; for a mixture, a mapping of source name to them.

    Returns:
        One :class:`Provenance` per document, in the order of its first token in the global batch
        (rank by rank, row by row).

    Raises:
        IndexError: the run has no batch at that step.
        TypeError: a source is not ``cache.sequences(...)`` (a numpy array has no documents).
        InputError: an input file is missing or changed since the build (size or modification time),
            or ``documents`` are not the ones the cache was built from.
        LoaderStateError: ``state`` does not resume over this loader's data and order.
    """
    view = _global_view(loader, state)
    position = _position(view, step, state)
    try:
        sources, samples = view.picks(position)
    except IndexError:
        raise IndexError(
            f"the run has no batch at position {position} (step {step or 0}"
            f"{' after the state' if state is not None else ''}): it ends at position {view.order.end}"
        ) from None
    datasets, names = _datasets(view), view.order.names
    placed = _placed(datasets, sources, samples, loader.options.world_size)
    result = []
    for source in sorted({source for source, _ in placed}):
        seqs = datasets[source]
        docs = sorted(doc for s, doc in placed if s == source)
        given = documents.get(names[source]) if isinstance(documents, Mapping) else documents
        for doc, where in _locate(seqs.cache, docs, given).items():
            runs = sorted(placed[source, doc], key=lambda run: run[:2])
            pieces = tuple(placement for _, _, placement in runs)
            found = (where.length, where.unit, where.path, where.line, where.row)
            result.append((runs[0][:2], Provenance(names[source], seqs.path, doc, *found, pieces)))
    return [provenance for _, provenance in sorted(result, key=lambda item: item[0])]


# --------------------------------------------------------------------------------------- the batch


def _global_view(loader: Loader, state: Mapping[str, Any] | None) -> Loader:
    """A copy of ``loader`` that reads every rank's rows, at ``state``'s position when given.

    ``copy.copy`` goes through ``Loader.__getstate__``, so no planned rows of the original (its own rank's)
    are carried over; the original loader is left as it was.
    """
    view = copy.copy(loader)
    view.options = dataclasses.replace(loader.options, rank=0, world_size=1, output="numpy")
    if state is not None:
        view.load_state_dict(state)
    return view


def _position(view: Loader, step: int | None, state: Mapping[str, Any] | None) -> int:
    """The position of ``step``: from the state's position (``view`` resumed from it), else from 0."""
    if step is None:
        return view.position  # the state's, else the loader's own: the view is a copy of it
    check_int("step", step, min=0, max=2**62)
    return (view.position if state is not None else 0) + int(step) * view.options.batch_size


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
    datasets: list[PackedSequences], sources: np.ndarray, samples: np.ndarray, world: int
) -> dict[tuple[int, int], list[tuple[int, int, Placement]]]:
    """``(source, doc)`` -> the runs of its tokens in the global batch: ``(row, column, Placement)``."""
    placed: dict[tuple[int, int], list[tuple[int, int, Placement]]] = {}
    for source, rows in groups(sources):
        for doc, row, column, placement in _placements(
            datasets[source], samples[rows], rows, len(samples), world
        ):
            placed.setdefault((source, doc), []).append((row, column, placement))
    return placed


def _placements(
    seqs: PackedSequences, samples: np.ndarray, rows: np.ndarray, batch: int, world: int
) -> Iterator[tuple[int, int, int, Placement]]:
    """Per run of one document in a row: ``(doc, global row, column, Placement)``.

    ``rows`` are the samples' rows in the global batch of ``batch`` rows, which rank ``r`` of ``world``
    splits as the loader does: rows ``[r * batch // world, (r + 1) * batch // world)``.
    """
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
    bounds = np.arange(world + 1) * batch // world
    global_rows = rows[r]
    ranks = np.searchsorted(bounds, global_rows, side="right") - 1
    for k in range(len(docs)):
        start = int(offsets[k])
        rank, g = int(ranks[k]), int(global_rows[k])
        columns = (int(c[k]), int(stops[k]))
        tokens = (start, start + columns[1] - columns[0])
        yield int(docs[k]), g, columns[0], Placement(rank, g - int(bounds[rank]), columns, tokens)


def _token_offsets(
    seqs: PackedSequences, samples: np.ndarray, r: np.ndarray, c: np.ndarray, docs: np.ndarray
) -> np.ndarray:
    """Which token of document ``docs[k]`` is at column ``c[k]`` of sample ``samples[r[k]]``.

    The layout's spans say which token of the stream each column holds; the offset tables, where each
    document starts in it.
    """
    cache = seqs.cache
    spans = seqs.layout.spans(samples)
    order = np.lexsort((spans.col, spans.rows))
    keys = spans.rows[order] * seqs.width + spans.col[order]
    k = order[np.searchsorted(keys, r * seqs.width + c, side="right") - 1]
    token_starts = np.asarray(cache.token_starts)
    at = token_starts[spans.shards[k]] + spans.lo[k] + (c - spans.col[k])
    return at - _doc_token_starts(cache, docs)


def _doc_token_starts(cache: Cache, docs: np.ndarray) -> np.ndarray:
    """The position in the cache's token stream of the first token of each of ``docs``."""
    shards = np.searchsorted(cache.doc_starts, docs, side="right") - 1
    starts = np.empty(len(docs), dtype=np.int64)
    for k, (doc, shard) in enumerate(zip(docs.tolist(), shards.tolist())):
        local = doc - int(cache.doc_starts[shard])
        before = int(cache.shard_offsets(shard)[local - 1]) if local else 0
        starts[k] = int(cache.token_starts[shard]) + before
    return starts


# --------------------------------------------------------------------------------------- the records


@dataclass(frozen=True)
class _Found:
    """Where a document came from (see :class:`Provenance`)."""

    unit: int
    length: int
    path: str
    line: int | None = None
    row: int | None = None


def _locate(cache: Cache, docs: list[int], documents: Any) -> dict[int, _Found]:
    """The input record of each of ``docs`` (global indices in ``cache``): one replay per unit."""
    inputs = _Inputs(cache, documents)
    doc_starts = cache.doc_starts
    shards = np.searchsorted(doc_starts, docs, side="right") - 1
    found: dict[int, _Found] = {}
    for shard, picked in groups(shards):
        info = cache.shard_info(shard)
        locals_ = [docs[i] - int(doc_starts[shard]) for i in picked.tolist()]
        offsets = cache.shard_offsets(shard)
        unit = int(info.name)
        origin = cache.files.origin(shard)
        records: dict[int, _Where]
        if origin is not None:  # another format's files: the document's index in its file
            records = {local: (origin[0], None, origin[1] + local) for local in locals_}
        else:
            records = inputs.records(unit, locals_)
        for local, (path, line, row) in records.items():
            length = int(offsets[local]) - (int(offsets[local - 1]) if local else 0)
            found[int(doc_starts[shard]) + local] = _Found(unit, length, path, line, row)
    return found


_Where = tuple[str, int | None, int | None]  # (path, line, row)
_PYTHON_ROWS = re.compile(r"\[rows (\d+):\d*\]$")


class _Inputs:
    """The work units a cache was built from, planned again from its manifest, and replayed on demand."""

    def __init__(self, cache: Cache, documents: Any) -> None:
        self.cache = cache
        manifest = cache.manifest
        settings = manifest.settings
        self.read = ReadOptions(settings.text_field, settings.split_lines, settings.unit_bytes)
        self.python = any(i.python for i in manifest.inputs)
        self.documents = documents
        self._units: list[WorkUnit] | None = None
        self._now: dict[str, InputFile] = {}

    def records(self, unit: int, wanted: list[int]) -> dict[int, _Where]:
        """``(path, line, row)`` of the records that made the documents ``wanted`` of ``unit``."""
        if self.python and self.documents is None:
            return self._python_without_documents(unit, wanted)
        work = self._plan()[unit]
        self._check_unchanged(work)
        left, found, docs = set(wanted), {}, 0
        replay = _records(work, self.read)
        try:
            for where, item in replay:
                if not _is_document(item):
                    continue
                if docs in left:
                    found[docs] = where
                    left.discard(docs)
                    if not left:
                        return found
                docs += 1
        finally:
            replay.close()  # closes the input files now, not when collected
        raise InputError(
            f"{work.describe()}: holds {docs} documents now, but the cache's unit {unit} holds more (its "
            f"document {max(left)} is asked for); the input changed since the build: rebuild the cache to "
            "trace its documents"
        )

    def _plan(self) -> list[WorkUnit]:
        if self._units is not None:
            return self._units
        manifest = self.cache.manifest
        if self.python:
            items = self.documents.items if isinstance(self.documents, Documents) else self.documents
            units = plan_python_units(items)
        else:
            units = plan_units(self._files(), self.read)
        planned = [unit.describe() for unit in units]
        if planned != manifest.units:
            at = next((i for i, (a, b) in enumerate(zip(planned, manifest.units)) if a != b), len(planned))
            differ = f"unit {at}: {_at(planned, at)} now, {_at(manifest.units, at)} in the manifest"
            fix = "; pass the documents the cache was built from" if self.python else ""
            what = "the documents given" if self.python else "its inputs"
            raise InputError(
                f"{self.cache.root}: {what} make other work units than the build did ({differ}){fix}"
            )
        self._units = units
        return units

    def _files(self) -> list[InputFile]:
        """The input files as the build saw them (its sizes plan the units), found where they were."""
        recorded = self.cache.manifest.inputs
        paths = [i.path for i in recorded]
        try:
            now = discover_inputs(paths).files
        except InputError as e:
            raise InputError(
                f"{self.cache.root}: its input files are needed to find the documents' lines: {e}"
            ) from None
        found = [file.path for file in now]
        if found != paths:  # two of them are one file now, say
            first = next(i for i, (a, b) in enumerate(itertools.zip_longest(found, paths)) if a != b)
            raise InputError(
                f"{self.cache.root}: its input {first} is {_at(paths, first)}, but that path now reads as "
                f"{_at(found, first)}; put the inputs back as they were at build time"
            )
        self._now = {file.path: file for file in now}
        return [
            dataclasses.replace(file, size=file.size if i.size is None else i.size, mtime_ns=i.mtime_ns)
            for file, i in zip(now, recorded)
        ]

    def _check_unchanged(self, unit: WorkUnit) -> None:
        for file in unit.files:
            now = self._now.get(file.path)
            if now is not None and (now.size, now.mtime_ns) != (file.size, file.mtime_ns):
                raise InputError(
                    f"{file.path}: changed since the cache was built (size {file.size} -> {now.size}, "
                    f"mtime_ns {file.mtime_ns} -> {now.mtime_ns}), so its lines may not be the cache's "
                    "documents any more; restore the file, or rebuild the cache"
                )

    def _python_without_documents(self, unit: int, wanted: list[int]) -> dict[int, _Where]:
        """Rows of Python documents not given: exact where each of the unit's records made a document."""
        described = self.cache.manifest.units[unit]
        path = described.split(" [", 1)[0]
        match = _PYTHON_ROWS.search(described)
        first = int(match.group(1)) if match else 0
        progress = read_entry(Path(self.cache.root), f"{unit:06d}", described)
        gapless = progress.records == progress.docs
        return {local: (path, None, first + local if gapless else None) for local in wanted}


def _at(units: list[str], index: int) -> str:
    return repr(units[index]) if index < len(units) else "none"


def _records(unit: WorkUnit, read: ReadOptions) -> Generator[tuple[_Where, Item], None, None]:
    """Every record of ``unit`` as the build reads it, with its ``(path, line, row)``."""
    file = unit.file
    if file is None:
        path, first = f"python:{type(unit.items).__name__}", records_before(unit)
        for i, item in enumerate(read_unit(unit, read)):
            yield (path, None, first + i), item
    elif unit.rest:  # a run of whole files, one after the other
        for one in unit.files:
            yield from _records(WorkUnit(unit.index, one), read)
    elif file.format == "text" and not read.split_lines:  # the whole file is one record
        for item in read_unit(unit, read):
            yield (file.path, None, None), item
    elif file.format == "parquet":
        first = records_before(unit)
        for i, item in enumerate(read_unit(unit, read)):
            yield (file.path, None, first + i), item
    else:  # one record per line
        first = records_before(unit)
        for i, item in enumerate(read_unit(unit, read)):
            yield (file.path, first + i + 1, None), item


def _is_document(item: Item) -> bool:
    """Whether the build made a document of this record: text that is not empty or only whitespace."""
    return isinstance(item, TextStream) or (isinstance(item, str) and bool(item) and not item.isspace())

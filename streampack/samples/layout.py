"""Which tokens make each sample: a :class:`Layout` maps sample numbers to :class:`Spans` of a token stream.

Reading spans (:func:`read_spans`) and finding their documents (:func:`boundaries`) is shared by every
layout, and importable from here too. The layouts are pure tables: :class:`FixedWindows` (the
``group_texts`` convention) and :class:`Bins` (whole documents then padding, planned by
:mod:`streampack.samples.packing`).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np

from streampack.samples.boundaries import Boundaries, boundaries
from streampack.samples.copies import BatchedSpans, read_spans, row_view
from streampack.samples.spans import Spans, ragged_arange

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
    "row_view",
    "split_windows",
]


class Layout(Protocol):
    """Which spans of a token stream form each sample: a pure function of the sample number.

    It holds only small tables, no memory maps, so it pickles with the samples that use it.
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
        """Tokens at the end of each row that also start the next sample (0 for most layouts)."""
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
    """A token stream of runs of shards' tokens laid end to end: a whole cache, or chosen documents.

    Run ``k`` is ``starts[k+1] - starts[k]`` tokens of shard ``shards[k]`` from ``offsets[k]``. A whole
    cache is one run per shard; a split, one run per stretch of consecutive chosen documents.

    Attributes:
        starts: where each run starts in the stream, then the stream's length (``int64``).
        shards: the shard each run lies in.
        offsets: each run's first token, local to its shard.
    """

    starts: np.ndarray
    shards: np.ndarray
    offsets: np.ndarray

    @classmethod
    def whole(cls, token_starts: np.ndarray) -> Runs:
        """Every shard in full: ``token_starts`` holds each shard's first token, then the total."""
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
    """Fixed-length windows of a stream: sample ``i`` is tokens ``[i*seq_len, i*seq_len + width)``; they
    cross document and shard boundaries, and only the final partial window is dropped.

    Args:
        runs: the stream.
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


@dataclass(eq=False, repr=False)
class Bins:
    """Whole documents (or pieces of long ones) laid left to right in each sample, then padding.

    Args:
        starts: ``int64``, ``samples + 1``: each sample's first piece, then the number of pieces.
        shards: the shard of each piece.
        lo: each piece's first token, local to its shard.
        lengths: each piece's length in tokens; a sample's add up to at most ``seq_len``.
        seq_len: tokens per sample.
        pad_id: the id that fills the padding.
        pad_multiple: each piece occupies its length rounded up to a multiple of this, the rest padding
            (context parallelism splits every segment into ``2 * cp_size`` chunks).
        settings: what made the plan, for the fingerprint.
        directory: where the plan's arrays are mapped from, which a pickle holds instead of the arrays;
            None when they are held in memory.
        dropped: documents the plan left out (``too_long="drop"``).
        no_target: pieces with no target token (every label ``-100``), left out with ``no_target="drop"``.
        checked: the stored plan's checksum and the identities of the files checked, so that a copy in
            another process maps the same plan without reading its files again.
    """

    overlap: ClassVar[int] = 0
    starts: np.ndarray
    shards: np.ndarray
    lo: np.ndarray
    lengths: np.ndarray
    _: KW_ONLY
    seq_len: int
    pad_id: int
    settings: dict[str, int | str]
    pad_multiple: int = 1
    directory: Path | None = None
    dropped: int = 0
    no_target: int = 0
    checked: tuple[str, tuple[tuple[int, ...], ...]] = ("", ())

    @property
    def width(self) -> int:
        """Tokens per sample row: ``seq_len``."""
        return self.seq_len

    def __getstate__(self) -> dict[str, Any]:
        """Pickle the plan's directory rather than its mapped arrays, when it has one."""
        if self.directory is None:
            return self.__dict__
        return {**self.__dict__, "starts": None, "shards": None, "lo": None, "lengths": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore the settings, and map the arrays again from the plan's directory (checked)."""
        self.__dict__.update(state)
        if self.directory is None:
            return
        from streampack.store.plans import load_plan

        checksum, identities = self.checked
        self.__dict__.update(load_plan(self.directory, checksum, identities).arrays)

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
        pieces = ragged_arange(first, counts)
        rows = np.repeat(np.arange(len(indices), dtype=np.int64), counts)
        lengths = np.asarray(self.lengths[pieces], dtype=np.int64)
        sizes = lengths if self.pad_multiple == 1 else -(-lengths // self.pad_multiple) * self.pad_multiple
        before = np.cumsum(sizes) - sizes  # columns of the batch before each piece
        heads = np.cumsum(counts) - counts  # each row's first piece (every sample has one)
        lo = np.asarray(self.lo[pieces], dtype=np.int64)
        shards = np.asarray(self.shards[pieces], dtype=np.int64)
        return Spans(rows, shards, lo, lo + lengths, before - np.repeat(before[heads], counts))

    def fingerprint(self) -> dict[str, int | str]:
        """The planner's settings, ``seq_len`` and the padding id."""
        return {**self.settings, "seq_len": self.seq_len, "pad_id": self.pad_id}


def split_windows(runs: Runs, starts: np.ndarray, width: int) -> Spans:
    """The spans of the windows ``[start, start + width)`` of a stream, cut at its run boundaries."""
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
    run = ragged_arange(first, counts)
    glo = np.maximum(starts[rows], table[run])
    ghi = np.minimum(starts[rows] + width, table[run + 1])
    keep = ghi > glo  # drop the empty runs a window steps over
    rows, run, glo, ghi = rows[keep], run[keep], glo[keep], ghi[keep]
    base = table[run] - runs.offsets[run]
    return Spans(rows, runs.shards[run], glo - base, ghi - base, glo - starts[rows])

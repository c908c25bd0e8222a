"""Exclusions applied: the samples they take out, the order that skips them, the labels they mask.

* **Samples** that touch an excluded document are found through the source's layout, O(samples) once per
  process.
* **Skip mode**: :class:`Skipping` is an :class:`~streampack.order.Order` over the loader's order: the same
  below the exclusion's position ``at``; from there on, position ``q`` is the ``(q - at)``-th position at or
  after ``at`` that is not excluded, counted lazily in chunks. A scan, not the order's inverse, is exact for
  every kind of order with nothing added to the protocol.
* **Mask mode**: :class:`Masking` gives, for a batch's document segments, those to label ``-100``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from streampack.errors import OptionsError
from streampack.loader.exclusions import ONLY, Exclusions, token_hash
from streampack.order import Order

if TYPE_CHECKING:
    from streampack.reader import Cache

__all__ = [
    "Masking",
    "Skipping",
    "doc_ranges",
    "excluded_documents",
    "excluded_samples",
    "in_keys",
    "merged",
    "reached",
    "unfiltered",
]

_SOURCE_SHIFT = 40  # key of a sample: source << 40 | sample
_CHUNK = 1 << 16  # positions counted at once
_SAMPLE_CHUNK = 1 << 16  # samples whose spans are tested at once
_KEPT = 4  # chunks whose excluded positions are kept


def _isin_sorted(values: np.ndarray, table: np.ndarray) -> np.ndarray:
    """``np.isin(values, table)`` for a sorted ``table``, by binary search."""
    if len(table) == 0:
        return np.zeros(len(values), dtype=bool)
    at = np.minimum(np.searchsorted(table, values), len(table) - 1)
    return table[at] == values


def in_keys(keys: np.ndarray, sources: np.ndarray, samples: np.ndarray) -> np.ndarray:
    """Whether each pick ``(sources[k], samples[k])`` is one of the sorted sample ``keys``."""
    return _isin_sorted((sources.astype(np.int64) << _SOURCE_SHIFT) | samples, keys)


def _in_ranges(positions: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Whether each position lies in one of the sorted, disjoint ranges ``[starts, stops)``."""
    at = np.searchsorted(starts, positions, side="right") - 1
    return (at >= 0) & (positions < stops[np.maximum(at, 0)])


def merged(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Half-open ranges merged where they overlap or touch: sorted, disjoint, none empty."""
    out: list[tuple[int, int]] = []
    for start, stop in sorted(r for r in ranges if r[1] > r[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


# --- documents -> samples ------------------------------------------------------------------------------


def _source_names(names: Sequence[str], what: dict[str, Any]) -> dict[str, Any]:
    """``what`` (by source name, ``""`` for the only source) by the loader's source names, checked."""
    out = {}
    for name, items in what.items():
        if name == ONLY:
            if len(names) != 1:
                raise OptionsError(
                    f"Exclusions names documents without a source, and this loader reads {len(names)} "
                    f"({', '.join(names)}): give documents={{source: [...]}}"
                )
            name = names[0]
        elif name not in names:
            raise OptionsError(
                f"Exclusions names documents of source {name!r}, which this loader does not read "
                f"(its sources: {', '.join(names)})"
            )
        out[name] = items
    return out


def _cache_of(data: object, name: str) -> Cache:
    cache = getattr(data, "cache", None)
    if cache is None or not hasattr(data, "layout"):
        raise OptionsError(
            f"Exclusions names documents of source {name!r}, a {type(data).__name__}, which has no cache "
            "documents (only a cache's samples do: cache.sequences/packed/documents); exclude its "
            "positions or steps instead"
        )
    return cache


def excluded_documents(
    entry: Exclusions, names: Sequence[str], datasets: Sequence[object]
) -> dict[int, np.ndarray]:
    """The documents ``entry`` names, by source id: sorted global document indices of that source's cache.

    Raises:
        OptionsError: a source it names is not read, or has no cache, or has no such document or record.
        InputError: an input file a record name reads again is missing or changed since the build.
    """
    found: dict[int, list[np.ndarray]] = {}
    for name, ids in _source_names(names, entry.document_ids()).items():
        source = names.index(name)
        cache = _cache_of(datasets[source], name)
        docs = np.asarray(ids, dtype=np.int64)
        if len(docs) and docs[-1] >= cache.num_docs and cache.manifest.complete:  # (a running build's: later)
            raise OptionsError(
                f"Exclusions names document {int(docs[-1])} of source {name!r}, whose cache has "
                f"{cache.num_docs} documents (indices 0 to {cache.num_docs - 1})"
            )
        found.setdefault(source, []).append(docs)
    for name, records in _source_names(names, entry.document_records()).items():
        from streampack.loader.origins import documents_named

        source = names.index(name)
        named = documents_named(_cache_of(datasets[source], name), records)
        found.setdefault(source, []).append(np.asarray(sorted(named.values()), dtype=np.int64))
    for name, hashes in _source_names(names, entry.document_hashes()).items():
        source = names.index(name)
        cache = _cache_of(datasets[source], name)
        wanted = set(hashes)
        hits = [i for i in range(cache.num_docs) if token_hash(cache.doc(i)) in wanted]
        found.setdefault(source, []).append(np.asarray(hits, dtype=np.int64))
    return {source: np.unique(np.concatenate(parts)) for source, parts in found.items()}


def doc_ranges(cache: Cache, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Global token ranges ``[start, stop)`` of the documents ``docs`` of ``cache``."""
    doc_starts = np.asarray(cache.doc_starts, dtype=np.int64)
    token_starts = np.asarray(cache.token_starts, dtype=np.int64)
    shards = np.searchsorted(doc_starts, docs, side="right") - 1
    starts = np.empty(len(docs), dtype=np.int64)
    stops = np.empty(len(docs), dtype=np.int64)
    for shard in np.unique(shards).tolist():
        mine = np.flatnonzero(shards == shard)
        ends = np.asarray(cache.shard_offsets(shard), dtype=np.int64)
        local = docs[mine] - doc_starts[shard]
        stops[mine] = token_starts[shard] + ends[local]
        starts[mine] = token_starts[shard] + np.where(local > 0, ends[np.maximum(local - 1, 0)], 0)
    return starts, stops


def excluded_samples(data: object, docs: np.ndarray) -> np.ndarray:
    """The samples of ``data`` (a cache's samples) that hold a token of one of ``docs``, sorted."""
    cache: Any = getattr(data, "cache")  # noqa: B009 - checked by _cache_of
    layout: Any = getattr(data, "layout")  # noqa: B009
    docs = docs[docs < cache.num_docs]  # the others, a running build has not committed: in no sample yet
    if len(docs) == 0:
        return np.zeros(0, dtype=np.int64)
    starts, stops = doc_ranges(cache, docs)
    token_starts = np.asarray(cache.token_starts, dtype=np.int64)
    hits = []
    size = len(layout)
    for first in range(0, size, _SAMPLE_CHUNK):
        samples = np.arange(first, min(first + _SAMPLE_CHUNK, size), dtype=np.int64)
        spans = layout.spans(samples)
        lo = token_starts[spans.shards] + spans.lo
        hi = token_starts[spans.shards] + spans.hi
        # The first excluded range ending after lo starts before hi: the span meets it.
        j = np.searchsorted(stops, lo, side="right")
        meets = (j < len(starts)) & (starts[np.minimum(j, len(starts) - 1)] < hi) & (hi > lo)
        hits.append(samples[np.unique(np.asarray(spans.rows)[meets])])
    return np.concatenate(hits) if hits else np.zeros(0, dtype=np.int64)


def sample_keys(by_source: Mapping[int, np.ndarray]) -> np.ndarray:
    """Sorted keys ``source << 40 | sample`` of the samples by source id."""
    parts = [(np.int64(source) << _SOURCE_SHIFT) | samples for source, samples in by_source.items()]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)


# --- skip mode: an order without the excluded positions ---------------------------------------------------


class Skipping:
    """``base`` with, from position ``at`` on, the positions of excluded samples or ranges taken out.

    Args:
        base: the order filtered (the loader's, or one filtered already by an earlier exclusion).
        at: where the exclusion takes effect.
        keys: sorted keys (``source << 40 | sample``) of the excluded samples.
        ranges: excluded positions of ``base``, as sorted disjoint ``(starts, stops)``.
    """

    def __init__(self, base: Order, at: int, keys: np.ndarray, ranges: tuple[np.ndarray, np.ndarray]) -> None:
        self.base, self.at, self.keys = base, at, keys
        self.starts, self.stops = ranges
        self.names = base.names
        self.resumes = base.resumes
        self._counts: list[int] = [0]  # good positions before each chunk counted, then in all of them
        self._prefix = np.zeros(1, dtype=np.int64)
        self._kept: dict[int, np.ndarray | None] = {}
        self._end: int | None = None
        self._ended = False  # every chunk up to base's end is counted
        # A prefetch thread maps positions ahead while the trainer's thread reads: the counts and kept
        # chunks are extended under this lock, or two threads count one chunk twice and shift every
        # position after it.
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"Skipping({self.base!r}, at={self.at}, samples={len(self.keys)}, ranges={len(self.starts)})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_kept": {}, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.RLock())

    def _good(self, chunk: int) -> np.ndarray | None:
        """The good positions of ``chunk`` (None: all of them)."""
        with self._lock:
            if chunk in self._kept:
                return self._kept[chunk]
            lo = self.at + chunk * _CHUNK
            end = self.base.end
            hi = lo + _CHUNK if end is None else min(lo + _CHUNK, end)
            positions = np.arange(lo, hi, dtype=np.int64)
            bad = np.zeros(len(positions), dtype=bool)
            if len(self.keys):
                bad |= in_keys(self.keys, *self.base(positions))
            if len(self.starts) and self.starts[0] < hi and self.stops[-1] > lo:
                bad |= _in_ranges(positions, self.starts, self.stops)
            good = None if not bad.any() else positions[~bad]
            if len(self._kept) >= _KEPT:
                self._kept.pop(next(iter(self._kept)))
            self._kept[chunk] = good
            return good

    def _count_until(self, served: int) -> None:
        """Count chunks until more than ``served`` good positions are known, or base's end."""
        end = self.base.end
        with self._lock:
            while self._counts[-1] <= served and not self._ended:
                chunk = len(self._counts) - 1
                lo = self.at + chunk * _CHUNK
                if end is not None and lo >= end:
                    self._ended = True
                    break
                good = self._good(chunk)
                size = (_CHUNK if end is None else min(_CHUNK, end - lo)) if good is None else len(good)
                self._counts.append(self._counts[-1] + size)
                if end is not None and lo + _CHUNK >= end:
                    self._ended = True
            if len(self._prefix) != len(self._counts):
                self._prefix = np.asarray(self._counts, dtype=np.int64)

    def underlying(self, positions: np.ndarray) -> np.ndarray:
        """The positions of ``base`` that ``positions`` (below :attr:`end`) serve."""
        out = np.asarray(positions, dtype=np.int64).copy()
        after = out >= self.at
        if not after.any():
            return out
        served = out[after] - self.at
        self._count_until(int(served.max()))
        chunks = np.searchsorted(self._prefix, served, side="right") - 1
        result = np.empty(len(served), dtype=np.int64)
        for chunk in np.unique(chunks).tolist():
            mine = chunks == chunk
            into = served[mine] - self._prefix[chunk]
            good = self._good(chunk)
            result[mine] = self.at + chunk * _CHUNK + into if good is None else good[into]
        out[after] = result
        return out

    def _cursor(self, position: int) -> int:
        """The position of ``base`` reached once ``position`` samples are served (skipped ones included)."""
        if position <= self.at:
            return position
        end = self.end
        if end is not None and position >= end:
            return self.base.end  # type: ignore[return-value]
        return int(self.underlying(np.asarray([position - 1]))[0]) + 1

    @property
    def end(self) -> int | None:
        """``base``'s end less the positions taken out before it (counting them all, once)."""
        base_end = self.base.end
        if base_end is None:
            return None
        if self._end is None:
            if base_end <= self.at:
                self._end = base_end
            else:
                self._count_until(base_end)
                self._end = self.at + self._counts[-1]
        return self._end

    def __call__(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``base``'s picks at the positions these serve."""
        return self.base(self.underlying(positions))

    def consumed(self, position: int) -> list[int]:
        """``base``'s cursors where ``position`` stands."""
        return self.base.consumed(self._cursor(position))

    def sizes(self) -> list[int]:
        """``base``'s."""
        return self.base.sizes()

    def weights(self, position: int) -> list[float]:
        """``base``'s weights where ``position`` stands."""
        return self.base.weights(self._cursor(position))

    def epoch_size(self, what: str) -> int:
        """``base``'s (an epoch is ``base``'s, less what was taken out of it)."""
        return self.base.epoch_size(what)

    def batches(self, batch_size: int, drop_last: bool) -> int:
        """Global batches of ``batch_size`` up to :attr:`end`."""
        from streampack.order import count_batches

        return count_batches(self.end, batch_size, drop_last)

    def fingerprint(self) -> dict[str, Any]:
        """``base``'s: what the positions mean before exclusions (a checkpoint records those beside it)."""
        return self.base.fingerprint()

    def resumed(self, saved: Mapping[str, Any], position: int) -> Order:
        """Not asked: a loader resumes its base order and filters it again."""
        raise NotImplementedError("a loader resumes the order under its exclusions, then excludes again")


def reached(order: Order, position: int) -> int:
    """Where the order under every skip exclusion of ``order`` is once ``position`` samples are served."""
    while isinstance(order, Skipping):
        position, order = order._cursor(position), order.base
    return position


def unfiltered(order: Order, position: int) -> int:
    """The position, in the order under every skip exclusion of ``order``, of the sample ``order`` serves
    at ``position``."""
    while isinstance(order, Skipping):
        end = order.end
        if end is None or position < end:
            position = int(order.underlying(np.asarray([position], dtype=np.int64))[0])
        else:
            position = order._cursor(position)
        order = order.base
    return position


# --- mask mode ---------------------------------------------------------------------------------------------


class Masking:
    """Which document segments of a batch get ``labels = -100``: those of an excluded document, and every
    segment of a row at an excluded position, from where the exclusion is in force.

    Args:
        entries: per mask exclusion, ``(at, documents by source id, (starts, stops) of excluded positions)``.
    """

    def __init__(
        self, entries: list[tuple[int, dict[int, np.ndarray], tuple[np.ndarray, np.ndarray]]]
    ) -> None:
        self.entries = entries

    def __call__(
        self, positions: np.ndarray, sources: np.ndarray, rows: np.ndarray, docs: np.ndarray
    ) -> np.ndarray:
        """Whether each segment (in row ``rows[k]``, of document ``docs[k]``) is masked; ``positions`` and
        ``sources`` are each row's global position and source id."""
        masked = np.zeros(len(rows), dtype=bool)
        row_positions = positions[rows]
        row_sources = sources[rows]
        for at, by_source, (starts, stops) in self.entries:
            active = row_positions >= at
            if not active.any():
                continue
            for source, excluded in by_source.items():
                masked |= active & (row_sources == source) & _isin_sorted(docs, excluded)
            if len(starts):
                masked |= active & _in_ranges(row_positions, starts, stops)
        return masked

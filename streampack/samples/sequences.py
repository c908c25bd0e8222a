"""The samples of a cache, in any layout, with their document boundaries.

A cache is one long stream of tokens: every document followed by its EOS, documents in input order, shards
end to end. :class:`PackedSequences` serves the samples a :mod:`~streampack.samples.layout` makes of it:

* ``cache.sequences(seq_len)``: windows of ``seq_len`` tokens (the ``group_texts`` convention): sample
  ``i`` is tokens ``[i*seq_len, i*seq_len + seq_len + overlap)``. Windows cross document and shard
  boundaries; only the final partial window is dropped, so at most ``seq_len + overlap - 1`` tokens of a
  cache are never served.
* ``cache.packed(seq_len)`` and ``cache.documents(seq_len)``: whole documents, best-fit packed or one per
  sample, then padding (planned by :mod:`streampack.samples.packing`).

Reading and document boundaries are written once over a layout's spans, in :mod:`streampack.samples.layout`.
Reading a batch is one call: each span is a slice of a memory-mapped shard copied straight into the output
array, with no per-token Python work. Document boundaries come from the shards' offset tables with
``searchsorted``, so a batch costs the same whatever the size of the cache.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from streampack._checks import check_choice, check_int
from streampack.errors import CacheError
from streampack.order import groups
from streampack.samples.chosen import Chosen
from streampack.samples.layout import (
    Bins,
    Boundaries,
    FixedWindows,
    Layout,
    Runs,
    Spans,
    boundaries,
    read_spans,
    row_view,
    split_windows,
)
from streampack.samples.packing import (
    NO_TARGET,
    TOO_LONG,
    NoTarget,
    TooLong,
    plan_again,
    plan_documents,
    plan_packed,
)
from streampack.store import CacheRef
from streampack.store.localcopy import CachedStore, on_release

if TYPE_CHECKING:
    from streampack.reader import Cache

__all__ = ["Boundaries", "PackedSequences"]

Index = int | np.integer | slice | npt.ArrayLike


class PackedSequences:
    """The samples of a cache in one layout. Create with ``cache.sequences``, ``.packed`` or ``.documents``.

    Constructed directly, it is the windows of ``cache.sequences``; :meth:`of` takes any layout.

    A data source in the small protocol loaders compose over: ``len()``, ``__getitem__`` with an int, a
    slice or an array of indices, deterministic, picklable. Pickling keeps only the cache path and the
    settings, never the memory maps: a copy sent to a DataLoader worker reopens the cache on first use.

    Example::

        seqs = cache.sequences(2048, overlap=1)
        batch = seqs[np.array([7, 3, 42])]  # (3, 2049) array of the cache dtype
        x, y = batch[:, :-1], batch[:, 1:]

    Args:
        cache: an open cache.
        seq_len: tokens per sample, at least 1.
        overlap: extra tokens at the end of each window, shared with the start of the next one; ``1`` gives
            nanoGPT-style inputs ``window[:-1]`` and next-token targets ``window[1:]``.
        chosen: the documents to lay end to end (one side of ``cache.split``); every document by default.

    Raises:
        OptionsError: (a ``ValueError``) ``seq_len`` or ``overlap`` is not an integer in its allowed range.
    """

    def __init__(self, cache: Cache, seq_len: int, *, overlap: int = 0, chosen: Chosen | None = None) -> None:
        seq_len = check_int("seq_len", seq_len, min=1, hint="tokens per sample, e.g. 2048")
        overlap = check_int("overlap", overlap, min=0, hint="usually 0, or 1 for next-token targets")
        chosen = chosen if chosen is not None else Chosen(cache)
        self._setup(cache, FixedWindows(chosen.runs(cache), seq_len, overlap, chosen.fingerprint()))

    @classmethod
    def of(cls, cache: Cache, layout: Layout) -> PackedSequences:
        """The samples of ``cache`` that ``layout`` makes (see :mod:`streampack.samples.layout`)."""
        samples = cls.__new__(cls)
        samples._setup(cache, layout)
        return samples

    def _setup(self, cache: Cache, layout: Layout) -> None:
        self._ref = cache_ref(cache)
        self._num_tokens = cache.num_tokens
        self._cache: Cache | None = cache
        self._layout = layout
        self._doc_starts = np.asarray(cache.doc_starts, dtype=np.int64)
        self._masked = cache.has_loss_mask

    def __getstate__(self) -> dict[str, Any]:
        """Pickle the cache's reference (URI and content digest), the settings and shard tables only; the
        memory maps are reopened where unpickled."""
        return {
            "cache": self._ref,
            "num_tokens": self._num_tokens,
            "layout": self._layout,
            "doc_starts": self._doc_starts,
            "masked": self._masked,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore the settings; the cache is reopened lazily, on first use."""
        self._ref = state["cache"] if "cache" in state else _ref_of_old_pickle(state)
        self._num_tokens = state["num_tokens"]
        self._layout = state["layout"]
        layout = self._layout  # unpickled before these samples: pickles are restored inner objects first
        if isinstance(layout, Bins) and layout.needs_plan and layout.directory is not None:
            # Pickled by streampack 0.1, whose plans had no checksums: made again (the same plan).
            layout.restore(plan_again(layout.directory, layout.seq_len, layout.settings, layout.pad_id))
        self._doc_starts = state["doc_starts"]
        self._masked = state.get("masked", False)
        self._cache = None

    @property
    def cache(self) -> Cache:
        """The cache the samples are read from (reopened from its URI after unpickling)."""
        return self._cache if self._cache is not None else self._reopen()

    def _reopen(self) -> Cache:
        cache = reopen_unchanged(self._ref, "these samples")
        # The shard tables kept from before describe this cache: the digest covers them.
        self._cache = cache
        return cache

    @property
    def layout(self) -> Layout:
        """Which spans of the cache's token stream make each sample."""
        return self._layout

    @property
    def seq_len(self) -> int:
        """Tokens per sample, without the overlap."""
        return self._layout.seq_len

    @property
    def overlap(self) -> int:
        """Extra tokens at the end of each window, shared with the start of the next one."""
        return self._layout.overlap

    @property
    def pad_id(self) -> int | None:
        """The id that fills padding (samples of whole documents), or None (windows have none)."""
        return self._layout.pad_id

    @property
    def path(self) -> str:
        """Absolute path of the cache directory."""
        return self._ref.local_path

    @property
    def cache_ref(self) -> CacheRef:
        """What names the cache wherever these samples are unpickled: its URI and content digest."""
        return self._ref

    @property
    def dtype(self) -> np.dtype:
        """Token dtype of the cache, which ``__getitem__`` returns (cast on the caller's side)."""
        return self.cache.dtype

    @property
    def width(self) -> int:
        """Tokens per returned window: ``seq_len + overlap``."""
        return self._layout.width

    def __len__(self) -> int:
        """Number of complete windows in the stream."""
        return len(self._layout)

    def __repr__(self) -> str:
        counts = ""
        if isinstance(self._layout, Bins):  # whole documents: what the plan left out or serves untrained
            counts = f", dropped={self._layout.dropped}, no_target={self._layout.no_target}"
        return (
            f"PackedSequences({self.path!r}, seq_len={self.seq_len}, overlap={self.overlap}, "
            f"samples={len(self)}, tokens={self._num_tokens}{counts})"
        )

    def fingerprint(self) -> dict[str, int | str]:
        """What identifies these samples, for checking a loader checkpoint against them (JSON-able).

        ``shards`` digests the manifest's shard table (names, sizes, checksums): a cache rebuilt from
        other data is told apart even at the same size, while a copy of the cache elsewhere is not.
        """
        return {
            "num_samples": len(self),
            "num_tokens": self._num_tokens,
            "shards": self._ref.content,
            **self._layout.fingerprint(),
        }

    def __getitem__(self, index: Index) -> np.ndarray:
        """Return the window(s) at ``index``, as a new array of the cache dtype.

        Args:
            index: a sample number (negative counts from the end), a slice, or an integer array of any
                shape.

        Returns:
            Shape ``(seq_len + overlap,)`` for an int; ``index.shape + (seq_len + overlap,)`` otherwise.

        Raises:
            IndexError: an index is outside ``[-len, len)``.
            TypeError: ``index`` is not an integer, a slice or an integer array.
        """
        indices, shape = self._indices(index)
        out = np.empty((indices.size, self.width), dtype=self.dtype)
        self._read(indices, out)
        return out.reshape(*shape, self.width)

    def read(
        self, indices: npt.ArrayLike, *, out: np.ndarray | None = None, rows: npt.ArrayLike | None = None
    ) -> np.ndarray:
        """Read a batch of windows into ``out``, casting while copying (one pass, no temporary).

        Args:
            indices: 1-D integer array of sample numbers.
            out: destination of shape ``(len(indices), seq_len + overlap)`` and an integer dtype that
                holds every id of the cache dtype (``np.can_cast(seqs.dtype, out.dtype, "safe")``: int32
                or int64 for a uint16 cache, not int16); a new array of the cache dtype when omitted.
            rows: write window ``k`` into row ``rows[k]`` of ``out`` (which may then have more rows),
                e.g. this source's rows of a batch mixed from several; rows ``0, 1, ...`` when omitted.

        Returns:
            ``out``.

        Raises:
            IndexError: an index is out of range.
            TypeError: ``out`` is not a numpy array.
            ValueError: ``indices`` is not 1-D, or ``out`` has the wrong shape or a dtype that cannot hold
                every token id (a narrower or non-integer one, which would wrap or round ids silently).
        """
        flat, shape = self._indices(indices)
        if len(shape) != 1:
            raise ValueError(f"read() takes a 1-D array of indices (got shape {shape})")
        targets = None if rows is None else self._rows(rows, flat.size, out)
        if out is None:
            out = np.empty((flat.size, self.width), dtype=self.dtype)
        else:
            self._check_out(out, flat.size if targets is None else None)
        self._read(flat, out, targets)
        return out

    @staticmethod
    def _rows(rows: npt.ArrayLike, count: int, out: np.ndarray | None) -> np.ndarray:
        targets = np.asarray(rows)
        if out is None or targets.shape != (count,) or not np.issubdtype(targets.dtype, np.integer):
            raise ValueError(
                f"rows= needs an out= array and one integer row per index (got {count} indices and rows of "
                f"shape {targets.shape}, dtype {targets.dtype})"
            )
        if count and not 0 <= int(targets.min()) <= int(targets.max()) < len(out):
            raise IndexError(f"rows must be in [0, {len(out)}), the rows of out")
        return targets.astype(np.int64, copy=False)

    def _check_out(self, out: object, rows: int | None) -> None:
        if not isinstance(out, np.ndarray):
            raise TypeError(f"out must be a numpy array (got {type(out).__name__})")
        if not holds_every_id(self.dtype, out.dtype):
            raise ValueError(
                f"out has dtype {out.dtype}, which cannot hold every id of the cache's {self.dtype} tokens "
                f"(they would be silently changed); use {self.dtype} or a wider integer type such as int64"
            )
        if out.ndim != 2 or out.shape[1] != self.width or (rows is not None and out.shape[0] != rows):
            need = f"{(rows, self.width)}" if rows is not None else f"(rows, {self.width})"
            raise ValueError(f"out has shape {out.shape}, but windows of {self.width} tokens need {need}")

    def boundaries(self, index: Index) -> Boundaries:
        """Document boundaries of the samples at ``index``: position ids, document ids, ``cu_seqlens``.

        Computed from the offset tables of the shards the windows touch (two ``searchsorted`` calls per
        shard in the batch); no token is read.

        Args:
            index: as for ``__getitem__``.

        Returns:
            A :class:`Boundaries` whose arrays have shape ``index_shape + (seq_len,)``.
        """
        indices, shape = self._indices(index)
        found = boundaries(
            self._layout.spans(indices),
            indices.size,
            self.seq_len,
            self._offsets,
            self._doc_starts,
            self._loss_mask if self._masked else None,
        )
        return found.reshaped((*shape, self.seq_len))

    def _indices(self, index: Index) -> tuple[np.ndarray, tuple[int, ...]]:
        """Normalize ``index`` to a flat int64 array of in-range sample numbers, and its shape."""
        n = len(self)
        if isinstance(index, slice):
            return np.arange(*index.indices(n), dtype=np.int64), (len(range(*index.indices(n))),)
        if isinstance(index, numbers.Integral) and not isinstance(index, bool):
            value = int(index)
            if not -n <= value < n:
                raise IndexError(f"sample {value} out of range for {n} samples (allowed: -{n} <= i < {n})")
            return np.array([value % n], dtype=np.int64), ()
        array = np.asarray(index)
        if array.dtype == np.bool_ or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
            raise TypeError(
                f"sample index must be an int, a slice or an integer array (got {type(index).__name__} "
                f"of dtype {array.dtype})"
            )
        low = high = 0
        if array.size:
            # Checked in the array's own dtype, before the cast: uint64 values >= 2**63 would wrap to
            # negative int64s, which count from the end.
            low, high = int(array.min()), int(array.max())
            if low < -n or high >= n:
                bad = low if low < -n else high
                raise IndexError(f"sample {bad} out of range for {n} samples (allowed: -{n} <= i < {n})")
        flat = array.astype(np.int64).reshape(-1)
        if low < 0:
            flat = np.where(flat < 0, flat + n, flat)
        return flat, array.shape

    def _read(self, indices: np.ndarray, out: np.ndarray, rows: np.ndarray | None = None) -> None:
        pad = self._layout.pad_id
        if pad is not None:
            if rows is None:
                out[...] = pad
            else:
                out[rows] = pad
        read_spans(self._layout.spans(indices), out, self._tokens, rows)

    def _tokens(self, shard: int) -> np.ndarray:
        return self.cache.shard_tokens(shard)

    def _offsets(self, shard: int) -> np.ndarray:
        return self.cache.shard_offsets(shard)

    def _loss_mask(self, shard: int) -> np.ndarray:
        return self.cache.shard_loss_mask(shard)


# Shard maps a JoinedSequences keeps at hand (each holds a file descriptor while kept).
_RECENT_MAPS = 16


class JoinedSequences:
    """Several :class:`PackedSequences` of one width read as one token space: one split, one copy loop.

    A mixture's batch holds rows of several caches; reading each cache's rows with its own call would pay
    every call's fixed cost once per source. Here the shard tables are laid end to end, so a batch is split
    into pieces and copied in one pass whatever the number of sources. Windows never cross from one cache
    into the next: a cache's last window ends inside its own tokens.

    Args:
        parts: the sources, in source-id order; all of one ``width`` (each with its own layout and
            ``seq_len``: ``seq_len + overlap`` may be the same width cut at another stride).
    """

    def __init__(self, parts: Sequence[PackedSequences]) -> None:
        self.parts = list(parts)
        self.width = parts[0].width
        self._seq_lens = np.array([part.seq_len for part in self.parts], dtype=np.int64)
        self._windows = all(isinstance(part.layout, FixedWindows) for part in self.parts)
        pads = [part.pad_id for part in self.parts]
        self._pads = None if all(pad is None for pad in pads) else np.array([pad or 0 for pad in pads])
        self._runs: Runs | None = None
        self._recent: dict[int, np.ndarray] = {}
        self._views: dict[int, np.ndarray] = {}

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_runs": None, "_recent": {}, "_views": {}}

    def _join(self) -> Runs:
        runs: list[Runs] = []
        owners: list[tuple[int, int]] = []
        tokens = 0
        self._shard_bases = np.zeros(len(self.parts), dtype=np.int64)
        self._token_bases = np.zeros(len(self.parts), dtype=np.int64)
        for j, part in enumerate(self.parts):
            shards = part.cache.num_shards
            self._shard_bases[j], self._token_bases[j] = len(owners), tokens
            if isinstance(part.layout, FixedWindows):
                runs.append(part.layout.runs.shifted(tokens, len(owners)))
                tokens += part.layout.runs.total
            owners += [(j, shard) for shard in range(shards)]
        self._owners = owners
        if any(isinstance(part.cache.store, CachedStore) for part in self.parts):
            on_release(self.forget_maps)  # a bounded local copy cannot evict the maps kept here
        self._runs = Runs(
            np.concatenate([np.zeros(1, dtype=np.int64)] + [r.starts[1:] for r in runs]),
            np.concatenate([r.shards for r in runs]) if runs else np.zeros(0, dtype=np.int64),
            np.concatenate([r.offsets for r in runs]) if runs else np.zeros(0, dtype=np.int64),
        )
        return self._runs

    def owner(self, shard: int) -> tuple[int, int]:
        """``(part, shard of that part)`` of shard ``shard`` of the joined stream."""
        if self._runs is None:
            self._join()
        return self._owners[shard]

    def forget_maps(self) -> None:
        """Forget the shard maps kept at hand (they close once no caller holds them)."""
        self._recent, self._views = {}, {}  # new dicts: another thread may be in the middle of a lookup

    def spans(self, sources: np.ndarray, samples: np.ndarray) -> Spans:
        """The spans of sample ``samples[k]`` of source ``sources[k]`` in row ``k`` (indices checked)."""
        runs = self._runs if self._runs is not None else self._join()
        if self._windows:
            starts = self._token_bases[sources] + samples * self._seq_lens[sources]
            return split_windows(runs, starts, self.width)
        found = []
        for source, rows in groups(sources):
            spans = self.parts[source].layout.spans(samples[rows])
            found.append(
                replace(spans, rows=rows[spans.rows], shards=spans.shards + self._shard_bases[source])
            )
        return Spans(
            *(np.concatenate([getattr(s, name) for s in found]) for name in Spans.__dataclass_fields__)
        )

    def pads_of(self, sources: np.ndarray) -> np.ndarray | None:
        """The padding id of each row's source, when some source pads; else None."""
        return None if self._pads is None else self._pads[sources]

    def pad(self, sources: np.ndarray, out: np.ndarray) -> None:
        """Fill the rows of sources whose samples have padding with their padding id (before reading)."""
        if self._pads is not None:
            out[...] = self._pads[sources][:, None]

    def read(self, sources: np.ndarray, samples: np.ndarray, out: np.ndarray) -> None:
        """Write sample ``samples[k]`` of source ``sources[k]`` into ``out[k]`` (indices already checked)."""
        self.pad(sources, out)
        read_spans(self.spans(sources, samples), out, self.tokens)

    def rows(self, shard: int) -> np.ndarray:
        """The :func:`~streampack.samples.layout.row_view` of shard ``shard``, for windows of ``width``
        tokens."""
        view = self._views.get(shard)
        if view is None:
            view = row_view(self.tokens(shard), self.width)
            if len(self._views) >= _RECENT_MAPS:
                self._views.pop(next(iter(self._views)))
            self._views[shard] = view
        return view

    def tokens(self, shard: int) -> np.ndarray:
        """The tokens of shard ``shard`` of the joined stream.

        The last few maps are kept here: a mixed batch touches a shard of every source, and each cache's
        own lookup has LRU bookkeeping to pay. A few more open maps keep descriptors bounded.
        """
        if self._runs is None:
            self._join()
        tokens = self._recent.get(shard)
        if tokens is None:
            part, local = self._owners[shard]
            tokens = self.parts[part]._tokens(local)
            if len(self._recent) >= _RECENT_MAPS:
                self._recent.pop(next(iter(self._recent)))
            self._recent[shard] = tokens
        return tokens


def whole_documents(
    cache: Cache,
    chosen: Chosen,
    kind: str,
    seq_len: int,
    too_long: TooLong,
    pad_id: int | None,
    no_target: NoTarget = "keep",
) -> PackedSequences:
    """Samples of whole documents: ``kind`` ``"packed"`` (best-fit) or ``"documents"`` (one per sample).

    Raises:
        OptionsError: ``seq_len`` is not a positive integer, ``too_long`` or ``no_target`` is not a policy,
            or ``pad_id`` does not fit the cache's token dtype.
    """
    seq_len = check_int("seq_len", seq_len, min=1, hint="tokens per sample, e.g. 2048")
    check_choice("too_long", too_long, TOO_LONG)
    check_choice("no_target", no_target, NO_TARGET)
    if pad_id is None:
        pad_id = cache.eos_id if cache.eos_id is not None else 0
    below = int(np.iinfo(cache.dtype).max) + 1
    pad_id = check_int(
        "pad_id", pad_id, min=0, below=below, hint=f"an id of the cache's {cache.dtype} tokens"
    )
    plan = plan_packed if kind == "packed" else plan_documents
    layout = plan(
        cache,
        chosen,
        seq_len,
        too_long=too_long,
        pad_id=pad_id,
        content=content_digest(cache),
        no_target=no_target,
    )
    return PackedSequences.of(cache, layout)


@functools.lru_cache(maxsize=64)
def holds_every_id(tokens: np.dtype, out: np.dtype) -> bool:
    """Whether ``out`` is an integer dtype that holds every value of ``tokens`` (memoised: once per read)."""
    return out.kind in "iu" and bool(np.can_cast(tokens, out, "safe"))


def reopen_unchanged(ref: CacheRef, what: str) -> Cache:
    """Reopen the cache ``ref`` names (in another process), refusing it if its shards changed since.

    Args:
        ref: the cache's URI, whether its build had finished, and the :func:`content_digest` taken when
            ``what`` were made.
        what: what was made from the cache, for the message (``"these samples"``).

    Raises:
        CacheError: the cache cannot be opened, or its shard table is not the one ``ref`` digests.
    """
    from streampack.reader import open as open_cache

    cache = open_cache(ref.uri, allow_incomplete=ref.allow_incomplete, **(ref.reading or {}))
    now = content_digest(cache)
    if now != ref.content and ref.content != cache.version_1_digest:  # pickled before format version 2
        raise CacheError(
            f"{cache.store.describe('')}: the cache changed on disk since {what} were made from it (it now "
            f"holds {cache.num_docs} documents, {cache.num_tokens} tokens; shard table {now}, was "
            f"{ref.content}), so their indices no longer mean the same tokens. Make {what} again from the "
            "reopened cache (and restart the loader)."
        )
    return cache


def cache_ref(cache: Cache) -> CacheRef:
    """The reference that picklable views of ``cache`` carry (see :class:`~streampack.store.CacheRef`)."""
    store = cache.store
    reading = store.reopen_options() if isinstance(store, CachedStore) else None
    return CacheRef(store.uri, content_digest(cache), not cache.manifest.complete, reading)


def with_current_digests(order: Mapping[str, Any], datasets: Sequence[object]) -> Mapping[str, Any]:
    """A checkpoint's order with each data fingerprint saved by streampack before format version 2 (whose
    ``shards`` digest was :attr:`~streampack.reader.Cache.version_1_digest`) given the current digest.

    Only a fingerprint equal to one of ``datasets``' in everything but ``shards`` is looked at, so the old
    digest is computed only when such a checkpoint is loaded.
    """
    samples = [data for data in datasets if isinstance(data, PackedSequences)]

    def current(saved: Any) -> Any:
        if not isinstance(saved, Mapping):
            return saved
        for data in samples:
            mine = data.fingerprint()
            digest = mine["shards"]
            same_but_digest = saved.get("shards") != digest and {**saved, "shards": digest} == mine
            if same_but_digest and saved["shards"] == data.cache.version_1_digest:
                return mine
        return saved

    upgraded = dict(order)
    if "data" in upgraded:
        upgraded["data"] = current(upgraded["data"])
    sources = upgraded.get("sources")
    if isinstance(sources, Mapping):
        upgraded["sources"] = {
            name: {**source, "data": current(source["data"])}
            if isinstance(source, Mapping) and "data" in source
            else source
            for name, source in sources.items()
        }
    return upgraded


def content_digest(cache: Cache) -> str:
    """A short digest of the shard table: :attr:`streampack.reader.Cache.content_digest`."""
    return cache.content_digest


def _ref_of_old_pickle(state: dict[str, Any]) -> CacheRef:
    """The reference of samples pickled before :class:`CacheRef` (an absolute path, the digest)."""
    return CacheRef(Path(state["path"]).as_uri(), state["content"], state["allow_incomplete"])

"""The samples of a cache in any layout (:class:`PackedSequences`), with their document boundaries.

A batch is read span by span from the memory-mapped shards straight into the output, and its boundaries
come from the offset tables, so a batch costs the same whatever the size of the cache.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from streampack._checks import check_int
from streampack.order import groups, kept
from streampack.samples.batches import Index, check_out, sample_indices, target_rows
from streampack.samples.boundaries import Boundaries, boundaries
from streampack.samples.chosen import Chosen
from streampack.samples.copies import read_spans, row_view
from streampack.samples.fim import Fim, Moves, fim_moves, make_fim
from streampack.samples.layout import Bins, FixedWindows, Layout, Runs, split_windows
from streampack.samples.refs import cache_ref, reopen_unchanged
from streampack.samples.spans import Spans
from streampack.store import CacheRef

if TYPE_CHECKING:
    from streampack.reader import Cache

__all__ = ["JoinedSequences", "PackedSequences", "with_current_digests"]

# What a pickle of PackedSequences holds: its key -> the attribute.
_PICKLED = {
    "cache": "_ref",
    "num_tokens": "_num_tokens",
    "layout": "_layout",
    "doc_starts": "_doc_starts",
    "masked": "_masked",
    "fim": "_fim",
}


class PackedSequences:
    """The samples of a cache in one layout. Create with ``cache.sequences``, ``.packed`` or ``.documents``.

    A data source: ``len()``, and ``[index]`` with an int, a slice or an array of indices. A pickle holds
    the cache's reference and the settings, not the memory maps: a copy sent to a DataLoader worker
    reopens the cache on first use. Constructed directly, it is the windows of ``cache.sequences``;
    :meth:`of` takes any layout.

    Example::

        seqs = cache.sequences(2048, overlap=1)
        batch = seqs[np.array([7, 3, 42])]  # (3, 2049) array of the cache dtype
        x, y = batch[:, :-1], batch[:, 1:]

    Args:
        cache: an open cache.
        seq_len: tokens per sample, at least 1.
        overlap: extra tokens at the end of each window, shared with the start of the next one; ``1`` gives
            inputs ``window[:-1]`` and next-token targets ``window[1:]``.
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
        self._fim: Fim | None = None

    def __getstate__(self) -> dict[str, Any]:
        """The cache's reference, the settings and the shard tables: no memory map."""
        return {key: getattr(self, attribute) for key, attribute in _PICKLED.items()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore the settings; the cache is reopened on first use."""
        for key, attribute in _PICKLED.items():
            setattr(self, attribute, state[key])
        self._cache = None

    @property
    def cache(self) -> Cache:
        """The cache the samples are read from (reopened from its URI after unpickling)."""
        if self._cache is None:
            # The shard tables kept from before describe this cache: the digest covers them.
            self._cache = reopen_unchanged(self._ref, "these samples")
        return self._cache

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
        """Token dtype of the cache, which ``__getitem__`` returns."""
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
        if self._fim is not None:
            counts += f", fim={self._fim.fingerprint()!r}"
        return (
            f"PackedSequences({self.path!r}, seq_len={self.seq_len}, overlap={self.overlap}, "
            f"samples={len(self)}, tokens={self._num_tokens}{counts})"
        )

    def fingerprint(self) -> dict[str, int | str]:
        """What identifies these samples, JSON-able: a loader checkpoint is checked against it.

        ``shards`` digests the shard table: a cache rebuilt from other data differs even at the same size,
        while a copy of the cache elsewhere does not.
        """
        fim = {} if self._fim is None else {"fim": self._fim.fingerprint()}
        return {
            "num_samples": len(self),
            "num_tokens": self._num_tokens,
            "shards": self._ref.content,
            **self._layout.fingerprint(),
            **fim,
        }

    def fim(
        self,
        *,
        rate: float = 0.5,
        spm_rate: float = 0.5,
        seed: int = 0,
        min_length: int = 16,
        sentinels: Sequence[int] | Sequence[str] | None = None,
        tokenizer: str | None = None,
    ) -> PackedSequences:
        """These samples with fill-in-the-middle for code (PSM and SPM; see :mod:`streampack.samples.fim`).

        Each piece of a document in a row is served in its own columns, the sentinels replacing its last
        three tokens; decided by ``seed`` and the sample's index alone, so a resume is exact.

        Example::

            code = cache.sequences(2048).fim(rate=0.5, spm_rate=0.5)
            loader = Loader(code, batch_size=32, seed=1, output="dict")

        Args:
            rate: probability that a piece is FIM'd.
            spm_rate: probability that a FIM'd piece is in SPM order.
            seed: the seed of the FIM decisions (the loader's own seed does not change them).
            min_length: shorter pieces (their EOS not counted) are served as they are; at least 4.
            sentinels: the (prefix, middle, suffix) sentinels: 3 ids, or 3 spellings to look up in the
                tokenizer; by default the tokenizer's ``<fim_prefix>``..., ``<|fim_prefix|>``... or
                DeepSeek-Coder's.
            tokenizer: the SPEC of the tokenizer to look them up in; by default the one that built the cache
                (refused if its file changed since).

        Returns:
            New samples, whose fingerprint holds the FIM settings: a checkpoint of other settings is
            refused on resume.

        Raises:
            OptionsError: an option out of its range, or an id outside the cache's vocabulary.
            TokenizerError: the tokenizer cannot be read, or has no such sentinels (named).
        """
        fim = make_fim(
            self.cache,
            rate=rate,
            spm_rate=spm_rate,
            seed=seed,
            min_length=min_length,
            sentinels=sentinels,
            tokenizer=tokenizer,
        )
        samples = copy.copy(self)
        samples._fim = fim
        return samples

    @property
    def fim_settings(self) -> Fim | None:
        """The FIM settings of these samples (:meth:`fim`), or None."""
        return self._fim

    def fim_moves(self, indices: np.ndarray, spans: Spans | None = None) -> Moves | None:
        """How FIM rearranges the plain rows of the samples ``indices`` (checked), or None without FIM."""
        if self._fim is None:
            return None
        spans = self._layout.spans(indices) if spans is None else spans
        return fim_moves(spans, indices, self._fim, self.cache.shard_offsets, self.width)

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
        indices, shape = sample_indices(index, len(self))
        out = np.empty((indices.size, self.width), dtype=self.dtype)
        self._read(indices, out)
        return out.reshape(*shape, self.width)

    def read(
        self, indices: npt.ArrayLike, *, out: np.ndarray | None = None, rows: npt.ArrayLike | None = None
    ) -> np.ndarray:
        """Read a batch of windows into ``out``, casting while copying (one pass, no temporary).

        Args:
            indices: 1-D integer array of sample numbers.
            out: destination of shape ``(len(indices), seq_len + overlap)``, of an integer dtype that holds
                every id of the cache dtype (int32 or int64 for a uint16 cache, not int16); a new array of
                the cache dtype when omitted.
            rows: write window ``k`` into row ``rows[k]`` of ``out``, which may have more rows (e.g. a
                batch mixed from several sources); rows ``0, 1, ...`` when omitted.

        Returns:
            ``out``.

        Raises:
            IndexError: an index is out of range.
            TypeError: ``out`` is not a numpy array.
            ValueError: ``indices`` is not 1-D, or ``out`` has the wrong shape or a dtype that cannot hold
                every token id.
        """
        flat, shape = sample_indices(indices, len(self))
        if len(shape) != 1:
            raise ValueError(f"read() takes a 1-D array of indices (got shape {shape})")
        targets = None if rows is None else target_rows(rows, flat.size, out)
        if out is None:
            out = np.empty((flat.size, self.width), dtype=self.dtype)
        else:
            check_out(out, self.dtype, self.width, flat.size if targets is None else None)
        self._read(flat, out, targets)
        return out

    def boundaries(self, index: Index) -> Boundaries:
        """Document boundaries of the samples at ``index``: position ids, document ids, ``cu_seqlens``.

        Computed from the shards' offset tables; no token is read.

        Args:
            index: as for ``__getitem__``.

        Returns:
            A :class:`Boundaries` whose arrays have shape ``index_shape + (seq_len,)``.
        """
        indices, shape = sample_indices(index, len(self))
        cache, spans = self.cache, self._layout.spans(indices)
        moves = self.fim_moves(indices, spans) if self._masked else None
        found = boundaries(
            spans,
            indices.size,
            self.seq_len,
            cache.shard_offsets,
            self._doc_starts,
            cache.shard_loss_mask if self._masked and moves is None else None,
            self._layout.pad_multiple if isinstance(self._layout, Bins) else 1,
        )
        if moves is not None:  # the marks move with their tokens; the sentinels are targets
            marks = np.zeros((indices.size, self.width), dtype=np.uint8)
            read_spans(spans, marks, cache.shard_loss_mask, moves=moves, sentinel=1)
            marks = np.ascontiguousarray(marks[:, : self.seq_len]).view(bool)
            found = Boundaries(found.shape, found.starts, found.docs, marks, found.fills)
        return found.reshaped((*shape, self.seq_len))

    def _read(self, indices: np.ndarray, out: np.ndarray, rows: np.ndarray | None = None) -> None:
        pad = self._layout.pad_id
        if pad is not None:
            if rows is None:
                out[...] = pad
            else:
                out[rows] = pad
        spans = self._layout.spans(indices)
        moves = self.fim_moves(indices, spans)
        if moves is not None and rows is not None:
            moves = moves.renumbered(rows)
        read_spans(spans, out, self.cache.shard_tokens, rows, moves)


# Shard maps a JoinedSequences keeps at hand (each holds a file descriptor while kept).
_RECENT_MAPS = 16


class JoinedSequences:
    """Several :class:`PackedSequences` of one width read as one token space.

    With the caches' shard tables laid end to end, a mixture's batch is split and copied in one pass,
    rather than paying each call's fixed cost once per source. A window never crosses into the next cache.

    Args:
        parts: the sources, in source-id order, all of one ``width`` (each with its own layout).
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
        fetching = [part.cache.store for part in self.parts if part.cache.store.fetches_copies]
        if fetching:  # a bounded local copy cannot evict the maps kept here
            fetching[0].on_pressure(self.forget_maps)
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
        return Spans.joined(found)

    def moves(self, sources: np.ndarray, samples: np.ndarray, spans: Spans) -> Moves | None:
        """How FIM rearranges the plain rows of ``spans`` (of :meth:`spans`), or None where no source is
        FIM'd."""
        if all(part.fim_settings is None for part in self.parts):
            return None
        found = []
        for source, rows in groups(sources):
            if self.parts[source].fim_settings is None:
                continue
            at = np.flatnonzero(
                sources[spans.rows] == source
            )  # the source's spans, in its own rows and shards
            mine = Spans(
                np.searchsorted(rows, spans.rows[at]),
                spans.shards[at] - self._shard_bases[source],
                spans.lo[at],
                spans.hi[at],
                spans.col[at],
            )
            moves = self.parts[source].fim_moves(samples[rows], mine)
            found.append(moves.renumbered(rows))  # type: ignore[union-attr]
        return Moves.joined(self.width, found) if found else None

    def pads_of(self, sources: np.ndarray) -> np.ndarray | None:
        """The padding id of each row's source, when some source pads; else None."""
        return None if self._pads is None else self._pads[sources]

    def read(self, sources: np.ndarray, samples: np.ndarray, out: np.ndarray) -> None:
        """Write sample ``samples[k]`` of source ``sources[k]`` into ``out[k]`` (indices already checked)."""
        if self._pads is not None:
            out[...] = self._pads[sources][:, None]
        spans = self.spans(sources, samples)
        read_spans(spans, out, self.tokens, moves=self.moves(sources, samples, spans))

    def rows(self, shard: int) -> np.ndarray:
        """The :func:`~streampack.samples.copies.row_view` of shard ``shard``, for windows of ``width``."""
        view = self._views.get(shard)
        if view is None:
            view = row_view(self.tokens(shard), self.width)
            self._views = kept(self._views, shard, view, keep=_RECENT_MAPS - 1)
        return view

    def tokens(self, shard: int) -> np.ndarray:
        """The tokens of shard ``shard`` of the joined stream.

        The last few maps are kept here: a mixed batch touches a shard of every source, and a cache's own
        lookup pays for its LRU bookkeeping.
        """
        if self._runs is None:
            self._join()
        tokens = self._recent.get(shard)
        if tokens is None:
            part, local = self._owners[shard]
            tokens = self.parts[part].cache.shard_tokens(local)
            self._recent = kept(self._recent, shard, tokens, keep=_RECENT_MAPS - 1)
        return tokens


def with_current_digests(order: Mapping[str, Any], datasets: Sequence[object]) -> Mapping[str, Any]:
    """A checkpoint's order with each data fingerprint of format version 1 given the current digest.

    Caches of version 1 had another ``shards`` digest (:attr:`~streampack.reader.Cache.version_1_digest`);
    it is computed only for a fingerprint equal to one of ``datasets``' in everything else.
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

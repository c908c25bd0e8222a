"""Packed fixed-length samples of a cache's token stream, with their document boundaries.

A cache is one long stream of tokens: every document followed by its EOS, documents in input order, shards
end to end. :class:`PackedSequences` cuts that stream into windows of ``seq_len`` tokens (the
``group_texts`` convention): sample ``i`` is tokens ``[i*seq_len, i*seq_len + seq_len + overlap)``.
Windows cross document and shard boundaries; only the final partial window is dropped, so at most
``seq_len + overlap - 1`` tokens of a cache are never served.

Reading a batch is one call: each window is a slice of a memory-mapped shard (two slices where it crosses
a shard boundary) copied straight into the output array, with no per-token Python work. Document
boundaries come from the shards' offset tables with ``searchsorted``, so a batch costs the same whatever
the size of the cache.
"""

from __future__ import annotations

import functools
import hashlib
import json
import numbers
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from streampack.errors import CacheError

if TYPE_CHECKING:
    from streampack.reader import Cache

__all__ = ["Boundaries", "PackedSequences"]

Index = int | np.integer | slice | npt.ArrayLike


@dataclass(frozen=True)
class Boundaries:
    """Where documents start inside a batch of samples, in the forms attention kernels take.

    Every row starts a new segment (a model sees nothing before its window), and so does every document
    start inside a row. All arrays cover the ``seq_len`` input positions of each sample, not its
    ``overlap`` tail.

    Attributes:
        position_ids: ``int64`` array of shape ``index_shape + (seq_len,)``: the position of each token in
            its segment, restarting at 0 at every document start and at every row start.
        doc_ids: ``int64`` array of the same shape: the global index of each token's document in the cache
            (``cache.doc(doc_ids[r, t])`` holds the token).
        cu_seqlens: ``int32`` array of shape ``(segments + 1,)``: cumulative segment lengths over the
            flattened batch, starting at 0 and ending at ``rows * seq_len`` (the ``cu_seqlens`` argument of
            varlen attention such as ``flash_attn_varlen_func``).
        max_seqlen: length of the longest segment.
    """

    position_ids: np.ndarray
    doc_ids: np.ndarray
    cu_seqlens: np.ndarray
    max_seqlen: int


@dataclass(frozen=True)
class _Pieces:
    """Where each window lies: one row per (window, shard) overlap, all arrays of equal length."""

    rows: np.ndarray  # window number in the batch
    shards: np.ndarray  # shard holding the piece
    lo: np.ndarray  # first token of the piece, local to the shard
    hi: np.ndarray  # one past its last token, local to the shard
    col: np.ndarray  # column of the output row where the piece starts


class PackedSequences:
    """The samples of a cache: fixed-length windows of its token stream. Create with ``cache.sequences``.

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

    Raises:
        ValueError: ``seq_len`` or ``overlap`` is not an integer in its allowed range.
    """

    def __init__(self, cache: Cache, seq_len: int, *, overlap: int = 0) -> None:
        self.seq_len = _check_int("seq_len", seq_len, 1, "a positive integer, e.g. 2048")
        self.overlap = _check_int("overlap", overlap, 0, "a non-negative integer, usually 0 or 1")
        self._path = os.path.abspath(cache.root)
        self._allow_incomplete = not cache.manifest.complete
        self._num_tokens = cache.num_tokens
        self._content = _content_digest(cache)
        self._attach(cache)

    def _attach(self, cache: Cache) -> None:
        self._cache: Cache | None = cache
        self._token_starts = np.asarray(cache.token_starts, dtype=np.int64)
        docs = [shard.num_docs for shard in cache.shards]
        self._doc_starts = np.concatenate([[0], np.cumsum(docs, dtype=np.int64)]).astype(np.int64)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle the cache path and settings only; the memory maps are reopened where unpickled."""
        return {
            "path": self._path,
            "allow_incomplete": self._allow_incomplete,
            "num_tokens": self._num_tokens,
            "content": self._content,
            "seq_len": self.seq_len,
            "overlap": self.overlap,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore the settings; the cache is reopened lazily, on first use."""
        self._path = state["path"]
        self._allow_incomplete = state["allow_incomplete"]
        self._num_tokens = state["num_tokens"]
        self._content = state["content"]
        self.seq_len = state["seq_len"]
        self.overlap = state["overlap"]
        self._cache = None

    @property
    def cache(self) -> Cache:
        """The cache the samples are read from (reopened from its path after unpickling)."""
        return self._cache if self._cache is not None else self._reopen()

    def _reopen(self) -> Cache:
        from streampack.reader import open as open_cache

        cache = open_cache(self._path, allow_incomplete=self._allow_incomplete)
        now = (cache.num_tokens, _content_digest(cache))
        if now != (self._num_tokens, self._content):
            raise CacheError(
                f"{self._path}: the cache now holds {now[0]} tokens (shards {now[1]}), but these sequences "
                f"were made from {self._num_tokens} (shards {self._content}); it changed on disk since, so "
                "sample indices no longer mean the same windows. Recreate the sequences (and restart the "
                "loader) from the cache."
            )
        self._attach(cache)
        return cache

    @property
    def path(self) -> str:
        """Absolute path of the cache directory."""
        return self._path

    @property
    def dtype(self) -> np.dtype:
        """Token dtype of the cache, which ``__getitem__`` returns (cast on the caller's side)."""
        return self.cache.dtype

    @property
    def width(self) -> int:
        """Tokens per returned window: ``seq_len + overlap``."""
        return self.seq_len + self.overlap

    def __len__(self) -> int:
        """Number of complete windows in the stream."""
        return max(0, (self._num_tokens - self.overlap) // self.seq_len)

    def __repr__(self) -> str:
        return (
            f"PackedSequences({self._path!r}, seq_len={self.seq_len}, overlap={self.overlap}, "
            f"samples={len(self)}, tokens={self._num_tokens})"
        )

    def fingerprint(self) -> dict[str, int | str]:
        """What identifies these samples, for checking a loader checkpoint against them (JSON-able).

        ``shards`` digests the manifest's shard table (names, sizes, checksums): a cache rebuilt from
        other data is told apart even at the same size, while a copy of the cache elsewhere is not.
        """
        return {
            "num_samples": len(self),
            "num_tokens": self._num_tokens,
            "shards": self._content,
            "seq_len": self.seq_len,
            "overlap": self.overlap,
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
        if not _holds_every_id(self.dtype, out.dtype):
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
        rows, length = indices.size, self.seq_len
        if rows == 0:
            empty = np.zeros((*shape, length), dtype=np.int64)
            return Boundaries(empty, empty.copy(), np.zeros(1, dtype=np.int32), 0)
        pieces = self._pieces(indices * length, length)
        positions, docs = [], []
        for shard in np.unique(pieces.shards).tolist():
            mine = pieces.shards == shard
            piece_pos, piece_docs, cut_pos, cut_docs = self._segments_in_shard(
                shard,
                pieces.lo[mine],
                pieces.hi[mine],
                pieces.rows[mine] * length + pieces.col[mine],
            )
            positions += [piece_pos, cut_pos]
            docs += [piece_docs, cut_docs]
        starts, start_docs = np.concatenate(positions), np.concatenate(docs)
        order = np.argsort(starts, kind="stable")
        starts, start_docs = starts[order], start_docs[order]
        # Empty documents (no EOS appended) end where the next starts: keep the last, which holds tokens.
        last = np.append(starts[1:] != starts[:-1], True)
        starts, start_docs = starts[last], start_docs[last]
        total = rows * length
        lengths = np.diff(starts, append=total)
        position_ids = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)
        doc_ids = np.repeat(start_docs, lengths)
        return Boundaries(
            position_ids=position_ids.reshape(*shape, length),
            doc_ids=doc_ids.reshape(*shape, length),
            cu_seqlens=np.append(starts, total).astype(np.int32),
            max_seqlen=int(lengths.max()) if lengths.size else 0,
        )

    def _segments_in_shard(
        self, shard: int, lo: np.ndarray, hi: np.ndarray, flat: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Segment starts of the pieces ``[lo, hi)`` of one shard that begin at ``flat`` in the batch.

        Returns the flat position and global document id of each piece start, then of each document start
        strictly inside a piece.
        """
        offsets = self._offsets(shard)
        # offsets hold each document's END: document j spans [offsets[j-1], offsets[j]). uint64 queries
        # keep searchsorted from promoting the whole table to float64.
        first = np.searchsorted(offsets, lo.astype(np.uint64), side="right").astype(np.int64)
        stop = np.searchsorted(offsets, hi.astype(np.uint64), side="left").astype(np.int64)
        counts = stop - first
        ends = _ragged_arange(first, counts)
        cut_local = offsets[ends].astype(np.int64)
        cut_pos = np.repeat(flat - lo, counts) + cut_local
        base = int(self._doc_starts[shard])
        return flat, base + first, cut_pos, base + ends + 1

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

    def _pieces(self, starts: np.ndarray, width: int) -> _Pieces:
        """Split the windows ``[start, start + width)`` of the global stream at shard boundaries."""
        if self._cache is None:
            self._reopen()  # first use after unpickling
        return _split(self._token_starts, starts, width)

    def _read(self, indices: np.ndarray, out: np.ndarray, rows: np.ndarray | None = None) -> None:
        _copy(self._pieces(indices * self.seq_len, self.width), out, rows, self._tokens)

    def _tokens(self, shard: int) -> np.ndarray:
        return self.cache.shard_tokens(shard)

    def _offsets(self, shard: int) -> np.ndarray:
        return self.cache.shard_offsets(shard)


class JoinedSequences:
    """Several :class:`PackedSequences` of one width read as one token space: one split, one copy loop.

    A mixture's batch holds rows of several caches; reading each cache's rows with its own call would pay
    every call's fixed cost once per source. Here the shard tables are laid end to end, so a batch is split
    into pieces and copied in one pass whatever the number of sources. Windows never cross from one cache
    into the next: a cache's last window ends inside its own tokens.

    Args:
        parts: the sources, in source-id order; all of one ``width``.
    """

    def __init__(self, parts: Sequence[PackedSequences]) -> None:
        self.parts = list(parts)
        self.seq_len, self.width = parts[0].seq_len, parts[0].width
        self._token_starts: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"parts": self.parts, "seq_len": self.seq_len, "width": self.width, "_token_starts": None}

    def _join(self) -> np.ndarray:
        starts, owners, base = [np.zeros(1, dtype=np.int64)], [], 0
        for j, part in enumerate(self.parts):
            if part._cache is None:
                part._reopen()
            table = part._token_starts
            starts.append(base + table[1:])
            owners += [(j, shard) for shard in range(len(table) - 1)]
            base += int(table[-1])
        self._bases = np.cumsum([0] + [int(part._token_starts[-1]) for part in self.parts[:-1]])
        self._owners = owners
        self._token_starts = np.concatenate(starts)
        return self._token_starts

    def read(self, sources: np.ndarray, samples: np.ndarray, out: np.ndarray) -> None:
        """Write sample ``samples[k]`` of source ``sources[k]`` into ``out[k]`` (indices already checked)."""
        table = self._token_starts if self._token_starts is not None else self._join()
        starts = self._bases[sources] + samples * self.seq_len
        _copy(_split(table, starts, self.width), out, None, self._tokens)

    def _tokens(self, shard: int) -> np.ndarray:
        part, local = self._owners[shard]
        return self.parts[part]._tokens(local)


def _split(token_starts: np.ndarray, starts: np.ndarray, width: int) -> _Pieces:
    """Split the windows ``[start, start + width)`` of a token space at its shard boundaries."""
    if len(token_starts) == 2:  # one shard: nothing to split
        zeros = np.zeros(len(starts), dtype=np.int64)
        return _Pieces(np.arange(len(starts)), zeros, starts, starts + width, zeros)
    # side="right" skips empty shards: it picks the last shard starting at or before the token.
    first = np.searchsorted(token_starts, starts, side="right") - 1
    last = np.searchsorted(token_starts, starts + (width - 1), side="right") - 1
    if np.array_equal(first, last):
        lo = starts - token_starts[first]
        zeros = np.zeros(len(starts), dtype=np.int64)
        return _Pieces(np.arange(len(starts)), first, lo, lo + width, zeros)
    counts = last - first + 1
    rows = np.repeat(np.arange(len(starts)), counts)
    shards = _ragged_arange(first, counts)
    glo = np.maximum(starts[rows], token_starts[shards])
    ghi = np.minimum(starts[rows] + width, token_starts[shards + 1])
    keep = ghi > glo  # drop the empty shards a window steps over
    rows, shards, glo, ghi = rows[keep], shards[keep], glo[keep], ghi[keep]
    base = token_starts[shards]
    return _Pieces(rows, shards, glo - base, ghi - base, glo - starts[rows])


def _copy(
    pieces: _Pieces, out: np.ndarray, rows: np.ndarray | None, tokens_of: Callable[[int], np.ndarray]
) -> None:
    """Copy each piece into its row of ``out`` (``rows[row]`` when given), shard by shard.

    Shard by shard: one lookup of each shard's map per call rather than one per piece (the cache's LRU
    bookkeeping), and one map held at a time, so open descriptors stay bounded.
    """
    order = np.argsort(pieces.shards, kind="stable")
    targets = pieces.rows if rows is None else rows[pieces.rows]
    current, tokens = -1, None
    for row, shard, lo, hi, col in zip(
        targets[order].tolist(),
        pieces.shards[order].tolist(),
        pieces.lo[order].tolist(),
        pieces.hi[order].tolist(),
        pieces.col[order].tolist(),
    ):
        if shard != current:
            current, tokens = shard, tokens_of(shard)
        out[row, col : col + hi - lo] = tokens[lo:hi]  # type: ignore[index]


@functools.lru_cache(maxsize=64)
def _holds_every_id(tokens: np.dtype, out: np.dtype) -> bool:
    """Whether ``out`` is an integer dtype that holds every value of ``tokens`` (memoised: once per read)."""
    return out.kind in "iu" and bool(np.can_cast(tokens, out, "safe"))


def _content_digest(cache: Cache) -> str:
    """A short digest of the shard table: what the samples are made of, wherever the cache lives."""
    table = [[s.name, s.num_docs, s.num_tokens, s.tokens_checksum, s.offsets_checksum] for s in cache.shards]
    return hashlib.sha256(json.dumps(table).encode()).hexdigest()[:16]


def _ragged_arange(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(s, s + c)`` per pair, vectorised: ``[5, 6, 7, 2]`` from ``[5, 2], [3, 1]``."""
    offsets = np.cumsum(counts) - counts
    return np.repeat(starts - offsets, counts) + np.arange(int(counts.sum()), dtype=np.int64)


def _check_int(name: str, value: object, minimum: int, allowed: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < minimum:
        raise ValueError(f"{name} must be {allowed} (got {name}={value!r})")
    return int(value)

"""grain data sources over a cache: its packed samples, or its documents for grain's own packers.

grain (and torchtitan, which loads through it) reads any picklable object with ``__len__``,
``__getitem__`` and an identifying ``__repr__``, from several threads at once. These two sources are, and
need no grain import:

* :class:`SequenceSource`: item ``i`` is packed sample ``i`` of ``cache.sequences(seq_len)``;
* :class:`DocumentSource`: item ``i`` is document ``i`` (its EOS included), for grain's packers
  (``grain.experimental.FirstFitPackIterDataset``) or torchtitan's pretokenized sources.

Example::

    source = streampack.grain.DocumentSource(streampack.open("cache"))
    docs = grain.MapDataset.source(source).shuffle(seed=0).map(lambda tokens: {"tokens": tokens})
    packed = grain.experimental.FirstFitPackIterDataset(
        docs.to_iter_dataset(), length_struct={"tokens": 2048}, num_packing_bins=64
    )
    iterator = iter(packed.batch(8))  # iterator.get_state() / set_state() checkpoint it

Either source reopens the cache lazily after unpickling, and refuses one that changed on disk since.
"""

from __future__ import annotations

import operator
import threading
from typing import TYPE_CHECKING, Any, SupportsIndex

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from streampack.reader import Cache
    from streampack.samples.sequences import PackedSequences

__all__ = ["DocumentSource", "SequenceSource"]


class SequenceSource:
    """grain source of packed samples: item ``i`` is ``sequences[i]``, a 1-D array.

    Args:
        sequences: the samples, e.g. ``cache.sequences(2048)``.
        dtype: dtype of the returned arrays; ``None`` keeps the cache's (``uint16`` or ``uint32``).
    """

    def __init__(self, sequences: PackedSequences, *, dtype: npt.DTypeLike | None = None) -> None:
        self.sequences = sequences
        self.dtype = None if dtype is None else np.dtype(dtype)
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"sequences": self.sequences, "dtype": self.dtype}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["sequences"], dtype=state["dtype"])  # type: ignore[misc]

    def __len__(self) -> int:
        """Number of samples."""
        return len(self.sequences)

    def __repr__(self) -> str:
        return f"streampack.grain.SequenceSource({self.sequences!r}, dtype={self.dtype})"

    def __getitem__(self, index: SupportsIndex) -> np.ndarray:
        """Sample ``index`` (in ``[0, len)``) as a new 1-D array.

        Raises:
            IndexError: ``index`` is out of range.
        """
        # One reader at a time: the cache's table of open maps is not made for threads.
        with self._lock:
            row = self.sequences[operator.index(index)]
        return row if self.dtype is None else row.astype(self.dtype)


class DocumentSource:
    """grain source of a cache's documents: item ``i`` is document ``i``'s tokens, its EOS included.

    Args:
        cache: an open cache.
        dtype: dtype of the returned arrays; ``None`` keeps the cache's (``uint16`` or ``uint32``).
    """

    def __init__(self, cache: Cache, *, dtype: npt.DTypeLike | None = None) -> None:
        from streampack.samples.refs import cache_ref

        self._ref = cache_ref(cache)
        self._num_docs = cache.num_docs
        self.dtype = None if dtype is None else np.dtype(dtype)
        self._cache: Cache | None = cache
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """The cache's reference (URI and content digest); it is reopened, and checked, where unpickled."""
        state = dict(self.__dict__)
        del state["_cache"], state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._cache = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Number of documents."""
        return self._num_docs

    def __repr__(self) -> str:
        return (
            f"streampack.grain.DocumentSource({self._ref.local_path!r}, documents={self._num_docs}, "
            f"shards={self._ref.content}, dtype={self.dtype})"
        )

    def __getitem__(self, index: SupportsIndex) -> np.ndarray:
        """Document ``index`` (in ``[0, len)``) as a new 1-D array, ending with the cache's EOS if any.

        Raises:
            IndexError: ``index`` is out of range.
            CacheError: the cache changed on disk since this source was made.
        """
        with self._lock:
            doc = self._opened().doc(operator.index(index))
            return np.array(doc, dtype=self.dtype or doc.dtype)

    def _opened(self) -> Cache:
        if self._cache is not None:
            return self._cache
        from streampack.samples.refs import reopen_unchanged

        cache = reopen_unchanged(self._ref, "this document source")
        self._cache = cache
        return cache

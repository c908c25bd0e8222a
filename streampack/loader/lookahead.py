"""Which store keys the next steps of a loader read: what a prefetcher fetches ahead.

A loader's order is known in advance, so the shard files of its next batches are too:
:meth:`Loader.lookahead <streampack.loader.Loader.lookahead>` lists them, nearest step first, and
:mod:`streampack.loader.prefetch` fetches them. The prefetcher knows nothing else of the loader: it asks
the :class:`Lookahead` protocol, and this module maps samples to the files of the caches they sit in.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from streampack.samples.sequences import JoinedSequences
from streampack.store.localcopy import CachedStore

__all__ = ["Lookahead", "prefetch_steps", "shard_files"]


class Lookahead(Protocol):
    """What a prefetcher asks of the loader it fetches for (a :class:`~streampack.loader.Loader`)."""

    @property
    def prefetch_steps(self) -> int:
        """Batches ahead to fetch for (0: none)."""
        ...

    def lookahead(
        self, position: int, steps: int, *, stride: int | None = None
    ) -> list[tuple[CachedStore, str]]:
        """The ``(store, key)`` of each shard file the ``steps`` batches after ``position`` read, nearest
        first, each once (files of caches in object storage only)."""
        ...


def prefetch_steps(joined: JoinedSequences | None) -> int:
    """Steps ahead to prefetch for a loader over ``joined``: 0 unless it reads a cache in object storage."""
    if not isinstance(joined, JoinedSequences):
        return 0
    stores = [part.cache.store for part in joined.parts]
    return max((s.prefetch_steps for s in stores if isinstance(s, CachedStore)), default=0)


def shard_files(
    joined: JoinedSequences,
    sources: np.ndarray,
    samples: np.ndarray,
    *,
    boundaries: bool,
    seen: set[tuple[int, int]],
) -> list[tuple[CachedStore, str]]:
    """The files of the shards that sample ``samples[k]`` of source ``sources[k]`` spans, in the order of
    the samples, leaving out the shards in ``seen`` (``(source, shard)``, updated here) and those of local
    caches.

    Args:
        boundaries: also the files a batch's document boundaries are read from (``output="dict"``).

    Raises:
        IndexError: a sample is past the end of its source.
    """
    files: list[tuple[CachedStore, str]] = []
    for shard in dict.fromkeys(joined.spans(sources, samples).shards.tolist()):
        part, local = joined.owner(shard)
        if (part, local) in seen:
            continue
        seen.add((part, local))
        cache = joined.parts[part].cache
        store = cache.store
        if isinstance(store, CachedStore):
            files += [(store, key) for key in cache.shard_keys(local, boundaries=boundaries)]
    return files

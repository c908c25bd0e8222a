"""Which store keys the next steps of a loader read: what a prefetcher fetches ahead.

A loader's order is known in advance, so the shard files of its next batches are too:
:meth:`Loader.lookahead <streampack.loader.Loader.lookahead>` lists them (:func:`files_ahead`), nearest
step first, and :mod:`streampack.loader.prefetch` fetches them. The prefetcher knows nothing else of the
loader: it asks the :class:`Lookahead` protocol, and this module maps samples to the files of the caches
they sit in.

Only a loader over caches in object storage has anything to fetch, and it has read their samples
(:mod:`streampack.samples`) and opened their local copies (:mod:`streampack.store.localcopy`) already: so
those modules are imported here when asked, not with the loader.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np

if TYPE_CHECKING:
    from streampack.samples.sequences import JoinedSequences
    from streampack.store.localcopy import CachedStore

__all__ = ["Lookahead", "files_ahead", "prefetch_steps", "shard_files"]


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
    if joined is None:
        return 0
    stores = [part.cache.store for part in joined.parts]
    return max((s.prefetch_steps for s in stores if s.fetches_copies), default=0)


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
        if store.fetches_copies:
            fetching = cast("CachedStore", store)
            files += [(fetching, key) for key in cache.shard_keys(local, boundaries=boundaries)]
    return files


def files_ahead(
    current: Callable[[], JoinedSequences | None],
    steps: Iterable[tuple[np.ndarray, np.ndarray] | None],
    *,
    boundaries: bool,
) -> list[tuple[CachedStore, str]]:
    """The files of the shards that the picks of ``steps`` read, nearest step first, each once.

    Args:
        current: the sources the loader reads now, joined (None: not every one is a cache, so nothing
            is listed); asked again when a pick is past the end of its source, which a growing source
            reopened meanwhile causes (the list then stops there, to start over after the next batch).
        steps: the source ids and sample ids of this process's rows of each batch ahead; None where a
            batch cannot be made now (past the run, or not known yet), which ends the list.
        boundaries: also the files of the batches' document boundaries (see :func:`shard_files`).

    Raises:
        IndexError: a sample is past the end of its source, which was not reopened.
    """
    files: list[tuple[CachedStore, str]] = []
    seen: set[tuple[int, int]] = set()
    joined = current()  # read once: a growing source replaces it as it grows
    if joined is None:
        return files
    for picks in steps:
        if picks is None:
            break
        try:
            files += shard_files(joined, *picks, boundaries=boundaries, seen=seen)
        except IndexError:
            if current() is joined:
                raise
            break
    return files

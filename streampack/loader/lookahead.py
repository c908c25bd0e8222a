"""Which store keys the next steps of a loader read: what :mod:`streampack.loader.prefetch` fetches ahead,
asking the :class:`Lookahead` protocol and nothing else of the loader."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np

if TYPE_CHECKING:
    from streampack.samples.sequences import JoinedSequences
    from streampack.store.localcopy import CachedStore

__all__ = ["Lookahead", "files_ahead", "prefetch_steps"]


class Lookahead(Protocol):
    """What a prefetcher asks of the loader it fetches for (a :class:`~streampack.loader.Loader`)."""

    @property
    def prefetch_steps(self) -> int:
        """Batches ahead to fetch for (0: none)."""
        ...

    def lookahead(
        self, position: int, steps: int, *, stride: int | None = None
    ) -> list[tuple[CachedStore, str]]:
        """The ``(store, key)`` of each shard file in object storage the next ``steps`` batches read."""
        ...


def prefetch_steps(joined: JoinedSequences | None) -> int:
    """Steps ahead to prefetch for a loader over ``joined``: 0 unless it reads a cache in object storage."""
    if joined is None:
        return 0
    stores = [part.cache.store for part in joined.parts]
    return max((s.prefetch_steps for s in stores if s.fetches_copies), default=0)


def files_ahead(
    current: Callable[[], JoinedSequences | None],
    steps: Iterable[tuple[np.ndarray, np.ndarray] | None],
    *,
    boundaries: bool,
) -> list[tuple[CachedStore, str]]:
    """The files in object storage of the shards the picks of ``steps`` read, nearest step first, each once.

    Args:
        current: the sources the loader reads now, joined (None: nothing is listed); asked again when a
            pick is past the end of its source, which a growing source reopened meanwhile causes.
        steps: the picks of each batch ahead; None where a batch cannot be made now, which ends the list.
        boundaries: also the files of the batches' document boundaries (``output="dict"``).

    Raises:
        IndexError: a sample is past the end of its source, which was not reopened.
    """
    files: list[tuple[CachedStore, str]] = []
    seen: set[tuple[int, int]] = set()  # (source, shard)
    joined = current()  # read once: a growing source replaces it as it grows
    if joined is None:
        return files
    for picks in steps:
        if picks is None:
            break
        try:
            shards = joined.spans(*picks).shards.tolist()
        except IndexError:
            if current() is joined:
                raise
            break
        for shard in dict.fromkeys(shards):
            part, local = joined.owner(shard)
            cache = joined.parts[part].cache
            if (part, local) not in seen and cache.store.fetches_copies:
                store = cast("CachedStore", cache.store)
                files += [(store, key) for key in cache.shard_keys(local, boundaries=boundaries)]
            seen.add((part, local))
    return files

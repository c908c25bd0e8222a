"""What names a cache wherever its samples are unpickled, and how another process reopens it unchanged."""

from __future__ import annotations

from typing import TYPE_CHECKING

from streampack.errors import CacheError
from streampack.store import CacheRef

if TYPE_CHECKING:
    from streampack.reader import Cache

__all__ = ["cache_ref", "reopen_unchanged"]


def reopen_unchanged(ref: CacheRef, what: str) -> Cache:
    """Reopen the cache ``ref`` names (in another process), refusing it if its shards changed since ``what``
    (``"these samples"``) were made from it.

    Raises:
        CacheError: the cache cannot be opened, or its :attr:`~streampack.reader.Cache.content_digest`
            is not the one ``ref`` holds.
    """
    from streampack.reader.opening import open as open_cache

    cache = open_cache(ref.uri, allow_incomplete=ref.allow_incomplete, **(ref.reading or {}))
    now = cache.content_digest
    if now != ref.content and ref.content != cache.version_1_digest:  # pickled before format version 2
        raise CacheError(
            f"{cache.store.describe('')}: the cache changed on disk since {what} were made from it (it now "
            f"holds {cache.num_docs} documents, {cache.num_tokens} tokens; content digest {now}, was "
            f"{ref.content}), so their indices no longer mean the same tokens. Make {what} again from the "
            "reopened cache (and restart the loader)."
        )
    return cache


def cache_ref(cache: Cache) -> CacheRef:
    """The reference that picklable views of ``cache`` carry."""
    store = cache.store
    # Both, for another format's files in object storage: the same local copy, and what they declared.
    copy = store.reopen_options()
    reading = {**copy, **(cache.declared or {})} or None
    return CacheRef(store.uri, cache.content_digest, not cache.manifest.complete, reading)

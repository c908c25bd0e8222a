"""What names a cache wherever its samples are unpickled: :func:`cache_ref` (its URI and content digest,
a :class:`~streampack.store.CacheRef`), and :func:`reopen_unchanged`, which opens it again in another
process and refuses it if its shards changed since.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streampack.errors import CacheError
from streampack.store import CacheRef

if TYPE_CHECKING:
    from streampack.reader import Cache

__all__ = ["cache_ref", "content_digest", "reopen_unchanged"]


def reopen_unchanged(ref: CacheRef, what: str) -> Cache:
    """Reopen the cache ``ref`` names (in another process), refusing it if its shards changed since.

    Args:
        ref: the cache's URI, whether its build had finished, and the :func:`content_digest` taken when
            ``what`` were made.
        what: what was made from the cache, for the message (``"these samples"``).

    Raises:
        CacheError: the cache cannot be opened, or it is not the one ``ref`` digests (its shard table, and
            for another format's files what they hold: :attr:`~streampack.reader.Cache.content_digest`).
    """
    from streampack.reader.opening import open as open_cache

    cache = open_cache(ref.uri, allow_incomplete=ref.allow_incomplete, **(ref.reading or {}))
    now = content_digest(cache)
    if now != ref.content and ref.content != cache.version_1_digest:  # pickled before format version 2
        raise CacheError(
            f"{cache.store.describe('')}: the cache changed on disk since {what} were made from it (it now "
            f"holds {cache.num_docs} documents, {cache.num_tokens} tokens; content digest {now}, was "
            f"{ref.content}), so their indices no longer mean the same tokens. Make {what} again from the "
            "reopened cache (and restart the loader)."
        )
    return cache


def cache_ref(cache: Cache) -> CacheRef:
    """The reference that picklable views of ``cache`` carry (see :class:`~streampack.store.CacheRef`)."""
    store = cache.store
    # Both, for another format's files in object storage: the same local copy, and what they declared.
    copy = store.reopen_options()
    reading = {**copy, **(cache.declared or {})} or None
    return CacheRef(store.uri, content_digest(cache), not cache.manifest.complete, reading)


def content_digest(cache: Cache) -> str:
    """A short digest of what the cache holds: :attr:`streampack.reader.Cache.content_digest`."""
    return cache.content_digest

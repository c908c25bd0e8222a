"""Another format's token files in object storage (any fsspec URL) opened as a cache: :func:`open_remote`,
what :func:`streampack.open` does for a URL without a ``manifest.json``.

They are read through the bounded local copy a native cache in object storage is read through
(:mod:`streampack.interop.files`), whose store is their folder (``s3://b/data`` for the Megatron prefix
``s3://b/data/corpus``). The small files that say where documents are (an ``.idx``, each ``.ds.index``)
are fetched at the open, the token files whole when a shard is first read. Formats not read through it
are refused, saying which are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from streampack.interop.files import CopiedFiles
from streampack.interop.reading import open_foreign
from streampack.store.localcopy import cached_store, default_local_dir

if TYPE_CHECKING:
    import os

    from streampack.reader import Cache

__all__ = ["open_remote"]


def open_remote(
    url: str,
    declared: Mapping[str, Any],
    *,
    local_dir: str | os.PathLike[str] | None = None,
    max_local_bytes: int | None = None,
    prefetch_steps: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Cache:
    """The token files at ``url`` as a cache read through a local copy; ``declared`` and the keywords are
    what :func:`streampack.open` was given.

    Raises:
        CacheError: no format read from object storage recognises ``url``, or its files are damaged
            (named by their URLs).
        OptionsError: a format that is read from a local path only, or an option of the local copy.
    """
    url = url.rstrip("/")
    folder, _, name = url.rpartition("/")
    if folder.endswith(":/") or not folder:  # the URL is a bucket: its files are in it
        folder, name = url, ""
    store = cached_store(
        folder,
        local_dir=local_dir if local_dir is not None else default_local_dir(url),
        max_local_bytes=max_local_bytes,
        prefetch_steps=prefetch_steps,
        storage_options=storage_options,
    )
    store.opened = url
    try:
        cache = open_foreign(store.root / name, files=CopiedFiles(store), store=store, **declared)
    except BaseException:
        store.close()
        raise
    cache._opened_store = store
    return cache

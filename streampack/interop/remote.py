"""Another format's token files in object storage (``s3://bucket/prefix``, ``https://...``, any fsspec URL)
opened as a cache: :func:`open_remote`, what :func:`streampack.open` does for a URL that holds no
``manifest.json`` (or with ``format=``).

They are read through the same bounded local copy a native cache in object storage is
(:class:`~streampack.store.localcopy.CachedStore`, :mod:`streampack.interop.files`): the store is the
folder that holds them (for a Megatron prefix ``s3://b/data/corpus``, ``s3://b/data``, whose ``corpus.bin``
and ``corpus.idx`` are read), the small files that say where documents are (an ``.idx``, each
``.ds.index``) are fetched when the cache is opened, the token files when a shard is first read (a
:class:`~streampack.Loader` prefetches those of its next steps), each one whole into ``local_dir``,
within ``max_local_bytes``. Formats whose readers do not read through it (see
:func:`~streampack.interop.reading.remote_formats`) are refused, saying which are.
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
    """The token files at ``url`` as a cache read through a local copy; the keywords are
    :func:`streampack.open`'s, ``declared`` what it was told of the files (``format``, ``eos_id``...).

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

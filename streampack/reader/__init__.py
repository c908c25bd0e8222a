"""Reading a token cache: memory-mapped shards, documents, the global token stream, and an SFT build's
loss mask.

:func:`open` reads the manifest, whose shard table becomes a few numpy arrays (not one object per shard),
and touches no shard file: each is checked against the manifest (its size, one ``stat``, and that it does
not lead out of the cache) when it is first mapped, before anything is read from it. Nothing is read into
RAM beyond the manifest and the offset tables of the shards in use; memory-mapped pages belong to the page
cache.

The modules: ``opening`` (:func:`open`, :func:`open_committed`), ``cache`` (:class:`Cache`), ``shards``
(the :class:`~streampack.reader.shards.Shards` protocol a cache reads its shards through, and the shard
files of a native cache), ``verify`` (every checksum, every file of the directory).
"""

from streampack.reader.cache import Cache
from streampack.reader.opening import open, open_committed
from streampack.reader.shards import MAX_OPEN_MAPS, ShardFiles, Shards

__all__ = ["MAX_OPEN_MAPS", "Cache", "ShardFiles", "Shards", "open", "open_committed"]

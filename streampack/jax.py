"""JAX: each step's global batch as one sharded ``jax.Array``, built from this process's rows.

Install with ``pip install 'streampack[jax]'``. Each JAX process runs a :class:`~streampack.loader.Loader`
with ``rank=jax.process_index(), world_size=jax.process_count()``: it reads only the rows its devices
hold under a sharding of the batch axis, so ``jax.make_array_from_process_local_data`` assembles the
global array without moving data between processes::

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    loader = streampack.Loader(cache.sequences(2048, overlap=1), batch_size=256, seed=0,
                               rank=jax.process_index(), world_size=jax.process_count())
    for batch in streampack.jax.global_batches(loader, sharding):  # (256, 2049) global arrays
        state = train_step(state, batch)
        checkpoint = {"data": loader.state_dict(), ...}  # resumes at the next batch
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from streampack.errors import OptionsError, extra_needed
from streampack.loader import Loader

with extra_needed("streampack.jax", "JAX", "jax"):
    import jax

__all__ = ["global_batches"]


def global_batches(loader: Loader, sharding: Any) -> Iterator[Any]:
    """Iterate the loader, turning each batch into global ``jax.Array`` s laid out by ``sharding``.

    The loader advances as batches are handed out, so its ``state_dict()`` resumes at the next one. For
    ``output="dict"``, each 2-D field becomes a global array; the rest passes through as it is.

    Args:
        loader: this process's loader (``rank=jax.process_index()``, ``world_size=jax.process_count()``).
        sharding: a ``jax.sharding.Sharding`` of the global batch (rows split over the data axis).

    Raises:
        OptionsError: the loader's rank or world size is not this JAX process's.
    """
    rank, world = jax.process_index(), jax.process_count()
    if (loader.options.rank, loader.options.world_size) != (rank, world):
        raise OptionsError(
            f"the Loader was built for rank {loader.options.rank} of {loader.options.world_size}, but this "
            f"is JAX process {rank} of {world}; build it with rank=jax.process_index(), "
            "world_size=jax.process_count()"
        )
    for batch in loader:
        if isinstance(batch, dict):
            yield {key: _global(value, sharding) for key, value in batch.items()}
        else:
            yield _global(batch, sharding)


def _global(rows: Any, sharding: Any) -> Any:
    if isinstance(rows, np.ndarray) and rows.ndim == 2:
        return jax.make_array_from_process_local_data(sharding, rows)
    return rows

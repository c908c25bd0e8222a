"""streampack: tokenize a corpus once into an on-disk token cache; train from it with flat memory.

Build side: :func:`build` streams documents through a tokenizer into cache shards, resumably.
Load side: :func:`open` memory-maps a cache; :class:`Loader` serves shuffled, resumable batches of its
samples, or of a :class:`Mixture` of caches; :class:`Follow` serves a cache while its build runs;
:func:`which` says which documents (and input lines) a step's batch held.

Every name here is loaded on first use, so a trainer that only reads a cache never imports the build
side. Protocols and returned types live in :mod:`streampack.samples`, :mod:`streampack.order`,
:mod:`streampack.loader` and :mod:`streampack.errors`; framework adapters in :mod:`streampack.torch`,
:mod:`streampack.hf`, :mod:`streampack.lightning`, :mod:`streampack.torchdata`, :mod:`streampack.grain`
and :mod:`streampack.jax`.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from streampack.builder.coordinator import BuildSummary
    from streampack.builder.options import BuildKeywords, CacheSpec, RunOptions
    from streampack.errors import StreampackError
    from streampack.follow import Follow
    from streampack.inputs.records import Documents
    from streampack.loader import Loader
    from streampack.order.blockshuffle import BlockShuffle
    from streampack.order.mixture import Mixture
    from streampack.reader import Cache, open
    from streampack.reader.verify import verify
    from streampack.runs.mixconfig import load_mixture
    from streampack.runs.provenance import which

#: The public names, and the module each is loaded from.
_PUBLIC = {
    "open": "streampack.reader",
    "verify": "streampack.reader.verify",
    "which": "streampack.runs.provenance",
    "Cache": "streampack.reader",
    "CacheSpec": "streampack.builder.options",
    "RunOptions": "streampack.builder.options",
    "Documents": "streampack.inputs.records",
    "Loader": "streampack.loader",
    "Follow": "streampack.follow",
    "Mixture": "streampack.order.mixture",
    "BlockShuffle": "streampack.order.blockshuffle",
    "load_mixture": "streampack.runs.mixconfig",
    "StreampackError": "streampack.errors",
}

__all__ = [
    "BlockShuffle",
    "Cache",
    "CacheSpec",
    "Documents",
    "Follow",
    "Loader",
    "Mixture",
    "RunOptions",
    "StreampackError",
    "build",
    "load_mixture",
    "open",
    "verify",
    "which",
]


def build(
    inputs: Any,
    out: str | os.PathLike[str],
    *,
    spec: CacheSpec | None = None,
    run: RunOptions | None = None,
    **options: Unpack[BuildKeywords],
) -> BuildSummary:
    """Build (or resume building) a token cache from ``inputs`` into the directory ``out``.

    Args:
        inputs: a path, directory, glob or URL, or a list of them; or documents: a Hugging Face
            ``Dataset``/``IterableDataset``, a generator, or :class:`~streampack.Documents` wrapping any
            iterable of ``str`` or dicts.
        out: the cache directory (created if needed), or an fsspec URL (``s3://bucket/prefix``): the
            build is then made in ``run.staging_dir`` and published there.
        spec: the settings that identify the cache (:class:`~streampack.CacheSpec`).
        run: how the build runs (:class:`~streampack.RunOptions`).
        **options: fields of either, by name (``tokenizer="gpt2/tokenizer.json", workers=4``), replacing
            those of ``spec`` and ``run``.

    Returns:
        A :class:`~streampack.builder.coordinator.BuildSummary`.

    Raises:
        StreampackError: bad inputs or records, a tokenizer that cannot load, a cache built with other
            settings or from other inputs, another build running in ``out``, or a full disk.
    """
    # The tokenizer loads on a thread of its own (~0.25-1.1 s) while the builder is imported (~0.2 s).
    from streampack.tokenizer import preload

    preload.start(
        options.get("tokenizer", getattr(spec, "tokenizer", None)),
        options.get("tokenizer_engine", getattr(run, "tokenizer_engine", "auto")),
    )
    from streampack.builder import coordinator

    return coordinator.build(inputs, out, spec=spec, run=run, **options)


def __getattr__(name: str) -> Any:
    """Load a public name on first use."""
    if name not in _PUBLIC:
        raise AttributeError(f"module 'streampack' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])

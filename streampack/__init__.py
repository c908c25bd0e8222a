"""streampack: tokenize a corpus once into an on-disk token cache; train from it with flat memory.

Build side: :func:`build` streams documents through a tokenizer into cache shards, resumably.
Load side: :func:`open` memory-maps a cache; :class:`Loader` serves shuffled, resumable batches of its
packed sequences, or of a :class:`Mixture` of several caches by weight (PyTorch adapters in
:mod:`streampack.torch`; training frameworks in :mod:`streampack.hf`, :mod:`streampack.lightning`,
:mod:`streampack.torchdata`, :mod:`streampack.grain` and :mod:`streampack.jax`, none imported here);
:func:`which` says which documents (and input lines) a step's batch held.
"""

from __future__ import annotations

from streampack import _aliases
from streampack.builder.coordinator import BuildSummary, build
from streampack.builder.options import CacheSpec, RunOptions
from streampack.errors import (
    BadRecordError,
    BuildLockedError,
    BuildStalledError,
    CacheError,
    ConfigMismatchError,
    InputError,
    LoaderStateError,
    MissingDependencyError,
    OptionsError,
    StreampackError,
    TokenizerError,
    WorkerDiedError,
    WriteError,
)
from streampack.inputs.sources import Documents
from streampack.loader import Loader, LoaderOptions, SourceProgress
from streampack.loader.follow import Follow
from streampack.loader.mixconfig import load_mixture
from streampack.loader.provenance import Placement, Provenance, which
from streampack.order.blockshuffle import BlockShuffle
from streampack.order.mixture import Mixture
from streampack.order.permutation import Permutation
from streampack.reader import Cache, open
from streampack.reader.verify import VerifyReport, verify
from streampack.samples.sequences import Boundaries, PackedSequences
from streampack.tokenizer.backends import load_tokenizer

__all__ = [
    "BadRecordError",
    "BlockShuffle",
    "Boundaries",
    "BuildLockedError",
    "BuildStalledError",
    "BuildSummary",
    "Cache",
    "CacheError",
    "CacheSpec",
    "ConfigMismatchError",
    "Documents",
    "Follow",
    "InputError",
    "Loader",
    "LoaderOptions",
    "LoaderStateError",
    "MissingDependencyError",
    "Mixture",
    "OptionsError",
    "PackedSequences",
    "Permutation",
    "Placement",
    "Provenance",
    "RunOptions",
    "SourceProgress",
    "StreampackError",
    "TokenizerError",
    "VerifyReport",
    "WorkerDiedError",
    "WriteError",
    "build",
    "load_mixture",
    "load_tokenizer",
    "open",
    "verify",
    "which",
]

_aliases.install()

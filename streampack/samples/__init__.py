"""Samples: which tokens of a cache make sample ``i``.

A ``Layout`` maps each sample to ``Spans`` of the cache's token stream: fixed windows, or whole documents
packed (planned by ``packing``) or one per sample. ``PackedSequences`` are the samples a loader reads,
with their ``Boundaries``; a ``DocumentSet`` is the documents they are made of: all of them, or one side
of a held-out split.
"""

from streampack.samples.boundaries import Boundaries
from streampack.samples.layout import Layout
from streampack.samples.sequences import PackedSequences
from streampack.samples.spans import Spans
from streampack.samples.split import DocumentSet

__all__ = ["Boundaries", "DocumentSet", "Layout", "PackedSequences", "Spans"]

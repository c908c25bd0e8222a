"""Samples: which tokens of a cache make sample ``i``.

``layout`` holds the ``Layout`` protocol (sample ``i`` = these spans, this padding, this loss mask) and its
forms: fixed windows of the token stream, packed bins of whole documents, one document per sample, over
the ``spans`` of a stream; ``copies`` reads a batch's spans into an array and ``boundaries`` finds the
documents inside them; ``packing`` plans the bins and stores the plans; ``sequences`` the samples a loader
reads (``PackedSequences``; ``batches`` checks what a read is asked, ``refs`` names the cache across
processes); ``chosen`` which documents samples are made of, and ``split`` the views of them that make
samples (``DocumentSet``: every document, or one side of a held-out split).
"""

from streampack.samples.boundaries import Boundaries
from streampack.samples.layout import Layout
from streampack.samples.sequences import PackedSequences
from streampack.samples.spans import Spans
from streampack.samples.split import DocumentSet

__all__ = ["Boundaries", "DocumentSet", "Layout", "PackedSequences", "Spans"]

"""Samples: which tokens of a cache make sample ``i``.

``layout`` holds the ``Layout`` protocol (sample ``i`` = these spans, this padding, this loss mask) and its
forms: fixed windows of the token stream, packed bins of whole documents, one document per sample;
``packing`` plans the bins and stores the plans; ``sequences`` the samples a loader reads
(``PackedSequences``); ``split`` a held-out selection of documents.
"""

from streampack.samples.layout import Layout, Spans
from streampack.samples.sequences import Boundaries, PackedSequences
from streampack.samples.split import DocumentSet

__all__ = ["Boundaries", "DocumentSet", "Layout", "PackedSequences", "Spans"]

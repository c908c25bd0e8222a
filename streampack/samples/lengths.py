"""The same stream's windows at another length, which a sequence-length schedule serves a unit as.

Window ``u*k + j`` of a stream at ``l = U / k`` lies inside window ``u`` of the stream at ``U``: a unit's
sub-windows are windows of :func:`at_seq_len`.
"""

from __future__ import annotations

from streampack.errors import OptionsError
from streampack.samples.layout import FixedWindows
from streampack.samples.sequences import PackedSequences

__all__ = ["at_seq_len", "windows_of"]


def windows_of(samples: object, what: str) -> PackedSequences:
    """``samples``, when they are fixed windows of a cache (``cache.sequences``).

    Raises:
        OptionsError: they are not (packed or whole documents, an array); the message names ``what``.
    """
    if isinstance(samples, PackedSequences) and isinstance(samples.layout, FixedWindows):
        if samples.fim_settings is not None:
            raise OptionsError(
                f"{what} serves sub-windows of windows as windows of another length, whose FIM decisions "
                "are not those of the windows served (FIM decides per sample): read FIM'd samples at one "
                "seq_len"
            )
        return samples
    kind = type(samples).__name__
    if isinstance(samples, PackedSequences):
        kind = f"{kind} of whole documents (cache.packed or cache.documents)"
    raise OptionsError(
        f"{what} serves sub-windows of fixed windows, cache.sequences(seq_len); got {kind}, whose samples "
        "are not one stream cut in windows. Read cache.sequences(L) with L the largest length"
    )


def at_seq_len(samples: PackedSequences, seq_len: int) -> PackedSequences:
    """The windows of ``samples``' stream (the same documents, the same overlap) at ``seq_len``."""
    layout = samples.layout
    assert isinstance(layout, FixedWindows)
    return PackedSequences.of(
        samples.cache, FixedWindows(layout.runs, seq_len, layout.overlap, layout.selection)
    )

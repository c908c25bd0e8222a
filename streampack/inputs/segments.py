"""An SFT document's parts: segments of text, each tokenized on its own, each a training target or not."""

from __future__ import annotations

from typing import NamedTuple


class Segment(NamedTuple):
    """A span of an SFT document's text, tokenized on its own.

    Attributes:
        text: the text.
        target: its tokens are training targets (they carry the loss).
        template: written by a chat template, so its special-token strings become their ids.
    """

    text: str
    target: bool
    template: bool = False


Sft = tuple[Segment, ...]  # an SFT document: its segments in order

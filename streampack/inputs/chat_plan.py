"""The segments of every conversation of one shape, made from renders of the shape alone.

Where a template is proven to only print the contents, the render of a conversation (and of the prefixes
that find the assistant turns) is its shape's render with each marker replaced by its content, as given or
stripped. A :class:`Plan` holds that once per shape, and fills in a conversation's contents with no render.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from streampack.inputs.segments import Segment, Sft

#: Renders messages, with the generation prompt or not.
Render = Callable[[list[dict[str, Any]], bool], str]
#: A plan's item: a literal text, or the content of message ``index`` (``index`` >= 0, stripped or not);
#: whether it is a target, whether it is the template's: (literal, index, stripped, target, template).
Item = tuple[str, int, bool, bool, bool]

# Private-use characters around a content's index: no template writes them. A marker padded with spaces
# tells a content the template strips (its render loses the spaces) from one it prints as given.
_MARK, _END = "\ue000", "\ue001"
MARKER = re.compile(f"{_MARK}([0-9]+){_END}")
_PAD = " "


def marker(index: int) -> str:
    """The marker of hole ``index``: what :data:`MARKER` finds."""
    return f"{_MARK}{index}{_END}"


def marked(messages: list[dict[str, Any]], pad: str = "") -> list[dict[str, Any]]:
    """``messages`` with each content replaced by its marker (the message's index), padded with ``pad``."""
    return [{**m, "content": f"{pad}{marker(i)}{pad}"} for i, m in enumerate(messages)]


@dataclass(frozen=True)
class _Render:
    """A render of a shape: its literal texts, and between each two the content of message ``index``
    (stripped or not)."""

    literals: list[str]
    holes: list[tuple[int, bool]]

    def starts(self, longer: _Render) -> bool:
        """Whether this render is a prefix of ``longer`` whatever the contents."""
        m = len(self.holes)
        return (
            m <= len(longer.holes)
            and self.holes == longer.holes[:m]
            and self.literals[:m] == longer.literals[:m]
            and longer.literals[m].startswith(self.literals[m])
        )

    @property
    def end(self) -> tuple[int, int]:
        """Where it ends in a render it starts: (literal, offset in it)."""
        return len(self.holes), len(self.literals[-1])


class Plan:
    """One shape's segments: its items, each a literal text or a content to fill in, a target or not."""

    __slots__ = ("_alternating", "_holes", "_kinds", "_literals", "_texts")

    def __init__(self, items: list[Item]) -> None:
        """A plan of ``items`` in order (see :data:`Item`)."""
        self._texts = [literal for literal, *_ in items]
        self._holes = [
            (k, index, stripped, target, template)
            for k, (_, index, stripped, target, template) in enumerate(items)
            if index >= 0
        ]
        self._kinds = [(target, template) for *_, target, template in items]
        # No two neighbours alike and no empty literal: the items are the segments when every content is
        # non-empty, the common case, made without joining runs.
        self._alternating = all(a != b for a, b in itertools.pairwise(self._kinds)) and all(
            literal for literal, index, *_ in items if index < 0
        )
        self._literals = [Segment(text, *kind) for text, kind in zip(self._texts, self._kinds)]

    def segments(self, messages: list[dict[str, Any]]) -> Sft:
        """The segments of a conversation of this plan's shape, as rendering it would give them."""
        if self._alternating:
            segments = self._literals.copy()
            for k, index, stripped, target, template in self._holes:
                content = messages[index]["content"]
                if stripped:
                    content = content.strip()
                if not content:
                    break
                segments[k] = Segment(content, target, template)
            else:
                return tuple(segments)
        texts = self._texts.copy()
        for k, index, stripped, *_ in self._holes:
            content = messages[index]["content"]
            texts[k] = content.strip() if stripped else content
        return runs(texts, self._kinds)


def runs(texts: list[str], kinds: list[tuple[bool, bool]]) -> Sft:
    """The non-empty ``texts`` joined into runs of the same kind (target, template)."""
    segments: list[Segment] = []
    run: list[str] = []
    kind = (False, False)
    for text, text_kind in zip(texts, kinds):
        if not text:
            continue
        if text_kind != kind and run:
            segments.append(Segment("".join(run), *kind))
            run = []
        kind = text_kind
        run.append(text)
    if run:
        segments.append(Segment("".join(run), *kind))
    return tuple(segments)


def plan(shape: list[dict[str, Any]], render: Render, *, last_only: bool = False) -> Plan | None:
    """The plan of the conversations of ``shape``, for a template proven to only print contents; None where
    its renders do not line up for every content, or it does not print one (each conversation is then
    rendered). ``last_only``: the last assistant turn is the only target."""
    full = _render(shape, False, render)
    if full is None or {index for index, _ in full.holes} != set(range(len(shape))):
        return None
    spans: list[tuple[tuple[int, int], tuple[int, int]]] = []
    for i, message in enumerate(shape):
        if message["role"] != "assistant":
            continue
        before = _render(shape[:i], True, render)
        through = full if i == len(shape) - 1 else _render(shape[: i + 1], False, render)
        start = spans[-1][1] if spans else (0, 0)
        if before is None or through is None or not (before.starts(full) and through.starts(full)):
            return None
        if not start <= before.end <= through.end:
            return None
        spans.append((before.end, through.end))
    return Plan(_items(full, spans[-1:] if last_only else spans))


def _render(shape: list[dict[str, Any]], prompt: bool, render: Render) -> _Render | None:
    """The render of ``shape`` with its contents as holes; None where the markers cannot be told apart."""
    plain = MARKER.split(render(marked(shape), prompt))
    literals, indexes = plain[::2], [int(i) for i in plain[1::2]]
    if any(i >= len(shape) for i in indexes) or any(_MARK in t or _END in t for t in literals):
        return None
    text, at, holes = render(marked(shape, _PAD), prompt), 0, []
    for literal, index in zip(literals, indexes):
        if not text.startswith(literal, at):
            return None
        at += len(literal)
        bare = f"{_MARK}{index}{_END}"
        stripped = text.startswith(bare, at)
        if not stripped and not text.startswith(_PAD + bare + _PAD, at):
            return None
        holes.append((index, stripped))
        at += len(bare) + (0 if stripped else 2 * len(_PAD))
    if text[at:] != literals[-1]:
        return None
    return _Render(literals, holes)


def _items(full: _Render, spans: list[tuple[tuple[int, int], tuple[int, int]]]) -> list[Item]:
    """``full``'s literals cut where a span begins or ends, and its holes, each a target or not."""

    def target(start: tuple[int, int], end: tuple[int, int]) -> bool:
        return any(a <= start and end <= b for a, b in spans)

    cuts = {point for span in spans for point in span}
    items: list[Item] = []
    for k, literal in enumerate(full.literals):
        offsets = sorted({0, len(literal), *(off for lit, off in cuts if lit == k)})
        for a, b in itertools.pairwise(offsets):
            items.append((literal[a:b], -1, False, target((k, a), (k, b)), True))
        if k < len(full.holes):
            index, stripped = full.holes[k]
            items.append(("", index, stripped, target((k, len(literal)), (k + 1, 0)), False))
    return items

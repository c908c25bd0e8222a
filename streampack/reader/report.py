"""The outcome of :func:`streampack.reader.verify.verify`: :class:`VerifyReport`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["VerifyReport"]


@dataclass
class VerifyReport:
    """The outcome of :func:`verify`: ``problems`` is empty for a sound cache.

    Attributes:
        path: the cache directory, or the URL of a cache in object storage.
        problems: each damage found, naming its file (or object).
        notes: what is there but not checked (unknown entries, leftovers of an interrupted write); none
            is a problem.
        bytes_checked: bytes read and checked.
        seconds: how long it took.
    """

    path: Path | str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    bytes_checked: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

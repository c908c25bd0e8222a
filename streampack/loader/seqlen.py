"""A run's sequence length over its tokens: :class:`SeqLenSchedule`, e.g. 512 for a warmup, then 2048.

A loader's positions count *units*, windows of the largest length; a unit of ``U`` tokens served at ``l``
is its ``U / l`` sub-windows, in one batch (:mod:`streampack.loader.served`). So no token is served twice
or skipped across a change, and positions, ranks, exclusions and resumes are those of a run without one.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from streampack._checks import check_int
from streampack.errors import OptionsError

__all__ = ["SeqLenSchedule"]


@dataclass(frozen=True, repr=False)
class SeqLenSchedule:
    """The sequence length of a run from each token on: ``[(0, 512), (T, 2048)]`` serves 512 until token
    ``T`` of the run (over all ranks), then 2048, from the first global batch at or after token ``T``.

    Args:
        changes: ``(first token, seq_len)`` pairs, the first at token 0, tokens increasing.

    Raises:
        OptionsError: not such pairs; the message names the pair.
    """

    changes: tuple[tuple[int, int], ...]

    def __init__(self, changes: Iterable[Sequence[int]]) -> None:
        checked: list[tuple[int, int]] = []
        for index, pair in enumerate(tuple(change) for change in changes):
            if len(pair) != 2:
                raise OptionsError(
                    f"seq_len_schedule[{index}] must be a (first token, seq_len) pair (got {pair!r})"
                )
            tokens = check_int(f"seq_len_schedule[{index}] first token", pair[0], min=0, max=2**62)
            length = check_int(f"seq_len_schedule[{index}] seq_len", pair[1], min=1, hint="e.g. 512")
            if checked and tokens <= checked[-1][0]:
                raise OptionsError(
                    f"seq_len_schedule's tokens must increase: pair {index} starts at token {tokens}, "
                    f"pair {index - 1} at {checked[-1][0]}"
                )
            checked.append((tokens, length))
        if not checked:
            raise OptionsError(
                "seq_len_schedule needs at least one (first token, seq_len) pair, e.g. [(0, 512)]"
            )
        if checked[0][0] != 0:
            raise OptionsError(
                f"seq_len_schedule must say the length from token 0 on (its first pair starts at token "
                f"{checked[0][0]}); begin it with (0, seq_len)"
            )
        object.__setattr__(self, "changes", tuple(checked))

    @classmethod
    def of(cls, value: SeqLenSchedule | Iterable[Sequence[int]] | None) -> SeqLenSchedule | None:
        """``value`` as a schedule: one given, one made of pairs, or None (no schedule)."""
        if value is None or isinstance(value, SeqLenSchedule):
            return value
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            raise OptionsError(
                "seq_len_schedule takes a SeqLenSchedule or a list of (first token, seq_len) pairs "
                f"(got {value!r})"
            )
        return cls(value)

    def __repr__(self) -> str:
        return f"SeqLenSchedule({self.to_json()!r})"

    @property
    def lengths(self) -> list[int]:
        """Every length the schedule serves, each once, in their order."""
        return list(dict.fromkeys(length for _, length in self.changes))

    def at(self, tokens: int) -> int:
        """The length in force at token ``tokens`` of the run."""
        return self.changes[bisect.bisect_right(self.changes, tokens, key=lambda change: change[0]) - 1][1]

    def to_json(self) -> list[list[int]]:
        """The pairs as lists, as a history entry records them."""
        return [list(change) for change in self.changes]

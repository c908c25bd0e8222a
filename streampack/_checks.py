"""The one validator of arguments: every option streampack takes is checked here, with one wording.

A wrong argument is an :class:`~streampack.errors.OptionsError` (also a ``ValueError``) of one shape::

    batch_size must be an integer >= 1 (got batch_size=0)
    seed must be an integer in [0, 2**64) (got seed=-1)
    too_long must be one of 'split', 'truncate', 'drop' (got too_long='nope')

Values read from a cache's files are not arguments: a damaged file is a
:class:`~streampack.errors.CacheError`.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import TypeGuard

from streampack.errors import OptionsError

__all__ = ["bounds", "check_bool", "check_choice", "check_int", "check_int_or_none", "is_int"]


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an integer (a Python or numpy one), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def readable(number: int) -> str:
    """``number`` as people read a limit: ``2**k`` for a large power of two, else its digits."""
    if number >= 1 << 16 and number & (number - 1) == 0:
        return f"2**{number.bit_length() - 1}"
    return str(number)


def bounds(min: int | None = None, max: int | None = None, below: int | None = None) -> str:
    """What an integer argument may be: ``an integer in [0, 2**64)``, ``an integer >= 1``, ..."""
    if max is not None and below is not None:
        raise TypeError("give max (inclusive) or below (exclusive), not both")
    top = f"{readable(max)}]" if max is not None else f"{readable(below)})" if below is not None else None
    if min is not None and top is not None:
        return f"an integer in [{readable(min)}, {top}"
    if min is not None:
        return f"an integer >= {readable(min)}"
    if max is not None:
        return f"an integer <= {readable(max)}"
    if below is not None:
        return f"an integer < {readable(below)}"
    return "an integer"


def check_int(
    name: str,
    value: object,
    *,
    min: int | None = None,
    max: int | None = None,
    below: int | None = None,
    hint: str = "",
) -> int:
    """``value`` as a Python int, if it is an integer (not a bool) within the bounds.

    Args:
        name: the argument's name, as the caller wrote it.
        value: what was given.
        min: the smallest value allowed.
        max: the largest value allowed (inclusive)...
        below: ...or the first value past the allowed ones (exclusive).
        hint: what the argument means or what to do, added after the message.

    Raises:
        OptionsError: ``value`` is not such an integer; the message names the bounds and the value.
    """
    if (
        not is_int(value)
        or (min is not None and int(value) < min)
        or (max is not None and int(value) > max)
        or (below is not None and int(value) >= below)
    ):
        raise OptionsError(_message(name, bounds(min, max, below), value, hint))
    return int(value)


def check_int_or_none(
    name: str,
    value: object,
    *,
    min: int | None = None,
    max: int | None = None,
    below: int | None = None,
    hint: str = "",
) -> int | None:
    """``None``, or ``value`` checked as :func:`check_int` does."""
    if value is None:
        return None
    try:
        return check_int(name, value, min=min, max=max, below=below)
    except OptionsError:
        raise OptionsError(_message(name, bounds(min, max, below) + ", or None", value, hint)) from None


def check_choice(name: str, value: object, choices: Iterable[object], *, hint: str = "") -> None:
    """Refuse ``value`` (:class:`OptionsError`, listing them) unless it is one of ``choices``."""
    allowed = tuple(choices)
    if not any(isinstance(value, type(choice)) and value == choice for choice in allowed):
        raise OptionsError(_message(name, f"one of {', '.join(map(repr, allowed))}", value, hint))


def check_bool(name: str, value: object, *, hint: str = "") -> bool:
    """``value`` if it is ``True`` or ``False``, else an :class:`OptionsError` (``1``, ``None``)."""
    if not isinstance(value, bool):
        raise OptionsError(_message(name, "True or False", value, hint))
    return value


def _message(name: str, allowed: str, value: object, hint: str) -> str:
    text = repr(value)
    if len(text) > 200:
        text = text[:197] + "..."
    return f"{name} must be {allowed} (got {name}={text})" + (f"; {hint}" if hint else "")

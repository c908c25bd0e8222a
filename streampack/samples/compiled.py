"""Per-token loops compiled by numba where it is installed (the ``fast`` extra).

A batch's per-token work (FIM's moves, a context-parallel rank's columns) is one pass over its tokens in
a compiled loop, where numpy needs several passes and temporaries. numba is optional: :func:`compiled`
gives None without it (or with ``STREAMPACK_COMPILED=0``), and each caller keeps its numpy path, the
reference the compiled loop is tested against. numba is imported, and a loop compiled (then cached on
disk), on first use, never at ``import streampack``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

__all__ = ["compiled"]


@functools.cache
def _njit() -> Callable[[Callable[..., Any]], Callable[..., Any]] | None:
    if os.environ.get("STREAMPACK_COMPILED", "1") == "0":
        return None
    try:
        import numba
    except ImportError:
        return None
    return numba.njit(cache=True, nogil=True)


def compiled(loop: Callable[..., Any]) -> Callable[[], Callable[..., Any] | None]:
    """A getter of ``loop`` compiled by numba (once, on the first call), or of None without numba.

    Example::

        @compiled
        def _fill(out, value):
            for i in range(out.shape[0]):
                out[i] = value

        fill = _fill()  # None without numba: take the numpy path
    """

    @functools.cache
    def get() -> Callable[..., Any] | None:
        njit = _njit()
        return None if njit is None else njit(loop)

    get.__doc__ = loop.__doc__
    return get

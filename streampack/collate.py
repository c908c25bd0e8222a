"""How the loader formats a batch: from the rows of tokens it read to what a training step takes.

A :class:`~streampack.loader.Loader` reads the tokens of a batch into one ``(rows, width)`` array, then
hands it to the format chosen once from its ``output=`` option:

* ``"numpy"``: :class:`Tokens`, the array itself;
* ``"dict"``: :class:`CausalLMDict`, the ``input_ids`` / ``labels`` / ``position_ids`` arrays Hugging Face
  causal language models take.

A user's ``collate=`` function, when given, is applied after the format.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from streampack.errors import OptionsError
from streampack.layout import Boundaries
from streampack.order import groups

__all__ = ["CausalLMDict", "Format", "Tokens", "format_for"]


class Format(Protocol):
    """Turns a batch's token rows into what the loader yields."""

    def __call__(self, tokens: np.ndarray, sources: np.ndarray, samples: np.ndarray) -> Any:
        """Format ``tokens``, whose row ``k`` is sample ``samples[k]`` of source ``sources[k]``."""
        ...


class Tokens:
    """The token array itself: ``output="numpy"``."""

    def __call__(self, tokens: np.ndarray, sources: np.ndarray, samples: np.ndarray) -> np.ndarray:
        """Return ``tokens`` unchanged."""
        return tokens


class CausalLMDict:
    """``input_ids``, ``labels`` and ``position_ids``, as Hugging Face causal LMs take: ``output="dict"``.

    ``labels`` is a copy of ``input_ids`` (the models shift it themselves); ``position_ids`` restart at 0
    at every document start and every row start, from each source's ``boundaries()``.

    Args:
        sources: the loader's data sources, in source-id order.

    Raises:
        OptionsError: a source has no ``boundaries()`` method, or its samples overlap.
    """

    def __init__(self, sources: Sequence[object]) -> None:
        self._boundaries: list[Callable[[np.ndarray], Boundaries]] = []
        for data in sources:
            if not hasattr(data, "boundaries"):
                raise OptionsError(
                    f"output='dict' needs position ids, which {type(data).__name__} does not provide "
                    "(no boundaries() method); use output='numpy' or cache.sequences(...)"
                )
            overlap = int(getattr(data, "overlap", 0))
            if overlap:
                raise OptionsError(
                    "output='dict' gives labels = input_ids (Hugging Face models shift them inside), so the "
                    f"samples need no overlap (got overlap={overlap}); use cache.sequences(seq_len) with "
                    "overlap=0, or output='numpy' for x/y windows"
                )
            self._boundaries.append(data.boundaries)

    def __call__(self, tokens: np.ndarray, sources: np.ndarray, samples: np.ndarray) -> dict[str, np.ndarray]:
        """The dict of ``tokens``: ``input_ids`` (the array itself), ``labels`` and ``position_ids``."""
        position_ids = self._position_ids(sources, samples, tokens.shape)
        return {"input_ids": tokens, "labels": tokens.copy(), "position_ids": position_ids}

    def _position_ids(self, sources: np.ndarray, samples: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        if len(self._boundaries) == 1:
            return np.asarray(self._boundaries[0](samples).position_ids)
        out = np.empty(shape, dtype=np.int64)
        for source, rows in groups(sources):
            out[rows] = self._boundaries[source](samples[rows]).position_ids
        return out


def format_for(output: str, sources: Sequence[object]) -> Format:
    """The format of ``output`` (``"numpy"`` or ``"dict"``, already validated) for these sources.

    Raises:
        OptionsError: ``output="dict"`` is asked of sources it does not fit (see :class:`CausalLMDict`).
    """
    return CausalLMDict(sources) if output == "dict" else Tokens()

"""Which source each row of a mixture's dict batch comes from, and the weight of its tokens' loss.

A loader of several named sources adds to every dict batch:

* ``source_ids``: ``int64``, ``(rows,)``: the index of each row's source in ``loader.order.names``;
* with the ``loss_weights`` option, ``loss_weights``: ``float32``, ``(rows, seq_len)``: the row's source's
  weight on each token whose label (``shift_labels`` under context parallelism) is not -100, else 0, for a
  loss ``sum(loss_weights * token_loss) / tokens``.

The weights change no token or label served, so they are not in the state: a resume may change them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from streampack.errors import OptionsError

__all__ = ["Domains", "domains_for"]


@dataclass(frozen=True)
class Domains:
    """The per-source keys of a loader's dict batches: ``source_ids``, and ``loss_weights`` when
    ``weights`` (one per source id) is given."""

    weights: tuple[float, ...] | None = None

    def add(self, batch: dict[str, Any], sources: np.ndarray, labels: np.ndarray) -> None:
        """Add the keys to ``batch``, whose row ``k`` is of source ``sources[k]`` and has ``labels[k]``."""
        batch["source_ids"] = np.array(sources, dtype=np.int64)
        if self.weights is not None:
            weights = (labels != -100).astype(np.float32)
            weights *= np.asarray(self.weights, dtype=np.float32)[sources][:, None]
            batch["loss_weights"] = weights


def domains_for(
    loss_weights: Mapping[str, float] | None, names: Sequence[str], *, named: bool, output: str
) -> Domains | None:
    """The :class:`Domains` of a loader whose order reads the sources ``names``; None when it reads one
    dataset (``named`` false) or serves token arrays.

    Raises:
        OptionsError: ``loss_weights`` does not fit the sources or the output.
    """
    if loss_weights is not None and not named:
        raise OptionsError(
            "loss_weights weights the sources of a Mixture (or a dict of sources), and the loader reads one "
            "dataset: give Loader(Mixture(...), loss_weights={...}), or scale the loss yourself"
        )
    if loss_weights is not None and output == "numpy":
        raise OptionsError(
            "loss_weights is a key of dict batches, and output='numpy' serves token arrays; use "
            "output='dict' (or 'varlen', 'hf-flash')"
        )
    if not named or output == "numpy":
        return None
    if loss_weights is None:
        return Domains()
    unknown = sorted(set(loss_weights) - set(names))
    if unknown:
        raise OptionsError(
            f"loss_weights names {', '.join(map(repr, unknown))}, which the mixture does not read; its "
            f"sources are {', '.join(map(repr, names))} (a source not named keeps weight 1.0)"
        )
    return Domains(tuple(float(loss_weights.get(name, 1.0)) for name in names))

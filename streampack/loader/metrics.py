"""What feeding the trainer cost, batch by batch: how long it waited for data, and what was read.

:class:`Made` is measured where a batch is made (the loader's process, or a DataLoader worker). The
**wait** (``data_wait_s``) is measured where the trainer takes the batch, with the clock stopped across
each ``yield``, so that what the trainer does with a batch is never counted as waiting for the next
(ServiceNow/Fast-LLM#567 read its wait ~200x too low until it split the two). A :class:`Meter` adds them
up per consumer. Metrics are not data: they are not in the state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["METRICS", "Made", "Meter", "per_step"]

METRICS = ("data_wait_s", "make_s", "bytes_read", "prefetch_hits", "prefetch_misses")
"""The metrics of a batch, each also counted since the loader was made as ``total_<name>``."""


@dataclass(frozen=True)
class Made:
    """What making one batch took, measured where it was made (see the module).

    Attributes:
        make_s: seconds spent making it (reading, formatting, the loader's ``collate``).
        bytes_read: bytes of tokens read from the sources (padding is not read).
        prefetch_hits: shard files in object storage it mapped that were already local.
        prefetch_misses: shard files in object storage it waited to download.
    """

    make_s: float = 0.0
    bytes_read: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0


_UNKNOWN = Made()


class Meter:
    """The metrics of the batches a consumer took: the last one's, and their totals."""

    def __init__(self) -> None:
        self.batches = 0
        self.last = dict.fromkeys(METRICS, 0.0)
        self.total = dict.fromkeys(METRICS, 0.0)

    def add(self, wait_s: float, made: Made | None) -> None:
        """Count a batch the consumer waited ``wait_s`` seconds for, made as ``made`` says (None: unknown)."""
        made = made or _UNKNOWN
        # Field by field: dataclasses.asdict deep-copies, 20 us a batch (a third of a batch's time).
        values = {
            "data_wait_s": wait_s,
            "make_s": made.make_s,
            "bytes_read": made.bytes_read,
            "prefetch_hits": made.prefetch_hits,
            "prefetch_misses": made.prefetch_misses,
        }
        self.batches += 1
        self.last = values
        total = self.total
        for name, value in values.items():
            total[name] += value

    def as_dict(self) -> dict[str, float]:
        """``batches``, each metric of the last batch, and each metric's total as ``total_<name>``."""
        return {"batches": self.batches, **self.last, **{f"total_{k}": v for k, v in self.total.items()}}


def per_step(now: Mapping[str, float], before: Mapping[str, float] | None, steps: int) -> dict[str, float]:
    """Each metric per trainer step between two :meth:`Meter.as_dict` (``before`` None: since the start),
    named ``data/<metric>`` (``data/wait_s``, ...), as the framework adapters log them."""
    if steps <= 0:
        return {}
    return {
        f"data/{name.removeprefix('data_')}": (
            now[f"total_{name}"] - (before[f"total_{name}"] if before else 0)
        )
        / steps
        for name in METRICS
    }

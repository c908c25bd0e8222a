"""The build's progress bar: input bytes of the total, documents, tokens/s and ETA (tqdm on stderr)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from streampack.builder.tasks import UnitResult
from streampack.format.ledger import LedgerEntry
from streampack.inputs.records import WorkUnit


class BuildProgress:
    """A tqdm bar over input bytes, with documents and tokens/s; silent when disabled."""

    def __init__(self, enabled: bool, units: Sequence[WorkUnit], progress: Sequence[LedgerEntry]) -> None:
        self.enabled = enabled
        self.sizes = {u.index: _unit_size(u) for u in units}
        self.read: dict[int, int] = {}
        self.docs = sum(p.docs for p in progress)
        self.tokens = 0
        self.started = time.perf_counter()
        self.bar: Any = None
        if enabled:
            from tqdm import tqdm

            done = sum(self.sizes[u.index] for u, p in zip(units, progress) if p.done)
            total = sum(self.sizes.values())
            self.bar = tqdm(
                total=total, initial=done, unit="B", unit_scale=True, desc="build", dynamic_ncols=True
            )

    def update(self, event: dict[str, int]) -> None:
        """Count one batch's documents, tokens and input bytes."""
        self.docs += event["docs"]
        self.tokens += event["tokens"]
        unit = event["unit"]
        step = min(event["bytes"], self.sizes[unit] - self.read.get(unit, 0))
        self.read[unit] = self.read.get(unit, 0) + step
        if self.bar is not None:
            self.bar.update(step)
            rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
            self.bar.set_postfix_str(f"{self.docs:,} docs, {rate / 1e6:.2f}M tok/s", refresh=False)

    def unit_done(self, result: UnitResult) -> None:
        """Complete the bar's share of a finished unit."""
        unit = result.unit_index
        if self.bar is not None:
            self.bar.update(self.sizes[unit] - self.read.get(unit, 0))
        self.read[unit] = self.sizes[unit]

    def __enter__(self) -> BuildProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def _unit_size(unit: WorkUnit) -> int:
    if unit.file is None:
        return 0
    if unit.stop is not None and unit.file.format == "jsonl":
        return unit.stop - unit.start
    return sum(f.size for f in unit.files)

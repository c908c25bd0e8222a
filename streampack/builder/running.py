"""Which processes run a build's units (this one, a pool, or Ray), how many, and with how many threads."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from streampack.builder.executors import run_local, run_ray
from streampack.builder.options import RunOptions
from streampack.builder.pipeline import run_units
from streampack.builder.tasks import UnitResult, UnitTask, init_worker
from streampack.tokenizer.base import Tokenizer


def worker_count(todo: list[UnitTask], run: RunOptions, tokenizer: Tokenizer) -> int:
    """Worker processes of the local executor: as asked or chosen, at most one per unit to build."""
    wanted = run.workers or default_workers(tokenizer, os.cpu_count() or 1)
    return min(wanted, max(sum(not t.unit.in_process for t in todo), 1))


def execute(
    todo: list[UnitTask],
    run: RunOptions,
    tokenizer: Tokenizer,
    workers: int,
    report: Callable[[dict[str, int]], None],
) -> Iterable[UnitResult]:
    """Run ``todo``: units read in this process here, the others on the executor ``run`` names."""
    in_process = [t for t in todo if t.unit.in_process]
    pooled = [t for t in todo if not t.unit.in_process]
    here = partial(run_units, tokenizer=tokenizer)  # this process: the tokenizer build() loaded
    yield from run_local(here, in_process, workers=1, on_progress=report)
    if run.executor == "ray":
        # Ray runs one task per CPU of each node (num_cpus=1): one thread each unless asked for more, so
        # that a node's tasks together use its cores without oversubscribing them.
        threads = run.threads or 1
        setup: dict[str, Any] = {"on_progress": report, "initializer": init_worker, "initargs": (threads,)}
        yield from run_ray(run_units, pooled, address=run.ray_address, **setup)
    elif workers == 1:
        yield from run_local(here, pooled, workers=1, on_progress=report)
    else:
        setup = {
            "on_progress": report,
            "initializer": init_worker,
            "initargs": (worker_threads(run, workers),),
        }
        yield from run_local(run_units, pooled, workers=workers, **setup)


def worker_threads(run: RunOptions, workers: int, cores: int | None = None) -> int:
    """Tokenizer threads of each worker process: ``run.threads``, else its share of the cores."""
    return run.threads or max(1, (cores or os.cpu_count() or 1) // workers)


def default_workers(tokenizer: Tokenizer, cores: int) -> int:
    """Worker processes when ``workers`` is not given: one per ``cores_per_worker`` cores of the engine."""
    return max(1, cores // tokenizer.cores_per_worker)

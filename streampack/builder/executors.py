"""Where a build's units run: in this process, in a pool of spawned worker processes, or as Ray tasks; how
many processes, and with how many tokenizer threads each.

Units are independent and each commits its own ledger entry, so an executor only hands out units, collects
results and forwards progress; killing workers is always safe. With Ray the output directory must be on
storage every node sees.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.context
import os
import queue
import signal
import socket
import sys
import threading
import time
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from streampack.builder.options import RunOptions
from streampack.builder.pipeline import run_units
from streampack.builder.tasks import UnitResult, UnitTask, init_worker
from streampack.errors import MissingDependencyError, OptionsError, StreampackError, WorkerDiedError
from streampack.tokenizer.base import Tokenizer

ProgressFn = Callable[[dict[str, int]], None]
UnitsFn = Callable[[Sequence[Any], ProgressFn], Iterator[Any]]

_RAY_POLL_SECONDS = 0.25  # how often the coordinator forwards the Ray tasks' progress events
# ray.init retries an address where no cluster answers for ever, so the address is tried first; a head
# node that answers at all answers at once.
_RAY_CONNECT_SECONDS = 5.0

_log = logging.getLogger(__name__)

_worker_fn: UnitsFn | None = None
_worker_queue: Any = None


def worker_count(todo: list[UnitTask], run: RunOptions, tokenizer: Tokenizer) -> int:
    """Worker processes of the local executor: as asked or chosen, at most one per unit to build."""
    wanted = run.workers or default_workers(tokenizer, os.cpu_count() or 1)
    return min(wanted, max(sum(not t.unit.in_process for t in todo), 1))


def execute(
    todo: list[UnitTask], run: RunOptions, tokenizer: Tokenizer, workers: int, report: ProgressFn
) -> Iterable[UnitResult]:
    """Run ``todo``: units read in this process here, the others on the executor ``run`` names."""
    elsewhere = run.executor == "ray" or workers > 1
    here = [t for t in todo if t.unit.in_process or not elsewhere]
    yield from run_units(here, report, tokenizer)  # this process: with the tokenizer build() loaded
    pooled = [t for t in todo if not t.unit.in_process] if elsewhere else []
    if run.executor == "ray":
        # Ray runs one task per CPU of each node (num_cpus=1): one thread each unless asked for more, so
        # that a node's tasks together use its cores without oversubscribing them.
        threads = run.threads or 1
        yield from run_ray(run_units, pooled, address=run.ray_address, on_progress=report, threads=threads)
    elif pooled:
        yield from run_local(
            run_units, pooled, workers=workers, on_progress=report, threads=worker_threads(run, workers)
        )


def worker_threads(run: RunOptions, workers: int, cores: int | None = None) -> int:
    """Tokenizer threads of each worker process: ``run.threads``, else its share of the cores."""
    return run.threads or max(1, (cores or os.cpu_count() or 1) // workers)


def default_workers(tokenizer: Tokenizer, cores: int) -> int:
    """Worker processes when ``workers`` is not given: one per ``cores_per_worker`` cores of the engine."""
    return max(1, cores // tokenizer.cores_per_worker)


def run_local(
    units_fn: UnitsFn, tasks: Sequence[Any], *, workers: int, on_progress: ProgressFn, threads: int
) -> Iterator[Any]:
    """Run every task through ``units_fn(tasks, report)``, one unit per call in ``workers`` spawned
    processes of ``threads`` tokenizer threads each, and yield the results as units finish. The first error
    stops all workers and is raised here."""
    context = _SpawnContext()
    events = context.Queue()
    stop = threading.Event()
    forwarder = threading.Thread(target=_forward, args=(events, on_progress, stop), daemon=True)
    forwarder.start()
    executor = ProcessPoolExecutor(
        workers,
        mp_context=context,
        initializer=_init_worker,
        initargs=(units_fn, events, os.getpid(), threads),
    )
    try:
        pending: set[Future[Any]] = {executor.submit(_run_in_worker, task) for task in tasks}
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for future in done:
                yield future.result()
    except BrokenProcessPool:
        raise WorkerDiedError(
            "a build worker process died (killed, or out of memory); rerun the same command to resume"
        ) from None
    finally:
        # ProcessPoolExecutor has no public way to stop running tasks before Python 3.14; units are
        # crash-safe by design, so terminating their processes loses nothing committed.
        processes = list(getattr(executor, "_processes", {}).values())
        executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join()
        stop.set()
        forwarder.join()
        events.close()


class _WorkerProcess(multiprocessing.context.SpawnProcess):
    """A spawned pool worker that does not re-run the user's main script.

    The workers need only streampack's functions, and a script without an ``if __name__ == "__main__":``
    guard would otherwise run its build again in every worker. multiprocessing decides what a child re-runs
    from ``sys.modules["__main__"]`` while it starts, so the start is shown a bare module.
    """

    def start(self) -> None:
        """Start the process without ``init_main_from_path``/``init_main_from_name`` in its preparation."""
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            super().start()
        finally:
            sys.modules["__main__"] = main


class _SpawnContext(multiprocessing.context.SpawnContext):
    """The spawn start method (not fork: tokenizer thread pools and fork do not mix), with our workers."""

    Process = _WorkerProcess


def _forward(events: Any, on_progress: ProgressFn, stop: threading.Event) -> None:
    while not stop.is_set() or not events.empty():
        try:
            on_progress(events.get(timeout=0.1))
        except queue.Empty:
            continue
        except (EOFError, OSError):
            return


def _init_worker(units_fn: UnitsFn, events: Any, coordinator: int, threads: int) -> None:
    global _worker_fn, _worker_queue
    if sys.platform.startswith("linux"):
        # SIGKILL this worker when the coordinator dies, so that an orphan never appends to a shard that
        # the rerun resumes.
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != coordinator:  # the coordinator died before prctl took effect
            os._exit(1)
    _worker_fn, _worker_queue = units_fn, events
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    init_worker(threads)


def _run_in_worker(task: Any) -> Any:
    assert _worker_fn is not None
    (result,) = _worker_fn([task], _worker_queue.put)
    return result


def run_ray(
    units_fn: UnitsFn,
    tasks: Sequence[Any],
    *,
    address: str | None,
    on_progress: ProgressFn,
    threads: int | None = None,
) -> Iterator[Any]:
    """Run ``units_fn`` on every task, one Ray task per unit (of ``threads`` tokenizer threads), and yield
    the results as units finish.

    Connects to the cluster at ``address`` (``auto``: a running one; None: a new local one if none runs).
    The first error cancels the other tasks and is raised here. A failed task is not retried (its node may
    still be writing its shard): the rerun resumes from the ledger. Each finished task's node is logged at
    DEBUG level.

    Raises:
        OptionsError: nothing answers at ``address``, or no running cluster was found for ``auto``.
        WorkerDiedError: a task, its worker, its node or the progress queue was lost.
        MissingDependencyError: Ray is not installed.
    """
    try:
        import ray
        from ray.util.queue import Queue
    except ImportError:
        raise MissingDependencyError("the ray executor needs Ray: pip install 'streampack[ray]'") from None
    started_here = not ray.is_initialized()
    if started_here:
        _connect(ray, address)
    events = None
    pending: list[Any] = []
    try:
        events = Queue(actor_options={"num_cpus": 0})  # holds no core the units could use
        remote = ray.remote(num_cpus=1, max_retries=0)(_run_ray_task)
        pending = [remote.remote(units_fn, task, threads, events) for task in tasks]
        numbers = {ref: number for number, ref in enumerate(pending, 1)}
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=_RAY_POLL_SECONDS)
            waiting = events.qsize()  # a task's events are all queued before it returns
            for event in events.get_nowait_batch(waiting) if waiting else ():
                on_progress(event)
            for ref in done:
                node, result = ray.get(ref)
                _log.debug("unit task %d of %d ran on Ray node %s", numbers[ref], len(numbers), node)
                yield result
    except ray.exceptions.RayError as e:
        cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) else e
        if isinstance(cause, StreampackError):
            raise cause from None
        if not isinstance(cause, ray.exceptions.RayError):
            raise  # a bug in the units' code, not a failure of Ray: keep its traceback
        raise WorkerDiedError(
            f"a Ray worker of the build failed ({type(cause).__name__}: killed, out of memory, or its node "
            "was lost); rerun the same command to resume"
        ) from None
    finally:  # cancel the tasks still running and stop the queue; those that died need no stopping
        for ref in pending:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.cancel(ref, force=True)
        if events is not None:
            with contextlib.suppress(ray.exceptions.RayError):
                events.shutdown()
        if started_here:
            ray.shutdown()


def _connect(ray: Any, address: str | None) -> None:
    """``ray.init`` at ``address``, with an error naming it when no cluster answers there."""
    if address is not None and address not in ("auto", "local"):
        _probe(address)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except ConnectionError as e:  # "auto" with no cluster running, or one that went away meanwhile
        raise OptionsError(
            f"could not connect to a Ray cluster at ray_address={address!r} ({e}); start one there "
            "(`ray start --head`) and pass the address it prints, or leave ray_address unset for a local "
            "instance"
        ) from None


def _probe(address: str) -> None:
    """Raise :class:`OptionsError` unless something listens at ``address`` (``HOST:PORT``, ``ray://…``)."""
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    if not colon or not port.isdigit():
        return  # not HOST:PORT: Ray says what it makes of it
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=_RAY_CONNECT_SECONDS).close()
    except OSError as e:
        reason = e.strerror or str(e) or type(e).__name__
        raise OptionsError(
            f"no Ray cluster answers at ray_address={address!r} ({reason}, {_RAY_CONNECT_SECONDS:g} s "
            "allowed): start it (`ray start --head --port PORT` on the head node) or pass the address that "
            "`ray status` shows there"
        ) from None


def _run_ray_task(units_fn: UnitsFn, task: Any, threads: int | None, events: Any) -> Any:
    import ray

    if threads is not None:
        init_worker(threads)
    report = _TaskEvents(events)
    (result,) = units_fn([task], report)
    report.flush()  # before returning: the coordinator forwards a finished task's events in full
    return ray.get_runtime_context().get_node_id(), result


class _TaskEvents:
    """A Ray task's progress events, sent every ``_RAY_POLL_SECONDS``: each send is a blocking round trip
    to the queue's actor, and one per batch was most of a Ray build's time."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue
        self.waiting: list[dict[str, int]] = []
        self.sent = time.monotonic()

    def __call__(self, event: dict[str, int]) -> None:
        self.waiting.append(event)
        if time.monotonic() - self.sent >= _RAY_POLL_SECONDS:
            self.flush()

    def flush(self) -> None:
        """Send the events not yet sent."""
        if self.waiting:
            self.queue.put_nowait_batch(self.waiting)
            self.waiting = []
        self.sent = time.monotonic()

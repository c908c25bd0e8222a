"""Where a build's time goes: seconds per part of the pipeline, summed over worker processes (``--profile``).

The reader and writer threads each charge their time to the timing they are in (:class:`Stopwatch`); calls
on the encoder threads are timed there and added.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TypeVar

T = TypeVar("T")
_END = object()

# The order of the table's rows; timings not listed follow in the order met.
TIMINGS = (
    "start",  # a worker process's start: the interpreter and imports (CPU only)
    "prepare",  # the coordinating process: list inputs, load the tokenizer, plan units, check the output
    "load tokenizer",  # a worker process's own load
    "read",  # read records as they are stored (I/O, decompression), not parsed
    "blocks",  # group them into blocks, hand the encoded ones to the writer
    "wait",  # the reader waits for encoder threads (the engine is the bottleneck) or for the writer
    "parse",  # on encoder threads: parse the records (JSON), cut documents into pieces
    "encode",  # on encoder threads: the engine's batch calls
    "verify",  # on encoder threads: the reference engine's re-encoding of the sampled records
    "frame",  # on encoder threads: check the ids, add BOS/EOS, narrow them to the cache's dtype
    "write wait",  # the writer thread waits for the next batch (the reader or the engine is the bottleneck)
    "write",  # on the writer thread: append to the shard, commit (fsync, ledger), checksum a finished shard
)
_THREADED = ("parse", "encode", "verify", "frame")  # wall seconds of calls on the encoder threads
_WRITER = ("write wait", "write")  # timed on the writer thread, with its CPU when profiling

# The process's CPU seconds already reported: 0 until a worker's first unit reports its start-up as "start".
_process_cpu_taken = 0.0


def mark_process_start() -> None:
    """Count this process's CPU from now: the build's coordinator, whose earlier CPU is not the build's."""
    global _process_cpu_taken
    _process_cpu_taken = time.process_time()


class Stopwatch:
    """Wall seconds per timing of one thread, and with ``cpu`` (a system call per switch) its CPU seconds."""

    def __init__(self, timing: str = "other", *, cpu: bool = False) -> None:
        self.seconds: dict[str, list[float]] = {}  # timing -> [wall, cpu]
        self.cpu = cpu
        self._timing = timing
        self._since = self._now()

    def measure_cpu(self, on: bool) -> None:
        """Start (or stop) reading the thread's CPU clock at the next switch."""
        if on != self.cpu:
            self.switch(self._timing)
            self.cpu = on
            self._since = self._now()

    def charge_start(self) -> None:
        """Charge this worker process's start-up CPU to "start", once, when measuring CPU."""
        global _process_cpu_taken
        if self.cpu and _process_cpu_taken == 0.0:
            _process_cpu_taken = time.process_time()
            self._charge("start", 0.0, _process_cpu_taken)

    def _now(self) -> tuple[float, float]:
        return time.perf_counter(), time.thread_time() if self.cpu else 0.0

    def switch(self, timing: str) -> str:
        """Charge the time since the last switch to the current timing, enter ``timing``; return the old."""
        now = self._now()
        self._charge(self._timing, now[0] - self._since[0], now[1] - self._since[1])
        previous, self._timing, self._since = self._timing, timing, now
        return previous

    def _charge(self, timing: str, wall: float, cpu: float) -> None:
        times = self.seconds.setdefault(timing, [0.0, 0.0])
        times[0] += wall
        times[1] += cpu

    @contextlib.contextmanager
    def timing(self, timing: str) -> Iterator[None]:
        """Charge a ``with`` block to ``timing``, then go back to the timing before it."""
        previous = self.switch(timing)
        try:
            yield
        finally:
            self.switch(previous)

    def timed(self, items: Iterable[T], timing: str) -> Iterator[T]:
        """``items``, the time spent producing each charged to ``timing``."""
        iterator = iter(items)
        while True:
            previous = self.switch(timing)
            item = next(iterator, _END)
            self.switch(previous)
            if item is _END:
                return
            yield item  # type: ignore[misc]

    def add(self, timing: str, wall: float) -> None:
        """Add wall seconds measured on another thread to ``timing`` (its CPU is in the process's)."""
        self._charge(timing, wall, 0.0)

    def take(self, *, process: bool = True) -> dict[str, list[float]]:
        """The times charged since the last take; with ``cpu`` and ``process``, the process's CPU too."""
        self.switch(self._timing)
        taken, self.seconds = self.seconds, {}
        if self.cpu and process:
            global _process_cpu_taken
            now = time.process_time()
            taken["process"] = [0.0, now - _process_cpu_taken]
            _process_cpu_taken = now
        return taken


def add_up(parts: Iterable[Mapping[str, Sequence[float]]]) -> dict[str, list[float]]:
    """The sum of several timing tables (``timing -> [wall, cpu]``)."""
    total: dict[str, list[float]] = {}
    for part in parts:
        for timing, (wall, cpu) in part.items():
            times = total.setdefault(timing, [0.0, 0.0])
            times[0] += wall
            times[1] += cpu
    return total


def render(times: Mapping[str, Sequence[float]], wall: float, workers: int) -> str:
    """A markdown table of ``times`` (``timing -> [wall, cpu]``) summed over ``workers`` processes.

    Encoder-thread calls have wall seconds only (they overlap the others'); "engine threads" is the CPU
    spent outside the reader and writer threads.
    """
    main = [s for s in TIMINGS if s in times and s not in _THREADED + _WRITER]
    main += [s for s in times if s not in TIMINGS and s != "process"]
    lines = ["| timing | thread | wall s | CPU s |", "|---|---|---:|---:|"]
    for timing in main:
        if timing == "other" and times[timing][0] < 0.0005:
            continue
        wall_s = "" if timing == "start" else f"{times[timing][0]:.3f}"
        lines.append(f"| {timing} | main | {wall_s} | {times[timing][1]:.3f} |")
    for timing in _THREADED:
        if timing in times:
            lines.append(f"| {timing} calls | encoder threads | {times[timing][0]:.3f} | |")
    for timing in _WRITER:
        if timing in times:
            lines.append(f"| {timing} | writer | {times[timing][0]:.3f} | {times[timing][1]:.3f} |")
    if "process" in times:
        measured = [s for s in main + list(_WRITER) if s in times and s not in ("prepare", "start")]
        start = times.get("start", [0.0, 0.0])[1]
        engine = times["process"][1] - sum(times[s][1] for s in measured)
        lines.append(f"| engine threads | others | | {engine:.3f} |")
        lines.append(f"| all processes | | | {times['process'][1] + start + times['prepare'][1]:.3f} |")
    plural = "es" if workers != 1 else ""
    lines.append(f"| build, wall ({workers} worker process{plural}) | | {wall:.3f} | |")
    return "\n".join(lines)

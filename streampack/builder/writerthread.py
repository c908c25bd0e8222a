"""The writer thread: encoded blocks appended to their shards and committed, in order, off the reader.

Writes, fsyncs and checksums wait for the disk and release the GIL, so the reader need not stop for them
(345 MB x 4 on 2 cores: 1.4 s were on the reader before). The writer runs no per-document Python. A failed
write is raised in the reading thread at its next hand-over; after it the writer writes nothing more.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

from streampack.builder.commits import OpenUnit
from streampack.builder.tasks import UnitResult
from streampack.builder.timings import Stopwatch
from streampack.format.ledger import Counts


@dataclass
class Framed:
    """A batch's tokens, ready to append, and whether the unit commits after them."""

    unit: OpenUnit
    tokens: np.ndarray  # in the cache's dtype
    doc_ends: np.ndarray  # the completed documents' ends, relative to the first token
    mask: np.ndarray | None  # SFT builds: the loss mask
    counts: Counts  # what a commit after this batch records
    commit: bool = False  # commit after appending
    last: bool = False  # the unit's last batch: commit it as done, then close the shard


class WriterThread:
    """Appends and commits handed batches in order on a thread of its own; at most ``capacity`` wait."""

    def __init__(self, capacity: int) -> None:
        self._queue: queue.Queue[Framed | None] = queue.Queue(capacity)
        self._error: BaseException | None = None
        self._finished: deque[UnitResult] = deque()
        self._thread = threading.Thread(target=self._run, name="streampack-write", daemon=True)
        self._thread.start()

    def put(self, framed: Framed) -> None:
        """Hand over ``framed`` (waits while ``capacity`` wait); raises the writer's error, if any."""
        self.raise_error()
        self._queue.put(framed)

    def drain(self) -> None:
        """Wait until every batch handed over is written; raises the writer's error, if any."""
        self._queue.join()
        self.raise_error()

    def raise_error(self) -> None:
        """Raise the error that stopped the writer, if one did."""
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        """End the thread; what it was handed and has not written is dropped."""
        if self._error is None:
            self._error = _Stopped()
        self._queue.put(None)
        self._thread.join()

    def take_finished(self) -> list[UnitResult]:
        """The results of the units completed since the last call (their timings: the writer's own)."""
        return [self._finished.popleft() for _ in range(len(self._finished))]

    def _run(self) -> None:
        watch = Stopwatch("write wait")
        while (framed := self._queue.get()) is not None:
            try:
                if self._error is None:
                    watch.measure_cpu(framed.unit.spec.profile)
                    with watch.timing("write"):
                        self._write(framed, watch)
            except BaseException as e:  # raised in the reading thread; nothing more is written
                self._error = e
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, framed: Framed, watch: Stopwatch) -> None:
        writer = framed.unit.writer
        if len(framed.tokens):
            writer.append(framed.tokens, framed.doc_ends, framed.mask)
        if framed.last:
            final = writer.commit(framed.counts, done=True)
            writer.close()
            self._finished.append(UnitResult(framed.unit.task.unit.index, final, watch.take(process=False)))
        elif framed.commit:
            writer.commit(framed.counts)


class _Stopped(Exception):
    """The writer was stopped (the reading thread is leaving on an error of its own)."""

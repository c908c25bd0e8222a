"""A unit being built: its open shard, where its reading is, when it last committed, and its counts."""

from __future__ import annotations

import time
from dataclasses import astuple
from pathlib import Path

import numpy as np

from streampack.builder.tasks import UnitTask
from streampack.builder.writer import ShardWriter
from streampack.format.ledger import Counts, LedgerEntry
from streampack.format.names import shard_name
from streampack.inputs.records import Position
from streampack.tokenizer.base import Tokenizer


class OpenUnit:
    """A unit whose shard is open: its writer, and what the next commit and progress event need."""

    def __init__(self, task: UnitTask, progress: LedgerEntry, tokenizer: Tokenizer) -> None:
        self.task, self.spec, self.tokenizer = task, task.spec, tokenizer
        dtype = np.dtype(task.spec.dtype)
        self.writer = ShardWriter(
            Path(task.spec.root), shard_name(task.unit.index), dtype, progress, masked=task.spec.read.sft
        )
        self.dtype = dtype
        self.eos = task.spec.eos.id if task.spec.eos.append else None
        self.id_limit = task.spec.vocab_size or int(np.iinfo(dtype).max) + 1
        self.bos = task.spec.bos.id if task.spec.bos.prepend else None
        self.position = Position()
        self.reported_bytes = 0
        self.tokens = self.writer.num_tokens  # framed so far (the writer thread appends them after)
        self.counts = progress.counts  # the records of those tokens
        self.last_commit = (time.monotonic(), self.tokens)

    def add(self, counts: Counts) -> None:
        """Add a block's own counts to the unit's."""
        self.counts = Counts(*(a + b for a, b in zip(astuple(self.counts), astuple(counts))))

    def bytes_read_delta(self) -> int:
        """Input bytes read since the last call."""
        now = max(self.position.bytes_read() - self.task.unit.start, 0)
        delta, self.reported_bytes = now - self.reported_bytes, now
        return max(delta, 0)

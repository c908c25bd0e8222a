"""The build's ledger, one small JSON file per work unit: :class:`LedgerEntry` and parsing an entry.

A unit's entry says how many input records it has consumed and how many documents and tokens of its
shard are durable. The writer fsyncs shard data *before* the entry that covers it is atomically replaced,
so after a crash the entry never claims more than the disk holds; the resumed unit truncates its shard to
the entry's lengths and skips the records it names. One file per unit lets worker processes commit
without talking to each other. Reading and writing entries through a store is
:mod:`streampack.store.files`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from streampack.errors import CacheError, read_json
from streampack.format.names import content_checksum

_Count = Annotated[int, msgspec.Meta(ge=0)]
_REBUILD = "rerun the build with overwrite=True"


@dataclass(frozen=True)
class Counts:
    """What a unit's input records held, counted up to a commit (see :class:`LedgerEntry`)."""

    records: int = 0
    skipped: int = 0
    empty_docs: int = 0
    inexact_cuts: int = 0


class LedgerEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one work unit has durably committed.

    Attributes:
        unit: the unit's description (input and range), to detect a ledger from a different plan.
        records: input records consumed (documents written plus records skipped or blank).
        docs: documents in the shard.
        tokens: tokens in the shard.
        skipped: bad records skipped (with ``on_bad_record="skip"``).
        done: the unit reached the end of its input and its shard is final.
        tokens_checksum: checksum of the final token file (set when done).
        offsets_checksum: checksum of the final offsets file (set when done).
        empty_docs: documents left out as empty or whitespace only.
        inexact_cuts: memory cuts in long documents (see :mod:`streampack.tokenizer.pieces`).
        mask_checksum: checksum of the final loss mask file (set when done; SFT builds only).
    """

    unit: str
    records: _Count = 0
    docs: _Count = 0
    tokens: _Count = 0
    skipped: _Count = 0
    done: bool = False
    tokens_checksum: str = ""
    offsets_checksum: str = ""
    empty_docs: _Count = 0
    inexact_cuts: _Count = 0
    mask_checksum: str = ""

    @property
    def counts(self) -> Counts:
        """The record counts this progress holds."""
        return Counts(self.records, self.skipped, self.empty_docs, self.inexact_cuts)


def parse_entry(raw: Any, path: str) -> LedgerEntry:
    """The ledger entry in ``raw``, the parsed JSON of the file ``path``, checked (an entry written before
    the checksum existed has none).

    Raises:
        CacheError: the entry does not match its checksum, holds an unknown key, lacks ``unit``, or holds
            a value of the wrong type (the message names its JSON path).
    """
    if isinstance(raw, dict) and "checksum" in raw:
        expected, actual = raw["checksum"], content_checksum(raw)
        if expected != actual:
            raise CacheError(
                f"{path}: the ledger entry's content does not match its checksum (recorded {expected!r:.40}, "
                f"content {actual}); it was damaged or edited: {_REBUILD}"
            )
        raw = {key: value for key, value in raw.items() if key != "checksum"}
    return read_json(raw, LedgerEntry, CacheError, f"{path}: malformed ledger entry", _REBUILD)

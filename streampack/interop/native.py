"""streampack's own cache as an export format: what ``streampack convert`` writes from another format.

``export(cache, "streampack", DEST)`` writes a native cache (``docs/FORMAT.md``): ``shards/NNNNNN.tokens``,
``.offsets`` (and ``.mask``), a finished ledger entry a shard, and a complete ``manifest.json`` with every
file's CRC-32 (so that ``streampack verify`` checks it), written last. The manifest keeps what the
source's said: its tokenizer (declared, or ``undeclared``), EOS, BOS, inputs (the foreign files, with their
sizes and times) and ``settings.foreign``. A source shard becomes one or more shards of at most
``shard_tokens`` tokens, cut between documents (a document longer than that is a shard of its own).

Tokens are copied by the kernel where the source holds them end to end in a file (every format but MDS);
their CRC-32 is computed meanwhile on another thread, from the source's pages (with ISA-L's CRC-32 where
``isal`` is installed, :data:`streampack.format.names.crc32`: a tenth of the copy's time), so the convert
runs at about the speed of a plain copy.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING

import numpy as np

from streampack.format.ledger import LedgerEntry
from streampack.format.manifest import ShardTable
from streampack.format.names import (
    MANIFEST,
    checksum_text,
    crc32,
    ledger_key,
    mask_key,
    offsets_key,
    shard_name,
    tokens_key,
    with_checksum,
)
from streampack.interop.writing import (
    Destination,
    Progress,
    ShardDocs,
    check_int_option,
    doc_chunks,
    release_maps,
    shard_docs,
    write_spans,
)
from streampack.store import encode_json

if TYPE_CHECKING:
    from streampack.reader import Cache

LAYOUT = "directory"
#: Tokens a shard holds at most by default (512 MiB of uint16).
SHARD_TOKENS = 1 << 28
#: Bytes a CRC read takes at a time: a buffer that stays in the CPU's cache (16 MiB ones were 15% slower).
_CRC_BYTES = 1 << 20


@dataclass(frozen=True)
class Options:
    """Options of the native export.

    Attributes:
        shard_tokens: tokens a shard holds at most (cut between documents).
    """

    shard_tokens: int = SHARD_TOKENS

    def __post_init__(self) -> None:
        check_int_option("shard_tokens", self.shard_tokens, low=1)


def check(cache: Cache, options: Options) -> None:
    """Nothing to refuse: a native cache keeps tokens, boundaries, masks and the manifest's policies."""


def write(
    cache: Cache, dest: Destination, options: Options, progress: bool
) -> tuple[int, int, Sequence[str]]:
    """Write the shards, then the manifest (committed last)."""
    docs_column: list[int] = []
    tokens_column: list[int] = []
    crcs: list[list[int]] = []
    units: list[str] = []
    with Progress(progress, cache.num_tokens, "streampack") as bar:
        for docs in shard_docs(cache):
            unit = cache.manifest.units[docs.shard]
            for first, stop in doc_chunks(cache, docs, options.shard_tokens):
                name = shard_name(len(units))
                crcs.append(_write_shard(cache, docs, first, stop, name, dest))
                start = int(docs.ends[first - 1]) if first else 0
                docs_column.append(stop - first)
                tokens_column.append(int(docs.ends[stop - 1]) - start)
                whole = first == 0 and stop == len(docs.ends)
                units.append(unit if whole else f"{unit}[documents {first}:{stop}]")
                _write_entry(dest, name, units[-1], docs_column[-1], tokens_column[-1], crcs[-1], cache)
                bar.update(tokens_column[-1])
            release_maps(cache)  # one source shard's arrays at a time (an MDS shard's is a copy)
    columns = np.array(crcs, dtype=np.uint32).reshape(-1, 3)
    table = ShardTable(
        np.array(docs_column, dtype=np.int64),
        np.array(tokens_column, dtype=np.int64),
        tokens_crc32=columns[:, 0],
        offsets_crc32=columns[:, 1],
        mask_crc32=columns[:, 2] if cache.has_loss_mask else None,
    )
    manifest = replace(cache.manifest, units=units, table=table, complete=True)
    with dest.open(MANIFEST) as out:
        out.write(encode_json(with_checksum(manifest.to_json())))
    return cache.num_docs, cache.num_tokens, [MANIFEST]


def _write_entry(
    dest: Destination, name: str, unit: str, docs: int, tokens: int, crcs: list[int], cache: Cache
) -> None:
    """The ledger entry of a finished unit, as a build leaves it (``verify`` checks one a shard)."""
    mask = checksum_text(crcs[2]) if cache.has_loss_mask else ""
    entry = LedgerEntry(unit, records=docs, docs=docs, tokens=tokens, done=True,
                        tokens_checksum=checksum_text(crcs[0]), offsets_checksum=checksum_text(crcs[1]),
                        mask_checksum=mask)  # fmt: skip
    with dest.open(ledger_key(name)) as out:
        out.write(encode_json(with_checksum(asdict(entry))))


def _write_shard(
    cache: Cache, docs: ShardDocs, first: int, stop: int, name: str, dest: Destination
) -> list[int]:
    """Write one native shard of documents ``[first, stop)`` of ``docs``; its files' CRC-32s."""
    start = int(docs.ends[first - 1]) if first else 0
    end = int(docs.ends[stop - 1])
    with dest.open(tokens_key(name)) as out:
        tokens_crc = _copy_with_crc(cache, docs.shard, out, start, end)
    offsets = (docs.ends[first:stop] - start).astype("<u8")
    with dest.open(offsets_key(name)) as out:
        out.write(offsets.tobytes())
    sums = [tokens_crc, crc32(offsets.data)]
    if cache.has_loss_mask:
        mask = np.ascontiguousarray(cache.shard_loss_mask(docs.shard)[start:end], dtype=np.uint8)
        with dest.open(mask_key(name)) as out:
            out.write(mask.data)
        sums.append(crc32(mask.data))
    else:
        sums.append(0)
    return sums


def _copy_with_crc(cache: Cache, shard: int, out: IO[bytes], start: int, end: int) -> int:
    """Copy tokens ``[start, end)`` of ``shard`` to ``out`` while another thread computes their CRC-32."""
    result = [0]
    where = cache.files.token_file(shard)
    summer = threading.Thread(
        target=_crc_of_file if where is not None else _crc_of_array,
        args=(result, where, cache.dtype.itemsize, start, end)
        if where is not None
        else (result, cache.shard_tokens(shard)[start:end], cache),
        name="streampack-convert-crc",
        daemon=True,
    )
    summer.start()
    try:
        write_spans(cache, shard, cache.dtype.newbyteorder("<"), [(out, start, end)])
    finally:
        summer.join()
    return result[0]


def _crc_of_file(result: list[int], where: tuple[Path, int], itemsize: int, start: int, end: int) -> None:
    """The CRC-32 of tokens ``[start, end)`` of a token file, by plain reads into one buffer: pages of a
    memory map would count towards the process's memory until unmapped."""
    path, base = where
    buffer = bytearray(_CRC_BYTES)
    view, crc = memoryview(buffer), 0
    with open(path, "rb", buffering=0) as f:
        at, stop = base + start * itemsize, base + end * itemsize
        while at < stop:
            n = os.preadv(f.fileno(), [view[: min(_CRC_BYTES, stop - at)]], at)
            if n == 0:
                break  # cut short meanwhile: the copy says so
            crc = crc32(view[:n], crc)
            at += n
    result[0] = crc


def _crc_of_array(result: list[int], tokens: np.ndarray, cache: Cache) -> None:
    """The CRC-32 of tokens held in memory (a shard not stored end to end: MDS samples)."""
    raw = np.ascontiguousarray(tokens, dtype=cache.dtype.newbyteorder("<")).view(np.uint8)
    crc = 0
    for at in range(0, len(raw), _CRC_BYTES):
        crc = crc32(raw[at : at + _CRC_BYTES].data, crc)
    result[0] = crc

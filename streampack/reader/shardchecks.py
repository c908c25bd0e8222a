"""The checks of a cache's shard files, for :func:`streampack.reader.verify.verify`.

Checksums, the offset table, the token range, EOS and BOS at every document's end and start and nowhere
else, an SFT build's loss mask (0 or 1, 1 at every EOS, 0 at every BOS), and, where shards may begin
inside a document (llm.c's), that the delimiter occurs at all. Each file is read once in chunks, mapped
(:class:`Mapped`) or streamed from object storage (:class:`Streamed`), so memory stays bounded.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from streampack.errors import CacheError
from streampack.format.manifest import Manifest, ShardInfo
from streampack.format.names import OFFSET_DTYPE, checksum_text, crc32, mask_key, offsets_key, tokens_key
from streampack.reader.cache import Cache
from streampack.store.remote import RemoteStore

__all__ = ["Mapped", "Streamed", "check_shards"]

_CHUNK_ITEMS = 8 << 20
_SHOWN = 3  # control ids inside documents listed in the report, of a shard


class _Source(Protocol):
    """Where verify reads a shard's files, by key (``read``: the bytes its chunks held so far)."""

    read: int

    def describe(self, key: str) -> str: ...

    def chunks(self, key: str, dtype: np.dtype, count: int) -> Iterator[np.ndarray]: ...

    def first(self, key: str, dtype: np.dtype, count: int) -> int: ...


def _whole(source: _Source, key: str, dtype: np.dtype, count: int) -> np.ndarray:
    parts = list(source.chunks(key, dtype, count))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


class Mapped:
    """A local cache's files, mapped by the reader (which checks their sizes and where they lead)."""

    def __init__(self, cache: Cache) -> None:
        self.cache, self.read = cache, 0

    def describe(self, key: str) -> str:
        shard, kind = _shard_kind(key)
        return self.cache.files.describe(shard, kind)

    def chunks(self, key: str, dtype: np.dtype, count: int) -> Iterator[np.ndarray]:
        array = self._array(key)
        for start in range(0, len(array), _CHUNK_ITEMS):
            self.read += array[start : start + _CHUNK_ITEMS].nbytes
            yield array[start : start + _CHUNK_ITEMS]

    def first(self, key: str, dtype: np.dtype, count: int) -> int:
        return int(self._array(key)[0])

    def _array(self, key: str) -> np.ndarray:
        shard, kind = _shard_kind(key)
        if kind == "tokens":
            return self.cache.shard_tokens(shard)
        return self.cache.raw_offsets(shard) if kind == "offsets" else self.cache.shard_loss_mask(shard)


def _shard_kind(key: str) -> tuple[int, str]:
    """The shard index and the kind (tokens, offsets or mask) of a shard file's key."""
    kind = key.rsplit(".", 1)[-1]
    return int(key.split("/")[-1].split(".")[0]), kind if kind in ("tokens", "offsets") else "mask"


class Streamed:
    """A remote cache's objects, read in ranged chunks (nothing kept but the chunk in hand)."""

    def __init__(self, remote: RemoteStore, sizes: dict[str, int]) -> None:
        self.remote, self.sizes, self.read = remote, sizes, 0

    def describe(self, key: str) -> str:
        return self.remote.describe(key)

    def chunks(self, key: str, dtype: np.dtype, count: int) -> Iterator[np.ndarray]:
        size = self.sizes.get(key.split("/")[-1])
        expected = count * dtype.itemsize
        if size is None:
            raise CacheError(f"{self.describe(key)}: shard object missing; the cache is damaged, rebuild it")
        if size != expected:
            raise CacheError(
                f"{self.describe(key)}: {size} bytes, but the manifest says {count} items ({expected} "
                "bytes); the cache is damaged or truncated: rebuild it"
            )
        step = _CHUNK_ITEMS * dtype.itemsize
        for start in range(0, expected, step):
            data = self.remote.read(key, start, min(expected, start + step))
            if len(data) != min(step, expected - start):
                raise CacheError(f"{self.describe(key)}: the object changed while it was read; verify again")
            self.read += len(data)
            yield np.frombuffer(data, dtype=dtype)

    def first(self, key: str, dtype: np.dtype, count: int) -> int:
        data = self.remote.read(key, 0, dtype.itemsize)
        if len(data) != dtype.itemsize:
            raise CacheError(f"{self.describe(key)}: shorter than one token; the cache is damaged")
        return int(np.frombuffer(data, dtype=dtype)[0])


@dataclass
class _Scan:
    """What one pass over a file found (see :func:`_scan`)."""

    crc: int = 0
    first_over: tuple[int, int] | None = None  # position, value
    strays: list[_Strays] = field(default_factory=list)
    wrong: dict[str, tuple[int, int]] = field(default_factory=dict)  # check -> (documents, first one)

    @property
    def checksum(self) -> str:
        return checksum_text(self.crc)


def check_shards(manifest: Manifest, source: _Source, *, checksums: bool = True) -> list[str]:
    """The problems of every shard of ``manifest``'s cache, read from ``source``. Without ``checksums``
    (another format's files record none) the CRC-32s are not compared."""
    problems, doc_start = [], 0
    for shard in range(len(manifest.table)):
        problems += _check_shard(manifest, shard, doc_start, source, checksums=checksums)
        doc_start += int(manifest.table.num_docs[shard])
    return problems + _check_delimiter(manifest, source)


def _check_shard(
    manifest: Manifest, shard: int, doc_start: int, source: _Source, *, checksums: bool
) -> list[str]:
    """The problems of shard ``shard``, whose first document is ``doc_start``."""
    info = manifest.table.row(shard, manifest.units[shard], manifest.loss_mask)
    dtype = np.dtype(manifest.dtype).newbyteorder("<")
    keys = tokens_key(info.name), offsets_key(info.name)
    tokens_file, offsets_file = map(source.describe, keys)
    try:
        offsets = _whole(source, keys[1], OFFSET_DTYPE, info.num_docs)
    except (CacheError, ValueError, OSError) as e:
        return [f"{offsets_file}: cannot read ({e})"]
    offsets_crc = checksum_text(crc32(offsets.data))
    problems = _differs(offsets_file, offsets_crc, info.offsets_checksum, checksums)
    offset_problems = _check_offsets(offsets_file, offsets, info.num_tokens)
    problems += offset_problems
    sound = not offset_problems
    eos = manifest.eos.appended
    bos = manifest.bos.prepended
    ends = np.asarray(offsets, dtype=np.int64)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    places = {}  # what must stand at each document's end and start, when the offsets are sound
    skipped = int(_continues_documents(manifest))  # documents at the shard's start the BOS check skips
    if sound and len(ends):
        empty = ends <= starts
        if eos is not None:
            places["end with EOS"] = (ends - 1, eos, empty)
        if bos is not None:
            places["begin with BOS"] = (starts[skipped:], bos, empty[skipped:])
    controls = _stray_controls(manifest) if sound else []
    try:
        scan = _scan(
            source.chunks(keys[0], dtype, info.num_tokens), manifest.vocab_size, controls, ends, places
        )
    except (CacheError, ValueError, OSError) as e:
        return [*problems, f"{tokens_file}: cannot read ({e})"]
    problems[:0] = _differs(tokens_file, scan.checksum, info.tokens_checksum, checksums)
    if scan.first_over is not None:
        position, value = scan.first_over
        problems.append(
            f"{tokens_file}: token {position} is {value}, not below the vocab size {manifest.vocab_size}"
        )
    if not problems:
        for name, (count, first) in scan.wrong.items():
            control, first = (eos, first) if name == "end with EOS" else (bos, first + skipped)
            problems.append(
                f"{tokens_file}: document {doc_start + first} (and {count - 1} more) does not {name} "
                f"{control}"
            )
    problems.extend(
        _stray_problem(doc_start, tokens_file, offsets, found, native=checksums)
        for found in scan.strays
        if found.count
    )
    if manifest.loss_mask:
        problems.extend(
            _check_mask(manifest, info, doc_start, source, ends, not problems, checksums=checksums)
        )
    return problems


def _differs(path: str, actual: str, recorded: str | None, checksums: bool) -> list[str]:
    """The problem of a file whose checksum is not the one recorded (none without ``checksums``)."""
    if checksums and actual != recorded:
        return [f"{path}: checksum {actual} does not match the manifest's {recorded}"]
    return []


def _check_delimiter(manifest: Manifest, source: _Source) -> list[str]:
    """The problem of a cache whose shards may begin inside a document (llm.c's) when its BOS, the
    delimiter, occurs in none of its files: :func:`_check_shard` lets a shard's first document lack it, so
    a wrong delimiter would pass there, each shard one document. Reads at most one token a shard."""
    bos = manifest.bos.prepended
    table = manifest.table
    if bos is None or not _continues_documents(manifest) or not int(np.sum(table.num_tokens)):
        return []
    dtype = np.dtype(manifest.dtype).newbyteorder("<")
    for shard in range(len(table)):
        docs, tokens = int(table.num_docs[shard]), int(table.num_tokens[shard])
        if docs > 1:
            return []  # its later documents begin with the delimiter (_check_shard says where one does not)
        key = tokens_key(table.row(shard, manifest.units[shard], manifest.loss_mask).name)
        try:
            if tokens and source.first(key, dtype, tokens) == bos:
                return []
        except (CacheError, ValueError, OSError):
            return []  # a damaged shard: _check_shard names it
    first = source.describe(tokens_key(table.row(0, manifest.units[0], manifest.loss_mask).name))
    others = f" or the {len(table) - 1} other shards" if len(table) > 1 else ""
    return [
        f"{first}: the delimiter {bos} (the BOS) occurs in no token of it{others}, so each shard was read "
        "as one document: llm.c's writers put the delimiter before every document, and these files put "
        "another id there. Open them (or convert them) with bos_id= (--bos-id) that id"
    ]


def _continues_documents(manifest: Manifest) -> bool:
    """Whether a shard's first document may continue the previous shard's last (llm.c's files, or a cache
    converted from them)."""
    return manifest.settings.extra.get("continued_documents") is True


def _check_mask(
    manifest: Manifest,
    info: ShardInfo,
    doc_start: int,
    source: _Source,
    ends: np.ndarray,
    check_places: bool,
    *,
    checksums: bool,
) -> list[str]:
    """The loss mask's checksum and values; with ``check_places``, that each EOS is a target and each BOS
    is not."""
    key = mask_key(info.name)
    path = source.describe(key)
    places = {}
    if check_places and len(ends):
        starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        nothing = np.zeros(len(ends), dtype=bool)
        if manifest.eos.append:
            places["EOS"] = (ends - 1, 1, nothing)
        if manifest.bos.prepend:
            places["BOS"] = (starts, 0, nothing)
    try:
        scan = _scan(source.chunks(key, np.dtype(np.uint8), info.num_tokens), 2, [], ends, places)
    except (CacheError, ValueError, OSError) as e:
        return [f"{path}: cannot read ({e})"]
    problems = _differs(path, scan.checksum, info.mask_checksum, checksums)
    if scan.first_over is not None:
        problems.append(f"{path}: byte {scan.first_over[0]} is {scan.first_over[1]}, not 0 or 1")
    if problems:
        return problems
    for control, (count, first) in scan.wrong.items():
        value = 1 if control == "EOS" else 0
        problems.append(
            f"{path}: the {control} of document {doc_start + first} (and {count - 1} more) has mask "
            f"{1 - value}, not {value}"
        )
    return problems


@dataclass(frozen=True)
class _Control:
    """A control id streampack writes, and where in a document it may stand."""

    name: str  # EOS or BOS
    id: int
    at_start: bool  # it may be a document's first token
    at_end: bool  # it may be a document's last token


@dataclass
class _Strays:
    """A control id found where streampack never writes it: how many, and where the first are."""

    control: _Control
    count: int = 0
    first: list[int] = field(default_factory=list)  # positions in the shard


def _stray_controls(manifest: Manifest) -> list[_Control]:
    """The control ids that may stand only where streampack puts them (none where a build parsed special
    tokens or rendered chats, which put them inside documents)."""
    settings = manifest.settings
    if settings.special_tokens == "parse" or settings.chat:
        return []
    eos = manifest.eos.appended
    bos = manifest.bos.prepended
    controls = []
    if eos is not None:
        controls.append(_Control("EOS", eos, at_start=eos == bos, at_end=True))
    if bos is not None and bos != eos:
        controls.append(_Control("BOS", bos, at_start=True, at_end=False))
    return controls


def _scan(
    chunks: Iterator[np.ndarray],
    limit: int | None,
    controls: list[_Control],
    ends: np.ndarray,
    places: dict[str, tuple[np.ndarray, int, np.ndarray]],
) -> _Scan:
    """One pass over a file's chunks: its checksum, its first value not below ``limit``, and the
    ``controls`` that stand inside documents (given their ``ends``).

    Each check of ``places`` is (sorted positions, the value that must stand there, documents that fail
    whatever they hold); the scan counts the documents that fail it.
    """
    scan = _Scan(strays=[_Strays(c) for c in controls])
    wrong = {name: failed.copy() for name, (_, _, failed) in places.items()}
    start = 0
    for chunk in chunks:
        scan.crc = crc32(chunk.data, scan.crc)
        if limit is not None and scan.first_over is None and len(chunk) and int(chunk.max()) >= limit:
            at = int(np.argmax(chunk >= limit))
            scan.first_over = (start + at, int(chunk[at]))
        for found in scan.strays:
            positions = _misplaced(chunk, start, found.control, ends)
            found.count += len(positions)
            found.first.extend(positions[: _SHOWN - len(found.first)].tolist())
        for name, (positions, value, _) in places.items():
            lo, hi = np.searchsorted(positions, [start, start + len(chunk)])
            inside = positions[lo:hi] - start
            wrong[name][lo:hi] |= chunk[inside] != value
        start += len(chunk)
    for name, failed in wrong.items():
        if failed.any():
            scan.wrong[name] = (int(failed.sum()), int(np.argmax(failed)))
    return scan


def _misplaced(chunk: np.ndarray, start: int, control: _Control, ends: np.ndarray) -> np.ndarray:
    """Positions of the ``control`` ids of ``chunk`` (at ``start`` in its shard) where it may not stand."""
    found = np.flatnonzero(chunk == control.id).astype(np.int64) + start
    if not len(found):
        return found
    allowed = np.zeros(len(found), dtype=bool)
    if control.at_end:  # position p ends a document when p + 1 is a document end
        allowed |= _is_end(ends, found + 1)
    if control.at_start:  # and begins one when it is 0 or a document end
        allowed |= (found == 0) | _is_end(ends, found)
    return found[~allowed]


def _is_end(ends: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Whether each of ``positions`` is one of the (sorted) document ``ends``."""
    if not len(ends):
        return np.zeros(len(positions), dtype=bool)
    index = np.minimum(np.searchsorted(ends, positions), len(ends) - 1)
    return np.asarray(ends[index], dtype=np.int64) == positions


def _stray_problem(
    doc_start: int, tokens_file: str, offsets: np.ndarray, strays: _Strays, *, native: bool
) -> str:
    where = []
    for position in strays.first:
        local = int(np.searchsorted(offsets, np.uint64(position), side="right"))
        begin = int(offsets[local - 1]) if local else 0
        where.append(
            f"document {doc_start + local} at token {position - begin} of {int(offsets[local]) - begin}"
        )
    control = strays.control
    shown = f" (the first {len(where)})" if strays.count > len(where) else ""
    place = "not at their end" if control.at_end else "not at their start"
    found = (
        f"{tokens_file}: {strays.count} {control.name} {'id' if strays.count == 1 else 'ids'} {control.id} "
        f"inside documents, {place}: {'; '.join(where)}{shown}. "
    )
    if not native:  # another tool wrote these files: nothing streampack builds would change them
        option = "eos_id" if control.at_end else "bos_id"
        return found + (
            f"Either {control.id} is not the id these files {'end' if control.at_end else 'start'} their "
            f"documents with (declare the right {option}=, or none), or the tool that wrote them encoded "
            f"the {control.name} token's string inside the text as the id: write the files again from "
            "the text with that tool, or build a streampack cache from it (`streampack build`)"
        )
    return found + (
        f"The text held the {control.name} token's string, which the tokenizer turned into the control id; "
        "rebuild the cache with overwrite=True (special-token strings are now encoded as text)"
    )


def _check_offsets(path: str, offsets: np.ndarray, num_tokens: int) -> list[str]:
    if not len(offsets):
        return [] if num_tokens == 0 else [f"{path}: no documents, but {num_tokens} tokens"]
    steps = np.diff(offsets.astype(np.int64), prepend=0)
    bad = np.flatnonzero(steps < 0)
    if len(bad):
        i = int(bad[0])
        return [
            f"{path}: offsets not monotone at document {i} ({int(offsets[i - 1])} then {int(offsets[i])})"
        ]
    if int(offsets[-1]) != num_tokens:
        return [
            f"{path}: the last document ends at {int(offsets[-1])}, but the shard has {num_tokens} tokens"
        ]
    return []

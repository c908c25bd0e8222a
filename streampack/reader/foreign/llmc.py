"""llm.c and modded-nanogpt token shards read as a cache: ``train_NNNNNN.bin``, a 256 x int32 header,
then tokens.

As karpathy/llm.c ``dev/data/data_common.py`` (``write_datafile``) writes it and ``llmc/dataloader.h``
and KellerJordan/modded-nanogpt ``train_gpt.py`` read it: ``header[0]`` the magic, ``header[1]`` the
version, ``header[2]`` the token count (below 2**31), the rest zero, then the little-endian tokens. uint16
tokens: magic 20240520, version 1 (GPT-2); uint32: magic 20240801, version 7 (Llama 3; modded-nanogpt
reads only uint16). streampack's export also records its delimiter in two ints those readers leave alone:
``header[254] = 20261207`` (:data:`DELIMITER_TAG`) and ``header[255]`` the delimiter.

``streampack.open(PATH)``: PATH is a folder of ``*.bin`` shards (all of them, in name order: llm.c writes
``fineweb_val_000000.bin`` beside the train shards, so open a folder of one split), or one shard; each is
one streampack shard, mapped where it lies, its header checked. A document starts at each delimiter, the
cache's ``bos_id``: the one the headers record, else ``bos_id=``, else :data:`DELIMITERS` by width. Tokens
before a shard's first delimiter are a document too, so a document llm.c continued into the next shard is
read as two; a shard without a delimiter is one document, with a
:class:`~streampack.errors.DocumentBoundaryWarning`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from streampack.errors import CacheError, DocumentBoundaryWarning, OptionsError
from streampack.reader.foreign.files import check_id_fits
from streampack.reader.foreign.opening import Foreign, ForeignOptions
from streampack.reader.foreign.scanning import Boundary, Found, ScanPlan, TokenSpan, open_plan

HEADER_INTS = 256
#: (magic, version) by token width in bytes.
HEADERS = {2: (20240520, 1), 4: (20240801, 7)}
#: ``header[DELIMITER_SLOT]`` holds :data:`DELIMITER_TAG` where ``header[DELIMITER_SLOT + 1]`` is the
#: delimiter the export wrote before every document: two of the ints llm.c reserves (and leaves 0), the
#: last ones, away from any field a later llm.c version might add after the token count.
DELIMITER_SLOT = 254
DELIMITER_TAG = 20261207
LOOKS_FOR = "llmc: a folder of *.bin shards with llm.c's header (magic 20240520 or 20240801), or one"
#: What reading the files checks of them, as ``verify`` reports it.
OPENED_CHECKS = (
    "their headers were checked (magic, version, and the token count against each file's size); llm.c "
    "shards have no index: documents are found at the delimiter"
)
HEADER_BYTES = 4 * HEADER_INTS
#: The delimiter llm.c's writers put before every document, by token width: GPT-2's ``<|endoftext|>``
#: (``fineweb.py``, ``tinyshakespeare.py``...) and Llama 3's ``<|begin_of_text|>``.
DELIMITERS = {2: 50256, 4: 128000}
#: magic -> (its version, the token width in bytes).
MAGICS = {magic: (version, itemsize) for itemsize, (magic, version) in HEADERS.items()}


def shard_files(path: Path) -> list[Path]:
    """The shard files ``path`` names: itself, or the ``*.bin`` files of the folder in name order."""
    if path.is_dir():
        return sorted(p for p in path.glob("*.bin") if p.is_file())
    return [path] if path.is_file() else []


def has_header(path: Path) -> bool:
    """Whether ``path`` starts with an llm.c magic."""
    try:
        with open(path, "rb") as f:
            raw = f.read(4)
    except OSError:
        return False
    return len(raw) == 4 and int.from_bytes(raw, "little", signed=True) in MAGICS


def recognise(path: Path) -> bool:
    """Whether ``path`` is an llm.c shard or a folder holding one (a file that starts with a magic)."""
    return any(has_header(f) for f in shard_files(path))


def read(path: Path, options: ForeignOptions) -> Foreign:
    """The shards at ``path``: :func:`plan`, its spans scanned."""
    return open_plan(plan(path, options))


def plan(path: Path, options: ForeignOptions) -> ScanPlan:
    """The shards at ``path``, each header checked; a document starts at each delimiter.

    Raises:
        CacheError: a header is not llm.c's or disagrees with its file's size, or the shards differ in
            dtype or in the delimiter they record.
        OptionsError: ``eos_id=`` or ``dtype=``, or a ``bos_id`` other than the recorded one or too large.
    """
    if options.dtype is not None:
        raise OptionsError(
            f"{path}: an llm.c header records its dtype (magic and version); dtype= applies to headerless "
            "files"
        )
    if options.eos_id is not None:
        raise OptionsError(
            f"{path}: llm.c shards put a delimiter before each document, not an EOS after it: pass bos_id= "
            f"(the delimiter; {DELIMITERS[2]} for uint16 shards and {DELIMITERS[4]} for uint32 ones by "
            "default), not eos_id="
        )
    files = shard_files(path)
    if not files:
        raise CacheError(f"{path}: no *.bin files; an llm.c cache is a folder of shards, or one shard file")
    headers = [_header(f) for f in files]
    (first, first_header), *rest = zip(files, headers)
    itemsize = first_header.itemsize
    for f, read in rest:
        if read.itemsize != itemsize:
            raise CacheError(
                f"{f}: {_kind(read.itemsize)} tokens, but {first.name} has {_kind(itemsize)} ones: the "
                "shards of one cache must have one dtype (magic and version)"
            )
    dtype = np.dtype(f"<u{itemsize}")
    check_id_fits(path, "bos_id", options.bos_id, dtype)
    delimiter = _delimiter(files, [h.delimiter for h in headers], options.bos_id, itemsize)
    spans = [TokenSpan(f, dtype, HEADER_BYTES, h.count) for f, h in zip(files, headers)]

    foreign = Foreign("llmc", path, dtype, [], bos_id=delimiter, files=files, continued_documents=True)
    warn = partial(_warn_undelimited, path, delimiter, spans)
    return ScanPlan(foreign, spans, Boundary(delimiter, starts=True), check=warn)


def _delimiter(files: list[Path], recorded: list[int | None], given: int | None, itemsize: int) -> int:
    """The delimiter of the shards ``files``: the one their headers record (``recorded``, one a file), else
    ``given``, else llm.c's for the width."""
    marked = [(f, d) for f, d in zip(files, recorded) if d is not None]
    if not marked:
        return DELIMITERS[itemsize] if given is None else given
    (file, delimiter), *others = marked
    for other, value in others:
        if value != delimiter:
            raise CacheError(
                f"{other}: its header records the delimiter {value}, but {file.name}'s records {delimiter}: "
                "the shards of one cache have one delimiter; open the shards of each apart"
            )
    if given is not None and given != delimiter:
        raise OptionsError(
            f"{file}: its header records the delimiter {delimiter} (header[{DELIMITER_SLOT + 1}], written "
            f"by streampack's export before every document), but bos_id={given} was given: drop bos_id="
        )
    unmarked = [f for f, d in zip(files, recorded) if d is None]
    if unmarked and given is None:
        raise CacheError(
            f"{unmarked[0]}: its header records no delimiter, but {file.name}'s records {delimiter} "
            "(streampack's export): the shards come from different writers. Pass "
            f"bos_id={delimiter} to read every shard with it, or open the shards of each writer apart"
        )
    return delimiter


def _warn_undelimited(path: Path, delimiter: int, spans: list[TokenSpan], found: list[Found]) -> None:
    """Warn about the shards without a delimiter, each read as one document: not refused, as a document
    longer than a shard leaves one in llm.c's layout (``verify`` fails when no shard holds one)."""
    # A shard holds a delimiter when it has two documents or more, or one that starts with it.
    lacking = [
        s.path.name for s, seen in zip(spans, found) if s.count and seen.num_docs < 2 and s[0] != delimiter
    ]
    if not lacking:
        return
    count, total = len(lacking), len(spans)
    named = ", ".join(lacking[:3]) + (f" and {count - 3} more" if count > 3 else "")
    if total == 1:
        which = f"its shard ({named}) holds no delimiter {delimiter}"
    elif count == total:
        which = f"none of its {total} shards ({named}) holds the delimiter {delimiter}"
    else:
        which = f"{count} of its {total} shards ({named}) hold no delimiter {delimiter}"
    warnings.warn(
        f"{path}: {which}: each such shard is read as one document. "
        "Either it continues a document longer than a shard, or the files put another id before each "
        "document: pass bos_id=N with N that id",
        DocumentBoundaryWarning,
        stacklevel=2,
    )


def _kind(itemsize: int) -> str:
    magic, version = HEADERS[itemsize]
    return f"uint{8 * itemsize} (magic {magic}, version {version})"


@dataclass(frozen=True)
class _Header:
    """What a shard's header says: its token count and width, and the delimiter it records (or None)."""

    count: int
    itemsize: int
    delimiter: int | None


def _header(path: Path) -> _Header:
    """The header of the shard ``path``, checked against its size."""
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES:
        raise CacheError(
            f"{path}: {len(raw):,} bytes, shorter than the {HEADER_BYTES:,}-byte llm.c header (256 int32): "
            "the file is truncated, or not an llm.c shard"
        )
    magic, version, count = (int(v) for v in np.frombuffer(raw, dtype="<i4", count=3))
    if magic not in MAGICS:
        known = " or ".join(f"{m} ({_kind(w).split()[0]})" for m, (_, w) in MAGICS.items())
        raise CacheError(f"{path}: header[0] (the magic) is {magic}, expected {known}: not an llm.c shard")
    expected, itemsize = MAGICS[magic]
    if version != expected:
        raise CacheError(
            f"{path}: header[1] (the version) is {version}, expected {expected} with magic {magic}: a "
            "version streampack cannot read"
        )
    if count < 0:
        raise CacheError(f"{path}: header[2] (the token count) is {count}, expected at least 0")
    size = path.stat().st_size
    if size != HEADER_BYTES + count * itemsize:
        expected = HEADER_BYTES + count * itemsize
        raise CacheError(
            f"{path}: {size:,} bytes, expected {expected:,}: the {HEADER_BYTES:,}-byte "
            f"header and the {count:,} uint{8 * itemsize} tokens header[2] (the token count) says it holds. "
            "The file is truncated, or its header is wrong"
        )
    tag, delimiter = (int(v) for v in np.frombuffer(raw, dtype="<u4", count=2, offset=4 * DELIMITER_SLOT))
    if tag != DELIMITER_TAG:
        return _Header(count, itemsize, None)
    if delimiter >= 1 << (8 * itemsize):
        raise CacheError(
            f"{path}: header[{DELIMITER_SLOT + 1}] (the delimiter streampack's export records) is "
            f"{delimiter:,}, more than its uint{8 * itemsize} tokens hold: the header is damaged"
        )
    return _Header(count, itemsize, delimiter)

"""llm.c and modded-nanogpt token shards: ``DEST/train_NNNNNN.bin``, a 256 x int32 header, then tokens.

The layout, as karpathy/llm.c ``dev/data/data_common.py`` (``write_datafile``, ``HEADERS_INFO``) writes
it and ``llmc/dataloader.h`` / ``train_gpt2.py`` (``_load_data_shard``) and KellerJordan/modded-nanogpt
``train_gpt.py`` (``_load_data_shard``) read it: ``header[0]`` the magic, ``header[1]`` the version,
``header[2]`` the number of tokens (below 2**31); the rest of the 256 int32 zero; then the tokens,
little-endian. uint16 tokens: magic 20240520, version 1 (GPT-2); uint32 tokens: magic 20240801,
version 7 (Llama 3). modded-nanogpt reads only the first kind. Those readers read nothing past
``header[2]``: streampack's export records its delimiter in two of the reserved ints,
``header[254] = 20261207`` (:data:`DELIMITER_TAG`, which marks the record) and ``header[255]`` the
delimiter (its uint32 bits), so that its shards open with their documents whatever the delimiter.

**Documents.** Those readers expect every document to be *preceded* by a delimiter: llm.c's
``fineweb.py`` writes ``[eot] + tokens`` (GPT-2's ``<|endoftext|>``, 50256), or ``<|begin_of_text|>`` for
Llama 3, and modded-nanogpt aligns its sequences to that id (``BOS_ID = 50256``). The export writes each
document as ``[delimiter] + its tokens``: the delimiter is the cache's BOS id where it prepends one (the
document is then written as it is, without an EOS the cache appended), else its EOS id (the cache's
``tokens, EOS`` become ``EOS, tokens``: the stream shifted by one). A cache with neither is refused. The
stream fills shards of ``shard_tokens`` tokens (llm.c's ``shard_size``, 10**8) one after the other; as in
llm.c, a document may continue into the next shard.

**Reading** (``streampack.open(PATH)``): PATH is a folder of ``*.bin`` shards (every one, in name order:
llm.c's ``fineweb.py`` writes its ``fineweb_val_000000.bin`` beside the train shards, so open a folder
that holds the split you want, or one shard file), or one such file. Each header is checked: the magic and
version pair (:data:`HEADERS`), a token count ``header[2]`` of at least 0, and a file of exactly the
1,024-byte header and that many tokens; all shards have one dtype. One shard is one streampack shard, its
tokens mapped where they lie. A document *starts* at each delimiter, which the cache's ``bos_id`` then
is: the one the headers record (streampack's export), else ``bos_id=``, else :data:`DELIMITERS` (GPT-2's
``<|endoftext|>`` 50256 for uint16 shards, Llama 3's ``<|begin_of_text|>`` 128000 for uint32 ones, what
llm.c's writers put there); a ``bos_id=`` other than the recorded one is refused, and so are shards
that record different ones. A document is ``[delimiter, tokens...]``; the tokens before a shard's first
delimiter are a document too. streampack's documents lie within one shard, so a document that llm.c
continued into the next shard is read as two, cut at the shard's end (``verify`` of the cache, or of one
converted from it, takes a shard's first document without the delimiter as such a rest, and fails when
the delimiter occurs in no shard at all). The delimiters are counted when the shards are opened (a scan
of every shard at disk speed, on a few threads: the number of documents is needed first); a shard that
holds none is read as one document, with a :class:`~streampack.errors.DocumentBoundaryWarning` (the
rest of a document longer than a shard, or the sign of a wrong delimiter). A cache exported here (in
one shard) and opened again thus has, for an EOS cache, the documents ``[EOS] + doc[:-1]`` (its stream
shifted by one), and for a BOS cache its own documents (less the EOS, where it appended one).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING

import numpy as np

from streampack.errors import CacheError, DocumentBoundaryWarning, OptionsError
from streampack.interop.destination import Destination
from streampack.interop.filechecks import check_id_fits
from streampack.interop.files import map_tokens
from streampack.interop.reading import Foreign, ForeignOptions, ForeignShard
from streampack.interop.scanning import Boundary, Found, ScanPlan, TokenSpan, open_plan
from streampack.interop.writing import (
    Progress,
    check_int_option,
    refuse_loss_mask,
    shard_docs,
    token_chunks,
    write_tokens,
)

if TYPE_CHECKING:
    from streampack.reader import Cache

LAYOUT = "directory"
HEADER_INTS = 256
#: (magic, version) by token width in bytes.
HEADERS = {2: (20240520, 1), 4: (20240801, 7)}
MAX_SHARD_TOKENS = 2**31 - 1
SHARD_TOKENS = 10**8
#: ``header[DELIMITER_SLOT]`` holds :data:`DELIMITER_TAG` where ``header[DELIMITER_SLOT + 1]`` is the
#: delimiter the export wrote before every document: two of the ints llm.c reserves (and leaves 0), the
#: last ones, away from any field a later llm.c version might add after the token count.
DELIMITER_SLOT = 254
DELIMITER_TAG = 20261207


@dataclass(frozen=True)
class Options:
    """Options of the llm.c export.

    Attributes:
        shard_tokens: tokens a shard holds (the last holds the rest); at most 2**31 - 1.
        drop_loss_mask: export an SFT cache's tokens without its loss mask (refused otherwise).
    """

    shard_tokens: int = SHARD_TOKENS
    drop_loss_mask: bool = False

    def __post_init__(self) -> None:
        check_int_option("shard_tokens", self.shard_tokens, low=1, high=MAX_SHARD_TOKENS)


def shard_file(index: int) -> str:
    """The name of shard ``index``."""
    return f"train_{index:06d}.bin"


def header(num_tokens: int, itemsize: int, delimiter: int) -> bytes:
    """The 256 x int32 header of a shard of ``num_tokens`` tokens, each document behind ``delimiter``
    (recorded in the reserved ints :data:`DELIMITER_SLOT` and after: llm.c's readers read none of them)."""
    magic, version = HEADERS[itemsize]
    values = np.zeros(HEADER_INTS, dtype="<u4")
    values[:3] = (magic, version, num_tokens)
    values[DELIMITER_SLOT : DELIMITER_SLOT + 2] = (DELIMITER_TAG, delimiter)
    return values.tobytes()


def delimiter_of(cache: Cache) -> int:
    """The id the export writes before each document: the cache's BOS, else its EOS (:func:`check`)."""
    delimiter = cache.bos_id if cache.bos_id is not None else cache.eos_id
    assert delimiter is not None  # refused by check()
    return delimiter


def check(cache: Cache, options: Options) -> None:
    """Refuse a loss mask, and a cache with no delimiter to put before its documents."""
    refuse_loss_mask(cache, "llmc", options.drop_loss_mask)
    if cache.bos_id is None and cache.eos_id is None:
        raise OptionsError(
            f"{cache.root}: the cache has no EOS or BOS id, and llm.c's readers find documents at the "
            "delimiter before each one: the document boundaries would be lost. Rebuild with an EOS, or "
            "export to megatron, datatrove or hf, which keep boundaries without a delimiter"
        )


def stream(cache: Cache) -> Iterator[np.ndarray]:
    """The llm.c token stream of the cache, in chunks: each document preceded by the delimiter."""
    bos, eos = cache.bos_id, cache.eos_id
    if bos is None:
        assert eos is not None
        # tokens, EOS per document becomes EOS, tokens: the stream shifted right by one.
        yield np.array([eos], dtype=cache.dtype)
        held: np.ndarray | None = None
        for shard in range(cache.num_shards):
            for chunk in token_chunks(cache, shard):
                if held is not None:
                    yield held
                held = chunk
        if held is not None:
            yield held[:-1]  # the last document's EOS, now before it
        return
    for docs in shard_docs(cache):
        if eos is None:
            yield from token_chunks(cache, docs.shard)
            continue
        # BOS, tokens, EOS per document: drop each EOS (the next document's BOS delimits it).
        pos = 0
        for chunk in token_chunks(cache, docs.shard):
            stop = pos + len(chunk)
            ends = docs.ends[(docs.ends > pos) & (docs.ends <= stop)]
            keep = np.ones(len(chunk), dtype=bool)
            keep[ends - 1 - pos] = False
            yield chunk[keep]
            pos = stop


def stream_length(cache: Cache) -> int:
    """Tokens of :func:`stream`: the cache's, less one EOS a document where a BOS is the delimiter."""
    dropped = cache.num_docs if cache.bos_id is not None and cache.eos_id is not None else 0
    return cache.num_tokens - dropped


def write(
    cache: Cache, dest: Destination, options: Options, progress: bool
) -> tuple[int, int, Sequence[str]]:
    """Write the shards; each header counts its shard's tokens, known before it is written."""
    total, size = stream_length(cache), options.shard_tokens
    counts = [min(size, total - start) for start in range(0, total, size)]
    little = cache.dtype.newbyteorder("<")
    itemsize, delimiter = cache.dtype.itemsize, delimiter_of(cache)
    with Progress(progress, total, "llmc") as bar:
        if cache.bos_id is None or cache.eos_id is None:
            # The stream is the cache's tokens (shifted right by one behind an EOS where the EOS delimits):
            # each llm.c shard is a span of them, copied as the file holds them.
            shift = int(cache.bos_id is None)
            for index, count in enumerate(counts):
                with dest.open(shard_file(index)) as out:
                    out.write(header(count, itemsize, delimiter))
                    first = index * size
                    if shift and first == 0:
                        out.write(np.array([cache.eos_id], dtype=little).tobytes())
                        first = 1
                    _write_stream(out, cache, first - shift, index * size + count - shift, little)
                    bar.update(count)
            return cache.num_docs, total, []
        chunks = stream(cache)
        pending = np.zeros(0, dtype=cache.dtype)
        for index, count in enumerate(counts):
            with dest.open(shard_file(index)) as out:
                out.write(header(count, itemsize, delimiter))
                left = count
                while left:
                    if not len(pending):
                        pending = next(chunks)
                        continue
                    take = pending[:left]
                    out.write(np.ascontiguousarray(take, dtype=little).data)
                    bar.update(len(take))
                    left -= len(take)
                    pending = pending[len(take) :]
    return cache.num_docs, total, []


def _write_stream(out: IO[bytes], cache: Cache, start: int, stop: int, dtype: np.dtype) -> None:
    """Tokens ``[start, stop)`` of the cache's whole stream, shard by shard."""
    starts = np.asarray(cache.token_starts, dtype=np.int64)
    shard = max(0, int(np.searchsorted(starts, start, side="right")) - 1)
    while shard < cache.num_shards and starts[shard] < stop:
        base = int(starts[shard])
        write_tokens(out, cache, shard, dtype, max(start - base, 0), min(stop, int(starts[shard + 1])) - base)
        shard += 1


# Reading ---------------------------------------------------------------------------------------------

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
    """The shards at ``path`` (see the module's docstring): :func:`plan`, its spans scanned.

    Raises:
        CacheError, OptionsError: as for :func:`plan`.
    """
    return open_plan(plan(path, options))


def plan(path: Path, options: ForeignOptions) -> ScanPlan:
    """The shards at ``path``, each header checked; a document starts at each delimiter.

    Raises:
        CacheError: a shard is shorter than its header, its magic or version is not llm.c's, its token
            count is below 0 or disagrees with its size, the shards do not all have one dtype, or they
            record different delimiters (or some one and others none).
        OptionsError: ``eos_id=`` or ``dtype=`` (an llm.c shard has a delimiter before each document, and
            its header says its dtype), a ``bos_id`` other than the one the headers record, or a
            ``bos_id`` the dtype cannot hold.
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
    if options.bos_id is not None:
        check_id_fits(path, "bos_id", options.bos_id, dtype)
    delimiter = _delimiter(files, [h.delimiter for h in headers], options.bos_id, itemsize)
    spans = [TokenSpan(f, dtype, HEADER_BYTES, h.count) for f, h in zip(files, headers)]
    made = partial(_made, path, dtype, spans, delimiter, files)
    return ScanPlan(spans, Boundary(delimiter, starts=True), made)


def _delimiter(files: list[Path], recorded: list[int | None], given: int | None, itemsize: int) -> int:
    """The delimiter of the shards ``files``: the one their headers record (``recorded``, one a file), else
    ``given``, else llm.c's for the width.

    Raises:
        CacheError: the files record different delimiters, or some one and others none.
        OptionsError: ``given`` is not the one they record.
    """
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


def _made(
    path: Path, dtype: np.dtype, spans: list[TokenSpan], delimiter: int, files: list[Path], found: list[Found]
) -> Foreign:
    """The foreign cache of the shards, given what their scans found (a warning for those without a
    delimiter)."""
    shards = [
        ForeignShard(
            span.path,
            seen.num_docs,
            span.count,
            ends=seen.ends,
            token_file=(span.path, HEADER_BYTES),
            tokens=partial(map_tokens, span.path, dtype, HEADER_BYTES, span.count),
        )
        for span, seen in zip(spans, found, strict=True)
    ]
    _warn_undelimited(path, delimiter, spans, found)
    return Foreign("llmc", path, dtype, shards, bos_id=delimiter, files=files, continued_documents=True)


def _warn_undelimited(path: Path, delimiter: int, spans: list[TokenSpan], found: list[Found]) -> None:
    """Warn about the shards in which the delimiter never occurs: each is read as one document.

    Not refused: a document longer than a shard leaves one without a delimiter in llm.c's layout, and a
    stream without any is still windowed right by ``sequences``; ``verify`` fails when no shard holds one.
    """
    # A scan found a delimiter where a shard has two documents or more, or one that starts with it.
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

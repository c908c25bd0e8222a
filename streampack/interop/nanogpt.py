"""nanoGPT's flat token files: ``DEST/train.bin`` (and ``val.bin``), headerless uint16, plus ``meta.pkl``.

The layout of karpathy/nanoGPT ``data/openwebtext/prepare.py``: every document's tokens followed by the
EOT id (``<|endoftext|>``), end to end, as one ``np.memmap`` of uint16; ``train.py``'s ``get_batch`` maps
``train.bin`` and ``val.bin`` with ``dtype=np.uint16`` and draws random windows from them. A cache that
appends an EOS is written as it is (a copy of its shards); ``val=FRACTION`` holds out that fraction of the
documents (:meth:`streampack.Cache.split`, seeded by ``split_seed``) into ``val.bin``, which ``train.py``'s
evaluation reads; both files are written in one pass over the shards. ``meta.pkl`` holds
``{"vocab_size": ...}``, which ``train.py`` reads to size the model.

Document boundaries survive only as the EOS ids in the stream; ``train.py`` reads uint16 only, so a
vocabulary above 65,536 ids is refused unless ``dtype="cache"`` (then edit ``train.py``'s dtype).

**Reading** (``streampack.open(PATH)``): PATH is a folder with ``train.bin`` (its ``val.bin`` is not
read: open ``PATH/val.bin`` for it), or one headerless ``.bin`` file (one that does not start with an llm.c
magic, which :mod:`~streampack.interop.llmc` reads). The tokens are ``dtype=`` (uint16 by default, as
``train.py`` maps them), so the file must be a whole number of them. A file holds no boundaries but its
EOS ids: with ``eos_id=`` (GPT-2's ``<|endoftext|>``, 50256, for ``prepare.py``'s files) a document is
its tokens up to and with each EOS, and a tail after the last one is a last document; without it the file
is one document, one stream (``sequences`` windows it as ``get_batch`` does; ``documents`` has one).
``meta.pkl`` beside the file gives the vocabulary size (read as plain data: no class is unpickled).

A file with an EOS is read as shards of at most :data:`SHARD_TOKENS` tokens, each cut after an EOS (a
document longer than that makes its shard longer), mapped where they lie: each shard's document ends are
then a bounded array, found when it is first read. The EOS ids are counted when the file is opened, a scan
at disk speed (the number of documents is needed first).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

import numpy as np

from streampack.errors import CacheError, OptionsError
from streampack.interop.files import map_tokens
from streampack.interop.llmc import has_header
from streampack.interop.reading import (
    Foreign,
    ForeignOptions,
    ForeignShard,
    check_doc_count,
    check_id_fits,
)
from streampack.interop.scanning import (
    KEPT_ENDS_BYTES,
    SCAN_TOKENS,
    KeptEnds,
    TokenSpan,
    ends_at,
    scanned,
)
from streampack.interop.writing import (
    Destination,
    Progress,
    check_ids_fit,
    refuse_loss_mask,
    shard_docs,
    write_spans,
    write_tokens,
)

if TYPE_CHECKING:
    from streampack.reader import Cache
    from streampack.samples.split import Chosen

LAYOUT = "directory"


@dataclass(frozen=True)
class Options:
    """Options of the nanoGPT export.

    Attributes:
        val: hold out this fraction of the documents (or this many, an int) into ``val.bin``; none by
            default.
        split_seed: which documents ``val`` holds out (as :meth:`streampack.Cache.split`'s ``seed``).
        dtype: ``"uint16"`` (what ``train.py`` reads, the default) or ``"cache"`` (the cache's own).
        drop_loss_mask: export an SFT cache's tokens without its loss mask (refused otherwise).
    """

    val: float | int | None = None
    split_seed: int = 0
    dtype: Literal["uint16", "cache"] = "uint16"
    drop_loss_mask: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in ("uint16", "cache"):
            raise OptionsError(f"nanogpt dtype must be uint16 or cache (got {self.dtype!r})")


def check(cache: Cache, options: Options) -> None:
    """Refuse a loss mask, and a vocabulary that uint16 cannot hold (unless ``dtype="cache"``)."""
    refuse_loss_mask(cache, "nanogpt", options.drop_loss_mask)
    if options.dtype == "uint16":
        check_ids_fit(
            cache,
            np.dtype(np.uint16),
            "nanogpt",
            "nanoGPT's train.py reads uint16: export to llmc (uint32, version 7) or megatron (int32), or "
            'pass dtype="cache" and change train.py\'s np.uint16 to np.uint32.',
        )


def write(
    cache: Cache, dest: Destination, options: Options, progress: bool
) -> tuple[int, int, Sequence[str]]:
    """Write ``train.bin`` (and ``val.bin``), then ``meta.pkl``."""
    dtype = (np.dtype(np.uint16) if options.dtype == "uint16" else cache.dtype).newbyteorder("<")
    with Progress(progress, cache.num_tokens, "nanogpt") as bar:
        if options.val is None:
            with dest.open("train.bin") as out:
                for shard in range(cache.num_shards):
                    bar.update(write_tokens(out, cache, shard, dtype))
        else:
            _, validation = cache.split(options.val, seed=options.split_seed)
            with dest.open("train.bin") as train, dest.open("val.bin") as val:
                _write_split(cache, validation.chosen, (train, val), dtype, bar)
    with dest.open("meta.pkl") as out:
        pickle.dump({"vocab_size": cache.vocab_size}, out)
    return cache.num_docs, cache.num_tokens, ["meta.pkl"]


def _write_split(
    cache: Cache, held: Chosen, outs: tuple[IO[bytes], IO[bytes]], dtype: np.dtype, bar: Progress
) -> None:
    """Both sides in one pass over the shards (``outs``: train, validation): each stretch of consecutive
    documents on one side is one span of its shard, written to that side's file."""
    for docs in shard_docs(cache):
        if not len(docs.ends):
            continue
        side = held.in_shard(docs.shard)  # True: validation
        change = np.flatnonzero(side[1:] != side[:-1]) + 1  # the first document of each later stretch
        bounds = np.concatenate([[0], docs.ends[change - 1], docs.ends[-1:]]).tolist()
        sides = side[np.concatenate([[0], change])].tolist()
        spans = [(outs[s], lo, hi) for s, lo, hi in zip(sides, bounds[:-1], bounds[1:])]
        write_spans(cache, docs.shard, dtype, spans)
        bar.update(int(docs.ends[-1]))


# Reading ---------------------------------------------------------------------------------------------

LOOKS_FOR = "nanogpt: a folder with train.bin, or one headerless .bin file (with eos_id= and dtype=)"
#: The most tokens a shard of a file read with an EOS holds (unless one document is longer).
SHARD_TOKENS = 1 << 28


def token_path(path: Path) -> Path:
    """The token file ``path`` names: ``path/train.bin`` for a folder."""
    return path / "train.bin" if path.is_dir() else path


def recognise(path: Path) -> bool:
    """Whether ``path`` is (a folder with) a ``.bin`` file without an llm.c header."""
    file = token_path(path)
    return file.suffix == ".bin" and file.is_file() and not has_header(file)


def read(path: Path, options: ForeignOptions) -> Foreign:
    """The token file at ``path`` (see the module's docstring).

    Raises:
        CacheError: the file is missing, or not a whole number of tokens of its dtype, or ``meta.pkl`` is
            not a dict of plain values.
        OptionsError: ``bos_id=`` (nanoGPT's documents end at an EOS), or an ``eos_id`` the dtype cannot
            hold.
    """
    if options.bos_id is not None:
        raise OptionsError(
            f"{path}: nanoGPT's files hold each document followed by its EOT: pass eos_id= to find "
            "documents (bos_id= is llm.c's delimiter before each one)"
        )
    file = token_path(path)
    if not file.is_file():
        raise CacheError(f"{file}: missing; a nanoGPT folder holds train.bin (open PATH/val.bin for val)")
    dtype = np.dtype(options.dtype or "uint16").newbyteorder("<")
    size = file.stat().st_size
    if size % dtype.itemsize:
        raise CacheError(
            f"{file}: {size:,} bytes, not a whole number of {dtype.itemsize}-byte {dtype.name} tokens: the "
            f"file is truncated, or its tokens are not {dtype.name} (pass dtype=)"
        )
    count = size // dtype.itemsize
    eos = options.eos_id
    if eos is not None:
        check_id_fits(file, "eos_id", eos, dtype)
    meta = file.parent / "meta.pkl"
    vocab = _vocab_size(meta) if meta.is_file() else None
    shards = []
    first_doc = 0
    found: list[np.ndarray | None] = []
    kept = KeptEnds()
    spans = plan_shards(TokenSpan(file, dtype, 0, count), eos, SHARD_TOKENS, found=found)
    for index, (start, stop, docs) in enumerate(spans):
        offset, length = start * dtype.itemsize, stop - start
        rescan = partial(_ends, file, dtype, offset, length, eos, docs)
        ends = found[index] if index < len(found) else None
        shards.append(
            ForeignShard(
                file,
                docs,
                length,
                tokens=partial(map_tokens, file, dtype, offset, length),
                ends=rescan if ends is None else kept.ends(ends, rescan),
                token_file=(file, offset),
                first_doc=first_doc,
            )
        )
        first_doc += docs
    files = [file, meta] if vocab is not None else [file]
    return Foreign("nanogpt", path, dtype, shards, eos_id=eos, vocab_size=vocab, files=files)


def plan_shards(
    tokens: np.ndarray | TokenSpan,
    eos_id: int | None,
    shard_tokens: int,
    *,
    scan_tokens: int = SCAN_TOKENS,
    found: list[np.ndarray | None] | None = None,
) -> list[tuple[int, int, int]]:
    """``(start, stop, documents)`` of each shard of a flat stream, found in one pass that compares
    ``scan_tokens`` at a time: each cut after the last EOS within ``shard_tokens`` tokens of its start
    (after the first EOS past them if a document is longer); one shard, one document, without ``eos_id``.

    ``found``, where given, receives each shard's document ends (uint64, from its start), or None for the
    shards past :data:`~streampack.interop.reading.KEPT_ENDS_BYTES` of them (found again when read)."""
    total = len(tokens)
    if eos_id is None or not total:
        return [(0, total, int(total > 0))]
    spans: list[tuple[int, int, int]] = []
    held = _HeldEnds(found)
    start = last = docs = 0  # the shard's start, the end of its last document so far, its documents
    for lo, chunk in scanned(tokens, scan_tokens):
        hi = lo + len(chunk)
        ends = np.flatnonzero(chunk == eos_id) + (lo + 1)
        held.add(ends)
        j = 0
        while True:
            limit = start + shard_tokens
            k = int(np.searchsorted(ends, limit, side="right"))
            if k > j:
                last, docs, j = int(ends[k - 1]), docs + k - j, k
            if hi <= limit:
                break  # every end up to the limit is not seen yet
            if last > start:
                spans.append((start, last, docs))
                held.close(start, last)
                start, docs = last, 0
            elif j < len(ends):  # a document longer than a shard: it ends at the next EOS
                end = int(ends[j])
                spans.append((start, end, 1))
                held.close(start, end)
                start = last = end
                j += 1
            else:
                break
    if start < total:
        tail = int(tokens[total - 1]) != eos_id  # tokens after the last EOS: one more document
        spans.append((start, total, docs + int(tail)))
        if tail:
            held.add(np.array([total], dtype=np.int64))
        held.close(start, total)
    return spans


class _HeldEnds:
    """The document ends :func:`plan_shards` has seen and not yet given to a shard: each shard's, once it
    is cut, go to ``found`` (while they stay within :data:`KEPT_ENDS_BYTES` in all, then None)."""

    def __init__(self, found: list[np.ndarray | None] | None) -> None:
        self.found = found
        self.parts: list[np.ndarray] | None = [] if found is not None else None
        self.given = 0

    def add(self, ends: np.ndarray) -> None:
        """Hold the ends (absolute, ascending) of the chunk just scanned."""
        if self.parts is not None and len(ends):
            self.parts.append(ends)

    def close(self, start: int, stop: int) -> None:
        """Give the held ends up to ``stop`` to the shard ``[start, stop)`` just cut."""
        if self.found is None or self.parts is None:
            return
        held = np.concatenate(self.parts) if self.parts else np.zeros(0, dtype=np.int64)
        cut = int(np.searchsorted(held, stop, side="right"))
        mine, rest = held[:cut], held[cut:]
        self.given += mine.nbytes
        if self.given > KEPT_ENDS_BYTES:  # the rest are found again when read: memory stays bounded
            self.parts = None
            self.found.append(None)
            return
        self.parts = [rest]
        self.found.append((mine - start).astype(np.uint64))


def _ends(path: Path, dtype: np.dtype, offset: int, count: int, eos: int | None, docs: int) -> np.ndarray:
    if eos is None:
        return np.array([count] if count else [], dtype=np.uint64)
    return check_doc_count(path, ends_at(TokenSpan(path, dtype, offset, count), eos), docs)


class _PlainData(pickle.Unpickler):
    """Unpickles builtin values only: a ``meta.pkl`` is data, and unpickling a class could run code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def _vocab_size(meta: Path) -> int | None:
    """``meta.pkl``'s ``vocab_size`` (``prepare.py``'s of shakespeare_char, or an export's)."""
    try:
        with open(meta, "rb") as f:
            value = _PlainData(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError) as e:
        raise CacheError(
            f"{meta}: not a pickled dict of plain values ({e}); nanoGPT's meta.pkl holds vocab_size. Move it "
            "aside to open the tokens without it"
        ) from None
    vocab = value.get("vocab_size") if isinstance(value, dict) else None
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 else None

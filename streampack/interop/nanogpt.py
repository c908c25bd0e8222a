"""nanoGPT's flat token files: ``DEST/train.bin`` (and ``val.bin``), headerless uint16, plus ``meta.pkl``.

The layout of karpathy/nanoGPT ``data/openwebtext/prepare.py``: every document's tokens followed by the
EOT id (``<|endoftext|>``), end to end, as one ``np.memmap`` of uint16; ``train.py``'s ``get_batch`` maps
``train.bin`` and ``val.bin`` with ``dtype=np.uint16`` and draws random windows from them. A cache that
appends an EOS is written as it is (a copy of its shards); ``val=FRACTION`` holds out that fraction of the
documents (:meth:`streampack.Cache.split`, seeded by ``split_seed``) into ``val.bin``, which ``train.py``'s
evaluation reads; both files are written in one pass over the shards. ``meta.pkl`` holds
``{"vocab_size": ...}``, which ``train.py`` reads to size the model.

Document boundaries survive only as the EOS ids in the stream, so a cache without an EOS is refused, and
so is one whose BOS is its EOS (each BOS would end a document when the file is read); ``train.py`` reads
uint16 only, so a vocabulary above 65,536 ids is refused unless ``dtype="cache"`` (then edit ``train.py``'s
dtype).

**Reading** (``streampack.open(PATH)``): PATH is a folder with ``train.bin`` (its ``val.bin`` is not
read: open ``PATH/val.bin`` for it), or one headerless ``.bin`` file (one that does not start with an llm.c
magic, which :mod:`~streampack.interop.llmc` reads). The tokens are ``dtype=`` (uint16 by default, as
``train.py`` maps them), so the file must be a whole number of them. A file holds no boundaries but its
EOS ids: with ``eos_id=`` (GPT-2's ``<|endoftext|>``, 50256, for ``prepare.py``'s files) a document is
its tokens up to and with each EOS, and a tail after the last one is a last document; without it the file
is one document, one stream (``sequences`` windows it as ``get_batch`` does; ``documents`` has one),
and opening it says so with a :class:`~streampack.errors.DocumentBoundaryWarning`.
``meta.pkl`` beside the file gives the vocabulary size (read as plain data: no class is unpickled).

A file with an EOS is read as shards of at most :data:`SHARD_TOKENS` tokens, each cut after an EOS (a
document longer than that makes its shard longer; each cut found by reading back from the limit), mapped
where they lie: each shard's document ends are then a bounded array. The EOS ids are counted when the file
is opened (the number of documents is needed first): a scan of the shards at disk speed, on a few threads
(:func:`~streampack.interop.scanning.open_plan`).
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

import numpy as np

from streampack.errors import CacheError, DocumentBoundaryWarning, OptionsError
from streampack.interop.destination import Destination
from streampack.interop.filechecks import check_id_fits
from streampack.interop.files import map_tokens
from streampack.interop.llmc import has_header
from streampack.interop.reading import Foreign, ForeignOptions, ForeignShard
from streampack.interop.scanning import SCAN_TOKENS, Boundary, Found, ScanPlan, TokenSpan, open_plan
from streampack.interop.writing import (
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
    """Refuse a loss mask, a vocabulary that uint16 cannot hold (unless ``dtype="cache"``), and a cache
    whose documents the EOS ids do not delimit (no EOS, or a BOS that is the EOS)."""
    refuse_loss_mask(cache, "nanogpt", options.drop_loss_mask)
    if cache.eos_id is None:
        raise OptionsError(
            f"{cache.root}: the cache appends no EOS, and nanoGPT's files keep document boundaries as the "
            "EOS ids alone: they would be lost. Rebuild with an EOS, or export to llmc (a delimiter "
            "before each document), megatron or datatrove"
        )
    if cache.bos_id == cache.eos_id:
        raise OptionsError(
            f"{cache.root}: the cache's BOS is its EOS ({cache.eos_id}), and nanoGPT's files keep document "
            "boundaries as the EOS ids alone: each BOS would end a document too when they are read. "
            "Rebuild without bos_id, or export to llmc, megatron or datatrove"
        )
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
#: What reading the files checks of them, as ``verify`` reports it.
OPENED_CHECKS = (
    "only their size was checked (a whole number of tokens): nanoGPT's files have no header nor index, "
    "their documents end at the EOS id, where one is declared"
)
#: The most tokens a shard of a file read with an EOS holds (unless one document is longer).
SHARD_TOKENS = 1 << 28


def token_path(path: Path) -> Path:
    """The token file ``path`` names: ``path/train.bin`` for a folder."""
    return path / "train.bin" if path.is_dir() else path


def companion(path: Path) -> str | None:
    """What the file ``path`` beside a ``train.bin`` that was read is, where nanoGPT's layout (and the
    export) puts it there; None for a file it does not know."""
    if path.name == "val.bin":
        return (
            "nanoGPT's validation split (the export's --val), read apart from train.bin, so not checked with "
            f"it: verify it on its own (`streampack verify {path} --eos-id N`)"
        )
    if path.name == "meta.pkl":
        return "nanoGPT's meta.pkl, which holds no vocab_size to read; not checked"
    return None


def recognise(path: Path) -> bool:
    """Whether ``path`` is (a folder with) a ``.bin`` file without an llm.c header."""
    file = token_path(path)
    return file.suffix == ".bin" and file.is_file() and not has_header(file)


def read(path: Path, options: ForeignOptions) -> Foreign:
    """The token file at ``path`` (see the module's docstring): :func:`plan`, its spans scanned.

    Raises:
        CacheError, OptionsError: as for :func:`plan`.
    """
    return open_plan(plan(path, options))


def plan(path: Path, options: ForeignOptions) -> ScanPlan:
    """The shards of the token file at ``path``: spans of at most :data:`SHARD_TOKENS` tokens, each cut
    after an EOS (:func:`shard_spans`), whose documents end at the EOS.

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
    eos = options.eos_id
    if eos is not None:
        check_id_fits(file, "eos_id", eos, dtype)
    else:
        # Documented (one stream for get_batch-style windows), so a warning, not a refusal: documents()
        # and packed() would serve one document made of them all.
        warnings.warn(
            f"{file}: no eos_id declared: the file is read as one document stream (sequences() windows it as "
            "nanoGPT's get_batch does; documents() and packed() see one document). Pass eos_id=N, the id "
            "after each document (50256 for GPT-2's prepare.py), to find its documents",
            DocumentBoundaryWarning,
            stacklevel=2,
        )
    meta = file.parent / "meta.pkl"
    vocab = _vocab_size(meta) if meta.is_file() else None
    whole = TokenSpan(file, dtype, 0, size // dtype.itemsize)
    spans = [
        TokenSpan(file, dtype, start * dtype.itemsize, stop - start)
        for start, stop in shard_spans(whole, eos, SHARD_TOKENS)
    ]
    files = [file, meta] if vocab is not None else [file]
    return ScanPlan(spans, Boundary(eos), partial(_made, path, spans, eos, vocab, files))


def _made(
    path: Path,
    spans: list[TokenSpan],
    eos: int | None,
    vocab: int | None,
    files: list[Path],
    found: list[Found],
) -> Foreign:
    """The foreign cache of the spans of one token file, given what their scans found."""
    shards, first_doc = [], 0
    for span, seen in zip(spans, found, strict=True):
        tokens = partial(map_tokens, span.path, span.dtype, span.offset, span.count)
        shards.append(
            ForeignShard(
                span.path,
                seen.num_docs,
                span.count,
                tokens=tokens,
                ends=seen.ends,
                token_file=(span.path, span.offset),
                first_doc=first_doc,
            )
        )
        first_doc += seen.num_docs
    return Foreign("nanogpt", path, spans[0].dtype, shards, eos_id=eos, vocab_size=vocab, files=files)


def shard_spans(
    tokens: np.ndarray | TokenSpan, eos_id: int | None, shard_tokens: int, *, window: int = SCAN_TOKENS
) -> list[tuple[int, int]]:
    """``(start, stop)`` of each shard of a flat stream: each cut after the last EOS within
    ``shard_tokens`` tokens of its start (after the first EOS past them if a document is longer); one
    shard without ``eos_id``. Each cut is found by reading back from the limit, ``window`` tokens at a
    time (a document's worth, usually): the plan reads a few MiB of a file, not all of it."""
    total = len(tokens)
    if eos_id is None or not total:
        return [(0, total)]
    spans, start = [], 0
    while total - start > shard_tokens:
        limit = start + shard_tokens
        stop = _last_end(tokens, eos_id, start, limit, window) or _first_end(tokens, eos_id, limit, window)
        if stop is None:
            break  # no EOS past the limit: the rest is one document
        spans.append((start, stop))
        start = stop
    if start < total:
        spans.append((start, total))
    return spans


def _window(tokens: np.ndarray | TokenSpan, start: int, stop: int) -> np.ndarray:
    return tokens.read(start, stop) if isinstance(tokens, TokenSpan) else tokens[start:stop]


def _last_end(tokens: np.ndarray | TokenSpan, eos: int, start: int, limit: int, window: int) -> int | None:
    """The end of the last document that ends within ``(start, limit]``, or None."""
    hi = limit
    while hi > start:
        lo = max(start, hi - window)
        found = np.flatnonzero(_window(tokens, lo, hi) == eos)
        if len(found):
            return lo + int(found[-1]) + 1
        hi = lo
    return None


def _first_end(tokens: np.ndarray | TokenSpan, eos: int, start: int, window: int) -> int | None:
    """The end of the first document that ends after ``start``, or None."""
    for lo in range(start, len(tokens), window):
        found = np.flatnonzero(_window(tokens, lo, lo + window) == eos)
        if len(found):
            return lo + int(found[0]) + 1
    return None


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

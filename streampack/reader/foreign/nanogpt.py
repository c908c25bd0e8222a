"""nanoGPT's flat token files read as a cache: ``train.bin`` (or ``val.bin``), headerless, and
``meta.pkl``.

``streampack.open(PATH)``: PATH is a folder with ``train.bin`` (open ``PATH/val.bin`` for the other split),
or one headerless ``.bin`` file that does not start with an llm.c magic. Its tokens are ``dtype=`` (uint16
by default). With ``eos_id=`` (50256 for GPT-2's ``prepare.py``) a document is its tokens up to and with
each EOS, and a tail after the last one is a last document; without it the file is one document stream
(``sequences`` windows it as ``get_batch`` does), with a :class:`~streampack.errors.DocumentBoundaryWarning`.
``meta.pkl`` gives the vocabulary size (plain data only: no class is unpickled). The file is read as shards
of at most :data:`SHARD_TOKENS` tokens, each cut after an EOS, whose EOS ids are counted at the open by a
scan on a few threads (:func:`~streampack.reader.foreign.scanning.open_plan`).
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from streampack.errors import CacheError, DocumentBoundaryWarning, OptionsError
from streampack.reader.foreign.files import check_id_fits
from streampack.reader.foreign.llmc import has_header
from streampack.reader.foreign.opening import Foreign, ForeignOptions
from streampack.reader.foreign.scanning import (
    SCAN_TOKENS,
    Boundary,
    ScanPlan,
    TokenSpan,
    open_plan,
)

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
    """What the file ``path`` beside a ``train.bin`` is, for ``verify``'s notes; None for an unknown one."""
    if path.name == "val.bin":
        return (
            "nanoGPT's validation split (the export's --val), read apart from train.bin, so not checked with "
            f"it: verify it on its own (`streampack verify {path} --eos-id N`)"
        )
    if path.name == "meta.pkl":
        return "nanoGPT's meta.pkl, which holds no vocab_size to read; not checked"
    return None


def recognise(path: Path) -> bool:
    """Whether ``path`` is, or holds, a ``.bin`` file without an llm.c header."""
    file = token_path(path)
    return file.suffix == ".bin" and file.is_file() and not has_header(file)


def read(path: Path, options: ForeignOptions) -> Foreign:
    """The token file at ``path``: :func:`plan`, its spans scanned."""
    return open_plan(plan(path, options))


def plan(path: Path, options: ForeignOptions) -> ScanPlan:
    """The shards of the token file at ``path``: spans of at most :data:`SHARD_TOKENS` tokens, each cut
    after an EOS.

    Raises:
        CacheError: the file is missing or not whole tokens, or ``meta.pkl`` is not plain data.
        OptionsError: ``bos_id=``, or an ``eos_id`` the dtype cannot hold.
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
    check_id_fits(file, "eos_id", eos, dtype)
    if eos is None:  # documented (one stream for get_batch-style windows), so a warning, not a refusal
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

    foreign = Foreign("nanogpt", path, dtype, [], eos_id=eos, vocab_size=vocab, files=files)
    return ScanPlan(foreign, spans, Boundary(eos))


def shard_spans(
    tokens: np.ndarray | TokenSpan, eos_id: int | None, shard_tokens: int, *, window: int = SCAN_TOKENS
) -> list[tuple[int, int]]:
    """``(start, stop)`` of each shard of a flat stream, cut after the last EOS within ``shard_tokens``
    tokens of its start (or the first EOS past them, for a longer document); one shard without ``eos_id``.
    Each cut is found by reading back from the limit ``window`` tokens at a time (a few MiB of the file)."""
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


def _last_end(tokens: np.ndarray | TokenSpan, eos: int, start: int, limit: int, window: int) -> int | None:
    """The end of the last document that ends within ``(start, limit]``, or None."""
    hi = limit
    while hi > start:
        lo = max(start, hi - window)
        found = np.flatnonzero(tokens[lo:hi] == eos)
        if len(found):
            return lo + int(found[-1]) + 1
        hi = lo
    return None


def _first_end(tokens: np.ndarray | TokenSpan, eos: int, start: int, window: int) -> int | None:
    """The end of the first document that ends after ``start``, or None."""
    for lo in range(start, len(tokens), window):
        found = np.flatnonzero(tokens[lo : lo + window] == eos)
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

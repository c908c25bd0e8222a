"""A streampack cache in the token formats of the other ecosystems.

``streampack.interop.export(cache, "megatron", "out/corpus")`` (or ``cache.export(...)``, or
``streampack export CACHE --to megatron --out out/corpus``) writes the cache's documents in one of:

=========== ============================================================ ==================================
format      what is written                                              read by
=========== ============================================================ ==================================
megatron    ``DEST.bin`` + ``DEST.idx`` (MMIDIDX version 1)              Megatron-LM, NeMo, gpt-neox, ...
llmc        ``DEST/train_NNNNNN.bin`` (256 x int32 header + tokens)      llm.c, modded-nanogpt
nanogpt     ``DEST/train.bin`` (+ ``val.bin``), flat tokens              nanoGPT's ``train.py``
datatrove   ``DEST/NNNNN.ds`` + ``.ds.index`` (+ ``.ds.loss``) + meta    datatrove, nanotron
olmo        ``DEST/token_ids_part_NNNNNN.npy`` (+ label masks) + json     OLMo-core's numpy datasets
hf          ``save_to_disk`` Arrow and/or Parquet, ``input_ids``          ``datasets``, TRL, axolotl
mds         ``DEST/shard.NNNNN.mds`` + ``index.json``                     MosaicML streaming, llm-foundry
streampack  a native cache (``streampack convert``)                       streampack
=========== ============================================================ ==================================

``streampack.open`` reads all but hf back as a :class:`~streampack.reader.Cache`
(:mod:`streampack.reader.foreign`, where each format's layout is), and ``streampack convert SOURCE --out
DEST`` makes a native cache of it.

One module per format holds its writer. The writers share :mod:`~streampack.interop.destination` (files
staged, then committed atomically), :mod:`~streampack.interop.copying` (bytes moved by the kernel) and
:mod:`~streampack.interop.writing`. A format refuses what it cannot hold (a loss mask, ids too large for its
dtype) with an :class:`~streampack.errors.OptionsError` that names what would be lost and a format that keeps
it.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from functools import partial
from typing import TYPE_CHECKING, Any

from streampack.errors import OptionsError
from streampack.interop.destination import DISK_FULL, Destination, disk_full
from streampack.reader.foreign.scanning import scan_plan

if TYPE_CHECKING:
    from streampack.reader import Cache

__all__ = ["FORMATS", "Exported", "convert", "export"]

#: Format name -> the module that writes it.
FORMATS: dict[str, str] = {
    name: f"streampack.interop.{'native' if name == 'streampack' else name}"
    for name in ("megatron", "llmc", "nanogpt", "datatrove", "olmo", "hf", "mds", "streampack")
}


@dataclass(frozen=True)
class Exported:
    """What an export wrote.

    Attributes:
        format: the format's name.
        dest: the destination as given.
        files: every file written, by its final path or key, the format's index last.
        rows: documents written, or samples for an export of samples (hf and mds with ``seq_len``).
        num_tokens: tokens written (delimiters and padding included).
    """

    format: str
    dest: str
    files: list[str]
    rows: int
    num_tokens: int


def export(
    cache: Cache | str | os.PathLike[str],
    format: str,
    dest: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    progress: bool | None = None,
    storage_options: Mapping[str, Any] | None = None,
    durable: bool = False,
    **options: Any,
) -> Exported:
    """Write ``cache`` to ``dest`` in ``format`` (one of :data:`FORMATS`), atomically.

    Args:
        cache: an open cache, or its path or URL (another format's files too: see :func:`streampack.open`).
        format: ``"megatron"``, ``"llmc"``, ``"nanogpt"``, ``"datatrove"``, ``"olmo"``, ``"hf"``, ``"mds"``
            or ``"streampack"`` (a native cache: what ``convert`` writes).
        dest: a local path or an fsspec URL (``s3://bucket/prefix``): the directory to create, or for
            ``megatron`` the prefix of ``DEST.bin`` and ``DEST.idx``.
        overwrite: replace what is at ``dest`` (only once the new export is complete).
        progress: show a progress bar on stderr; by default when stderr is a terminal.
        storage_options: passed to the fsspec filesystem of a URL ``dest``.
        durable: fsync every file before the move into place, so that a crash of the machine leaves no
            destination a reader takes as whole (see :mod:`streampack.interop.destination`).
        **options: the format's options (its module's ``Options``), e.g. ``dtype="optimal"`` for
            megatron, ``seq_len=2048, packed=True`` for hf, ``val=0.01`` for nanogpt.

    Returns:
        What was written.

    Raises:
        OptionsError: an unknown format or option, a destination that exists (without ``overwrite``), or
            a cache the format cannot hold without losing something (the message says what and which
            format keeps it).
    """
    if format not in FORMATS:
        raise OptionsError(f"unknown export format {format!r}; choose one of {', '.join(FORMATS)}")
    from streampack.reader import Cache
    from streampack.reader import open as open_cache

    opened = cache if isinstance(cache, Cache) else open_cache(cache)
    module = importlib.import_module(FORMATS[format])
    allowed = [f.name for f in fields(module.Options)]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise OptionsError(
            f"the {format} export takes no option {', '.join(unknown)}; its options are: "
            f"{', '.join(allowed) or 'none'}"
        )
    chosen = module.Options(**options)
    module.check(opened, chosen)
    writing: dict[str, Any] = dict(overwrite=overwrite, storage_options=storage_options, durable=durable)
    return _written(format, dest, partial(module.write, opened, options=chosen), progress, **writing)


def _written(
    format: str,
    dest: str | os.PathLike[str],
    write: Callable[..., tuple[int, int, Sequence[str]]],
    progress: bool | None,
    storage_options: Mapping[str, Any] | None,
    **destination: bool,
) -> Exported:
    """Stage what ``write(dest=, progress=)`` writes at ``dest``, then commit it (or clear it on an error)."""
    module = importlib.import_module(FORMATS[format])
    try:
        staged = Destination(
            dest,
            layout=module.LAYOUT,
            suffixes=getattr(module, "SUFFIXES", ()),
            storage_options=dict(storage_options) if storage_options else None,
            **destination,
        )
        try:
            rows, tokens, last = write(
                dest=staged, progress=sys.stderr.isatty() if progress is None else progress
            )
        except BaseException:
            staged.abort()  # an error or Ctrl-C; a killed process leaves it for the next run to clear
            raise
    except OSError as error:
        if error.errno in DISK_FULL:  # outside a file's write, which names its file: the staging folder
            raise disk_full(error, str(dest)) from error
        raise
    return Exported(format, str(dest), staged.commit(last), rows, tokens)


def convert(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    progress: bool | None = None,
    storage_options: Mapping[str, Any] | None = None,
    durable: bool = False,
    shard_tokens: int | None = None,
    **declared: Any,
) -> Exported:
    """Make a native cache at ``out`` of another format's token files at ``source`` (or of a cache).

    It is :func:`streampack.open` then :func:`export` to ``"streampack"``, except that files without an
    index (nanoGPT, OLMo, llm.c) are not opened first: their spans are copied while another thread scans
    them for documents and checksums, one read of the files for both
    (:func:`~streampack.interop.native.write_scanned`). The keywords are as for :func:`export`.

    Args:
        source: what :func:`streampack.open` takes: a Megatron prefix, a folder of llm.c, datatrove, OLMo
            or MDS shards, a nanoGPT ``train.bin``, or a cache.
        out: the cache directory to create (or an fsspec URL).
        shard_tokens: tokens a shard of the new cache holds at most (cut between documents).
        **declared: what the files do not say, as :func:`streampack.open` takes it (``format``, ``eos_id``,
            ``bos_id``, ``dtype``, ``tokenizer``, ``vocab_size``).

    Raises:
        CacheError: ``source`` is no format streampack reads, or its files are damaged.
        OptionsError: as for :func:`export`.
    """
    from streampack.interop import native
    from streampack.reader import open as open_cache

    options: dict[str, Any] = {} if shard_tokens is None else {"shard_tokens": shard_tokens}
    limit = native.Options(**options).shard_tokens
    plan = scan_plan(source, declared)
    writing: dict[str, Any] = dict(overwrite=overwrite, storage_options=storage_options, durable=durable)
    if plan is not None and all(span.count <= limit for span in plan.spans):
        return _written("streampack", out, partial(native.write_scanned, plan, declared), progress, **writing)
    with open_cache(source, **declared) as opened:
        return export(opened, "streampack", out, progress=progress, **writing, **options)

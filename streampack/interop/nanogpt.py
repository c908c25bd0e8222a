"""nanoGPT's flat token files: ``DEST/train.bin`` (and ``val.bin``), headerless uint16, plus ``meta.pkl``.

The layout of karpathy/nanoGPT ``data/openwebtext/prepare.py``: every document's tokens and the EOT id,
end to end, as one uint16 ``np.memmap``; ``train.py`` reads ``meta.pkl``'s ``{"vocab_size": ...}``.
``val=FRACTION`` holds out that fraction of the documents (:meth:`streampack.Cache.split`) into
``val.bin``, in the same pass. Boundaries survive only as the EOS ids, so a cache without an EOS, or whose
BOS is its EOS, is refused. Reading them: :mod:`streampack.reader.foreign.nanogpt`.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Literal

import numpy as np

from streampack.errors import OptionsError
from streampack.interop.destination import Destination
from streampack.interop.writing import (
    Progress,
    check_ids_fit,
    progress_bar,
    refuse_loss_mask,
    require_eos,
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
    reader = "nanoGPT's files keep document boundaries as the EOS ids alone"
    require_eos(cache, reader, "llmc (a delimiter before each document), megatron or datatrove")
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
    with progress_bar(progress, cache.num_tokens, "nanogpt") as bar:
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
    """Train and validation (``outs``) in one pass: each run of documents on one side is one span."""
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

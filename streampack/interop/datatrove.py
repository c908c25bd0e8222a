"""datatrove's tokenized files (what nanotron's Nanosets read) written from a cache: ``DEST/NNNNN.ds``
and its sidecars (the layout: :mod:`streampack.reader.foreign.datatrove`).

That is a streampack shard renamed: one ``.ds`` per non-empty shard, its offsets table as the
``.ds.index`` and its loss mask as the ``.ds.loss``. A cache without tokens is one empty ``00000.ds``
(and sidecars): ``DatatroveFolderDataset`` reads a folder without a ``.ds`` as an error, an empty file as
no samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from streampack.interop.destination import Destination
from streampack.interop.writing import progress_bar, shard_docs, shard_mask, write_tokens

if TYPE_CHECKING:
    from streampack.reader import Cache

LAYOUT = "directory"


@dataclass(frozen=True)
class Options:
    """The datatrove export has no options: the layout follows the cache."""


def check(cache: Cache, options: Options) -> None:
    """Nothing to refuse: tokens, boundaries and a loss mask all have a file."""


def short_count(count: int) -> str:
    """A count as ``humanize.metric(count, unit="T")`` shows it in datatrove's metadata (``1.23 MT``)."""
    for power, prefix in ((12, "T"), (9, "G"), (6, "M"), (3, "k")):
        if count >= 10**power:
            value = count / 10**power
            return f"{value:.{max(0, 2 - len(str(int(value))) + 1)}f} {prefix}T"
    return f"{count} T"


def write(
    cache: Cache, dest: Destination, options: Options, progress: bool
) -> tuple[int, int, Sequence[str]]:
    """Write one ``.ds`` (and sidecars) per non-empty shard."""
    little = cache.dtype.newbyteorder("<")
    tokenizer = cache.manifest.tokenizer
    named = str(tokenizer.name or tokenizer.spec or "Unknown Tokenizer").replace("|", "/")
    written = 0
    with progress_bar(progress, cache.num_tokens, "datatrove") as bar:
        for index, docs in enumerate(shard_docs(cache, nonempty=True)):
            name = f"{index:05d}.ds"
            with dest.open(name) as out:
                bar.update(write_tokens(out, cache, docs.shard, little))
            with dest.open(f"{name}.index") as out:
                out.write(docs.ends.astype("<u8").tobytes())
            if cache.has_loss_mask:
                with dest.open(f"{name}.loss") as out:
                    out.write((shard_mask(cache, docs.shard) != 0).astype(np.uint8).tobytes())
            _write_metadata(dest, name, named, cache.dtype.itemsize, int(docs.ends[-1]))
            written += 1
    if not written:  # no tokens: one empty file, which datatrove's readers take as no samples
        for suffix in ("", ".index") + ((".loss",) if cache.has_loss_mask else ()):
            with dest.open(f"00000.ds{suffix}"):
                pass
        _write_metadata(dest, "00000.ds", named, cache.dtype.itemsize, 0)
    return cache.num_docs, cache.num_tokens, []


def _write_metadata(dest: Destination, name: str, tokenizer: str, itemsize: int, count: int) -> None:
    """``NAME.ds.metadata``: the tokenizer and token width, the token count, and the count in short form."""
    with dest.open(f"{name}.metadata") as out:
        out.write(f"{tokenizer}|{itemsize}\n{count}\n{short_count(count)}".encode())

"""What the readers of foreign files check before they trust them: a file's size, document ends that go
forward within the tokens, a document count unchanged since the open, a declared id its tokens can hold.
Each refusal is a :class:`~streampack.errors.CacheError` (for an option,
:class:`~streampack.errors.OptionsError`) naming the file and the field.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from streampack.errors import CacheError, OptionsError
from streampack.interop.files import LOCAL, ForeignFiles


def check_size(path: Path, expected: int, what: str, files: ForeignFiles = LOCAL) -> None:
    """Refuse a file that is missing or not ``expected`` bytes long, naming what it should hold."""
    try:
        size = files.size(path)
    except FileNotFoundError:
        raise CacheError(f"{path}: missing; it should hold {what}") from None
    if size != expected:
        raise CacheError(
            f"{path}: {size:,} bytes, but {what} take {expected:,}: the file is truncated or does not "
            "belong to this index"
        )


def check_ends(path: Path, ends: np.ndarray, num_tokens: int) -> np.ndarray:
    """Refuse document ends that go back or past ``num_tokens`` (naming the first bad entry)."""
    if len(ends):
        back = np.flatnonzero(np.diff(ends.astype(np.int64), prepend=0) < 0)
        if len(back):
            i = int(back[0])
            before = int(ends[i - 1]) if i else 0
            raise CacheError(
                f"{path}: document end {i} is {int(ends[i]):,}, before the previous one ({before:,}): the "
                "index must not decrease"
            )
        if int(ends[-1]) > num_tokens:
            raise CacheError(
                f"{path}: the last document ends at token {int(ends[-1]):,}, past the {num_tokens:,} tokens "
                "of its token file"
            )
    return ends


def check_doc_count(path: Path, ends: np.ndarray, num_docs: int) -> np.ndarray:
    """Refuse ends that do not count the ``num_docs`` documents found when the file was opened."""
    if len(ends) != num_docs:
        raise CacheError(
            f"{path}: {len(ends):,} documents now, {num_docs:,} when it was opened: the file changed since; "
            "open it again"
        )
    return ends


def check_id_fits(path: Path, name: str, token_id: int, dtype: np.dtype) -> None:
    """Refuse a declared id that tokens of ``dtype`` cannot hold (it would never be found)."""
    if token_id >= 1 << (8 * dtype.itemsize):
        raise OptionsError(
            f"{path}: {name}={token_id:,} does not fit its {dtype.name} tokens (at most "
            f"{(1 << (8 * dtype.itemsize)) - 1:,}): the id is wrong, or the files are uint32 (pass dtype=)"
        )

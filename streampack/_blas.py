"""numpy's BLAS threads, which streampack never uses, kept from starting.

numpy's wheels link OpenBLAS, which starts a thread per core when numpy is imported, and each spins ~0.1 s
before it sleeps: 0.11 CPU-s on 2 cores (``import numpy`` and a second's sleep: 0.17 CPU-s against 0.06),
taken from a build's start-up, where fastokens loads its tokenizer beside the command's imports. Nothing
in streampack multiplies matrices, so the processes it starts say ``OPENBLAS_NUM_THREADS=1`` unless the
user chose otherwise. Standard library only: this runs before numpy is imported.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

_VARIABLE = "OPENBLAS_NUM_THREADS"


def no_blas_threads() -> None:
    """Keep numpy's BLAS threads from starting in this process (call it before numpy is imported)."""
    os.environ.setdefault(_VARIABLE, "1")


@contextmanager
def children_without_blas_threads() -> Iterator[None]:
    """Processes started inside this block start no BLAS threads (unless the user chose a number); the
    environment is as it was after it."""
    if _VARIABLE in os.environ:
        yield
        return
    os.environ[_VARIABLE] = "1"
    try:
        yield
    finally:
        os.environ.pop(_VARIABLE, None)

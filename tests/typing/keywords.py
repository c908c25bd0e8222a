"""Checked by mypy (pyproject's ``files``), never run: the option keywords are typed, so a typo is an error.

Each ``type: ignore[...]`` marks an error mypy must find; ``warn_unused_ignores`` fails the check when one is
no longer an error.
"""

from __future__ import annotations

import numpy as np

import streampack
from streampack import Follow, Loader


def loader_keywords() -> None:
    Loader(np.zeros((8, 4)), batch_size=2, seed=1, shuffle=False, epochs=1, output="dict")
    Loader(np.zeros((8, 4)), batch_sz=2)  # type: ignore[call-arg]
    Loader(np.zeros((8, 4)), batch_size="2")  # type: ignore[arg-type]
    Loader(np.zeros((8, 4)), batch_size=2, output="torch")  # type: ignore[arg-type]


def follow_keywords() -> None:
    Follow("cache", batch_size=2, seq_len=128, layout="packed", too_long="drop", timeout=60)
    Follow("cache", batch_size=2, seq_len=128, epochs=1)  # type: ignore[call-arg]
    Follow("cache", batch_size=2, seq_lem=128)  # type: ignore[call-arg]


def build_keywords() -> None:
    streampack.build("corpus", "cache", tokenizer="gpt2/tokenizer.json", workers=4, fields=["q", "a"])
    streampack.build("corpus", "cache", tokeniser="gpt2/tokenizer.json")  # type: ignore[call-arg]
    streampack.build("corpus", "cache", workers="4")  # type: ignore[arg-type]

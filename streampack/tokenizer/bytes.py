"""The built-in ``bytes`` tokenizer: UTF-8 bytes as ids, needing no files."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from streampack.tokenizer.base import TokenizerBase
from streampack.tokenizer.engines import BytesEngine, Engine
from streampack.tokenizer.pieces import CutSafety


class BytesTokenizer(TokenizerBase):
    """UTF-8 bytes as token ids 0-255, with EOS = 256. Needs no files; the built-in default."""

    spec = "bytes"
    vocab_size = 257
    eos_id: int | None = 256
    bos_id: int | None = None
    cut_safety = CutSafety(True, "every cut keeps UTF-8 bytes", anywhere=True)
    engine: Engine = BytesEngine()  # stateless: one for all, and its own reference
    _reference = engine
    engine_reason = "the bytes tokenizer's only engine"

    def fingerprint(self) -> dict[str, Any]:
        """See :class:`Tokenizer`."""
        return {"kind": "bytes", "name": "bytes", "vocab_size": self.vocab_size, "sha256": "bytes-v1"}

    def encode_specials(self, texts: list[str]) -> list[np.ndarray]:
        """See :class:`Tokenizer`; bytes have no special tokens."""
        return self.encode_batch(texts)

    def decode(self, ids: Iterable[int]) -> str:
        """See :class:`Tokenizer`; ids above 255 (EOS) are left out."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

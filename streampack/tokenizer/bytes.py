"""The built-in ``bytes`` tokenizer: UTF-8 bytes as ids, needing no files."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from streampack.tokenizer.engines import BytesEngine, Engine, FlatIds
from streampack.tokenizer.pieces import CutSafety


class BytesTokenizer:
    """UTF-8 bytes as token ids 0-255, with EOS = 256. Needs no files; the built-in default."""

    spec = "bytes"
    vocab_size = 257
    eos_id: int | None = 256
    bos_id: int | None = None
    fast_piece_chars: int | None = None
    cut_safety = CutSafety(True, "every cut keeps UTF-8 bytes", anywhere=True)
    engine: Engine = BytesEngine()  # stateless: one for all
    engine_reason = "the bytes tokenizer's only engine"

    @property
    def cores_per_worker(self) -> int:
        """See :class:`Tokenizer`."""
        return self.engine.cores_per_worker

    def reference_engine(self) -> Engine:
        """The engine that defines this tokenizer's ids: its only one."""
        return self.engine

    def fingerprint(self) -> dict[str, Any]:
        """See :class:`Tokenizer`."""
        return {"kind": "bytes", "name": "bytes", "vocab_size": self.vocab_size, "sha256": "bytes-v1"}

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """See :class:`Tokenizer`."""
        return self.engine.encode_batch(texts)

    def encode_flat(self, texts: list[str]) -> FlatIds:
        """See :class:`Tokenizer`."""
        return self.engine.encode_flat(texts)

    def encode_specials(self, texts: list[str]) -> list[np.ndarray]:
        """See :class:`Tokenizer`; bytes have no special tokens."""
        return self.encode_batch(texts)

    def decode(self, ids: Iterable[int]) -> str:
        """See :class:`Tokenizer`; ids above 255 (EOS) are left out."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

"""What a tokenizer is to streampack: the :class:`Tokenizer` protocol, and what the tokenizers share.

**Text is text.** Special-token strings in a document are encoded as the plain text they are, and no
post-processor adds ids (tiktoken's ``encode_ordinary``; Hugging Face with ``add_special_tokens=False``
and ``encode_special_tokens``): control ids come only from streampack. ``special_tokens="parse"`` opts into
matching them as their ids instead.

A tokenizer decides which ids a text gets; an engine computes them. Its reference engine, the library that
defines it, gives the cache's ids whatever engine computes them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, Literal, Protocol

import numpy as np

from streampack.errors import TokenizerError
from streampack.tokenizer.choices import TokenizerEngine
from streampack.tokenizer.engines import (
    GIGATOKEN_CACHE_BYTES,
    Engine,
    FastokensEngine,
    FlatIds,
    GigatokenEngine,
    fastokens_loading,
    import_fastokens,
    import_gigatoken,
    reference_reason,
)
from streampack.tokenizer.pieces import CutSafety


class Tokenizer(Protocol):
    """What the builder needs of a tokenizer."""

    spec: str
    vocab_size: int
    engine: Engine
    engine_reason: str  # why that engine: "proven exact for this tokenizer in parse mode", ...

    @property
    def fast_piece_chars(self) -> int | None:
        """The piece size its engine encodes fastest, where cuts keep its tokens (None: no such cuts)."""
        ...

    cut_safety: CutSafety  # which cuts keep its tokens, proven from its structure

    @property
    def cores_per_worker(self) -> int:
        """How many cores one build process of it keeps busy (engine threads and the reader)."""
        ...

    @property
    def eos_id(self) -> int | None:
        """The tokenizer's own EOS id, or None."""
        ...

    @property
    def bos_id(self) -> int | None:
        """The tokenizer's own BOS id, or None."""
        ...

    def fingerprint(self) -> dict[str, Any]:
        """Kind, name, vocab size and a hash of the definition: identifies the tokenizer in a manifest."""
        ...

    def reference_engine(self) -> Engine:
        """The engine whose ids define the tokenizer's (``engine`` itself when it is the reference)."""
        ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text (special-token text as text, unless parsed; none added), as arrays."""
        ...

    def encode_flat(self, texts: list[str]) -> FlatIds:
        """The ids :meth:`encode_batch` gives, end to end, and where each text's begin."""
        ...

    def encode_specials(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text with special-token strings as their ids (a chat template's own text)."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a sequence of ids."""
        ...


class RecurringTexts:
    """The ids of texts that recur, each encoded once: a chat template writes the same few strings into
    every conversation. Only short texts are kept, at most :attr:`MAX_TEXTS` (a tool call's JSON may differ
    in every record)."""

    MAX_CHARS = 256
    MAX_TEXTS = 4096

    def __init__(self, encode: Callable[[list[str]], list[np.ndarray]]) -> None:
        self._encode = encode
        self._ids: dict[str, np.ndarray] = {}

    def __call__(self, texts: list[str]) -> list[np.ndarray]:
        """The ids of each of ``texts`` (read-only arrays: they are shared by every call that gets them)."""
        known = self._ids
        new = [text for text in dict.fromkeys(texts) if text not in known]
        fresh = dict(zip(new, self._encode(new))) if new else {}
        for text, ids in fresh.items():
            ids.flags.writeable = False
            if len(text) <= self.MAX_CHARS and len(known) < self.MAX_TEXTS:
                known[text] = ids  # (two encoder threads may both add a text: the same ids)
        return [known[text] if text in known else fresh[text] for text in texts]


def describe_engine(tokenizer: Tokenizer) -> dict[str, str]:
    """The engine that computes a tokenizer's ids, why, and its reference, with versions."""
    engine, reference = tokenizer.engine, tokenizer.reference_engine()
    return {
        "name": engine.name,
        "version": engine.version,
        "reference": f"{reference.name} {reference.version}",
        "why": tokenizer.engine_reason,
    }


class TokenizerBase:
    """What the tokenizers share: a reference engine ``_reference`` that defines their ids, and the engine
    that computes them.

    A library's tokenizer (a subclass with ``_kind``, ``_wrong_library``, ``_refusal`` and the three
    ``_fastokens``/``_gigatoken``/``_mismatch`` hooks) starts the fastokens load, makes its reference
    engine, then chooses its engine by :meth:`_choose_engine`: it, ``gigatoken`` or ``fastokens``.
    """

    _kind: str  # what it is, for messages: "a tokenizer.json"
    _wrong_library: str  # the other library's engine
    _refusal: str  # the start of the error when an engine is asked for and not proven, ``{engine}`` in it
    spec: str
    _reference: Engine
    engine: Engine
    engine_reason: str

    def _fastokens(self, fastokens: Any) -> Any:
        """The ``fastokens.Tokenizer`` of this tokenizer (run on a thread of its own)."""
        raise NotImplementedError

    def _gigatoken(self, parse: bool) -> Callable[[], Any]:
        """What makes the ``gigatoken.Tokenizer`` of this tokenizer (again on each reload)."""
        raise NotImplementedError

    def _mismatch(self, engine: Literal["fastokens", "gigatoken"], parse: bool) -> str:
        """Why ``engine`` may not give the reference's ids in this special-token mode (``""``: proven to)."""
        raise NotImplementedError

    def _start_fastokens(self, choice: TokenizerEngine, threads: int | None) -> Future[Any] | None:
        """Start loading the fastokens tokenizer now, beside the reference engine's load; None where
        fastokens cannot be chosen (another engine asked for, or it is not installed)."""
        if choice not in ("auto", "fastokens"):
            return None
        fastokens = import_fastokens(needed=choice == "fastokens")
        return None if fastokens is None else fastokens_loading(lambda: self._fastokens(fastokens), threads)

    def _choose_engine(
        self, choice: TokenizerEngine, started: Future[Any] | None, *, threads: int | None, parse: bool
    ) -> tuple[Engine, str]:
        """The engine asked for, where installed and proven to give the reference's ids in this special-token
        mode, else refused; for ``auto``, fastokens where so (``started``: its load), else the reference
        engine; and why."""
        library = self._reference.name
        if choice == self._wrong_library:
            raise TokenizerError(
                f"tokenizer {self.spec!r} is {self._kind}: its engines are {library}, fastokens and "
                f"gigatoken (got tokenizer_engine={choice!r})"
            )
        mode = "parse" if parse else "text"
        proven = f"proven exact for this tokenizer in {mode} mode"
        # gigatoken only when asked for: in a build here it took as much CPU as fastokens (bench_build)
        if choice == "gigatoken" and import_gigatoken(needed=True):
            why = self._mismatch("gigatoken", parse)
            if not why:
                try:
                    load = self._gigatoken(parse)
                    return GigatokenEngine(load, threads=threads, cache_bytes=GIGATOKEN_CACHE_BYTES), proven
                except TokenizerError as e:
                    why = str(e)
            raise TokenizerError(
                f"{self._refusal.format(engine='gigatoken')} in {mode} mode ({why}); use "
                f"tokenizer_engine='auto' or '{library}'"
            )
        if started is None:
            return self._reference, reference_reason(choice)
        why = self._mismatch("fastokens", parse)
        if not why:
            return FastokensEngine(started, split_special=not parse, fallback=library), proven
        if choice == "fastokens":
            raise TokenizerError(
                f"{self._refusal.format(engine='fastokens')} in {mode} mode ({why}); use "
                f"tokenizer_engine='auto' or '{library}'"
            )
        return self._reference, f"fastokens refused: {why} in {mode} mode"

    @property
    def cores_per_worker(self) -> int:
        """See :class:`Tokenizer`."""
        return self.engine.cores_per_worker

    @property
    def fast_piece_chars(self) -> int | None:
        """See :class:`Tokenizer`: its engine's."""
        return self.engine.fast_piece_chars

    def reference_engine(self) -> Engine:
        """The engine that defines this tokenizer's ids."""
        return self._reference

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """See :class:`Tokenizer`."""
        return self.engine.encode_batch(texts)

    def encode_flat(self, texts: list[str]) -> FlatIds:
        """See :class:`Tokenizer`."""
        return self.engine.encode_flat(texts)

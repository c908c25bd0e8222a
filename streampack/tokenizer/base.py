"""What a tokenizer is to streampack: the :class:`Tokenizer` protocol, the engine it runs
(:func:`describe_engine`), and :class:`LibraryTokenizer`, what the tokenizers a library defines share.

**Text is text.** A document's tokens are the tokenizer's encoding of its text with special-token strings
(``<|endoftext|>``, ``</s>``, ...) encoded as the plain text they are, and no post-processor template
(no BOS/CLS): tiktoken's ``encode_ordinary``, and for Hugging Face ``encode(text,
add_special_tokens=False)`` with ``encode_special_tokens = True``; for one vocabulary both give the same
ids. Control ids come only from streampack (the EOS it appends). ``special_tokens="parse"`` opts into
matching special-token strings as their ids instead (recorded in the manifest).

Each tokenizer also says which cuts of a long text keep its tokens (``cut_safety``, proven from its
structure by :mod:`streampack.tokenizer.pieces`).

**Tokenizer and engine.** A tokenizer decides which ids a text gets: its definition, fingerprint, EOS and
BOS, and the special-token rule above. An :class:`~streampack.tokenizer.engines.Engine` computes them:
``tokenizers`` (``encode_batch_fast``), ``tiktoken``, or ``bytes``. Each tokenizer has a reference engine,
the library it is defined by, whose ids are the ids of the cache whatever engine computes them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import numpy as np

from streampack.tokenizer.choices import TokenizerEngine
from streampack.tokenizer.engines import (
    Engine,
    FastokensLoad,
    FlatIds,
    fastokens_or_reference,
    import_fastokens,
    reference_reason,
    wrong_engine,
)
from streampack.tokenizer.pieces import CutSafety


class Tokenizer(Protocol):
    """What the builder needs of a tokenizer."""

    spec: str
    vocab_size: int
    # What computes its ids (see the module docstring), and why that engine: "proven exact for this
    # tokenizer in parse mode", "fastokens refused: ...", "fastokens is not installed (...)", ...
    engine: Engine
    engine_reason: str

    @property
    def fast_piece_chars(self) -> int | None:
        """Where cuts keep its tokens, documents are cut into pieces of about this many characters, because
        its engine encodes them faster than whole documents (None: no such cuts); see
        :func:`streampack.tokenizer.pieces.piece_rule`."""
        ...

    # Which cuts keep its tokens, proven from its structure.
    cut_safety: CutSafety

    @property
    def cores_per_worker(self) -> int:
        """How many cores one build process of it keeps busy: its engine's threads plus the Python thread
        that reads and frames the documents; see :func:`streampack.builder.running.default_workers`."""
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
    """The ids of texts that recur, each encoded once: a chat template writes the same few strings
    (``<|im_end|>\\n<|im_start|>assistant\\n``) into every conversation, and encoding them one record at a
    time cost a chat build as much as its contents.

    A text's ids are the same whatever batch it is encoded in, so a remembered text's are the ids it would
    get again. Only short texts are kept, and at most :attr:`MAX_TEXTS`: what a template writes around a
    message's fields (a tool call's JSON) may differ in every record.
    """

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
    """The engine that computes a tokenizer's ids, why, and its reference, with versions (for the
    manifest)."""
    engine, reference = tokenizer.engine, tokenizer.reference_engine()
    return {
        "name": engine.name,
        "version": engine.version,
        "reference": f"{reference.name} {reference.version}",
        "why": tokenizer.engine_reason,
    }


class LibraryTokenizer:
    """What the tokenizers a library defines (``tokenizers``, ``tiktoken``) share: that library is their
    reference engine; their engine is it or ``fastokens``, chosen alike (:meth:`_choose_engine`); and they
    encode with their engine.

    A subclass sets ``_kind`` (what it is, for messages) and ``_wrong_library`` (the other library's
    engine, which cannot compute its ids), makes its reference engine ``_reference`` and then its engine
    with :meth:`_choose_engine`.
    """

    _kind: str
    _wrong_library: str
    spec: str
    _reference: Engine
    engine: Engine
    engine_reason: str

    def _choose_engine(
        self,
        choice: TokenizerEngine,
        threads: int | None,
        *,
        problem: Callable[[], str],
        load: Callable[[Any], Any],
        split_special: bool,
        refusal: str,
        started: FastokensLoad | None = None,
    ) -> tuple[Engine, str]:
        """The reference engine, or ``fastokens`` where it is installed and proven to give the same ids in
        this special-token mode; and why.

        Args:
            choice: the engine asked for.
            threads: the engine's threads.
            problem: why fastokens may not give the ids (``""``: proven to), asked only where it is installed.
            load: makes the ``fastokens.Tokenizer`` from the ``fastokens`` module.
            split_special: special-token strings are text.
            refusal: the start of the error when fastokens is asked for and not proven.
            started: the load :meth:`_start_fastokens` started, if it did.
        """
        library = self._reference.name
        if choice == self._wrong_library:
            raise wrong_engine(self.spec, choice, self._kind, f"{library} and fastokens")
        fastokens = import_fastokens(needed=choice == "fastokens") if choice != library else None
        if fastokens is None:
            return self._reference, reference_reason(choice, fastokens)
        return fastokens_or_reference(
            self._reference,
            choice,
            problem(),
            lambda: started or FastokensLoad(lambda: load(fastokens), threads),
            split_special=split_special,
            refusal=refusal,
        )

    @staticmethod
    def _start_fastokens(
        choice: TokenizerEngine, threads: int | None, load: Callable[[Any], Any]
    ) -> FastokensLoad | None:
        """Start loading the fastokens tokenizer now, before the reference engine loads and the structure
        that decides whether fastokens may run is read (:meth:`_choose_engine` then takes the load, or it is
        dropped): the load lets go of the GIL, and a build's encoders wait for it. None where fastokens
        will not be chosen whatever the structure (another engine asked for, or it is not installed)."""
        if choice not in ("auto", "fastokens"):
            return None
        fastokens = import_fastokens(needed=False)
        return None if fastokens is None else FastokensLoad(lambda: load(fastokens), threads)

    @property
    def cores_per_worker(self) -> int:
        """See :class:`Tokenizer`."""
        return self.engine.cores_per_worker

    @property
    def fast_piece_chars(self) -> int | None:
        """See :class:`Tokenizer`: its engine's."""
        return self.engine.fast_piece_chars

    def reference_engine(self) -> Engine:
        """The engine that defines this tokenizer's ids: its library's."""
        return self._reference

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """See :class:`Tokenizer`."""
        return self.engine.encode_batch(texts)

    def encode_flat(self, texts: list[str]) -> FlatIds:
        """See :class:`Tokenizer`."""
        return self.engine.encode_flat(texts)

"""A Hugging Face ``tokenizer.json``, its EOS and BOS (from a ``tokenizer_config.json`` beside it)."""

from __future__ import annotations

import array
import hashlib
import json
import re
import threading
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np
import orjson

from streampack.errors import TokenizerError
from streampack.tokenizer import preload
from streampack.tokenizer.base import RecurringTexts, TokenizerBase
from streampack.tokenizer.choices import SpecialTokens, TokenizerEngine
from streampack.tokenizer.engines import TokenizersEngine, text_is_whole
from streampack.tokenizer.pieces import hf_cut_safety
from streampack.tokenizer.proofs import ADDED_FLAGS, fastokens_mismatch_hf, gigatoken_mismatch_hf
from streampack.tokenizer.specials import BOS_NAMES, EOS_NAMES


class HFTokenizer(TokenizerBase):
    """A Hugging Face tokenizer loaded from a local ``tokenizer.json``; ``tokenizers`` is its reference."""

    _kind = "a tokenizer.json"
    _wrong_library = "tiktoken"
    _reference: TokenizersEngine

    def __init__(
        self,
        spec: str,
        *,
        threads: int | None = None,
        special_tokens: SpecialTokens = "text",
        engine: TokenizerEngine = "auto",
    ) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(spec)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(
                f"tokenizer {spec!r}: no such file; pass a tokenizer.json path or a folder holding one, "
                "'bytes', or 'tiktoken:PATH'"
            )
        self.spec = spec
        self._path = path
        self._refusal = f"{path}: {{engine}} is not known to give this tokenizer's ids"
        self._definition = path.read_bytes()
        started = self._start_fastokens(engine, threads)
        try:
            text = self._definition.decode("utf-8")  # once: ~7 ms for GPT-2's 3.5 MB
            self._tok = _Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises a bare Exception for unparsable files
            raise TokenizerError(f"{path}: not a valid Hugging Face tokenizer.json ({e})") from None
        text_is_whole(self._tok)
        self._tok.encode_special_tokens = special_tokens == "text"
        self._parsing: Any = None if special_tokens == "text" else self._tok  # see _parse_specials
        self._parsing_lock = threading.Lock()
        self._template_ids = RecurringTexts(self._parse_specials)
        self._structure = self._structure_of(text)
        self.cut_safety = hf_cut_safety(self._structure, parse_special=special_tokens == "parse")
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self._config = self._read_config()
        self._eos_id, self._eos_problem = self._find_special("eos_token", EOS_NAMES, added_only=False)
        self._bos_id, self._bos_problem = self._find_special("bos_token", BOS_NAMES, added_only=True)
        self._reference = TokenizersEngine(self._tok, threads=threads)
        parse = special_tokens == "parse"
        self.engine, self.engine_reason = self._choose_engine(engine, started, threads=threads, parse=parse)
        if self._parsing is None and self.engine is not self._reference:
            self._reference.exclusive = self._parsing_lock  # see _parse_specials

    def _fastokens(self, fastokens: Any) -> Any:
        # the load the command began before its imports (streampack.tokenizer.preload), if of these bytes
        definition = self._definition
        return preload.taken_or_loaded(
            definition, lambda: fastokens.Tokenizer.from_json_str(definition.decode("utf-8"))
        )

    def _gigatoken(self, parse: bool) -> Callable[[], Any]:
        form = gigatoken_form(self._definition.decode("utf-8"), parse_special=parse)
        return partial(_load_gigatoken, form)

    def _mismatch(self, engine: Literal["fastokens", "gigatoken"], parse: bool) -> str:
        mismatch = gigatoken_mismatch_hf if engine == "gigatoken" else fastokens_mismatch_hf
        return mismatch(self._structure, parse_special=parse)

    def _structure_of(self, text: str) -> dict[str, Any]:
        """The parts of the definition that decide which cuts keep the tokens and whether fastokens is exact,
        read from the loaded tokenizer (parsing the whole file again costs ~0.1 s per process)."""

        def state(part: Any) -> Any:
            return None if part is None else json.loads(part.__getstate__())

        # The ids the file declares: fastokens gives those, tokenizers numbers its added tokens itself
        # (the vocabulary's id where the content is a vocabulary entry, else the next free id).
        declared = _json_member(text, "added_tokens")
        added = [t for t in declared if isinstance(t, dict)] if isinstance(declared, list) else []
        return {
            "normalizer": state(self._tok.normalizer),
            "pre_tokenizer": state(self._tok.pre_tokenizer),
            "model": {
                "type": type(self._tok.model).__name__,
                **{
                    key: getattr(self._tok.model, key, None)
                    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback")
                },
            },
            "added_tokens": [
                {
                    "id": t.get("id"),
                    "content": str(t.get("content", "")),
                    **{key: bool(t.get(key)) for key in ADDED_FLAGS},
                    "vocab_id": self._tok.token_to_id(str(t.get("content", ""))),
                    "in_model": self._tok.model.token_to_id(str(t.get("content", ""))) is not None,
                }
                for t in added
            ],
        }

    @property
    def eos_id(self) -> int | None:
        """The tokenizer's EOS id (its config's ``eos_token``, else a usual EOS name), or None.

        Raises:
            TokenizerError: ``tokenizer_config.json`` names an EOS token the vocabulary lacks.
        """
        if self._eos_problem:
            raise TokenizerError(self._eos_problem)
        return self._eos_id

    @property
    def bos_id(self) -> int | None:
        """The tokenizer's BOS id (its config's ``bos_token``, else an added token named like a BOS), or None.

        Raises:
            TokenizerError: ``tokenizer_config.json`` names a BOS token the vocabulary lacks.
        """
        if self._bos_problem:
            raise TokenizerError(self._bos_problem)
        return self._bos_id

    @property
    def config_path(self) -> Path:
        """Where the ``tokenizer_config.json`` beside the ``tokenizer.json`` is (it may not exist)."""
        return self._path.parent / "tokenizer_config.json"

    def _read_config(self) -> dict[str, Any]:
        """The ``tokenizer_config.json`` beside the ``tokenizer.json``, or ``{}`` when there is none."""
        path = self.config_path
        if not path.is_file():
            return {}
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, OSError) as e:
            raise TokenizerError(f"{path}: not a valid tokenizer_config.json ({e})") from None
        if not isinstance(config, dict):
            raise TokenizerError(f"{path}: not a valid tokenizer_config.json (a {type(config).__name__})")
        return config

    def config_token(self, key: str) -> str | None:
        """The string of the config's special token ``key`` (``bos_token``, ``eos_token``), or None."""
        token = self._config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        return token if isinstance(token, str) else None

    def _find_special(self, key: str, names: tuple[str, ...], *, added_only: bool) -> tuple[int | None, str]:
        """The id of the config's ``key`` token, else of the first of ``names`` in the vocabulary (the added
        tokens only with ``added_only``); and the problem to raise when the config's token is unknown."""
        token = self.config_token(key)
        if token is not None:
            token_id = self._tok.token_to_id(token)
            if token_id is None:
                kind = key.split("_")[0]
                return None, (
                    f"{self.config_path}: {key} {token!r} is not in the vocabulary of {self._path}; fix the "
                    f"config, or give the {kind.upper()} id explicitly ({kind}_id=N)"
                )
            return token_id, ""
        added = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}
        for name in names:
            token_id = added.get(name) if added_only else self._tok.token_to_id(name)
            if token_id is not None:
                return token_id, ""
        return None, ""

    def fingerprint(self) -> dict[str, Any]:
        """See :class:`Tokenizer`."""
        digest = hashlib.sha256(self._definition).hexdigest()
        return {"kind": "hf", "name": self._path.name, "vocab_size": self.vocab_size, "sha256": digest}

    def encode_specials(self, texts: list[str]) -> list[np.ndarray]:
        """See :class:`Tokenizer`; each distinct text is encoded once (see :class:`RecurringTexts`)."""
        return self._template_ids(texts)

    def _parse_specials(self, texts: list[str]) -> list[np.ndarray]:
        """The ids of ``texts`` with special-token strings as their ids (chat builds' template pieces).

        ``encode_special_tokens`` is a setting of the shared tokenizer object: where another engine computes
        the ids, the reference's sample checks and these calls take turns with it; else a second instance,
        loaded on first use, parses them.
        """
        if self._reference.exclusive is not None:
            with self._reference.exclusive:
                self._tok.encode_special_tokens = False
                try:
                    encodings = self._tok.encode_batch(texts, add_special_tokens=False)
                finally:
                    self._tok.encode_special_tokens = True
        else:
            with self._parsing_lock:
                if self._parsing is None:
                    from tokenizers import Tokenizer as _Tokenizer

                    self._parsing = _Tokenizer.from_str(self._definition.decode("utf-8"))
                    text_is_whole(self._parsing)
            encodings = self._parsing.encode_batch(texts, add_special_tokens=False)
        return [np.frombuffer(array.array("I", e.ids), dtype=np.uint32) for e in encodings]

    @property
    def config(self) -> dict[str, Any]:
        """The ``tokenizer_config.json`` beside the ``tokenizer.json`` (``{}`` when there is none)."""
        return dict(self._config)

    def decode(self, ids: Iterable[int]) -> str:
        """See :class:`Tokenizer`."""
        return self._tok.decode(list(ids), skip_special_tokens=False)


def _load_gigatoken(form: str) -> Any:
    """The ``gigatoken.Tokenizer`` of a ``tokenizer.json``'s text."""
    import gigatoken

    return gigatoken.Tokenizer.from_json(form)


def gigatoken_form(text: str, *, parse_special: bool) -> str:
    """The ``tokenizer.json`` that gigatoken loads: the file itself where special tokens are parsed, else the
    file without its added tokens, which gigatoken matches in the text whatever their flags. (Their ids stay
    in the model's vocabulary where they are entries of it, which no merge of the text's bytes reaches in a
    byte-level BPE whose added tokens are all special: :func:`gigatoken_mismatch_hf`.)"""
    if parse_special:
        return text
    definition = orjson.loads(text)
    definition["added_tokens"] = []
    return orjson.dumps(definition).decode("utf-8")


def _json_member(text: str, key: str) -> Any:
    """The member ``key`` of the JSON object ``text`` (None when absent), parsing only the members before it:
    a ``tokenizer.json``'s ``added_tokens`` come before its large ``model``."""
    decoder = json.JSONDecoder()

    def skip(at: int) -> int:  # past JSON whitespace
        found = _JSON_SPACE.match(text, at)
        return found.end() if found else at

    at = skip(0)
    if text[at : at + 1] != "{":
        return None
    at = skip(at + 1)
    while text[at : at + 1] == '"':
        name, at = decoder.raw_decode(text, at)
        at = skip(at)
        if text[at : at + 1] != ":":
            return None
        value, at = decoder.raw_decode(text, skip(at + 1))
        if name == key:
            return value
        at = skip(at)
        if text[at : at + 1] == ",":
            at = skip(at + 1)
    return None


_JSON_SPACE = re.compile(r"[ \t\n\r]*")

"""A tiktoken encoding from a local ranks file (``NAME.tiktoken``) and its JSON sidecar (``NAME.json``)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np

from streampack.errors import TokenizerError, extra_needed
from streampack.tokenizer import preload
from streampack.tokenizer.base import TokenizerBase
from streampack.tokenizer.choices import SpecialTokens, TokenizerEngine
from streampack.tokenizer.engines import RoutedEngine, TiktokenEngine
from streampack.tokenizer.fast_forms import fast_split, load_fast_tiktoken
from streampack.tokenizer.pieces import tiktoken_cut_safety
from streampack.tokenizer.proofs import GIGATOKEN_SCHEMES, tiktoken_mismatch
from streampack.tokenizer.specials import EOS_NAMES


class TiktokenTokenizer(TokenizerBase):
    """A tiktoken encoding built from a local ranks file and its sidecar (pattern, special tokens)."""

    _kind = "a tiktoken encoding"
    _wrong_library = "tokenizers"

    def __init__(
        self,
        spec: str,
        *,
        threads: int | None = None,
        special_tokens: SpecialTokens = "text",
        engine: TokenizerEngine = "auto",
    ) -> None:
        with extra_needed("the tiktoken backend", "the tiktoken package", "tiktoken"):
            import tiktoken
        ranks = Path(spec.removeprefix(preload.TIKTOKEN_PREFIX))
        if not ranks.name:
            raise TokenizerError(
                f"tokenizer {spec!r}: no ranks file named; pass tiktoken:/path/to/NAME.tiktoken"
            )
        sidecar = ranks.with_suffix(".json")
        if not ranks.is_file():
            raise TokenizerError(
                f"tokenizer {spec!r}: no ranks file at {ranks}; pass tiktoken:/path/to/NAME.tiktoken "
                "(streampack never downloads one)"
            )
        if not sidecar.is_file():
            raise TokenizerError(
                f"tokenizer {spec!r}: {sidecar} is missing; it holds the encoding's 'pat_str' and "
                "'special_tokens' (JSON)"
            )
        self.spec = spec
        self._refusal = f"{ranks}: {{engine}} is not known to give this encoding's ids"
        self._definition = ranks.read_bytes() + sidecar.read_bytes()
        try:
            mergeable_ranks = _read_ranks(ranks)
        except ValueError as e:
            raise TokenizerError(str(e)) from None
        pattern, specials, n_vocab = _read_sidecar(sidecar, mergeable_ranks)
        self._ranks_file, self._ranks = ranks, mergeable_ranks
        self._pattern, self._specials = pattern, specials
        started = self._start_fastokens(engine, threads)
        try:
            self._enc = tiktoken.Encoding(
                ranks.stem,
                pat_str=pattern,
                mergeable_ranks=mergeable_ranks,
                special_tokens=specials,
                explicit_n_vocab=n_vocab,
            )
        except (ValueError, KeyError, TypeError, OverflowError) as e:
            raise TokenizerError(f"tokenizer {spec!r}: cannot load ({type(e).__name__}: {e})") from None
        self._name = ranks.stem
        self.vocab_size = self._enc.n_vocab
        self.eos_id = next((specials[n] for n in EOS_NAMES if n in specials), None)
        self.bos_id: int | None = None  # a ranks file says nothing of a BOS: give bos_id
        self._allowed = set(specials) if special_tokens == "parse" else set()
        self.cut_safety = tiktoken_cut_safety(pattern, specials, parse_special=special_tokens == "parse")
        self._reference = TiktokenEngine(self._enc, allowed=self._allowed, threads=threads)
        parse = special_tokens == "parse"
        chosen, self.engine_reason = self._choose_engine(engine, started, threads=threads, parse=parse)
        split = fast_split(pattern)
        if split is not None and split.exact_for and chosen.name == "fastokens":
            chosen = RoutedEngine(chosen, self._reference, split.exact_for)
            self.engine_reason += (
                "; texts holding U+017F (long s, where its fast form splits otherwise) by tiktoken"
            )
        self.engine = chosen

    def _fastokens(self, fastokens: Any) -> Any:
        def load() -> Any:
            return load_fast_tiktoken(fastokens, self._ranks_file, self._ranks, self._pattern, self._specials)

        # the load the command began before its imports (streampack.tokenizer.preload), if of these bytes
        return preload.taken_or_loaded(self._definition, load)

    def _gigatoken(self, parse: bool) -> Callable[[], Any]:
        scheme = GIGATOKEN_SCHEMES[self._pattern]
        return partial(_load_gigatoken, self._ranks_file, scheme, self._specials if parse else {})

    def _mismatch(self, engine: Literal["fastokens", "gigatoken"], parse: bool) -> str:
        return tiktoken_mismatch(self._pattern, self._specials, parse_special=parse, engine=engine)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("TiktokenTokenizer is not picklable: load it in each process from its spec")

    def fingerprint(self) -> dict[str, Any]:
        """See :class:`Tokenizer`."""
        digest = hashlib.sha256(self._definition).hexdigest()
        return {"kind": "tiktoken", "name": self._name, "vocab_size": self.vocab_size, "sha256": digest}

    def encode_specials(self, texts: list[str]) -> list[np.ndarray]:
        """See :class:`Tokenizer`."""
        batch = self._enc.encode_batch(texts, allowed_special="all", disallowed_special=())
        return [np.array(ids, dtype=np.uint32) for ids in batch]

    def decode(self, ids: Iterable[int]) -> str:
        """See :class:`Tokenizer`."""
        return self._enc.decode(list(ids))


def _load_gigatoken(ranks: Path, scheme: str, specials: dict[str, int]) -> Any:
    """The ``gigatoken.Tokenizer`` of a ranks file, split by gigatoken's ``scheme``, matching ``specials``."""
    import gigatoken

    return gigatoken.Tokenizer.from_tiktoken(str(ranks), pretokenizer=scheme, special_tokens=dict(specials))


def _read_sidecar(path: Path, ranks: dict[bytes, int]) -> tuple[str, dict[str, int], int | None]:
    """The split pattern, special tokens and explicit vocabulary size of a tiktoken sidecar, validated."""
    try:
        meta = json.loads(path.read_bytes())
    except ValueError as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("pat_str"), str):
        raise TokenizerError(f"{path}: needs a 'pat_str' string (the encoding's split pattern)")
    specials = meta.get("special_tokens", {})
    if not isinstance(specials, dict):
        raise TokenizerError(
            f"{path}: 'special_tokens' must be an object of token string -> id (got a "
            f"{type(specials).__name__})"
        )
    taken = set(ranks.values())
    for token, token_id in specials.items():
        if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < 1 << 32:
            raise TokenizerError(
                f"{path}: special_tokens[{token!r}] = {token_id!r} is not an id in [0, 2**32)"
            )
        if token_id in taken:
            raise TokenizerError(
                f"{path}: special_tokens[{token!r}] = {token_id} is also the rank of a regular token; "
                "give the special token an id of its own"
            )
    n_vocab = meta.get("explicit_n_vocab")
    real = max([*taken, *specials.values()], default=-1) + 1
    if n_vocab is not None and n_vocab != real:
        raise TokenizerError(
            f"{path}: explicit_n_vocab is {n_vocab!r}, but the ranks and special tokens make {real} ids; "
            "fix it or leave it out"
        )
    return meta["pat_str"], specials, n_vocab


def _read_ranks(path: Path) -> dict[bytes, int]:
    """Parse a ``.tiktoken`` ranks file (``base64-token rank`` per line); not ``load_tiktoken_bpe``, whose
    cache by path would serve an edited file's old ranks."""
    ranks = {}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if line.strip():
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error):
                raise ValueError(f"{path}:{number}: expected 'base64-token rank'") from None
    return ranks

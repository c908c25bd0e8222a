"""The tokenizer package's names under the path that held them all until 0.2 (and that the 0.1 alias
``streampack.tokenize`` names): each is defined in the module of its idea, and imported from there by
streampack itself.

- :mod:`~streampack.tokenizer.base`: the :class:`Tokenizer` protocol, :func:`describe_engine`;
- :mod:`~streampack.tokenizer.load`: :func:`load_tokenizer` and its table of SPEC kinds;
- :mod:`~streampack.tokenizer.choices`: the special-token modes and the engine choices;
- :mod:`~streampack.tokenizer.specials`: the EOS and BOS policies;
- :mod:`~streampack.tokenizer.engines`: the :class:`Engine` protocol, the four engines, the engine choice;
- :mod:`~streampack.tokenizer.proofs`: where the fast engine is proven exact;
- :mod:`~streampack.tokenizer.bytes`, :mod:`~streampack.tokenizer.hf`, :mod:`~streampack.tokenizer.tiktoken`:
  the three kinds of tokenizer.
"""

from __future__ import annotations

from streampack.tokenizer.base import Tokenizer, describe_engine
from streampack.tokenizer.bytes import BytesTokenizer
from streampack.tokenizer.choices import ENGINE_CHOICES, SPECIAL_TOKENS, SpecialTokens, TokenizerEngine
from streampack.tokenizer.engines import (  # noqa: F401  (the private helpers too, for code that reached them)
    BytesEngine,
    Engine,
    FastokensEngine,
    TiktokenEngine,
    TokenizersEngine,
    _environment,
    _fastokens_or_reference,
    _import_fastokens,
    _package_version,
    _reference_reason,
    _text_is_whole,
    _wrong_engine,
    fastokens_unsupported_platform,
)
from streampack.tokenizer.hf import _JSON_SPACE, HFTokenizer, _json_member  # noqa: F401
from streampack.tokenizer.load import load_tokenizer
from streampack.tokenizer.preload import TIKTOKEN_PREFIX
from streampack.tokenizer.proofs import (  # noqa: F401
    _ADDED_FLAGS,
    _byte_level_problem,
    _matched_added_problem,
    _overlapping,
    fastokens_mismatch_hf,
    fastokens_mismatch_tiktoken,
)
from streampack.tokenizer.specials import BOS_NAMES, EOS_NAMES, BosPolicy, EosPolicy, resolve_bos, resolve_eos
from streampack.tokenizer.tiktoken import TiktokenTokenizer, _read_ranks, _read_sidecar  # noqa: F401

__all__ = [
    "BOS_NAMES",
    "ENGINE_CHOICES",
    "EOS_NAMES",
    "SPECIAL_TOKENS",
    "TIKTOKEN_PREFIX",
    "BosPolicy",
    "BytesEngine",
    "BytesTokenizer",
    "Engine",
    "EosPolicy",
    "FastokensEngine",
    "HFTokenizer",
    "SpecialTokens",
    "TiktokenEngine",
    "TiktokenTokenizer",
    "Tokenizer",
    "TokenizerEngine",
    "TokenizersEngine",
    "describe_engine",
    "fastokens_mismatch_hf",
    "fastokens_mismatch_tiktoken",
    "fastokens_unsupported_platform",
    "load_tokenizer",
    "resolve_bos",
    "resolve_eos",
]

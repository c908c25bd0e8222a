"""cl100k_base and o200k_base through fastokens' fast splitters: the same ids as tiktoken itself.

fastokens splits the caseless spellings of their patterns (Llama 3's for cl100k) with hand-written code,
~10x its general regex, folding only the contractions' ASCII cases: exactly the spelling with the cases
listed (js-tiktoken's, the sidecars' here). tiktoken's own caseless spelling also folds U+017F (long s), so
there texts holding it go to tiktoken.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard

import streampack
from streampack.tokenizer import load_tokenizer
from streampack.tokenizer.engines import RoutedEngine
from streampack.tokenizer.fast_forms import fast_split
from streampack.tokenizer.pieces import CL100K_CASELESS, O200K_CASELESS
from tests.conftest import SAMPLE_CORPUS, TIKTOKEN_GPT2

tiktoken = pytest.importorskip("tiktoken")
tiktoken_load = pytest.importorskip("tiktoken.load")
fastokens = pytest.importorskip("fastokens")

ENCODINGS = ("cl100k_base", "o200k_base")


def _ranks(name: str) -> Path:
    path = TIKTOKEN_GPT2.with_name(f"{name}.tiktoken")
    if not path.exists():
        pytest.skip(f"{path} is absent (../shared/data)")
    return path


@pytest.fixture(scope="module", params=ENCODINGS)
def encoding(request: pytest.FixtureRequest) -> tuple[Path, Any]:
    """A ranks file and tiktoken's own encoding of it, from its sidecar."""
    ranks = _ranks(request.param)
    meta = json.loads(ranks.with_suffix(".json").read_text())
    reference = tiktoken.Encoding(
        request.param,
        pat_str=meta["pat_str"],
        mergeable_ranks=tiktoken_load.load_tiktoken_bpe(str(ranks)),
        special_tokens=meta["special_tokens"],
    )
    return ranks, reference


@pytest.fixture(scope="module")
def texts() -> list[str]:
    if not SAMPLE_CORPUS.exists():
        pytest.skip(f"the sample corpus is absent ({SAMPLE_CORPUS})")
    with zstandard.open(SAMPLE_CORPUS, "rt") as f:
        return [json.loads(line)["text"] for line in itertools.islice(f, 250)]


def _long_s_cases() -> list[str]:
    """Texts around an apostrophe before U+017F (where the two spellings split apart), and near misses."""
    before = ["", "a", "word", " I", "A", " ", "1", "'", "\n", "中"]
    middle = ["'ſ", "'ſſ", "'ſt", "'ſS", "'s", "'S", "'ll", "'lL", "'Ll", "'ſll", "'ſe"]
    after = ["", "t", "tart", " ", "'", "ſ", "S", "1", "\n", "中", "e", "ſe x"]
    return ["".join(parts) for parts in itertools.product(before, middle, after)]


def _random_texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = [*" \t\n\r\x0b\x0c\x85\xa0\u2028\u3000'sStTdDmMlLvVrReE0123456789٣/ſ\u212aǅßé\u0301😀中"]
    alphabet += [chr(c) for c in rng.sample(range(0x20, 0x3000), 300)]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(count)]


@pytest.mark.slow
def test_the_auto_engine_is_fastokens_and_gives_tiktokens_ids(
    encoding: tuple[Path, Any], texts: list[str]
) -> None:
    ranks, reference = encoding
    tokenizer = load_tokenizer(f"tiktoken:{ranks}")
    assert tokenizer.engine.name == "fastokens" and not isinstance(tokenizer.engine, RoutedEngine)
    cases = [*texts, *_long_s_cases(), *_random_texts(1500, seed=1)]
    got = tokenizer.encode_batch(cases)
    for text, ids in zip(cases, got, strict=True):
        assert ids.tolist() == reference.encode_ordinary(text), text[:80]


@pytest.mark.slow
def test_the_caseless_spelling_routes_long_s_texts_to_tiktoken(
    tmp_path: Path, encoding: tuple[Path, Any]
) -> None:
    """tiktoken's own spelling folds 'ſ as 's; fastokens' fast splitter does not, so alone it gives other
    ids for some texts holding U+017F (o200k: " I'ſ" is one piece, where BPE merges " I'"), and the same
    for every other text."""
    ranks, _ = encoding
    meta = json.loads(ranks.with_suffix(".json").read_text())
    caseless = CL100K_CASELESS if ranks.stem == "cl100k_base" else O200K_CASELESS
    (tmp_path / ranks.name).symlink_to(ranks)
    (tmp_path / f"{ranks.stem}.json").write_text(json.dumps({**meta, "pat_str": caseless}))
    table = tiktoken_load.load_tiktoken_bpe(str(ranks))
    reference = tiktoken.Encoding("caseless", pat_str=caseless, mergeable_ranks=table, special_tokens={})
    tokenizer = load_tokenizer(f"tiktoken:{tmp_path / ranks.name}")
    assert isinstance(tokenizer.engine, RoutedEngine) and "U+017F" in tokenizer.engine_reason
    cases = [*_long_s_cases(), *_random_texts(1000, seed=2)]
    for text, ids in zip(cases, tokenizer.encode_batch(cases), strict=True):
        assert ids.tolist() == reference.encode_ordinary(text), text

    split = fast_split(caseless)
    assert split is not None and split.exact_for == "\u017f"
    fast = tokenizer.engine.fast.encode_batch(cases)
    differ = [t for t, ids in zip(cases, fast, strict=True) if ids.tolist() != reference.encode_ordinary(t)]
    assert all("\u017f" in t for t in differ)
    if ranks.stem == "o200k_base":
        assert differ, "the case the routing exists for no longer differs: recheck fast_split's table"


def test_a_cl100k_cache_is_the_same_with_either_engine(tmp_path: Path, texts: list[str]) -> None:
    ranks = _ranks("cl100k_base")
    documents = [*texts[:120], "it'ſ the end", "A word'ſ tail"]
    for engine in ("tiktoken", "auto"):
        streampack.build(
            streampack.Documents(documents),
            tmp_path / engine,
            tokenizer=f"tiktoken:{ranks}",
            tokenizer_engine=engine,
        )
    plain, fast = streampack.open(tmp_path / "tiktoken"), streampack.open(tmp_path / "auto")
    assert fast.manifest.engines[0].name == "fastokens"
    assert plain.num_docs == fast.num_docs == len(documents)
    for i in range(plain.num_docs):
        np.testing.assert_array_equal(plain.doc(i), fast.doc(i))

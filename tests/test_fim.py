"""Fill-in-the-middle with real tokenizers: the sentinels found by name in the tokenizer that built the
cache, and refused, naming them, where it has none. The FIM rule itself is checked against the reference
model (``tests/test_reference_model.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import streampack
from streampack.errors import OptionsError, TokenizerError
from streampack.loader import Loader
from tests.conftest import GPT2_JSON

SENTINELS = ("<fim_prefix>", "<fim_middle>", "<fim_suffix>")
CODE = [
    "def add(a, b):\n    return a + b\n" * 3,
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n" * 2,
    "for i in range(10):\n    print(i * i)\n" * 4,
]


def _gpt2() -> Path:
    if not GPT2_JSON.is_file():
        pytest.skip("the GPT-2 tokenizer.json of shared/data/tokenizers is not here")
    return GPT2_JSON


def _with_sentinels(tmp: Path) -> Path:
    """GPT-2's tokenizer.json with the StarCoder sentinels added as special tokens (ids 50257-50259)."""
    definition = json.loads(_gpt2().read_text(encoding="utf-8"))
    first = 1 + max(t["id"] for t in definition["added_tokens"])
    for offset, content in enumerate(SENTINELS):
        definition["added_tokens"].append(
            {
                "id": first + offset,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
    path = tmp / "fim-tokenizer" / "tokenizer.json"
    path.parent.mkdir()
    path.write_text(json.dumps(definition), encoding="utf-8")
    return path


def _build(tmp: Path, name: str, tokenizer: str) -> Any:
    inputs = tmp / f"{name}.jsonl"
    with open(inputs, "w", encoding="utf-8") as file:
        for text in CODE * 4:
            file.write(json.dumps({"text": text}) + "\n")
    streampack.build([str(inputs)], tmp / name, tokenizer=tokenizer, progress=False)
    return streampack.open(tmp / name)


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("fim")
    return {
        "fim": _build(tmp, "fim", str(_with_sentinels(tmp))),
        "gpt2": _build(tmp, "gpt2", str(_gpt2())),
        "bytes": _build(tmp, "bytes", "bytes"),
        "tokenizer": _with_sentinels(tmp_path_factory.mktemp("again")),
    }


def test_the_sentinels_come_from_the_tokenizer_that_built_the_cache(caches: dict[str, Any]) -> None:
    cache = caches["fim"]
    fim = cache.sequences(32).fim(rate=1.0, min_length=8)
    assert fim.fim_settings.ids == (50257, 50258, 50259)
    spelled = cache.sequences(32).fim(rate=1.0, min_length=8, sentinels=SENTINELS)
    assert spelled.fim_settings == fim.fim_settings
    rows = fim[np.arange(len(fim))]
    plain = cache.sequences(32)[np.arange(len(fim))]
    assert rows.shape == plain.shape
    assert (rows == 50257).any() and (rows == 50258).any() and (rows == 50259).any()
    assert not np.isin(plain, [50257, 50258, 50259]).any()
    batch = next(iter(Loader(fim, batch_size=4, seed=1, output="dict")))
    assert np.isin(batch["input_ids"], [50257, 50258, 50259]).any()


def test_a_tokenizer_without_sentinels_is_refused_naming_them(caches: dict[str, Any]) -> None:
    for name in ("gpt2", "bytes"):
        with pytest.raises(TokenizerError, match=r"<fim_prefix>.*<fim_middle>.*<fim_suffix>") as raised:
            caches[name].sequences(32).fim()
        assert "sentinels=(prefix_id, middle_id, suffix_id)" in str(raised.value)
    with pytest.raises(TokenizerError, match="'<PRE>', '<MID>'"):
        caches["fim"].sequences(32).fim(sentinels=("<PRE>", "<MID>", "<SUF>"))


def test_sentinels_outside_the_cache_vocabulary_are_refused(caches: dict[str, Any]) -> None:
    # The sentinels of another tokenizer, whose ids the cache's vocabulary does not hold.
    with pytest.raises(OptionsError, match="prefix id"):
        caches["gpt2"].sequences(32).fim(tokenizer=str(caches["tokenizer"]))
    with pytest.raises(OptionsError, match="rate"):
        caches["gpt2"].sequences(32).fim(rate=1.5, sentinels=(1, 2, 3))
    with pytest.raises(OptionsError, match="min_length"):
        caches["gpt2"].sequences(32).fim(min_length=3, sentinels=(1, 2, 3))


def test_fim_rows_pickle_and_keep_their_settings(caches: dict[str, Any]) -> None:
    import pickle

    fim = caches["fim"].packed(64).fim(rate=0.5, spm_rate=1.0, seed=3, min_length=8)
    again = pickle.loads(pickle.dumps(fim))
    indices = np.arange(len(fim))
    assert np.array_equal(again[indices], fim[indices])
    assert again.fingerprint() == fim.fingerprint() and "fim" in fim.fingerprint()


def test_fim_rows_read_every_way_agree(caches: dict[str, Any]) -> None:
    """The loader's planned batches, a mixture of FIM'd and plain samples, ``read`` into chosen rows of a
    wider, non-contiguous array and ``[index]`` all serve the same FIM'd rows (the rule itself is the
    reference model's)."""
    from streampack.order.mixture import Mixture

    cache = caches["fim"]
    plain = cache.sequences(24)
    fim = plain.fim(rate=1.0, spm_rate=0.5, seed=2, min_length=6)
    indices = np.arange(len(fim))
    rows = fim[indices]
    assert not np.array_equal(rows, plain[indices])
    wide = np.zeros((2 * len(fim) + 1, fim.width), dtype=np.int32, order="F")
    fim.read(indices[::-1], out=wide, rows=2 * indices + 1)
    assert np.array_equal(wide[2 * indices + 1], rows[::-1]) and not wide[0::2].any()
    loader = Loader(
        Mixture({"fim": fim, "plain": plain}, weights={"fim": 1, "plain": 1}, seed=3), batch_size=4
    )
    served = 0
    for position, batch in zip(range(0, 40, 4), loader, strict=False):
        sources, samples = loader.picks(position)
        expected = np.stack([(fim, plain)[s][i] for s, i in zip(sources.tolist(), samples.tolist())])
        assert np.array_equal(batch, expected)
        served += int((sources == 0).sum())
    assert served


def test_which_says_where_a_fim_pieces_parts_sit(caches: dict[str, Any]) -> None:
    """``which`` marks each FIM'd piece PSM or SPM and places its prefix, middle and suffix: each part's
    columns of the served batch hold those tokens of the document, and the prefix sentinel starts it."""
    cache = caches["fim"]
    fim = cache.sequences(40).fim(rate=0.7, spm_rate=0.5, seed=1, min_length=8)
    loader = Loader(fim, batch_size=4, seed=2)
    orders = []
    for step in range(len(fim) // 4):
        batch = loader.batch(step * 4)
        for doc in streampack.which(loader, step):
            tokens = cache.doc(doc.doc)
            for placed in doc.placements:
                row = batch[placed.row]
                if placed.fim_order is None:
                    served = row[placed.columns[0] : placed.columns[1]]
                    assert served.tolist() == tokens[placed.tokens[0] : placed.tokens[1]].tolist()
                    continue
                orders.append(placed.fim_order)
                assert row[placed.columns[0]] == 50257  # <fim_prefix>
                assert [name for name, _, _ in placed.fim] == (
                    ["prefix", "suffix", "middle"]
                    if placed.fim_order == "PSM"
                    else ["suffix", "prefix", "middle"]
                )
                for _, (lo, hi), (first, stop) in placed.fim:
                    assert row[lo:hi].tolist() == tokens[first:stop].tolist()
    assert "PSM" in orders and "SPM" in orders


def test_a_cache_with_a_bos_is_refused(tmp_path: Path) -> None:
    """Every document of a cache built with a BOS starts with it: FIM would serve it inside the document
    (after the suffix, in SPM), so fim() refuses such a cache and says how to build one it takes."""
    inputs = tmp_path / "code.jsonl"
    inputs.write_text("".join(json.dumps({"text": text}) + "\n" for text in CODE))
    tokenizer = str(_with_sentinels(tmp_path))
    streampack.build([str(inputs)], tmp_path / "bos", tokenizer=tokenizer, bos_id=1, progress=False)
    with pytest.raises(OptionsError, match=r"a BOS \(1\) before every document is not supported"):
        streampack.open(tmp_path / "bos").sequences(64).fim(rate=0.5)

"""Fill-in-the-middle with real tokenizers: the sentinels found by name in the tokenizer that built the
cache, and refused, naming them, where it has none. The FIM rule itself is checked against the reference
model (``tests/test_reference_model.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import streampack
from streampack.errors import OptionsError, TokenizerError
from streampack.loader import Loader
from streampack.samples.fim import Fim
from streampack.samples.spans import Spans
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


@st.composite
def _fim_batches(draw: st.DrawFn) -> dict[str, Any]:
    """Shards of random documents (empty ones too), rows of ``width`` columns tiled by spans of them (a row
    may cross documents and shards, and end in padding), and FIM settings."""
    dtype = np.dtype(draw(st.sampled_from(["uint8", "uint16", "uint32", "int64"])))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shards = []
    for _ in range(draw(st.integers(1, 3))):
        lengths = rng.choice([0, 1, 3, 5, 9, 17, 30, 60], size=int(rng.integers(1, 12)))
        offsets = np.cumsum(lengths).astype(np.uint64)
        shards.append(
            (rng.integers(0, min(np.iinfo(dtype).max, 1000), int(offsets[-1]) + 1).astype(dtype), offsets)
        )
    width, rows = draw(st.integers(4, 48)), draw(st.integers(1, 12))
    spans: list[tuple[int, int, int, int, int]] = []
    for row in range(rows):
        col = 0
        while col < width and rng.random() < 0.9:
            shard = int(rng.integers(len(shards)))
            size = int(shards[shard][1][-1])
            if size == 0:
                break
            length = int(rng.integers(1, min(width - col, size) + 1))
            lo = int(rng.integers(0, size - length + 1))
            spans.append((row, shard, lo, lo + length, col))
            col += length
    if draw(st.booleans()):
        rng.shuffle(spans)
    fim = Fim(
        rate=draw(st.sampled_from([0.0, 0.5, 1.0])),
        spm_rate=draw(st.sampled_from([0.0, 0.5, 1.0])),
        seed=draw(st.integers(0, 2**64 - 1)),
        min_length=draw(st.integers(4, 12)),
        ids=(1, 2, 3),
        keeps_last=draw(st.booleans()),
    )
    found = Spans(*(np.array([s[k] for s in spans], dtype=np.int64).reshape(-1) for k in range(5)))
    samples = rng.integers(0, 2**40, rows)
    return {"shards": shards, "width": width, "rows": rows, "spans": found, "samples": samples, "fim": fim}


def _both(run: Any) -> tuple[Any, Any]:
    """``run()`` by the compiled loops, then by numpy's path."""
    from streampack.samples import copies, fim

    if fim.moved_copy() is None or fim._counted() is None:
        pytest.skip("numba is not installed, or STREAMPACK_COMPILED=0: no compiled loop to check")
    compiled = run()
    with pytest.MonkeyPatch.context() as patched:
        for module, name in ((fim, "_counted"), (fim, "_decided"), (copies, "moved_copy")):
            patched.setattr(module, name, lambda: None)
        return compiled, run()


@given(_fim_batches(), st.sampled_from([None, 1]), st.sampled_from(["int64", "int32", "same"]))
@settings(max_examples=120, derandomize=True, deadline=None)
def test_the_compiled_fim_loops_do_what_numpy_does(
    batch: dict[str, Any], sentinel: int | None, out_dtype: str
) -> None:
    """FIM's compiled decisions and its one-pass read give exactly numpy's moves and rows: random documents,
    spans across shards and padding, settings, dtypes, a loss-mark sentinel, rows read into a wider array."""
    from streampack.samples.copies import BatchedSpans, read_spans, row_view
    from streampack.samples.fim import fim_moves

    shards, width, rows, spans = batch["shards"], batch["width"], batch["rows"], batch["spans"]
    dtype = shards[0][0].dtype if out_dtype == "same" else np.dtype(out_dtype)

    def tokens_of(shard: int) -> np.ndarray:
        return shards[shard][0].astype(shards[0][0].dtype)

    def offsets_of(shard: int) -> np.ndarray:
        return shards[shard][1]

    def moves() -> Any:
        return fim_moves(spans, batch["samples"], batch["fim"], offsets_of, width)

    compiled, reference = _both(moves)
    for field in ("first", "cuts", "spm", "ids", "source", "size", "spots"):
        np.testing.assert_array_equal(getattr(compiled, field), getattr(reference, field), err_msg=field)

    def read() -> np.ndarray:
        wide = np.full((rows + 2, width + 3), 7, dtype=dtype)  # rows 1, 2, ... of a wider array
        read_spans(spans, wide[1:-1, :width], tokens_of, moves=reference, sentinel=sentinel)
        return wide

    np.testing.assert_array_equal(*_both(read))
    if len(spans.rows) == 0:
        return
    half = (rows + 1) // 2  # two batches of `half` rows, padded where no span is

    def read_batches() -> list[np.ndarray]:
        even = Spans(*(getattr(spans, f)[spans.rows < 2 * half] for f in Spans.__dataclass_fields__))
        pads = np.arange(2 * half) + 40
        planned = BatchedSpans(even, half, 2, width, pads, reference)
        outs = [np.empty((half, width), dtype=dtype) for _ in range(2)]
        for step, out in enumerate(outs):
            planned.read(step, out, tokens_of, lambda shard: row_view(tokens_of(shard), width))
        return outs

    for a, b in zip(*_both(read_batches), strict=True):
        np.testing.assert_array_equal(a, b)

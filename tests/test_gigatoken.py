"""gigatoken as an engine: its ids equal the reference library's for the real tokenizers in every
special-token mode (hypothesis, adversarial texts), the proofs refuse the structures it gets wrong (each
refusal shown to matter), ``auto`` never picks it (fastokens is as fast in a build), its caches stay
bounded, and a build with it writes the reference's bytes (tests/test_tokenizer_engines.py)."""

from __future__ import annotations

import functools
import json
import random
import string
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streampack.errors import TokenizerError
from streampack.tokenizer.base import Tokenizer
from streampack.tokenizer.engines import GigatokenEngine, anonymous_memory
from streampack.tokenizer.load import load_tokenizer
from streampack.tokenizer.proofs import gigatoken_mismatch_hf
from tests.conftest import GPT2_JSON, SHARED_DATA

pytest.importorskip("gigatoken", reason="gigatoken is not installed here")
pytest.importorskip("tiktoken", reason="tiktoken is not installed here")

TIKTOKEN = SHARED_DATA / "tokenizers" / "tiktoken"
SPECS = {
    "gpt2.json": str(GPT2_JSON),
    **{name: f"tiktoken:{TIKTOKEN / name}.tiktoken" for name in ("gpt2", "cl100k_base", "o200k_base")},
}
if not GPT2_JSON.exists():
    pytest.skip("the real tokenizers are not found (../shared/data is absent)", allow_module_level=True)


@functools.cache
def _tokenizer(name: str, mode: str) -> Tokenizer:
    tok = load_tokenizer(SPECS[name], special_tokens=mode, engine="gigatoken", threads=2)  # type: ignore[arg-type]
    assert tok.engine.name == "gigatoken"
    return tok


# Pieces that meet at the places byte-level BPE engines get wrong: special-token strings and their parts,
# whitespace runs of every kind, contractions (and U+017F, which folds to s), code, scripts, long words.
PIECES = [
    "<|endoftext|>",
    "<|endoftext|",
    "<|",
    "|>",
    "<|fim_prefix|>",
    "<|endofprompt|>",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\r\n",
    "\t",
    "\u00a0",
    "\u3000",
    "\u2028",
    "'s",
    "'S",
    "'ll",
    "'\u017f",
    "\u017f",
    "def f(x):\n    return x[1:] + 0x1F\n",
    '{"a": [1, 2.5e-3]}',
    "123456789",
    "\u00bd\u0663\u0664",
    "naïve café",
    "e\u0301",
    "ǅungla DŽ",
    "漢字かな",
    "مرحبا",
    "🙂‍🚀",
    "\U0001f1fa\U0001f1f8",
    "ﬁ",
    "x" * 3000,
    "antidisestablishmentarianism" * 40,
]
TEXTS = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=12)), max_size=12).map("".join)


def _same_ids(tok: Tokenizer, texts: list[str]) -> None:
    flat, offsets = tok.encode_flat(texts)
    assert flat.dtype == np.uint32 and offsets.dtype == np.intp and len(offsets) == len(texts) + 1
    reference = tok.reference_engine().encode_batch(texts)
    for i, (text, want) in enumerate(zip(texts, reference)):
        assert flat[offsets[i] : offsets[i + 1]].tolist() == want.tolist(), repr(text)


@pytest.mark.parametrize("mode", ["text", "parse"])
@pytest.mark.parametrize("name", list(SPECS))
@settings(max_examples=60, deadline=None)
@given(texts=st.lists(TEXTS, min_size=1, max_size=6))
def test_gigatoken_gives_the_reference_ids(name: str, mode: str, texts: list[str]) -> None:
    _same_ids(_tokenizer(name, mode), texts)


@pytest.mark.parametrize("mode", ["text", "parse"])
def test_special_token_strings_follow_the_mode(mode: str) -> None:
    """gigatoken itself always matches them (50256 for GPT-2's); text mode must not."""
    tok = _tokenizer("gpt2.json", mode)
    ids = tok.encode_batch(["Hello<|endoftext|>World"])[0].tolist()
    assert (50256 in ids) == (mode == "parse")
    _same_ids(tok, ["Hello<|endoftext|>World", "", " ", "<|endoftext|>" * 3])


def test_an_empty_batch_and_the_natural_sample() -> None:
    import io

    import zstandard

    from tests.conftest import SAMPLE_CORPUS

    flat, offsets = _tokenizer("gpt2.json", "text").encode_flat([])
    assert len(flat) == 0 and offsets.tolist() == [0]
    if not SAMPLE_CORPUS.exists():
        pytest.skip("the natural sample is absent")
    with zstandard.ZstdDecompressor().stream_reader(SAMPLE_CORPUS.open("rb")) as raw:
        texts = [json.loads(line)["text"] for line in io.TextIOWrapper(raw, encoding="utf-8")]
    for name in SPECS:
        _same_ids(_tokenizer(name, "text"), texts[:200])


def test_a_lone_surrogate_is_refused_not_encoded() -> None:
    """Records holding one are bad records before any engine sees them; the engine itself raises too."""
    with pytest.raises(TypeError):
        _tokenizer("gpt2.json", "text").encode_flat(["a\ud800b"])


# ---------------------------------------------------------------- what the proofs refuse, and why it matters


def _added(token_id: int, content: str, *, special: bool = True, **flags: bool) -> dict[str, Any]:
    base = dict.fromkeys(("single_word", "lstrip", "rstrip", "normalized"), False)
    return {"id": token_id, "content": content, **base, **flags, "special": special}


def _gpt2_with(folder: Path, added: list[dict[str, Any]], **top: Any) -> str:
    definition = json.loads(GPT2_JSON.read_text())
    definition["added_tokens"] += added
    definition.update(top)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(definition))
    return str(folder)


AROUND = ["a <|im|> b", "x<|im|>y", " <|im|>  ", "<|im|><|im|>", "a<|endoftext|> <|im|>", "hello world"]


def _raw_gigatoken_matches(spec: str, texts: list[str]) -> bool:
    """Whether gigatoken loaded naively from the file gives ``tokenizers``' parse-mode ids."""
    import gigatoken
    from tokenizers import Tokenizer as HF

    path = Path(spec) / "tokenizer.json"
    raw, ref = gigatoken.Tokenizer.from_json(path.read_text()), HF.from_file(str(path))
    return all(raw.encode(t).tolist() == ref.encode(t, add_special_tokens=False).ids for t in texts)


@pytest.mark.parametrize(
    ("added", "why"),
    [
        (_added(50257, "<|im|>", single_word=True), "single_word"),
        (_added(50300, "<|im|>"), "tokenizers' id 50257"),
        (_added(50257, "hello"), "vocabulary id"),
    ],
)
def test_parse_mode_refuses_what_gigatoken_gets_wrong(
    tmp_path: Path, added: dict[str, Any], why: str
) -> None:
    spec = _gpt2_with(tmp_path, [added])
    assert not _raw_gigatoken_matches(spec, AROUND)  # the refusal matters
    with pytest.raises(TokenizerError, match=f"gigatoken is not known to give .* parse mode .*{why}"):
        load_tokenizer(spec, special_tokens="parse", engine="gigatoken")
    # Text mode drops the added tokens from gigatoken's form: proven, and exact.
    text = load_tokenizer(spec, special_tokens="text", engine="gigatoken")
    _same_ids(text, AROUND)


@pytest.mark.parametrize("flags", [{"lstrip": True}, {"rstrip": True}, {"normalized": True}, {}])
def test_parse_mode_keeps_the_flags_gigatoken_matches_alike(tmp_path: Path, flags: dict[str, bool]) -> None:
    spec = _gpt2_with(tmp_path, [_added(50257, "<|im|>", **flags)])
    tok = load_tokenizer(spec, special_tokens="parse", engine="gigatoken")
    assert tok.engine.name == "gigatoken", tok.engine_reason
    _same_ids(tok, AROUND)


def test_a_non_special_added_token_is_refused_in_both_modes(tmp_path: Path) -> None:
    spec = _gpt2_with(tmp_path, [_added(50257, "<|im|>", special=False)])
    for mode in ("text", "parse"):
        with pytest.raises(TokenizerError, match="not special: it would be matched inside the text"):
            load_tokenizer(spec, special_tokens=mode, engine="gigatoken")  # type: ignore[arg-type]


def test_what_gigatoken_cannot_load_falls_back_or_is_refused(tmp_path: Path) -> None:
    """A normalizer is refused by the proof; a split regex it has no scheme for, by gigatoken's own load."""
    definition = json.loads(GPT2_JSON.read_text())
    assert gigatoken_mismatch_hf(
        {
            "model": {"type": "BPE"},
            "normalizer": {"type": "Lowercase"},
            "pre_tokenizer": None,
            "added_tokens": [],
        },
        parse_special=False,
    ).startswith("it has a Lowercase normalizer")
    gpt2_regex = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    definition["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": gpt2_regex}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(definition))
    with pytest.raises(TokenizerError, match="gigatoken cannot load the tokenizer"):
        load_tokenizer(str(tmp_path), engine="gigatoken")
    auto = load_tokenizer(str(tmp_path))
    assert auto.engine.name == "fastokens"
    _same_ids(auto, AROUND)


def test_gigatoken_runs_when_asked_for_and_auto_keeps_fastokens() -> None:
    for name in SPECS:
        for mode in ("text", "parse"):
            tok = load_tokenizer(SPECS[name], special_tokens=mode, engine="gigatoken")  # type: ignore[arg-type]
            assert tok.engine.name == "gigatoken"
            assert tok.engine_reason == f"proven exact for this tokenizer in {mode} mode"
            assert load_tokenizer(SPECS[name], special_tokens=mode).engine.name == "fastokens"  # type: ignore[arg-type]
    assert load_tokenizer(SPECS["gpt2.json"], engine="fastokens").engine.name == "fastokens"
    with pytest.raises(TokenizerError, match="its engines are tiktoken, fastokens and gigatoken"):
        load_tokenizer(SPECS["gpt2"], engine="tokenizers")


# ---------------------------------------------------------------------------------- its caches stay bounded


def test_its_caches_are_dropped_past_the_bound_and_the_ids_stay_the_same() -> None:
    """In a fresh process: the bound is on the process's anonymous memory, which the memory an earlier test
    freed would absorb."""
    import gigatoken

    if hasattr(gigatoken, "set_max_cache_bytes"):
        pytest.skip("this gigatoken bounds its caches itself")
    if anonymous_memory() is None:
        pytest.skip("no /proc/self/statm here")
    code = "from tests.test_gigatoken import check_the_cache_bound; check_the_cache_bound()"
    ran = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).parents[1], capture_output=True, text=True
    )
    assert ran.returncode == 0, ran.stderr


def check_the_cache_bound() -> None:
    """Encode ~30 MB of new words through a gigatoken engine bounded to 16 MB: it reloads, the ids stay the
    reference's, and the memory stays near the bound."""
    import gigatoken

    bound = 16 << 20
    engine = GigatokenEngine(lambda: gigatoken.Tokenizer(str(GPT2_JSON)), threads=2, cache_bytes=bound)
    rng = random.Random(0)
    engine.encode_flat(["warm up: the tokenizer loaded"])
    start = anonymous_memory() or 0
    peak, checked = start, []
    for _ in range(30):  # ~30 MB of words never seen twice: caches that kept them would pass the bound
        texts = [
            " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(4, 12))) for _ in range(1000))
            for _ in range(120)
        ]
        flat, offsets = engine.encode_flat(texts)
        peak = max(peak, anonymous_memory() or 0)
        checked += [(text, flat[offsets[i] : offsets[i + 1]].tolist()) for i, text in enumerate(texts[:3])]
    assert engine.reloads >= 1
    reference = _tokenizer("gpt2.json", "parse").reference_engine()  # after: its own caches are not counted
    want = reference.encode_batch([text for text, _ in checked])
    assert all(ids == expected.tolist() for (_, ids), expected in zip(checked, want, strict=True))
    # The bound, plus what the allocator keeps of the caches dropped (55-80 MB here, whatever the data),
    # not what unbounded caches keep of 30 MB of new words (~250 MB; 101 MB for the first 12 MB).
    assert peak - start < 8 * bound, (peak - start) >> 20


# ------------------------------------------------------------------------ a build with it: the same bytes


@pytest.mark.slow
@pytest.mark.parametrize("special_tokens", ["text", "parse"])
def test_a_cache_built_with_gigatoken_is_the_references_byte_for_byte(
    tmp_path: Path, special_tokens: str
) -> None:
    import io

    import zstandard

    import streampack
    from streampack.store.files import load_manifest
    from tests.conftest import SAMPLE_CORPUS, run_cli, shard_bytes, write_jsonl

    if not SAMPLE_CORPUS.exists():
        pytest.skip("the natural sample is absent")
    with zstandard.ZstdDecompressor().stream_reader(SAMPLE_CORPUS.open("rb")) as raw:
        lines = io.TextIOWrapper(raw, encoding="utf-8")
        texts = [json.loads(next(lines))["text"] for _ in range(150)]
    edge = [
        "a<|endoftext|>b",
        "<|endoftext|>",
        "  \n\n\t's\n\nThen",
        "emoji 🙂‍🚀 and 漢字 " * 50,
        "x" * 30_000,
    ]
    data = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in edge + texts])
    builds = [
        (SPECS["gpt2.json"], "tokenizers", 1),
        (SPECS["gpt2.json"], "fastokens", 1),
        (SPECS["gpt2.json"], "gigatoken", 2),  # in two spawned workers, on their own pools
        (SPECS["gpt2"], "tiktoken", 1),
        (SPECS["gpt2"], "auto", 1),
    ]
    caches = []
    for i, (spec, engine, workers) in enumerate(builds):
        out = tmp_path / str(i)
        streampack.build(
            data, out, tokenizer=spec, tokenizer_engine=engine, workers=workers, special_tokens=special_tokens
        )
        caches.append({k: v for k, v in shard_bytes(out).items() if k != "manifest.json"})
    assert all(cache == caches[0] for cache in caches)
    for i in (2,):
        engines = load_manifest(tmp_path / str(i)).engines
        assert {(e.name, e.verify.mode if e.verify else None) for e in engines} == {("gigatoken", "sample")}
    built = run_cli(
        "build", data, "-t", SPECS["gpt2.json"], "--tokenizer-engine", "gigatoken",
        "--special-tokens", special_tokens, "--out", tmp_path / "cli",
    ).stdout  # fmt: skip
    assert "tokenizer engine: gigatoken 0.10" in built and "proven exact for this tokenizer" in built
    assert "gigatoken" in run_cli("info", tmp_path / "cli").stdout
    assert {k: v for k, v in shard_bytes(tmp_path / "cli").items() if k != "manifest.json"} == caches[0]

"""Tokenizer engines give the same cache bytes as the tokenizer's reference engine, and a build checks that
they do: an engine that gets one id wrong is stopped, naming the record."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import streampack
from streampack.errors import TokenizerError
from streampack.store.files import load_manifest
from streampack.tokenizer.engines import FastokensEngine, FlatIds
from streampack.tokenizer.load import load_tokenizer
from tests.conftest import SAMPLE_CORPUS, shard_bytes, write_jsonl

pytest.importorskip("fastokens", reason="the fast extra is not installed")

# Special-token text stays text whatever the engine: these must come out the same too.
EDGE = ["a<|endoftext|>b", "<|endoftext|>", "  \n\n\t's\n\nThen", "emoji 🙂‍🚀 and 漢字 " * 50, "x" * 30_000]


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first 300 documents of the real natural sample, and edge cases, as JSONL."""
    import zstandard

    if not SAMPLE_CORPUS.exists():
        pytest.skip(f"real text sample not found at {SAMPLE_CORPUS} (../shared/data is absent)")
    with zstandard.ZstdDecompressor().stream_reader(SAMPLE_CORPUS.open("rb")) as raw:
        lines = io.TextIOWrapper(raw, encoding="utf-8")
        texts = [json.loads(next(lines))["text"] for _ in range(300)]
    path = tmp_path_factory.mktemp("sample") / "sample.jsonl"
    return write_jsonl(path, [{"text": t} for t in EDGE + texts])


def _build(sample: Path, out: Path, tokenizer: str, engine: str, **options: Any) -> dict[str, bytes]:
    streampack.build(sample, out, tokenizer=tokenizer, tokenizer_engine=engine, workers=1, **options)
    return {k: v for k, v in shard_bytes(out).items() if k != "manifest.json"}


@pytest.mark.slow
@pytest.mark.parametrize("special_tokens", ["text", "parse"])
def test_gpt2_caches_are_byte_identical_across_engines(
    tmp_path: Path, sample: Path, gpt2_tokenizer: Path, tiktoken_gpt2: Path, special_tokens: str
) -> None:
    json_spec, ranks_spec = str(gpt2_tokenizer), f"tiktoken:{tiktoken_gpt2}"
    caches = {
        (spec, engine): _build(sample, tmp_path / f"{i}", spec, engine, special_tokens=special_tokens)
        for i, (spec, engine) in enumerate(
            [
                (json_spec, "tokenizers"),
                (json_spec, "fastokens"),
                (ranks_spec, "tiktoken"),
                (ranks_spec, "auto"),
            ]
        )
    }
    reference = caches[(json_spec, "tokenizers")]
    assert all(cache == reference for cache in caches.values())
    engines = load_manifest(tmp_path / "3").engines
    assert [(e.name, e.reference.split()[0], e.verify.mode if e.verify else None) for e in engines] == [
        ("fastokens", "tiktoken", "sample")
    ]
    assert load_manifest(tmp_path / "0").engines[0].name == "tokenizers"


@pytest.mark.slow
def test_the_engine_is_not_a_setting_a_rerun_must_match(
    tmp_path: Path, sample: Path, gpt2_tokenizer: Path
) -> None:
    out = tmp_path / "c"
    first = _build(sample, out, str(gpt2_tokenizer), "tokenizers")
    # A rerun with another engine is the same build (a different setting would raise ConfigMismatchError).
    assert _build(sample, out, str(gpt2_tokenizer), "fastokens") == first


class _OneWrongId(FastokensEngine):
    """fastokens, except that the first token of any text holding 'zebra' is off by one."""

    def encode_flat(self, texts: list[str]) -> FlatIds:
        flat, offsets = super().encode_flat(texts)
        wrong = flat.copy()
        wrong[[int(offsets[i]) for i, t in enumerate(texts) if "zebra" in t]] += 1
        return wrong, offsets


@pytest.fixture
def wrong_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("streampack.tokenizer.base.FastokensEngine", _OneWrongId)  # where it is made


@pytest.mark.slow
def test_the_verification_sample_stops_an_engine_that_gets_one_id_wrong(
    tmp_path: Path, gpt2_tokenizer: Path, wrong_engine: None
) -> None:
    texts = [f"document {i} about nothing much" for i in range(1500)]
    texts[4] = "a zebra in the first twenty"
    data = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    assert isinstance(load_tokenizer(str(gpt2_tokenizer), engine="fastokens").engine, _OneWrongId)
    with pytest.raises(TokenizerError, match=r"in\.jsonl:5: the fastokens engine's token ids differ .*zebra"):
        streampack.build(data, tmp_path / "sampled", tokenizer=str(gpt2_tokenizer), workers=1)
    texts[4], texts[1200] = texts[0], "a zebra past the first twenty, not in the 0.1 % sample"
    write_jsonl(data, [{"text": t} for t in texts])
    from streampack.builder.blocks import verified

    assert not verified(0, 1200, "sample")
    streampack.build(data, tmp_path / "unchecked", tokenizer=str(gpt2_tokenizer), workers=1)  # not seen
    with pytest.raises(TokenizerError, match=r"in\.jsonl:1201: "):
        streampack.build(
            data, tmp_path / "all", tokenizer=str(gpt2_tokenizer), workers=1, verify_tokens="all"
        )


@pytest.mark.slow
def test_gpt2_ranks_become_the_tokenizer_json_that_gives_tiktokens_ids(tiktoken_gpt2: Path) -> None:
    """The GPT-2-pattern ranks fastokens loads as a tokenizer.json (its fast path) give tiktoken's ids."""
    import fastokens
    import tiktoken
    import tiktoken.load

    from streampack.tokenizer.tiktoken_json import byte_level_json, merges_of

    # Every split into two tokens is a merge, ranked by the join's rank, then by the halves' ranks.
    toy = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5}
    assert merges_of(toy) == [(b"a", b"b"), (b"b", b"c"), (b"a", b"bc"), (b"ab", b"c")]
    tok = load_tokenizer(f"tiktoken:{tiktoken_gpt2}")
    assert isinstance(tok.engine, FastokensEngine)
    meta = json.loads(tiktoken_gpt2.with_suffix(".json").read_text())
    ranks = tiktoken.load.load_tiktoken_bpe(str(tiktoken_gpt2))
    fast = fastokens.Tokenizer.from_json_str(byte_level_json(ranks, meta["special_tokens"]))
    enc = tiktoken.Encoding("gpt2", pat_str=meta["pat_str"], mergeable_ranks=ranks, special_tokens={})
    texts = [*EDGE, "naïve café — “quotes” ’s 's", "\u00a0\u2003 spaces\r\n\r\n", "123456789 1.5e10"]
    for text in texts:
        got = fast.encode(text, add_special_tokens=False, split_special_tokens=True).ids
        assert got == enc.encode_ordinary(text), text


@pytest.mark.slow
def test_build_profile_reports_every_timing(tmp_path: Path, sample: Path, gpt2_tokenizer: Path) -> None:
    """`--profile` prints where the time went; the summary holds the same [wall, CPU] seconds per timing."""
    from tests.conftest import run_cli

    summary = streampack.build(sample, tmp_path / "api", tokenizer=str(gpt2_tokenizer), profile=True)
    for timing in ("prepare", "read", "parse", "frame", "write", "encode", "verify", "process"):
        assert timing in summary.timings, timing
    wall, cpu = summary.timings["read"]
    assert wall > 0 and cpu > 0
    assert summary.timings["encode"][1] == 0  # encoder threads report wall time; their CPU is the process's
    out = run_cli("build", sample, "--out", tmp_path / "cli", "-t", gpt2_tokenizer, "--profile").stdout
    table = out[out.index("| timing |") :]
    for row in (
        "| read | main |",
        "| encode calls | encoder threads |",
        "| engine threads |",
        "| all processes |",
    ):
        assert row in table, table
    # A finished build run again exits at once, whatever fastokens' loading thread is doing.
    again = run_cli("build", sample, "--out", tmp_path / "cli", "-t", gpt2_tokenizer)
    assert "FATAL" not in again.stderr and again.returncode == 0


# ------------------------------------------------------------- which tokenizers fastokens is proven for


def _added(token_id: int, content: str, *, special: bool = True, **flags: bool) -> dict[str, Any]:
    base = dict.fromkeys(("single_word", "lstrip", "rstrip", "normalized"), False)
    return {"id": token_id, "content": content, **base, **flags, "special": special}


def _gpt2_with(gpt2_tokenizer: Path, folder: Path, added: list[dict[str, Any]], **top: Any) -> Path:
    """GPT-2's tokenizer.json with more added tokens (and top-level members such as truncation)."""
    definition = json.loads(gpt2_tokenizer.read_text())
    definition["added_tokens"] += added
    definition.update(top)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(definition))
    return folder


def _texts_around(contents: list[str], seed: int = 0, n: int = 400) -> list[str]:
    """Texts that put the added tokens' strings next to each other, to spaces, letters and their parts."""
    import random

    rng = random.Random(seed)
    parts = [
        " ",
        "  ",
        "\n",
        "\t",
        "\u3000",
        "a",
        "é",
        "_",
        ".",
        "b",
        "|>",
        "<|",
        "Hello",
        *contents,
        *contents,
    ]
    return ["".join(rng.choice(parts) for _ in range(rng.randint(1, 12))) for _ in range(n)]


def _same_ids(tok: Any, texts: list[str]) -> bool:
    got, expected = tok.engine.encode_batch(texts), tok.reference_engine().encode_batch(texts)
    return all(np.array_equal(a, b) for a, b in zip(got, expected))


def _fastokens_differs(folder: Path, texts: list[str], *, parse: bool) -> bool:
    """Whether fastokens itself, loaded from the file, gives other ids than tokenizers for some text."""
    import fastokens
    from tokenizers import Tokenizer

    text = (folder / "tokenizer.json").read_text()
    reference = Tokenizer.from_str(text)
    reference.encode_special_tokens = not parse
    fast = fastokens.Tokenizer.from_json_str(text)
    for t in texts:
        ids, _ = fast.encode_batch_flat([t], add_special_tokens=False, split_special_tokens=not parse)
        if np.frombuffer(ids, np.uint32).tolist() != reference.encode(t, add_special_tokens=False).ids:
            return True
    return False


# (added tokens, why fastokens is refused in parse mode or None, whether real fastokens then differs)
ADDED_TOKEN_CASES = {
    "content a vocabulary entry": (
        [_added(50257, "Hello")],
        "added token 'Hello' id 50257 != vocabulary id 15496",
        True,
    ),
    "declared id past a gap": (
        [_added(60000, "<|x|>")],
        "added token '<|x|>' id 60000 != tokenizers' id 50257",
        True,
    ),
    "declared id of another token": (
        [_added(100, "<|x|>")],
        "added token '<|x|>' id 100 != tokenizers' id 50257",
        True,
    ),
    "one inside another": (
        [_added(50257, "<|a", single_word=True), _added(50258, "<|a|>b", lstrip=True, normalized=True)],
        "the added tokens '<|a' and '<|a|>b' overlap",
        True,
    ),
    "the end of one the start of another": (
        [_added(50257, "<|ab", rstrip=True), _added(50258, "b|>", single_word=True, normalized=True)],
        "the added tokens '<|ab' and 'b|>' overlap",
        True,
    ),
    "whitespace stripped from another's edge": (
        [_added(50257, " <|x|>", normalized=True), _added(50258, "<|y|>", lstrip=True, rstrip=True)],
        "the added token '<|y|>' strips whitespace and ' <|x|>' begins or ends with whitespace",
        True,
    ),
    "single_word next to a token of the other pass": (
        [_added(50257, " <|x|>", single_word=True, normalized=True), _added(50258, "<|ab")],
        "the added token ' <|x|>' is single_word and normalized, and other added tokens are not",
        True,
    ),
    "every flag on one token": (
        [_added(50257, "<|x|>", lstrip=True, rstrip=True, single_word=True)],
        None,
        False,
    ),
    "flags on tokens that cannot meet": (
        [
            _added(50257, "<|x|>", rstrip=True, normalized=True),
            _added(50258, "<|y|>", lstrip=True, single_word=True),
        ],
        None,
        False,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(ADDED_TOKEN_CASES))
def test_fastokens_runs_only_where_it_is_proven_in_each_special_token_mode(
    tmp_path: Path, gpt2_tokenizer: Path, case: str
) -> None:
    """In parse mode an added token's id and its neighbours decide whether fastokens gives tokenizers' ids;
    in text mode special tokens are text and fastokens is exact for all of these."""
    from streampack.tokenizer.engines import TokenizersEngine

    added, refusal, differs = ADDED_TOKEN_CASES[case]
    folder = _gpt2_with(gpt2_tokenizer, tmp_path / "tok", added)
    texts = _texts_around([t["content"] for t in added])
    text_mode = load_tokenizer(str(folder), special_tokens="text")
    assert isinstance(text_mode.engine, FastokensEngine), text_mode.engine_reason
    assert text_mode.engine_reason == "proven exact for this tokenizer in text mode"
    assert _same_ids(text_mode, texts)
    parse = load_tokenizer(str(folder), special_tokens="parse")
    if refusal is None:
        assert isinstance(parse.engine, FastokensEngine), parse.engine_reason
        assert parse.engine_reason == "proven exact for this tokenizer in parse mode"
        assert _same_ids(parse, texts)
    else:
        assert isinstance(parse.engine, TokenizersEngine)
        assert parse.engine_reason == f"fastokens refused: {refusal} in parse mode"
        with pytest.raises(TokenizerError, match=r"not known to give this tokenizer's ids in parse mode"):
            load_tokenizer(str(folder), special_tokens="parse", engine="fastokens")
    assert _fastokens_differs(folder, texts, parse=True) == differs  # each refusal is one that is needed


@pytest.mark.parametrize("special_tokens", ["text", "parse"])
def test_tokens_fastokens_cannot_hold_are_refused_in_both_modes(
    tmp_path: Path, gpt2_tokenizer: Path, special_tokens: str
) -> None:
    from streampack.tokenizer.engines import TokenizersEngine

    twice = _gpt2_with(gpt2_tokenizer, tmp_path / "twice", [_added(50257, "<|x|>"), _added(50258, "<|x|>")])
    plain = _gpt2_with(gpt2_tokenizer, tmp_path / "plain", [_added(50257, "Hello", special=False)])
    for folder, why in (
        (twice, "two added tokens are '<|x|>', which fastokens cannot load"),
        (plain, "the added token 'Hello' is not special: it would be matched inside the text"),
    ):
        tok = load_tokenizer(str(folder), special_tokens=special_tokens)
        assert isinstance(tok.engine, TokenizersEngine)
        assert tok.engine_reason == f"fastokens refused: {why} in {special_tokens} mode"
    assert _fastokens_differs(plain, ["Hello there"], parse=special_tokens == "parse")


@pytest.mark.slow
def test_wherever_auto_picks_fastokens_its_ids_are_the_references(
    tmp_path: Path, gpt2_tokenizer: Path
) -> None:
    """Random sets of added tokens (ids, overlaps, whitespace and every flag): in each mode, either auto
    refuses fastokens or fastokens gives exactly tokenizers' ids."""
    import random

    rng = random.Random(7)
    pool = ["<|a|>", "<|a|>b", "<|a", "<|ab", "b|>", "<|x|>", "<|y|>", " <|x|>", "<|z|> ", "\n<|w|>", "Hello"]
    flags = ("lstrip", "rstrip", "single_word", "normalized")
    picked = {"text": 0, "parse": 0}
    for trial in range(16):
        contents = rng.sample(pool, rng.randint(1, 3))
        added = [
            _added(
                50257 + i if rng.random() < 0.8 else 60000 + i, c, **{f: rng.random() < 0.3 for f in flags}
            )
            for i, c in enumerate(contents)
        ]
        folder = _gpt2_with(gpt2_tokenizer, tmp_path / str(trial), added)
        texts = _texts_around(contents, seed=trial, n=300)
        for mode in ("text", "parse"):
            tok = load_tokenizer(str(folder), special_tokens=mode)  # type: ignore[arg-type]
            if isinstance(tok.engine, FastokensEngine):
                picked[mode] += 1
                assert _same_ids(tok, texts), (mode, added)
    assert picked["text"] == 16 and picked["parse"] >= 3  # the property was tested where it matters


def test_parse_mode_build_with_an_added_token_that_is_a_vocabulary_entry(
    tmp_path: Path, gpt2_tokenizer: Path
) -> None:
    """The review's repro: auto no longer picks fastokens, so the cache is the reference's, and says why."""
    folder = _gpt2_with(gpt2_tokenizer, tmp_path / "tok", [_added(50257, "Hello")])
    texts = [f"record {i}: " + ("Hello there" if i == 1500 else "nothing here") for i in range(3000)]
    data = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    auto = _build(data, tmp_path / "auto", str(folder), "auto", special_tokens="parse")
    assert auto == _build(data, tmp_path / "ref", str(folder), "tokenizers", special_tokens="parse")
    assert streampack.open(tmp_path / "auto").doc(1500).tolist()[-3:] == [15496, 612, 50256]
    (entry,) = load_manifest(tmp_path / "auto").engines
    assert entry.name == "tokenizers"
    assert entry.why == "fastokens refused: added token 'Hello' id 50257 != vocabulary id 15496 in parse mode"
    assert streampack.verify(tmp_path / "auto").ok


@pytest.mark.slow
def test_a_tiktoken_encodings_overlapping_special_tokens_are_refused_when_parsed(
    tmp_path: Path, tiktoken_gpt2: Path
) -> None:
    import shutil

    ranks = tmp_path / "gpt2.tiktoken"
    shutil.copy(tiktoken_gpt2, ranks)
    meta = json.loads(tiktoken_gpt2.with_suffix(".json").read_text())
    meta.pop("explicit_n_vocab", None)
    meta["special_tokens"].update({"<|a|>": 50257, "<|a|>b": 50258, "Hello": 50259})
    ranks.with_suffix(".json").write_text(json.dumps(meta))
    parse = load_tokenizer(f"tiktoken:{ranks}", special_tokens="parse")
    assert parse.engine.name == "tiktoken"
    assert (
        parse.engine_reason
        == "fastokens refused: the special tokens '<|a|>' and '<|a|>b' overlap in parse mode"
    )
    text = load_tokenizer(f"tiktoken:{ranks}", special_tokens="text")
    assert isinstance(text.engine, FastokensEngine)
    assert _same_ids(text, _texts_around(["<|a|>", "<|a|>b"]))
    # A special token that is also a rank's bytes keeps its own id in tiktoken and fastokens alike.
    del meta["special_tokens"]["<|a|>b"]
    meta["special_tokens"]["Hello"] = 50258
    ranks.with_suffix(".json").write_text(json.dumps(meta))
    parse = load_tokenizer(f"tiktoken:{ranks}", special_tokens="parse")
    assert isinstance(parse.engine, FastokensEngine)
    assert _same_ids(parse, _texts_around(["<|a|>", "Hello"]))


def test_truncation_and_padding_in_a_tokenizer_json_are_ignored_by_every_engine(
    tmp_path: Path, gpt2_tokenizer: Path
) -> None:
    """A document's tokens are its whole text's, unpadded: a tokenizer.json's truncation and padding (set for
    a model's inputs) would cut every piece and pad each batch, differently per engine."""
    folder = _gpt2_with(
        gpt2_tokenizer,
        tmp_path / "tok",
        [],
        truncation={"direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0},
        padding={
            "strategy": "BatchLongest",
            "direction": "Right",
            "pad_to_multiple_of": None,
            "pad_id": 7,
            "pad_type_id": 0,
            "pad_token": "(",
        },
    )
    texts = [f"document {i} " + "word " * (i % 17) for i in range(200)]
    data = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    plain = _build(data, tmp_path / "plain", str(gpt2_tokenizer), "tokenizers")
    for engine in ("tokenizers", "fastokens"):
        assert _build(data, tmp_path / engine, str(folder), engine) == plain, engine


# ---------------------------------------------------------------- the write path's check of every id


def test_an_id_at_or_above_the_vocab_size_stops_the_build_before_it_is_written(
    tmp_path: Path, gpt2_tokenizer: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Were the proof ever wrong again (here: the old one, which let fastokens run this tokenizer in parse
    mode), the id outside the vocabulary is stopped on the write path, past the verification sample."""
    from streampack.builder.blocks import verified
    from streampack.store.files import read_entry

    folder = _gpt2_with(gpt2_tokenizer, tmp_path / "tok", [_added(50257, "Hello")])
    texts = [f"record {i}: " + ("Hello there" if i == 1500 else "nothing here") for i in range(3000)]
    data = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    assert not verified(0, 1500, "sample")
    monkeypatch.setattr("streampack.tokenizer.hf.fastokens_mismatch_hf", lambda *args, **kwargs: "")
    out = tmp_path / "c"
    options: dict[str, Any] = {
        "special_tokens": "parse",
        "workers": 1,
        "batch_chars": 2000,
        "commit_bytes": 1,
    }
    with pytest.raises(
        TokenizerError,
        match=r"in\.jsonl:1501: the fastokens engine gave token id 50257, not below the vocab size 50,257 of "
        r"this cache .*before writing the block.*tokenizer_engine='tokenizers'",
    ):
        streampack.build(data, out, tokenizer=str(folder), **options)
    committed = read_entry(out, "000000", str(data))
    # What was committed lies before it (how much depends on how far the writer got: none, under load).
    assert 0 <= committed.docs < 1500
    tokens = np.fromfile(out / "shards" / "000000.tokens", dtype=np.uint16)
    assert len(tokens) == committed.tokens and tokens.max() < 50257
    monkeypatch.undo()  # the real proof: the rerun resumes with the reference engine
    streampack.build(data, out, tokenizer=str(folder), **options)
    assert streampack.verify(out).ok
    assert streampack.open(out).doc(1500).tolist()[-3:] == [15496, 612, 50256]


# -------------------------------------------------------------- build and info say which engine, and why


@pytest.mark.slow
def test_build_and_info_say_which_engine_ran_and_why(tmp_path: Path, gpt2_tokenizer: Path) -> None:
    import os
    import subprocess
    import sys

    from tests.conftest import run_cli

    data = write_jsonl(tmp_path / "in.jsonl", [{"text": f"text {i}"} for i in range(50)])
    summary = streampack.build(data, tmp_path / "api", tokenizer=str(gpt2_tokenizer))
    assert summary.tokenizer_engine.startswith("fastokens ")
    assert "(proven exact for this tokenizer in text mode; reference tokenizers " in summary.tokenizer_engine
    folder = _gpt2_with(gpt2_tokenizer, tmp_path / "tok", [_added(50257, "Hello")])
    built = run_cli(
        "build", data, "-t", folder, "--special-tokens", "parse", "--out", tmp_path / "cli"
    ).stdout
    why = "fastokens refused: added token 'Hello' id 50257 != vocabulary id 15496 in parse mode"
    assert "tokenizer engine: tokenizers " in built and f"({why}; the tokenizer's reference engine)" in built
    assert why in run_cli("info", tmp_path / "cli").stdout
    info = json.loads(run_cli("info", tmp_path / "cli", "--json").stdout)
    assert info["tokenizer_engine"].startswith("tokenizers ") and why in info["tokenizer_engine"]
    # Where fastokens cannot be imported (a platform without its wheels), the reference engine runs and
    # the build says so.
    blocker = tmp_path / "no-fastokens" / "fastokens"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('no fastokens here')\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(blocker.parent), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "streampack", "build", str(data), "-t", str(gpt2_tokenizer)]
    result = subprocess.run([*cmd, "--out", str(tmp_path / "none")], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert "tokenizer engine: tokenizers " in result.stdout and "(fastokens is not installed" in result.stdout
    engines = load_manifest(tmp_path / "none").engines
    assert engines[0].name == "tokenizers" and engines[0].why.startswith("fastokens is not installed")


# ------------------------------------------------------------------------ who gets the fast engine


def _fastokens_requirements() -> dict[str, Any]:
    """The fastokens requirement of the core dependencies and of the ``fast`` extra, from pyproject.toml."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    core = [Requirement(r) for r in project["dependencies"] if r.startswith("fastokens")]
    extra = [Requirement(r) for r in project["optional-dependencies"]["fast"] if r.startswith("fastokens")]
    assert len(core) == 1 and len(extra) == 1
    return {"core": core[0], "extra": extra[0]}


@pytest.mark.parametrize(
    ("implementation", "system", "machine", "wheels"),
    [
        ("CPython", "linux", "x86_64", True),
        ("CPython", "linux", "aarch64", True),
        ("CPython", "linux", "i686", True),
        ("CPython", "linux", "armv7l", True),
        ("CPython", "linux", "ppc64le", True),
        ("CPython", "darwin", "arm64", True),
        ("CPython", "darwin", "x86_64", True),
        ("CPython", "win32", "AMD64", True),
        ("CPython", "linux", "s390x", False),
        ("CPython", "linux", "riscv64", False),
        ("CPython", "win32", "ARM64", False),
        ("CPython", "win32", "x86", False),
        ("PyPy", "linux", "x86_64", False),
    ],
)
def test_fastokens_is_a_dependency_exactly_where_it_has_wheels(
    implementation: str, system: str, machine: str, wheels: bool
) -> None:
    """fastokens 0.3.5's wheels (CPython abi3): manylinux x86_64/i686 (glibc 2.17), aarch64/armv7l/ppc64le
    (glibc 2.28), musllinux x86_64/i686/aarch64/armv7l, macOS x86_64/arm64, win_amd64; nothing else."""
    requirements = _fastokens_requirements()
    environment = {"platform_python_implementation": implementation, "sys_platform": system}
    environment |= {"platform_machine": machine, "extra": "fast"}
    assert requirements["core"].marker.evaluate(environment) == wheels
    assert requirements["extra"].marker.evaluate(environment) == wheels  # the extra adds nothing
    assert requirements["core"].specifier == requirements["extra"].specifier


def test_this_platform_has_the_fast_engine_by_default(gpt2_tokenizer: Path) -> None:
    """Here fastokens is installed as a core dependency, and it is what a default build runs."""
    from streampack.tokenizer.engines import fastokens_unsupported_platform

    assert fastokens_unsupported_platform() == ""
    assert _fastokens_requirements()["core"].marker.evaluate()
    assert isinstance(load_tokenizer(str(gpt2_tokenizer)).engine, FastokensEngine)


@pytest.mark.parametrize("engine", ["auto", "tokenizers"])
def test_fastokens_loads_beside_the_reference_engine_only_where_it_may_run(
    engine: str, gpt2_tokenizer: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fastokens' load (which lets go of the GIL) starts before ``tokenizers`` parses the same file, so
    that a build's encoders wait less; a tokenizer asked to run ``tokenizers`` starts no load at all."""
    import threading

    import tokenizers

    loading_while_parsed: list[bool] = []
    parse = tokenizers.Tokenizer.from_str
    before = set(threading.enumerate())  # an earlier test's load may still be finishing on a loaded machine

    def observed(text: str) -> tokenizers.Tokenizer:
        started = {t.name for t in threading.enumerate() if t not in before}
        loading_while_parsed.append("streampack-fastokens-load" in started)
        return parse(text)

    monkeypatch.setattr(tokenizers.Tokenizer, "from_str", staticmethod(observed))
    tok = load_tokenizer(str(gpt2_tokenizer), engine=engine)
    assert loading_while_parsed == [engine == "auto"]
    assert isinstance(tok.engine, FastokensEngine) == (engine == "auto")
    assert tok.encode_batch(["Hello world"])[0].tolist() == [15496, 995]

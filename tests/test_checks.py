"""One rule for a wrong argument, at every public entry point: an OptionsError with one wording."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import streampack
from streampack import BlockShuffle, Follow, Loader, Mixture
from streampack._checks import bounds, check_choice, check_int, check_int_or_none
from streampack.errors import OptionsError
from streampack.order.permutation import Permutation
from tests.conftest import write_jsonl

# What every refusal of an argument says: NAME must be ALLOWED (got NAME=VALUE), then perhaps a hint.
SHAPE = re.compile(
    r"(?P<name>[\w\[\] ]+?) must be "
    r"(an integer( in \[\S+, \S+[\]\)]| >= \S+)?(, or None)?|one of '.+'|True or False"
    r"|True, False or a BlockShuffle\(block=\.\.\., window=\.\.\.\)) "
    r"\(got (?P=name)=(?P<value>.+?)\)(; .+)?"
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> streampack.Cache:
    root = tmp_path_factory.mktemp("checks")
    docs = write_jsonl(root / "in.jsonl", [{"text": f"document {i} " * (i % 7 + 1)} for i in range(200)])
    streampack.build([docs], root / "cache", tokenizer="bytes")
    return streampack.open(root / "cache")


def loader(cache: streampack.Cache, **options: Any) -> Loader:
    return Loader(cache.sequences(16), **({"batch_size": 4} | options))


def mixture(cache: streampack.Cache, **options: Any) -> Mixture:
    return Mixture({"a": cache.sequences(16)}, {"a": 1.0}, **options)


def build(tmp: Path, **options: Any) -> None:
    docs = write_jsonl(tmp / "b.jsonl", [{"text": "a document"}])
    streampack.build([docs], tmp / "out", tokenizer="bytes", **options)


def follow(tmp: Path, **options: Any) -> None:
    settings = {"seq_len": 16, "batch_size": 4, "timeout": 0.01} | options
    Follow(tmp / "nothing-built-here", **settings)


Call = Callable[[streampack.Cache, Path], object]

# (what is called, the argument named in the message, the value shown): every public entry point.
CASES: list[tuple[str, Call, str, str]] = [
    ("sequences seq_len", lambda c, t: c.sequences(0), "seq_len", "0"),
    ("sequences overlap", lambda c, t: c.sequences(8, overlap=-1), "overlap", "-1"),
    ("sequences float", lambda c, t: c.sequences(2.0), "seq_len", "2.0"),
    ("packed seq_len", lambda c, t: c.packed(0), "seq_len", "0"),
    ("packed too_long", lambda c, t: c.packed(8, too_long="nope"), "too_long", "'nope'"),
    ("documents too_long", lambda c, t: c.documents(8, too_long=1), "too_long", "1"),
    ("documents pad_id", lambda c, t: c.documents(8, pad_id=-1), "pad_id", "-1"),
    ("documents pad_id big", lambda c, t: c.documents(8, pad_id=2**16), "pad_id", "65536"),
    ("split seed", lambda c, t: c.split(0.1, seed=1.5), "seed", "1.5"),
    ("split side", lambda c, t: c.split(0.1)[0].sequences(0), "seq_len", "0"),
    ("Loader batch_size", lambda c, t: loader(c, batch_size=0), "batch_size", "0"),
    ("Loader seed", lambda c, t: loader(c, seed=-1), "seed", "-1"),
    ("Loader rank", lambda c, t: loader(c, rank=2, world_size=2), "rank", "2"),
    ("Loader world_size", lambda c, t: loader(c, world_size=0), "world_size", "0"),
    ("Loader epochs", lambda c, t: loader(c, epochs=0), "epochs", "0"),
    ("Loader shuffle", lambda c, t: loader(c, shuffle=1), "shuffle", "1"),
    ("Loader drop_last", lambda c, t: loader(c, drop_last=1), "drop_last", "1"),
    ("Loader output", lambda c, t: loader(c, output="torch"), "output", "'torch'"),
    ("Loader.advance", lambda c, t: loader(c).advance(-1), "batches", "-1"),
    ("Loader.realised", lambda c, t: loader(c).realised(True), "steps", "True"),
    ("which", lambda c, t: streampack.which(loader(c), -1), "step", "-1"),
    ("Mixture seed", lambda c, t: mixture(c, seed=-1), "seed", "-1"),
    ("Mixture block_size", lambda c, t: mixture(c, block_size=0), "block_size", "0"),
    ("Mixture stop", lambda c, t: mixture(c, stop="later"), "stop", "'later'"),
    ("Mixture shuffle", lambda c, t: mixture(c, shuffle="blocks"), "shuffle", "'blocks'"),
    (
        "Mixture stages",
        lambda c, t: Mixture({"a": c.sequences(16)}, stages=[(0, {"a": 1}), (-5, {"a": 1})]),
        "stages[1] position",
        "-5",
    ),
    ("Permutation n", lambda c, t: Permutation(0, seed=0), "n", "0"),
    ("Permutation seed", lambda c, t: Permutation(10, seed=-1), "seed", "-1"),
    ("Permutation epoch", lambda c, t: Permutation(10, seed=0, epoch=2**64), "epoch", str(2**64)),
    ("BlockShuffle block", lambda c, t: BlockShuffle(block=0), "block", "0"),
    ("BlockShuffle window", lambda c, t: BlockShuffle(window=True), "window", "True"),
    ("Follow seq_len", lambda c, t: follow(t, seq_len=0), "seq_len", "0"),
    ("Follow batch_size", lambda c, t: follow(t, batch_size=0), "batch_size", "0"),
    ("Follow first_era", lambda c, t: follow(t, first_era=0), "first_era", "0"),
    ("Follow largest_era", lambda c, t: follow(t, first_era=64, largest_era=8), "largest_era", "8"),
    ("Follow then", lambda c, t: follow(t, then="stop"), "then", "'stop'"),
    ("build workers", lambda c, t: build(t, workers=0), "workers", "0"),
    ("build unit_bytes", lambda c, t: build(t, unit_bytes=100), "unit_bytes", "100"),
    ("build eos_id", lambda c, t: build(t, eos_id=-1), "eos_id", "-1"),
    ("build bos_id", lambda c, t: build(t, bos_id=2**32), "bos_id", str(2**32)),
    ("build special_tokens", lambda c, t: build(t, special_tokens="maybe"), "special_tokens", "'maybe'"),
    ("build executor", lambda c, t: build(t, executor="spark"), "executor", "'spark'"),
    ("build commit_bytes", lambda c, t: build(t, commit_bytes=0), "commit_bytes", "0"),
    ("build max_piece_chars", lambda c, t: build(t, max_piece_chars=-1), "max_piece_chars", "-1"),
    (
        "open max_local_bytes",
        lambda c, t: streampack.open("s3://bucket/cache", max_local_bytes=-1),
        "max_local_bytes",
        "-1",
    ),
    (
        "open prefetch_steps",
        lambda c, t: streampack.open("s3://bucket/cache", prefetch_steps=1.5),
        "prefetch_steps",
        "1.5",
    ),
]


@pytest.mark.parametrize(("call", "name", "value"), [case[1:] for case in CASES], ids=[c[0] for c in CASES])
def test_every_entry_point_refuses_a_wrong_argument_with_one_wording(
    cache: streampack.Cache, tmp_path: Path, call: Call, name: str, value: str
) -> None:
    with pytest.raises(OptionsError) as info:
        call(cache, tmp_path)
    message = str(info.value)
    shape = SHAPE.fullmatch(message)
    assert shape is not None, message
    assert shape["name"] == name and shape["value"] == value, message
    assert isinstance(info.value, ValueError)  # as a wrong argument value is


@pytest.mark.parametrize(
    ("kwargs", "allowed"),
    [
        ({"min": 1}, "an integer >= 1"),
        ({"min": 0, "below": 2**64}, "an integer in [0, 2**64)"),
        ({"min": 1, "max": 2**62}, "an integer in [1, 2**62]"),
        ({"min": 0, "below": 4}, "an integer in [0, 4)"),
        ({"min": 1 << 16}, "an integer >= 2**16"),
        ({"min": 0, "max": 65535}, "an integer in [0, 65535]"),
        ({"max": 9}, "an integer <= 9"),
        ({}, "an integer"),
    ],
)
def test_bounds_are_written_as_people_read_them(kwargs: dict[str, int], allowed: str) -> None:
    assert bounds(**kwargs) == allowed


def test_the_checks_return_python_values_and_refuse_bools() -> None:
    value = check_int("n", np.int64(3), min=0)
    assert value == 3 and type(value) is int
    assert check_int_or_none("n", None, min=0) is None
    with pytest.raises(OptionsError, match=r"^n must be an integer >= 0, or None \(got n=-1\); hint$"):
        check_int_or_none("n", -1, min=0, hint="hint")
    with pytest.raises(OptionsError, match=r"n must be an integer >= 0 \(got n=False\)"):
        check_int("n", False, min=0)
    check_choice("mode", "a", ("a", "b"))
    with pytest.raises(OptionsError, match=r"mode must be one of 'a', 'b' \(got mode=array"):
        check_choice("mode", np.array(["a", "b"]), ("a", "b"))

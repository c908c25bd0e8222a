"""The public face: a pinned, lazy set of top-level names; moved names warn; reading needs no build side."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import streampack

PUBLIC = [
    "BlockShuffle",
    "Cache",
    "CacheSpec",
    "Documents",
    "Follow",
    "Loader",
    "Mixture",
    "RunOptions",
    "StreampackError",
    "build",
    "load_mixture",
    "open",
    "verify",
    "which",
]


def test_the_top_level_names_are_pinned() -> None:
    assert streampack.__all__ == PUBLIC
    assert sorted([*streampack._PUBLIC, "build"]) == PUBLIC  # build: the package's own function
    assert streampack.build.__module__ == "streampack"


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_resolves_and_is_documented(name: str) -> None:
    value = getattr(streampack, name)
    assert value.__doc__, name
    assert name in dir(streampack)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Loadr'"):
        streampack.Loadr  # noqa: B018


def _modules_after(statement: str) -> list[str]:
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_import_streampack_loads_nothing_but_its_face() -> None:
    loaded = [m for m in _modules_after("import streampack") if m.startswith("streampack")]
    assert loaded == ["streampack"]


@pytest.mark.parametrize("statement", ["from streampack import Loader", "import streampack; streampack.open"])
def test_a_trainer_that_reads_a_cache_loads_no_build_side_and_no_heavy_module(statement: str) -> None:
    loaded = _modules_after(statement)
    ours = [m for m in loaded if m.startswith("streampack.")]
    assert not [m for m in ours if m.split(".")[1] in {"builder", "inputs", "tokenizer", "cli"}], ours
    heavy = {"multiprocessing", "concurrent.futures", "socket", "pyarrow", "tokenizers", "yaml", "click"}
    assert not heavy & set(loaded), heavy & set(loaded)


def test_the_torch_adapter_loads_no_build_side() -> None:
    pytest.importorskip("torch")
    ours = [m for m in _modules_after("import streampack.torch") if m.startswith("streampack.")]
    assert not [m for m in ours if m.split(".")[1] in {"builder", "inputs", "tokenizer", "cli"}], ours

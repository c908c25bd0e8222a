"""The public face: a pinned, lazy set of top-level names; moved names warn; reading needs no build side."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

import streampack
import streampack.testing
from streampack.builder.options import BuildKeywords, CacheSpec, RunOptions
from streampack.follow.options import FollowKeywords, FollowOptions
from streampack.loader.options import LoaderKeywords, LoaderOptions

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


def _fields(*classes: type) -> set[str]:
    return {f.name for cls in classes for f in dataclasses.fields(cls)}


def test_the_typed_keywords_are_the_options_fields() -> None:
    """``**keywords: Unpack[...]`` lists each option for type checkers: the same names as the dataclasses."""
    assert set(LoaderKeywords.__annotations__) == _fields(LoaderOptions)  # with the base's keys
    assert set(FollowKeywords.__annotations__) == _fields(FollowOptions, LoaderOptions) - {
        "shuffle",
        "epochs",
    }
    assert set(BuildKeywords.__annotations__) == _fields(CacheSpec, RunOptions)
    assert not _fields(CacheSpec) & _fields(RunOptions)  # one keyword, one field


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
    heavy |= {"shutil", "streampack.order.mixture"}  # to delete a folder; to read a Mixture
    assert not heavy & set(loaded), heavy & set(loaded)


REMOTE = {"streampack.store.remote", "streampack.store.localcopy"}


@pytest.mark.parametrize("output", ["numpy", "dict"])
def test_a_trainer_of_a_local_cache_loads_nothing_remote(tmp_path: Path, output: str) -> None:
    """``open()`` of a local cache, a Loader and its batches (windows and packed documents) import no fsspec
    and no module of the object-storage read path."""
    streampack.testing.write_random_cache(tmp_path / "c", 50_000, num_shards=2, vocab_size=1000)
    loaded = _modules_after(
        f"import streampack\ncache = streampack.open({str(tmp_path / 'c')!r})\n"
        f"for samples in (cache.sequences(64), cache.packed(64)):\n"
        f"    next(iter(streampack.Loader(samples, batch_size=4, output={output!r})))"
    )
    assert not [m for m in loaded if m.split(".")[0] in {"fsspec", "s3fs", "aiobotocore"}]
    assert not REMOTE & set(loaded), REMOTE & set(loaded)
    assert "numba" not in loaded  # compiled loops only for FIM and context parallelism, on first use


def test_the_torch_adapter_loads_no_build_side() -> None:
    pytest.importorskip("torch")
    ours = [m for m in _modules_after("import streampack.torch") if m.startswith("streampack.")]
    assert not [m for m in ours if m.split(".")[1] in {"builder", "inputs", "tokenizer", "cli"}], ours

"""The module paths of version 0.1 still import, warn, and give the same objects as the new ones."""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import streampack
from streampack._aliases import MOVED, _Alias


@pytest.fixture(autouse=True)
def _forget_old_paths() -> Iterator[None]:
    """Each test's imports of old paths are undone after it: importing ``streampack.build`` binds the
    package's ``build`` to the alias module, which other tests must not see."""
    face = dict(vars(streampack))
    yield
    for old in MOVED:
        sys.modules.pop(old, None)
    for name, value in list(vars(streampack).items()):
        if isinstance(value, _Alias):  # an old module bound over a name of the package, or new
            if name in face:
                setattr(streampack, name, face[name])
            else:
                delattr(streampack, name)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_gives_the_new_modules_objects_with_a_warning(old: str) -> None:
    new = importlib.import_module(MOVED[old])
    public = [
        n
        for n in vars(new)
        if not n.startswith("_") and getattr(vars(new)[n], "__module__", "") == new.__name__
    ] or list(getattr(new, "__all__", []))  # a module that only re-exports (a face): its public names
    assert public, f"{MOVED[old]} defines nothing public to check"
    alias = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        assert getattr(alias, public[0]) is getattr(new, public[0])


def test_no_old_module_file_is_left_beside_the_packages() -> None:
    root = Path(streampack.__path__[0])
    for old in MOVED:
        assert not (root / f"{old.rpartition('.')[2]}.py").exists(), old


def test_importing_the_old_build_module_keeps_the_build_function_callable() -> None:
    code = (
        "import streampack, streampack.build, streampack.verify\n"
        "from streampack.builder.coordinator import build\n"
        "assert callable(streampack.build) and callable(streampack.verify)\n"
        "from streampack.build import BuildSummary\n"
        "from streampack.builder.coordinator import BuildSummary as new\n"
        "print(BuildSummary is new)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "True"


def test_the_import_statement_of_an_old_path_names_the_caller_in_its_warning() -> None:
    code = (
        "import warnings\nwarnings.simplefilter('error')\nfrom streampack.sequences import PackedSequences\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "DeprecationWarning: streampack.sequences moved to streampack.samples.sequences" in done.stderr
    assert '<string>", line 3' in done.stderr


@pytest.mark.parametrize(
    ("module", "old", "new"),
    [
        ("streampack.format.ledger", "UnitProgress", "LedgerEntry"),
        ("streampack.ledger", "UnitProgress", "LedgerEntry"),  # 0.1's path, which its pickles name
        ("streampack.loader.options", "SourceProgress", "SourceShare"),
        ("streampack.loader", "SourceProgress", "SourceShare"),
        ("streampack", "SourceProgress", "SourceShare"),
        ("streampack.store", "StagedFile", "AppendFile"),
        ("streampack.builder.publish", "default_stage", "default_staging_dir"),
    ],
)
def test_a_renamed_name_still_gives_its_object_with_a_warning(module: str, old: str, new: str) -> None:
    found = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=old):
        value = getattr(found, old)
    assert value.__name__ == new


def test_local_store_stage_is_the_old_name_of_append_file(tmp_path: Path) -> None:
    from streampack.store import LocalStore

    with pytest.warns(
        DeprecationWarning, match="LocalStore.stage is deprecated: it is now LocalStore.append_file"
    ):
        file = LocalStore(tmp_path).stage("x.tokens", 0)
    file.write(b"ab")
    file.close()
    assert (tmp_path / "x.tokens").read_bytes() == b"ab"

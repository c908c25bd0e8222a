"""Objects pickled by version 0.1.0 (every module in one flat folder) still load and serve the same data.

The fixtures were written by ``tests/fixtures/pickles/make.py`` at commit ec13218; they name classes by
their old module paths (``streampack.sequences.PackedSequences``, ``streampack.layout.Bins``, …). Each
test rebuilds the fixtures' cache (the same bytes) in its own folder and points the pickles at it.
"""

from __future__ import annotations

import importlib.util
import json
import pickle
import pickletools
import shutil
import struct
from pathlib import Path
from urllib.parse import urlparse

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "pickles"
NAMES = sorted(p.stem for p in FIXTURES.glob("*.pkl"))
_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"}


def _maker():
    spec = importlib.util.spec_from_file_location("make_pickles", FIXTURES / "make.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _string_op(text: str) -> bytes:
    data = text.encode()
    if len(data) < 256:
        return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE
    return b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE


def relocate(data: bytes, old_root: Path, new_root: Path) -> bytes:
    """The pickle with every string naming ``old_root`` (a URI, a path, or a ``PosixPath``'s parts)
    naming ``new_root``. Protocol 2 has no frames, so string opcodes can be rewritten in place."""
    old_parts, new_parts = old_root.parts, new_root.parts
    assert len(old_parts) == 3, old_parts  # "/", the temporary directory, the fixture's folder
    exact = {
        old_root.as_uri(): new_root.as_uri(),
        str(old_root): str(new_root),
        old_parts[1]: "/".join(new_parts[1:-1]),
        old_parts[2]: new_parts[-1],
    }
    out, last = bytearray(), 0
    for op, arg, pos in pickletools.genops(data):
        if op.name not in _STRINGS or not isinstance(arg, str):
            continue
        new = exact.get(arg)
        if new is None and arg.startswith(str(old_root) + "/"):
            new = str(new_root) + arg[len(str(old_root)) :]
        if new is None:
            continue
        end = pos + 1 + (1 if op.name == "SHORT_BINUNICODE" else 4 if op.name == "BINUNICODE" else 8)
        end += len(arg.encode())
        out += data[last:pos] + _string_op(new)
        last = end
    return bytes(out + data[last:])


@pytest.fixture(scope="module")
def relocated(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, bytes], dict[str, object]]:
    """The fixture pickles pointed at a rebuilt copy of their cache, and what each served first."""
    maker = _maker()
    root = tmp_path_factory.mktemp("pickles").resolve() / "cache"
    maker.objects(maker.build_cache(root), root)
    # The plans 0.1 stored, which its pickles name: a cache that 0.1 read keeps them.
    for plan in (FIXTURES / "layouts").iterdir():
        shutil.copytree(plan, root / "layouts" / plan.name, dirs_exist_ok=True)
    old_root = Path(urlparse((FIXTURES / "uri.txt").read_text().strip()).path)
    pickles = {name: relocate((FIXTURES / f"{name}.pkl").read_bytes(), old_root, root) for name in NAMES}
    expected = json.loads((FIXTURES / "expected.json").read_text())
    return pickles, {"maker": maker, "expected": expected}


def test_there_are_fixtures_of_every_kind() -> None:
    assert set(NAMES) >= {"windows", "packed", "documents", "loader", "mixture", "follow", "grain_documents"}


@pytest.mark.filterwarnings("ignore:streampack.*moved to:DeprecationWarning")
@pytest.mark.parametrize("name", NAMES)
def test_a_pickle_of_version_0_1_loads_and_serves_the_same_data(
    name: str, relocated: tuple[dict[str, bytes], dict[str, object]]
) -> None:
    pickles, context = relocated
    if name == "grain_documents":
        pytest.importorskip("grain")
    obj = pickle.loads(pickles[name])
    maker, expected = context["maker"], context["expected"]
    assert maker.first_rows(obj) == expected[name]  # type: ignore[attr-defined,index]


def test_relocation_rewrites_every_path(relocated: tuple[dict[str, bytes], dict[str, object]]) -> None:
    old = urlparse((FIXTURES / "uri.txt").read_text().strip()).path
    for name, data in relocated[0].items():
        assert Path(old).name.encode() not in data, name

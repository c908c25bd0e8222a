"""The code is ruff clean and type-checked (mypy, settings in pyproject.toml), as part of the suite."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *command], cwd=REPO, capture_output=True, text=True)


@pytest.mark.parametrize(
    "command",
    [("ruff", "check", "."), ("ruff", "format", "--check", "."), ("mypy",)],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_clean(command: tuple[str, ...]) -> None:
    if _run(command[0], "--version").returncode != 0:
        pytest.skip(f"{command[0]} is not installed (pip install -e '.[dev]')")
    result = _run(*command)
    assert result.returncode == 0, result.stdout + result.stderr


def _without_torch(root: Path) -> Path:
    """An interpreter that sees this environment's packages except torch and what only runs on it."""
    site = root / "site"
    site.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.lower().startswith(("torch", "functorch", "__editable__")):
            (site / entry.name).symlink_to(entry)
    venv.create(root / "env", with_pip=False)
    (next((root / "env").glob("lib/python*/site-packages")) / "suite.pth").write_text(f"{site}\n")
    python = root / "env" / "bin" / "python"
    probe = subprocess.run([python, "-c", "import torch"], capture_output=True)
    assert probe.returncode != 0, "torch is still importable in the torch-less environment"
    return python


def test_mypy_is_clean_without_torch(tmp_path: Path) -> None:
    """A plain install has no torch: the adapters' ``type: ignore`` comments and torch-typed code must check
    there too (torch's types then are Any), not only beside torch."""
    if _run("mypy", "--version").returncode != 0:
        pytest.skip("mypy is not installed (pip install -e '.[dev]')")
    python = _without_torch(tmp_path)
    result = _run("mypy", "--python-executable", str(python), "--cache-dir", str(tmp_path / "cache"))
    assert result.returncode == 0, result.stdout + result.stderr

"""The code is ruff clean and type-checked (mypy, settings in pyproject.toml), as part of the suite."""

from __future__ import annotations

import subprocess
import sys
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

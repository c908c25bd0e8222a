"""The docs site (``mkdocs.yml``, the pages under ``docs/``, the API reference made from the docstrings)
builds with ``mkdocs build --strict``: no broken link or anchor, no page left out of the navigation, no
docstring the reference cannot parse. Runs where the ``docs`` extra is installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("material")
pytest.importorskip("mkdocstrings_handlers.python")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_docs_site_builds_strictly(tmp_path: Path) -> None:
    site = tmp_path / "site"
    config = str(ROOT / "mkdocs.yml")
    command = ["mkdocs", "build", "--strict", "--config-file", config, "--site-dir", str(site)]
    done = subprocess.run(
        [sys.executable, "-m", *command],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    reference = (site / "api" / "streampack" / "index.html").read_text()
    assert 'id="streampack.Loader.load_state_dict"' in reference  # inherited members are listed
    assert ":class:" not in reference  # the docstrings' Sphinx roles are shown as Sphinx shows them

"""mypy over the package in an environment without torch: a plain install has none, so the adapters'
``type: ignore`` comments and torch-typed code must check there too (torch's types are then Any).

Run by ``.ci/lint``; the environment is this one's packages, torch and what only runs on it left out.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tempfile
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def without_torch(root: Path) -> Path:
    """An interpreter that sees this environment's packages except torch."""
    site = root / "site"
    site.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.lower().startswith(("torch", "functorch", "__editable__")):
            (site / entry.name).symlink_to(entry)
    venv.create(root / "env", with_pip=False)
    (next((root / "env").glob("lib/python*/site-packages")) / "suite.pth").write_text(f"{site}\n")
    python = root / "env" / "bin" / "python"
    if subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0:
        sys.exit("torch is still importable in the torch-less environment")
    return python


def main() -> int:
    with tempfile.TemporaryDirectory() as scratch:
        python = without_torch(Path(scratch))
        command = [sys.executable, "-m", "mypy", "--python-executable", str(python)]
        return subprocess.run([*command, "--cache-dir", str(Path(scratch) / "cache")], cwd=REPO).returncode


if __name__ == "__main__":
    sys.exit(main())

"""A DataLoader worker killed mid-epoch is a clear error, never a hang; the saved state resumes exactly."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from streampack.testing.caches import write_cache

SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys
    import numpy as np
    import streampack
    from streampack.torch import DataLoader

    cache, mode, state_file = sys.argv[1], sys.argv[2], sys.argv[3]
    def make():
        loader = streampack.Loader(streampack.open(cache).sequences(16), batch_size=4, seed=3, epochs=1)
        return DataLoader(loader, num_workers=2, persistent_workers=True)
    data = make()
    if mode == "kill":
        for step, batch in enumerate(data):
            if step == 5:
                json.dump(data.state_dict(), open(state_file, "w"))
                os.kill(data._iterator._workers[0].pid, signal.SIGKILL)
        print("finished without noticing the dead worker")
    elif mode == "resume":
        data.load_state_dict(json.load(open(state_file)))
        np.save(sys.argv[4], np.stack([b.numpy() for b in data]))
    else:
        batches = [b.numpy() for b in data]
        np.save(sys.argv[4], np.stack(batches[6:]))
    """
)


@pytest.mark.slow
def test_killed_worker_is_an_error_and_state_resumes(tmp_path: Path) -> None:
    tokens = np.arange(4000) % 997
    cache = write_cache(tmp_path / "c", [(tokens, np.arange(50, 4001, 50))], vocab_size=1000, eos_id=999)
    script = tmp_path / "fault.py"
    script.write_text(SCRIPT)
    state = tmp_path / "state.json"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(script), str(cache), *args], capture_output=True, text=True, timeout=120
        )

    killed = run("kill", str(state))
    assert killed.returncode != 0, killed.stdout
    assert "DataLoader worker" in killed.stderr, killed.stderr[-2000:]
    # torch says so from its SIGCHLD handler or from its next check of the workers, whichever runs first.
    said = ("exited unexpectedly", "is killed by signal: Killed")
    assert any(words in killed.stderr for words in said), killed.stderr[-2000:]
    assert run("resume", str(state), str(tmp_path / "resumed.npy")).returncode == 0
    assert run("full", str(state), str(tmp_path / "full.npy")).returncode == 0
    np.testing.assert_array_equal(np.load(tmp_path / "resumed.npy"), np.load(tmp_path / "full.npy"))

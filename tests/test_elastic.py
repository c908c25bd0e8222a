"""Elastic resume of mixtures through PyTorch: real `torchrun` ranks, DataLoader workers, changed mixtures.

Every sample of the caches here names itself: sample ``i`` of source ``j`` is ``SEQ_LEN`` copies of the
token ``j * OFFSET + i``, so a served batch says exactly which ``(source, sample)`` pairs it holds.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from itertools import islice
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import streampack  # noqa: E402
from streampack.errors import LoaderStateError  # noqa: E402
from streampack.loader import Loader  # noqa: E402
from streampack.order.mixture import Mixture  # noqa: E402
from streampack.testing.caches import write_cache  # noqa: E402
from streampack.torch import DataLoader, IterableDataset  # noqa: E402

# Workers beyond this machine's core count only warn.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:torch.utils.data.dataloader")

SEQ_LEN = 8
OFFSET = 10_000
SIZES = {"web": 211, "code": 97, "books": 150}  # samples per source: three caches of different sizes
VOCAB = 3 * OFFSET + 1

Pair = tuple[int, int]


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Three real caches (two shards each, documents of 5 tokens) whose samples name themselves."""
    root = tmp_path_factory.mktemp("elastic")
    out = {}
    for j, (name, n) in enumerate(SIZES.items()):
        tokens = np.repeat(j * OFFSET + np.arange(n), SEQ_LEN)
        parts = np.split(tokens, [n // 3 * SEQ_LEN])
        shards = [(part, np.append(np.arange(5, len(part), 5), len(part))) for part in parts]
        out[name] = str(write_cache(root / name, shards, vocab_size=VOCAB, eos_id=VOCAB - 1))
    return out


def sources(roots: dict[str, str], *names: str) -> dict[str, Any]:
    """The named caches' samples, in the order given."""
    return {name: streampack.open(roots[name]).sequences(SEQ_LEN) for name in names}


def decode(rows: Any) -> list[Pair]:
    """``(source, sample)`` of each row of a batch (an array, a tensor, or nested lists)."""
    rows = np.asarray(rows)
    assert (rows == rows[:, :1]).all(), "a row mixes samples"
    return [divmod(int(v), OFFSET) for v in rows[:, 0]]


def served(batches: Any) -> list[Pair]:
    """The ``(source, sample)`` pairs of a sequence of batches, in order."""
    return [pair for batch in batches for pair in decode(batch)]


def stream(mix: Mixture, start: int, stop: int) -> list[Pair]:
    """The ``(source, sample)`` pairs ``mix`` holds at positions ``[start, stop)``, as it is."""
    ids, samples = mix(np.arange(start, stop, dtype=np.int64))
    return list(zip(ids.tolist(), samples.tolist(), strict=True))


# --- 1. two torchrun ranks stop, one process with another batch size resumes -----------------------------

# Both runs of the issue in one script: the mixture and the run's shape come in as JSON.
_RANK_SCRIPT = """
import json, sys
import torch.distributed as dist
import streampack
from streampack.loader import Loader
from streampack.order.mixture import Mixture
from streampack.torch import DataLoader, rank_and_world_size

config = json.loads(sys.argv[1])
dist.init_process_group("gloo")
rank, world = rank_and_world_size()
mix = Mixture(
    {name: streampack.open(root).sequences(config["seq_len"]) for name, root in config["roots"].items()},
    **config["mixture"],
)
loader = Loader(mix, batch_size=config["batch_size"], rank=rank, world_size=world, drop_last=False)
data = DataLoader(loader, num_workers=config["workers"], persistent_workers=True)
if config["resume"]:
    with open(config["resume"]) as f:
        data.load_state_dict(json.load(f))
batches = []
for batch in data:
    batches.append(batch.tolist())
    if len(batches) == config["steps"]:
        break  # stopped here: the workers have prefetched batches beyond this one
with open(f"{config['out']}.rank{rank}.json", "w") as f:
    json.dump({"rank": rank, "world": world, "batches": batches, "state": data.state_dict()}, f)
dist.destroy_process_group()
"""

# Stages change the weights at position 200, after the checkpoint; the stream ends when "web" runs out.
STAGED = {
    "stages": [(0, {"web": 5, "code": 2, "books": 3}), (200, {"web": 2, "code": 1, "books": 1})],
    "seed": 3,
    "block_size": 20,
    "stop": "first_exhausted",
}


def torchrun(script: Path, ranks: int, out: Path, **config: Any) -> list[dict[str, Any]]:
    """Run ``script`` on ``ranks`` torchrun processes with ``config``; what each rank wrote, in rank order."""
    launcher = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if launcher is None:
        pytest.skip("torchrun is not installed beside this Python")
    config |= {"out": str(out)}
    command = [launcher, "--standalone", "--nproc_per_node", str(ranks), str(script), json.dumps(config)]
    result = subprocess.run(command, timeout=180, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(ranks)]


@pytest.mark.slow
def test_two_ranks_stop_and_one_process_with_a_doubled_batch_resumes_the_mixture(
    roots: dict[str, str], tmp_path: Path
) -> None:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(_RANK_SCRIPT))
    common = {"roots": roots, "seq_len": SEQ_LEN, "mixture": STAGED}
    steps, batch_size = 13, 6  # stops at position 78: inside a block, and not a multiple of 12

    # Two ranks x 2 persistent workers, global batch 6, stopped after 13 steps.
    first = torchrun(
        script, 2, tmp_path / "first", **common, batch_size=batch_size, workers=2, steps=steps, resume=None
    )
    assert [r["world"] for r in first] == [2, 2]
    assert first[0]["state"] == first[1]["state"]  # every rank saves the same state
    assert first[0]["state"]["position"] == steps * batch_size
    state_file = tmp_path / "state.json"
    state_file.write_text(json.dumps(first[0]["state"]))

    # One process, 3 persistent workers, global batch 12, from the saved state to the end of the stream.
    doubled = {"batch_size": 2 * batch_size, "workers": 3, "steps": None, "resume": str(state_file)}
    second = torchrun(script, 1, tmp_path / "second", **common, **doubled)
    assert second[0]["world"] == 1

    # In order of global position: each global batch is rank 0's rows, then rank 1's.
    ranks = zip(first[0]["batches"], first[1]["batches"], strict=True)
    before = [pair for rows in ranks for pair in served(rows)]
    after = served(second[0]["batches"])
    assert len(before) == steps * batch_size
    mix = Mixture(sources(roots, *SIZES), **STAGED)
    uninterrupted = served(Loader(mix, batch_size=7, drop_last=False))
    assert mix.end is not None and len(uninterrupted) == mix.end
    union = before + after
    assert len(union) == mix.end  # M: everything the stream holds was served
    assert Counter(union) == Counter(uninterrupted)  # as a multiset: nothing repeated, nothing skipped
    assert max(Counter(union).values()) == 1  # a stopping mixture serves each sample at most once
    assert union == uninterrupted  # and in the same order
    assert second[0]["state"]["position"] == mix.end


# --- 2. persistent workers, and a checkpoint resumed by a changed mixture --------------------------------


def old_mixture(roots: dict[str, str]) -> Mixture:
    """Two of the caches, 3:1."""
    return Mixture(sources(roots, "web", "code"), weights={"web": 3, "code": 1}, seed=5, block_size=16)


def new_mixture(roots: dict[str, str]) -> Mixture:
    """The old mixture with new stage weights and an added source."""
    return Mixture(
        sources(roots, "web", "code", "books"),
        stages=[(0, {"web": 1, "code": 1, "books": 2}), (160, {"web": 2, "code": 1, "books": 1})],
        seed=5,
        block_size=16,
    )


def checkpoint(mix: Mixture, steps: int, batch_size: int = 6) -> dict[str, Any]:
    """The state of a run over ``mix`` after ``steps`` batches, through JSON as a trainer saves it."""
    loader = Loader(mix, batch_size=batch_size)
    loader.advance(steps)
    return json.loads(json.dumps(loader.state_dict()))


def resumed(mix: Mixture, state: dict[str, Any], steps: int, skip: int = 0) -> list[Pair]:
    """What a fresh loader over ``mix``, resumed from ``state``, serves in ``steps`` batches of 8 after
    ``skip`` more."""
    loader = Loader(mix, batch_size=8)
    loader.load_state_dict(state)
    loader.advance(skip)
    return served(islice(loader, steps))


def test_running_persistent_workers_resume_a_checkpoint_with_a_changed_mixture(
    roots: dict[str, str],
) -> None:
    new = new_mixture(roots)
    state = checkpoint(old_mixture(roots), 7)  # position 42: the third block of 16 has begun
    expected = resumed(new, state, 20)
    # What workers still holding the new mixture's own order (its weights from position 0) would serve.
    assert stream(new, 42, 42 + 20 * 8) != expected  # so the test tells the two apart

    data = DataLoader(Loader(new, batch_size=8), num_workers=2, persistent_workers=True)
    assert served(islice(data, 3)) == served(islice(Loader(new, batch_size=8), 3))  # workers running
    data.load_state_dict(state)
    assert served(islice(data, 20)) == expected
    middle = data.state_dict()
    assert middle["position"] == 42 + 20 * 8

    # The same DataLoader, rewound to an earlier checkpoint of the old run, then forward again.
    early = checkpoint(old_mixture(roots), 3)  # position 18: a block earlier
    data.load_state_dict(early)
    assert served(islice(data, 10)) == resumed(new, early, 10)
    data.load_state_dict(middle)
    assert served(islice(data, 10)) == resumed(new, state, 10, skip=20)


def test_a_dataloader_over_the_old_mixture_reused_after_the_mixture_changed(roots: dict[str, str]) -> None:
    # A DataLoader serves the Loader, and so the Mixture, it was built with: there is no public way to hand
    # it another mixture, so a run with a new mixture builds a new DataLoader. What the old one can do
    # once the mixture changed is load the new run's checkpoints.
    old, new = old_mixture(roots), new_mixture(roots)
    data = DataLoader(Loader(old, batch_size=8), num_workers=2, persistent_workers=True)
    head = served(islice(data, 4))
    state = data.state_dict()
    later = DataLoader(Loader(new, batch_size=8), num_workers=2, persistent_workers=True)
    later.load_state_dict(state)
    assert served(islice(later, 5)) == resumed(new, state, 5)

    # The new run reads a source the old mixture lacks: refused, naming it, and nothing changes.
    with pytest.raises(LoaderStateError, match="reads source 'books', which this mixture does not have"):
        data.load_state_dict(later.state_dict())
    assert head + served(islice(data, 3)) == served(islice(Loader(old, batch_size=8), 7))

    # A new run with new weights only: the old DataLoader, its workers running, takes over that run's
    # history, and its own weights apply again from the next block.
    reweighted = Mixture(sources(roots, "web", "code"), weights={"web": 1, "code": 1}, seed=5, block_size=16)
    run = Loader(reweighted, batch_size=8)
    run.load_state_dict(data.state_dict())
    run.advance(6)
    checkpoint_of_run = run.state_dict()
    assert stream(old, run.position, run.position + 10 * 8) != resumed(old, checkpoint_of_run, 10)
    data.load_state_dict(checkpoint_of_run)
    assert served(islice(data, 10)) == resumed(old, checkpoint_of_run, 10)


def test_persistent_workers_of_a_plain_torch_dataloader_refuse_an_order_they_do_not_hold(
    roots: dict[str, str],
) -> None:
    # torch's own DataLoader cannot restart its persistent workers when a resume changes the order, and
    # they only see the position: they refuse to go on rather than serve the stale order's samples.
    new = new_mixture(roots)
    state = checkpoint(old_mixture(roots), 7)
    dataset = IterableDataset(Loader(new, batch_size=8))
    plain = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, persistent_workers=True)
    assert served(islice(plain, 2)) == stream(new, 0, 16)
    dataset.load_state_dict(state)
    with pytest.raises(LoaderStateError, match="persistent workers keep the order they were started with"):
        next(iter(plain))
    # Workers started afresh for each iteration read the loader as it now is.
    dataset = IterableDataset(Loader(new, batch_size=8))
    plain = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
    assert served(islice(plain, 2)) == stream(new, 0, 16)
    dataset.load_state_dict(state)
    assert served(islice(plain, 5)) == resumed(new, state, 5)


# --- 3. a mixture through DataLoader workers serves exactly the Loader's batches -------------------------


@pytest.mark.parametrize("output", ["numpy", "dict"])
def test_a_mixture_through_workers_serves_the_loaders_batches(
    roots: dict[str, str], output: Literal["numpy", "dict"]
) -> None:
    mix = Mixture(sources(roots, *SIZES), **STAGED)
    assert mix.end == 420  # in batches of 16: a partial last batch of 4

    def make() -> Loader:
        return Loader(mix, batch_size=16, drop_last=False, output=output)

    expected = list(make())
    got = list(DataLoader(make(), num_workers=2))
    assert len(got) == len(expected) == len(make()) == 27
    for batch, reference in zip(got, expected, strict=True):
        if output == "numpy":  # through the shared-slot ring
            assert batch.dtype == torch.int64 and np.array_equal(batch.numpy(), reference)
        else:
            assert set(batch) == set(reference) == {"input_ids", "labels", "position_ids", "source_ids"}
            for key, value in batch.items():
                assert value.dtype == torch.int64 and np.array_equal(value.numpy(), reference[key]), key
    tokens = [batch if output == "numpy" else batch["input_ids"] for batch in got]
    assert len(tokens[-1]) == 420 - 26 * 16
    assert served(tokens) == stream(mix, 0, 420)
    if output == "dict":  # documents of 5 tokens: position ids restart inside rows
        assert any(not np.array_equal(row, np.arange(SEQ_LEN)) for row in got[0]["position_ids"].numpy())

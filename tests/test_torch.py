"""Tests for `streampack.torch`: DataLoader workers, ranks, resume, and real `torchrun` processes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import warnings
from itertools import islice
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import streampack  # noqa: E402
from streampack.errors import LoaderStateError, OptionsError  # noqa: E402
from streampack.loader import Loader  # noqa: E402
from streampack.testing.caches import write_cache  # noqa: E402
from streampack.torch import DataLoader, Dataset, IterableDataset, _SlotRing  # noqa: E402
from tests.conftest import run_cli  # noqa: E402

# Workers beyond this machine's core count, and pin_memory without an accelerator, only warn.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:torch.utils.data.dataloader")

SEQ_LEN = 8
NUM_SAMPLES = 150


@pytest.fixture(scope="module")
def numbered(tmp_path_factory: pytest.TempPathFactory) -> streampack.Cache:
    """A cache whose sample i is SEQ_LEN copies of the token i, in two shards: batches name their samples."""
    tokens = np.repeat(np.arange(NUM_SAMPLES), SEQ_LEN)
    cut = 61 * SEQ_LEN
    shards = [(tokens[:cut], np.arange(1, cut + 1)), (tokens[cut:], np.arange(1, len(tokens) - cut + 1))]
    return streampack.open(
        write_cache(tmp_path_factory.mktemp("t") / "c", shards, vocab_size=1000, eos_id=999)
    )


def sample_ids(batches: list) -> list[list[int]]:
    """The sample numbers of each batch of a numbered cache."""
    ids = []
    for batch in batches:
        assert bool((batch == batch[:, :1]).all()), "a row mixes samples"
        ids.append(batch[:, 0].tolist())
    return ids


@pytest.mark.parametrize(("world", "workers"), [(2, 3), (3, 2)])
def test_ranks_times_workers_see_every_sample_once(
    numbered: streampack.Cache, world: int, workers: int
) -> None:
    seqs = numbered.sequences(SEQ_LEN)
    per_rank = []
    for rank in range(world):
        loader = Loader(
            seqs, batch_size=2 * world, seed=11, rank=rank, world_size=world, drop_last=False, epochs=1
        )
        per_rank.append(sample_ids(list(DataLoader(loader, num_workers=workers))))
    assert len({len(batches) for batches in per_rank}) == 1
    everything = sorted(i for batches in per_rank for batch in batches for i in batch)
    assert everything == list(range(NUM_SAMPLES))


def test_real_workers_split_a_block_shuffled_epoch(numbered: streampack.Cache) -> None:
    seqs, shuffle = numbered.sequences(SEQ_LEN), streampack.BlockShuffle(block=16, window=2)
    per_rank = []
    for rank in range(2):
        options = {"seed": 11, "shuffle": shuffle, "rank": rank, "world_size": 2, "epochs": 1}
        per_rank.append(sample_ids(list(DataLoader(Loader(seqs, batch_size=6, **options), num_workers=2))))
        alone = [batch[:, 0].tolist() for batch in Loader(seqs, batch_size=6, **options)]
        assert per_rank[-1] == alone  # the workers hand out the loader's own stream, in order
    everything = [i for batches in per_rank for batch in batches for i in batch]
    assert sorted(everything) == list(range(NUM_SAMPLES))


@pytest.mark.slow
def test_drop_last_false_never_hands_a_rank_an_empty_batch(tmp_path: Path) -> None:
    # The reported numbers: 1,257 samples, global batch 8 over 8 ranks leaves 1 row for 8 ranks.
    n = 1257
    tokens = np.repeat(np.arange(n), SEQ_LEN)
    seqs = streampack.open(
        write_cache(tmp_path / "c", [(tokens, np.arange(1, len(tokens) + 1))], vocab_size=2000, eos_id=1999)
    ).sequences(SEQ_LEN)
    refused = Loader(seqs, batch_size=8, world_size=8, drop_last=False, epochs=1)
    with pytest.raises(OptionsError, match=r"7 of the 8 ranks an empty last batch.*1257 mod 8 = 1 sample"):
        next(iter(DataLoader(refused)))
    # batch_size=16 leaves 9 rows: every rank gets 1 or 2, through DataLoader workers too.
    per_rank = []
    for rank in range(8):
        loader = Loader(seqs, batch_size=16, seed=2, rank=rank, world_size=8, drop_last=False, epochs=1)
        per_rank.append(sample_ids(list(DataLoader(loader, num_workers=2))))
    assert {len(batches) for batches in per_rank} == {-(-n // 16)}
    assert [len(batches[-1]) for batches in per_rank] == [1] * 7 + [2]
    assert all(len(batch) == 2 for batches in per_rank for batch in batches[:-1])
    assert sorted(i for batches in per_rank for batch in batches for i in batch) == list(range(n))


@pytest.mark.parametrize("workers", [0, 2])
def test_workers_hand_out_the_loaders_batches_in_order(numbered: streampack.Cache, workers: int) -> None:
    seqs = numbered.sequences(SEQ_LEN, overlap=1)
    expected = list(Loader(seqs, batch_size=6, seed=3, epochs=2))
    got = list(DataLoader(Loader(seqs, batch_size=6, seed=3, epochs=2), num_workers=workers))
    assert len(got) == len(expected)
    for tensor, array in zip(got, expected):
        assert tensor.dtype == torch.int64 and np.array_equal(tensor.numpy(), array)
    if workers:  # copied out of a shared slot into a tensor of the training process's own
        assert not got[0].is_shared()


def test_len_is_the_batches_of_the_run(numbered: streampack.Cache) -> None:
    seqs = numbered.sequences(SEQ_LEN)
    loader = Loader(seqs, batch_size=4, world_size=2, seed=3, drop_last=False, epochs=2)
    data = DataLoader(loader, num_workers=2)
    assert len(data) == len(loader) == -(-2 * NUM_SAMPLES // 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert len(list(data)) == len(data)  # two epochs, and torch does not warn of a wrong length
    assert not [w for w in caught if "Length of IterableDataset" in str(w.message)]


def test_one_shared_tensor_per_batch_without_slots(numbered: streampack.Cache) -> None:
    seqs = numbered.sequences(SEQ_LEN)
    expected = list(Loader(seqs, batch_size=6, seed=3, epochs=1))
    got = list(DataLoader(Loader(seqs, batch_size=6, seed=3, epochs=1), num_workers=2, shared_slots=False))
    assert all(np.array_equal(tensor.numpy(), array) for tensor, array in zip(got, expected))
    assert got[0].is_shared()  # built in shared memory by the worker: sending it moves no tokens


def test_an_overwritten_slot_is_detected(numbered: streampack.Cache) -> None:
    loader = Loader(numbered.sequences(SEQ_LEN), batch_size=4, seed=3)
    ring = _SlotRing(loader, workers=1, per_worker=1)
    first = ring.put(loader, 0, 0)
    assert np.array_equal(ring.take(first, np.dtype(np.int64), pin=False).numpy(), loader.batch(0))
    ring.put(loader, 0, 4)  # reuses the only slot
    with pytest.raises(RuntimeError, match="overwritten before it was read"):
        ring.take(first, None, pin=False)


@pytest.mark.parametrize("persistent", [False, True])
def test_break_and_resume_continue_exactly(numbered: streampack.Cache, persistent: bool) -> None:
    seqs = numbered.sequences(SEQ_LEN)
    expected = sample_ids(list(Loader(seqs, batch_size=4, seed=5, epochs=2)))
    data = DataLoader(
        Loader(seqs, batch_size=4, seed=5, epochs=2), num_workers=2, persistent_workers=persistent
    )
    head = sample_ids(list(islice(data, 9)))  # the workers have prefetched more than this
    state = json.loads(json.dumps(data.state_dict()))
    assert state["position"] == 9 * 4
    middle = sample_ids(list(islice(data, 5)))  # the same DataLoader continues where it stopped
    assert head + middle == expected[:14]

    resumed = DataLoader(
        Loader(seqs, batch_size=4, seed=5, epochs=2), num_workers=2, persistent_workers=persistent
    )
    resumed.load_state_dict(state)
    assert sample_ids(list(resumed)) == expected[9:]
    data.load_state_dict(state)  # also on a DataLoader that already has (persistent) workers
    assert sample_ids(list(data)) == expected[9:]


@pytest.mark.parametrize("persistent", [False, True])
def test_load_state_dict_is_refused_while_an_iterator_runs(
    numbered: streampack.Cache, persistent: bool
) -> None:
    seqs = numbered.sequences(SEQ_LEN)
    expected = sample_ids(list(Loader(seqs, batch_size=4, seed=5, epochs=1)))
    data = DataLoader(
        Loader(seqs, batch_size=4, seed=5, epochs=1), num_workers=2, persistent_workers=persistent
    )
    start = data.state_dict()
    iterator = iter(data)
    head = sample_ids([next(iterator) for _ in range(3)])
    with pytest.raises(LoaderStateError, match="while an iterator over this DataLoader is running; call it "):
        data.load_state_dict(start)
    head += sample_ids([next(iterator)])  # the refused call changed nothing: state and batches agree
    checkpoint = data.state_dict()
    assert head == expected[:4] and checkpoint["position"] == 4 * 4
    iterator.close()
    data.load_state_dict(start)
    assert sample_ids(list(data)) == expected
    for step, _ in enumerate(data):  # leaving a loop with break ends its iterator
        if step == 6:
            break
    data.load_state_dict(checkpoint)
    assert sample_ids(list(data)) == expected[4:]


def test_spawned_workers_reopen_the_cache(numbered: streampack.Cache) -> None:
    seqs = numbered.sequences(SEQ_LEN)
    expected = sample_ids(list(Loader(seqs, batch_size=5, seed=1, epochs=1)))
    loader = Loader(seqs, batch_size=5, seed=1, epochs=1)
    loader.advance(3)
    data = DataLoader(loader, num_workers=2, multiprocessing_context="spawn")
    assert sample_ids(list(data)) == expected[3:]


def test_dict_and_cache_dtype_outputs_through_workers(numbered: streampack.Cache) -> None:
    seqs = numbered.sequences(SEQ_LEN)
    batch = next(iter(DataLoader(Loader(seqs, batch_size=4, output="dict", epochs=1), num_workers=2)))
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert all(value.dtype == torch.int64 and value.shape == (4, SEQ_LEN) for value in batch.values())
    starts = batch["position_ids"] == 0
    assert (batch["labels"][starts] == -100).all() and torch.equal(
        batch["labels"][~starts], batch["input_ids"][~starts]
    )
    varlen = next(iter(DataLoader(Loader(seqs, batch_size=4, output="varlen", epochs=1), num_workers=2)))
    assert varlen["cu_seqlens"].dtype == torch.int32 and int(varlen["cu_seqlens"][-1]) == 4 * SEQ_LEN
    assert isinstance(varlen["max_seqlen"], int) and torch.equal(varlen["labels"], batch["labels"])
    raw_loader = Loader(seqs, batch_size=4, dtype=None, epochs=1)
    raw = next(iter(DataLoader(raw_loader, num_workers=2, pin_memory=True)))
    assert raw.dtype == torch.uint16 and raw.shape == (4, SEQ_LEN)


def test_plain_torch_dataloader_over_the_iterable_dataset(numbered: streampack.Cache) -> None:
    seqs = numbered.sequences(SEQ_LEN)
    dataset = IterableDataset(Loader(seqs, batch_size=10, seed=2, epochs=1))
    got = list(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2))
    assert sample_ids(got) == sample_ids(list(Loader(seqs, batch_size=10, seed=2, epochs=1)))
    assert "IterableDataset(Loader(" in repr(dataset)


def test_batching_arguments_are_refused(numbered: streampack.Cache) -> None:
    loader = Loader(numbered.sequences(SEQ_LEN), batch_size=4)
    with pytest.raises(
        ValueError, match=r"takes no batch_size= \(got batch_size=8\); set batch_size"
    ) as refused:
        DataLoader(loader, batch_size=8)
    assert isinstance(refused.value, OptionsError)  # the one type of a wrong argument, a ValueError
    with pytest.raises(ValueError, match="takes no shuffle="):
        DataLoader(loader, shuffle=True)


def test_map_style_dataset_with_workers(numbered: streampack.Cache) -> None:
    seqs = numbered.sequences(SEQ_LEN, overlap=1)
    dataset = Dataset(seqs)
    assert len(dataset) == len(seqs) and dataset[7].dtype == torch.int64
    assert torch.equal(dataset[7], torch.from_numpy(seqs[7].astype(np.int64)))
    data = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=False, num_workers=2)
    rows = torch.cat(list(data))
    assert torch.equal(rows, torch.from_numpy(seqs[: len(seqs)].astype(np.int64)))
    assert Dataset(seqs, dtype=torch.int32)[7].dtype == torch.int32
    for narrow in (torch.int16, torch.uint8, torch.float32):
        with pytest.raises(ValueError, match=rf"dtype={narrow} cannot hold every id of the cache's uint16"):
            Dataset(seqs, dtype=narrow)


_TORCHRUN_SCRIPT = """
import json, sys
import torch.distributed as dist
import streampack
from streampack.loader import Loader
from streampack.torch import DataLoader, rank_and_world_size

dist.init_process_group("gloo")
rank, world = rank_and_world_size()
loader = Loader(
    streampack.open(sys.argv[1]).sequences(8), batch_size=6, seed=4, rank=rank, world_size=world,
    drop_last=False, epochs=1,
)
mine = [batch[:, 0].tolist() for batch in DataLoader(loader, num_workers=2, persistent_workers=True)]
everyone = [None] * world
dist.all_gather_object(everyone, mine)
if rank == 0:
    with open(sys.argv[2], "w") as f:
        json.dump(everyone, f)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_torchrun_ranks_with_workers_consume_an_epoch_once(
    numbered: streampack.Cache, tmp_path: Path
) -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this Python")
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(_TORCHRUN_SCRIPT))
    out = tmp_path / "seen.json"
    subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", str(script), str(numbered.root), str(out)],
        check=True,
        timeout=120,
        capture_output=True,
    )
    per_rank = json.loads(out.read_text())
    assert len(per_rank) == 2 and len(per_rank[0]) == len(per_rank[1]) == -(-NUM_SAMPLES // 6)
    everything = sorted(i for batches in per_rank for batch in batches for i in batch)
    assert everything == list(range(NUM_SAMPLES))


def test_cli_bench_with_workers_reports_each_worker(numbered: streampack.Cache) -> None:
    args = ["--seq-len", "8", "--batch-size", "4", "--loader-workers", "2"]
    out = run_cli("bench", numbered.root, *args).stdout
    memory = next(line for line in out.splitlines() if line.startswith("memory"))
    assert memory.count(" MB") == 3, out  # the main process and two workers


def _source_losses_on_rank(rank: int, world: int, address: str, out: str) -> None:
    """One rank of a gloo group: rank 0 adds a row of source 0, rank 1 rows of sources 0 and 1."""
    import torch.distributed as dist

    from streampack.torch import SourceLosses

    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world)
    try:
        counted = SourceLosses(("web", "code"))
        labels = torch.tensor([[-100, 5, 5, -100]] * (rank + 1))
        losses = torch.tensor([[0.0, 1.0, 3.0, 0.0]] * (rank + 1)) * (rank + 1)
        counted.add(losses, labels, torch.tensor([0, 1][: rank + 1]))
        Path(out, f"{rank}.json").write_text(json.dumps(counted.report()))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_source_losses_are_summed_over_the_ranks_of_a_real_process_group(tmp_path: Path) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_source_losses_on_rank, args=(2, f"tcp://127.0.0.1:{port}", str(tmp_path)), nprocs=2)
    reports = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    # web: rank 0's 2 tokens (loss 1 + 3) and rank 1's (2 + 6); code: rank 1's (2 + 6).
    assert reports[0] == reports[1] == {"loss/web": 12 / 4, "loss/code": 8 / 2}


def test_token_losses_are_each_labels_cross_entropy_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import streampack.torch as adapter

    torch.manual_seed(0)
    logits, labels = torch.randn(3, 10, 13), torch.randint(0, 13, (3, 10))
    labels[0, 4] = labels[2, 9] = -100
    whole = adapter.token_losses(logits, labels)
    monkeypatch.setattr(adapter, "_LOSS_CHUNK", 7 * 13)  # chunks of 7 tokens, across rows
    chunked = adapter.token_losses(logits, labels)
    plain = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 13), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="none"
    ).view(3, 9)
    assert torch.equal(whole, chunked) and whole.shape == labels.shape
    assert torch.allclose(whole[:, 1:], plain) and not whole[:, 0].any() and whole[0, 4] == whole[2, 9] == 0

"""What identifies another format's files (`streampack.reader.foreign.identity`): what they hold, so that
files rewritten in place with the same counts get a fresh plan, a loader state saved over other files with the
same counts is refused, and a DataLoader worker that finds the files changed refuses to read them; while the
same files copied elsewhere (another path, other modification times) keep their identity.

The files are each format's export of two real caches (the same GPT-2 documents, in two orders), written
over one another in place as a rerun of ``prepare.py`` (nanoGPT), of a datatrove tokenization with
``shuffle_documents``, or of any exporter would.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import zstandard

import streampack
from streampack.errors import CacheError, LoaderStateError
from streampack.samples.layout import Bins
from tests.conftest import SAMPLE_CORPUS, write_jsonl

EOT = 50256
SEQ_LEN = 512

#: Each format's export, and what opening it is told.
FORMATS: dict[str, dict[str, int]] = {
    "nanogpt": {"eos_id": EOT},
    "llmc": {},
    "datatrove": {"eos_id": EOT},
    "olmo": {},
    "mds": {"eos_id": EOT},
    "megatron": {"eos_id": EOT},
}


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory, gpt2_tokenizer: Path) -> tuple[streampack.Cache, ...]:
    """Two one-shard caches of the same 300 real documents (GPT-2, EOS appended): in order, and shuffled."""
    if not SAMPLE_CORPUS.exists():
        pytest.skip(f"sample corpus not found at {SAMPLE_CORPUS}")
    root = tmp_path_factory.mktemp("orders")
    lines = zstandard.ZstdDecompressor().stream_reader(SAMPLE_CORPUS.open("rb")).read().decode().splitlines()
    records = [json.loads(line) for line in lines[:300]]
    shuffled = records[:]
    random.Random(0).shuffle(shuffled)
    made = []
    for name, order in (("a", records), ("b", shuffled)):
        src = write_jsonl(root / f"{name}.jsonl", order)
        streampack.build(src, root / name, tokenizer=str(gpt2_tokenizer))
        made.append(streampack.open(root / name))
    assert all(c.num_shards == 1 for c in made) and made[0].num_tokens == made[1].num_tokens
    return tuple(made)


def exported(cache: streampack.Cache, format: str, folder: Path, **options: object) -> Path:
    """``cache`` exported to ``folder``; the path to open (a Megatron pair's prefix)."""
    dest = folder / "corpus" if format == "megatron" else folder
    cache.export(format, dest, progress=False, **options)
    return dest


def rewrite_in_place(source: Path, folder: Path) -> None:
    """Every file of ``source`` written over the file of the same name in ``folder``: opened for writing and
    truncated, as a rerun of an exporter writes it (same path and inode, new bytes)."""
    for path in source.iterdir():
        if path.is_file():
            shutil.copyfile(path, folder / path.name)


def rows(samples: streampack.PackedSequences) -> np.ndarray:
    return np.asarray(samples[np.arange(len(samples))])


@pytest.mark.slow
@pytest.mark.parametrize("format", FORMATS)
def test_a_plan_of_files_rewritten_in_place_with_the_same_counts_is_made_again(
    format: str, caches: tuple[streampack.Cache, ...], tmp_path: Path
) -> None:
    """The plan stored beside the files (``layouts/``) is not used once they hold other documents, though
    as many: the samples are those a fresh plan of the new files serves, every document whole."""
    declared = FORMATS[format]
    old = exported(caches[0], format, tmp_path / "a")
    new = exported(caches[1], format, tmp_path / "b")
    shutil.copytree(tmp_path / "a", tmp_path / "p")
    opened = tmp_path / "p" / old.relative_to(tmp_path / "a")
    before = streampack.open(opened, **declared)
    first = before.packed(SEQ_LEN)
    # Stored in the folder, where the next open looks (a Megatron prefix has no folder: kept in memory).
    assert (first.layout.directory is None) == (format == "megatron")
    rewrite_in_place(new.parent if format == "megatron" else new, tmp_path / "p")
    after = streampack.open(opened, **declared)
    assert after.table == before.table  # the counts alone do not tell the files apart
    assert after.content_digest != before.content_digest
    served = after.packed(SEQ_LEN)
    assert served.layout.directory != first.layout.directory or format == "megatron"
    shutil.rmtree(tmp_path / "p" / "layouts", ignore_errors=True)
    np.testing.assert_array_equal(rows(served), rows(streampack.open(opened, **declared).packed(SEQ_LEN)))
    assert pieces(served.layout) == documents_cut(after, SEQ_LEN)


def pieces(plan: Bins) -> list[tuple[int, int, int]]:
    """The (shard, first token, end) of each piece a plan serves, in token order."""
    return sorted(zip(plan.shards.tolist(), plan.lo.tolist(), (plan.lo + plan.lengths).tolist()))


def documents_cut(cache: streampack.Cache, seq_len: int) -> list[tuple[int, int, int]]:
    """Each document of ``cache`` as a piece, a longer one cut every ``seq_len`` tokens (as "split" does)."""
    cut = []
    for shard in range(cache.num_shards):
        ends = cache.shard_offsets(shard).tolist()
        for start, end in zip([0, *ends[:-1]], ends):
            cut += [(shard, lo, min(lo + seq_len, end)) for lo in range(start, end, seq_len)]
    return cut


@pytest.mark.parametrize(
    ("format", "options", "declared"),
    [("nanogpt", {}, {"eos_id": EOT}), ("mds", {"seq_len": 64}, {})],
    ids=["documents-reordered", "windows-of-one-length-reordered"],
)
def test_a_state_saved_over_one_folder_is_refused_over_another_with_the_same_counts(
    format: str,
    options: dict[str, int],
    declared: dict[str, int],
    caches: tuple[streampack.Cache, ...],
    tmp_path: Path,
) -> None:
    """Another folder holding as many documents and tokens (MDS windows: even the same document ends) is
    other data: the state is refused naming both digests. A copy of the saved-over folder (another path,
    other modification times) is the same data: the state resumes over it."""
    a = streampack.open(exported(caches[0], format, tmp_path / "a", **options), **declared)
    b = streampack.open(exported(caches[1], format, tmp_path / "b", **options), **declared)
    assert a.table == b.table
    saved = streampack.Loader(a.sequences(SEQ_LEN), batch_size=4, seed=1)
    batches = iter(saved)
    next(batches)
    state = saved.state_dict()
    other = streampack.Loader(b.sequences(SEQ_LEN), batch_size=4, seed=1)
    refused = (
        rf"data in checkpoint: .*'shards': '{a.content_digest}'.* / data in this loader: .*'shards': "
        rf"'{b.content_digest}'.*Only the data's content digest differs"
    )
    with pytest.raises(LoaderStateError, match=refused):
        other.load_state_dict(state)
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    for path in (tmp_path / "copy").iterdir():
        os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    copy = streampack.open(tmp_path / "copy", **declared)
    assert copy.content_digest == a.content_digest
    resumed = streampack.Loader(copy.sequences(SEQ_LEN), batch_size=4, seed=1)
    resumed.load_state_dict(state)
    np.testing.assert_array_equal(next(iter(resumed)), next(batches))


@pytest.mark.slow
def test_a_dataloader_worker_refuses_files_changed_since_its_parent_opened_them(
    caches: tuple[streampack.Cache, ...], tmp_path: Path
) -> None:
    """A worker process reopens the files: rewritten meanwhile with as many documents, they are refused
    (the samples' indices no longer mean the same tokens), naming the folder."""
    torch_data = pytest.importorskip("streampack.torch", reason="the DataLoader part needs torch")
    old = exported(caches[0], "nanogpt", tmp_path / "p")
    new = exported(caches[1], "nanogpt", tmp_path / "b")
    loader = streampack.Loader(streampack.open(old, eos_id=EOT).packed(SEQ_LEN), batch_size=4, seed=1)
    rewrite_in_place(new, old)
    workers = torch_data.DataLoader(loader, num_workers=1, multiprocessing_context="spawn")
    with pytest.raises(CacheError, match=rf"{old}: the cache changed on disk since these samples were made"):
        next(iter(workers))


def test_a_file_removed_after_the_open_read_it_is_named(tmp_path: Path) -> None:
    """The identity reads each file's first and last bytes: a file gone by then is a CacheError naming it."""
    from streampack.reader.foreign.identity import files_identity

    with pytest.raises(CacheError, match=rf"{tmp_path / 'gone.bin'}: cannot be read .*open them again"):
        files_identity([], [tmp_path / "gone.bin"])


def test_the_identity_of_a_scanned_file_is_the_same_past_the_ends_an_open_keeps(
    caches: tuple[streampack.Cache, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each shard's ends digest is taken from its scan at open: the same whether the ends are kept or would
    be scanned again when read (past ``KEPT_ENDS_BYTES``), so a large file is scanned once for it."""
    from streampack.reader.foreign import scanning

    folder = exported(caches[0], "nanogpt", tmp_path / "ng")
    kept = streampack.open(folder, eos_id=EOT).content_digest
    monkeypatch.setattr(scanning, "KEPT_ENDS_BYTES", 0)
    assert streampack.open(folder, eos_id=EOT).content_digest == kept

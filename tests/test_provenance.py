"""streampack.which: every document of a step's batch traced to the input record that holds its text.

Each test builds a real cache from real files with a real tokenizer, asks which documents a step read,
then reads the record at each reported location *without streampack* (json, gzip, pyarrow), tokenizes
its text again and compares it with the document in the cache; and checks that each reported run of
tokens is what the rank's loader really served there.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import streampack
from streampack import Loader, Mixture
from streampack.errors import InputError, OptionsError
from streampack.loader import Exclusions
from streampack.runs.provenance import Provenance, position_of
from streampack.tokenizer import load_tokenizer
from tests.conftest import run_cli, write_bytes, write_jsonl

MakeLoader = Callable[..., Loader]


def record_text(doc: Provenance, documents: Sequence[Any] | None = None) -> str:
    """The text of the record at ``doc``'s location, read with the standard library and pyarrow only."""
    if doc.path.startswith("python:"):
        assert documents is not None and doc.row is not None
        item = documents[doc.row]
        return item if isinstance(item, str) else item["text"]
    path = Path(doc.path)
    if path.suffix == ".parquet":
        assert doc.row is not None
        return pq.read_table(path, columns=["text"]).column("text")[doc.row].as_py()
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if doc.line is None:  # a whole text file
        return data.removeprefix(b"\xef\xbb\xbf").decode()
    line = data.split(b"\n")[doc.line - 1]
    if ".jsonl" in path.name:
        return json.loads(line)["text"]
    return line.decode().rstrip("\r")


def check_step(
    make: MakeLoader,
    step: int | None,
    *,
    world_size: int = 2,
    state: dict[str, Any] | None = None,
    documents: Any = None,
    texts: Sequence[Any] | None = None,
) -> list[Provenance]:
    """Run ``which`` on a step and check every answer against the files and the ranks' real batches."""
    loader = make(rank=0, world_size=world_size)
    found = streampack.which(loader, step, state=state, documents=documents)
    position = position_of(loader, step, state=state)
    batches = []
    for rank in range(world_size):
        ranked = make(rank=rank, world_size=world_size)
        if state is not None:
            ranked.load_state_dict(state)
        batch = ranked.batch(position)
        batches.append(batch["input_ids"] if isinstance(batch, dict) else batch)
    overlap = getattr(loader.sources[0].data, "overlap", 0)
    inputs = sum(len(b) * (b.shape[1] - overlap) for b in batches)  # rows as served: of seq_len + overlap
    assert sum(doc.tokens for doc in found) == inputs  # every input column once
    tokenizers: dict[str, Any] = {}
    for doc in found:
        cache = streampack.open(doc.cache)
        spec = cache.manifest.tokenizer.spec
        tokenizer = tokenizers.setdefault(spec, load_tokenizer(spec))
        tokens = cache.doc(doc.doc)
        assert doc.length == len(tokens)
        text = record_text(doc, texts)
        assert tokenizer.encode_batch([text])[0].tolist() == tokens[:-1].tolist(), doc.location
        for placed in doc.placements:
            served = batches[placed.rank][placed.row, placed.columns[0] : placed.columns[1]]
            assert served.tolist() == tokens[placed.tokens[0] : placed.tokens[1]].tolist(), doc
    return found


def every_step(make: MakeLoader, **kwargs: Any) -> list[Provenance]:
    """Check every step of the first epoch; return all the documents found."""
    found = []
    for step in range(make().steps_per_epoch):
        found += check_step(make, step, **kwargs)
    return found


def loader_of(cache: Path, seq_len: int, batch_size: int, **options: Any) -> MakeLoader:
    seqs = streampack.open(cache).sequences(seq_len)
    return lambda **more: Loader(seqs, batch_size=batch_size, **options, **more)


def build(inputs: Any, out: Path, tokenizer: Path, **options: Any) -> Path:
    options.setdefault("on_bad_record", "skip")
    streampack.build(inputs, out, tokenizer=str(tokenizer), progress=False, **options)
    return out


def doc_text(i: int) -> str:
    return f"Document {i}: the quick brown fox jumps over {i % 7} lazy dogs. " * (1 + i % 4)


# A JSONL file with every kind of record that makes no document, between real ones.
NOT_DOCUMENTS = [b"", b'{"text": ""}', b'{"text": "  \\n\\t "}', b"not json at all", b'{"text": 3}', b"[1]"]


def jsonl_with_gaps(count: int) -> bytes:
    lines = []
    for i in range(count):
        lines.append(json.dumps({"text": doc_text(i), "id": i}).encode())
        if i % 3 == 1:
            lines.append(NOT_DOCUMENTS[i // 3 % len(NOT_DOCUMENTS)])
    return b"\n".join(lines) + b"\n"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["in.jsonl", "in.jsonl.gz"])
def test_jsonl_lines_past_blank_lines_empty_documents_and_skipped_records(
    tmp_path: Path, bpe_tokenizer: Path, name: str
) -> None:
    src = write_bytes(tmp_path / name, jsonl_with_gaps(60))
    cache = build(src, tmp_path / "c", bpe_tokenizer)
    manifest = streampack.open(cache).manifest
    assert (manifest.skipped_records, manifest.empty_docs) == (9, 7)  # and 4 blank lines
    found = every_step(loader_of(cache, 16, 8, seed=3))
    assert {doc.path for doc in found} == {str(src)}
    assert max(doc.line or 0 for doc in found) > 60  # past many gaps: lines are not document numbers


def test_a_big_jsonl_file_split_into_byte_ranges(tmp_path: Path, bpe_tokenizer: Path) -> None:
    src = write_bytes(tmp_path / "big.jsonl", jsonl_with_gaps(2400))
    assert src.stat().st_size > 4 * 65536
    cache = build(src, tmp_path / "c", bpe_tokenizer, unit_bytes=65536)
    units = streampack.open(cache).manifest.units
    assert len(units) >= 4 and units[1].endswith(f"[bytes 65536:{2 * 65536}]")
    make = loader_of(cache, 64, 16, seed=1)
    found = [doc for step in range(4) for doc in check_step(make, step)]
    assert len({doc.unit for doc in found}) >= 3 and max(doc.unit for doc in found) > 0


@pytest.mark.slow
def test_a_run_of_small_files_jsonl_gz_and_whole_text_files(tmp_path: Path, bpe_tokenizer: Path) -> None:
    data = tmp_path / "data"
    write_bytes(data / "01.jsonl", jsonl_with_gaps(12))
    write_bytes(data / "02.txt", "\ufeffA whole file is one document.\nIts second line.\n".encode())
    write_bytes(data / "03.txt", b"")  # empty: no document
    write_bytes(data / "04.txt", b"invalid \xc3\x28 UTF-8")  # a bad record, skipped
    write_bytes(data / "05.txt", doc_text(5).encode())
    write_bytes(data / "06.jsonl.gz", jsonl_with_gaps(9))
    cache = build(data, tmp_path / "c", bpe_tokenizer)
    assert len(streampack.open(cache).manifest.units) == 1  # one run of six files
    found = every_step(loader_of(cache, 8, 4, seed=0))
    assert {Path(doc.path).name for doc in found} == {"01.jsonl", "02.txt", "05.txt", "06.jsonl.gz"}
    assert {doc.line for doc in found if doc.path.endswith(".txt")} == {None}


def test_text_files_one_document_per_line(tmp_path: Path, bpe_tokenizer: Path) -> None:
    lines = [doc_text(i) if i % 4 else "   " for i in range(40)]
    src = write_bytes(tmp_path / "lines.txt", ("\n\n".join(lines) + "\r\n").encode())
    cache = build(src, tmp_path / "c", bpe_tokenizer, split_lines=True)
    found = every_step(loader_of(cache, 16, 4, shuffle=False), world_size=1)
    assert {doc.line for doc in found} >= {3, 79}  # blank lines between the documents count


@pytest.mark.slow
def test_parquet_rows_across_row_group_units(tmp_path: Path, bpe_tokenizer: Path) -> None:
    texts = [None if i % 17 == 3 else "" if i % 13 == 5 else doc_text(i) for i in range(2000)]
    src = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": list(range(2000)), "text": texts}), src, row_group_size=200)
    cache = build(src, tmp_path / "c", bpe_tokenizer, unit_bytes=65536)
    assert len(streampack.open(cache).manifest.units) > 2
    make = loader_of(cache, 128, 8, seed=5)
    found = [doc for step in range(0, 40, 9) for doc in check_step(make, step)]
    assert max(doc.unit for doc in found) > 0 and max(doc.row or 0 for doc in found) > 400


@pytest.mark.slow
def test_python_documents(tmp_path: Path, bpe_tokenizer: Path) -> None:
    clean = [doc_text(i) for i in range(50)]
    cache = build(streampack.Documents(clean), tmp_path / "clean", bpe_tokenizer)
    found = every_step(loader_of(cache, 16, 4), texts=clean)  # every record is a document: rows known
    assert found[0].path == "python:list" and found[0].location == f"python:list[{found[0].row}]"

    gappy = [{"text": doc_text(i)} if i % 5 else {"text": ""} for i in range(50)]
    cache = build(streampack.Documents(gappy), tmp_path / "gappy", bpe_tokenizer)
    make = loader_of(cache, 16, 4)
    assert {doc.row for doc in streampack.which(make(), 0)} == {None}  # unknown without the documents
    every_step(make, documents=streampack.Documents(gappy), texts=gappy)
    with pytest.raises(InputError, match=r"the documents given make other work units.*python:list"):
        streampack.which(make(), 0, documents=gappy * 2)


@pytest.mark.slow
def test_mixture_rows_name_their_source(tmp_path: Path, bpe_tokenizer: Path) -> None:
    web = build(write_bytes(tmp_path / "web.jsonl.gz", jsonl_with_gaps(40)), tmp_path / "web", bpe_tokenizer)
    src = tmp_path / "code.parquet"
    pq.write_table(pa.table({"text": [f"def f{i}(): return {i}\n" * 3 for i in range(80)]}), src)
    code = build(src, tmp_path / "code", bpe_tokenizer)
    sources = {"web": streampack.open(web).sequences(16), "code": streampack.open(code).sequences(16)}
    mix = Mixture(sources, {"web": 0.5, "code": 0.5}, seed=2, block_size=8)
    make: MakeLoader = lambda **more: Loader(mix, batch_size=8, **more)  # noqa: E731
    found = [doc for step in range(6) for doc in check_step(make, step)]
    assert {(doc.source, Path(doc.cache).name) for doc in found} == {("web", "web"), ("code", "code")}
    run = make()
    for _ in zip(range(3), run):
        pass
    reweighted = Mixture(sources, {"web": 0.25, "code": 0.75}, seed=2, block_size=8)
    make = lambda **more: Loader(reweighted, batch_size=8, **more)  # noqa: E731
    check_step(make, 2, state=run.state_dict())  # resumed with new weights: the state's schedule counts


def test_a_step_of_a_resumed_state(tmp_path: Path, bpe_tokenizer: Path) -> None:
    cache = build(write_bytes(tmp_path / "in.jsonl", jsonl_with_gaps(80)), tmp_path / "c", bpe_tokenizer)
    make = loader_of(cache, 16, 4, seed=7)
    run = make()
    for _ in zip(range(5), run):
        pass
    state = json.loads(json.dumps(run.state_dict()))
    assert check_step(make, None, state=state) == check_step(make, 5)
    assert check_step(make, 3, state=state) == check_step(make, 8)
    # The run resumed at batch size 8: its second step after the state is at position 5 * 4 + 8.
    bigger = loader_of(cache, 16, 8, seed=7)
    assert position_of(bigger(), 1, state=state) == 28
    check_step(bigger, 1, state=state)
    # A loader that resumed from the state counts steps from the start of the run.
    resumed = make()
    resumed.load_state_dict(state)
    assert streampack.which(resumed) == streampack.which(resumed, 5) == check_step(make, 5, world_size=1)
    assert resumed.position == 20  # which() left it as it was


def test_placements_under_a_seq_len_schedule_are_in_the_rows_served(
    tmp_path: Path, bpe_tokenizer: Path
) -> None:
    """Units of 64 served as sub-windows of 16, then of 32, then whole: each placement is the row and
    columns of the batch served (check_step), a document across sub-windows in a run for each."""
    cache = build(write_bytes(tmp_path / "in.jsonl", jsonl_with_gaps(150)), tmp_path / "c", bpe_tokenizer)
    seqs = streampack.open(cache).sequences(64, overlap=1)
    schedule = [(0, 16), (64 * 8 * 2, 32), (64 * 8 * 4, 64)]
    options = {"batch_size": 8, "seed": 1, "seq_len_schedule": schedule}
    make: MakeLoader = lambda **more: Loader(seqs, **options, **more)  # noqa: E731
    for step, rows in ((0, 16), (1, 16), (2, 8), (4, 4)):
        found = check_step(make, step)
        assert make(rank=1, world_size=2).batch_shape(step * 8) == (rows, 64 // (rows // 4) + 1)
        assert max(p.row for doc in found for p in doc.placements) == rows - 1
        # a document's run through a unit is cut into one run per sub-window it reaches
        split = [doc for doc in found if len({(p.rank, p.row // (rows // 4)) for p in doc.placements}) == 1]
        assert rows == 4 or any(len(doc.placements) > 1 for doc in split)


def test_placements_of_a_resume_at_a_longer_seq_len_are_in_the_joined_rows(
    tmp_path: Path, bpe_tokenizer: Path
) -> None:
    """A checkpoint of windows of 16 resumed at 64: four of its units a row, each placement in them."""
    cache = build(write_bytes(tmp_path / "in.jsonl", jsonl_with_gaps(150)), tmp_path / "c", bpe_tokenizer)
    run = loader_of(cache, 16, 16, seed=4)(rank=0, world_size=2)
    for _ in zip(range(3), run):
        pass
    state = run.state_dict()
    longer = loader_of(cache, 64, 4, seed=4, output="dict")  # joins need labels to mask them
    for step in range(3):
        found = check_step(longer, step, state=state)
        assert {p.row for doc in found for p in doc.placements} == {0, 1}  # 8 units a rank, 2 rows of 64
        assert max(p.columns[1] for doc in found for p in doc.placements) == 64


def test_which_of_a_resume_at_another_seq_len_with_a_mask_exclusion(
    tmp_path: Path, bpe_tokenizer: Path
) -> None:
    """The view ``which`` reads a run through keeps its output: a loader of sub-windows resuming units of
    another length with a mask exclusion (which needs labels) is traced, not refused."""
    cache = build(write_bytes(tmp_path / "in.jsonl", jsonl_with_gaps(60)), tmp_path / "c", bpe_tokenizer)
    masked = Exclusions(documents=[3], mode="mask", at=0)
    first = loader_of(cache, 32, 4, seed=2, output="dict", exclude=[masked])()
    first.advance(2)
    state = first.state_dict()
    shorter = loader_of(cache, 16, 8, seed=2, output="dict", exclude=[masked])
    check_step(shorter, 0, world_size=1, state=state)


def test_inputs_moved_or_changed_are_refused(tmp_path: Path, bpe_tokenizer: Path) -> None:
    src = write_bytes(tmp_path / "in.jsonl", jsonl_with_gaps(30))
    cache = build(src, tmp_path / "c", bpe_tokenizer)
    loader = loader_of(cache, 16, 4)()
    src.write_bytes(src.read_bytes().replace(b"Document 0:", b"Document 0 "))  # same size, new mtime
    with pytest.raises(InputError, match=r"in\.jsonl: changed since the cache was built"):
        streampack.which(loader, 0)
    src.unlink()
    with pytest.raises(InputError, match=r"its input files are needed .*in\.jsonl"):
        streampack.which(loader, 0)
    a, b = (write_bytes(tmp_path / "two" / f"{x}.jsonl", jsonl_with_gaps(20)) for x in "ab")
    loader = loader_of(build([a, b], tmp_path / "c2", bpe_tokenizer), 16, 4)()
    b.unlink()
    b.symlink_to(a)  # read once only now
    with pytest.raises(InputError, match=r"its input 1 is '\S+b\.jsonl', but that path now reads as none"):
        streampack.which(loader, 0)


def test_what_has_no_documents_or_no_batch_is_refused(tmp_path: Path, bpe_tokenizer: Path) -> None:
    with pytest.raises(TypeError, match="source 'data' is a ndarray"):
        streampack.which(Loader(np.zeros((8, 4), dtype=np.int64), batch_size=4), 0)
    cache = build(
        write_jsonl(tmp_path / "in.jsonl", [{"text": doc_text(i)} for i in range(9)]),
        tmp_path / "c",
        bpe_tokenizer,
    )
    loader = loader_of(cache, 16, 4, epochs=1)()
    with pytest.raises(IndexError, match="no batch at position"):
        streampack.which(loader, loader.steps_per_epoch)
    with pytest.raises(OptionsError, match=r"step must be an integer in \[0, 2\*\*62\] \(got step=-1\)"):
        streampack.which(loader, -1)


@pytest.mark.slow
def test_cli_which_prints_the_table_and_json(tmp_path: Path, bpe_tokenizer: Path) -> None:
    src = write_bytes(tmp_path / "in.jsonl", jsonl_with_gaps(60))
    cache = build(src, tmp_path / "c", bpe_tokenizer)
    make = loader_of(cache, 16, 8, seed=4)
    settings = ["--seq-len", "16", "--batch-size", "8", "--seed", "4", "--world-size", "2"]
    shown = json.loads(run_cli("which", cache, *settings, "--step", "3", "--json").stdout)
    expected = check_step(make, 3)
    assert shown["position"] == 24
    assert [(d["doc"], d["location"], d["tokens"]) for d in shown["documents"]] == [
        (d.doc, d.location, d.tokens) for d in expected
    ]
    table = run_cli("which", cache, *settings, "--step", "3").stdout
    assert f"{expected[0].location}\n" in table and "rank:row[columns]" in table
    run = make(world_size=2)
    for _ in zip(range(2), run):
        pass
    state = tmp_path / "state.json"
    state.write_text(json.dumps(run.state_dict()))  # batch size 8 and world size 2 come from it
    by_state = run_cli("which", cache, "--seq-len", "16", "--seed", "4", "--state", state, "--step", "1")
    assert by_state.stdout == table
    accumulating = make(world_size=2)
    accumulating.batches_per_step = 2  # as the trainer adapters set it
    next(iter(accumulating))
    state.write_text(json.dumps(accumulating.state_dict()))
    noted = run_cli("which", cache, "--seq-len", "16", "--seed", "4", "--state", state, "--step", "5").stdout
    assert "note: the trainer took 2 batches a step: --step counts batches, so this is batch 2 of 2 " in noted
    missing = run_cli("which", cache, "--seq-len", "16", "--batch-size", "8", check=False)
    assert missing.returncode == 2 and "give --step N" in missing.stderr


@pytest.mark.slow
def test_cli_which_reads_a_mixture_config(tmp_path: Path, bpe_tokenizer: Path) -> None:
    for name in ("web", "books"):
        build(write_bytes(tmp_path / f"{name}.jsonl", jsonl_with_gaps(30)), tmp_path / name, bpe_tokenizer)
    config = tmp_path / "mix.json"
    config.write_text(
        json.dumps(
            {
                "seq_len": 16,
                "sources": {"web": "web", "books": "books"},
                "weights": {"web": 1, "books": 1},
                "block_size": 4,
            }
        )
    )
    shown = run_cli("which", config, "--batch-size", "4", "--step", "2")
    assert "source" in shown.stdout and "books" in shown.stdout and "web.jsonl:" in shown.stdout
    # The settings a script passes for a cache are accepted where they agree with the config's own.
    agreeing = ("--seq-len", "16", "--seed", "0", "--overlap", "0")
    assert run_cli("which", config, "--batch-size", "4", "--step", "2", *agreeing).stdout == shown.stdout
    refused = run_cli(
        "which", config, "--batch-size", "4", "--step", "2", "--seed", "1", "--seq-len", "8", check=False
    )
    assert refused.returncode == 2
    said = " ".join(refused.stderr.split())
    assert "--seq-len 8 (the config has seq_len: 16); --seed 1 (the config has seed: 0)" in said
    assert "mix.json sets these itself" in said
    no_shuffle = run_cli("which", config, "--batch-size", "4", "--step", "2", "--no-shuffle", check=False)
    assert no_shuffle.returncode == 2 and "--no-shuffle (the config has shuffle: true)" in " ".join(
        no_shuffle.stderr.split()
    )
    mix = streampack.load_mixture(config)
    expected = streampack.which(Loader(mix, batch_size=4), 2)
    assert [line.split()[-1] for line in shown.stdout.splitlines()[2:]] == [d.location for d in expected]
    assert os.path.isdir(expected[0].cache)
    # A resume that changed the loss weights: a step from its state is of that leg, and says its weights.
    first = Loader(mix, batch_size=4, output="dict")
    first.advance(2)
    weighted = Loader(streampack.load_mixture(config), batch_size=4, output="dict", loss_weights={"books": 2})
    weighted.load_state_dict(first.state_dict())
    weighted.advance(1)
    states = {}
    for name, loader in (("plain", first), ("weighted", weighted)):
        states[name] = tmp_path / f"{name}.json"
        states[name].write_text(json.dumps(loader.state_dict()))
    at_step = ("--state", states["weighted"], "--step", "0")
    assert "loss weights: web 1, books 2 (the state's" in run_cli("which", config, *at_step).stdout
    as_json = json.loads(run_cli("which", config, *at_step, "--json").stdout)
    assert as_json["loss_weights"] == {"web": 1.0, "books": 2.0}
    assert "loss weights" not in run_cli("which", config, "--state", states["plain"], "--step", "0").stdout


# ------------------------------------------------------------------------------------------- SFT caches


def sft_lines(count: int) -> tuple[list[bytes], dict[int, dict[str, Any]]]:
    """JSONL lines of SFT records (``prompt``, ``response``), a third of them with a rendered ``text`` copy,
    between records that an SFT build leaves out though most hold a non-empty ``text``: a missing or
    non-string response (bad, skipped), fields that are empty or whitespace, and blank lines. Returns the
    lines and, by line number (from 1), the records that make a document."""
    lines, kept = [], {}
    for i in range(count):
        record: dict[str, Any] = {"prompt": f"Question {i}: what is {i} + {i}?", "response": f" {2 * i}."}
        if i % 3 == 0:
            record["text"] = record["prompt"] + record["response"]
        if i % 5 == 2:
            del record["response"]  # bad: skipped
        elif i % 7 == 3:
            record["response"] = i  # bad: not a string
        elif i % 11 == 4:
            record |= {"prompt": "", "response": "  \n"}  # empty: no document
        else:
            kept[len(lines) + 1] = record
        lines.append(json.dumps(record).encode())
        if i % 9 == 8:
            lines.append(b"")
    return lines, kept


def chat_lines(count: int) -> tuple[list[bytes], dict[int, dict[str, Any]]]:
    """As :func:`sft_lines`, for a chat build: conversations in ``messages``, a third of them with a
    ``text`` copy, between bad records (a turn whose content is not a string, no turns) and blank lines."""
    lines, kept = [], {}
    for i in range(count):
        turns: list[dict[str, Any]] = [
            {"role": "user", "content": f"Question {i}?"},
            {"role": "assistant", "content": f"Answer {i}."},
        ]
        record: dict[str, Any] = {"messages": turns}
        if i % 3 == 0:
            record["text"] = f"Question {i}? Answer {i}."
        if i % 5 == 2:
            turns[1]["content"] = i  # bad: not a string
        elif i % 7 == 3:
            record["messages"] = []  # bad: no conversation
        else:
            kept[len(lines) + 1] = record
        lines.append(json.dumps(record).encode())
        if i % 9 == 8:
            lines.append(b"")
    return lines, kept


def check_sft_epoch(
    cache: streampack.Cache, kept: dict[int, dict[str, Any]], tokens_of: Callable[[dict[str, Any]], list[int]]
) -> None:
    """Every document ``which`` finds in an epoch is traced to the line of the record it was built from:
    the ``k``-th record that made a document (``kept`` by line), whose tokens (``tokens_of``) it holds."""
    lines = sorted(kept)
    assert cache.num_docs == len(lines)
    make = loader_of(Path(cache.root), 16, 4, seed=3)
    seen = set()
    for step in range(make().steps_per_epoch):
        for doc in streampack.which(make(), step):
            assert doc.line == lines[doc.doc], doc
            assert cache.doc(doc.doc).tolist() == tokens_of(kept[doc.line]), doc
            seen.add(doc.doc)
    assert len(seen) > 0.9 * cache.num_docs


def test_sft_fields_records_are_traced_as_the_build_read_them(tmp_path: Path) -> None:
    """An SFT build reads its fields, not ``text``: records without ``text`` are found, and the records it
    left out (bad, empty fields, blank) are not counted as documents even where their ``text`` is not."""
    lines, kept = sft_lines(80)
    src = write_bytes(tmp_path / "sft.jsonl", b"\n".join(lines) + b"\n")
    out = tmp_path / "c"
    fields = ("--fields", "prompt,response", "--on-bad-record", "skip", "--tokenizer", "bytes")
    run_cli("build", src, "--out", out, *fields)
    cache = streampack.open(out)
    assert (cache.manifest.skipped_records, cache.manifest.empty_docs) == (25, 5)
    check_sft_epoch(cache, kept, lambda r: [*(r["prompt"] + r["response"]).encode(), 256])
    settings = ("--seq-len", "16", "--batch-size", "4", "--seed", "3", "--step", "0", "--json")
    shown = json.loads(run_cli("which", out, *settings).stdout)
    assert shown["documents"]
    assert [d["location"] for d in shown["documents"]] == [
        f"{src}:{sorted(kept)[d['doc']]}" for d in shown["documents"]
    ]


@pytest.mark.slow
def test_chat_records_are_traced_as_the_build_rendered_them(tmp_path: Path, gpt2_tokenizer: Path) -> None:
    """A chat build's records are read again with its chat template (found beside its tokenizer), and
    refused once that template changed, which may render them otherwise."""
    from tests.test_sft import CHATML, CHATML_TOKENS, chat_tokenizer, encoder, expected_chat, ids

    tokenizer = chat_tokenizer(gpt2_tokenizer, tmp_path / "tok", CHATML, CHATML_TOKENS)
    lines, kept = chat_lines(60)
    src = write_bytes(tmp_path / "chat.jsonl", b"\n".join(lines) + b"\n")
    out = tmp_path / "c"
    chat = ("--chat", "messages", "--tokenizer", tokenizer.parent, "--on-bad-record", "skip")
    run_cli("build", src, "--out", out, *chat)
    cache = streampack.open(out)
    assert cache.manifest.skipped_records == 60 - len(kept)
    parse, text = encoder(tokenizer, parse=True), encoder(tokenizer, parse=False)

    def chatml(record: dict[str, Any]) -> list[int]:  # expected_chat's tokens, with its encoders made once
        turns = [(f"<|im_start|>{m['role']}\n", m["content"]) for m in record["messages"]]
        made = [ids(parse, head) + ids(text, body) + ids(parse, "<|im_end|>\n") for head, body in turns]
        return [*(t for tokens in made for t in tokens), parse.token_to_id("<|endoftext|>")]

    first = kept[min(kept)]
    assert chatml(first) == expected_chat(tokenizer, CHATML, first["messages"])[0]
    check_sft_epoch(cache, kept, chatml)

    config = tokenizer.parent / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": CHATML.replace("\\n", " ")}))
    with pytest.raises(InputError, match=r"tokenizer_config\.json: its chat template has sha256 \w+, but"):
        streampack.which(loader_of(out, 16, 4)(), 0)

"""Exclusions naming documents by the input record they were built from (``path:line``, ``path[row]``, as
``streampack which`` reports them): each name finds the document ``which`` traced to it, through a real
cache of real files, split into several work units."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import streampack
from streampack import Loader
from streampack.errors import OptionsError
from streampack.loader import Exclusions
from streampack.loader.origins import documents_named
from tests.conftest import run_cli, write_bytes
from tests.test_provenance import chat_lines, doc_text, jsonl_with_gaps, sft_lines


def _build(inputs: object, out: Path, **options: object) -> streampack.Cache:
    streampack.build(inputs, out, tokenizer="bytes", progress=False, on_bad_record="skip", **options)
    return streampack.open(out)


def _traced(cache: streampack.Cache, steps: int) -> dict[str, int]:
    """``location -> doc`` of the documents ``which`` finds in the first steps of a run."""
    loader = Loader(cache.sequences(64), batch_size=8, seed=3)
    return {doc.location: doc.doc for step in range(steps) for doc in streampack.which(loader, step)}


def test_line_and_row_names_find_the_documents_which_reported(tmp_path: Path) -> None:
    src = write_bytes(tmp_path / "big.jsonl", jsonl_with_gaps(2400))
    cache = _build(src, tmp_path / "c", unit_bytes=65536)
    assert len(cache.manifest.units) >= 4
    traced = _traced(cache, 12)
    assert len({doc for doc in traced.values()}) > 20 and max(traced.values()) > cache.num_docs // 2
    assert documents_named(cache, list(traced)) == traced

    table = tmp_path / "t.parquet"
    texts = ["" if i % 13 == 5 else doc_text(i) for i in range(2000)]
    pq.write_table(pa.table({"text": texts}), table, row_group_size=200)
    rows = _build(table, tmp_path / "p", unit_bytes=65536)
    assert len(rows.manifest.units) > 2
    traced = _traced(rows, 8)
    assert any("[" in name for name in traced) and documents_named(rows, list(traced)) == traced


def test_a_loader_excludes_by_record_as_by_index_and_through_a_mixture_config(tmp_path: Path) -> None:
    src = write_bytes(tmp_path / "in.jsonl", jsonl_with_gaps(200))
    cache = _build(src, tmp_path / "c")
    traced = _traced(cache, 3)
    names = sorted(traced)[:5]
    seqs = cache.sequences(64)
    by_record = Loader(seqs, batch_size=8, seed=3, epochs=1, exclude=Exclusions(records=names))
    by_index = Loader(
        seqs, batch_size=8, seed=3, epochs=1, exclude=Exclusions(documents=[traced[n] for n in names])
    )
    assert len(by_record) == len(by_index) < len(Loader(seqs, batch_size=8, seed=3, epochs=1))
    assert all(np.array_equal(a, b) for a, b in zip(by_record, by_index, strict=True))
    assert by_record.exclusions_state()[0]["records"] == 5

    config = tmp_path / "mix.yaml"
    config.write_text(
        f"seq_len: 64\nseed: 3\nblock_size: 16\nsources:\n  web: {{path: {tmp_path / 'c'}, exclude: "
        f"{{records: ['{names[0]}', '{names[1]}']}}}}\nweights: {{web: 1}}\n"
    )
    from streampack.runs.mixconfig import load_mixture, mixture_exclusions

    run = Loader(load_mixture(config), batch_size=8, exclude=mixture_exclusions(config))
    served = {doc.doc for step in range(40) for doc in streampack.which(run, step)}
    assert not served & {traced[names[0]], traced[names[1]]}


def test_bad_record_names_are_refused_naming_them(tmp_path: Path) -> None:
    src = write_bytes(tmp_path / "in.jsonl", jsonl_with_gaps(30))
    cache = _build(src, tmp_path / "c")
    seqs = cache.sequences(16)
    lines = src.read_bytes().count(b"\n")
    blank = src.read_bytes().split(b"\n").index(b"") + 1  # a record that made no document
    cases = [
        (f"{tmp_path / 'other.jsonl'}:3", "is not an input of the cache"),
        (f"{src}:{lines + 5}", "past the records of its file"),
        (f"{src}:{blank}", "a record that made no document"),
        (f"{src}[2]", r"a record of \S+in\.jsonl is named 'path:line'"),
    ]
    for name, message in cases:
        with pytest.raises(OptionsError, match=message) as caught:
            Loader(seqs, batch_size=4, exclude=Exclusions(records=[name]))
        assert name in str(caught.value)
    with pytest.raises(OptionsError, match=r"'path:line' \(lines from 1\)"):
        Exclusions(records=[f"{src}:0"])


@pytest.mark.slow
def test_cli_which_marks_excluded_documents_and_steps(tmp_path: Path) -> None:
    src = write_bytes(tmp_path / "in.jsonl", jsonl_with_gaps(200))
    cache = _build(src, tmp_path / "c")
    plain = Loader(cache.sequences(16), batch_size=8, seed=3)
    masked = streampack.which(plain, 5)[0]
    skipped = next(doc for doc in streampack.which(plain, 6) if doc.doc != masked.doc)
    rules = tmp_path / "exclude.yaml"
    rules.write_text(
        f"exclude:\n  - {{records: ['{masked.location}'], mode: mask}}\n  - {{steps: [[7, 7]], mode: mask}}\n"
        f"  - {{steps: [[8, 8]]}}\n  - {{documents: [{skipped.doc}], at: 80}}\n"
    )
    settings = [cache.root, "--seq-len", "16", "--batch-size", "8", "--seed", "3", "--exclude", rules]
    shown = json.loads(run_cli("which", *settings, "--step", "5", "--json").stdout)
    marks = {d["doc"]: d["excluded"] for d in shown["documents"]}
    assert marks[masked.doc] == "mask" and shown["excluded"] == []
    expected = {masked.doc: "mask"} | ({skipped.doc: "skip from position 80"} if skipped.doc in marks else {})
    assert {d: mark for d, mark in marks.items() if mark} == expected
    table = run_cli("which", *settings, "--step", "6").stdout
    assert f"{skipped.location}  excluded (skip from position 80)\n" in table
    table = run_cli("which", *settings, "--step", "7").stdout
    assert "excluded: positions 56-64 of this step are excluded (mask) by exclusion 1" in table
    table = run_cli("which", *settings, "--step", "8").stdout
    assert "excluded: positions 64-72 are excluded (skip) by exclusion 2 from position 0" in table
    assert "excluded (" not in run_cli("which", *settings[:7], "--step", "5").stdout


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fields", "chat"])
def test_records_of_an_sft_cache_name_the_documents_they_made(
    tmp_path: Path, gpt2_tokenizer: Path, kind: str
) -> None:
    """An SFT build reads fields or a chat, not ``text``: the ``k``-th record that made a document is
    document ``k``, though records before it left out by the build (bad, empty, blank) hold a ``text``."""
    if kind == "fields":
        lines, kept = sft_lines(80)
        options: dict[str, Any] = {"tokenizer": "bytes", "fields": ["prompt", "response"]}
    else:
        from tests.test_sft import CHATML, CHATML_TOKENS, chat_tokenizer

        lines, kept = chat_lines(60)
        tokenizer = chat_tokenizer(gpt2_tokenizer, tmp_path / "tok", CHATML, CHATML_TOKENS)
        options = {"tokenizer": str(tokenizer.parent), "chat": "messages"}
    src = write_bytes(tmp_path / "sft.jsonl", b"\n".join(lines) + b"\n")
    streampack.build(src, tmp_path / "c", progress=False, on_bad_record="skip", **options)
    cache = streampack.open(tmp_path / "c")
    made = {f"{src}:{line}": k for k, line in enumerate(sorted(kept))}
    assert documents_named(cache, list(made)) == made
    left_out = [line for line in range(1, len(lines) + 1) if line not in kept]
    for line in left_out[:8]:  # blank lines, bad records (most with a text), empty fields
        with pytest.raises(OptionsError, match="a record that made no document"):
            documents_named(cache, [f"{src}:{line}"])

    chosen = list(made)[4:12]
    seqs = cache.sequences(16)
    by_record = Loader(seqs, batch_size=4, seed=3, epochs=1, exclude=Exclusions(records=chosen))
    by_index = Loader(
        seqs, batch_size=4, seed=3, epochs=1, exclude=Exclusions(documents=[made[n] for n in chosen])
    )
    assert len(by_record) == len(by_index) < len(Loader(seqs, batch_size=4, seed=3, epochs=1))
    assert all(np.array_equal(a, b) for a, b in zip(by_record, by_index, strict=True))

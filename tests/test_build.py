"""Round trips through build and open, for every input format, compression and tokenizer kind."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

import streampack
from streampack.errors import BadRecordError, ConfigMismatchError, InputError, StreampackError
from tests.conftest import shard_bytes, write_bytes, write_jsonl

texts = st.text(st.characters(exclude_categories=["Cs"]), max_size=300)
long_texts = st.builds(lambda t, n: t * n, st.text(min_size=1, max_size=20), st.integers(50, 400))
corpora = st.lists(st.one_of(texts, texts, long_texts, st.just("")), min_size=1, max_size=25)


def expected_docs(tokenizer_json: Path | None, docs: list[str]) -> list[list[int]]:
    """What the cache must hold: the tokenizer called directly on each text, then EOS; no empty documents."""
    docs = [d for d in docs if d and not d.isspace()]
    if tokenizer_json is None:
        return [[*d.encode("utf-8"), 256] for d in docs]
    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.encode_special_tokens = True  # text is text
    eos = tok.token_to_id("<|endoftext|>")
    return [[*tok.encode(d, add_special_tokens=False).ids, eos] for d in docs]


def read_docs(out: Path) -> list[list[int]]:
    cache = streampack.open(out)
    return [cache.doc(i).tolist() for i in range(cache.num_docs)]


def write_corpus(directory: Path, docs: list[str], fmt: str) -> list[Path]:
    """Write ``docs`` in format ``fmt``, split over up to three files; return the files in order."""
    parts = [docs] if len(docs) < 3 else [docs[:1], docs[1:2], docs[2:]]
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, part in enumerate(parts):
        if fmt == "parquet":
            path = directory / f"part{i}.parquet"
            pq.write_table(pa.table({"text": part, "n": list(range(len(part)))}), path, row_group_size=4)
        else:
            path = write_jsonl(
                directory / f"part{i}.{fmt}", [{"text": d, "id": j} for j, d in enumerate(part)]
            )
        paths.append(path)
    return paths


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "jsonl.zst", "jsonl.bz2", "jsonl.xz", "parquet"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(docs=corpora)
def test_round_trip_every_format(fmt: str, docs: list[str], bpe_tokenizer: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_corpus(Path(tmp) / "in", docs, fmt)
        for tokenizer in (None, bpe_tokenizer):
            out = Path(tmp) / f"cache-{tokenizer is None}"
            spec = "bytes" if tokenizer is None else str(tokenizer)
            streampack.build(paths, out, tokenizer=spec, workers=1)
            assert read_docs(out) == expected_docs(tokenizer, docs)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(docs=st.lists(texts.filter(lambda t: "\n" not in t and "\r" not in t and t.strip()), min_size=1))
def test_round_trip_text_lines_and_files(docs: list[str], bpe_tokenizer: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        lines = write_bytes(Path(tmp) / "in" / "lines.txt.gz", "".join(d + "\n" for d in docs).encode())
        streampack.build(lines, Path(tmp) / "lines", split_lines=True, workers=1)
        assert read_docs(Path(tmp) / "lines") == expected_docs(None, [d.rstrip("\r\n") for d in docs])
        files = [write_bytes(Path(tmp) / "docs" / f"{i:03d}.txt", d.encode()) for i, d in enumerate(docs)]
        streampack.build(Path(tmp) / "docs", Path(tmp) / "files", tokenizer=str(bpe_tokenizer), workers=1)
        assert read_docs(Path(tmp) / "files") == expected_docs(bpe_tokenizer, docs)
        assert len(files) == streampack.open(Path(tmp) / "files").num_docs


def test_python_documents_and_generators(tmp_path: Path) -> None:
    docs = ["alpha", "", "gamma δ"]
    streampack.build(streampack.Documents(docs), tmp_path / "a")
    streampack.build(({"text": d} for d in docs), tmp_path / "b")
    assert read_docs(tmp_path / "a") == read_docs(tmp_path / "b") == expected_docs(None, docs)


def test_hugging_face_dataset(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    docs = [f"document {i} " * (i % 7) for i in range(250)]
    ds = datasets.Dataset.from_dict({"text": docs})
    streampack.build(ds, tmp_path / "ds")
    assert read_docs(tmp_path / "ds") == expected_docs(None, docs)
    streampack.build(ds.to_iterable_dataset(num_shards=3), tmp_path / "iterable")
    assert read_docs(tmp_path / "iterable") == expected_docs(None, docs)


def test_split_jsonl_units_match_whole_file(tmp_path: Path) -> None:
    docs = [f"line {i} " + "x" * (i % 300) for i in range(3000)]
    path = write_jsonl(tmp_path / "big.jsonl", [{"text": d} for d in docs])
    assert path.stat().st_size > 3 * (1 << 16)
    streampack.build(path, tmp_path / "split", unit_bytes=1 << 16, workers=1)
    cache = streampack.open(tmp_path / "split")
    assert cache.num_shards > 3
    assert read_docs(tmp_path / "split") == expected_docs(None, docs)


def test_small_files_are_read_in_runs_of_at_most_a_unit(tmp_path: Path) -> None:
    sizes = [30_000, 30_000, 30_000, 0, 200_000, 10_000, 10_000]  # bytes of text per file
    paths = []
    for i, size in enumerate(sizes):
        suffix = ".txt" if i % 2 else ".jsonl"
        text = f"file {i} " + "w" * size
        data = text if suffix == ".txt" else json.dumps({"text": text}) + "\n"
        paths.append(write_bytes(tmp_path / "in" / f"{i}{suffix}", data.encode() if size else b""))
    pq.write_table(pa.table({"text": ["a parquet document"]}), tmp_path / "in" / "7.parquet")

    streampack.build(tmp_path / "in", tmp_path / "c", unit_bytes=1 << 16, workers=1)
    cache = streampack.open(tmp_path / "c")
    units = [s.unit for s in cache.shards]
    first, fifth = str(paths[0]), str(paths[4])
    assert units == [
        f"{first} .. {paths[1]} (2 files)",  # a third 30 kB file would pass 64 kB
        f"{paths[2]} .. {paths[3]} (2 files)",  # an empty file joins the run before it
        f"{fifth} [bytes 0:65536]",  # a large JSONL file is split into its own units
        f"{fifth} [bytes 65536:131072]",
        f"{fifth} [bytes 131072:196608]",
        f"{fifth} [bytes 196608:{paths[4].stat().st_size}]",
        f"{paths[5]} .. {paths[6]} (2 files)",
        f"{tmp_path / 'in' / '7.parquet'} [row groups 0:1]",  # Parquet: always by row groups
    ]
    texts = [f"file {i} " + "w" * size if size else "" for i, size in enumerate(sizes)]  # empty .txt: ""
    assert read_docs(tmp_path / "c") == expected_docs(None, [*texts, "a parquet document"])
    assert streampack.verify(tmp_path / "c").ok


def test_a_run_resumes_after_its_committed_records_across_files(tmp_path: Path) -> None:
    texts = [f"doc {i} " * (i + 1) for i in range(12)]
    inputs = tmp_path / "in"
    for i in range(4):  # a .txt document, then a JSONL file whose second line is bad
        write_bytes(inputs / f"{i}a.txt", texts[3 * i].encode())
        lines = [json.dumps({"text": texts[3 * i + 1]}), json.dumps({"text": texts[3 * i + 2]})]
        if i == 2:
            lines.insert(1, "{not json")
        write_bytes(inputs / f"{i}b.jsonl", "\n".join(lines).encode() + b"\n")

    with pytest.raises(StreampackError, match=r"2b\.jsonl:2: malformed JSON"):
        streampack.build(inputs, tmp_path / "c", workers=1, commit_bytes=1)
    partial = streampack.open(tmp_path / "c", allow_incomplete=True)
    assert partial.num_shards == 1 and partial.num_docs == 8  # committed up to the bad record
    summary = streampack.build(inputs, tmp_path / "c", workers=1, on_bad_record="skip")
    assert (summary.units_resumed, summary.skipped_records) == (1, 1)
    streampack.build(inputs, tmp_path / "fresh", workers=1, on_bad_record="skip")
    assert shard_bytes(tmp_path / "c") == shard_bytes(tmp_path / "fresh")
    assert read_docs(tmp_path / "c") == expected_docs(None, texts)


def test_workers_do_not_change_the_bytes(tmp_path: Path, bpe_tokenizer: Path) -> None:
    inputs = [
        write_jsonl(tmp_path / "in" / f"{i}.jsonl", [{"text": f"doc {i}.{j} " * j} for j in range(400)])
        for i in range(3)
    ]
    for workers in (1, 2):
        streampack.build(
            inputs,
            tmp_path / f"w{workers}",
            tokenizer=str(bpe_tokenizer),
            workers=workers,
            unit_bytes=1 << 16,
        )
    assert shard_bytes(tmp_path / "w1") == shard_bytes(tmp_path / "w2")
    assert streampack.open(tmp_path / "w1").num_shards >= 4


def test_gpt2_sample_matches_tokenizer(tmp_path: Path, gpt2_tokenizer: Path) -> None:
    from tests.conftest import SAMPLE_CORPUS

    if not SAMPLE_CORPUS.exists():
        pytest.skip(f"{SAMPLE_CORPUS} is absent")
    streampack.build(SAMPLE_CORPUS, tmp_path / "c", tokenizer=str(gpt2_tokenizer), max_piece_chars=20_000)
    cache = streampack.open(tmp_path / "c")
    import zstandard

    lines = zstandard.ZstdDecompressor().stream_reader(SAMPLE_CORPUS.open("rb")).read().splitlines()
    texts_ = [json.loads(line)["text"] for line in lines]
    assert cache.num_docs == len(texts_)
    tok = Tokenizer.from_file(str(gpt2_tokenizer))
    for i in (0, 1, len(texts_) // 2, len(texts_) - 1, *np.argsort([-len(t) for t in texts_])[:3].tolist()):
        assert cache.doc(i).tolist() == [*tok.encode(texts_[i]).ids, 50256], i


def test_tiktoken_backend(tmp_path: Path, tiktoken_gpt2: Path, gpt2_tokenizer: Path) -> None:
    docs = ["Hello world", "<|endoftext|> is plain text here", "  spaces\n\nand lines  ", ""]
    streampack.build(streampack.Documents(docs), tmp_path / "tt", tokenizer=f"tiktoken:{tiktoken_gpt2}")
    cache = streampack.open(tmp_path / "tt")
    assert cache.manifest.dtype == "uint16" and cache.eos_id == 50256
    import tiktoken
    import tiktoken.load

    meta = json.loads(tiktoken_gpt2.with_suffix(".json").read_text())
    enc = tiktoken.Encoding(
        "gpt2",
        pat_str=meta["pat_str"],
        mergeable_ranks=tiktoken.load.load_tiktoken_bpe(str(tiktoken_gpt2)),
        special_tokens=meta["special_tokens"],
    )
    assert read_docs(tmp_path / "tt") == [[*enc.encode_ordinary(d), 50256] for d in docs if d]
    assert cache.doc(0).tolist()[:2] == [15496, 995]


def test_eos_options(tmp_path: Path) -> None:
    streampack.build(streampack.Documents(["ab"]), tmp_path / "none", eos=False)
    streampack.build(streampack.Documents(["ab"]), tmp_path / "big", eos_id=70000, allow_new_ids=True)
    assert streampack.open(tmp_path / "none").doc(0).tolist() == [97, 98]
    big = streampack.open(tmp_path / "big")
    assert big.doc(0).tolist() == [97, 98, 70000] and big.dtype == np.dtype("uint32")


def test_rerun_is_a_no_op_and_settings_are_checked(tmp_path: Path, bpe_tokenizer: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}, {"body": "y", "text": "z"}])
    out = tmp_path / "c"
    streampack.build(path, out)
    before = shard_bytes(out)
    summary = streampack.build(path, out)
    assert summary.num_docs == 2 and shard_bytes(out) == before
    with pytest.raises(ConfigMismatchError, match="tokenizer"):
        streampack.build(path, out, tokenizer=str(bpe_tokenizer))
    with pytest.raises(ConfigMismatchError, match="text_field"):
        streampack.build(path, out, text_field="body")
    with pytest.raises(ConfigMismatchError, match="eos"):
        streampack.build(path, out, eos=False)
    streampack.build(path, out, text_field="body", overwrite=True, on_bad_record="skip")
    assert streampack.open(out).manifest.skipped_records == 1


def test_incomplete_cache_is_refused_unless_asked(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": "good"}, "not an object", {"text": "never"}])
    with pytest.raises(StreampackError, match=r"a\.jsonl:2"):
        streampack.build(path, tmp_path / "c")
    with pytest.raises(StreampackError, match="has not finished"):
        streampack.open(tmp_path / "c")
    partial = streampack.open(tmp_path / "c", allow_incomplete=True)
    assert partial.num_docs == 1 and partial.doc(0).tolist() == [*b"good", 256]


def test_invalid_utf8_in_a_streamed_document_is_a_bad_record(tmp_path: Path) -> None:
    good = write_bytes(tmp_path / "in" / "a.txt", b"a small document")
    big = write_bytes(tmp_path / "in" / "b.txt", b"word " * (3 << 20) + b"\xff")  # 15 MB: streamed in chunks
    last = write_bytes(tmp_path / "in" / "c.txt", b"after it")
    options = {"workers": 1, "max_piece_chars": 100_000, "batch_chars": 200_000}
    with pytest.raises(BadRecordError, match=r"b\.txt: byte 15728640: invalid UTF-8"):
        streampack.build([good, big, last], tmp_path / "c", **options)
    partial = streampack.open(tmp_path / "c", allow_incomplete=True)  # the files form one unit
    assert [(s.num_docs, s.num_tokens) for s in partial.shards] == [(1, len(b"a small document") + 1)]
    assert partial.doc(0).tolist() == [*b"a small document", 256]

    summary = streampack.build([good, big, last], tmp_path / "c", on_bad_record="skip", **options)
    assert summary.skipped_records == 1
    assert read_docs(tmp_path / "c") == [[*b"a small document", 256], [*b"after it", 256]]


def test_bom_file_split_into_units_reads_every_line_once(tmp_path: Path) -> None:
    docs = [f"z{i} " + "y" * (i % 50) for i in range(3000)]
    path = write_jsonl(tmp_path / "bom.jsonl", [{"text": d} for d in docs])
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    streampack.build(path, tmp_path / "c", unit_bytes=1 << 16, workers=1)
    assert streampack.open(tmp_path / "c").num_shards > 1
    assert read_docs(tmp_path / "c") == expected_docs(None, docs)


def test_overwrite_refuses_a_directory_that_is_not_a_cache(tmp_path: Path) -> None:
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "train.py").write_text("print('precious')")
    with pytest.raises(StreampackError, match=r"refusing to overwrite .*train\.py"):
        streampack.build(streampack.Documents(["x"]), tmp_path / "project", overwrite=True)
    assert (tmp_path / "project" / "train.py").exists()


def test_a_cache_inside_its_input_directory_is_not_read_as_input(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "data" / "a.jsonl", [{"text": "one"}, {"text": "two"}])
    for _ in range(2):  # the second run must see the same inputs, not the cache's own .json files
        summary = streampack.build(tmp_path / "data", tmp_path / "data" / "cache")
    assert summary.num_docs == 2 and summary.units_already_done == 0


@pytest.mark.parametrize("items", [{"text": "a"}, {"a.jsonl", "b.jsonl"}])
def test_mappings_and_sets_are_not_documents(tmp_path: Path, items: object) -> None:
    with pytest.raises(InputError, match="cannot read documents from a"):
        streampack.build(items, tmp_path / "c")


def test_python_strings_with_lone_surrogates_are_bad_records(tmp_path: Path) -> None:
    docs = streampack.Documents(["fine", "bad \ud800 text", {"text": "also fine"}])
    with pytest.raises(BadRecordError, match="python record 1: the text holds a lone surrogate"):
        streampack.build(docs, tmp_path / "a")
    summary = streampack.build(docs, tmp_path / "b", on_bad_record="skip")
    assert summary.num_docs == 2 and summary.skipped_records == 1


def test_new_python_data_never_returns_the_old_cache(tmp_path: Path) -> None:
    out = tmp_path / "g"
    streampack.build((t for t in ["old one", "old two"]), out)
    with pytest.raises(ConfigMismatchError, match="cannot tell whether they still hold the same documents"):
        streampack.build((t for t in ["NEW", "x", "y", "z"]), out)
    with pytest.raises(ConfigMismatchError, match=r"overwrite=True .* Documents\(items, fingerprint="):
        streampack.build(streampack.Documents(["NEW", "x"]), out)
    summary = streampack.build((t for t in ["NEW", "x", "y", "z"]), out, overwrite=True)
    assert summary.num_docs == 4 and read_docs(out)[0] == [*b"NEW", 256]


def test_an_interrupted_python_build_resumes_only_under_the_same_fingerprint(tmp_path: Path) -> None:
    out = tmp_path / "g"
    docs = ["first", "second", "bad \ud800", "fourth"]
    with pytest.raises(BadRecordError, match="python record 2"):
        streampack.build(streampack.Documents(docs, fingerprint="v1"), out)
    with pytest.raises(ConfigMismatchError, match="cannot tell"):  # no identity: never resumed
        streampack.build(streampack.Documents(docs), out, on_bad_record="skip")
    with pytest.raises(ConfigMismatchError, match="fingerprint v1 -> v2"):
        streampack.build(streampack.Documents(docs, fingerprint="v2"), out, on_bad_record="skip")
    summary = streampack.build(streampack.Documents(docs, fingerprint="v1"), out, on_bad_record="skip")
    assert summary.units_resumed == 1 and summary.skipped_records == 1
    assert read_docs(out) == [[*d.encode(), 256] for d in ("first", "second", "fourth")]
    again = streampack.build(streampack.Documents(docs, fingerprint="v1"), out, on_bad_record="skip")
    assert again.num_docs == 3  # the finished cache is reused


def test_empty_and_whitespace_documents_are_left_out_and_counted_in_every_format(tmp_path: Path) -> None:
    texts = ["kept", "", "   ", "\n\t", "also kept"]
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"text": t} for t in texts])
    pq.write_table(pa.table({"text": texts}), tmp_path / "in" / "b.parquet")
    for i, text in enumerate(texts):
        (tmp_path / "in" / f"c{i}.txt").write_text(text)
    summary = streampack.build(tmp_path / "in", tmp_path / "files")
    assert summary.num_docs == 6 and summary.empty_docs == 9
    python = streampack.build(streampack.Documents(texts), tmp_path / "python")
    assert python.num_docs == 2 and python.empty_docs == 3
    assert streampack.open(tmp_path / "python").manifest.empty_docs == 3

"""`streampack.open` over llm.c shards, nanoGPT bins and OLMo memmaps (`streampack.reader.foreign.llmc`,
`nanogpt`, `olmo`).

Each format both ways: a cache exported and opened again has the original documents (llm.c: by the
relation its delimiter makes), the same windows over the same stream, and a Loader runs over it; files
written by the format's own writer code, reproduced below from its source (those writers are scripts, not
packages), from real text and the real GPT-2 tokenizer, open with the documents they were given. Damaged
files raise a CacheError naming the file, the field and what was expected.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

import streampack
from streampack.errors import CacheError, DocumentBoundaryWarning, OptionsError
from streampack.interop import convert
from streampack.reader.foreign import nanogpt, scanning
from tests.conftest import SAMPLE_CORPUS, run_cli

EOT = 50256  # GPT-2's <|endoftext|>


def docs_of(cache: streampack.Cache) -> list[np.ndarray]:
    return [np.asarray(cache.doc(i)) for i in range(cache.num_docs)]


def assert_docs(got: streampack.Cache, expected: list[np.ndarray]) -> None:
    assert got.num_docs == len(expected)
    for i, doc in enumerate(expected):
        np.testing.assert_array_equal(got.doc(i), doc, err_msg=f"document {i}")


def loader_runs(cache: streampack.Cache, seq_len: int = 256) -> None:
    samples = cache.sequences(seq_len, overlap=1)
    loader = streampack.Loader(samples, batch_size=8, seed=1, epochs=1, drop_last=False)
    seen = sum(len(batch) for batch in loader)
    assert seen == len(samples) > 0


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """The first 60 documents of the real sample corpus."""
    if not SAMPLE_CORPUS.exists():
        pytest.skip(f"sample corpus not found at {SAMPLE_CORPUS}")
    reader = zstandard.ZstdDecompressor().stream_reader(SAMPLE_CORPUS.open("rb"))
    lines = reader.read().decode().splitlines()[:60]
    return [json.loads(line)["text"] for line in lines]


@pytest.fixture(scope="module")
def encoded(texts: list[str], gpt2_tokenizer: Path) -> list[list[int]]:
    """Those documents' ids by the real GPT-2 tokenizer (no EOT: each writer adds its own)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(gpt2_tokenizer))
    return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


# ----------------------------------------------------------------------------- llm.c


def llmc_write_datafile(filename: Path, toks: list[int], model_desc: str = "gpt-2") -> None:
    """karpathy/llm.c ``dev/data/data_common.py`` ``write_datafile`` (with its ``HEADERS_INFO``), as
    written there, less its print."""
    headers_info = {
        "gpt-2": {"magic": 20240520, "version": 1, "token_dtype": np.uint16},
        "llama-3": {"magic": 20240801, "version": 7, "token_dtype": np.uint32},
    }
    assert len(toks) < 2**31, "token count too large"  # ~2.1B tokens
    assert model_desc in ["gpt-2", "llama-3"], f"unknown model descriptor {model_desc}"
    info = headers_info[model_desc]
    header = np.zeros(256, dtype=np.int32)  # header is always 256 int32 values
    header[0] = info["magic"]
    header[1] = info["version"]
    header[2] = len(toks)  # number of tokens after the 256*4 bytes of header
    toks_np = np.array(toks, dtype=info["token_dtype"])
    with open(filename, "wb") as f:
        f.write(header.tobytes())
        f.write(toks_np.tobytes())


def llmc_fineweb_shards(out: Path, docs: list[list[int]], shard_size: int, delimiter: int, desc: str) -> list:
    """llm.c ``dev/data/fineweb.py``'s main loop: each document tokenized as ``[eot] + tokens``, packed
    into shards of ``shard_size`` tokens (a document that does not fit is split, its remainder starting the
    next shard); the first shard is ``val``, the rest ``train``. Returns each shard's tokens in file name
    order (the reader's: ``fineweb_train_*`` before ``fineweb_val_000000``)."""
    out.mkdir()
    written: list[tuple[str, list[int]]] = []
    shard_index, buf = 0, []
    for ids in docs:
        tokens = [delimiter, *ids]
        buf.extend(tokens)
        while len(buf) >= shard_size:
            split = "val" if shard_index == 0 else "train"
            name = f"fineweb_{split}_{shard_index:06d}.bin"
            llmc_write_datafile(out / name, buf[:shard_size], desc)
            written.append((name, buf[:shard_size]))
            buf, shard_index = buf[shard_size:], shard_index + 1
    if buf:
        split = "val" if shard_index == 0 else "train"
        name = f"fineweb_{split}_{shard_index:06d}.bin"
        llmc_write_datafile(out / name, buf, desc)
        written.append((name, buf))
    return [tokens for _, tokens in sorted(written)]


def split_at(stream: np.ndarray, delimiter: int) -> list[np.ndarray]:
    """A shard's documents as the reader cuts them: at each delimiter, and the tokens before the first."""
    starts = sorted({0, *np.flatnonzero(stream == delimiter).tolist()}) if len(stream) else []
    return [stream[a:b] for a, b in zip(starts, [*starts[1:], len(stream)])]


def test_llmc_export_opens_as_the_documents_behind_their_delimiter(
    natural: streampack.Cache, tmp_path: Path
) -> None:
    natural.export("llmc", tmp_path / "one")  # 10**8 tokens a shard: one shard
    opened = streampack.open(tmp_path / "one")
    assert (opened.num_shards, opened.bos_id, opened.eos_id) == (1, EOT, None)
    eos = natural.eos_id
    assert_docs(opened, [np.concatenate([[eos], doc[:-1]]) for doc in docs_of(natural)])
    # The stream is the native one shifted right by one: window k starts a token earlier.
    ours, native = opened.sequences(512, overlap=1), natural.sequences(512, overlap=1)
    assert len(ours) == len(native)
    np.testing.assert_array_equal(ours[:][:, 1:], native[:][:, :-1])
    loader_runs(opened)


def test_llmc_documents_are_cut_at_shard_ends(natural: streampack.Cache, tmp_path: Path) -> None:
    natural.export("llmc", tmp_path / "many", shard_tokens=200_000)
    opened = streampack.open(tmp_path / "many")
    files = sorted((tmp_path / "many").glob("*.bin"))
    assert opened.num_shards == len(files) > 5
    stream = np.concatenate([[natural.eos_id], np.asarray(natural.tokens(0, natural.num_tokens))[:-1]])
    np.testing.assert_array_equal(np.concatenate(docs_of(opened)), stream)
    expected = []
    for shard in range(opened.num_shards):
        expected += split_at(np.asarray(opened.shard_tokens(shard)), EOT)
    assert_docs(opened, expected)
    continued = sum(int(opened.shard_tokens(s)[0] != EOT) for s in range(opened.num_shards))
    assert opened.num_docs == natural.num_docs + continued


def test_llmc_export_of_a_bos_cache_opens_as_its_documents(
    texts: list[str], gpt2_tokenizer: Path, tmp_path: Path
) -> None:
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    streampack.build(src, tmp_path / "bos", tokenizer=str(gpt2_tokenizer), bos_id=EOT, eos=False)
    cache = streampack.open(tmp_path / "bos")
    cache.export("llmc", tmp_path / "llmc")
    opened = streampack.open(tmp_path / "llmc")
    assert_docs(opened, docs_of(cache))
    np.testing.assert_array_equal(opened.sequences(300)[:], cache.sequences(300)[:])


def test_llmc_shards_of_llmc_fineweb_writer_open_with_their_documents(
    encoded: list[list[int]], tmp_path: Path
) -> None:
    shards = llmc_fineweb_shards(tmp_path / "gpt2", encoded, 20_000, EOT, "gpt-2")
    assert len(shards) > 3
    # A document longer than a shard leaves one shard without a delimiter: read as one document, said.
    with pytest.warns(
        DocumentBoundaryWarning,
        match=r"1 of its 11 shards \(fineweb_train_\d+\.bin\) hold no delimiter 50256",
    ):
        opened = streampack.open(tmp_path / "gpt2")
    assert opened.dtype == np.uint16 and opened.num_shards == len(shards)
    expected = [d for s in shards for d in split_at(np.array(s), EOT)]
    assert_docs(opened, expected)
    # One shard file opens alone (llm.c's val shard).
    val = streampack.open(tmp_path / "gpt2" / "fineweb_val_000000.bin")
    assert_docs(val, split_at(np.array(shards[-1]), EOT))
    # Llama 3's layout: uint32 tokens behind <|begin_of_text|> (128000), the default delimiter there.
    llama = llmc_fineweb_shards(tmp_path / "llama", encoded, 50_000, 128000, "llama-3")
    opened = streampack.open(tmp_path / "llama")
    assert (opened.dtype, opened.bos_id) == (np.uint32, 128000)
    assert_docs(opened, [d for s in llama for d in split_at(np.array(s), 128000)])
    assert opened.num_docs == len(encoded) + sum(s[0] != 128000 for s in llama)
    loader_runs(opened)


def test_llmc_bad_shards_name_the_file_and_field(natural: streampack.Cache, tmp_path: Path) -> None:
    natural.export("llmc", tmp_path / "good", shard_tokens=500_000)
    good = tmp_path / "good" / "train_000001.bin"
    raw = good.read_bytes()

    def damaged(name: str, data: bytes) -> Path:
        folder = tmp_path / name
        shutil.copytree(tmp_path / "good", folder)
        (folder / good.name).write_bytes(data)
        return folder

    def header(magic: int, version: int, count: int) -> bytes:
        """The shard with these header fields."""
        return np.array([magic, version, count], dtype="<i4").tobytes() + raw[12:]

    count = int(np.frombuffer(raw[8:12], dtype="<i4")[0])
    at = r"train_000001\.bin: "
    cases = {
        "truncated": (raw[:-2], at + r".* expected .*header\[2\] \(the token count\)"),
        "header cut": (raw[:1000], at + r"1,000 bytes, shorter than the 1,024-byte llm\.c header"),
        "version": (header(20240520, 3, count), at + r"header\[1\] \(the version\) is 3, expected 1"),
        "magic": (
            header(20240521, 1, count),
            at + r"header\[0\] \(the magic\) is 20240521, expected 20240520",
        ),
        "count": (header(20240520, 1, count + 1), at + r".*expected 1,001,026: .*header\[2\]"),
        "negative": (
            header(20240520, 1, -5),
            at + r"header\[2\] \(the token count\) is -5, expected at least 0",
        ),
        "mixed": (
            header(20240801, 7, count // 2),
            at + r"uint32 .*, but train_000000\.bin has uint16 .*one dtype",
        ),
    }
    assert count == 500_000
    for name, (data, message) in cases.items():
        with pytest.raises(CacheError, match=message):
            streampack.open(damaged(name.replace(" ", "_"), data))
    # A lone file with a damaged magic looks headerless: it is an llm.c shard only when told so.
    (tmp_path / "lone.bin").write_bytes(header(7, 1, count))
    with pytest.raises(CacheError, match=r"lone\.bin: header\[0\] \(the magic\) is 7"):
        streampack.open(tmp_path / "lone.bin", format="llmc")
    with pytest.raises(OptionsError, match=r"pass bos_id= .* not eos_id="):
        streampack.open(tmp_path / "good", eos_id=EOT)
    with pytest.raises(OptionsError, match=r"bos_id=70,000 does not fit its uint16 tokens"):
        streampack.open(tmp_path / "good", bos_id=70_000)


def header_ints(shard: Path) -> np.ndarray:
    """The 256 ints of an llm.c shard's header (uint32: the delimiter record is a token id)."""
    return np.fromfile(shard, dtype="<u4", count=256)


def test_llmc_export_of_a_uint32_cache_opens_with_its_documents(
    texts: list[str], tiktoken_gpt2: Path, tmp_path: Path
) -> None:
    """A1: cl100k's EOS (100257) is not llm.c's uint32 delimiter (128000): the export records the one it
    wrote in the header, and opening reads it, so each document comes back (not one per shard)."""
    ranks = tiktoken_gpt2.with_name("cl100k_base.tiktoken")
    if not ranks.exists():
        pytest.skip(f"{ranks} is absent (../shared/data)")
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    streampack.build(src, tmp_path / "c", tokenizer=f"tiktoken:{ranks}", progress=False)
    cache = streampack.open(tmp_path / "c")
    assert (cache.dtype, cache.eos_id) == (np.uint32, 100257)
    cache.export("llmc", tmp_path / "llmc", progress=False)
    shard = tmp_path / "llmc" / "train_000000.bin"
    assert header_ints(shard)[[0, 1, 254, 255]].tolist() == [20240801, 7, 20261207, 100257]
    opened = streampack.open(tmp_path / "llmc")
    assert (opened.dtype, opened.bos_id) == (np.uint32, 100257)
    assert_docs(opened, [np.concatenate([[100257], doc[:-1]]) for doc in docs_of(cache)])
    assert len(opened.documents(2048)) >= cache.num_docs
    report = streampack.verify(tmp_path / "llmc")
    assert report.ok and report.notes[0].startswith("llmc files: their headers were checked (magic, version")
    # Told another delimiter than the recorded one: refused, naming both.
    with pytest.raises(OptionsError, match=r"records the delimiter 100257 .* but bos_id=128000 was given"):
        streampack.open(tmp_path / "llmc", bos_id=128000)
    assert streampack.open(tmp_path / "llmc", bos_id=100257).num_docs == cache.num_docs


def test_llmc_export_of_a_cache_with_a_bos_id_opens_with_its_documents(
    texts: list[str], tmp_path: Path
) -> None:
    """A1: a uint16 cache whose delimiter is its --bos-id (255, not llm.c's 50256) round-trips."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t[:400]}) + "\n" for t in texts[:30]))
    streampack.build(src, tmp_path / "c", bos_id=255, progress=False)
    cache = streampack.open(tmp_path / "c")
    assert (cache.dtype, cache.bos_id, cache.eos_id) == (np.uint16, 255, 256)
    cache.export("llmc", tmp_path / "llmc", shard_tokens=1_500, progress=False)
    shards = sorted((tmp_path / "llmc").glob("*.bin"))
    assert len(shards) > 3 and all(header_ints(f)[255] == 255 for f in shards)
    opened = streampack.open(tmp_path / "llmc")
    assert opened.bos_id == 255
    # Each document behind its BOS, less the EOS the cache appended; cut where a shard ends.
    stream = np.concatenate([doc[:-1] for doc in docs_of(cache)])
    np.testing.assert_array_equal(np.concatenate(docs_of(opened)), stream)
    expected = [
        d for f in range(opened.num_shards) for d in split_at(np.asarray(opened.shard_tokens(f)), 255)
    ]
    assert_docs(opened, expected)
    assert opened.num_docs >= cache.num_docs
    assert streampack.verify(tmp_path / "llmc").ok


def test_llmc_shards_that_record_different_delimiters_are_refused(
    natural: streampack.Cache, tmp_path: Path
) -> None:
    natural.export("llmc", tmp_path / "a", shard_tokens=500_000, progress=False)
    first, second = sorted((tmp_path / "a").glob("*.bin"))[:2]
    raw = bytearray(second.read_bytes())
    raw[4 * 255 : 4 * 256] = np.array([7], dtype="<u4").tobytes()
    second.write_bytes(bytes(raw))
    with pytest.raises(CacheError, match=r"train_000001\.bin: its header records the delimiter 7, but "):
        streampack.open(tmp_path / "a")
    raw[4 * 254 : 4 * 256] = bytes(8)  # no record: written by another writer
    second.write_bytes(bytes(raw))
    with pytest.raises(CacheError, match=r"train_000001\.bin: its header records no delimiter, .* bos_id="):
        streampack.open(tmp_path / "a")
    assert streampack.open(tmp_path / "a", bos_id=EOT).num_shards > 2
    raw[4 * 254 : 4 * 256] = np.array([20261207, 70_000], dtype="<u4").tobytes()
    second.write_bytes(bytes(raw))
    with pytest.raises(CacheError, match=r"header\[255\] .* is 70,000, more than its uint16 tokens hold"):
        streampack.open(tmp_path / "a")
    assert first.exists()


def test_llmc_verify_fails_where_the_delimiter_never_occurs(encoded: list[list[int]], tmp_path: Path) -> None:
    """A1: uint32 shards written as llm.c writes them, each document behind cl100k's 100257, read with the
    uint32 default 128000: opening warns that no shard holds it; verify fails (every shard's first document
    is exempt from the delimiter check, so it passed before), and so does verify of a cache converted from
    them. Told the delimiter, they open with their documents and verify."""
    shards = llmc_fineweb_shards(tmp_path / "cl", encoded, 50_000, 100257, "llama-3")
    with pytest.warns(
        DocumentBoundaryWarning, match=r"cl: none of its \d+ shards \(.*\) holds the delimiter 128000"
    ):
        opened = streampack.open(tmp_path / "cl")
    assert opened.num_docs == len(shards)
    with pytest.warns(DocumentBoundaryWarning):
        report = streampack.verify(tmp_path / "cl")
    assert not report.ok
    assert (
        len(report.problems) == 1
        and "the delimiter 128000 (the BOS) occurs in no token" in report.problems[0]
    )
    assert "fineweb_train_000001.bin" in report.problems[0] and "bos_id=" in report.problems[0]
    with pytest.warns(DocumentBoundaryWarning):
        convert(tmp_path / "cl", tmp_path / "native", progress=False)
    native = streampack.verify(tmp_path / "native")
    assert not native.ok and "occurs in no token" in native.problems[0]
    # One shard file alone: the same.
    with pytest.warns(DocumentBoundaryWarning):
        assert not streampack.verify(tmp_path / "cl" / "fineweb_val_000000.bin").ok
    right = streampack.open(tmp_path / "cl", bos_id=100257)
    assert_docs(right, [d for s in shards for d in split_at(np.array(s), 100257)])
    assert streampack.verify(tmp_path / "cl", bos_id=100257).ok


# ----------------------------------------------------------------------------- nanoGPT


def nanogpt_prepare(out: Path, split: str, docs: list[list[int]], eot: int) -> None:
    """karpathy/nanoGPT ``data/openwebtext/prepare.py``: ``process`` appends the EOT to each document's
    ids, then the ids are written into one ``np.memmap`` of uint16, batch after batch, as written there
    (its ``datasets`` shards as slices of the list)."""
    tokenized = [{"ids": [*ids, eot], "len": len(ids) + 1} for ids in docs]
    arr_len = np.sum([d["len"] for d in tokenized], dtype=np.uint64)
    filename = os.path.join(out, f"{split}.bin")
    dtype = np.uint16  # (can do since enc.max_token_value == 50256 is < 2**16)
    arr = np.memmap(filename, dtype=dtype, mode="w+", shape=(int(arr_len),))
    total_batches = 8
    idx = 0
    per = -(-len(tokenized) // total_batches)
    for batch_idx in range(total_batches):
        batch = tokenized[batch_idx * per : (batch_idx + 1) * per]
        if not batch:
            continue
        arr_batch = np.concatenate([np.array(d["ids"]) for d in batch])
        arr[idx : idx + len(arr_batch)] = arr_batch
        idx += len(arr_batch)
    arr.flush()


def test_nanogpt_export_opens_as_the_same_stream(
    natural: streampack.Cache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    natural.export("nanogpt", tmp_path / "owt")
    opened = streampack.open(tmp_path / "owt", eos_id=natural.eos_id)
    assert (opened.eos_id, opened.vocab_size, opened.num_shards) == (natural.eos_id, natural.vocab_size, 1)
    assert_docs(opened, docs_of(natural))
    np.testing.assert_array_equal(opened.sequences(512, overlap=1)[:], natural.sequences(512, overlap=1)[:])
    loader_runs(opened)
    # Without eos_id the file is one stream: one document, the same windows; opening it says so.
    with pytest.warns(DocumentBoundaryWarning, match=r"owt/train\.bin: no eos_id declared: .* one document"):
        stream = streampack.open(tmp_path / "owt")
    assert (stream.num_docs, stream.eos_id) == (1, None)
    np.testing.assert_array_equal(stream.doc(0), natural.tokens(0, natural.num_tokens))
    np.testing.assert_array_equal(stream.sequences(512)[:], natural.sequences(512)[:])
    # A big file is read in shards cut after an EOS.
    monkeypatch.setattr(nanogpt, "SHARD_TOKENS", 100_000)
    sharded = streampack.open(tmp_path / "owt", eos_id=natural.eos_id)
    assert sharded.num_shards > 10
    longest = int(natural.doc_lengths().max())
    for shard in range(sharded.num_shards):
        tokens = sharded.shard_tokens(shard)
        assert len(tokens) <= max(100_000, longest) and tokens[-1] == natural.eos_id
    assert_docs(sharded, docs_of(natural))
    loader_runs(sharded)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 3), max_size=60),
    st.integers(1, 12),
    st.integers(1, 9),
)
def test_nanogpt_shards_are_cut_after_the_last_eos_that_fits(ids: list[int], size: int, window: int) -> None:
    tokens = np.array(ids, dtype=np.uint16)  # 0 is the EOS
    cuts = nanogpt.shard_spans(tokens, 0, size, window=window)
    spans = [(start, stop, len(scanning.Boundary(0).ends(tokens[start:stop])[0])) for start, stop in cuts]
    ends = (np.flatnonzero(tokens == 0) + 1).tolist()
    assert [a for a, _, _ in spans] == [0, *(b for _, b, _ in spans[:-1])] and spans[-1][1] == len(tokens)
    for start, stop, docs in spans:
        inside = [e for e in ends if start < e <= stop]
        assert docs == len(inside) + int(stop == len(tokens) and stop not in ends and stop > start)
        if stop != len(tokens) or stop in ends:
            assert stop in ends  # cut after an EOS
        fits = [e for e in ends if start < e <= start + size]
        if stop < len(tokens):  # the last EOS that fits, or the first one past the limit
            assert stop == (fits[-1] if fits else min(e for e in ends if e > start))
    assert sum(d for _, _, d in spans) == (len(ends) + int(bool(ids) and ids[-1] != 0))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=80), st.booleans())
def test_a_scan_finds_each_documents_end_and_the_crc_in_one_read(ids: list[int], starts: bool) -> None:
    """Ends after each EOS (a tail after the last one is a document), or before each delimiter but one at
    the start; the CRC-32 of the bytes read on the way."""
    tokens = np.array(ids, dtype="<u2")
    ends, crc = scanning.Boundary(0, starts=starts).ends(tokens, checksum=True)
    marks = np.flatnonzero(tokens == 0)
    if starts:
        expected = [*(int(m) for m in marks if m > 0), *([len(ids)] if ids else [])]
    else:
        expected = [int(m) + 1 for m in marks] + ([len(ids)] if ids and ids[-1] != 0 else [])
    assert ends.dtype == np.uint64 and ends.tolist() == expected
    assert crc == zlib.crc32(tokens.tobytes())
    assert scanning.Boundary(None).ends(tokens)[0].tolist() == ([len(ids)] if ids else [])


@pytest.mark.parametrize("format", ["nanogpt", "llmc", "olmo"])
@pytest.mark.filterwarnings("ignore::streampack.errors.DocumentBoundaryWarning")  # documents over a shard
def test_documents_past_the_kept_ends_are_found_again(
    format: str, natural: streampack.Cache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An open keeps the document ends its scan found (so that a convert scans once); past the budget a
    shard's are found again when read, the same."""
    natural.export(format, tmp_path / format, **({"shard_tokens": 20_000} if format == "llmc" else {}))
    declared = {} if format == "llmc" else {"eos_id": natural.eos_id}
    kept = streampack.open(tmp_path / format, **declared)
    monkeypatch.setattr(scanning, "KEPT_ENDS_BYTES", 0)
    found_again = streampack.open(tmp_path / format, **declared)
    assert kept.num_shards == found_again.num_shards and kept.num_docs == found_again.num_docs
    for shard in range(kept.num_shards):
        np.testing.assert_array_equal(kept.shard_offsets(shard), found_again.shard_offsets(shard))
    assert_docs(found_again, docs_of(kept))


def test_nanogpt_val_bin_opens_as_the_held_out_documents(natural: streampack.Cache, tmp_path: Path) -> None:
    natural.export("nanogpt", tmp_path / "owt", val=0.05)
    _, validation = natural.split(0.05)
    keep = np.concatenate([validation.chosen.in_shard(s) for s in range(natural.num_shards)])
    held = [doc for doc, k in zip(docs_of(natural), keep) if k]
    assert_docs(streampack.open(tmp_path / "owt" / "val.bin", eos_id=natural.eos_id), held)
    train = streampack.open(tmp_path / "owt", eos_id=natural.eos_id)
    assert train.num_docs == natural.num_docs - len(held)


def test_nanogpt_prepare_py_bins_open_with_their_documents(encoded: list[list[int]], tmp_path: Path) -> None:
    (tmp_path / "owt").mkdir()
    nanogpt_prepare(tmp_path / "owt", "train", encoded, EOT)
    opened = streampack.open(tmp_path / "owt", eos_id=EOT)
    assert_docs(opened, [np.array([*ids, EOT]) for ids in encoded])
    # Samples sent to another process reopen the file with what was declared (eos_id: 60 documents).
    code = "import pickle, sys; s = pickle.loads(sys.stdin.buffer.read()); print(len(s), s[3][:4].tolist())"
    done = subprocess.run(
        [sys.executable, "-c", code],
        input=pickle.dumps(opened.documents(128)),
        capture_output=True,
        check=True,
    )
    assert done.stdout.decode().split(maxsplit=1) == [str(len(encoded)), f"{encoded[3][:4]}\n"]
    # A tail after the last EOS is a last document; uint32 files with dtype=.
    tail = np.array([*encoded[0], EOT, *encoded[1]], dtype=np.uint32)
    tail.tofile(tmp_path / "tail.bin")
    opened = streampack.open(tmp_path / "tail.bin", eos_id=EOT, dtype="uint32")
    assert_docs(opened, [np.array([*encoded[0], EOT]), np.array(encoded[1])])


def test_nanogpt_without_eos_id_says_it_is_one_document(natural: streampack.Cache, tmp_path: Path) -> None:
    """New user 3c.2: `info` of a nanoGPT train.bin opened without --eos-id says the file is read as one
    document, naming it and the option (stderr: the table on stdout stays as it is); with it, nothing."""
    natural.export("nanogpt", tmp_path / "owt", progress=False)
    shown = run_cli("info", tmp_path / "owt", "--json")
    assert json.loads(shown.stdout)["num_docs"] == 1
    assert shown.stderr.startswith(
        f"warning: {tmp_path / 'owt' / 'train.bin'}: no eos_id declared: the file is"
    )
    assert "Pass --eos-id N, the id after each document" in shown.stderr and "Traceback" not in shown.stderr
    declared = run_cli("info", tmp_path / "owt", "--eos-id", natural.eos_id, "--json")
    assert json.loads(declared.stdout)["num_docs"] == natural.num_docs and not declared.stderr


def test_verify_of_a_nanogpt_export_says_what_it_checked_and_knows_its_files(
    natural: streampack.Cache, tmp_path: Path
) -> None:
    """New user 3c.3-4: verify says what it checked of nanoGPT's files (no header nor index: their size),
    and names val.bin, which the export writes beside train.bin, as what it is, not as a leftover."""
    natural.export("nanogpt", tmp_path / "owt", val=0.1, progress=False)
    (tmp_path / "owt" / "notes.txt").write_text("a file of the user's")
    done = run_cli("verify", tmp_path / "owt", "--eos-id", natural.eos_id)
    notes = [line for line in done.stdout.splitlines() if line.startswith("note: ")]
    assert "headers and indexes" not in done.stdout
    assert notes[0].startswith("note: nanogpt files: only their size was checked (a whole number of tokens)")
    val = tmp_path / "owt" / "val.bin"
    assert f"note: {val}: nanoGPT's validation split (the export's --val)" in done.stdout
    assert f"`streampack verify {val} --eos-id N`" in done.stdout
    unread = [n for n in notes if "not one of the nanogpt files" in n]
    assert len(unread) == 1 and "notes.txt" in unread[0]  # meta.pkl is read (its vocab_size)
    assert run_cli("verify", val, "--eos-id", natural.eos_id).stdout.startswith("note: nanogpt files: only")


@pytest.mark.filterwarnings("ignore::streampack.errors.DocumentBoundaryWarning")  # opened without eos_id
def test_nanogpt_bad_files_name_the_file_and_field(tmp_path: Path) -> None:
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "train.bin").write_bytes(b"\x01\x00\x02\x00\x03")
    with pytest.raises(CacheError, match=r"train\.bin: 5 bytes, not a whole number of 2-byte uint16 tokens"):
        streampack.open(tmp_path / "odd", eos_id=EOT)
    (tmp_path / "odd" / "train.bin").write_bytes(b"\x01\x00\x02\x00\x03\x00")
    with pytest.raises(CacheError, match=r"train\.bin: 6 bytes, not a whole number of 4-byte uint32 tokens"):
        streampack.open(tmp_path / "odd", dtype="uint32")
    with pytest.raises(OptionsError, match=r"train\.bin: eos_id=100,000 does not fit its uint16 tokens"):
        streampack.open(tmp_path / "odd", eos_id=100_000)
    with pytest.raises(OptionsError, match=r"pass eos_id= to find documents"):
        streampack.open(tmp_path / "odd", bos_id=EOT)
    (tmp_path / "odd" / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 7, "path": Path("x")}))
    with pytest.raises(CacheError, match=r"meta\.pkl: not a pickled dict of plain values .*pathlib"):
        streampack.open(tmp_path / "odd")
    (tmp_path / "odd" / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 7, "itos": {0: "a"}}))
    assert streampack.open(tmp_path / "odd").vocab_size == 7
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        CacheError, match=r"empty: not a streampack cache .*nanogpt: a folder with train\.bin"
    ):
        streampack.open(tmp_path / "empty")


# ----------------------------------------------------------------------------- OLMo


def dolma_memmap_write(path: Path, docs: list[list[int]], eos: int, max_tokens: int) -> None:
    """allenai/dolma's tokenizer output through ``memmap_writer.py``'s ``MemmapWriter``: each document's
    ids followed by the EOS (``Tokenizer.encode``), written into an ``np.memmap`` of ``max_tokens`` opened
    ``w+``, which is cut to the tokens written when it is closed (its ``__exit__`` rewrites the array at
    its written size)."""
    dtype = np.dtype(np.uint16)
    memmap = np.memmap(path, dtype=dtype, mode="w+", shape=(max_tokens,))
    written = 0
    for ids in docs:
        values = np.array([*ids, eos], dtype=dtype)
        memmap[written : written + len(values)] = values
        written += len(values)
    memmap.flush()
    del memmap
    os.truncate(path, written * dtype.itemsize)


def test_olmo_export_opens_as_its_documents(natural: streampack.Cache, tmp_path: Path) -> None:
    natural.export("olmo", tmp_path / "olmo")
    opened = streampack.open(tmp_path / "olmo")
    assert (opened.eos_id, opened.vocab_size) == (natural.eos_id, natural.vocab_size)
    assert opened.num_shards == natural.num_shards and not opened.has_loss_mask
    assert_docs(opened, docs_of(natural))
    np.testing.assert_array_equal(opened.sequences(512, overlap=1)[:], natural.sequences(512, overlap=1)[:])
    loader_runs(opened)
    # One token file opens alone, with eos_id=.
    lone = streampack.open(tmp_path / "olmo" / "token_ids_part_000002.npy", eos_id=natural.eos_id)
    first = int(natural.doc_starts[2])
    assert_docs(lone, docs_of(natural)[first : first + natural.table.num_docs[2]])


def test_olmo_sft_export_keeps_the_loss_mask(sft: streampack.Cache, tmp_path: Path) -> None:
    sft.export("olmo", tmp_path / "sft")
    # The same folder without olmo.json: the masks are found beside their token files by name.
    shutil.copytree(tmp_path / "sft", tmp_path / "bare", ignore=shutil.ignore_patterns("olmo.json"))
    for opened in (streampack.open(tmp_path / "sft"), streampack.open(tmp_path / "bare", eos_id=sft.eos_id)):
        assert opened.has_loss_mask
        assert_docs(opened, docs_of(sft))
        for i in range(sft.num_docs):
            np.testing.assert_array_equal(opened.doc_loss_mask(i), sft.doc_loss_mask(i))
        loader = streampack.Loader(opened.documents(64), batch_size=4, shuffle=False, output="dict", epochs=1)
        native = streampack.Loader(sft.documents(64), batch_size=4, shuffle=False, output="dict", epochs=1)
        batches = 0
        for ours, theirs in zip(loader, native, strict=True):
            np.testing.assert_array_equal(np.asarray(ours["labels"]), np.asarray(theirs["labels"]))
            batches += 1
        assert batches > 0


def test_olmo_dolma_memmaps_open_with_their_documents(encoded: list[list[int]], tmp_path: Path) -> None:
    (tmp_path / "dolma").mkdir()
    halves = [encoded[:25], encoded[25:]]
    for index, docs in enumerate(halves):
        dolma_memmap_write(tmp_path / "dolma" / f"part-{index}-00000.npy", docs, EOT, 1 << 20)
    opened = streampack.open(tmp_path / "dolma", eos_id=EOT)
    assert opened.num_shards == 2 and opened.dtype == np.uint16
    assert_docs(opened, [np.array([*ids, EOT]) for ids in encoded])
    loader_runs(opened)


def test_olmo_bad_files_name_the_file_and_field(sft: streampack.Cache, tmp_path: Path) -> None:
    sft.export("olmo", tmp_path / "good")

    def damaged(name: str) -> Path:
        shutil.copytree(tmp_path / "good", tmp_path / name)
        return tmp_path / name

    def config(folder: Path, **changes: object) -> Path:
        data = json.loads((folder / "olmo.json").read_text())
        (folder / "olmo.json").write_text(json.dumps({**data, **changes}))
        return folder

    folder = damaged("truncated")
    tokens = folder / "token_ids_part_000000.npy"
    tokens.write_bytes(tokens.read_bytes()[:-1])
    with pytest.raises(
        CacheError, match=r"token_ids_part_000000\.npy: .* not a whole number of 2-byte uint16"
    ):
        streampack.open(folder)
    folder = damaged("mask")
    mask = folder / "labels_mask_part_000000.npy"
    mask.write_bytes(mask.read_bytes()[:-3])
    n = sft.table.num_tokens[0]
    with pytest.raises(
        CacheError,
        match=rf"labels_mask_part_000000\.npy: {n - 3:,} bytes, .* one bool byte a token: {n:,} expected",
    ):
        streampack.open(folder)
    (damaged("nomask") / "labels_mask_part_000000.npy").unlink()
    with pytest.raises(CacheError, match=r"labels_mask_part_000000\.npy: missing; it should hold the label"):
        streampack.open(tmp_path / "nomask")
    with pytest.raises(
        CacheError, match=r"olmo\.json: label_mask_paths is \[\], expected null or a list of 1"
    ):
        streampack.open(config(damaged("masks"), label_mask_paths=[]))
    with pytest.raises(CacheError, match=r"token_ids_part_000009\.npy: missing"):
        streampack.open(config(damaged("paths"), paths=["token_ids_part_000009.npy"], label_mask_paths=None))
    with pytest.raises(
        CacheError,
        match=r"olmo\.json: Invalid enum value 'int64' - at `\$\.dtype`; .*dtype \(uint16 or uint32\)",
    ):
        streampack.open(config(damaged("dtype"), dtype="int64"))
    with pytest.raises(
        CacheError, match=r"olmo\.json: Expected `array`, got `null` - at `\$\.paths`; olmo\.json holds paths"
    ):
        streampack.open(config(damaged("nopaths"), paths=None))
    (damaged("json") / "olmo.json").write_text("{")
    with pytest.raises(CacheError, match=r"olmo\.json: not JSON \(.*\); olmo\.json holds paths"):
        streampack.open(tmp_path / "json")
    with pytest.raises(OptionsError, match=r"olmo\.json: dtype is 'uint16' there, but 'uint32' was given"):
        streampack.open(tmp_path / "good", dtype="uint32")
    np.save(tmp_path / "header.npy", np.arange(10, dtype=np.uint16))
    with pytest.raises(CacheError, match=r"header\.npy: starts with a NumPy \.npy header"):
        streampack.open(tmp_path / "header.npy", eos_id=1)
    with pytest.raises(OptionsError, match=r"none is known: pass eos_id="):
        streampack.open(tmp_path / "good" / "token_ids_part_000000.npy")


def test_olmo_json_counts_are_checked_against_the_token_files(
    natural: streampack.Cache, tmp_path: Path
) -> None:
    """B3: olmo.json's num_tokens and num_docs, the export's, are checked when the folder is opened (and so
    by verify): a token file cut at a document boundary, emptied, or with an EOS overwritten is refused,
    naming olmo.json and both counts. An EOS id inside a document (a chat template's) is more documents, as
    OLMo-core reads them too: no damage."""
    natural.export("olmo", tmp_path / "good", progress=False)
    eos, total, docs = natural.eos_id, natural.num_tokens, natural.num_docs

    def damaged(name: str) -> tuple[Path, Path]:
        shutil.copytree(tmp_path / "good", tmp_path / name)
        return tmp_path / name, tmp_path / name / "token_ids_part_000000.npy"

    cut = int(natural.shard_offsets(0)[9])  # the end of document 9
    left = cut + int(natural.table.num_tokens[1:].sum())
    folder, tokens = damaged("cut")
    os.truncate(tokens, cut * 2)
    counts = rf"olmo\.json: num_tokens is {total:,} \(and num_docs {docs}\), but its token files hold "
    with pytest.raises(CacheError, match=counts + rf"{left:,} tokens: a file was cut"):
        streampack.open(folder)
    report = streampack.verify(folder)
    assert not report.ok and f"num_tokens is {total:,}" in report.problems[0]
    os.truncate(tokens, 0)
    with pytest.raises(CacheError, match=counts + rf"{left - cut:,} tokens"):
        streampack.open(folder)
    folder, tokens = damaged("eos")
    stream = np.memmap(tokens, dtype=np.uint16, mode="r+")
    stream[int(np.flatnonzero(stream == eos)[0])] = 13
    stream.flush()
    del stream
    with pytest.raises(
        CacheError, match=rf"num_docs is {docs:,}, but its token files hold {docs - 1:,} documents"
    ):
        streampack.open(folder)
    folder, tokens = damaged("more")
    stream = np.memmap(tokens, dtype=np.uint16, mode="r+")
    stream[1] = eos
    stream.flush()
    del stream
    assert streampack.open(folder).num_docs == docs + 1
    # Its verify names dolma's .csv.gz sidecars, written by the export, as what they are.
    notes = streampack.verify(tmp_path / "good").notes
    assert not [n for n in notes if "not one of the olmo files" in n]
    assert any(
        "token_ids_part_000000.csv.gz: dolma's document index of token_ids_part_000000.npy" in n
        for n in notes
    )
    assert notes[0].startswith("olmo files: olmo.json was checked where there is one")


def test_a_scan_of_a_file_cut_short_since_it_was_opened_says_so(tmp_path: Path) -> None:
    path = tmp_path / "train.bin"
    np.arange(1000, dtype="<u2").tofile(path)
    span = scanning.TokenSpan(path, np.dtype("<u2"), 0, 1000)
    np.testing.assert_array_equal(np.concatenate([c.copy() for _, c in span.chunks(300)]), np.arange(1000))
    assert span[-1] == 999 and span[0] == 0
    with open(path, "r+b") as f:
        f.truncate(1500)
    with pytest.raises(CacheError, match=r"train\.bin: ended at byte 1,500, before the 1,000 tokens"):
        scanning.Boundary(7).ends(span)

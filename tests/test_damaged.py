"""Damaged and hostile caches are refused (by open, cheaply) or reported (by verify, fully)."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import streampack
from streampack.errors import CacheError
from streampack.format import with_checksum
from tests.conftest import as_version_1, run_cli, set_shard_checksum, write_jsonl

shard_checks = importlib.import_module("streampack.reader.shardchecks")  # where verify reads in chunks


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pristine")
    src = write_jsonl(root / "in.jsonl", [{"text": f"doc {i} " * (i % 50)} for i in range(4000)])
    streampack.build(src, root / "cache", unit_bytes=1 << 16, workers=1)
    assert streampack.open(root / "cache").num_shards >= 3
    return root / "cache"


@pytest.fixture
def cache(pristine: Path, tmp_path: Path) -> Path:
    shutil.copytree(pristine, tmp_path / "cache")
    return tmp_path / "cache"


def edit_manifest(cache: Path, change: Callable[[dict], object]) -> None:
    """Change the manifest and give it a matching checksum: a manifest that is sound but lies."""
    manifest = json.loads((cache / "manifest.json").read_text())
    change(manifest)
    (cache / "manifest.json").write_text(json.dumps(with_checksum(manifest)))


def assert_refused(cache: Path, message: str) -> None:
    with pytest.raises(CacheError, match=message):
        streampack.open(cache)
    result = run_cli("verify", cache, check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr


def assert_refused_at_first_read(cache: Path, shard: int, message: str) -> None:
    """Open does not look at shard files (10^5 of them open in milliseconds): the first read of the shard
    refuses it, before anything is served from it, and so does verify."""
    opened = streampack.open(cache)
    opened.doc(0 if shard else opened.num_docs - 1)  # the other shards read fine
    first = int(opened.doc_starts[shard])
    with pytest.raises(CacheError, match=message):
        opened.doc(first)
    if ".tokens" in message:  # and no sample is made from its tokens (samples read no offsets)
        samples = opened.sequences(16)
        with pytest.raises(CacheError, match=message):
            samples[int(opened.token_starts[shard]) // 16 + 1]
    result = run_cli("verify", cache, check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert re.search(message, result.stderr), result.stderr


def assert_verify_finds(cache: Path, message: str) -> None:
    report = streampack.verify(cache)
    assert not report.ok and any(message in p for p in report.problems), report.problems
    result = run_cli("verify", cache, check=False)
    assert result.returncode == 1 and message in result.stderr


def test_truncated_shard(cache: Path) -> None:
    path = cache / "shards" / "000001.tokens"
    path.write_bytes(path.read_bytes()[:-2])
    assert_refused_at_first_read(cache, 1, "000001.tokens: .* the cache is damaged or truncated")


def test_missing_shard(cache: Path) -> None:
    (cache / "shards" / "000002.offsets").unlink()
    assert_refused_at_first_read(cache, 2, "000002.offsets: shard file missing")


def test_flipped_byte(cache: Path) -> None:
    path = cache / "shards" / "000000.tokens"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    streampack.open(cache)  # sizes are right: open's cheap check passes, verify's checksum does not
    assert_verify_finds(cache, "000000.tokens: checksum")


def test_offsets_not_monotone(cache: Path) -> None:
    path = cache / "shards" / "000001.offsets"
    offsets = np.fromfile(path, dtype="<u8")
    offsets[[3, 4]] = offsets[[4, 3]]
    offsets.tofile(path)
    assert_verify_finds(cache, "offsets not monotone at document 4")


def test_token_out_of_range(cache: Path) -> None:
    path = cache / "shards" / "000000.tokens"
    tokens = np.fromfile(path, dtype="<u2")
    tokens[10] = 300  # the bytes tokenizer's vocab is 257
    tokens.tofile(path)
    assert_verify_finds(cache, "token 10 is 300, not below the vocab size 257")


def test_verify_checks_in_chunks_what_the_whole_file_holds(
    cache: Path, pristine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shard_checks, "_CHUNK_ITEMS", 7)  # many chunks, none aligned with anything
    assert streampack.verify(pristine).ok  # chunked checksums equal the manifest's whole-file ones
    path = cache / "shards" / "000001.tokens"
    tokens = np.fromfile(path, dtype="<u2")
    tokens[[30, 40]] = 300  # the first bad token lies in the fifth chunk
    tokens.tofile(path)
    report = streampack.verify(cache)
    assert any("token 30 is 300, not below the vocab size 257" in p for p in report.problems), report.problems
    assert any("000001.tokens: checksum" in p for p in report.problems)


def test_manifest_disagrees_with_files(cache: Path) -> None:
    def grow(m: dict) -> None:
        m["shards"]["num_tokens"][0] += 1
        m["num_tokens"] += 1

    edit_manifest(cache, grow)
    assert_refused_at_first_read(cache, 0, "000000.tokens: .* bytes, but the manifest says")


def test_format_version_from_the_future(cache: Path) -> None:
    edit_manifest(cache, lambda m: m.update(format_version=99))
    assert_refused(cache, "format version 99 is not supported")


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "000001/../../x", "", 7])
def test_shard_paths_outside_the_cache_are_refused(cache: Path, name: object) -> None:
    """Version 2 names shards by their index; version 1 wrote names, which are checked."""
    version_1 = as_version_1(json.loads((cache / "manifest.json").read_text()))
    version_1["shards"][0]["name"] = name
    (cache / "manifest.json").write_text(json.dumps(with_checksum(version_1)))
    assert_refused(cache, "invalid shard name")


def test_symlink_out_of_the_cache_is_refused(cache: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.tokens"
    shutil.copy(cache / "shards" / "000000.tokens", outside)
    (cache / "shards" / "000000.tokens").unlink()
    os.symlink(outside, cache / "shards" / "000000.tokens")
    assert_refused_at_first_read(cache, 0, "outside the cache directory")


def test_oversized_manifest_is_refused_before_parsing(cache: Path) -> None:
    with open(cache / "manifest.json", "ab") as f:
        f.truncate(65 << 20)
    assert_refused(cache, "over the .* byte limit")


def test_every_bit_flip_of_a_manifest_is_found(tmp_path: Path) -> None:
    """C19: no field of the manifest is outside a checksum, so no single flipped bit reads as sound."""
    cache = tmp_path / "cache"
    streampack.build(streampack.Documents(["a", "bc"]), cache)
    manifest = cache / "manifest.json"
    original = manifest.read_bytes()
    assert streampack.verify(cache).ok
    missed = []
    for bit in range(len(original) * 8):
        flipped = bytearray(original)
        flipped[bit // 8] ^= 1 << (bit % 8)
        manifest.write_bytes(bytes(flipped))
        report = streampack.verify(cache)
        if report.ok:
            missed.append((bit // 8, original[bit // 8 - 10 : bit // 8 + 10]))
        elif not any("manifest" in p for p in report.problems):
            missed.append((bit // 8, report.problems))
    assert not missed, f"{len(missed)} of {len(original) * 8} flips not found in the manifest: {missed[:3]}"


def test_manifest_checksum_names_both_values(cache: Path) -> None:
    text = (cache / "manifest.json").read_text()
    (cache / "manifest.json").write_text(text.replace('"text_field": "text"', '"text_field": "body"'))
    checksums = r"\(recorded 'crc32:[0-9a-f]{8}', content crc32:[0-9a-f]{8}\)"
    assert_refused(cache, r"manifest\.json: the manifest's content does not match its checksum " + checksums)


def test_a_manifest_written_before_checksums_is_accepted(cache: Path) -> None:
    manifest = json.loads((cache / "manifest.json").read_text())
    newer = ("checksum", "empty_docs", "inexact_cuts", "ignored_inputs", "bos", "loss_mask", "engines")
    for name in newer:
        del manifest[name]
    (cache / "manifest.json").write_text(json.dumps(manifest))
    assert streampack.verify(cache).ok
    manifest["checksun"] = "crc32:00000000"  # the field's name damaged
    (cache / "manifest.json").write_text(json.dumps(manifest))
    assert_refused(cache, "no checksum and an unknown field 'checksun'")


FUZZ_EXAMPLES = int(os.environ.get("STREAMPACK_FUZZ_EXAMPLES", "150"))  # the README's figure uses 5000


@settings(
    max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_fuzzed_manifests_and_ledgers_raise_only_cache_errors(
    pristine: Path, tmp_path: Path, data: st.DataObject
) -> None:
    target = data.draw(st.sampled_from(["manifest.json", "ledger/000001.json"]))
    original = (pristine / target).read_bytes()
    mutation = data.draw(st.sampled_from(["flip", "truncate", "splice", "json"]))
    if mutation == "flip":
        raw = bytearray(original)
        for position in data.draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=8)):
            raw[position] = data.draw(st.integers(0, 255))
        mutated = bytes(raw)
    elif mutation == "truncate":
        mutated = original[: data.draw(st.integers(0, len(original) - 1))]
    elif mutation == "splice":
        at = data.draw(st.integers(0, len(original)))
        mutated = original[:at] + data.draw(st.binary(max_size=40)) + original[at:]
    else:
        doc = json.loads(original)
        key = data.draw(st.sampled_from(sorted(doc)))
        doc[key] = data.draw(
            st.one_of(
                st.none(),
                st.integers(),
                st.text(max_size=5),
                st.lists(st.integers(), max_size=3),
                st.booleans(),
            )
        )
        mutated = json.dumps(doc).encode()
    case = tmp_path / f"case{abs(hash(mutated))}"
    shutil.copytree(pristine, case)
    (case / target).write_bytes(mutated)
    try:
        cache = streampack.open(case, allow_incomplete=True)
        cache.doc(cache.num_docs - 1) if cache.num_docs else None
    except CacheError:
        pass
    report = streampack.verify(case)
    assert isinstance(report.ok, bool)
    shutil.rmtree(case)


def test_missing_eos_is_found_even_with_matching_checksums(cache: Path) -> None:
    from streampack.store.files import file_checksum

    path = cache / "shards" / "000001.tokens"
    tokens = np.fromfile(path, dtype="<u2")
    ends = np.fromfile(cache / "shards" / "000001.offsets", dtype="<u8")
    tokens[int(ends[2]) - 1] = ord("x")  # document 2 of the shard loses its EOS
    tokens.tofile(path)
    edit_manifest(cache, lambda m: set_shard_checksum(m, 1, "tokens_crc32", file_checksum(path)))
    first_doc = streampack.open(cache).doc_starts[1]
    assert_verify_finds(cache, f"document {first_doc + 2} (and 0 more) does not end with EOS 256")


def poke_tokens(cache: Path, shard: int, values: dict[int, int]) -> np.ndarray:
    """Set tokens of a shard (by position) and give the manifest its new checksum; return its offsets."""
    from streampack.store.files import file_checksum

    path = cache / "shards" / f"{shard:06d}.tokens"
    tokens = np.fromfile(path, dtype="<u2")
    tokens[list(values)] = list(values.values())
    tokens.tofile(path)
    edit_manifest(cache, lambda m: set_shard_checksum(m, shard, "tokens_crc32", file_checksum(path)))
    return np.fromfile(cache / "shards" / f"{shard:06d}.offsets", dtype="<u8")


@pytest.mark.parametrize("chunk_items", [8 << 20, 7])
def test_eos_ids_inside_documents_are_found(
    cache: Path, chunk_items: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A1: an EOS id anywhere but at its document's end splits the document for EOS-based readers."""
    monkeypatch.setattr(shard_checks, "_CHUNK_ITEMS", chunk_items)  # 7: the ids fall in other chunks
    ends = np.fromfile(cache / "shards" / "000001.offsets", dtype="<u8").astype(int)
    long_docs = [i for i in range(1, len(ends)) if ends[i] - ends[i - 1] > 20]
    a, b = long_docs[0], long_docs[1]
    poke_tokens(cache, 1, {ends[a - 1] + 1: 256, ends[b - 1]: 256, ends[b] - 2: 256})
    first = streampack.open(cache).doc_starts[1]
    length_a, length_b = ends[a] - ends[a - 1], ends[b] - ends[b - 1]
    assert_verify_finds(
        cache,
        f"000001.tokens: 3 EOS ids 256 inside documents, not at their end: document {first + a} at token 1 "
        f"of {length_a}; document {first + b} at token 0 of {length_b}; document {first + b} at token "
        f"{length_b - 2} of {length_b}. The text held the EOS token's string",
    )


def test_eos_ids_inside_documents_are_counted_and_the_first_shown(cache: Path) -> None:
    ends = poke_tokens(cache, 0, {})
    start = int(ends[9])  # document 10
    poke_tokens(cache, 0, {start + i: 256 for i in range(5)})
    assert_verify_finds(cache, "5 EOS ids 256 inside documents, not at their end: document 10 at token 0 of")
    assert_verify_finds(cache, f"document 10 at token 2 of {int(ends[10] - ends[9])} (the first 3). The text")


def test_eos_ids_inside_documents_are_allowed_when_special_tokens_are_parsed(cache: Path) -> None:
    ends = poke_tokens(cache, 0, {})
    poke_tokens(cache, 0, {int(ends[9]) + 1: 256})
    assert not streampack.verify(cache).ok
    edit_manifest(cache, lambda m: m["settings"].update(special_tokens="parse"))
    assert streampack.verify(cache).ok


def test_resuming_onto_a_shard_shorter_than_its_ledger_is_refused(pristine: Path, tmp_path: Path) -> None:
    """A partial shard cut below what the ledger committed (damaged after the crash) is not built on."""
    cache = tmp_path / "cache"
    shutil.copytree(pristine, cache)
    edit_manifest(cache, lambda m: m.update(complete=False))
    entry = cache / "ledger" / "000001.json"
    entry.write_text(json.dumps(with_checksum({**json.loads(entry.read_text()), "done": False})))
    tokens = cache / "shards" / "000001.tokens"
    os.truncate(tokens, tokens.stat().st_size // 2)
    with pytest.raises(CacheError, match=r"000001\.tokens holds .* bytes but the ledger committed"):
        streampack.build(pristine.parent / "in.jsonl", cache, unit_bytes=1 << 16, workers=1)

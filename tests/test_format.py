"""The documented format is the contract: docs/FORMAT.md's numpy-only reader must read our caches."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

import streampack

FORMAT_DOC = Path(__file__).resolve().parents[1] / "docs" / "FORMAT.md"


def test_format_doc_reader_reads_a_cache(tmp_path: Path) -> None:
    docs = ["first", "", "third ü", "x" * 5000]
    streampack.build(streampack.Documents(docs), tmp_path / "c", unit_bytes=1 << 16)
    code = re.search(r"```python\n(.*?)```", FORMAT_DOC.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(FORMAT_DOC), "exec"), namespace)
    read = list(namespace["read_cache"](tmp_path / "c"))
    assert [d.tolist() for d in read] == [[*t.encode(), 256] for t in docs if t]  # no empty documents
    assert all(d.dtype == np.dtype("<u2") for d in read)


def test_manifest_checksum_follows_the_documented_recipe(tmp_path: Path) -> None:
    import json
    import zlib

    streampack.build(streampack.Documents(["Ünï 🙂", "b"]), tmp_path / "c")
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    recorded = manifest.pop("checksum")
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert 'sort_keys=True, separators=(",", ":"), ensure_ascii=False' in FORMAT_DOC.read_text()
    assert recorded == f"crc32:{zlib.crc32(canonical.encode()):08x}"


def test_a_version_1_manifest_with_its_row_table_reads_the_same_samples(tmp_path: Path) -> None:
    """Caches built before the column table (format version 1) open, read and verify as before."""
    import json
    import shutil

    from streampack.format import with_checksum
    from tests.conftest import as_version_1, write_jsonl

    src = write_jsonl(tmp_path / "in.jsonl", [{"text": f"doc {i} " * (i % 50)} for i in range(4000)])
    streampack.build(src, tmp_path / "new", unit_bytes=1 << 16, workers=1)
    shutil.copytree(tmp_path / "new", tmp_path / "old")
    manifest = json.loads((tmp_path / "new" / "manifest.json").read_text())
    assert manifest["format_version"] == 2 and isinstance(manifest["shards"]["tokens_crc32"], str)
    (tmp_path / "old" / "manifest.json").write_text(json.dumps(with_checksum(as_version_1(manifest))))
    new, old = streampack.open(tmp_path / "new"), streampack.open(tmp_path / "old")
    assert old.num_shards == new.num_shards > 3 and old.shards == new.shards
    assert old.shards[1].name == "000001" and old.shards[1].tokens_checksum.startswith("crc32:")
    assert old.num_docs == new.num_docs
    assert all(np.array_equal(old.doc(i), new.doc(i)) for i in range(new.num_docs))
    assert old.content_digest == new.content_digest  # checkpoints and plans do not tell them apart
    old_samples, new_samples = old.sequences(16), new.sequences(16)
    assert np.array_equal(old_samples[range(len(old_samples))], new_samples[range(len(new_samples))])
    assert streampack.verify(tmp_path / "old").ok


def test_upgrade_rewrites_a_version_1_manifest_and_checkpoints_still_resume(tmp_path: Path) -> None:
    """`streampack upgrade` (a real subprocess) rewrites a version 1 manifest as version 2: the same cache,
    content digest and checkpoints; a second run has nothing to do; a non-cache is refused."""
    import json

    from streampack.format import with_checksum
    from tests.conftest import as_version_1, run_cli, write_jsonl

    src = write_jsonl(tmp_path / "in.jsonl", [{"text": f"doc {i} " * (i % 50)} for i in range(3000)])
    streampack.build(src, tmp_path / "c", unit_bytes=1 << 16, workers=1)
    new = json.loads((tmp_path / "c" / "manifest.json").read_text())
    shards_before = {p.name: p.read_bytes() for p in (tmp_path / "c" / "shards").iterdir()}
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(with_checksum(as_version_1(new))))
    old = streampack.open(tmp_path / "c")
    loader = streampack.Loader(old.sequences(16), batch_size=4, seed=2)
    next(iter(loader))
    state = loader.state_dict()

    result = run_cli("upgrade", tmp_path / "c")
    assert "upgraded from format version 1 to 2" in result.stdout
    assert json.loads((tmp_path / "c" / "manifest.json").read_text()) == new  # as the build wrote it
    assert {p.name: p.read_bytes() for p in (tmp_path / "c" / "shards").iterdir()} == shards_before
    upgraded = streampack.open(tmp_path / "c")
    assert upgraded.content_digest == old.content_digest and streampack.verify(tmp_path / "c").ok
    resumed = streampack.Loader(upgraded.sequences(16), batch_size=4, seed=2)
    resumed.load_state_dict(state)
    assert np.array_equal(next(iter(resumed)), loader.batch(4))
    assert "already format version 2" in run_cli("upgrade", tmp_path / "c").stdout
    refused = run_cli("upgrade", tmp_path, check=False)
    assert refused.returncode == 1 and "not a streampack cache (no manifest.json)" in refused.stderr


def test_the_shard_table_is_columns(tmp_path: Path) -> None:
    """Version 2: counts as lists, each checksum column one hex string, names and units from the index."""
    import json
    import zlib

    streampack.build(streampack.Documents(["one", "two"]), tmp_path / "c")
    table = json.loads((tmp_path / "c" / "manifest.json").read_text())["shards"]
    tokens = (tmp_path / "c" / "shards" / "000000.tokens").read_bytes()
    assert table["num_docs"] == [2] and table["num_tokens"] == [len(tokens) // 2]
    assert table["tokens_crc32"] == f"{zlib.crc32(tokens):08x}" and "mask_crc32" not in table

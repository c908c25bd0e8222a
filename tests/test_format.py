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

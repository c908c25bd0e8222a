"""Write token caches straight from numpy arrays, for tests and benchmarks (not a build path).

The files follow docs/FORMAT.md. :func:`write_cache` records every shard's checksums and ledger entry;
:func:`write_random_cache` records none (``streampack verify`` refuses it), which writes gigabytes at disk
speed in flat memory.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec
import numpy as np

from streampack.format.ledger import LedgerEntry
from streampack.format.manifest import Manifest, ShardInfo, ShardTable
from streampack.format.names import (
    LEDGER_DIR,
    MANIFEST,
    SHARD_DIR,
    checksum_text,
    ledger_key,
    offsets_path,
    shard_name,
    token_dtype,
    tokens_path,
    with_checksum,
)
from streampack.format.sections import BuildSettings, EosPolicy, TokenizerInfo
from streampack.store import encode_json
from streampack.store.files import load_manifest, write_manifest

_CHUNK_TOKENS = 1 << 25


def write_cache(
    root: str | Path,
    shards: Iterable[tuple[np.ndarray, np.ndarray]],
    *,
    vocab_size: int,
    eos_id: int,
    units: Sequence[str] | None = None,
) -> Path:
    """Write a complete cache whose shard ``k`` holds the given tokens and document end offsets.

    Args:
        root: the cache directory to create.
        shards: ``(tokens, doc_ends)`` per shard: token ids, and the cumulative end offset of each
            document (the last equal to ``len(tokens)``).
        vocab_size: every id is below it; it decides the token dtype.
        eos_id: the EOS id recorded in the manifest.
        units: the description of each shard's work unit (``synthetic:K`` by default).

    Returns:
        The cache directory.
    """
    root = Path(root)
    (root / SHARD_DIR).mkdir(parents=True)
    dtype = token_dtype(vocab_size)
    infos = []
    for index, (tokens, ends) in enumerate(shards):
        name = shard_name(index)
        token_bytes = np.asarray(tokens).astype(dtype).tobytes()
        offset_bytes = np.asarray(ends).astype("<u8").tobytes()
        tokens_path(root, name).write_bytes(token_bytes)
        offsets_path(root, name).write_bytes(offset_bytes)
        unit = f"synthetic:{index}" if units is None else units[index]
        checksums = checksum_text(zlib.crc32(token_bytes)), checksum_text(zlib.crc32(offset_bytes))
        infos.append(ShardInfo(name, unit, len(ends), len(tokens), *checksums))
        entry = LedgerEntry(unit, len(ends), len(ends), len(tokens), 0, True, *checksums)
        (root / LEDGER_DIR).mkdir(exist_ok=True)
        (root / ledger_key(name)).write_bytes(encode_json(with_checksum(msgspec.structs.asdict(entry))))
    _write_manifest(root, infos, vocab_size, eos_id)
    return root


def write_random_cache(
    root: str | Path,
    num_tokens: int,
    *,
    num_shards: int = 1,
    mean_doc_tokens: int = 600,
    vocab_size: int = 50257,
    seed: int = 0,
) -> Path:
    """Write a cache of ``num_tokens`` random tokens in ``num_shards`` shards, in flat memory.

    Documents have geometric lengths (at least 1 token) and end with the EOS id ``vocab_size - 1``; other
    ids are uniform in ``[0, vocab_size - 1)``.

    Args:
        root: the cache directory to create.
        num_tokens: total tokens.
        num_shards: shards of (nearly) equal size.
        mean_doc_tokens: mean document length, EOS included.
        vocab_size: size of the vocabulary.
        seed: seed of the random generator.

    Returns:
        The cache directory.
    """
    root = Path(root)
    (root / SHARD_DIR).mkdir(parents=True)
    rng = np.random.default_rng(seed)
    dtype = token_dtype(vocab_size)
    bounds = np.linspace(0, num_tokens, num_shards + 1).astype(np.int64)
    infos = []
    for index in range(num_shards):
        name = shard_name(index)
        size = int(bounds[index + 1] - bounds[index])
        num_docs = _write_random_shard(root, name, size, rng, dtype, vocab_size - 1, mean_doc_tokens)
        infos.append(ShardInfo(name, f"synthetic:{index}", num_docs, size, "", ""))
    _write_manifest(root, infos, vocab_size, vocab_size - 1)
    return root


def _write_manifest(root: Path, shards: list[ShardInfo], vocab_size: int, eos_id: int) -> None:
    manifest = Manifest(
        tokenizer=TokenizerInfo("synthetic", "synthetic", vocab_size, sha256=""),
        dtype=token_dtype(vocab_size).name,
        eos=EosPolicy(True, eos_id),
        settings=BuildSettings.from_json({"synthetic": True}),  # none of a build's settings
        inputs=[],
        units=[s.unit for s in shards],
        complete=True,
        table=ShardTable.from_rows(shards),
    )
    write_manifest(root, manifest)


def _write_random_shard(
    root: Path, name: str, size: int, rng: np.random.Generator, dtype: np.dtype, eos: int, mean: int
) -> int:
    """Write one shard of ``size`` random tokens, a chunk at a time; return its number of documents."""
    ends = []
    with open(tokens_path(root, name), "wb") as tokens:
        position = 0
        while position < size:
            chunk = min(_CHUNK_TOKENS, size - position)
            lengths = rng.geometric(1 / mean, size=chunk // mean * 2 + 16)
            chunk_ends = np.cumsum(lengths)
            chunk_ends = np.append(chunk_ends[chunk_ends < chunk], chunk)  # documents end with their chunk
            ids = rng.integers(0, eos, size=chunk, dtype=dtype)
            ids[chunk_ends - 1] = eos
            tokens.write(ids.tobytes())
            ends.append((chunk_ends + position).astype("<u8"))
            position += chunk
    offsets = np.concatenate(ends) if ends else np.zeros(0, dtype="<u8")
    offsets.tofile(offsets_path(root, name))
    return len(offsets)


def rewrite_as_version_1(root: str | Path) -> None:
    """Rewrite a cache's manifest as format version 1 wrote it (the shard table as rows)."""
    manifest = load_manifest(Path(root))
    doc = {**manifest.to_json(), "format_version": 1, "shards": [s.to_json() for s in manifest.shards]}
    (Path(root) / MANIFEST).write_bytes(encode_json(with_checksum(doc)))

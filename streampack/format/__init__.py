"""The on-disk token cache: what a cache *is*, and nothing about where it is kept.

A cache is a directory::

    manifest.json          format version, tokenizer fingerprint, dtype, EOS and BOS policies, inputs, shards
    ledger/NNNNNN.json     build progress of work unit NNNNNN (committed records, docs, tokens)
    shards/NNNNNN.tokens   flat little-endian token ids (dtype from the manifest)
    shards/NNNNNN.offsets  little-endian uint64 cumulative document end offsets, one per document
    shards/NNNNNN.mask     SFT builds only: uint8 loss mask, one byte per token (1: a training target)
    build.lock             present while a build runs (holds its pid)

docs/FORMAT.md documents every field; everything can be read with numpy and json alone. The package is
pure (it imports nothing of streampack's but :mod:`streampack.errors`); reading and writing these files
through a store is :mod:`streampack.store.files`'s.
"""

from __future__ import annotations

from streampack.format.manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    NO_BOS,
    READABLE_VERSIONS,
    Manifest,
    ShardInfo,
    ShardTable,
    build_digest,
    build_identity,
    parse_manifest,
)
from streampack.format.names import (
    LAYOUT_DIR,
    LEDGER_DIR,
    LOCK,
    MANIFEST,
    OFFSET_DTYPE,
    SHARD_DIR,
    checked_shard_name,
    checksum_text,
    content_checksum,
    dtype_name,
    ledger_key,
    manifest_checksum,
    mask_key,
    mask_path,
    offsets_key,
    offsets_path,
    shard_name,
    token_dtype,
    tokens_key,
    tokens_path,
    with_checksum,
)
from streampack.format.sections import (
    BosPolicy,
    BuildSettings,
    EngineRecord,
    EosPolicy,
    IgnoredInputs,
    InputRecord,
    TokenizerInfo,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LAYOUT_DIR",
    "LEDGER_DIR",
    "LOCK",
    "MANIFEST",
    "NO_BOS",
    "OFFSET_DTYPE",
    "READABLE_VERSIONS",
    "SHARD_DIR",
    "BosPolicy",
    "BuildSettings",
    "EngineRecord",
    "EosPolicy",
    "IgnoredInputs",
    "InputRecord",
    "Manifest",
    "ShardInfo",
    "ShardTable",
    "TokenizerInfo",
    "build_digest",
    "build_identity",
    "checked_shard_name",
    "checksum_text",
    "content_checksum",
    "dtype_name",
    "ledger_key",
    "manifest_checksum",
    "mask_key",
    "mask_path",
    "offsets_key",
    "offsets_path",
    "parse_manifest",
    "shard_name",
    "token_dtype",
    "tokens_key",
    "tokens_path",
    "with_checksum",
]

"""The on-disk token cache: file layout and manifest schema (the I/O is :mod:`streampack.store`'s).

A cache is a directory::

    manifest.json          format version, tokenizer fingerprint, dtype, EOS and BOS policies, inputs, shards
    ledger/NNNNNN.json     build progress of work unit NNNNNN (committed records, docs, tokens)
    shards/NNNNNN.tokens   flat little-endian token ids (dtype from the manifest)
    shards/NNNNNN.offsets  little-endian uint64 cumulative document end offsets, one per document
    shards/NNNNNN.mask     SFT builds only: uint8 loss mask, one byte per token (1: a training target)
    build.lock             present while a build runs (holds its pid)

docs/FORMAT.md documents every field; everything can be read with numpy and json alone.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from streampack.errors import CacheError
from streampack.store import LocalStore, Store, crc32_file, encode_json

FORMAT_NAME = "streampack-cache"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LEDGER_DIR = "ledger"
SHARD_DIR = "shards"
LAYOUT_DIR = "layouts"  # sample plans derived from the shards (streampack.packing); safe to delete
LOCK = "build.lock"
OFFSET_DTYPE = np.dtype("<u8")
_SHARD_NAME = re.compile(r"^[0-9]{6}$")
NO_BOS: dict[str, Any] = {"prepend": False, "id": None}


def token_dtype(vocab_size: int) -> np.dtype:
    """Return the smallest little-endian unsigned dtype that holds ids ``0 .. vocab_size - 1``."""
    if vocab_size <= 1 << 16:
        return np.dtype("<u2")
    if vocab_size <= 1 << 32:
        return np.dtype("<u4")
    raise CacheError(f"vocab size {vocab_size} does not fit in uint32")


def dtype_name(dtype: np.dtype) -> str:
    """Return the manifest name of a token dtype (``uint16`` or ``uint32``)."""
    return np.dtype(dtype).name


def shard_name(unit_index: int) -> str:
    """Return the file stem of the shard written by work unit ``unit_index``."""
    return f"{unit_index:06d}"


def tokens_key(name: str) -> str:
    """Store key of a shard's token file."""
    return f"{SHARD_DIR}/{name}.tokens"


def offsets_key(name: str) -> str:
    """Store key of a shard's offsets file."""
    return f"{SHARD_DIR}/{name}.offsets"


def mask_key(name: str) -> str:
    """Store key of a shard's loss mask file (SFT builds only)."""
    return f"{SHARD_DIR}/{name}.mask"


def ledger_key(name: str) -> str:
    """Store key of the ledger entry of shard ``name``."""
    return f"{LEDGER_DIR}/{name}.json"


def tokens_path(root: Path, name: str) -> Path:
    """Path of a shard's token file."""
    return root / tokens_key(name)


def offsets_path(root: Path, name: str) -> Path:
    """Path of a shard's offsets file."""
    return root / offsets_key(name)


def mask_path(root: Path, name: str) -> Path:
    """Path of a shard's loss mask file (SFT builds only)."""
    return root / mask_key(name)


def checked_shard_name(name: object) -> str:
    """Validate a shard name read from a manifest or ledger; a name is six digits, never a path."""
    if not isinstance(name, str) or not _SHARD_NAME.match(name):
        raise CacheError(f"invalid shard name {name!r} in the manifest: expected six digits like '000042'")
    return name


def file_checksum(path: Path, length: int | None = None) -> str:
    """CRC-32 of the first ``length`` bytes of a file (all of it by default), as ``crc32:xxxxxxxx``.

    CRC-32 detects damage (truncation, flipped bytes) at memory speed; it is not a defence against
    tampering, which the reader handles by never trusting paths or sizes from the manifest.
    """
    return checksum_text(crc32_file(path, length))


def checksum_text(crc: int) -> str:
    """A CRC-32 as the manifest writes it: ``crc32:xxxxxxxx``."""
    return f"crc32:{crc:08x}"


@dataclass(frozen=True)
class ShardInfo:
    """One row of the manifest's shard table."""

    name: str
    unit: str
    num_docs: int
    num_tokens: int
    tokens_checksum: str
    offsets_checksum: str
    mask_checksum: str | None = None  # None: the cache has no loss mask

    def to_json(self) -> dict[str, Any]:
        """The manifest representation of this shard."""
        shard = {
            "name": self.name,
            "unit": self.unit,
            "num_docs": self.num_docs,
            "num_tokens": self.num_tokens,
            "tokens_checksum": self.tokens_checksum,
            "offsets_checksum": self.offsets_checksum,
        }
        if self.mask_checksum is not None:
            shard["mask_checksum"] = self.mask_checksum
        return shard


@dataclass(frozen=True)
class Manifest:
    """The parsed ``manifest.json`` of a cache.

    ``complete`` is false while a build runs (or after it was interrupted): the shard table is then empty
    and the committed prefix is described by the ledger.
    """

    tokenizer: dict[str, Any]
    dtype: str
    eos: dict[str, Any]
    settings: dict[str, Any]
    inputs: list[dict[str, Any]]
    units: list[str]
    complete: bool = False
    shards: list[ShardInfo] = field(default_factory=list)
    skipped_records: int = 0
    empty_docs: int = 0
    inexact_cuts: int = 0
    ignored_inputs: dict[str, Any] = field(default_factory=dict)
    bos: dict[str, Any] = field(default_factory=lambda: dict(NO_BOS))
    loss_mask: bool = False  # an SFT build: every shard has a .mask file
    # Informational, not compared on resume (every engine gives the same ids): the engines that computed
    # the ids, one entry per distinct engine and verification over the runs that built the cache.
    engines: list[dict[str, Any]] = field(default_factory=list)

    @property
    def vocab_size(self) -> int:
        """Number of token ids of the tokenizer (every id in the cache is below it)."""
        return int(self.tokenizer["vocab_size"])

    @property
    def num_docs(self) -> int:
        """Documents in the complete cache."""
        return sum(s.num_docs for s in self.shards)

    @property
    def num_tokens(self) -> int:
        """Tokens in the complete cache."""
        return sum(s.num_tokens for s in self.shards)

    def build_config(self) -> dict[str, Any]:
        """The settings a resumed build must share with this cache."""
        return {
            "tokenizer": self.tokenizer,
            "dtype": self.dtype,
            "eos": self.eos,
            "bos": self.bos,
            "settings": self.settings,
        }

    def to_json(self) -> dict[str, Any]:
        """The JSON document written to ``manifest.json`` (which :meth:`write` adds a checksum to)."""
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "complete": self.complete,
            "tokenizer": self.tokenizer,
            "dtype": self.dtype,
            "eos": self.eos,
            "bos": self.bos,
            "loss_mask": self.loss_mask,
            "settings": self.settings,
            "inputs": self.inputs,
            "units": self.units,
            "num_docs": self.num_docs,
            "num_tokens": self.num_tokens,
            "skipped_records": self.skipped_records,
            "empty_docs": self.empty_docs,
            "inexact_cuts": self.inexact_cuts,
            "ignored_inputs": self.ignored_inputs,
            "engines": self.engines,
            "shards": [s.to_json() for s in self.shards],
        }

    def write(self, root: Path | Store) -> None:
        """Atomically replace the cache's ``manifest.json`` (``root`` is its directory or its store)."""
        store = LocalStore(root) if isinstance(root, Path) else root
        store.put_atomic(MANIFEST, encode_json(with_checksum(self.to_json())))


def load_manifest(root: Path | Store) -> Manifest:
    """Read and validate the cache's ``manifest.json`` (``root`` is its directory or its store).

    Raises:
        CacheError: the manifest is missing, malformed, from another format version, or inconsistent.
    """
    store = LocalStore(root) if isinstance(root, Path) else root
    path = store.describe(MANIFEST)
    if isinstance(store, LocalStore) and not store.is_dir():
        raise CacheError(f"{store.root}: no such cache directory")
    raw = store.read_json(MANIFEST, what="manifest")
    _check_manifest_checksum(path, raw)
    try:
        return _parse_manifest(raw)
    except (KeyError, TypeError, ValueError) as e:
        raise CacheError(f"{path}: malformed manifest ({type(e).__name__}: {e})") from None


# ------------------------------------------------------------------------------------ manifest checksum

# The top-level fields of the manifests written before the checksum: such a manifest is accepted without
# one, but any other field there (e.g. "checksum" with a flipped bit) means damage.
_FIELDS_BEFORE_CHECKSUM = frozenset(
    {
        *("format", "format_version", "complete", "tokenizer", "dtype", "eos", "settings", "inputs"),
        *("units", "num_docs", "num_tokens", "skipped_records", "shards"),
    }
)


def manifest_checksum(doc: dict[str, Any]) -> str:
    """CRC-32 of a manifest's canonical JSON (sorted keys, no whitespace), its ``checksum`` field left out.

    Computed over the parsed values, not the file's bytes, so that it does not depend on the layout.
    """
    content = {key: value for key, value in doc.items() if key != "checksum"}
    return checksum_text(zlib.crc32(orjson.dumps(content, option=orjson.OPT_SORT_KEYS)))


def with_checksum(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with its ``checksum`` field set (see :func:`manifest_checksum`)."""
    return {**doc, "checksum": manifest_checksum(doc)}


def _check_manifest_checksum(path: str, raw: Any) -> None:
    """Refuse a manifest whose content differs from what its checksum covers.

    The shard files' checksums cover the data, and this one everything else (inputs, settings, the
    tokenizer's hash, the shard table), so that no damage to the manifest goes unnoticed.
    """
    if not isinstance(raw, dict):
        return  # _parse_manifest refuses it
    if "checksum" not in raw:
        unknown = sorted(set(raw) - _FIELDS_BEFORE_CHECKSUM)
        if unknown:
            raise CacheError(
                f"{path}: the manifest has no checksum and an unknown field {unknown[0]!r}; it is damaged: "
                "rebuild the cache (overwrite=True)"
            )
        return
    expected, actual = raw["checksum"], manifest_checksum(raw)
    if expected != actual:
        raise CacheError(
            f"{path}: the manifest's content does not match its checksum (recorded {expected!r:.40}, content "
            f"{actual}); it was damaged or edited: rebuild the cache (overwrite=True)"
        )


def _parse_manifest(raw: Any) -> Manifest:
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise ValueError(f"not a {FORMAT_NAME} manifest")
    version = raw["format_version"]
    if not isinstance(version, int) or version != FORMAT_VERSION:
        raise CacheError(
            f"cache format version {version!r} is not supported by this streampack (it reads version "
            f"{FORMAT_VERSION}); upgrade streampack or rebuild the cache"
        )
    _require(raw["tokenizer"], {"kind": str, "name": str, "vocab_size": int}, "tokenizer")
    _require(raw["eos"], {"append": bool}, "eos")
    if raw["eos"]["append"] and not isinstance(raw["eos"].get("id"), int):
        raise ValueError("eos.id must be an integer when eos.append is true")
    bos = raw.get("bos", NO_BOS)  # written before BOS existed: none
    _require(bos, {"prepend": bool}, "bos")
    if bos["prepend"] and not _is_count(bos.get("id")):
        raise ValueError("bos.id must be a non-negative integer when bos.prepend is true")
    dtype = raw["dtype"]
    if dtype not in ("uint16", "uint32"):
        raise ValueError(f"dtype {dtype!r} is not uint16 or uint32")
    shards = [_parse_shard(s) for s in raw["shards"]]
    vocab = raw["tokenizer"]["vocab_size"]
    if (
        not isinstance(vocab, int)
        or not 0 < vocab <= np.iinfo(np.uint16 if dtype == "uint16" else np.uint32).max + 1
    ):
        raise ValueError(f"vocab_size {vocab!r} does not fit dtype {dtype}")
    manifest = Manifest(
        tokenizer=dict(raw["tokenizer"]),
        dtype=dtype,
        eos=dict(raw["eos"]),
        settings=dict(raw["settings"]),
        inputs=list(raw["inputs"]),
        units=[str(u) for u in raw["units"]],
        complete=bool(raw["complete"]),
        shards=shards,
        skipped_records=int(raw.get("skipped_records", 0)),
        empty_docs=int(raw.get("empty_docs", 0)),
        inexact_cuts=int(raw.get("inexact_cuts", 0)),
        ignored_inputs=dict(raw.get("ignored_inputs", {})),
        bos=dict(bos),
        loss_mask=raw.get("loss_mask", False),
        engines=list(raw.get("engines", [])),
    )
    if not isinstance(manifest.loss_mask, bool):
        raise ValueError(f"loss_mask must be true or false (got {manifest.loss_mask!r})")
    if manifest.loss_mask and any(s.mask_checksum is None for s in shards):
        raise ValueError("loss_mask is true but a shard has no mask_checksum")
    if manifest.complete and (raw["num_docs"], raw["num_tokens"]) != (manifest.num_docs, manifest.num_tokens):
        raise ValueError("num_docs/num_tokens disagree with the shard table")
    if manifest.complete and [s.name for s in shards] != [shard_name(i) for i in range(len(manifest.units))]:
        raise ValueError("the shard table does not list one shard per work unit, in order")
    return manifest


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _require(section: Any, fields: dict[str, type], name: str) -> None:
    if not isinstance(section, dict):
        raise ValueError(f"{name} must be an object")
    for key, kind in fields.items():
        if not isinstance(section.get(key), kind) or (kind is int and isinstance(section.get(key), bool)):
            raise ValueError(f"{name}.{key} must be a {kind.__name__} (got {section.get(key)!r})")


def _parse_shard(raw: Any) -> ShardInfo:
    shard = ShardInfo(
        name=checked_shard_name(raw["name"]),
        unit=str(raw["unit"]),
        num_docs=raw["num_docs"],
        num_tokens=raw["num_tokens"],
        tokens_checksum=str(raw["tokens_checksum"]),
        offsets_checksum=str(raw["offsets_checksum"]),
        mask_checksum=None if raw.get("mask_checksum") is None else str(raw["mask_checksum"]),
    )
    for key in ("num_docs", "num_tokens"):
        value = getattr(shard, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"shard {shard.name}: {key} must be a non-negative integer (got {value!r})")
    return shard

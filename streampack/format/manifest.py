"""The manifest: :class:`Manifest` and its shard table (:class:`ShardTable`, :class:`ShardInfo`), to and
from the JSON objects ``manifest.json`` holds (docs/FORMAT.md), and the identity of the build it records
(:func:`build_identity`, :func:`build_digest`). Pure: no file is read here.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streampack.errors import CacheError
from streampack.format.names import checked_shard_name, checksum_text, manifest_checksum, shard_name
from streampack.format.sections import (
    BosPolicy,
    BuildSettings,
    EngineRecord,
    EosPolicy,
    IgnoredInputs,
    InputRecord,
    InputRecords,
    TokenizerInfo,
    sections_of,
)

FORMAT_NAME = "streampack-cache"
FORMAT_VERSION = 2  # 2: the shard table as columns (ShardTable); version 1 (rows) is still read
READABLE_VERSIONS = (1, 2)
_CHECKSUM = re.compile(r"^crc32:[0-9a-f]{8}$")
_CHECKSUMS = re.compile(r"(?:crc32:[0-9a-f]{8})*")
NO_BOS = BosPolicy(False, None)  # the policy of a cache written before BOS existed


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


_CRC_COLUMNS = ("tokens_crc32", "offsets_crc32", "mask_crc32")
_COLUMNS = ("num_docs", "num_tokens", *_CRC_COLUMNS)


@dataclass(frozen=True, eq=False)
class ShardTable:
    """The manifest's shard table as columns: element ``i`` of each array is shard ``i``'s.

    Shard ``i`` is named :func:`shard_name` ``(i)`` and was written by work unit ``i``, so neither is
    stored. A checksum column is None where none was recorded (a synthetic cache, the committed prefix of
    an unfinished build, no loss mask). Opening 10^5 shards makes a few arrays, not 10^5 objects.

    Attributes:
        num_docs: documents per shard (int64).
        num_tokens: tokens per shard (int64).
        tokens_crc32: CRC-32 of each ``.tokens`` file (uint32), or None.
        offsets_crc32: CRC-32 of each ``.offsets`` file (uint32), or None.
        mask_crc32: CRC-32 of each ``.mask`` file (uint32), or None.
    """

    num_docs: np.ndarray
    num_tokens: np.ndarray
    tokens_crc32: np.ndarray | None = None
    offsets_crc32: np.ndarray | None = None
    mask_crc32: np.ndarray | None = None

    def __post_init__(self) -> None:
        for name in _COLUMNS:
            column = getattr(self, name)
            if column is not None:
                column.setflags(write=False)  # shared by every view of the cache

    @classmethod
    def empty(cls) -> ShardTable:
        """The table of a manifest whose build has not finished: no shard."""
        return cls(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.num_docs)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardTable):
            return NotImplemented
        pairs = [(getattr(self, name), getattr(other, name)) for name in _COLUMNS]
        return all(a is b or (a is not None and b is not None and np.array_equal(a, b)) for a, b in pairs)

    __hash__ = None  # type: ignore[assignment]

    @classmethod
    def from_rows(cls, rows: Sequence[ShardInfo]) -> ShardTable:
        """The columns of a row table (a build's); ValueError for a checksum neither ``crc32:xxxxxxxx`` nor
        empty, or where some shards have one and others not."""
        return cls(
            np.array([r.num_docs for r in rows], dtype=np.int64),
            np.array([r.num_tokens for r in rows], dtype=np.int64),
            _crc_column([r.tokens_checksum for r in rows], "tokens_checksum"),
            _crc_column([r.offsets_checksum for r in rows], "offsets_checksum"),
            _crc_column([r.mask_checksum or "" for r in rows], "mask_checksum"),
        )

    def row(self, index: int, unit: str, masked: bool) -> ShardInfo:
        """Shard ``index`` as a :class:`ShardInfo` (``unit``: its work unit's description)."""
        mask = _crc_text(self.mask_crc32, index)
        return ShardInfo(
            shard_name(index),
            unit,
            int(self.num_docs[index]),
            int(self.num_tokens[index]),
            _crc_text(self.tokens_crc32, index),
            _crc_text(self.offsets_crc32, index),
            mask if masked else None,
        )

    def to_json(self, masked: bool) -> dict[str, Any]:
        """The manifest's ``shards`` object: counts as lists, each checksum column as one hex string."""
        columns: dict[str, Any] = {"num_docs": self.num_docs.tolist(), "num_tokens": self.num_tokens.tolist()}
        for name in _CRC_COLUMNS if masked else _CRC_COLUMNS[:2]:
            column = getattr(self, name)
            columns[name] = None if column is None else column.astype(">u4").tobytes().hex()
        return columns

    @classmethod
    def from_json(cls, raw: Any, masked: bool) -> ShardTable:
        """Parse a version 2 ``shards`` object; raises ValueError, TypeError or KeyError when malformed."""
        if not isinstance(raw, dict):
            raise ValueError(f"shards must be an object of columns (got {type(raw).__name__})")
        num_docs, num_tokens = _count_column(raw, "num_docs"), _count_column(raw, "num_tokens")
        if len(num_docs) != len(num_tokens):
            raise ValueError(f"shards.num_docs has {len(num_docs)} items, num_tokens {len(num_tokens)}")
        crcs = [_hex_column(raw, name, len(num_docs)) for name in _CRC_COLUMNS[:2]]
        if masked and "mask_crc32" not in raw:
            raise ValueError("loss_mask is true but the shard table has no mask_crc32")
        mask = _hex_column(raw, "mask_crc32", len(num_docs)) if masked else None
        return cls(num_docs, num_tokens, crcs[0], crcs[1], mask)

    def digest(self) -> str:
        """A short digest of the table (SHA-256 of its columns' bytes), the same in every process."""
        h = hashlib.sha256(b"streampack shard table 2")
        for name in _COLUMNS:
            column = getattr(self, name)
            little = None if column is None else column.astype(column.dtype.newbyteorder("<"))
            h.update(b"-" if little is None else name.encode() + little.tobytes())
        return h.hexdigest()[:16]

    def version_1_digest(self) -> str:
        """Format version 1's digest (SHA-256 of the rows' JSON), to recognise a checkpoint saved then."""
        rows = [
            [shard_name(i), docs, tokens, _crc_text(self.tokens_crc32, i), _crc_text(self.offsets_crc32, i)]
            for i, (docs, tokens) in enumerate(zip(self.num_docs.tolist(), self.num_tokens.tolist()))
        ]
        return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def _crc_text(column: np.ndarray | None, index: int) -> str:
    return "" if column is None else checksum_text(int(column[index]))


def _crc_column(texts: list[Any], name: str) -> np.ndarray | None:
    """Checksums ``crc32:xxxxxxxx`` as uint32, or None when none was recorded (all empty)."""
    if all(text == "" for text in texts):
        return None
    joined = "".join(text if isinstance(text, str) else "?" for text in texts)
    if len(joined) != 14 * len(texts) or not _CHECKSUMS.fullmatch(joined):  # one regex pass, not one a row
        bad = next(i for i, text in enumerate(texts) if not (isinstance(text, str) and _CHECKSUM.match(text)))
        raise ValueError(f"shard {bad}: {name} {texts[bad]!r} is not crc32:xxxxxxxx")
    digits = np.frombuffer(joined.encode(), dtype="S14").view("S1").reshape(-1, 14)[:, 6:]
    return np.frombuffer(bytes.fromhex(digits.tobytes().decode()), dtype=">u4").astype(np.uint32)


def _count_column(raw: dict[str, Any], name: str) -> np.ndarray:
    """A list of non-negative integers as int64, checked by its dtype (no per-item Python check)."""
    values = raw[name]
    if not isinstance(values, list):
        raise ValueError(f"shards.{name} must be a list of counts")
    column = np.array(values) if values else np.zeros(0, dtype=np.int64)
    if column.ndim != 1 or column.dtype.kind not in "iu":  # strings, floats, booleans, nulls, lists
        raise ValueError(f"shards.{name} must be a list of non-negative integers")
    if column.dtype.kind == "u" and len(column) and column.max() > np.iinfo(np.int64).max:
        raise ValueError(f"shards.{name} holds a count over 2**63")
    column = column.astype(np.int64)
    if len(column) and column.min() < 0:
        raise ValueError(f"shards.{name} holds a negative count ({int(column.min())})")
    return column


def _hex_column(raw: dict[str, Any], name: str, count: int) -> np.ndarray | None:
    """A checksum column: 8 hex digits per shard in one string, or null (none recorded)."""
    text = raw[name]
    if text is None:
        return None
    if not isinstance(text, str) or len(text) != 8 * count or not re.fullmatch(r"[0-9a-f]*", text):
        raise ValueError(f"shards.{name} must be {8 * count} lowercase hex digits (8 per shard) or null")
    return np.frombuffer(bytes.fromhex(text), dtype=">u4").astype(np.uint32)


@dataclass(frozen=True)
class Manifest:
    """The parsed ``manifest.json`` of a cache.

    ``complete`` is false while a build runs or after it was interrupted: the shard table is then empty,
    and the ledger describes the committed prefix.
    """

    tokenizer: TokenizerInfo
    dtype: str
    eos: EosPolicy
    settings: BuildSettings
    inputs: Sequence[InputRecord]  # InputRecords when read from a file
    units: list[str]
    complete: bool = False
    table: ShardTable = field(default_factory=ShardTable.empty)
    skipped_records: int = 0
    empty_docs: int = 0
    inexact_cuts: int = 0
    ignored_inputs: IgnoredInputs = field(default_factory=IgnoredInputs)
    bos: BosPolicy = NO_BOS
    loss_mask: bool = False  # an SFT build: every shard has a .mask file
    # The engines that computed the ids over the runs (informational: every engine gives the same ids).
    engines: list[EngineRecord] = field(default_factory=list)

    @property
    def vocab_size(self) -> int:
        """Number of token ids of the tokenizer (every id in the cache is below it)."""
        return self.tokenizer.vocab_size

    @property
    def shards(self) -> list[ShardInfo]:
        """The shard table as rows, built on each call (prefer :attr:`table`, its columns)."""
        return [self.table.row(i, self.units[i], self.loss_mask) for i in range(len(self.table))]

    @property
    def num_docs(self) -> int:
        """Documents in the complete cache."""
        return int(self.table.num_docs.sum())

    @property
    def num_tokens(self) -> int:
        """Tokens in the complete cache."""
        return int(self.table.num_tokens.sum())

    def to_json(self) -> dict[str, Any]:
        """The JSON document of ``manifest.json``, its checksum left to the writer."""
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "complete": self.complete,
            "tokenizer": self.tokenizer.to_json(),
            "dtype": self.dtype,
            "eos": self.eos.to_json(),
            "bos": self.bos.to_json(),
            "loss_mask": self.loss_mask,
            "settings": self.settings.to_json(),
            "inputs": inputs_json(self.inputs),
            "units": self.units,
            "num_docs": self.num_docs,
            "num_tokens": self.num_tokens,
            "skipped_records": self.skipped_records,
            "empty_docs": self.empty_docs,
            "inexact_cuts": self.inexact_cuts,
            "ignored_inputs": self.ignored_inputs.to_json(),
            "engines": [e.to_json() for e in self.engines],
            "shards": self.table.to_json(self.loss_mask),
        }


def parse_manifest(raw: Any, path: str) -> Manifest:
    """Validate the parsed JSON of a ``manifest.json`` and return its :class:`Manifest`.

    Args:
        raw: the parsed JSON.
        path: how messages name the file.

    Raises:
        CacheError: the manifest is malformed, from another format version, inconsistent, or does not
            match its checksum.
    """
    _check_manifest_checksum(path, raw)
    try:
        return _parse_manifest(raw, path)
    except (KeyError, TypeError, ValueError) as e:
        raise CacheError(f"{path}: malformed manifest ({type(e).__name__}: {e})") from None


# The top-level fields of the manifests written before the checksum: such a manifest is accepted without
# one, but any other field there (e.g. "checksum" with a flipped bit) means damage.
_FIELDS_BEFORE_CHECKSUM = frozenset(
    {
        *("format", "format_version", "complete", "tokenizer", "dtype", "eos", "settings", "inputs"),
        *("units", "num_docs", "num_tokens", "skipped_records", "shards"),
    }
)


def _check_manifest_checksum(path: str, raw: Any) -> None:
    """Refuse a manifest whose content differs from its checksum, which covers everything the shard files'
    checksums do not (inputs, settings, the tokenizer's hash, the shard table)."""
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


def _parse_manifest(raw: Any, path: str) -> Manifest:
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise ValueError(f"not a {FORMAT_NAME} manifest")
    version = raw["format_version"]
    if not isinstance(version, int) or isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise CacheError(
            f"cache format version {version!r} is not supported by this streampack (it reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}); upgrade streampack or rebuild the cache"
        )
    tokenizer = TokenizerInfo.from_json(raw["tokenizer"], where=path)
    eos = EosPolicy.from_json(raw["eos"], where=path)
    bos = BosPolicy.from_json(raw["bos"], where=path) if "bos" in raw else NO_BOS  # before BOS existed: none
    dtype = raw["dtype"]
    if dtype not in ("uint16", "uint32"):
        raise ValueError(f"dtype {dtype!r} is not uint16 or uint32")
    loss_mask = raw.get("loss_mask", False)
    if not isinstance(loss_mask, bool):
        raise ValueError(f"loss_mask must be true or false (got {loss_mask!r})")
    units = raw["units"]
    if not isinstance(units, list) or not all(isinstance(u, str) for u in units):
        raise ValueError("units must be a list of strings")
    if version == 1:
        table = _table_of_rows(raw["shards"], loss_mask)
    else:
        table = ShardTable.from_json(raw["shards"], loss_mask)
    vocab = tokenizer.vocab_size
    if not 0 < vocab <= np.iinfo(np.uint16 if dtype == "uint16" else np.uint32).max + 1:
        raise ValueError(f"vocab_size {vocab!r} does not fit dtype {dtype}")
    manifest = Manifest(
        tokenizer=tokenizer,
        dtype=dtype,
        eos=eos,
        settings=BuildSettings.from_json(raw["settings"], where=path),
        inputs=InputRecords.from_json(raw["inputs"], where=path),
        units=units,
        complete=bool(raw["complete"]),
        table=table,
        skipped_records=int(raw.get("skipped_records", 0)),
        empty_docs=int(raw.get("empty_docs", 0)),
        inexact_cuts=int(raw.get("inexact_cuts", 0)),
        ignored_inputs=IgnoredInputs.from_json(raw.get("ignored_inputs", {}), where=path),
        bos=bos,
        loss_mask=loss_mask,
        engines=list(sections_of(raw.get("engines", []), EngineRecord, where=path, name="engines")),
    )
    if manifest.complete and (raw["num_docs"], raw["num_tokens"]) != (manifest.num_docs, manifest.num_tokens):
        raise ValueError("num_docs/num_tokens disagree with the shard table")
    if manifest.complete and len(table) != len(units):
        raise ValueError(f"the shard table has {len(table)} shards for {len(units)} work units")
    return manifest


def _table_of_rows(raw: Any, masked: bool) -> ShardTable:
    """A version 1 shard table (a list of rows) as columns, checked a column at a time."""
    if not isinstance(raw, list) or not all(isinstance(row, dict) for row in raw):
        raise ValueError("shards must be a list of rows in a version 1 manifest")
    names = [row["name"] for row in raw]
    if names != [shard_name(i) for i in range(len(names))]:
        for name in names:
            checked_shard_name(name)  # a name that is no shard name at all is refused as such
        raise ValueError("the shard table does not list one shard per work unit, in order")
    counts = {key: [row[key] for row in raw] for key in ("num_docs", "num_tokens")}
    masks = [row.get("mask_checksum") for row in raw]
    if masked and None in masks:
        raise ValueError("loss_mask is true but a shard has no mask_checksum")
    return ShardTable(
        _count_column(counts, "num_docs"),
        _count_column(counts, "num_tokens"),
        _crc_column([row["tokens_checksum"] for row in raw], "tokens_checksum"),
        _crc_column([row["offsets_checksum"] for row in raw], "offsets_checksum"),
        _crc_column([mask or "" for mask in masks], "mask_checksum"),
    )


def inputs_json(inputs: Sequence[InputRecord]) -> list[dict[str, Any]]:
    """The manifest's ``inputs``: as read (:class:`InputRecords`), or each record's JSON."""
    return inputs.to_json() if isinstance(inputs, InputRecords) else [i.to_json() for i in inputs]


def build_identity(manifest: Manifest) -> dict[str, Any]:
    """What a resumed build must share with the cache, one setting per key (the tokenizer by its hash: it
    may be named by another path). Computed from the sections' JSON, so a key a later version added is
    compared too; settings older caches lack read as what such a build did."""
    tokenizer = {k: v for k, v in manifest.tokenizer.to_json().items() if k != "spec"}
    settings = {k: v for k, v in manifest.settings.to_json().items() if k != "tokenizer"}
    for key, value in _LATER_SETTINGS.items():
        settings.setdefault(key, value)
    for key, value in _LEFT_OUT_AT_DEFAULT.items():
        if settings.get(key, value) == value:
            settings.pop(key, None)
    # The policies as resolved (the tokenizer's own EOS or BOS may come from a tokenizer_config.json, which
    # the tokenizer's hash does not cover), keyed apart from the settings of the same name.
    policies = {"eos_policy": manifest.eos.to_json(), "bos_policy": manifest.bos.to_json()}
    return {"tokenizer": tokenizer, "dtype": manifest.dtype, **policies, **settings}


# Settings added after caches were first written, with the value that those caches were built with.
_LATER_SETTINGS: dict[str, Any] = {"bos": False, "bos_id": None, "fields": None, "chat": None}
# Settings added later still, left out of the identity while they hold these defaults: the identity and
# digest of every cache built without them stay what they were.
_LEFT_OUT_AT_DEFAULT: dict[str, Any] = {"chat_turns": "all", "chat_reasoning": "train"}


def build_digest(manifest: Manifest) -> str:
    """What identifies a build's output, the same while it runs, once complete and after a resume: its
    :func:`build_identity`, inputs and work units."""
    fields = {
        "identity": build_identity(manifest),
        "inputs": inputs_json(manifest.inputs),
        "units": manifest.units,
        "loss_mask": manifest.loss_mask,
    }
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

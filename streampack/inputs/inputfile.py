"""An input file (its format told by its name), and why an entry found is not one: what discovery gives."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal

import orjson

from streampack.errors import InputError

Format = Literal["jsonl", "parquet", "text"]

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt",)
PARQUET_SUFFIXES = (".parquet",)
COMPRESSION_SUFFIXES = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2", ".xz": "xz"}

# The reasons an entry is skipped (Ignored.reason); a duplicate's reason also names the file it repeats.
HIDDEN = "hidden"
DUPLICATE = "duplicate of"
NOT_JSON_LINES = "not JSON Lines"
CACHE = "a streampack cache"
SYMLINK_LOOP = "symlink loop"
NOT_AN_INPUT_TYPE = "not an input file type"
NOT_A_REGULAR_FILE = "not a regular file"
UNREADABLE = "cannot be listed"

_SNIFF_BYTES = 1 << 20  # a first line longer than this is taken to be JSON Lines
BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class InputFile:
    """One input file (local path or fsspec URL) with the stats that identify its content."""

    path: str
    format: Format
    compression: str | None
    size: int
    mtime_ns: int | None

    @property
    def is_local(self) -> bool:
        """True for a local path, false for a URL read through fsspec."""
        return "://" not in self.path

    def stat_json(self) -> dict[str, Any]:
        """The manifest's record of this input, as ``InputRecord``'s JSON (made directly: 10^5 files)."""
        return {"path": self.path, "size": self.size, "mtime_ns": self.mtime_ns}


@dataclass(frozen=True)
class Ignored:
    """An entry found under a directory or glob input (or given twice) that is not read, and why.

    Attributes:
        path: the entry as found (a file, or a folder skipped whole).
        reason: one of ``hidden``, ``duplicate of PATH``, ``not JSON Lines``, ``a streampack cache``,
            ``symlink loop``, ``not an input file type``, ``not a regular file``, ``cannot be listed``.
    """

    path: str
    reason: str


def looks_like_json_lines(f: BinaryIO) -> bool:
    """False when the first non-blank line of ``f`` shows a single JSON document rather than JSON Lines:
    ``{`` or ``[`` alone, an array, or a value that is not an object. A broken first record counts as
    JSON Lines, so that its error is reported."""
    budget = _SNIFF_BYTES
    while budget > 0:
        line = f.readline(budget)
        if not line:
            return True
        budget -= len(line)
        line = line.removeprefix(BOM).strip()
        if not line:
            continue
        if line.startswith(b"{"):
            return line != b"{"
        return not (line.startswith(b"[") or _is_json(line))
    return True


def _is_json(line: bytes) -> bool:
    try:
        orjson.loads(line)
    except orjson.JSONDecodeError:
        pass
    else:
        return True
    try:  # what only Python's parser accepts (NaN, lone surrogates)
        json.loads(line.decode("utf-8"))
    except ValueError:
        return False
    return True


def describe_error(error: BaseException) -> str:
    """``Class: message`` of an error and its causes (fsspec wraps the reason in an error naming the URL)."""
    parts, seen = [], set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        parts.append(f"{type(cause).__name__}: {cause}")
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    return "; caused by ".join(parts)


def nothing_found(message: str, ignored: list[Ignored]) -> str:
    message += f" ({supported()})"
    entries = list(dict.fromkeys(ignored))
    if entries:
        shown = ", ".join(f"{i.path} ({i.reason})" for i in entries[:5])
        more = f" and {len(entries) - 5} more" if len(entries) > 5 else ""
        message += f"; skipped: {shown}{more}"
    return message


def detect(path: str) -> tuple[Format, str | None] | None:
    """Format and compression of a path from its extension, or None when it is not an input file."""
    name = path.lower()
    compression = None
    for suffix, kind in COMPRESSION_SUFFIXES.items():
        if name.endswith(suffix):
            compression, name = kind, name[: -len(suffix)]
            break
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl", compression
    if name.endswith(TEXT_SUFFIXES):
        return "text", compression
    if name.endswith(PARQUET_SUFFIXES) and compression is None:
        return "parquet", None
    return None


def detect_strict(path: str) -> tuple[Format, str | None]:
    detected = detect(path)
    if detected is None:
        raise InputError(f"{path}: unknown file type ({supported()}); rename the file or convert it")
    return detected


def supported() -> str:
    compressed = "/".join(COMPRESSION_SUFFIXES)
    return (
        f"supported: {', '.join(JSONL_SUFFIXES + TEXT_SUFFIXES)} optionally compressed ({compressed}), "
        f"and {PARQUET_SUFFIXES[0]}"
    )

"""Opening an input for reading: local or remote, decompressed by its name (gzip, bz2, xz, zstd)."""

from __future__ import annotations

import bz2
import functools
import gzip
import io
import lzma
import os
import re
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO, cast

from streampack.errors import InputError
from streampack.inputs.inputfile import InputFile, describe_error
from streampack.inputs.records import Position

READ_CHUNK = 1 << 20


# ISA-L's GzipFile where isal is installed (3x zlib's speed), else the standard library's.
GzipFile: Any = gzip.GzipFile
STREAM_ERRORS: tuple[type[Exception], ...] = (EOFError, OSError, zlib.error, lzma.LZMAError)
try:
    from isal import igzip, isal_zlib

    GzipFile = igzip.GzipFile
    STREAM_ERRORS += (getattr(isal_zlib, "error"),)  # noqa: B009 (its stub calls it an instance)
except ImportError:
    pass


@contextmanager
def open_input(file: InputFile, position: Position | None = None) -> Iterator[BinaryIO]:
    """Open an input for binary reading, decompressing by extension."""
    try:
        # a 1 MiB buffer: with the default 8 KiB, reading 10 KB JSONL lines cost 5x more
        raw: BinaryIO = (
            open(file.path, "rb", buffering=READ_CHUNK)  # noqa: SIM115
            if file.is_local
            else open_remote(file.path)
        )
    except OSError as e:
        raise InputError(f"{file.path}: cannot open ({e.strerror or e})") from None
    if position is not None:
        position.attach(raw, 0)
    try:
        if file.compression is None:
            yield raw
        else:
            with _decompressor(file.compression, raw) as f:
                yield f
    finally:
        raw.close()


def _decompressor(compression: str, raw: BinaryIO) -> BinaryIO:
    # cast: these are binary files, which typeshed types as BufferedIOBase rather than BinaryIO
    if compression == "gzip":
        return cast(BinaryIO, GzipFile(fileobj=raw))
    if compression == "bz2":
        return cast(BinaryIO, bz2.BZ2File(raw))
    if compression == "xz":
        return cast(BinaryIO, lzma.LZMAFile(raw))
    return io.BufferedReader(_ZstdReader(raw), buffer_size=READ_CHUNK)


def open_remote(url: str) -> BinaryIO:
    """Open an object-storage or HTTP input through fsspec, for binary reading.

    Raises:
        InputError: naming the URL and what its backend said.
    """
    import fsspec

    try:
        return fsspec.open(url, "rb").open()
    except Exception as e:  # fsspec backends raise their own classes (aiohttp, botocore, ...)
        raise InputError(f"{url}: cannot open ({describe_error(e)})") from None


class _ZstdReader(io.RawIOBase):
    """Zstandard decompression that raises on a truncated stream.

    ``zstandard``'s own ``stream_reader`` returns a silently short stream when the last frame is cut off;
    a truncated input must be an error, never a quietly smaller cache.
    """

    def __init__(self, raw: BinaryIO) -> None:
        import zstandard

        self._raw = raw
        self._new = zstandard.ZstdDecompressor().decompressobj
        self._obj = self._new()
        self._pending = memoryview(b"")  # decompressed, not yet read: a view, taken from without a copy
        self._started = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            compressed = self._raw.read(READ_CHUNK)
            if not compressed:
                if self._started and not self._obj.eof:
                    raise EOFError("zstd stream ended before the end of its last frame")
                return 0
            self._pending = memoryview(self._decompress(compressed))
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def _decompress(self, data: bytes) -> bytes:
        import zstandard

        out = []
        while data:
            if self._obj.eof:
                self._obj = self._new()
            self._started = True
            try:
                out.append(self._obj.decompress(data))
            except zstandard.ZstdError as e:
                raise OSError(f"corrupt zstd data: {e}") from None
            data = self._obj.unused_data
        return b"".join(out)


_MAGIC = [  # the first bytes of the compressed formats, and the extension each wants
    (re.compile(rb"\x1f\x8b"), "gzip", ".gz"),
    (re.compile(rb"\x28\xb5\x2f\xfd"), "zstd", ".zst"),
    (re.compile(rb"BZh[1-9](1AY&SY|\x17rE8P\x90)"), "bz2", ".bz2"),
    (re.compile(rb"\xfd7zXZ\x00"), "xz", ".xz"),
]


def refuse_compressed(file: InputFile) -> None:
    """Raise when a file read as uncompressed starts like a compressed one (asked only on a failure).

    Raises:
        InputError: naming the compression and the name to rename the file to.
    """
    kind = _compressed_as(file)
    if kind is not None:
        name = file.path.rstrip("/").rsplit("/", 1)[-1]
        suffix = os.path.splitext(name)[1]
        raise InputError(
            f"{file.path}: the file looks {kind[0]}-compressed but is named {suffix}; rename it to "
            f"{name}{kind[1]}"
        )


@functools.lru_cache(maxsize=64)
def _compressed_as(file: InputFile) -> tuple[str, str] | None:
    if file.compression is not None:
        return None
    try:
        with open_input(file) as f:
            head = f.read(10)
    except InputError:
        return None
    except STREAM_ERRORS:
        return None
    return next(((kind, ext) for magic, kind, ext in _MAGIC if magic.match(head)), None)

"""A plain text file read as one document: whole when small, else as a :class:`TextStream` of chunks."""

from __future__ import annotations

import codecs
from collections.abc import Iterator

from streampack.errors import BadRecordError, InputError
from streampack.inputs.compression import READ_CHUNK, STREAM_ERRORS, open_input, refuse_compressed
from streampack.inputs.inputfile import BOM, InputFile
from streampack.inputs.records import Item, Position, TextStream

_STREAM_TEXT_BYTES = 8 << 20  # larger .txt documents are streamed in chunks rather than read whole


def read_text_document(file: InputFile, skip: int, position: Position | None) -> Iterator[Item]:
    """The one record of a text file (a stream when large or compressed; a bad record when not UTF-8)."""
    if skip:
        return
    if file.size <= _STREAM_TEXT_BYTES and file.compression is None:
        data = _whole(file).removeprefix(BOM)
        try:
            yield data.decode("utf-8")
        except UnicodeDecodeError as e:
            refuse_compressed(file)
            yield BadRecordError(f"{file.path}: byte {e.start}", "invalid UTF-8")
        return
    try:  # a first pass, so that invalid UTF-8 is a bad record found before any of the document is kept
        for _ in _decoded_chunks(file, None):
            pass
    except _InvalidUtf8 as e:
        refuse_compressed(file)
        yield BadRecordError(f"{file.path}: byte {e.offset}", "invalid UTF-8")
        return
    yield TextStream(_decoded_chunks(file, position))


def _whole(file: InputFile) -> bytes:
    """A small uncompressed file's bytes (a local one unbuffered: thousands of small files are read)."""
    try:
        if file.is_local:
            with open(file.path, "rb", buffering=0) as raw:
                return raw.readall()
        with open_input(file) as f:
            return f.read()
    except STREAM_ERRORS as e:
        raise InputError(f"{file.path}: cannot read ({e})") from None


class _InvalidUtf8(InputError):
    """A streamed text file is not UTF-8 at byte ``offset``."""

    def __init__(self, file: InputFile, offset: int) -> None:
        super().__init__(f"{file.path}: byte {offset}: invalid UTF-8; fix or re-encode the file")
        self.offset = offset


def _decoded_chunks(file: InputFile, position: Position | None) -> Iterator[str]:
    decoder = codecs.getincrementaldecoder("utf-8-sig")()
    offset = 0
    with open_input(file, position) as f:
        while True:
            try:
                chunk = f.read(READ_CHUNK)
                text = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                raise _InvalidUtf8(file, offset + e.start) from None
            except STREAM_ERRORS as e:
                raise InputError(
                    f"{file.path}: the stream is truncated or corrupt at byte {offset} ({e})"
                ) from None
            offset += len(chunk)
            if text:
                yield text
            if not chunk:
                return

"""Moving bytes into an export's files in the kernel where it can: ``copy_file_range`` (else ``sendfile``)
for a byte range of a file, ``writev`` for pieces of memory maps. Each function leaves its buffered ``out``
positioned at its end, so that the caller's next ``out.write`` appends.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from typing import IO

#: Pieces one ``writev`` takes at most (the system's IOV_MAX).
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16
_UNSUPPORTED = (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)


def file_descriptor(out: IO[bytes]) -> int | None:
    """The descriptor of a local file, None for anything else (an fsspec file, a buffer)."""
    try:
        return out.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        return None


def copy_range(source: IO[bytes], offset: int, count: int, out: IO[bytes]) -> int:
    """Append ``count`` bytes of the file ``source`` from ``offset`` to ``out`` in the kernel.

    Returns:
        The bytes copied: fewer than ``count`` (0 where ``out`` is not a local file) when the kernel
        cannot copy these files or ``source`` ends early; the caller writes the rest.
    """
    fd = file_descriptor(out)
    if fd is None or count <= 0:
        return 0
    out.flush()
    try:
        return _kernel_copy(source.fileno(), fd, offset, count)
    finally:
        out.seek(0, os.SEEK_END)  # the buffered writer learns where the file now ends


def _kernel_copy(src: int, dst: int, offset: int, count: int) -> int:
    done = 0
    copy_file_range = getattr(os, "copy_file_range", None)
    if copy_file_range is None and not hasattr(os, "sendfile"):
        return 0
    while done < count:
        try:
            if copy_file_range is not None:
                n = copy_file_range(src, dst, count - done, offset + done)
            else:
                n = os.sendfile(dst, src, offset + done, count - done)
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                raise
            if copy_file_range is None or not hasattr(os, "sendfile"):
                return done
            copy_file_range = None  # e.g. across file systems on an old kernel: try sendfile
            continue
        if n == 0:
            return done  # the file ends early
        done += n
    return done


def write_pieces(out: IO[bytes], pieces: Sequence[memoryview]) -> None:
    """Write ``pieces`` to ``out`` in order: gathered by ``writev`` where ``out`` is a local file."""
    fd = file_descriptor(out) if hasattr(os, "writev") else None
    if fd is None:
        for piece in pieces:
            out.write(piece)
        return
    out.flush()
    for at in range(0, len(pieces), _IOV_MAX):
        batch = pieces[at : at + _IOV_MAX]
        written = os.writev(fd, batch)
        if written < sum(map(len, batch)):  # a short write (rare for a file): the rest piece by piece
            rest = b"".join(batch)[written:]
            while rest:
                rest = rest[os.write(fd, rest) :]
    out.seek(0, os.SEEK_END)  # the buffered writer learns where the file now ends

"""The build's memory: glibc's allocator set so that a long build's resident memory stays flat.

glibc's dynamic mmap threshold rises above the ~1 MiB buffers a build frees on every thread, whose arenas
then fragment and grow (1.15-1.25x the RSS); a fixed 2 MiB threshold with a 64 MiB trim threshold held it
to 1.05-1.09x at the same speed.
"""

from __future__ import annotations

import ctypes
import functools
import sys

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3


@functools.cache
def steady_allocator() -> bool:
    """Fix glibc's mmap and trim thresholds for this process, once; whether it did (glibc only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)  # this process's C library (ctypes.util.find_library runs a subprocess)
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # not glibc: musl's mallopt does nothing
        return False
    mallopt = libc.mallopt
    return all([bool(mallopt(_M_MMAP_THRESHOLD, 2 << 20)), bool(mallopt(_M_TRIM_THRESHOLD, 64 << 20))])

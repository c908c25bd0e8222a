"""The build's memory: the C allocator set so that a long build's resident memory stays flat.

glibc's malloc serves an allocation of over its *mmap threshold* with a mapping of its own, returned to the
system when freed, and the rest from its arenas. By default the threshold is dynamic: freeing a mapped
buffer raises it to that buffer's size (up to 32 MiB). A build frees a stream of buffers of about 1 MiB on
every thread (blocks read, their texts, the engine's ids, the framed tokens), so the threshold soon rises
above them all, and the arenas of its threads, which then serve them, fragment and grow for as long as the
build runs: 345 MB x 4 (GPT-2, 2 cores) peaked at 1.15-1.25x the RSS of 345 MB. A fixed threshold of
2 MiB, with a trim threshold of 64 MiB (so that an arena is not given back and taken again at every
block), held it to 1.05-1.09x at the same speed (with a threshold of 1 MiB, mapping and faulting in those
buffers cost 0.8 s more system time).
"""

from __future__ import annotations

import ctypes
import functools
import sys

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 2 << 20
TRIM_THRESHOLD = 64 << 20


@functools.cache
def steady_allocator() -> bool:
    """Fix glibc's mmap and trim thresholds for this process, once; whether it did (glibc only: other C
    libraries and systems keep their own allocator's behaviour)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        # the C library this process runs on, by its global symbols: ctypes.util.find_library runs
        # `ldconfig -p` in a subprocess (1.5-5 ms at a build's start; 40 ms beside a thread holding the GIL)
        libc = ctypes.CDLL(None)
        gnu_get_libc_version = libc.gnu_get_libc_version  # glibc's alone: musl's mallopt does nothing
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    del gnu_get_libc_version
    settings = {_M_MMAP_THRESHOLD: MMAP_THRESHOLD, _M_TRIM_THRESHOLD: TRIM_THRESHOLD}
    return all([bool(mallopt(parameter, value)) for parameter, value in settings.items()])

"""The build lock of a cache: an ``flock``ed file, emptied and never deleted (see :class:`FileLock`)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import TracebackType

from streampack.errors import BuildLockedError


class FileLock:
    """Context manager holding the exclusive ``flock`` of a lock file (the build lock of a cache).

    The file holds the holder's pid and host, and is emptied, never deleted, when released. The kernel
    releases an ``flock`` when its process dies, so a killed build's lock is taken over safely.

    Raises:
        BuildLockedError: another live process holds the lock, or the file cannot be created.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def __enter__(self) -> FileLock:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise BuildLockedError(
                f"cannot write to {self.path.parent}: {e.strerror}; choose a writable output directory"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise BuildLockedError(
                f"{self.path.parent} is locked by another build ({holder}); wait for it to finish or stop "
                "it, then rerun (a killed build's lock is released automatically)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._fd is not None:
            # The file stays: deleting it while locked would let a build that opened it just before lock
            # the deleted file while a third locks a new one. Emptying it says nobody holds it.
            os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None

"""Where an export writes: its files staged, then moved into place at once, the format's index last.

**Atomic, not resumable.** A killed export leaves the staging area and nothing at the destination; the
next run removes it and starts again.

* A local destination is staged in a hidden sibling directory (``.NAME.streampack-export``) and moved into
  place by one ``rename`` (a prefix format such as Megatron's file by file, the index last). Nothing is
  fsynced by default, as ``cp`` and the formats' own writers do, so a machine crash soon after may leave
  files cut short; ``durable=True`` (``--durable``) fsyncs every file and directory before the move.
* An object-storage destination (any fsspec URL) is staged under ``DEST.streampack-export/`` and moved
  object by object, the index last: a kill during that move can leave files without their index.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Literal

from streampack.errors import OptionsError, WriteError
from streampack.store import fsync_dir, is_remote

STAGING_SUFFIX = ".streampack-export"
#: The errors of a write that found no room: ``disk_full`` words them.
DISK_FULL = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file size limit reached",
}

Layout = Literal["directory", "prefix"]


class Destination:
    """Where an export writes: files under a staging name, then moved into place by :meth:`commit`.

    Args:
        dest: a local path or an fsspec URL. For a ``"directory"`` format the directory to create; for a
            ``"prefix"`` format (Megatron) the path prefix its files' suffixes are appended to.
        layout: ``"directory"`` or ``"prefix"``.
        suffixes: (``"prefix"``) the suffixes of the format's files, e.g. ``(".bin", ".idx")``.
        overwrite: replace what is at ``dest`` (removed only once the new export is complete).
        storage_options: passed to the fsspec filesystem of a URL.
        durable: (local) fsync every file and directory before the move (see the module's docstring).

    Raises:
        OptionsError: something is already at ``dest`` and ``overwrite`` is false, or storage options were
            given for a local path.
    """

    def __init__(
        self,
        dest: str | os.PathLike[str],
        *,
        layout: Layout,
        suffixes: Sequence[str] = (),
        overwrite: bool = False,
        storage_options: dict[str, Any] | None = None,
        durable: bool = False,
    ) -> None:
        self.layout, self.suffixes, self.durable = layout, tuple(suffixes), durable
        self.remote = is_remote(str(dest))
        if storage_options and not self.remote:
            raise OptionsError(
                f"{dest}: storage_options apply to object storage (s3://...), not a local path"
            )
        if self.remote:
            import fsspec

            self.fs, root = fsspec.core.url_to_fs(str(dest), **(storage_options or {}))
            self.root = root.rstrip("/")
            self.staging = self.root + STAGING_SUFFIX
        else:
            path = Path(dest).expanduser().absolute()
            if str(dest).endswith(("/", os.sep)) and layout == "prefix":
                raise OptionsError(
                    f"{dest}: a {layout} format needs a path prefix such as out/corpus, not a folder"
                )
            self.root = str(path)
            self.staging = str(path.parent / f".{path.name}{STAGING_SUFFIX}")
        self.written: list[str] = []
        found = self.existing()
        if found and not overwrite:
            raise OptionsError(
                f"{dest}: the destination exists ({', '.join(found)}); pass overwrite=True "
                "to replace it once the new export is complete, or choose another destination"
            )
        self.abort()  # what a killed export left in the staging area goes
        if not self.remote:
            os.makedirs(self.staging)

    def final(self, name: str) -> str:
        """Where the file ``name`` ends up (a path or a key)."""
        return self.root + name if self.layout == "prefix" else f"{self.root}/{name}"

    def existing(self) -> list[str]:
        """What is already at the destination (the directory, or the prefix's files)."""
        targets = [self.root] if self.layout == "directory" else [self.root + s for s in self.suffixes]
        if self.remote:
            return [t for t in targets if self.fs.exists(t)]
        return [t for t in targets if os.path.lexists(t)]

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        """Write the file ``name`` (a path relative to the destination; a suffix for a prefix format).

        Raises:
            WriteError: the disk (or a quota, or the file size limit) is full: naming the file.
        """
        staged = self._staged(name)
        try:
            if self.remote:
                with self.fs.open(staged, "wb") as f:
                    yield f
            else:
                os.makedirs(os.path.dirname(staged), exist_ok=True)
                with open(staged, "wb") as f:
                    yield f
                    if self.durable:
                        f.flush()
                        os.fsync(f.fileno())
        except OSError as error:
            if error.errno in DISK_FULL:
                raise disk_full(error, self.final(name)) from error
            raise
        self.written.append(name)

    def rename(self, name: str, new: str) -> None:
        """Rename a written file in the staging area."""
        if self.remote:
            self.fs.mv(self._staged(name), self._staged(new))
        else:
            os.replace(self._staged(name), self._staged(new))
        self.written[self.written.index(name)] = new

    def _staged(self, name: str) -> str:
        if self.layout == "prefix":
            return f"{self.staging}/{Path(self.root).name}{name}"
        return f"{self.staging}/{name}"

    def commit(self, last: Sequence[str] = ()) -> list[str]:
        """Move every written file into place, those in ``last`` last, replacing what was there; return the
        final paths or keys."""
        order = [n for n in self.written if n not in last] + [n for n in last if n in self.written]
        if self.remote:
            for target in self.existing():
                self.fs.rm(target, recursive=self.layout == "directory")
            for name in order:
                self.fs.mv(self._staged(name), self.final(name))
            self.abort()
        elif self.layout == "directory":
            if self.durable:
                for folder, _, _ in os.walk(self.staging):
                    fsync_dir(Path(folder))
            old = None
            if os.path.lexists(self.root):
                old = f"{self.staging}.old"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(self.root, old)
            os.replace(self.staging, self.root)
            if self.durable:
                fsync_dir(Path(os.path.dirname(self.root)))
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        else:
            # A reader opens the index first: remove the old one before any new file lands beside it.
            for suffix in reversed(self.suffixes):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.root + suffix)
            for name in order:
                os.replace(self._staged(name), self.final(name))
            if self.durable:
                fsync_dir(Path(os.path.dirname(self.root)))
            self.abort()
        return [self.final(n) for n in order]

    def abort(self) -> None:
        """Remove the staging area (after an error, or once committed)."""
        if self.remote:
            with contextlib.suppress(Exception):
                self.fs.rm(self.staging, recursive=True)
        else:
            shutil.rmtree(self.staging, ignore_errors=True)


def disk_full(error: OSError, path: str) -> WriteError:
    """The error of an export whose write to ``path`` found no room (``error.errno`` in :data:`DISK_FULL`)."""
    reason = DISK_FULL.get(error.errno or errno.ENOSPC, "disk full")
    room = (
        "raise the file size limit (ulimit -f)"
        if error.errno == errno.EFBIG
        else "free space where it writes (the export needs about its own size there)"
    )
    return WriteError(
        f"{reason} while writing {path}: the export stopped and kept nothing (an export is written whole "
        f"or not at all, and a rerun starts it over); {room}, then rerun the same command"
    )

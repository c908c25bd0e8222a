"""What every exporter shares: the destination (staged, then committed), reading a cache in bounded memory,
the progress bar, and the refusals.

**Atomic, not resumable.** An export writes every file under a staging name and moves the files into place
only once all of them are written, the format's index (the file its reader opens first: a Megatron
``.idx``, an MDS ``index.json``, a ``save_to_disk`` ``state.json``) last. A killed export leaves the
staging area and nothing at the destination; the next run removes the staging area and starts again.

* A local destination is staged in a hidden sibling directory (``.NAME.streampack-export``) on the same
  file system; a directory format is moved into place by one ``rename`` of that directory, a prefix format
  (Megatron's ``DEST.bin`` + ``DEST.idx``) file by file, the index last.
* **Killed, or crashed.** A killed process (an error, Ctrl-C, ``SIGKILL``, the OOM killer) never leaves a
  destination a reader takes as whole: what it wrote is in the page cache, which every reader sees, and
  the rename either happened or did not. By default nothing is fsynced, as ``cp``, ``shutil.copyfile`` and
  the formats' own writers (Megatron's ``IndexedDatasetBuilder``, datatrove, ``MDSWriter``,
  ``save_to_disk``) do: a crash of the machine itself (power, kernel) within the file system's writeback
  interval after the export may leave a destination whose files are cut short or zero-filled.
  ``durable=True`` (``--durable``) fsyncs every file (and a directory format's directories) before the
  move and the parent directory after it, so that after a crash there is the staging area or the whole
  destination; each fsync waits for the disk (``benchmarks/bench_export.py``'s ``--durable`` row
  measures the cost).
* An object-storage destination (any fsspec URL) is staged under the sibling prefix
  ``DEST.streampack-export/`` and moved (a server-side copy per object) into place, the index last. Object
  stores have no atomic rename of many objects: a kill *during that move* can leave some files of a
  format without an index file (datatrove, llm.c, OLMo, Parquet) visible to a reader that lists files.

**Bounded memory, and copies in the kernel.** Where a format's token file holds a shard's bytes as they are
(the same width: datatrove's ``.ds``, OLMo's ``.npy``, nanoGPT's ``train.bin``, Megatron's ``.bin`` in
the cache's width), :func:`write_tokens` has the kernel copy them (``copy_file_range``, else
``sendfile``, as ``shutil.copyfile`` does), so they never pass through this process. Elsewhere token files
are read with plain reads of :data:`CHUNK_TOKENS` tokens (not through memory maps, whose touched pages
would count towards the process's memory until unmapped); offset tables (8 bytes a document) and loss
masks are read a shard at a time.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

import numpy as np

from streampack.errors import CacheError, OptionsError
from streampack.store import fsync_dir
from streampack.store.localcopy import CachedStore
from streampack.store.remote import is_remote

if TYPE_CHECKING:
    from streampack.reader import Cache

#: Tokens read at once from a shard's token file (16 MiB of uint32, 8 MiB of uint16).
CHUNK_TOKENS = 1 << 22
#: Pieces one ``writev`` takes at most (the system's IOV_MAX).
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16

STAGING_SUFFIX = ".streampack-export"

Layout = Literal["directory", "prefix"]


# ----------------------------------------------------------------------------- the destination


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
        self.dest, self.layout, self.suffixes, self.overwrite = str(dest), layout, tuple(suffixes), overwrite
        self.durable = durable
        self.remote = is_remote(self.dest)
        if storage_options and not self.remote:
            raise OptionsError(
                f"{dest}: storage_options apply to object storage (s3://...), not a local path"
            )
        if self.remote:
            import fsspec

            self.fs, root = fsspec.core.url_to_fs(self.dest, **(storage_options or {}))
            self.root = root.rstrip("/")
            self.staging = self.root + STAGING_SUFFIX
        else:
            path = Path(self.dest).expanduser().absolute()
            if self.dest.endswith(("/", os.sep)) and layout == "prefix":
                raise OptionsError(
                    f"{dest}: a {layout} format needs a path prefix such as out/corpus, not a folder"
                )
            self.root = str(path)
            self.staging = str(path.parent / f".{path.name}{STAGING_SUFFIX}")
        self.written: list[str] = []
        self._check_free()
        self._clear_staging()

    def describe(self) -> str:
        """The destination as the user named it, for messages."""
        return self.dest

    def final(self, name: str) -> str:
        """Where the file ``name`` ends up (a path or a key)."""
        return self.root + name if self.layout == "prefix" else f"{self.root}/{name}"

    def existing(self) -> list[str]:
        """What is already at the destination (the directory, or the prefix's files)."""
        targets = [self.root] if self.layout == "directory" else [self.root + s for s in self.suffixes]
        if self.remote:
            return [t for t in targets if self.fs.exists(t)]
        return [t for t in targets if os.path.lexists(t)]

    def _check_free(self) -> None:
        found = self.existing()
        if found and not self.overwrite:
            raise OptionsError(
                f"{self.dest}: the destination exists ({', '.join(found)}); pass overwrite=True "
                "to replace it once the new export is complete, or choose another destination"
            )

    def _clear_staging(self) -> None:
        """Remove what a killed export left in the staging area, then create it."""
        if self.remote:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.staging, recursive=True)
            return
        shutil.rmtree(self.staging, ignore_errors=True)
        os.makedirs(self.staging)

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        """Write the file ``name`` (a path relative to the destination; a suffix for a prefix format)."""
        staged = self._staged(name)
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
        self.written.append(name)

    def rename(self, name: str, new: str) -> None:
        """Rename a written file in the staging area (a name that counts the files, known at the end)."""
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
        """Move every written file into place, those named in ``last`` last (in that order); replace what
        was there (with ``overwrite``). Returns the final paths or keys."""
        order = [n for n in self.written if n not in last] + [n for n in last if n in self.written]
        if self.remote:
            self._remove_existing()
            for name in order:
                self.fs.mv(self._staged(name), self.final(name))
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.staging, recursive=True)
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
            shutil.rmtree(self.staging, ignore_errors=True)
        return [self.final(n) for n in order]

    def _remove_existing(self) -> None:
        for target in self.existing():
            self.fs.rm(target, recursive=self.layout == "directory")

    def abort(self) -> None:
        """Remove the staging area (after an error; a killed process leaves it for the next run)."""
        if self.remote:
            with contextlib.suppress(Exception):
                self.fs.rm(self.staging, recursive=True)
        else:
            shutil.rmtree(self.staging, ignore_errors=True)


# ----------------------------------------------------------------------------- reading the cache


@dataclass(frozen=True)
class ShardDocs:
    """One shard's document table: where each document ends (cumulative tokens, int64) and the global
    index of its first document."""

    shard: int
    ends: np.ndarray
    first_doc: int

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of each document (int64)."""
        return np.diff(self.ends, prepend=0)


def shard_docs(cache: Cache) -> Iterator[ShardDocs]:
    """Every shard's document table, in stream order (one table in memory at a time)."""
    for shard in range(cache.num_shards):
        ends = np.array(cache.shard_offsets(shard), dtype=np.int64)
        yield ShardDocs(shard, ends, int(cache.doc_starts[shard]))


def token_chunks(cache: Cache, shard: int, start: int = 0, stop: int | None = None) -> Iterator[np.ndarray]:
    """Tokens ``[start, stop)`` of shard ``shard`` (all of them by default), in new arrays of at most
    :data:`CHUNK_TOKENS` tokens, read from the file (a remote cache's shard is fetched first)."""
    count = int(cache.table.num_tokens[shard])
    stop = count if stop is None else stop
    if stop <= start:
        return
    tokens = cache.shard_tokens(shard)  # checks the file's size (and fetches a remote cache's copy)
    where = cache.files.token_file(shard)
    if where is None:  # not one span of a file (MDS samples): from the array its reader made
        for pos in range(start, stop, CHUNK_TOKENS):
            yield np.array(tokens[pos : min(pos + CHUNK_TOKENS, stop)])
        return
    del tokens
    path, base = where
    itemsize = cache.dtype.itemsize
    with open(path, "rb") as f:
        pos = start
        while pos < stop:
            n = min(CHUNK_TOKENS, stop - pos)
            f.seek(base + pos * itemsize)
            yield np.fromfile(f, dtype=cache.dtype, count=n)
            pos += n
    release_maps(cache)


def write_tokens(
    out: IO[bytes], cache: Cache, shard: int, dtype: np.dtype, start: int = 0, stop: int | None = None
) -> int:
    """Write tokens ``[start, stop)`` of shard ``shard`` (all of them by default) to ``out`` as ``dtype``
    (little-endian); returns how many. See :func:`write_spans`."""
    stop = int(cache.table.num_tokens[shard]) if stop is None else stop
    write_spans(cache, shard, dtype, [(out, start, stop)])
    return max(0, stop - start)


def write_spans(
    cache: Cache, shard: int, dtype: np.dtype, spans: Iterable[tuple[IO[bytes], int, int]]
) -> None:
    """Write each span ``(out, start, stop)`` of shard ``shard``'s tokens to its ``out``, in order, as
    ``dtype`` (little-endian), the shard file opened (and its size checked) once.

    Where ``dtype`` has the cache's width (and its ids fit, which the exporters check first: a uint32 id
    below 2**31 has the bytes of the int32) and ``out`` is a local file, the kernel copies the bytes from
    the shard file; otherwise they are read in chunks of :data:`CHUNK_TOKENS` and written, cast where the
    width differs.
    """
    itemsize = cache.dtype.itemsize
    same = dtype.itemsize == itemsize and _little(cache.dtype)
    opened: IO[bytes] | None = None
    where = cache.files.token_file(shard)
    if where is None:  # not one span of a file (MDS samples): from the array its reader made
        tokens = cache.shard_tokens(shard)
        for out, start, stop in spans:
            for pos in range(start, stop, CHUNK_TOKENS):
                chunk = tokens[pos : min(pos + CHUNK_TOKENS, stop)]
                out.write(np.ascontiguousarray(chunk, dtype=dtype).data)
        return
    path, base = where
    try:
        for out, start, stop in spans:
            if stop <= start:
                continue
            if opened is None:
                cache.shard_tokens(shard)  # checks the file's size (and fetches a remote cache's copy)
                opened = open(path, "rb")  # noqa: SIM115 (closed below)
            fd = file_descriptor(out) if same else None
            if fd is not None:
                out.flush()
                offset, size = base + start * itemsize, (stop - start) * itemsize
                start += kernel_copy(opened.fileno(), fd, offset, size) // itemsize
                out.seek(0, os.SEEK_END)  # the buffered writer learns where the file now ends
            while start < stop:
                n = min(CHUNK_TOKENS, stop - start)
                opened.seek(base + start * itemsize)
                chunk = np.fromfile(opened, dtype=cache.dtype, count=n)
                if len(chunk) < n:
                    raise CacheError(
                        f"{path}: ended at token {start + len(chunk):,}, not {stop:,}: the token file was "
                        "cut short while it was read; run `streampack verify`"
                    )
                out.write(np.ascontiguousarray(chunk, dtype=dtype).data)
                start += n
    finally:
        if opened is not None:
            opened.close()
            release_maps(cache)


def _little(dtype: np.dtype) -> bool:
    return dtype == dtype.newbyteorder("<")


def file_descriptor(out: IO[bytes]) -> int | None:
    """The descriptor of a local file, None for anything else (an fsspec file, a buffer)."""
    try:
        return out.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        return None


def write_pieces(out: IO[bytes], pieces: Sequence[memoryview]) -> None:
    """Write ``pieces`` to ``out`` in order: gathered by the kernel where ``out`` is a local file
    (``writev``, :data:`_IOV_MAX` pieces a call), else one by one."""
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


def kernel_copy(src: int, dst: int, offset: int, count: int) -> int:
    """Copy ``count`` bytes of ``src`` from ``offset`` to ``dst``'s position in the kernel; returns the bytes
    copied, fewer where neither ``copy_file_range`` nor ``sendfile`` works for these files (the caller
    writes the rest itself)."""
    done = 0
    copy_range = getattr(os, "copy_file_range", None)
    if copy_range is None and not hasattr(os, "sendfile"):
        return 0
    while done < count:
        try:
            if copy_range is not None:
                n = copy_range(src, dst, count - done, offset + done)
            else:
                n = os.sendfile(dst, src, offset + done, count - done)
        except OSError as e:
            unsupported = (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)
            if e.errno not in unsupported:
                raise
            if copy_range is None or not hasattr(os, "sendfile"):
                return done
            copy_range = None  # e.g. across file systems on an old kernel: try sendfile
            continue
        if n == 0:
            return done  # the file ends early: the chunked reads after it say so
        done += n
    return done


def shard_mask(cache: Cache, shard: int) -> np.ndarray:
    """Shard ``shard``'s loss mask (uint8, one byte a token) as a new array read from the file."""
    mask = np.array(cache.shard_loss_mask(shard), dtype=np.uint8)
    release_maps(cache)
    return mask


def release_maps(cache: Cache) -> None:
    """Drop the maps the size checks made: an export reads every shard once."""
    if not isinstance(cache.store, CachedStore):
        cache.drop_maps()


def doc_chunks(cache: Cache, docs: ShardDocs, max_tokens: int = CHUNK_TOKENS) -> Iterator[tuple[int, int]]:
    """Runs ``[first, stop)`` of a shard's documents of about ``max_tokens`` tokens each (a longer document
    is a run of its own)."""
    ends = docs.ends
    first = 0
    while first < len(ends):
        base = int(ends[first - 1]) if first else 0
        stop = int(np.searchsorted(ends, base + max_tokens, side="right"))
        stop = max(stop, first + 1)
        yield first, stop
        first = stop


# ----------------------------------------------------------------------------- progress and refusals


class Progress:
    """A tqdm bar over the tokens an export writes, on stderr; silent when disabled."""

    def __init__(self, enabled: bool, total: int, what: str) -> None:
        self.bar: Any = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, unit="tok", unit_scale=True, desc=f"export {what}", dynamic_ncols=True
            )

    def update(self, tokens: int) -> None:
        """Count ``tokens`` more tokens written."""
        if self.bar is not None:
            self.bar.update(tokens)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def refuse_loss_mask(cache: Cache, format: str, drop: bool) -> None:
    """Refuse an SFT cache's loss mask into a format that cannot hold one, unless ``drop`` is set.

    Raises:
        OptionsError: naming the mask, the formats that keep it and how to drop it deliberately.
    """
    if cache.has_loss_mask and not drop:
        raise OptionsError(
            f"{cache.root}: this SFT cache has a loss mask (which tokens are training targets), and the "
            f"{format} format cannot hold one: the export would lose it. Export to datatrove (.ds.loss), "
            "olmo (label mask files) or hf (labels) to keep it, or pass drop_loss_mask=True "
            "(--drop-loss-mask) to export the tokens alone"
        )


def check_ids_fit(cache: Cache, dtype: np.dtype, format: str, keeps: str) -> None:
    """Refuse a vocabulary whose ids a format's token dtype cannot hold.

    Raises:
        OptionsError: naming the vocabulary, the dtype and a format (or option) that holds the ids.
    """
    top = np.iinfo(dtype).max
    if cache.vocab_size - 1 > top:
        raise OptionsError(
            f"{cache.root}: a vocabulary of {cache.vocab_size:,} ids does not fit the {format} format's "
            f"{dtype.name} tokens (at most {top:,}): ids would wrap. {keeps}"
        )


def check_int_option(name: str, value: object, *, low: int, high: int | None = None) -> int:
    """An integer option in ``[low, high]``.

    Raises:
        OptionsError: it is not an integer in range.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise OptionsError(f"{name} must be an integer (got {value!r})")
    if value < low or (high is not None and value > high):
        allowed = f"between {low:,} and {high:,}" if high is not None else f"at least {low:,}"
        raise OptionsError(f"{name} must be {allowed} (got {value:,})")
    return int(value)

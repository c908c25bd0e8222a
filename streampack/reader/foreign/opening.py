"""Another ecosystem's token files opened as a :class:`~streampack.reader.Cache`: :func:`open_foreign`,
and :func:`open_remote` for files in object storage.

A format's module (:data:`READERS`) has ``recognise(path) -> bool`` and ``read(path, options) ->
Foreign``: it checks the files' headers and indexes and describes each shard as a :class:`ForeignShard`,
which :class:`ForeignShards` serves as :class:`~streampack.reader.shards.Shards`. The formats record no
checksums, so what the files held when opened identifies them (:mod:`streampack.reader.foreign.identity`).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from streampack.errors import CacheError, OptionsError, StreampackError
from streampack.format.manifest import Manifest, ShardTable
from streampack.format.sections import (
    UNDECLARED,
    BosPolicy,
    BuildSettings,
    EosPolicy,
    InputRecord,
    TokenizerInfo,
)
from streampack.reader.cache import Cache
from streampack.reader.foreign.files import LOCAL, CopiedFiles, ForeignFiles
from streampack.reader.foreign.identity import ends_digest, files_identity
from streampack.reader.shards import keep
from streampack.store import LocalStore
from streampack.store.localcopy import cached_store, default_local_dir, forget_release, on_release

__all__ = [
    "READERS",
    "Foreign",
    "ForeignOptions",
    "ForeignShard",
    "ForeignShards",
    "open_foreign",
    "open_remote",
]

#: Format name -> the module that reads it, in the order a path is tried.
READERS: dict[str, str] = {
    name: f"streampack.reader.foreign.{name}"
    for name in ("megatron", "mds", "datatrove", "olmo", "llmc", "nanogpt")
}
#: The formats read from object storage too: their ``read`` takes where the files are (a ``ForeignFiles``).
REMOTE_READERS = ("megatron", "datatrove")

#: Bytes of token copies (MDS samples, not stored end to end) that :class:`ForeignShards` keeps for reuse;
#: the last one is kept whatever its size. A kept map costs a file descriptor, a kept copy memory.
MAX_COPY_BYTES = 1 << 30


@dataclass(frozen=True)
class ForeignOptions:
    """What opening a foreign cache may be told that its files do not say.

    Attributes:
        format: the format to read it as (one of :data:`READERS`); recognised from the files by default.
        eos_id: the id that ends every document (nanoGPT, OLMo); the format's convention by default.
        bos_id: the id that starts every document (llm.c: the delimiter before each one).
        dtype: the token dtype of headerless files (``"uint16"`` or ``"uint32"``).
        tokenizer: the tokenizer of the ids (as ``build`` takes it), whose fingerprint a mixture checks.
        vocab_size: every id is below it (the declared tokenizer's, else the format's, else the dtype's).
    """

    format: str | None = None
    eos_id: int | None = None
    bos_id: int | None = None
    dtype: str | None = None
    tokenizer: str | None = None
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.format is not None and self.format not in READERS:
            raise OptionsError(f"unknown format {self.format!r} to open; choose one of {', '.join(READERS)}")
        if self.dtype is not None and self.dtype not in ("uint16", "uint32"):
            raise OptionsError(f"dtype must be uint16 or uint32 (got {self.dtype!r})")
        for name in ("eos_id", "bos_id", "vocab_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise OptionsError(f"{name} must be a non-negative integer (got {value!r})")


@dataclass(frozen=True)
class ForeignShard:
    """One shard of a foreign cache: its file and counts, and the functions that read its arrays.

    Attributes:
        tokens: maps its tokens (read-only, the cache's dtype); ``ends``: its document ends (uint64,
            cumulative); ``mask``: its loss mask (uint8, one a token), or None.
        token_file: (path, byte offset) where its tokens lie end to end, or None (MDS samples: ``pieces``,
            each document's bytes as views of its map).
        first_doc: the index in ``path`` of its first document (a file read as several shards).
        index_files: the files other than ``path`` its document ends are read from (an ``.idx``).
        hashes: the digests its format records of ``path``, by algorithm.
        ends_digest: the :func:`~streampack.reader.foreign.identity.ends_digest` of ``ends`` a scan found
            at the open; None: made from ``ends``.
    """

    path: Path
    num_docs: int
    num_tokens: int
    tokens: Callable[[], np.ndarray]
    ends: Callable[[], np.ndarray]
    mask: Callable[[], np.ndarray] | None = None
    token_file: tuple[Path, int] | None = None
    first_doc: int = 0
    index_files: tuple[Path, ...] = ()
    mask_file: Path | None = None
    hashes: dict[str, str] = field(default_factory=dict)
    pieces: Callable[[], list[memoryview]] | None = None
    ends_digest: bytes | None = None


@dataclass(frozen=True)
class Foreign:
    """A foreign cache as its format module read it.

    Attributes:
        root: the directory (or prefix) it was opened from.
        dtype: the token dtype, uint16 or uint32 (int32 files are read as uint32).
        vocab_size: every id is below it, where the files record it.
        files: every file it reads (the manifest's inputs).
        continued_documents: a shard's first document may continue the previous shard's last (llm.c cuts
            shards at a token count), so ``verify`` does not ask it to start with the BOS.
    """

    format: str
    root: Path
    dtype: np.dtype
    shards: list[ForeignShard]
    eos_id: int | None = None
    bos_id: int | None = None
    vocab_size: int | None = None
    tokenizer_name: str | None = None
    files: list[Path] = field(default_factory=list)
    continued_documents: bool = False

    @property
    def loss_mask(self) -> bool:
        """Whether its shards have a loss mask."""
        return bool(self.shards) and all(s.mask is not None for s in self.shards)


class ForeignShards:
    """The :class:`~streampack.reader.shards.Shards` of a foreign cache, each array made by its
    :class:`ForeignShard` on first use and kept as :func:`~streampack.reader.shards.keep` allows.

    Args:
        files: where the files are read from.
        identity: what they held when opened (:func:`foreign_identity`).
    """

    _closed = False

    def __init__(self, foreign: Foreign, files: ForeignFiles = LOCAL, identity: str = "") -> None:
        self.foreign, self.where, self._identity = foreign, files, identity
        if not files.local:  # a bounded local copy may need the room of the maps kept here
            on_release(self.drop)
        self._kept: dict[str, OrderedDict[int, np.ndarray]] = {k: OrderedDict() for k in ("t", "c", "o", "m")}
        # Per shard, where its tokens are kept: mapped ("t") or copied ("c", MDS samples).
        self._token_kind = ["c" if s.token_file is None else "t" for s in foreign.shards]
        self._masked = foreign.loss_mask

    def __repr__(self) -> str:
        foreign = self.foreign
        return f"ForeignShards({foreign.format}, {str(foreign.root)!r}, shards={len(foreign.shards)})"

    def tokens(self, shard: int) -> np.ndarray:
        """The tokens of shard ``shard``."""
        return self._get(self._token_kind[shard], shard, "tokens")

    def offsets(self, shard: int) -> np.ndarray:
        """Where each document of shard ``shard`` ends (checked by the format's reader)."""
        return self._get("o", shard, "ends")

    def raw_offsets(self, shard: int) -> np.ndarray:
        """:meth:`offsets`, not kept."""
        return self._shard(shard).ends()

    def mask(self, shard: int) -> np.ndarray:
        """The loss mask of shard ``shard``; a CacheError where the files have none."""
        if not self._masked:
            raise CacheError(
                f"{self.foreign.root}: this {self.foreign.format} cache has no loss mask; every token is a "
                "training target"
            )
        return self._get("m", shard, "mask")

    def token_file(self, shard: int) -> tuple[Path, int] | None:
        """(file, byte offset) where shard ``shard``'s tokens lie end to end in a local file, or None."""
        return self._shard(shard).token_file if self.where.local else None

    def pieces(self, shard: int) -> list[memoryview] | None:
        """Each document's bytes of shard ``shard``, where its tokens lie in a local file in pieces."""
        made = self._shard(shard).pieces
        return made() if made is not None and self.where.local else None

    def origin(self, shard: int) -> tuple[str, int]:
        """The file that holds shard ``shard``'s documents, and the index there of its first."""
        found = self._shard(shard)
        return self.where.name(found.path), found.first_doc

    def describe(self, shard: int, kind: str) -> str:
        """The token file of shard ``shard``, and which of its parts ``kind`` is."""
        path = self.where.name(self._shard(shard).path)
        return (
            path if kind == "tokens" else f"{path} ({'document ends' if kind == 'offsets' else 'loss mask'})"
        )

    def paths(self, shard: int) -> tuple[Path, ...]:
        """Shard ``shard``'s token file, then the files its document ends are read from."""
        found = self._shard(shard)
        return tuple(self.where.local_path(path) for path in dict.fromkeys((found.path, *found.index_files)))

    def keys(self, shard: int, *, boundaries: bool = True) -> list[str]:
        """The keys of :meth:`paths` (its token file's alone without ``boundaries``), and the loss mask's."""
        found = self._shard(shard)
        files = (found.path, *found.index_files, found.mask_file) if boundaries else (found.path,)
        return [self.where.key(path) for path in dict.fromkeys(files) if path is not None]

    def mask_path(self, shard: int) -> Path | None:
        """The file of shard ``shard``'s loss mask, or None."""
        mask = self._shard(shard).mask_file
        return None if mask is None else self.where.local_path(mask)

    def hashes(self, shard: int) -> dict[str, str]:
        """The digests the format records of shard ``shard``'s token file (none: empty)."""
        return dict(self._shard(shard).hashes)

    def identity(self) -> str:
        """What the files held when they were opened (:mod:`streampack.reader.foreign.identity`)."""
        return self._identity

    def drop(self) -> None:
        """Forget the arrays kept for reuse (those a caller holds stay valid)."""
        for kept in self._kept.values():
            kept.clear()

    def close(self) -> None:
        """Drop the kept arrays and leave a local copy's releases; reads refuse afterwards."""
        self._closed = True
        forget_release(self.drop)
        self.drop()

    def _shard(self, shard: int) -> ForeignShard:
        return self.foreign.shards[range(len(self.foreign.shards))[shard]]

    def _get(self, kind: str, shard: int, attribute: str) -> np.ndarray:
        """Shard ``shard``'s array of ``kind``: kept (on every batch's path), or made by ``attribute``."""
        kept = self._kept[kind]
        array = kept.get(shard)  # kept under its non-negative index: a negative one misses, then is found
        if array is not None:
            with contextlib.suppress(KeyError):  # evicted by another thread since the get
                kept.move_to_end(shard)
            return array
        index = range(len(self.foreign.shards))[shard]
        array = kept.get(index)
        if array is not None:
            return array
        if self._closed:
            raise CacheError(f"{self.foreign.root}: the cache was closed; open it again to read it")
        try:
            array = getattr(self.foreign.shards[index], attribute)()
        except StreampackError as e:
            raise type(e)(self.where.shown(str(e))) from None
        return keep(kept, index, array, MAX_COPY_BYTES if kind == "c" else None)


def open_foreign(
    path: str | os.PathLike[str],
    *,
    files: ForeignFiles = LOCAL,
    store: LocalStore | None = None,
    **declared: Any,
) -> Cache:
    """Open another format's token files at ``path`` as a cache, where they lie.

    Args:
        path: a Megatron prefix, a folder of llm.c, datatrove, OLMo or MDS shards, a nanoGPT ``train.bin``.
        files: where they are read from (object storage: :func:`open_remote`).
        store: the cache's store; a store of their folder by default.
        **declared: the fields of :class:`ForeignOptions`.

    Raises:
        CacheError: no format recognises ``path``, or its files are damaged (naming the file and field).
        OptionsError: an option the format does not take, or a format not read from object storage.
    """
    options = ForeignOptions(**declared)
    chosen = options.format or recognise(path, files)
    module = importlib.import_module(READERS[chosen])
    if not files.local and chosen not in REMOTE_READERS:
        raise OptionsError(
            f"{files.name(Path(path))}: {chosen} files are read from a local path; from object storage "
            f"streampack opens {' and '.join(REMOTE_READERS)} files: copy these to a local or shared "
            f"filesystem and open that path, or convert them (`streampack convert`) to a cache there"
        )
    try:
        foreign: Foreign = (
            module.read(Path(path), options, files) if not files.local else module.read(Path(path), options)
        )
        return foreign_cache(foreign, options, files=files, store=store)
    except StreampackError as e:
        raise type(e)(files.shown(str(e))) from None


def open_remote(
    url: str,
    declared: Mapping[str, Any],
    *,
    local_dir: str | os.PathLike[str] | None = None,
    max_local_bytes: int | None = None,
    prefetch_steps: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Cache:
    """The token files at ``url`` (any fsspec URL) as a cache read through a local copy of their folder;
    ``declared`` and the keywords are what :func:`streampack.open` was given.

    The small index files are fetched at the open, a token file whole when a shard of it is first read.

    Raises:
        CacheError: no format read from object storage recognises ``url``, or its files are damaged
            (named by their URLs).
        OptionsError: a format that is read from a local path only, or an option of the local copy.
    """
    url = url.rstrip("/")
    folder, _, name = url.rpartition("/")
    if folder.endswith(":/") or not folder:  # the URL is a bucket: its files are in it
        folder, name = url, ""
    store = cached_store(
        folder,
        local_dir=local_dir if local_dir is not None else default_local_dir(url),
        max_local_bytes=max_local_bytes,
        prefetch_steps=prefetch_steps,
        storage_options=storage_options,
    )
    store.opened = url
    try:
        cache = open_foreign(store.root / name, files=CopiedFiles(store), store=store, **declared)
    except BaseException:
        store.close()
        raise
    cache._opened_store = store
    return cache


def foreign_cache(
    foreign: Foreign, options: ForeignOptions, *, files: ForeignFiles = LOCAL, store: LocalStore | None = None
) -> Cache:
    """The cache of what a format module read, with what ``options`` declared of it."""
    manifest = foreign_manifest(foreign, options, files)
    shards = ForeignShards(foreign, files, foreign_identity(foreign, files))
    cache = Cache(store or LocalStore(foreign.root), manifest, manifest.table, files=shards)
    cache.declared = {k: v for k, v in asdict(options).items() if v is not None} | {"format": foreign.format}
    return cache


def foreign_identity(foreign: Foreign, files: ForeignFiles = LOCAL) -> str:
    """The :func:`~streampack.reader.foreign.identity.files_identity` of ``foreign``'s files."""
    ends = (shard.ends_digest or ends_digest(shard.ends()) for shard in foreign.shards)
    sampled = [path for s in foreign.shards for path in (s.path, s.mask_file) if path is not None]
    return files_identity(ends, list(dict.fromkeys(sampled)), files)


def recognise(path: str | os.PathLike[str], files: ForeignFiles = LOCAL) -> str:
    """The format whose files are at ``path`` (of those read from object storage, for remote ``files``).

    Raises:
        CacheError: none is; the message lists what each format looks for.
    """
    where = Path(path)
    near = [where, *(Path(f"{where}{suffix}") for suffix in (".bin", ".idx"))]
    if not any(files.is_file(p) or files.is_dir(p) for p in near):
        missing = "no such cache directory" if files.local else "no object or folder there"
        raise CacheError(f"{files.name(where)}: {missing}")
    names = READERS if files.local else REMOTE_READERS
    for name in names:
        module = importlib.import_module(READERS[name])
        if module.recognise(where) if files.local else module.recognise(where, files):
            return name
    looked = "; ".join(importlib.import_module(READERS[n]).LOOKS_FOR for n in names)
    if not files.local:  # open() looked for a native cache's manifest first
        raise CacheError(
            f"{files.name(where)}/manifest.json: not found: no streampack cache there, nor the token files "
            f"of a format read from object storage ({looked}; the others are read from a local path). Check "
            "the URL, or pass format= to say which format it is"
        )
    raise CacheError(
        f"{where}: not a streampack cache (no manifest.json) nor the token files of another format "
        f"({looked}). Build a cache with `streampack build`, or pass format= to say which format it is"
    )


def foreign_manifest(foreign: Foreign, options: ForeignOptions, files: ForeignFiles = LOCAL) -> Manifest:
    """The manifest of a foreign cache: what its files and the user declared; no checksums."""
    table = ShardTable(
        np.array([s.num_docs for s in foreign.shards], dtype=np.int64),
        np.array([s.num_tokens for s in foreign.shards], dtype=np.int64),
    )
    inputs = [InputRecord(files.name(p), files.size(p), files.mtime_ns(p)) for p in foreign.files]
    settings: dict[str, Any] = {"foreign": foreign.format}
    if foreign.continued_documents:
        settings["continued_documents"] = True
    return Manifest(
        tokenizer=_tokenizer(foreign, options),
        dtype=foreign.dtype.name,
        eos=EosPolicy(foreign.eos_id is not None, foreign.eos_id),
        bos=BosPolicy(foreign.bos_id is not None, foreign.bos_id),
        settings=BuildSettings.from_json(settings),
        inputs=inputs,
        units=_units(foreign),
        complete=True,
        table=table,
        loss_mask=foreign.loss_mask,
    )


def _units(foreign: Foreign) -> list[str]:
    """Each shard's unit: its file, and its documents there where a file is read as several shards."""
    shared = Counter(s.path for s in foreign.shards)
    return [
        f"{foreign.format}:{s.path.name}"
        + (f"[documents {s.first_doc}:{s.first_doc + s.num_docs}]" if shared[s.path] > 1 else "")
        for s in foreign.shards
    ]


def _tokenizer(foreign: Foreign, options: ForeignOptions) -> TokenizerInfo:
    """The declared tokenizer's fingerprint, as a build records it; else the format's name for it."""
    if options.tokenizer is not None:
        from streampack.tokenizer import load_tokenizer

        fingerprint = load_tokenizer(options.tokenizer, threads=1).fingerprint()
        ids = [i for i in (foreign.eos_id, foreign.bos_id) if i is not None] or [0]
        vocab = options.vocab_size or max(fingerprint["vocab_size"], *(i + 1 for i in ids))
        return TokenizerInfo(**{**fingerprint, "vocab_size": vocab}, spec=options.tokenizer)
    vocab = options.vocab_size or foreign.vocab_size or 1 << (8 * foreign.dtype.itemsize)
    return TokenizerInfo(UNDECLARED, foreign.tokenizer_name or foreign.format, vocab)

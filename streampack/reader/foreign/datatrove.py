"""datatrove's tokenized files (what nanotron's Nanosets read) read as a cache: ``NNNNN.ds`` and its
sidecars, from a local path or object storage.

As huggingface/datatrove ``pipeline/tokens/tokenizer.py`` (``TokenizedFile``) writes it and
``utils/dataset.py`` (``DatatroveFolderDataset``) reads it:

* ``NAME.ds``: the tokens, little-endian uint16 or uint32, each document followed by its EOS where the
  tokenizer appends one;
* ``NAME.ds.index``: uint64, the cumulative end of every document;
* ``NAME.ds.loss``: (an SFT cache) one byte a token, 1 at a training target;
* ``NAME.ds.metadata``: text, ``TOKENIZER|TOKEN_SIZE``, the token count, and the count in short form.

``streampack.open(FOLDER)``, a folder of ``.ds`` files or one: each ``.ds`` is one shard, mapped as it is,
in name order as ``DatatroveFolderDataset`` takes them. The token width is the ``.ds.metadata`` files' (all
must agree), else ``dtype=``, else uint16, datatrove's default. The tokenizer they name becomes the cache's
tokenizer name (declare ``tokenizer=`` for a mixture to check it). The files record no EOS id: ``eos_id=``
declares the id documents end with, if any. A ``.ds.loss`` beside every ``.ds`` is the loss mask.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from streampack.errors import CacheError, OptionsError
from streampack.reader.foreign.files import LOCAL, ForeignFiles, check_ends, check_size
from streampack.reader.foreign.opening import Foreign, ForeignOptions, ForeignShard

LOOKS_FOR = "datatrove: a folder of NAME.ds + NAME.ds.index (or one .ds file)"
#: What reading the files checks of them, as ``verify`` reports it.
OPENED_CHECKS = (
    "their indexes and metadata were checked (each .ds.index against its .ds, the .ds.metadata token "
    "widths and counts, a .ds.loss one byte a token); a .ds file has no header"
)
SUFFIX = ".ds"
#: The name datatrove's ``TokenizedFile`` gives a tokenizer it was not told (then ``|SIZE`` twice).
UNKNOWN = "Unknown Tokenizer"
#: The width datatrove's readers take without being told (``token_size=2``).
DEFAULT_TOKEN_SIZE = 2
TOKEN_DTYPES: dict[int, np.dtype] = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


def ds_files(path: Path, files: ForeignFiles = LOCAL) -> list[Path]:
    """The ``.ds`` files at ``path``: a folder's, sorted by name, or the file."""
    if path.name.endswith(SUFFIX) and files.is_file(path):
        return [path]
    if files.local and not files.is_dir(path):
        return []
    # A remote folder: listed whatever its own description says (an HTTP server's page is a "file").
    found = (p for p in files.listdir(path) if p.name.endswith(SUFFIX) and files.is_file(p))
    return sorted(found, key=lambda p: p.name)


def recognise(path: Path, files: ForeignFiles = LOCAL) -> bool:
    """Whether ``path`` is a ``.ds`` file or a folder that holds one."""
    return bool(ds_files(path, files))


def read(path: Path, options: ForeignOptions, where: ForeignFiles = LOCAL) -> Foreign:
    """The ``.ds`` files at ``path``, one shard each, whose documents end at the ``.ds.index`` ends.

    Raises:
        CacheError: no ``.ds`` file, or a file or sidecar that is malformed or disagrees (naming it).
        OptionsError: ``dtype=`` other than the ``.ds.metadata`` files' width.
    """
    files = ds_files(path, where)
    if not files:
        raise CacheError(f"{path}: no .ds file; {LOOKS_FOR}")
    metadata = [_metadata(Path(f"{f}.metadata"), where) for f in files]
    named = {(name, size) for name, size, _ in (m for m in metadata if m is not None)}
    if len({size for _, size in named}) > 1:
        raise CacheError(
            f"{path}: the .ds.metadata files give token sizes {sorted({s for _, s in named})}: the files of "
            "one cache have one token width; open the files of each width apart"
        )
    size = next(iter(named))[1] if named else None
    if options.dtype is not None:
        declared = np.dtype(options.dtype).itemsize
        if size is not None and declared != size:
            raise OptionsError(
                f"{path}: dtype={options.dtype!r} is {declared} bytes a token, but the .ds.metadata files "
                f"say TOKEN_SIZE {size}; leave dtype= out (the metadata gives it)"
            )
        size = declared
    dtype = TOKEN_DTYPES[size or DEFAULT_TOKEN_SIZE]
    shards = [_shard(f, dtype, m, where) for f, m in zip(files, metadata)]
    masked = [s.mask is not None for s in shards]
    if any(masked) and not all(masked):
        lacking = files[masked.index(False)]
        raise CacheError(
            f"{lacking}.loss: missing, though other .ds files of {path} have a .ds.loss: every file of a "
            "cache with a loss mask needs one (one byte a token); remove the others to read it without"
        )
    sidecars = [Path(f"{f}{s}") for f in files for s in (".index", ".loss", ".metadata")]
    inputs = files + [p for p in sidecars if where.is_file(p)]
    tokenizer = ", ".join(sorted({name for name, _ in named if name is not None})) or None
    eos, bos = options.eos_id, options.bos_id
    return Foreign("datatrove", path, dtype, shards, eos, bos, tokenizer_name=tokenizer, files=inputs)


def _metadata(path: Path, files: ForeignFiles) -> tuple[str | None, int, int | None] | None:
    """A ``.ds.metadata``'s tokenizer name (None if unknown), token size and token count; None without."""
    if not files.is_file(path):
        return None
    lines = files.read(path).decode(errors="replace").splitlines()
    name, _, size = lines[0].rpartition("|") if lines else ("", "", "")
    if not name or size not in ("2", "4"):
        raise CacheError(
            f"{path}: the first line is {lines[0] if lines else ''!r}, expected TOKENIZER|TOKEN_SIZE with a "
            "size of 2 or 4 (as datatrove writes it)"
        )
    count = lines[1].strip() if len(lines) > 1 else ""
    if count and not count.isdigit():
        raise CacheError(f"{path}: the token count (line 2) is {count!r}, expected a number of tokens")
    known = None if name.startswith(UNKNOWN) else name
    return known, int(size), int(count) if count else None


def _shard(
    ds: Path, dtype: np.dtype, metadata: tuple[str | None, int, int | None] | None, files: ForeignFiles
) -> ForeignShard:
    """One ``.ds`` file and its sidecars, checked."""
    nbytes = files.size(ds)
    if nbytes % dtype.itemsize:
        raise CacheError(
            f"{ds}: {nbytes:,} bytes, not a whole number of {dtype.itemsize}-byte tokens: the file is "
            "truncated, or its tokens are of another width (dtype=)"
        )
    count = nbytes // dtype.itemsize
    if metadata is not None and metadata[2] is not None and metadata[2] != count:
        raise CacheError(
            f"{ds}.metadata: the token count is {metadata[2]:,}, but {ds.name} holds {count:,} tokens: the "
            "file is truncated or does not belong to this metadata"
        )
    index = Path(f"{ds}.index")
    if not files.is_file(index):
        raise CacheError(
            f"{index}: missing; it should hold the end of every document of {ds.name} (uint64, in tokens), "
            "as datatrove writes it with save_index=True"
        )
    size = files.size(index)
    if size % 8:
        raise CacheError(
            f"{index}: {size:,} bytes, not a whole number of uint64 document ends: the file is truncated"
        )
    ends = files.map(index, np.dtype("<u8"), 0, size // 8)
    _check_index(index, ends, count)
    loss = Path(f"{ds}.loss")
    mask, mask_file = None, None
    if files.is_file(loss):
        mask_file = loss
        what = f"the loss mask of the {count:,} tokens of {ds.name} (one byte a token)"
        check_size(loss, count, what, files)
        mask = lambda: files.map(loss, np.dtype(np.uint8), 0, count)  # noqa: E731
    return ForeignShard(
        ds,
        len(ends),
        count,
        tokens=lambda: files.map(ds, dtype, 0, count),
        ends=lambda: ends,
        mask=mask,
        token_file=(ds, 0),
        index_files=(index,),
        mask_file=mask_file,
    )


def _check_index(index: Path, ends: np.ndarray, count: int) -> None:
    """The document ends never decrease and the last is the token count (no token outside a document)."""
    last = int(check_ends(index, ends, count)[-1]) if len(ends) else 0
    if last != count:
        raise CacheError(
            f"{index}: the last document ends at token {last:,}, but the .ds file holds {count:,} tokens: "
            "the index or the tokens are cut short, or they do not belong together"
        )

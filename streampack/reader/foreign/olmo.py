"""OLMo-core's numpy token files (dolma's layout) read as a cache: headerless memmaps, label masks, and
their sidecars.

What allenai/OLMo-core ``data/numpy_dataset.py`` (``NumpyDatasetConfig``: ``paths``, ``dtype``,
``label_mask_paths``) reads, as allenai/dolma ``tokenizer/memmap_writer.py`` writes it:

* ``token_ids_part_NNNNNN.npy``: the tokens, a headerless little-endian uint16 or uint32 array (no
  ``.npy`` header despite the name), each document followed by the EOS id;
* ``labels_mask_part_NNNNNN.npy``: (an SFT cache) one bool byte a token, True at a training target;
* ``token_ids_part_NNNNNN.csv.gz``: one ``start,end,id`` line a document, which OLMo-core reads for a
  remote array only (a local one's documents end at the EOS ids);
* ``olmo.json`` (streampack's export): what a ``NumpyDatasetConfig`` needs (``paths``,
  ``label_mask_paths``, ``dtype``, ``eos_token_id``, ``bos_token_id``, ``vocab_size``) and the cache's
  ``num_docs`` and ``num_tokens``, which a reader checks the files against.

``streampack.open(PATH)``: PATH is a folder with ``olmo.json`` (its paths relative to the folder), or a
folder of ``*.npy`` token files (in name order; ``labels_mask_X.npy`` is the mask of ``token_ids_X.npy``),
or one such file, whose ``dtype=`` (uint16 by default) and ``eos_id=`` (required) are declared. Each file
is one shard, mapped where it lies, whose documents end at each EOS (a tail after the last one is a last
document). The EOS ids are counted by a scan rather than read from the ``.csv.gz`` sidecars: gunzipping
and parsing a line a document costs more than comparing the tokens, and a folder not written by dolma has
none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from streampack.errors import CacheError, OptionsError, read_json
from streampack.reader.foreign.files import check_id_fits
from streampack.reader.foreign.opening import Foreign, ForeignOptions
from streampack.reader.foreign.scanning import Boundary, Found, ScanPlan, TokenSpan, open_plan

CONFIG = "olmo.json"
LOOKS_FOR = "olmo: a folder with olmo.json or headerless *.npy token files, or one .npy file (with eos_id=)"
#: What reading the files checks of them, as ``verify`` reports it.
OPENED_CHECKS = (
    "olmo.json was checked where there is one (its fields, and its token and document counts against the "
    "files), and each file's size (whole tokens; a label mask one byte a token): OLMo's token files have "
    "no header, their documents end at the EOS id"
)
TOKEN_PREFIX = "token_ids"
MASK_PREFIX = "labels_mask"
#: The start of a NumPy ``.npy`` header: OLMo's token files are raw arrays despite their name.
NPY_MAGIC = b"\x93NUMPY"
_CONFIG_FIX = (
    "olmo.json holds paths, label_mask_paths, dtype (uint16 or uint32) and non-negative ids and counts, "
    "written last by streampack's export: rerun the export"
)
_Count = Annotated[int, msgspec.Meta(ge=0)]


class _Config(msgspec.Struct):
    """``olmo.json``, as the export writes it."""

    paths: list[str]
    label_mask_paths: list[str] | None = None
    dtype: Literal["uint16", "uint32"] | None = None
    eos_token_id: _Count | None = None
    bos_token_id: _Count | None = None
    vocab_size: _Count | None = None
    num_docs: _Count | None = None
    num_tokens: _Count | None = None


def companion(path: Path) -> str | None:
    """What the file ``path`` beside the token files is, for ``verify``'s notes; None for an unknown one."""
    if path.name.startswith(TOKEN_PREFIX) and path.name.endswith(".csv.gz"):
        return (
            f"dolma's document index of {path.name.removesuffix('.csv.gz')}.npy, not read (documents are "
            "found at the EOS ids), so not checked"
        )
    return None


def recognise(path: Path) -> bool:
    """Whether ``path`` is a folder with ``olmo.json`` or ``*.npy`` files, or a ``.npy`` file."""
    if path.is_dir():
        return (path / CONFIG).is_file() or any(path.glob("*.npy"))
    return path.suffix == ".npy" and path.is_file()


def read(path: Path, options: ForeignOptions) -> Foreign:
    """The token files at ``path``: :func:`plan`, its spans scanned."""
    return open_plan(plan(path, options))


def plan(path: Path, options: ForeignOptions) -> ScanPlan:
    """The token files at ``path``, one shard each, whose documents end at the EOS.

    Raises:
        CacheError: ``olmo.json`` is not what the export writes or disagrees with the files, or a token or
            mask file is missing or of the wrong size.
        OptionsError: no EOS id is known, an option disagrees with ``olmo.json``, or an id is too large.
    """
    has_config = path.is_dir() and (path / CONFIG).is_file()
    config = _config(path / CONFIG) if has_config else _Config(paths=[])
    if has_config:
        tokens = [path / p for p in config.paths]
        masks = [path / p for p in config.label_mask_paths] if config.label_mask_paths else None
    else:
        tokens, masks = _discover(path)
    where = path / CONFIG if has_config else path
    dtype = np.dtype(_declared(where, "dtype", config.dtype, options.dtype) or "uint16")
    dtype = dtype.newbyteorder("<")
    eos = _declared(where, "eos_token_id", config.eos_token_id, options.eos_id)
    bos = _declared(where, "bos_token_id", config.bos_token_id, options.bos_id)
    if eos is None:
        raise OptionsError(
            f"{path}: OLMo's token files end each document with the EOS id, and none is known: pass eos_id= "
            "(the tokenizer's EOS, the eos_token_id of the run's config)"
        )
    check_id_fits(path, "eos_id", eos, dtype)
    check_id_fits(path, "bos_id", bos, dtype)
    spans = [TokenSpan(file, dtype, 0, _token_count(file, dtype)) for file in tokens]
    if masks is not None:
        for mask, span in zip(masks, spans, strict=True):
            _check_mask(mask, span.path, span.count)
    recorded, num_docs = config.num_tokens, config.num_docs
    held = sum(span.count for span in spans)
    if recorded is not None and recorded != held:
        raise CacheError(
            f"{where}: num_tokens is {recorded:,} (and num_docs {num_docs}), but its token "
            f"files hold {held:,} tokens: a file was cut, emptied or replaced since olmo.json was written. "
            "Export the files again, or remove olmo.json's counts to read them as they are"
        )
    files = [*tokens, *(masks or []), *([path / CONFIG] if has_config else [])]

    def check(found: list[Found]) -> None:
        # More documents than olmo.json counts is no damage: a document that holds the EOS id (a chat
        # template's) is two to OLMo-core too.
        ended = sum(seen.num_docs for seen in found)
        if num_docs is not None and ended < num_docs:
            raise CacheError(
                f"{path / CONFIG}: num_docs is {num_docs:,}, but its token files hold {ended:,} documents "
                f"(ended by the EOS id {eos}): the files were changed since olmo.json was written. Export "
                "them again, or remove olmo.json's counts to read them as they are"
            )

    foreign = Foreign("olmo", path, dtype, [], eos, bos, config.vocab_size, files=files)
    return ScanPlan(foreign, spans, Boundary(eos), masks, check)


def _config(file: Path) -> _Config:
    """``olmo.json``, its fields checked."""
    try:
        raw = file.read_bytes()
    except OSError as e:
        raise CacheError(f"{file}: not readable ({e}); {_CONFIG_FIX}") from None
    config = read_json(raw, _Config, CacheError, str(file), _CONFIG_FIX)
    masks = config.label_mask_paths
    if masks is not None and len(masks) != len(config.paths):
        raise CacheError(
            f"{file}: label_mask_paths is {masks!r}, expected null or a list of {len(config.paths)} file "
            "names (one a token file)"
        )
    remote = [p for p in [*config.paths, *(masks or [])] if "://" in p]
    if remote:
        raise CacheError(
            f"{file}: {remote[0]} is a URL; streampack opens OLMo token files on a local disk: copy them "
            "beside olmo.json"
        )
    return config


def _discover(path: Path) -> tuple[list[Path], list[Path] | None]:
    """The token files of a folder without ``olmo.json`` (or the one file), and their masks if any."""
    if not path.is_dir():
        return [path], None
    files = sorted(p for p in path.glob("*.npy") if p.is_file())
    tokens = [p for p in files if not p.name.startswith(MASK_PREFIX)]
    if not tokens:
        raise CacheError(f"{path}: no token files; the *.npy files are all label masks ({MASK_PREFIX}_*)")
    masks = [p.with_name(p.name.replace(TOKEN_PREFIX, MASK_PREFIX, 1)) for p in tokens]
    found = [m.is_file() and m.name.startswith(MASK_PREFIX) for m in masks]
    if not any(found):
        return tokens, None
    if not all(found):
        lacking = tokens[found.index(False)]
        raise CacheError(
            f"{lacking}: no label mask beside it ({masks[found.index(False)].name}), where other token files "
            "have one: a loss mask covers every token or none"
        )
    return tokens, masks


def _declared(where: Path, name: str, recorded: Any, given: Any) -> Any:
    """The value ``olmo.json`` records for ``name``, or the one given; they must agree where both are."""
    if recorded is not None and given is not None and recorded != given:
        raise OptionsError(f"{where}: {name} is {recorded!r} there, but {given!r} was given: drop the option")
    return given if recorded is None else recorded


def _token_count(file: Path, dtype: np.dtype) -> int:
    """The tokens of ``file``, refusing a missing one, a NumPy header, or a partial token."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(len(NPY_MAGIC))
    except FileNotFoundError:
        raise CacheError(f"{file}: missing; it is one of the token files the cache lists") from None
    if head == NPY_MAGIC:
        raise CacheError(
            f"{file}: starts with a NumPy .npy header; OLMo's token files are headerless arrays "
            "(np.memmap). Write its tokens with array.tofile(), or open it with np.load"
        )
    if size % dtype.itemsize:
        raise CacheError(
            f"{file}: {size:,} bytes, not a whole number of {dtype.itemsize}-byte {dtype.name} tokens: the "
            f"file is truncated, or its tokens are not {dtype.name}"
        )
    return size // dtype.itemsize


def _check_mask(mask: Path, file: Path, count: int) -> None:
    try:
        size = mask.stat().st_size
    except FileNotFoundError:
        raise CacheError(f"{mask}: missing; it should hold the label mask of {file.name}") from None
    if size != count:
        raise CacheError(
            f"{mask}: {size:,} bytes, but the label mask of {file.name} holds one bool byte a token: "
            f"{count:,} expected. The file is truncated, or belongs to another token file"
        )

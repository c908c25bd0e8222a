"""Input discovery: paths, directories, globs and URLs to the ordered list of input files.

The rules, in the order they apply:

- Inputs are taken in the order given. A file named explicitly is read whatever its name (a hidden one
  too); a directory or glob contributes its input files sorted by path, so the order (and so the cache)
  is stable.
- Below the root of a directory or glob, entries whose name starts with ``.`` are skipped
  (``.git``, ``.ipynb_checkpoints``, ``.cache``), as Hugging Face ``datasets`` does; so are files of an
  unsupported type, a streampack cache's own files, and ``.json`` files that hold one JSON document
  (a ``tokenizer.json``, a ``config.json``) rather than JSON Lines.
- Symlinked folders are followed in both forms; a folder reached again through a link to itself or one
  of its parents (a loop) is skipped.
- Each real file (:func:`os.path.realpath`) is read once: a file given twice, or reached through two
  paths, keeps its first place and the later ones are skipped.

:func:`discover_inputs` returns the files and the skipped entries with the reason for each;
:func:`expand_inputs` returns the files only.
"""

from __future__ import annotations

import fnmatch
import json
import os
import posixpath
import re
import stat
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

import orjson

from streampack.errors import InputError

Format = Literal["jsonl", "parquet", "text"]

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt",)
PARQUET_SUFFIXES = (".parquet",)
COMPRESSION_SUFFIXES = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2", ".xz": "xz"}
STDIN_PATHS = ("-", "/dev/stdin", "/dev/fd/0", "/proc/self/fd/0")

# The reasons an entry is skipped (Ignored.reason); a duplicate's reason also names the file it repeats.
HIDDEN = "hidden"
DUPLICATE = "duplicate of"
NOT_JSON_LINES = "not JSON Lines"
CACHE = "a streampack cache"
SYMLINK_LOOP = "symlink loop"
NOT_AN_INPUT_TYPE = "not an input file type"
NOT_A_REGULAR_FILE = "not a regular file"
UNREADABLE = "cannot be listed"

_SNIFF_BYTES = 1 << 20  # a first line longer than this is taken to be JSON Lines
_BOM = b"\xef\xbb\xbf"
_MAGIC = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class InputFile:
    """One input file (local path or fsspec URL) with the stats that identify its content."""

    path: str
    format: Format
    compression: str | None
    size: int
    mtime_ns: int | None

    @property
    def is_local(self) -> bool:
        """True for a local path, false for a URL read through fsspec."""
        return "://" not in self.path

    def stat_json(self) -> dict[str, Any]:
        """The manifest record used to detect inputs that changed between a build and its resume."""
        return {"path": self.path, "size": self.size, "mtime_ns": self.mtime_ns}


@dataclass(frozen=True)
class Ignored:
    """An entry found under a directory or glob input (or given twice) that is not read, and why.

    Attributes:
        path: the entry as found (a file, or a folder skipped whole).
        reason: one of ``hidden``, ``duplicate of PATH``, ``not JSON Lines``, ``a streampack cache``,
            ``symlink loop``, ``not an input file type``, ``not a regular file``, ``cannot be listed``.
    """

    path: str
    reason: str


@dataclass(frozen=True)
class Discovery:
    """What the inputs resolve to: the files to read, in order, and the entries skipped on the way."""

    files: list[InputFile]
    ignored: list[Ignored] = field(default_factory=list)


def discover_inputs(inputs: Sequence[str | os.PathLike[str]]) -> Discovery:
    """Resolve paths, directories, globs and URLs to the ordered input files (see the module docstring).

    Args:
        inputs: local paths, directories, globs (``**`` for any depth) and fsspec URLs.

    Returns:
        The :class:`Discovery`: files in reading order, each real file once, and the skipped entries.

    Raises:
        InputError: an input does not exist, is not a file or directory, matches nothing, or has an
            unsupported extension.
    """
    if not inputs:
        raise InputError("no inputs given: pass one or more files, directories, globs or URLs")
    files: list[InputFile] = []
    ignored: list[Ignored] = []
    first_of: dict[str, str] = {}  # real path (or URL) -> the path it was first read as
    for raw in inputs:
        skipped: list[Ignored] = []  # this input's own, for its "no input files" message
        found = _expand_one(str(raw), skipped)
        ignored.extend(skipped)
        for file, real in found:
            if real in first_of:
                ignored.append(Ignored(file.path, f"{DUPLICATE} {first_of[real]}"))
            else:
                first_of[real] = file.path
                files.append(file)
    return Discovery(files, _skipped(ignored, first_of))


def expand_inputs(inputs: Sequence[str | os.PathLike[str]]) -> list[InputFile]:
    """The input files of :func:`discover_inputs`, without the skipped entries.

    Raises:
        InputError: as :func:`discover_inputs`.
    """
    return discover_inputs(inputs).files


def check_output_outside_inputs(
    out: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str]]
) -> None:
    """Refuse an output directory that is an input directory (or glob root), or that holds an input.

    Such a cache shares a directory with its inputs: its files would be read as input (or, once it is a
    cache, hide the inputs), and ``--overwrite`` could not tell the two apart. An output directory
    *inside* an input directory is fine: a cache found below an input root is never read.

    Raises:
        InputError: naming the output and the input.
    """
    target = Path(os.path.realpath(out))
    for raw in inputs:
        spec = str(raw)
        if "://" in spec or spec in STDIN_PATHS:
            continue
        root = _glob_root(spec) if _MAGIC.search(spec) else spec
        real = Path(os.path.realpath(root or os.curdir))
        if real == target:
            if root != spec:
                kind = f"the root of the input glob {spec}"
            else:
                kind = f"the input {'directory' if os.path.isdir(spec) else 'file'} {spec}"
            raise InputError(
                f"out={os.fspath(out)} is {kind}: the cache would be read as input; choose an output "
                "directory outside the inputs"
            )
        if target in real.parents:
            raise InputError(
                f"out={os.fspath(out)} holds the input {spec}: the cache and its inputs would share a "
                "directory; choose an output directory outside the inputs"
            )


def looks_like_json_lines(f: BinaryIO) -> bool:
    """False when the first non-blank line of ``f`` shows a single JSON document rather than JSON Lines.

    A document shows as ``{`` or ``[`` alone (pretty-printed), an array, or a JSON value that is not an
    object. Anything else counts as JSON Lines: an object, an empty file, a first line too long to tell
    (over 1 MiB), and a broken first record too, whose error is then reported when it is read rather
    than the whole file skipped.
    """
    budget = _SNIFF_BYTES
    while budget > 0:
        line = f.readline(budget)
        if not line:
            return True
        budget -= len(line)
        line = line.removeprefix(_BOM).strip()
        if not line:
            continue
        if line.startswith(b"{"):
            return line != b"{"
        return not (line.startswith(b"[") or _is_json(line))
    return True


def _is_json(line: bytes) -> bool:
    try:
        orjson.loads(line)
    except orjson.JSONDecodeError:
        pass
    else:
        return True
    try:  # what only Python's parser accepts (NaN, lone surrogates)
        json.loads(line.decode("utf-8"))
    except ValueError:
        return False
    return True


def describe_error(error: BaseException) -> str:
    """``Class: message`` of an error and of its causes: fsspec wraps the reason (a DNS failure, a 404)
    in a FileNotFoundError that names only the URL."""
    parts, seen = [], set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        parts.append(f"{type(cause).__name__}: {cause}")
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    return "; caused by ".join(parts)


# ---------------------------------------------------------------------------------------------- one input


def _expand_one(spec: str, ignored: list[Ignored]) -> list[tuple[InputFile, str]]:
    """The files of one input, with the real path (or URL) of each, in reading order."""
    if "://" in spec:
        return _expand_url(spec, ignored)
    if spec in STDIN_PATHS or os.path.abspath(spec) in STDIN_PATHS:
        raise InputError(
            f"{spec}: reading from standard input is not supported; save it to a file first (a file named "
            "'-': pass ./-)"
        )
    if _MAGIC.search(spec):
        root = _glob_root(spec)
        pattern = spec[len(root) :].lstrip(os.sep) if root else spec
        found = _found_files(root, _glob_parts(pattern), ignored)
        if not found:
            raise InputError(_nothing_found(f"{spec}: the glob matches no input files", ignored))
        return found
    try:
        mode = os.stat(spec).st_mode
    except FileNotFoundError:
        raise InputError(f"{spec}: no such file or directory") from None
    except OSError as e:
        raise InputError(f"{spec}: cannot read ({e.strerror or e})") from None
    if stat.S_ISDIR(mode):
        found = _found_files(spec, ["**", "*"], ignored)
        if not found:
            raise InputError(_nothing_found(f"{spec}: the directory holds no input files", ignored))
        return found
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
        raise InputError(f"{spec}: {_file_kind(mode)}, not a regular file or directory; pass a file")
    cache = _cache_holding(spec)
    if cache is not None:
        raise InputError(f"{spec}: a file of the streampack cache {cache}, not an input")
    return [(_local_file(spec), os.path.realpath(spec))]


def _nothing_found(message: str, ignored: list[Ignored]) -> str:
    message += f" ({_supported()})"
    entries = list(dict.fromkeys(ignored))
    if entries:
        shown = ", ".join(f"{i.path} ({i.reason})" for i in entries[:5])
        more = f" and {len(entries) - 5} more" if len(entries) > 5 else ""
        message += f"; skipped: {shown}{more}"
    return message


def _file_kind(mode: int) -> str:
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"


def _found_files(root: str, parts: list[str], ignored: list[Ignored]) -> list[tuple[InputFile, str]]:
    """The input files among the paths under ``root`` matching ``parts``, sorted by path."""
    real = os.path.realpath(root or os.curdir)
    found = []
    for path, file_real in sorted(set(_match(root, real, parts, frozenset([real]), ignored))):
        try:
            st = os.stat(file_real)
        except OSError:  # a broken symlink
            ignored.append(Ignored(path, NOT_A_REGULAR_FILE))
            continue
        reason = _not_an_input(path, st.st_mode)
        if reason is None:
            found.append((_local_file(path, st), file_real))
        else:
            ignored.append(Ignored(path, reason))
    return found


def _not_an_input(path: str, mode: int) -> str | None:
    """Why a file found under a directory or glob is not read, or None when it is an input file."""
    if not stat.S_ISREG(mode):
        return NOT_A_REGULAR_FILE
    if _detect(path) is None:
        return NOT_AN_INPUT_TYPE
    if path.lower().endswith(".json"):
        if _cache_holding(path) is not None:
            return CACHE
        if not _local_json_lines(path):
            return NOT_JSON_LINES
    return None


def _local_json_lines(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return looks_like_json_lines(f)
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e})") from None


def _cache_holding(path: str) -> str | None:
    """The cache directory when ``path`` is a cache's manifest or ledger file, else None."""
    parent = os.path.dirname(os.path.abspath(path))
    name = os.path.basename(path)
    candidates = [parent] if name == "manifest.json" else []
    if os.path.basename(parent) == "ledger":
        candidates.append(os.path.dirname(parent))
    return next((d for d in candidates if _is_cache(d)), None)


def _is_cache(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "manifest.json")) and os.path.isdir(
        os.path.join(directory, "ledger")
    )


def _local_file(path: str, st: os.stat_result | None = None) -> InputFile:
    abspath = os.path.abspath(path)
    if ".." in Path(path).parts and os.path.realpath(abspath) != os.path.realpath(path):
        abspath = os.path.join(os.getcwd(), path)  # "link/.." is not where abspath's folding says
    if st is None:
        try:
            st = os.stat(abspath)
        except OSError as e:
            raise InputError(f"{path}: cannot read ({e.strerror or e})") from None
    return InputFile(abspath, *_detect_strict(abspath), st.st_size, st.st_mtime_ns)


# ---------------------------------------------------------------------------------------------- globbing


def _glob_root(spec: str) -> str:
    """The leading folders of a glob that hold no wildcard (``""`` for the working directory)."""
    parts = spec.split(os.sep)
    first = next(i for i, p in enumerate(parts) if _MAGIC.search(p))
    root = os.sep.join(parts[:first])
    return root or (os.sep if spec.startswith(os.sep) else "")


def _glob_parts(pattern: str) -> list[str]:
    parts = [p for p in pattern.split(os.sep) if p]
    return [*parts, "*"] if parts[-1] == "**" else parts  # a trailing ** means every file below


def _match(
    directory: str, real: str, parts: list[str], ancestors: frozenset[str], ignored: list[Ignored]
) -> Iterator[tuple[str, str]]:
    """Files (with their real paths) under ``directory`` matching the glob components ``parts``.

    Glob semantics as Python's ``glob`` (``**`` is any number of folders; wildcards match no name that
    starts with ``.`` unless the pattern does), except that the hidden entries skipped are recorded, a
    folder that is a streampack cache is skipped whole, and symlinked folders are followed unless they
    lead back to a folder being walked (``ancestors``, real paths). ``real`` is the real path of
    ``directory``; those of its entries are derived from it, calling ``realpath`` only for symlinks.
    """
    if _is_cache(directory or os.curdir):
        ignored.append(Ignored(directory, CACHE))
        return
    head, rest = parts[0], parts[1:]
    if head == "**":
        yield from _match(directory, real, rest, ancestors, ignored)
        for name, path, sub_real, is_dir in _entries(directory, real, ignored):
            if not is_dir or _is_loop(path, sub_real, ancestors, ignored):
                continue
            if name.startswith("."):
                ignored.append(Ignored(path, HIDDEN))
            else:
                yield from _match(path, sub_real, parts, ancestors | {sub_real}, ignored)
    elif not _MAGIC.search(head):
        path = os.path.join(directory, head)
        if not rest:
            if os.path.lexists(path) and not os.path.isdir(path):
                yield path, os.path.realpath(path)
        elif os.path.isdir(path):
            sub_real = os.path.realpath(path)
            if not _is_loop(path, sub_real, ancestors, ignored):
                yield from _match(path, sub_real, rest, ancestors | {sub_real}, ignored)
    else:
        for name, path, entry_real, is_dir in _entries(directory, real, ignored):
            if not fnmatch.fnmatch(name, head) or (rest and not is_dir):
                continue
            if name.startswith(".") and not head.startswith("."):
                ignored.append(Ignored(path, HIDDEN))
            elif not rest:
                if not is_dir:
                    yield path, entry_real
            elif not _is_loop(path, entry_real, ancestors, ignored):
                yield from _match(path, entry_real, rest, ancestors | {entry_real}, ignored)


def _entries(directory: str, real: str, ignored: list[Ignored]) -> Iterator[tuple[str, str, str, bool]]:
    """The entries of ``directory`` sorted by name: name, path, real path, and whether it is a folder."""
    try:
        with os.scandir(directory or os.curdir) as it:
            entries = sorted(it, key=lambda e: e.name)
    except FileNotFoundError:
        return
    except OSError as e:
        ignored.append(Ignored(directory, f"{UNREADABLE} ({e.strerror or e})"))
        return
    for entry in entries:
        path = os.path.join(directory, entry.name)
        try:
            is_dir, is_link = entry.is_dir(), entry.is_symlink()
        except OSError:
            is_dir, is_link = False, True
        entry_real = os.path.realpath(path) if is_link else os.path.join(real, entry.name)
        yield entry.name, path, entry_real, is_dir


def _is_loop(path: str, real: str, ancestors: frozenset[str], ignored: list[Ignored]) -> bool:
    """True (and recorded) when the folder ``path`` leads back to a folder being walked."""
    if real in ancestors:
        ignored.append(Ignored(path, SYMLINK_LOOP))
        return True
    return False


# ---------------------------------------------------------------------------------------------- URLs


def _expand_url(spec: str, ignored: list[Ignored]) -> list[tuple[InputFile, str]]:
    """The files of a URL, a URL glob, or a URL folder (expanded like a local directory)."""
    try:
        import fsspec

        fs, _, paths = fsspec.get_fs_token_paths(spec)
        infos = [(p, fs.info(p)) for p in sorted(paths)]
        found: list[tuple[str, dict[str, Any]]] = []
        for path, info in infos:
            if info.get("type") == "directory":
                found.extend(_url_folder(fs, path, ignored))
            else:
                found.append((path, info))
    except ImportError as e:
        raise InputError(f"{spec}: cannot read ({describe_error(e)}); install the fsspec backend") from None
    except Exception as e:  # fsspec backends raise their own classes (aiohttp, botocore, ...)
        raise InputError(f"{spec}: cannot read ({describe_error(e)})") from None
    if not found:
        message = f"{spec}: the URL matches no input files"
        raise InputError(_nothing_found(message, ignored) if ignored else message)
    files = []
    for path, info in found:
        url = fs.unstrip_protocol(path)
        # Remote stores have no portable mtime: a resumed build checks the size of remote inputs only.
        files.append((InputFile(url, *_detect_strict(url), int(info.get("size") or 0), None), url))
    return files


def _url_folder(fs: Any, root: str, ignored: list[Ignored]) -> list[tuple[str, dict[str, Any]]]:
    """The input files below a URL folder, sorted; hidden entries, caches and other types are skipped."""
    root = root.rstrip("/")
    entries: dict[str, dict[str, Any]] = fs.find(root, detail=True)
    manifests = {posixpath.dirname(p) for p in entries if posixpath.basename(p) == "manifest.json"}
    ledgers = {posixpath.dirname(posixpath.dirname(p)) for p in entries if "/ledger/" in p}
    caches = sorted(manifests & ledgers)
    found = []
    for path in sorted(entries):
        info, url = entries[path], fs.unstrip_protocol(path)
        relative = path[len(root) + 1 :].split("/")
        hidden = next((i for i, part in enumerate(relative) if part.startswith(".")), None)
        cache = next((c for c in caches if path.startswith(c + "/")), None)
        if hidden is not None:
            ignored.append(Ignored(fs.unstrip_protocol("/".join([root, *relative[: hidden + 1]])), HIDDEN))
        elif cache is not None:
            ignored.append(Ignored(fs.unstrip_protocol(cache), CACHE))
        elif info.get("type") != "file":
            ignored.append(Ignored(url, NOT_A_REGULAR_FILE))
        elif _detect(path) is None:
            ignored.append(Ignored(url, NOT_AN_INPUT_TYPE))
        elif path.lower().endswith(".json") and not _remote_json_lines(fs, path):
            ignored.append(Ignored(url, NOT_JSON_LINES))
        else:
            found.append((path, info))
    return found


def _remote_json_lines(fs: Any, path: str) -> bool:
    with fs.open(path, "rb") as f:
        return looks_like_json_lines(f)


def _skipped(ignored: list[Ignored], read: dict[str, str]) -> list[Ignored]:
    """The entries skipped, once each (a folder can be listed by more than one ``**``), with absolute
    paths; without those read after all (a hidden file also named explicitly)."""
    skipped = []
    for entry in dict.fromkeys(ignored):
        if "://" in entry.path:
            skipped.append(entry)
        elif entry.reason.startswith(DUPLICATE) or os.path.realpath(entry.path) not in read:
            skipped.append(Ignored(os.path.abspath(entry.path), entry.reason))
    return skipped


# ---------------------------------------------------------------------------------------------- types


def _detect(path: str) -> tuple[Format, str | None] | None:
    """Format and compression of a path from its extension, or None when it is not an input file."""
    name = path.lower()
    compression = None
    for suffix, kind in COMPRESSION_SUFFIXES.items():
        if name.endswith(suffix):
            compression, name = kind, name[: -len(suffix)]
            break
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl", compression
    if name.endswith(TEXT_SUFFIXES):
        return "text", compression
    if name.endswith(PARQUET_SUFFIXES) and compression is None:
        return "parquet", None
    return None


def _detect_strict(path: str) -> tuple[Format, str | None]:
    detected = _detect(path)
    if detected is None:
        raise InputError(f"{path}: unknown file type ({_supported()}); rename the file or convert it")
    return detected


def _supported() -> str:
    compressed = "/".join(COMPRESSION_SUFFIXES)
    return (
        f"supported: {', '.join(JSONL_SUFFIXES + TEXT_SUFFIXES)} optionally compressed ({compressed}), "
        f"and {PARQUET_SUFFIXES[0]}"
    )

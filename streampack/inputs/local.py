"""Local inputs: the files of a directory or glob walked by discovery's rules, and one local file's stats."""

from __future__ import annotations

import fnmatch
import os
import re
import stat
from collections.abc import Iterator

from streampack.errors import InputError
from streampack.inputs.inputfile import (
    CACHE,
    HIDDEN,
    NOT_A_REGULAR_FILE,
    NOT_AN_INPUT_TYPE,
    NOT_JSON_LINES,
    SYMLINK_LOOP,
    UNREADABLE,
    Format,
    Ignored,
    InputFile,
    detect,
    detect_strict,
    looks_like_json_lines,
)

MAGIC = re.compile(r"[*?\[]")


def found_files(root: str, parts: list[str], ignored: list[Ignored]) -> list[tuple[InputFile, str]]:
    """The input files among the paths under ``root`` matching ``parts``, sorted by path."""
    real = os.path.realpath(root or os.curdir)
    found = []
    for path, file_real in sorted(set(_match(root, real, parts, frozenset([real]), ignored))):
        try:
            st = os.stat(file_real)
        except OSError:  # a broken symlink
            ignored.append(Ignored(path, NOT_A_REGULAR_FILE))
            continue
        detected = detect(path)
        reason = _not_an_input(path, st.st_mode, detected)
        if reason is None:
            found.append((local_file(path, st, detected), file_real))
        else:
            ignored.append(Ignored(path, reason))
    return found


def _not_an_input(path: str, mode: int, detected: tuple[Format, str | None] | None) -> str | None:
    """Why a file found under a directory or glob is not read, or None when it is an input file."""
    if not stat.S_ISREG(mode):
        return NOT_A_REGULAR_FILE
    if detected is None:
        return NOT_AN_INPUT_TYPE
    if path.lower().endswith(".json"):
        if cache_holding(path) is not None:
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


def cache_holding(path: str) -> str | None:
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


def local_file(
    path: str, st: os.stat_result | None = None, detected: tuple[Format, str | None] | None = None
) -> InputFile:
    """The input file at local ``path`` (made absolute), with its stats and format where already known."""
    abspath = path if _absolute_and_normal(path) else os.path.abspath(path)
    if ".." in path.split(os.sep) and os.path.realpath(abspath) != os.path.realpath(path):
        abspath = os.path.join(os.getcwd(), path)  # "link/.." is not where abspath's folding says
    if st is None:
        try:
            st = os.stat(abspath)
        except OSError as e:
            raise InputError(f"{path}: cannot read ({e.strerror or e})") from None
    return InputFile(abspath, *(detected or detect_strict(abspath)), st.st_size, st.st_mtime_ns)


def _absolute_and_normal(path: str) -> bool:
    """Whether ``os.path.abspath`` would give ``path`` back (most paths found under an absolute folder)."""
    sep = os.sep
    return path.startswith(sep) and not path.endswith(sep) and sep * 2 not in path and sep + "." not in path


def glob_root(spec: str) -> str:
    """The leading folders of a glob that hold no wildcard (``""`` for the working directory)."""
    parts = spec.split(os.sep)
    first = next(i for i, p in enumerate(parts) if MAGIC.search(p))
    root = os.sep.join(parts[:first])
    return root or (os.sep if spec.startswith(os.sep) else "")


def glob_parts(pattern: str) -> list[str]:
    parts = [p for p in pattern.split(os.sep) if p]
    return [*parts, "*"] if parts[-1] == "**" else parts  # a trailing ** means every file below


def _match(
    directory: str, real: str, parts: list[str], ancestors: frozenset[str], ignored: list[Ignored]
) -> Iterator[tuple[str, str]]:
    """Files (with their real paths) under ``directory`` matching the glob components ``parts``.

    As Python's ``glob``, except that hidden entries skipped are recorded, a cache folder is skipped whole,
    and symlinked folders are followed unless they lead back to one of ``ancestors`` (real paths).
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
    elif not MAGIC.search(head):
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
            if (head != "*" and not fnmatch.fnmatch(name, head)) or (rest and not is_dir):
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
    # os.path.join(directory, name) and os.path.join(real, name), a prefix joined once (10^4 entries)
    here, there = os.path.join(directory, ""), os.path.join(real, "")
    for entry in entries:
        path = here + entry.name
        try:
            is_dir, is_link = entry.is_dir(), entry.is_symlink()
        except OSError:
            is_dir, is_link = False, True
        entry_real = os.path.realpath(path) if is_link else there + entry.name
        yield entry.name, path, entry_real, is_dir


def _is_loop(path: str, real: str, ancestors: frozenset[str], ignored: list[Ignored]) -> bool:
    """True (and recorded) when the folder ``path`` leads back to a folder being walked."""
    if real in ancestors:
        ignored.append(Ignored(path, SYMLINK_LOOP))
        return True
    return False

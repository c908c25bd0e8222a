"""Input discovery: paths, directories, globs and URLs to the ordered list of input files.

- Inputs are read in the order given; a directory or glob gives its input files sorted by path. A file
  named explicitly is read whatever its name.
- Below a directory or glob root, hidden entries (``.git``), files of other types, a streampack cache's
  files and ``.json`` files holding one JSON document (a ``config.json``) are skipped.
- Symlinked folders are followed, except into a loop.
- Each real file is read once, at its first place.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from streampack.errors import InputError
from streampack.inputs.inputfile import DUPLICATE, Ignored, InputFile, nothing_found
from streampack.inputs.local import MAGIC, cache_holding, found_files, glob_parts, glob_root, local_file
from streampack.inputs.urls import expand_url

STDIN_PATHS = ("-", "/dev/stdin", "/dev/fd/0", "/proc/self/fd/0")


@dataclass(frozen=True)
class Discovery:
    """What the inputs resolve to: the files to read, in order, and the entries skipped on the way."""

    files: list[InputFile]
    ignored: list[Ignored] = field(default_factory=list)


def discover_inputs(inputs: Sequence[str | os.PathLike[str]]) -> Discovery:
    """Resolve local paths, directories, globs (``**`` for any depth) and fsspec URLs to the input files in
    reading order, and the entries skipped (see the module's rules).

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
    """Refuse an output directory that is an input directory (or glob root), or that holds an input: the
    two would mix. An output directory inside an input directory is fine (a cache there is never read).

    Raises:
        InputError: naming the output and the input.
    """
    target = Path(os.path.realpath(out))
    for raw in inputs:
        spec = str(raw)
        if "://" in spec or spec in STDIN_PATHS:
            continue
        root = glob_root(spec) if MAGIC.search(spec) else spec
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


def _expand_one(spec: str, ignored: list[Ignored]) -> list[tuple[InputFile, str]]:
    """The files of one input, with the real path (or URL) of each, in reading order."""
    if "://" in spec:
        return expand_url(spec, ignored)
    if spec in STDIN_PATHS or os.path.abspath(spec) in STDIN_PATHS:
        raise InputError(
            f"{spec}: reading from standard input is not supported; save it to a file first (a file named "
            "'-': pass ./-)"
        )
    if MAGIC.search(spec):
        root = glob_root(spec)
        pattern = spec[len(root) :].lstrip(os.sep) if root else spec
        found = found_files(root, glob_parts(pattern), ignored)
        if not found:
            raise InputError(nothing_found(f"{spec}: the glob matches no input files", ignored))
        return found
    try:
        mode = os.stat(spec).st_mode
    except FileNotFoundError:
        raise InputError(f"{spec}: no such file or directory") from None
    except OSError as e:
        raise InputError(f"{spec}: cannot read ({e.strerror or e})") from None
    if stat.S_ISDIR(mode):
        found = found_files(spec, ["**", "*"], ignored)
        if not found:
            raise InputError(nothing_found(f"{spec}: the directory holds no input files", ignored))
        return found
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
        kind = next((name for is_kind, name in _SPECIAL_FILES if is_kind(mode)), "a special file")
        raise InputError(f"{spec}: {kind}, not a regular file or directory; pass a file")
    cache = cache_holding(spec)
    if cache is not None:
        raise InputError(f"{spec}: a file of the streampack cache {cache}, not an input")
    return [(local_file(spec), os.path.realpath(spec))]


_SPECIAL_FILES = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _skipped(ignored: list[Ignored], read: dict[str, str]) -> list[Ignored]:
    """The entries skipped, once each and with absolute paths, without those read after all."""
    skipped = []
    for entry in dict.fromkeys(ignored):
        if "://" in entry.path:
            skipped.append(entry)
        elif entry.reason.startswith(DUPLICATE) or os.path.realpath(entry.path) not in read:
            skipped.append(Ignored(os.path.abspath(entry.path), entry.reason))
    return skipped

"""URL inputs: the files of a URL, a URL glob or a URL folder, read through fsspec."""

from __future__ import annotations

import posixpath
from typing import Any

from streampack.errors import InputError
from streampack.inputs.inputfile import (
    CACHE,
    HIDDEN,
    NOT_A_REGULAR_FILE,
    NOT_AN_INPUT_TYPE,
    NOT_JSON_LINES,
    Ignored,
    InputFile,
    describe_error,
    detect,
    detect_strict,
    looks_like_json_lines,
    nothing_found,
)


def expand_url(spec: str, ignored: list[Ignored]) -> list[tuple[InputFile, str]]:
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
        raise InputError(nothing_found(message, ignored) if ignored else message)
    files = []
    for path, info in found:
        url = fs.unstrip_protocol(path)
        # no portable mtime: a resumed build checks the size of remote inputs only
        files.append((InputFile(url, *detect_strict(url), int(info.get("size") or 0), None), url))
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
        elif detect(path) is None:
            ignored.append(Ignored(url, NOT_AN_INPUT_TYPE))
        elif path.lower().endswith(".json") and not _remote_json_lines(fs, path):
            ignored.append(Ignored(url, NOT_JSON_LINES))
        else:
            found.append((path, info))
    return found


def _remote_json_lines(fs: Any, path: str) -> bool:
    with fs.open(path, "rb") as f:
        return looks_like_json_lines(f)

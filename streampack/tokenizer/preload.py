"""Start the fast engine's load of a ``tokenizer.json`` before a command has imported what it runs.

A build cannot encode before fastokens has made its tokenizer (~0.25 CPU-s for GPT-2's), and the command's
own imports take ~0.25 s more on the main thread. fastokens lets go of the GIL while it loads, so the
``streampack`` command starts that load first (:func:`start`), on an idle core, and the tokenizer takes it
(:func:`take`) when its file holds the very bytes that were loaded; otherwise it loads its own.

Only the standard library is imported here: this runs before anything else of the command.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

_lock = threading.Lock()
_started: dict[bytes, Future[Any]] = {}


#: The engine choices under which a ``tokenizer.json`` may be encoded by fastokens.
FAST_ENGINES = ("auto", "fastokens")


def start(spec: object, engine: object = "auto") -> bool:
    """Start loading the ``tokenizer.json`` that ``spec`` names (the file, or a folder holding one) with
    fastokens, on a thread of its own, where the ``engine`` chosen may be fastokens; False where there is
    nothing to start (another engine, not a path, no such file, an unreadable one, or fastokens not
    installed). The options are not checked here: the build checks them."""
    if engine not in FAST_ENGINES or not isinstance(spec, (str, os.PathLike)) or spec == "bytes":
        return False
    path = Path(spec)
    try:
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file() or importlib.util.find_spec("fastokens") is None:
            return False
        definition = path.read_bytes()
    except (OSError, ValueError):  # the command's own load says what is wrong with the file, in its words
        return False
    loading: Future[Any] = Future()
    with _lock:
        if definition in _started:  # begun and not taken yet (a build that failed before its load)
            return True
        _started[definition] = loading
    # Not a daemon: a process that exits waits for the load to end rather than killing the thread inside
    # fastokens' native code, which aborts.
    threading.Thread(target=_load, args=(definition, loading), name="streampack-fastokens-preload").start()
    return True


def take(definition: bytes) -> Future[Any] | None:
    """The load :func:`start` began of exactly these ``tokenizer.json`` bytes (its ``fastokens.Tokenizer``,
    or the error fastokens raised), handed over once; None if none was begun."""
    with _lock:
        return _started.pop(definition, None)


def _load(definition: bytes, loading: Future[Any]) -> None:
    try:
        import fastokens

        tokenizer = fastokens.Tokenizer.from_json_str(definition.decode("utf-8"))
    except BaseException as e:  # handed to whoever takes the load, as a load of its own would raise it
        loading.set_exception(e)
    else:
        loading.set_result(tokenizer)

"""Start the fast engine's load of a tokenizer before a command has imported what it runs.

fastokens lets go of the GIL while it loads, so the load runs beside the command's imports, and the
tokenizer takes it (:func:`take`) when its files hold the very bytes that were loaded. Only the standard
library is imported here: this runs before anything else of the command.
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

TIKTOKEN_PREFIX = "tiktoken:"  # how a tokenizer spec names a tiktoken encoding's ranks file

_lock = threading.Lock()
_started: dict[bytes, Future[Any]] = {}


#: The engine choices under which a ``tokenizer.json`` may be encoded by fastokens.
FAST_ENGINES = ("auto", "fastokens")


def start_for_command(args: list[str]) -> bool:
    """Start loading the tokenizer a ``streampack build`` command line names (:func:`start`); False for
    any other command line."""
    named = named_by_command(args)
    return named is not None and start(*named)


def named_by_command(args: list[str]) -> tuple[str, str] | None:
    """The ``--tokenizer`` and ``--tokenizer-engine`` of a ``build`` command line, else None: a guess before
    the options are parsed (a wrong one costs a load never taken)."""
    if not args or args[0] != "build" or {"-h", "--help"} & set(args):
        return None
    options = dict(option_values(args[1:]))
    tokenizer = options.get("--tokenizer", options.get("-t"))
    return None if tokenizer is None else (tokenizer, options.get("--tokenizer-engine", "auto"))


def option_values(args: list[str]) -> list[tuple[str, str]]:
    """(option, value) for each ``--name value``, ``--name=value`` and ``-t value`` in ``args``."""
    pairs = []
    for i, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if equals and name.startswith("--"):
            pairs.append((name, value))
        elif arg.startswith("-") and i + 1 < len(args):
            pairs.append((arg, args[i + 1]))
    return pairs


def start(spec: object, engine: object = "auto") -> bool:
    """Start loading with fastokens, on a thread of its own, the tokenizer ``spec`` names where ``engine``
    may be fastokens: a ``tokenizer.json``, or ``tiktoken:`` ranks whose split fastokens runs by hand
    (cl100k's, o200k's). False where there is nothing to start; the build checks the options."""
    if engine not in FAST_ENGINES or not isinstance(spec, (str, os.PathLike)) or spec == "bytes":
        return False
    if importlib.util.find_spec("fastokens") is None:
        return False
    if isinstance(spec, str) and spec.startswith(TIKTOKEN_PREFIX):
        return _start_tiktoken(Path(spec.removeprefix(TIKTOKEN_PREFIX)))
    path = Path(spec)
    try:
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            return False
        definition = path.read_bytes()
    except (OSError, ValueError):  # the command's own load says what is wrong with the file, in its words
        return False
    return _begin(definition, lambda fastokens: fastokens.Tokenizer.from_json_str(definition.decode("utf-8")))


def _start_tiktoken(ranks: Path) -> bool:
    """:func:`start` for a tiktoken ranks file, keyed by its bytes and its sidecar's."""
    # imported here: its dataclasses (8 ms) would delay the load of a tokenizer.json, the usual case
    from streampack.tokenizer.fast_forms import fast_split, load_fast_tiktoken

    try:
        ranks_bytes, sidecar_bytes = ranks.read_bytes(), ranks.with_suffix(".json").read_bytes()
        meta = json.loads(sidecar_bytes)
    except (OSError, ValueError):
        return False
    if not isinstance(meta, dict) or not isinstance(pattern := meta.get("pat_str"), str):
        return False
    specials = meta.get("special_tokens", {})
    if fast_split(pattern) is None or not isinstance(specials, dict):
        return False
    return _begin(
        ranks_bytes + sidecar_bytes,
        lambda fastokens: load_fast_tiktoken(fastokens, ranks, None, pattern, specials),
    )


def _begin(definition: bytes, load: Callable[[Any], Any]) -> bool:
    """Run ``load(fastokens)`` on a thread of its own, as the load of ``definition``; True."""
    loading: Future[Any] = Future()
    with _lock:
        if definition in _started:  # begun and not taken yet (a build that failed before its load)
            return True
        _started[definition] = loading
    # Not a daemon: a process that exits waits for the load to end rather than killing the thread inside
    # fastokens' native code, which aborts.
    threading.Thread(target=_load, args=(load, loading), name="streampack-fastokens-preload").start()
    return True


def take(definition: bytes) -> Future[Any] | None:
    """The load :func:`start` began of exactly these bytes, handed over once; None if none was begun."""
    with _lock:
        return _started.pop(definition, None)


def taken_or_loaded(definition: bytes, load: Callable[[], Any]) -> Any:
    """The ``fastokens.Tokenizer`` :func:`start` began to load from exactly these bytes, else ``load()``'s."""
    early = take(definition)
    return load() if early is None else early.result()


def _load(load: Callable[[Any], Any], loading: Future[Any]) -> None:
    try:
        import fastokens

        tokenizer = load(fastokens)
    except BaseException as e:  # handed to whoever takes the load, as a load of its own would raise it
        loading.set_exception(e)
    else:
        loading.set_result(tokenizer)

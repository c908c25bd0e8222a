"""Exceptions raised by streampack, the warning it gives about another format's documents, and
:func:`read_json`, the one way it reads JSON that comes in.

Every error a user can cause is a :class:`StreampackError`; the CLI prints its message (no traceback) and
exits with status 1. Messages say what was received, where (file and line or row), and what to do.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any, TypeVar

import msgspec

__all__ = [
    "BadRecordError",
    "BuildLockedError",
    "BuildStalledError",
    "CacheError",
    "ConfigMismatchError",
    "DocumentBoundaryWarning",
    "InputError",
    "LoaderStateError",
    "MissingDependencyError",
    "OptionsError",
    "StreampackError",
    "TokenizerError",
    "WorkerDiedError",
    "WriteError",
    "read_json",
]

T = TypeVar("T")


class StreampackError(Exception):
    """Base class of the errors a user can cause and fix."""


class InputError(StreampackError):
    """An input cannot be found, opened or read as a whole (missing file, unknown extension, bad stream)."""


class BadRecordError(InputError):
    """One record of an input is unusable: malformed JSON, missing text field, invalid UTF-8.

    Attributes:
        location: ``path:line`` (or ``path:row N``) of the record.
    """

    def __init__(self, location: str, problem: str) -> None:
        super().__init__(
            f'{location}: {problem}. Fix the record, or rerun with on_bad_record="skip" to skip and count '
            "such records (the committed part of the cache is kept)."
        )
        self.location = location
        self.problem = problem

    def __reduce__(self) -> tuple[type[BadRecordError], tuple[str, str]]:
        return (type(self), (self.location, self.problem))  # survive pickling from worker processes


class WriteError(StreampackError):
    """Writing the cache failed (disk full, file size limit, read-only or vanished directory).

    Nothing more is written after it: what the disk holds past the last commit is unknown, and the
    resumed build truncates it away.
    """


class CacheError(StreampackError):
    """A cache directory is missing, incomplete, damaged, or from an unsupported format version."""


class BuildStalledError(CacheError):
    """A cache followed while its build runs (:class:`streampack.follow.Follow`) got no new data in
    time."""


class ConfigMismatchError(StreampackError):
    """A build was asked to continue a cache made with different settings."""


class LoaderStateError(StreampackError, ValueError):
    """A loader state (``load_state_dict``) is damaged, from a newer streampack, or from another run.

    Also a ``ValueError``; the message names both sides of a mismatch.
    """


class OptionsError(StreampackError, ValueError):
    """An option has a value that is not allowed (a negative size, contradicting flags, a bad choice).

    Also a ``ValueError``, as a wrong argument value is.
    """


class TokenizerError(StreampackError):
    """A tokenizer spec names no usable tokenizer: a missing or malformed file, or a bad sidecar."""


class BuildLockedError(StreampackError):
    """Another build holds the output directory's lock."""


class WorkerDiedError(StreampackError):
    """A build worker died (killed, out of memory, a lost Ray node); rerunning the build resumes it."""


class MissingDependencyError(StreampackError, ModuleNotFoundError):
    """An optional dependency (an extra such as ``ray``, ``torch`` or ``tiktoken``) is not installed.

    A ``ModuleNotFoundError``, so ``pytest.importorskip("streampack.torch")`` skips where torch is absent.
    """


@contextlib.contextmanager
def extra_needed(user: str, needs: str, extra: str) -> Iterator[None]:
    """Turn an ``ImportError`` in the block into a :class:`MissingDependencyError` naming the extra:
    ``{user} needs {needs}: pip install 'streampack[{extra}]'`` (``streampack.torch needs PyTorch: ...``)."""
    try:
        yield
    except ImportError as error:
        raise MissingDependencyError(f"{user} needs {needs}: pip install 'streampack[{extra}]'") from error


class DocumentBoundaryWarning(UserWarning):
    """Another format's token files were opened with document boundaries that may not be theirs: a nanoGPT
    file without a declared ``eos_id`` (read as one document), llm.c shards that hold no delimiter.

    The tokens are read as they lie; ``documents``, ``packed`` and ``output="dict"`` labels follow the
    boundaries, so the message says what to declare.
    """


def read_json(
    value: object,
    struct: type[T],
    error: type[StreampackError],
    where: str,
    fix: str,
    *,
    at: str = "$",
    strict: bool = True,
) -> T:
    """``value`` (parsed JSON or YAML, or the bytes of a JSON file) as ``struct``, a msgspec type.

    Every refusal reads the same, naming the JSON path: ``{where}: Expected `int` >= 0, got `-1` - at
    `$.order.seed`; {fix}``, or ``{where}: not JSON (...); {fix}``.

    Args:
        value: what was read.
        struct: what it must be.
        error: the error to raise.
        where: what ``value`` is, for the message (a file, ``"version 2 loader state"``).
        fix: what to do, for the message.
        at: the JSON path of ``value`` in what ``where`` names (``"$.order"``).
        strict: False to take numbers written as strings or floats (``"1e9"``, ``2.0e+10``), as in a
            config file.

    Raises:
        StreampackError: (``error``) ``value`` is not what ``struct`` holds.
    """
    if isinstance(value, bytes):
        try:
            value = msgspec.json.decode(value)
        except msgspec.DecodeError as bad:
            raise error(f"{where}: not JSON ({bad}); {fix}") from None
    try:
        return msgspec.convert(value, struct, strict=strict)
    except msgspec.ValidationError as refused:
        text, found, path = str(refused).rpartition(" - at ")
        if not found:
            text, path = path, "`$`"
        if text.startswith("Expected") and ", got" not in text and path.startswith("`$"):
            with contextlib.suppress(LookupError, TypeError):  # msgspec does not say a missed bound's value
                text += f", got `{_value_at(value, path.strip('`'))!r:.80}`"
        raise error(f"{where}: {text} - at {path.replace('`$', f'`{at}')}; {fix}") from None


def _value_at(value: Any, path: str) -> object:
    """The value at a JSON path as msgspec names it (``$.order.seed``, ``$.history[0]``)."""
    if "[...]" in path:
        raise LookupError(path)
    for name, index in re.findall(r"\.(\w+)|\[(\d+)\]", path):
        value = value[name] if name else value[int(index)]
    return value

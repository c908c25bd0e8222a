"""Which input record each document of a cache was built from, and which document a named record made.

A document is the ``k``-th of its shard, which is one work unit of the build. The unit's input is read
again as the build read it (:func:`read_options`) and its records counted as the build counted them
(:func:`~streampack.inputs.records.makes_document`), up to its ``k``-th document (:func:`locate`, for
``streampack which``) or up to a named record (:func:`documents_named`, for ``Exclusions(records=...)``).
Each unit is read once per call. The input files must still be as they were at build time; Python
objects (``python:TYPE`` inputs) have no file to read again.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from collections.abc import Generator, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from streampack.errors import InputError, OptionsError, TokenizerError
from streampack.inputs.discovery import discover_inputs
from streampack.inputs.inputfile import InputFile
from streampack.inputs.records import Documents, Item, ReadOptions, WorkUnit, makes_document
from streampack.inputs.sft import ChatTemplate, load_chat_template
from streampack.inputs.units import plan_python_units, plan_units, read_unit, records_before
from streampack.loader.exclusions import parse_record
from streampack.order import groups
from streampack.reader import Cache
from streampack.store.files import read_entry
from streampack.tokenizer import load_tokenizer

__all__ = ["Origin", "documents_named", "locate", "read_options"]


@dataclass(frozen=True)
class Origin:
    """Where a document came from (see :class:`~streampack.runs.provenance.Provenance`)."""

    unit: int
    length: int
    path: str
    line: int | None = None
    row: int | None = None


def locate(cache: Cache, docs: list[int], documents: Any) -> dict[int, Origin]:
    """The input record of each of ``docs`` (global indices in ``cache``): one replay per unit."""
    inputs = _Inputs(cache, documents)
    doc_starts = cache.doc_starts
    shards = np.searchsorted(doc_starts, docs, side="right") - 1
    found: dict[int, Origin] = {}
    for shard, picked in groups(shards):
        info = cache.shard_info(shard)
        locals_ = [docs[i] - int(doc_starts[shard]) for i in picked.tolist()]
        offsets = cache.shard_offsets(shard)
        unit = int(info.name)
        origin = cache.files.origin(shard)
        records: dict[int, _Where]
        if origin is not None:  # another format's files: the document's index in its file
            records = {local: (origin[0], None, origin[1] + local) for local in locals_}
        else:
            records = inputs.records(unit, locals_)
        for local, (path, line, row) in records.items():
            length = int(offsets[local]) - (int(offsets[local - 1]) if local else 0)
            found[int(doc_starts[shard]) + local] = Origin(unit, length, path, line, row)
    return found


def read_options(cache: Cache) -> ReadOptions:
    """How the build of ``cache`` read its records, from its manifest: the text field, the SFT fields, or
    the chat template, read again from the cache's tokenizer. Read otherwise, other records would count
    as documents.

    Raises:
        InputError: a chat build whose tokenizer no longer gives the chat template it was built with.
    """
    settings = cache.manifest.settings
    read = ReadOptions(settings.text_field, settings.split_lines, settings.unit_bytes, fields=settings.fields)
    if settings.chat is None:
        return read
    chat = _chat_template(cache, settings.chat)
    policy: dict[str, Any] = {"turns": settings.chat_turns, "reasoning": settings.chat_reasoning}
    return dataclasses.replace(read, chat=dataclasses.replace(chat, **policy))


def _chat_template(cache: Cache, field: str) -> ChatTemplate:
    """The chat template a chat build rendered its conversations with, found where the build found it."""
    built_with = cache.manifest.tokenizer
    spec = built_with.spec or cache.manifest.settings.tokenizer or "bytes"
    why = "to find which records made its documents, its conversations are rendered again as the build did"
    try:
        chat = load_chat_template(load_tokenizer(spec, engine="tokenizers"), field)
    except TokenizerError as e:
        raise InputError(
            f"{cache.root}: {why}, with the chat template of its tokenizer {spec!r} (a relative path is "
            f"taken from where the build ran), which cannot be read now: {e}"
        ) from None
    expected = built_with.chat_template_sha256
    if expected is not None and chat.sha256 != expected:
        raise InputError(
            f"{chat.origin}: its chat template has sha256 {chat.sha256}, but the cache {cache.root} was "
            f"built with sha256 {expected}; {why}, and another template may render them otherwise: restore "
            "the template, or rebuild the cache"
        )
    return chat


_Where = tuple[str, int | None, int | None]  # (path, line, row)
_PYTHON_ROWS = re.compile(r"\[rows (\d+):\d*\]$")


class _Inputs:
    """The work units a cache was built from, planned again from its manifest, and replayed on demand."""

    def __init__(self, cache: Cache, documents: Any) -> None:
        self.cache = cache
        manifest = cache.manifest
        self.python = any(i.python for i in manifest.inputs)
        self.documents = documents
        self._units: list[WorkUnit] | None = None
        self._now: dict[str, InputFile] = {}

    @functools.cached_property
    def read(self) -> ReadOptions:
        """How the build read the records: asked only when they are read (a chat's template is loaded)."""
        return read_options(self.cache)

    def records(self, unit: int, wanted: list[int]) -> dict[int, _Where]:
        """``(path, line, row)`` of the records that made the documents ``wanted`` of ``unit``."""
        if self.python and self.documents is None:
            return self._python_without_documents(unit, wanted)
        work = self._plan()[unit]
        self._check_unchanged(work)
        left, found, docs = set(wanted), {}, 0
        with closing(_records(work, self.read)) as replay:  # closes the input files now, not when collected
            for where, item in replay:
                if not makes_document(item):
                    continue
                if docs in left:
                    found[docs] = where
                    left.discard(docs)
                    if not left:
                        return found
                docs += 1
        raise InputError(
            f"{work.describe()}: holds {docs} documents now, but the cache's unit {unit} holds more (its "
            f"document {max(left)} is asked for); the input changed since the build: rebuild the cache to "
            "trace its documents"
        )

    def _plan(self) -> list[WorkUnit]:
        if self._units is not None:
            return self._units
        manifest = self.cache.manifest
        if self.python:
            items = self.documents.items if isinstance(self.documents, Documents) else self.documents
            units = plan_python_units(items)
        else:
            units = plan_units(self._files(), self.read)
        planned = [unit.describe() for unit in units]
        if planned != manifest.units:
            at = next((i for i, (a, b) in enumerate(zip(planned, manifest.units)) if a != b), len(planned))
            differ = f"unit {at}: {_at(planned, at)} now, {_at(manifest.units, at)} in the manifest"
            fix = "; pass the documents the cache was built from" if self.python else ""
            what = "the documents given" if self.python else "its inputs"
            raise InputError(
                f"{self.cache.root}: {what} make other work units than the build did ({differ}){fix}"
            )
        self._units = units
        return units

    def _files(self) -> list[InputFile]:
        """The input files as the build saw them (its sizes plan the units), found where they were."""
        recorded = self.cache.manifest.inputs
        paths = [i.path for i in recorded]
        try:
            now = discover_inputs(paths).files
        except InputError as e:
            raise InputError(
                f"{self.cache.root}: its input files are needed to find the documents' lines: {e}"
            ) from None
        found = [file.path for file in now]
        if found != paths:  # two of them are one file now, say
            first = next(i for i, (a, b) in enumerate(itertools.zip_longest(found, paths)) if a != b)
            raise InputError(
                f"{self.cache.root}: its input {first} is {_at(paths, first)}, but that path now reads as "
                f"{_at(found, first)}; put the inputs back as they were at build time"
            )
        self._now = {file.path: file for file in now}
        return [
            dataclasses.replace(file, size=file.size if i.size is None else i.size, mtime_ns=i.mtime_ns)
            for file, i in zip(now, recorded)
        ]

    def _check_unchanged(self, unit: WorkUnit) -> None:
        for file in unit.files:
            now = self._now.get(file.path)
            if now is not None and (now.size, now.mtime_ns) != (file.size, file.mtime_ns):
                raise InputError(
                    f"{file.path}: changed since the cache was built (size {file.size} -> {now.size}, "
                    f"mtime_ns {file.mtime_ns} -> {now.mtime_ns}), so its lines may not be the cache's "
                    "documents any more; restore the file, or rebuild the cache"
                )

    def _python_without_documents(self, unit: int, wanted: list[int]) -> dict[int, _Where]:
        """Rows of Python documents not given: exact where each of the unit's records made a document."""
        described = self.cache.manifest.units[unit]
        path = described.split(" [", 1)[0]
        match = _PYTHON_ROWS.search(described)
        first = int(match.group(1)) if match else 0
        progress = read_entry(Path(self.cache.root), f"{unit:06d}", described)
        gapless = progress.records == progress.docs
        return {local: (path, None, first + local if gapless else None) for local in wanted}

    def named(self, wanted: _Wanted) -> dict[str, int]:
        """The documents that named records of a native cache made, each unit's input replayed once."""
        if self.python:
            raise OptionsError(
                f"Exclusions(records=...) names {sorted(wanted)[0]!r}, but the cache {self.cache.root} was "
                "built from Python objects, which have no file to read again: name its documents by index "
                "(documents=) or by token hash (hashes=)"
            )
        units = self._plan()
        by_unit: dict[int, dict[_Where, str]] = {}
        for name, (path, line, row) in wanted.items():
            unit = self._unit_of(units, name, path, line, row)
            spelt = next(f.path for f in unit.files if _same(path, f.path))  # as the unit's records name it
            by_unit.setdefault(unit.index, {})[(spelt, line, row)] = name
        found: dict[str, int] = {}
        for index, names in by_unit.items():
            found |= self._replay(units[index], names)
        return found

    def _unit_of(
        self, units: list[WorkUnit], name: str, path: str, line: int | None, row: int | None
    ) -> WorkUnit:
        """The unit that reads the record: the last of the file's units whose records start before it."""
        mine = [u for u in units if any(_same(path, f.path) for f in u.files)]
        if not mine:
            recorded = self.cache.manifest.inputs
            inputs = ", ".join(i.path for i in recorded[:3]) + (", ..." if len(recorded) > 3 else "")
            raise OptionsError(
                f"Exclusions(records=...) names {name!r}, but {path} is not an input of the cache "
                f"{self.cache.root} (its inputs: {inputs})"
            )
        kind = mine[0].files[0].format if len(mine[0].files) == 1 else "jsonl"
        if (kind == "parquet") != (row is not None):
            form = "'path[row]'" if kind == "parquet" else "'path:line'"
            raise OptionsError(f"Exclusions(records=...) names {name!r}: a record of {path} is named {form}")
        record = row if row is not None else int(line or 1) - 1
        chosen = mine[0]
        for unit in mine[1:]:
            if unit.rest or records_before(unit) > record:
                break
            chosen = unit
        self._check_unchanged(chosen)
        return chosen

    def _replay(self, unit: WorkUnit, names: dict[_Where, str]) -> dict[str, int]:
        left, found, docs = dict(names), {}, 0
        cache = self.cache
        shard = next(
            (s for s in range(cache.num_shards) if int(cache.shard_info(s).name) == unit.index), None
        )
        with closing(_records(unit, self.read)) as replay:
            for where, item in replay:
                name = left.pop(where, None)
                if name is not None:
                    if not makes_document(item):
                        raise OptionsError(
                            f"Exclusions(records=...) names {name!r}, a record that made no document (blank, "
                            "empty, or skipped as bad at build time): there is nothing to exclude"
                        )
                    assert shard is not None  # a unit that made a document has a shard
                    found[name] = int(cache.doc_starts[shard]) + docs
                if makes_document(item):
                    docs += 1
                if not left:
                    return found
        name = next(iter(left.values()))
        raise OptionsError(
            f"Exclusions(records=...) names {name!r}, past the records of its file ({unit.describe()} ends "
            f"before it): name a record that streampack which reports"
        )


def _at(units: list[str], index: int) -> str:
    return repr(units[index]) if index < len(units) else "none"


def _records(unit: WorkUnit, read: ReadOptions) -> Generator[tuple[_Where, Item], None, None]:
    """Every record of ``unit`` as the build reads it, with its ``(path, line, row)``."""
    file = unit.file
    if file is not None and unit.rest:  # a run of whole files, one after the other
        for one in unit.files:
            yield from _records(WorkUnit(unit.index, one), read)
    elif file is not None and file.format == "text" and not read.split_lines:  # the file is one record
        for item in read_unit(unit, read):
            yield (file.path, None, None), item
    else:  # rows of Python objects or of a Parquet file, or one record per line
        path = f"python:{type(unit.items).__name__}" if file is None else file.path
        rows = file is None or file.format == "parquet"
        for i, item in enumerate(read_unit(unit, read), start=records_before(unit)):
            yield ((path, None, i) if rows else (path, i + 1, None)), item


# --------------------------------------------------------------------------------------- named records

_Wanted = dict[str, _Where]  # name -> (path, line, row)


def documents_named(cache: Cache, names: Sequence[str]) -> dict[str, int]:
    """The document of ``cache`` that each record name (``path:line`` or ``path[row]``, as ``which`` reports
    them) made. Each unit that holds a name is read once.

    Raises:
        OptionsError: a name of neither form, a path that is not one of the cache's inputs, a line or row
            past its file, or a record that made no document (blank, empty, or skipped as bad); each named.
        InputError: an input file is missing or changed since the build.
    """
    wanted: _Wanted = {}
    for name in names:
        parsed = parse_record(name)
        if parsed is None:
            raise OptionsError(
                f"Exclusions(records=...) holds {name!r}: a record is named 'path:line' (lines from 1) or "
                "'path[row]' (rows from 0), as streampack which reports it"
            )
        wanted[name] = parsed
    if not wanted:
        return {}
    if any(cache.files.origin(shard) is not None for shard in range(cache.num_shards)):
        return _named_in_token_files(cache, wanted)
    return _Inputs(cache, None).named(wanted)


def _named_in_token_files(cache: Cache, wanted: _Wanted) -> dict[str, int]:
    """Names ``path[row]`` of a cache of another format's files: the row-th document of that file."""
    found: dict[str, int] = {}
    paths = set()
    for shard in range(cache.num_shards):
        origin = cache.files.origin(shard)
        if origin is None:
            continue
        paths.add(origin[0])
        count = len(cache.shard_offsets(shard))
        for name, (path, _, row) in wanted.items():
            if row is not None and _same(path, origin[0]) and origin[1] <= row < origin[1] + count:
                found[name] = int(cache.doc_starts[shard]) + row - origin[1]
    for name, (path, _, _) in wanted.items():
        if name not in found:
            where = "its files" if not any(_same(path, p) for p in paths) else "that file's documents"
            raise OptionsError(
                f"Exclusions(records=...) names {name!r}, which is not in {where} of the cache {cache.root} "
                f"(a document of another format's files is named 'file[row]', as streampack which reports it)"
            )
    return found


def _same(a: str, b: str) -> bool:
    """Whether two paths name one input (as given, or once resolved)."""
    return a == b or (not a.startswith("python:") and Path(a).resolve() == Path(b).resolve())

"""The plan of a build: its work units, the manifest's record of its inputs, and what discovery skipped."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from typing import Any

from streampack.builder.options import CacheSpec
from streampack.format.sections import IgnoredEntry, IgnoredInputs, InputRecord, InputRecords
from streampack.inputs.discovery import discover_inputs
from streampack.inputs.inputfile import Ignored
from streampack.inputs.records import Documents, ReadOptions, WorkUnit, refuse_text_for_sft
from streampack.inputs.units import plan_python_units, plan_units


@dataclass(frozen=True)
class _Plan:
    units: list[WorkUnit]
    inputs: InputRecords  # the manifest's record of each input read, as its JSON
    ignored: IgnoredInputs  # what discovery skipped: counts by reason, and the first few entries


def plan_inputs(inputs: Any, read: ReadOptions, spec: CacheSpec) -> _Plan:
    """The units of ``inputs`` (paths or Python documents), the record of each input, and what was skipped."""
    documents = as_documents(inputs)
    if documents is not None:
        items = documents.items if isinstance(documents, Documents) else documents
        path = f"python:{type(items).__name__}"
        stat = InputRecord(path, _len_or_none(items), None, _python_fingerprint(documents))
        return _Plan(plan_python_units(items), InputRecords([stat.to_json()]), IgnoredInputs())
    paths = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    found = discover_inputs(paths)
    if spec.sft:
        refuse_text_for_sft(found.files, "fields=[...]" if spec.fields is not None else "chat=...")
    # As JSON, made once: the manifest is written twice and its identity taken from it (10^4 .txt inputs)
    inputs = InputRecords([f.stat_json() for f in found.files])
    return _Plan(plan_units(found.files, read), inputs, _ignored(found.ignored))


def _ignored(entries: list[Ignored]) -> IgnoredInputs:
    if not entries:
        return IgnoredInputs()
    reasons = Counter(e.reason.split(" of ")[0] for e in entries)  # "duplicate of X" counts as "duplicate"
    first = tuple(IgnoredEntry(e.path, e.reason) for e in entries[:_IGNORED_LISTED])
    return IgnoredInputs(len(entries), dict(sorted(reasons.items())), first)


_IGNORED_LISTED = 20


def _python_fingerprint(documents: Any) -> str | None:
    """What identifies Python documents across runs: the user's fingerprint, or a Hugging Face dataset's
    (its private ``_fingerprint``, which changes with its data and transforms)."""
    if isinstance(documents, Documents):
        if documents.fingerprint is not None:
            return documents.fingerprint
        documents = documents.items
    fingerprint = getattr(documents, "_fingerprint", None)
    return fingerprint if isinstance(fingerprint, str) else None


def as_documents(inputs: Any) -> Any:
    """``inputs`` when they are Python documents, ``None`` when they are paths (a path, or a list of them)."""
    if isinstance(inputs, Documents):
        return inputs
    if isinstance(inputs, (str, os.PathLike)):
        return None
    if isinstance(inputs, (list, tuple)) and all(isinstance(i, (str, os.PathLike)) for i in inputs):
        return None
    return inputs


def _len_or_none(items: Any) -> int | None:
    try:
        return len(items)
    except TypeError:
        return None

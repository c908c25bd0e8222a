"""The exclusions of a run as an audit re-applies them (:mod:`streampack.runs.audit`), leg by leg.

A state records only a digest of each exclusion in force (the lists may hold 10^6 documents): the audit
is given the lists (``exclude=``, a mixture config's ``exclude:``, ``streampack audit --exclude FILE``),
checks each against its digest, and builds each leg's loader with those in force there. An exclusion
added at a resume whose data state was older than the model may have let the model train on what it
names: a finding of its own, ``"excluded"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from streampack.errors import LoaderStateError
from streampack.loader import Loader
from streampack.loader.excluding import excluded_documents, excluded_samples, in_keys, sample_keys
from streampack.loader.exclusions import Exclusions
from streampack.runs.coverage import CHUNK, Finding, Leg, listed

__all__ = ["excluded_served", "in_force", "placed"]

Record = Mapping[str, Any]  # what a state records of an exclusion (exclusions.entry_state)


def in_force(entries: Sequence[Mapping[str, Any]], final: Sequence[Record]) -> list[list[Record]]:
    """Per history entry, the exclusions in force in its leg: those it records, and those put in force
    during the leg, which the next entry (the last leg: the state's ``final``) records."""
    legs = []
    for i, entry in enumerate(entries):
        later: Sequence[Record] = final if i + 1 == len(entries) else entries[i + 1].get("exclusions") or []
        own = list(entry.get("exclusions") or [])
        if i + 1 == len(entries):
            count = len(later)
        else:
            stop = int(entries[i + 1]["position"])
            count = max(len(own), sum(1 for record in later if int(record["at"]) < stop))
        legs.append(list(later[:count]) if len(later) >= len(own) else own)
    return legs


def placed(records: Sequence[Record], given: Sequence[Exclusions], leg: int) -> list[Exclusions]:
    """The exclusions given, each at the position its record says it took effect at.

    Raises:
        LoaderStateError: fewer exclusions were given than the run had in force, or one differs from the
            run's (its digest): the message names which and what to give.
    """
    if len(records) > len(given):
        raise LoaderStateError(
            f"history entry {leg} has {len(records)} exclusions in force, and {len(given)} were given: the "
            "audit re-applies them, so give the run's exclusion lists in order (exclude=[...], a mixture "
            "config's exclude:, or streampack audit --exclude FILE)"
        )
    out = []
    for index, (record, entry) in enumerate(zip(records, given)):
        if entry.digest != record["digest"]:
            raise LoaderStateError(
                f"exclusion {index} given (digest {entry.digest}, mode {entry.mode!r}) is not the one the "
                f"run had in force from position {record['at']} (digest {record['digest']}, mode "
                f"{record['mode']!r}): give the run's exclusion lists unchanged, in order"
            )
        out.append(dataclasses.replace(entry, at=int(record["at"])))
    return out


def excluded_served(
    legs: list[Leg], loaders: list[Loader], recorded: list[list[Record]], given: Sequence[Exclusions]
) -> list[Finding]:
    """A finding per leg that trained samples an exclusion names after it took effect, while it was not in
    force in that leg."""
    found = []
    names = list(loaders[-1].order.names)
    datasets = [source.data for source in loaders[-1].sources]
    final = recorded[-1]
    for m, record in enumerate(final):
        entry, at = given[m], int(record["at"])
        docs = excluded_documents(entry, names, datasets)
        keys = sample_keys({s: excluded_samples(datasets[s], ids) for s, ids in docs.items()})
        if not len(keys):
            continue
        for leg, loader, mine in zip(legs, loaders, recorded, strict=True):
            start, stop = max(leg.positions[0], at), leg.positions[1]
            if len(mine) > m or start >= stop:
                continue
            counts, hits = _served_of(loader, start, stop, keys)
            if counts:
                found.append(_finding(leg, m, record, counts, hits))
    return found


def _served_of(
    loader: Loader, start: int, stop: int, keys: np.ndarray
) -> tuple[dict[str, int], tuple[int, int]]:
    """Samples of ``keys`` served at ``[start, stop)``, per source name, and the positions they span."""
    counts: dict[str, int] = {}
    first, last = stop, start
    for lo in range(start, stop, CHUNK):
        sources, samples = loader.served(lo, min(stop, lo + CHUNK))
        hit = np.flatnonzero(in_keys(keys, sources, samples))
        for source, count in zip(*np.unique(sources[hit], return_counts=True), strict=True):
            name = loader.order.names[int(source)]
            counts[name] = counts.get(name, 0) + int(count)
        if len(hit):
            first, last = min(first, lo + int(hit[0])), max(last, lo + int(hit[-1]) + 1)
    return counts, (first, last)


def _finding(leg: Leg, m: int, record: Record, counts: dict[str, int], hits: tuple[int, int]) -> Finding:
    lo, hi = hits
    steps = leg.steps_of(lo, hi)
    return Finding(
        kind="excluded",
        resume=leg.index,
        positions=hits,
        steps=steps,
        samples=counts,
        message=f"positions {lo:,}-{hi:,} (steps {steps[0]:,}-{steps[1]:,}) trained {listed(counts)} that "
        f"exclusion {m} (mode {record['mode']!r}) takes out from position {int(record['at']):,}: it was put "
        "in force at a later resume, from a data state older than the model checkpoint",
    )

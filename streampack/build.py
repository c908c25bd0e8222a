"""Building a token cache: plan the work units, run them on an engine, and finalize the manifest.

The coordinator (:func:`build`) checks the output directory (lock, settings of an existing cache, inputs
unchanged), writes an incomplete manifest, runs every unfinished unit, and writes the complete manifest
last. The units run through :func:`streampack.pipeline.run_units`, which streams their records through the
tokenizer and appends them to their shards. See docs/FORMAT.md for the commit protocol.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from streampack import ledger
from streampack.engines import run_local, run_ray
from streampack.errors import CacheError, ConfigMismatchError, StreampackError
from streampack.format import (
    LEDGER_DIR,
    LOCK,
    MANIFEST,
    SHARD_DIR,
    Manifest,
    ShardInfo,
    dtype_name,
    load_manifest,
    shard_name,
    token_dtype,
)
from streampack.ledger import UnitProgress
from streampack.lock import BuildLock
from streampack.pipeline import UnitResult, UnitTask, process_tokenizer, run_units, set_process_threads
from streampack.progress import BuildProgress
from streampack.sources import (
    Documents,
    ReadOptions,
    WorkUnit,
    check_output_outside_inputs,
    expand_inputs,
    plan_python_units,
    plan_units,
)
from streampack.tokenize import Tokenizer, piece_rule, resolve_eos

OnBadRecord = Literal["error", "skip"]
Engine = Literal["local", "ray"]


@dataclass(frozen=True)
class BuildOptions:
    """Settings of a build. Those in :meth:`cache_settings` are fixed for the life of a cache.

    Attributes:
        tokenizer: tokenizer SPEC: ``bytes``, a ``tokenizer.json`` path or folder, or ``tiktoken:PATH``.
        text_field: JSON key or Parquet column holding the text.
        split_lines: one document per line of ``.txt`` inputs (default: one per file).
        eos: append an EOS id after every document.
        eos_id: the EOS id to append (default: the tokenizer's own EOS token).
        on_bad_record: ``error`` stops at the first bad record; ``skip`` skips and counts them.
        workers: worker processes (default: see :func:`default_workers`).
        threads: tokenizer threads per worker (default: the number of cores).
        overwrite: delete an existing cache in the output directory and start over.
        unit_bytes: size of the work units large uncompressed JSONL and Parquet files are split into.
        batch_chars: characters of text tokenized per batch call.
        max_piece_chars: longer documents are tokenized in pieces of at most this many characters
            (default: :func:`~streampack.tokenize.default_max_piece_chars` of the tokenizer).
        commit_bytes: commit after this many bytes of tokens...
        commit_seconds: ...or after this many seconds, whichever comes first.
        progress: show a progress bar on stderr.
        engine: ``local`` (a process pool on this machine) or ``ray`` (Ray tasks on a cluster).
        ray_address: the Ray cluster to connect to (default: a running one, else a new local instance).
    """

    tokenizer: str = "bytes"
    text_field: str = "text"
    split_lines: bool = False
    eos: bool = True
    eos_id: int | None = None
    on_bad_record: OnBadRecord = "error"
    workers: int | None = None
    threads: int | None = None
    overwrite: bool = False
    unit_bytes: int = ReadOptions.unit_bytes
    batch_chars: int = 1 << 20
    max_piece_chars: int | None = None
    commit_bytes: int = 64 << 20
    commit_seconds: float = 10.0
    progress: bool = False
    engine: Engine = "local"
    ray_address: str | None = None

    def __post_init__(self) -> None:
        if self.engine not in ("local", "ray"):
            raise ValueError(f"engine must be 'local' or 'ray' (got {self.engine!r})")
        if self.on_bad_record not in ("error", "skip"):
            raise ValueError(f"on_bad_record must be 'error' or 'skip' (got {self.on_bad_record!r})")
        for name in ("workers", "threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 (got {getattr(self, name)})")
        if self.commit_seconds < 0:
            raise ValueError(f"commit_seconds must be >= 0 (got {self.commit_seconds})")
        if not self.eos and self.eos_id is not None:
            raise ValueError(f"eos_id={self.eos_id} contradicts eos=False (--no-eos): give one or the other")
        for name in ("batch_chars", "max_piece_chars", "commit_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive (got {getattr(self, name)})")

    @property
    def read_options(self) -> ReadOptions:
        """The options of the sources."""
        return ReadOptions(self.text_field, self.split_lines, self.unit_bytes)

    def cache_settings(self) -> dict[str, Any]:
        """Settings that change the cache's bytes, recorded in the manifest and checked on resume."""
        return {
            "text_field": self.text_field,
            "split_lines": self.split_lines,
            "unit_bytes": self.unit_bytes,
            "max_piece_chars": self.max_piece_chars,
        }


@dataclass
class BuildSummary:
    """What a build did, for the CLI's last lines and for callers."""

    out: Path
    num_docs: int = 0
    num_tokens: int = 0
    num_shards: int = 0
    skipped_records: int = 0
    units_resumed: int = 0
    units_already_done: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        """Tokens of the cache divided by the wall time of this run."""
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0


def build(inputs: Any, out: str | os.PathLike[str], **options: Any) -> BuildSummary:
    """Build (or resume building) a token cache from ``inputs`` into the directory ``out``.

    Args:
        inputs: a path, directory, glob or URL, or a list of them; or documents: a Hugging Face
            ``Dataset``/``IterableDataset``, a generator, or :class:`~streampack.Documents` wrapping any
            iterable of ``str`` or dicts.
        out: the cache directory (created if needed).
        **options: fields of :class:`BuildOptions`.

    Returns:
        A :class:`BuildSummary`.

    Raises:
        StreampackError: bad inputs or records, a tokenizer that cannot load, a cache built with other
            settings, another build running in ``out``, or a full disk.
    """
    opts = BuildOptions(**options)
    root = Path(out)
    started = time.perf_counter()
    if _as_documents(inputs) is None:  # paths: refuse an --out that would mix with them before listing them
        check_output_outside_inputs(root, [inputs] if isinstance(inputs, (str, os.PathLike)) else inputs)
    units, input_stats = _plan(inputs, opts.read_options)
    set_process_threads(opts.threads or 0)
    tokenizer = process_tokenizer(opts.tokenizer)  # kept for the units that run in this process
    pieces = piece_rule(tokenizer, opts.max_piece_chars)
    opts = replace(opts, max_piece_chars=pieces.max_chars)
    eos = resolve_eos(tokenizer, eos=opts.eos, eos_id=opts.eos_id)
    vocab_size = max(tokenizer.vocab_size, (eos.id or 0) + 1)
    manifest = Manifest(
        tokenizer={**tokenizer.fingerprint(), "vocab_size": vocab_size, "spec": opts.tokenizer},
        dtype=dtype_name(token_dtype(vocab_size)),
        eos=eos.to_json(),
        settings=opts.cache_settings(),
        inputs=input_stats,
        units=[u.describe() for u in units],
    )
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StreampackError(f"cannot create {root}: {e.strerror}; choose a writable --out") from None
    with BuildLock(root):
        _prepare_directory(root, opts.overwrite)
        tasks = [UnitTask(str(root), u, opts, eos, manifest.dtype, pieces) for u in units]
        summary = _build_locked(root, manifest, tasks, opts)
    summary.seconds = time.perf_counter() - started
    return summary


def _plan(inputs: Any, read: ReadOptions) -> tuple[list[WorkUnit], list[dict[str, Any]]]:
    documents = _as_documents(inputs)
    if documents is not None:
        stat = {
            "path": f"python:{type(documents).__name__}",
            "size": _len_or_none(documents),
            "mtime_ns": None,
        }
        fingerprint = getattr(documents, "_fingerprint", None)
        if isinstance(fingerprint, str):
            stat["fingerprint"] = fingerprint
        return plan_python_units(documents), [stat]
    paths = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    files = expand_inputs(paths)
    return plan_units(files, read), [f.stat_json() for f in files]


def _as_documents(inputs: Any) -> Any:
    if isinstance(inputs, Documents):
        return inputs.items
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


def _prepare_directory(root: Path, overwrite: bool) -> None:
    """Create the cache's folders; with ``overwrite``, first delete the cache that is there."""
    try:
        if overwrite:
            _delete_cache(root)
        elif not (root / MANIFEST).exists() and any((root / LEDGER_DIR).glob("*.json")):
            raise CacheError(
                f"{root}/{LEDGER_DIR} holds build progress but there is no manifest (an --overwrite was "
                "interrupted?); rerun with --overwrite"
            )
        (root / LEDGER_DIR).mkdir(exist_ok=True)
        (root / SHARD_DIR).mkdir(exist_ok=True)
    except PermissionError as e:
        raise StreampackError(f"cannot write to {root}: {e.strerror}; choose a writable --out") from None


_CACHE_ENTRIES = {MANIFEST, f"{MANIFEST}.tmp", LEDGER_DIR, SHARD_DIR, LOCK}


def _delete_cache(root: Path) -> None:
    """Delete a cache, refusing a directory that holds anything else; the manifest goes last."""
    strangers = sorted(p.name for p in root.iterdir() if p.name not in _CACHE_ENTRIES)
    if strangers:
        raise StreampackError(
            f"refusing to --overwrite {root}: it holds files that are not part of a streampack cache "
            f"({', '.join(strangers[:3])}); choose an empty or new --out"
        )
    if (root / MANIFEST).exists():
        load_manifest(root)  # raises unless it is a streampack manifest
    for sub in (LEDGER_DIR, SHARD_DIR):
        if (root / sub).exists():
            shutil.rmtree(root / sub)
    (root / MANIFEST).unlink(missing_ok=True)


def _build_locked(root: Path, manifest: Manifest, tasks: list[UnitTask], opts: BuildOptions) -> BuildSummary:
    summary = BuildSummary(out=root)
    if (root / MANIFEST).exists():
        existing = load_manifest(root)
        _check_same_build(root, existing, manifest)
        if existing.complete:
            return _summarize(summary, existing)
    manifest.write(root)
    units = [t.unit for t in tasks]
    progress = [ledger.read_progress(root, shard_name(u.index), u.describe()) for u in units]
    summary.units_already_done = sum(p.done for p in progress)
    summary.units_resumed = sum(not p.done and p.records > 0 for p in progress)
    todo = [t for t, p in zip(tasks, progress) if not p.done]
    with BuildProgress(opts.progress, units, progress) as bar:
        for result in _run(todo, opts, bar.update):
            progress[result.unit_index] = result.progress
            bar.unit_done(result)
    final = replace(
        manifest,
        complete=True,
        shards=_shard_table(units, progress),
        skipped_records=sum(p.skipped for p in progress),
    )
    final.write(root)
    return _summarize(summary, final)


def _summarize(summary: BuildSummary, manifest: Manifest) -> BuildSummary:
    summary.num_docs, summary.num_tokens = manifest.num_docs, manifest.num_tokens
    summary.num_shards, summary.skipped_records = len(manifest.shards), manifest.skipped_records
    return summary


def _shard_table(units: list[WorkUnit], progress: list[UnitProgress]) -> list[ShardInfo]:
    return [
        ShardInfo(shard_name(u.index), u.describe(), p.docs, p.tokens, p.tokens_checksum, p.offsets_checksum)
        for u, p in zip(units, progress)
    ]


def _check_same_build(root: Path, existing: Manifest, new: Manifest) -> None:
    old_config, new_config = existing.build_config(), new.build_config()
    for config in (old_config, new_config):  # the same tokenizer may be named by another path
        config["tokenizer"] = {k: v for k, v in config["tokenizer"].items() if k != "spec"}
    differences = [
        f"{key}: the cache has {old_config[key]}, this build has {new_config[key]}"
        for key in old_config
        if old_config[key] != new_config[key]
    ]
    if differences:
        raise ConfigMismatchError(
            f"{root} holds a cache built with other settings ({'; '.join(differences)}); use another --out, "
            "or --overwrite to start over"
        )
    changed = _changed_inputs(existing.inputs, new.inputs)
    if changed:
        raise ConfigMismatchError(
            f"{root}: the inputs changed since the ledger was written ({changed}); rerun with --overwrite "
            "to rebuild from the current inputs"
        )


def _changed_inputs(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> str:
    old_paths, new_paths = [i["path"] for i in old], [i["path"] for i in new]
    if old_paths != new_paths:
        return (
            f"the cache was built from {len(old_paths)} inputs starting {old_paths[:2]}, not {new_paths[:2]}"
        )
    for before, now in zip(old, new):
        changed = [
            f"{key} {before.get(key)} -> {now.get(key)}"
            for key in sorted(before | now)
            if before.get(key) != now.get(key)
        ]
        if changed:
            return f"{now['path']}: {', '.join(changed)}"
    return ""


# ---------------------------------------------------------------------------------------------- running


def _run(
    todo: list[UnitTask], opts: BuildOptions, report: Callable[[dict[str, int]], None]
) -> Iterable[UnitResult]:
    cores = os.cpu_count() or 1
    in_process = [t for t in todo if t.unit.in_process]
    pooled = [t for t in todo if not t.unit.in_process]
    wanted = opts.workers or default_workers(process_tokenizer(opts.tokenizer), cores)
    workers = min(wanted, max(len(pooled), 1))
    # By default every worker's batch calls may use every core: while all workers are busy they share the
    # cores, and when the last units run alone (the tail of a build) they still use the whole machine.
    threads = opts.threads or 0
    setup: dict[str, Any] = {
        "on_progress": report,
        "initializer": set_process_threads,
        "initargs": (threads,),
    }
    yield from run_local(run_units, in_process, workers=1, **setup)
    if opts.engine == "ray":
        yield from run_ray(run_units, pooled, address=opts.ray_address, **setup)
    else:
        yield from run_local(run_units, pooled, workers=workers, **setup)


def default_workers(tokenizer: Tokenizer, cores: int) -> int:
    """Worker processes when ``--workers`` is not given: chosen by measurement, per backend.

    Measured on 2 cores with the GPT-2 vocabulary on real English text. Hugging Face ``tokenizers`` runs
    best as one process using every core (100 MB: 0.94x its raw ``encode_batch_fast`` speed, against
    0.78x for two processes whose thread pools fight over the cores), so it gets one process per 8
    cores. tiktoken is fast enough that reading and framing the documents matter, and runs best as one
    process per core (345 MB: 25-27 s against 36 s for one process). ``bytes`` holds the GIL: one per core.
    """
    return max(1, cores // 8) if tokenizer.saturates_cores else cores

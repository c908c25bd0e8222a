"""Building a token cache: plan the work units, run them on an engine, and finalize the manifest.

The coordinator (:func:`build`) checks the output directory (lock, settings of an existing cache, inputs
unchanged), writes an incomplete manifest, runs every unfinished unit, and writes the complete manifest
last. The units run through :func:`streampack.builder.pipeline.run_units`, which streams their records
through the
tokenizer and appends them to their shards. See docs/FORMAT.md for the commit protocol.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from streampack.builder.executors import run_local, run_ray
from streampack.builder.options import CacheSpec, RunOptions, VerifyTokens, split_options
from streampack.builder.pipeline import (
    VERIFY_FIRST,
    VERIFY_RATE,
    TokenizerRef,
    UnitResult,
    UnitSpec,
    UnitTask,
    init_worker,
    run_units,
)
from streampack.builder.progress import BuildProgress
from streampack.builder.publish import Publisher, default_stage
from streampack.builder.stagetimes import add_up, mark_process_start
from streampack.errors import CacheError, ConfigMismatchError, OptionsError, StreampackError
from streampack.format.identity import build_identity
from streampack.format.ledger import UnitProgress
from streampack.format.manifest import Manifest, ShardInfo, ShardTable
from streampack.format.names import (
    LAYOUT_DIR,
    LEDGER_DIR,
    LOCK,
    MANIFEST,
    SHARD_DIR,
    dtype_name,
    shard_name,
    token_dtype,
)
from streampack.format.sections import (
    BuildSettings,
    Cuts,
    EngineRecord,
    IgnoredEntry,
    IgnoredInputs,
    InputRecord,
    TokenizerInfo,
    Verification,
)
from streampack.inputs.discovery import Ignored, check_output_outside_inputs, discover_inputs
from streampack.inputs.records import Documents, ReadOptions, WorkUnit, refuse_text_for_sft
from streampack.inputs.sft import load_chat_template
from streampack.inputs.units import plan_python_units, plan_units
from streampack.store import LocalStore
from streampack.store.files import load_manifest, read_progress, write_manifest
from streampack.store.remote import RemoteStore, is_remote
from streampack.tokenizer.base import Tokenizer, describe_engine
from streampack.tokenizer.choices import ENGINE_CHOICES
from streampack.tokenizer.load import load_tokenizer
from streampack.tokenizer.pieces import piece_rule
from streampack.tokenizer.specials import BosPolicy, EosPolicy, resolve_bos, resolve_eos


@dataclass
class BuildSummary:
    """What a build did, for the CLI's last lines and for callers."""

    out: Path | str  # a URL for a build to object storage
    num_docs: int = 0
    num_tokens: int = 0
    num_shards: int = 0
    skipped_records: int = 0
    empty_docs: int = 0
    inexact_cuts: int = 0
    units_resumed: int = 0
    units_already_done: int = 0
    seconds: float = 0.0
    workers: int = 1  # processes that ran units (Ray: tasks at once is the cluster's business; 1 shown)
    # Which engine computed the ids in this run, and why: "fastokens 0.3.5 (proven exact for this tokenizer
    # in text mode)", "tokenizers 0.23.3 (fastokens refused: ...)". A cache found complete says "".
    tokenizer_engine: str = ""
    stages: dict[str, list[float]] = field(
        default_factory=dict
    )  # [wall, CPU] s per stage: streampack.builder.stagetimes

    @property
    def tokens_per_second(self) -> float:
        """Tokens of the cache divided by the wall time of this run."""
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0


def build(
    inputs: Any,
    out: str | os.PathLike[str],
    *,
    spec: CacheSpec | None = None,
    run: RunOptions | None = None,
    **options: Any,
) -> BuildSummary:
    """Build (or resume building) a token cache from ``inputs`` into the directory ``out``.

    Args:
        inputs: a path, directory, glob or URL, or a list of them; or documents: a Hugging Face
            ``Dataset``/``IterableDataset``, a generator, or :class:`~streampack.Documents` wrapping any
            iterable of ``str`` or dicts.
        out: the cache directory (created if needed), or an fsspec URL (``s3://bucket/prefix``): the
            build is then staged in ``run.stage`` and published there (see :mod:`streampack.builder.publish`).
        spec: the settings that identify the cache (:class:`~streampack.CacheSpec`).
        run: how the build runs (:class:`~streampack.RunOptions`).
        **options: fields of either, by name (``tokenizer="gpt2/tokenizer.json", workers=4``), replacing
            those of ``spec`` and ``run``.

    Returns:
        A :class:`BuildSummary`.

    Raises:
        StreampackError: bad inputs or records, a tokenizer that cannot load, a cache built with other
            settings or from other inputs, another build running in ``out``, or a full disk.
    """
    spec, run = split_options(spec, run, options)
    remote = RemoteStore(out, run.storage_options) if isinstance(out, str) and is_remote(out) else None
    root = Path(out) if remote is None else Path(run.stage or default_stage(remote.url))
    mark_process_start()
    started = time.perf_counter(), time.process_time()
    if _as_documents(inputs) is None:  # paths: refuse an output that would mix with them before listing them
        check_output_outside_inputs(root, [inputs] if isinstance(inputs, (str, os.PathLike)) else inputs)
    read = ReadOptions(spec.text_field, spec.split_lines, spec.unit_bytes, fields=spec.fields)
    plan = _plan(inputs, read, spec)
    cores = os.cpu_count() or 1
    threads = run.threads or cores
    tokenizer = load_tokenizer(
        spec.tokenizer, threads=threads, special_tokens=spec.special_tokens, engine=run.tokenizer_engine
    )
    pieces = piece_rule(tokenizer.cut_safety, tokenizer.fast_piece_chars, spec.max_piece_chars)
    spec = replace(spec, max_piece_chars=pieces.max_chars)
    eos = resolve_eos(tokenizer, eos=spec.eos, eos_id=spec.eos_id)
    bos = resolve_bos(tokenizer, bos=spec.bos, bos_id=spec.bos_id)
    vocab_size = _vocab_size(tokenizer, eos, bos, allow_new_ids=run.allow_new_ids)
    fingerprint = tokenizer.fingerprint()
    chat_sha256 = None
    if spec.chat is not None:
        chat = load_chat_template(tokenizer, spec.chat)
        read = replace(read, chat=chat)
        chat_sha256 = chat.sha256  # compared on resume, as the tokenizer's own hash
    described = TokenizerInfo(
        **{**fingerprint, "vocab_size": vocab_size},
        spec=spec.tokenizer,
        cuts=Cuts(tokenizer.cut_safety.exact, tokenizer.cut_safety.reason),
        chat_template_sha256=chat_sha256,
    )
    manifest = Manifest(
        tokenizer=described,
        dtype=dtype_name(token_dtype(vocab_size)),
        eos=eos,
        bos=bos,
        loss_mask=spec.sft,
        settings=BuildSettings(**spec.to_json()),
        inputs=plan.inputs,
        units=[u.describe() for u in plan.units],
        ignored_inputs=plan.ignored,
        engines=[_engine_entry(tokenizer, run)],
    )
    engine = tokenizer.engine.name
    ref = TokenizerRef(
        spec.tokenizer,
        spec.special_tokens,
        fingerprint["sha256"],
        engine=engine if engine in ENGINE_CHOICES else "auto",
    )
    shared = UnitSpec(
        root=str(root),
        tokenizer=ref,
        read=read,
        eos=eos,
        bos=bos,
        vocab_size=vocab_size,
        verify=_verify_mode(tokenizer, run),
        dtype=manifest.dtype,
        pieces=pieces,
        on_bad_record=run.on_bad_record,
        batch_chars=run.batch_chars,
        commit_bytes=run.commit_bytes,
        commit_seconds=run.commit_seconds,
        profile=run.profile,
    )
    store = LocalStore(root)
    try:
        store.makedirs()
    except OSError as e:
        raise StreampackError(
            f"cannot create {root}: {e.strerror}; choose a writable output directory"
        ) from None
    with store.lock(LOCK):
        tasks = [UnitTask(shared, u) for u in plan.units]
        if remote is None:
            _prepare_directory(store, run.overwrite)
            summary = _build_locked(store, manifest, tasks, run, tokenizer, started)
        else:
            summary = _build_remote(remote, store, manifest, tasks, run, tokenizer, started)
    summary.seconds = time.perf_counter() - started[0]
    return summary


def _vocab_size(tokenizer: Tokenizer, eos: EosPolicy, bos: BosPolicy, *, allow_new_ids: bool) -> int:
    """The cache's vocab size: the tokenizer's, grown past an EOS or BOS id beyond it only when allowed.

    Raises:
        OptionsError: an EOS or BOS id is outside the tokenizer's vocabulary and ``allow_new_ids`` is off.
    """
    size = tokenizer.vocab_size
    for kind, token_id in (("eos", eos.id), ("bos", bos.id)):
        if token_id is not None and token_id >= size and not allow_new_ids:
            raise OptionsError(
                f"{kind}_id={token_id} is outside the vocabulary of tokenizer {tokenizer.spec!r}, whose "
                f"{size:,} ids are 0..{size - 1:,}: a model's embedding of {size:,} rows has no row for it. "
                f"Give an id below {size:,}, or pass allow_new_ids=True if the model adds ids of its own "
                f"(the cache's vocab_size then becomes {token_id + 1:,})"
            )
    return max(size, (eos.id or 0) + 1, (bos.id or 0) + 1)


def _verify_mode(tokenizer: Tokenizer, run: RunOptions) -> VerifyTokens:
    """What the units re-encode with the reference engine: nothing when the engine is the reference."""
    return "none" if tokenizer.engine is tokenizer.reference_engine() else run.verify_tokens


def engine_summary(entry: EngineRecord) -> str:
    """One line for a manifest's engine entry: which engine computed the ids, why, and how they were checked
    against the reference engine."""
    name = f"{entry.name} {entry.version}"
    why = f"{entry.why}; " if entry.why else ""
    if name == entry.reference:
        return f"{name} ({why}the tokenizer's reference engine)"
    verify = entry.verify or Verification("")
    checked = {
        "sample": f"first {verify.first or 0:,} records + {verify.rate or 0:.1%} re-encoded",
        "all": "every record re-encoded",
        "none": "not verified",
    }.get(verify.mode, "verification not recorded")
    return f"{name} ({why}reference {entry.reference}; {checked})"


def _engine_entry(tokenizer: Tokenizer, run: RunOptions) -> EngineRecord:
    """The manifest's record of the engine of this run, and how its ids were checked against the reference."""
    mode = _verify_mode(tokenizer, run)
    verify = None
    if tokenizer.engine is not tokenizer.reference_engine():
        verify = Verification(mode, VERIFY_FIRST, VERIFY_RATE) if mode == "sample" else Verification(mode)
    engine = describe_engine(tokenizer)
    return EngineRecord(engine["name"], engine["version"], engine["reference"], engine["why"], verify=verify)


@dataclass(frozen=True)
class _Plan:
    units: list[WorkUnit]
    inputs: list[InputRecord]  # the manifest's record of each input read
    ignored: IgnoredInputs  # what discovery skipped: counts by reason, and the first few entries


def _plan(inputs: Any, read: ReadOptions, spec: CacheSpec) -> _Plan:
    documents = _as_documents(inputs)
    if documents is not None:
        items = documents.items if isinstance(documents, Documents) else documents
        path = f"python:{type(items).__name__}"
        stat = InputRecord(path, _len_or_none(items), None, _python_fingerprint(documents))
        return _Plan(plan_python_units(items), [stat], IgnoredInputs())
    paths = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    found = discover_inputs(paths)
    if spec.sft:
        refuse_text_for_sft(found.files, "fields=[...]" if spec.fields is not None else "chat=...")
    inputs = [InputRecord(f.path, f.size, f.mtime_ns) for f in found.files]
    return _Plan(plan_units(found.files, read), inputs, _ignored(found.ignored))


def _ignored(entries: list[Ignored]) -> IgnoredInputs:
    if not entries:
        return IgnoredInputs()
    reasons = Counter(e.reason.split(" of ")[0] for e in entries)  # "duplicate of X" counts as "duplicate"
    first = tuple(IgnoredEntry(e.path, e.reason) for e in entries[:_IGNORED_LISTED])
    return IgnoredInputs(len(entries), dict(sorted(reasons.items())), first)


_IGNORED_LISTED = 20


def _python_fingerprint(documents: Any) -> str | None:
    """What identifies Python documents across runs: the user's fingerprint, or a Hugging Face dataset's.

    ``datasets`` keeps a dataset's content hash in the private ``_fingerprint`` attribute; it changes
    whenever the dataset's data or transforms do. Other Python objects cannot be identified.
    """
    if isinstance(documents, Documents):
        if documents.fingerprint is not None:
            return documents.fingerprint
        documents = documents.items
    fingerprint = getattr(documents, "_fingerprint", None)
    return fingerprint if isinstance(fingerprint, str) else None


def _as_documents(inputs: Any) -> Any:
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


def _prepare_directory(store: LocalStore, overwrite: bool) -> None:
    """Create the cache's folders; with ``overwrite``, first delete the cache that is there."""
    root = store.root
    try:
        if overwrite:
            _delete_cache(store)
        elif not store.exists(MANIFEST) and any(n.endswith(".json") for n in store.list(LEDGER_DIR)):
            raise CacheError(
                f"{root}/{LEDGER_DIR} holds build progress but there is no manifest (an overwrite was "
                "interrupted?); rerun with overwrite=True"
            )
        store.makedirs(LEDGER_DIR)
        store.makedirs(SHARD_DIR)
    except PermissionError as e:
        raise StreampackError(
            f"cannot write to {root}: {e.strerror}; choose a writable output directory"
        ) from None


_CACHE_ENTRIES = {MANIFEST, f"{MANIFEST}.tmp", LEDGER_DIR, SHARD_DIR, LAYOUT_DIR, LOCK}


def _delete_cache(store: LocalStore) -> None:
    """Delete a cache, refusing a directory that holds anything else; the manifest goes last."""
    strangers = [name for name in store.list("") if name not in _CACHE_ENTRIES]
    if strangers:
        raise StreampackError(
            f"refusing to overwrite {store.root}: it holds files that are not part of a streampack cache "
            f"({', '.join(strangers[:3])}); choose an empty or new output directory"
        )
    if store.exists(MANIFEST):
        load_manifest(store)  # raises unless it is a streampack manifest
    for sub in (LEDGER_DIR, SHARD_DIR, LAYOUT_DIR):
        store.delete(sub)
    store.delete(MANIFEST)


def _build_remote(
    remote: RemoteStore,
    stage: LocalStore,
    manifest: Manifest,
    tasks: list[UnitTask],
    run: RunOptions,
    tokenizer: Tokenizer,
    started: tuple[float, float],
) -> BuildSummary:
    """Build in the staging directory ``stage`` and publish to ``remote`` (see
    :mod:`streampack.builder.publish`)."""
    publisher = Publisher(remote, stage, {shard_name(t.unit.index): t.unit.describe() for t in tasks})
    complete = publisher.begin(manifest, overwrite=run.overwrite, same_build=_check_same_build)
    if complete is not None:
        return _summarize(BuildSummary(out=remote.url), complete)
    summary = _build_locked(stage, manifest, tasks, run, tokenizer, started, publisher)
    summary.out = remote.url
    return summary


def _build_locked(
    store: LocalStore,
    manifest: Manifest,
    tasks: list[UnitTask],
    run: RunOptions,
    tokenizer: Tokenizer,
    started: tuple[float, float],
    publisher: Publisher | None = None,
) -> BuildSummary:
    """Build the units not done yet, then write the final manifest (``started``: build()'s clocks)."""
    summary = BuildSummary(out=store.root)
    if store.exists(MANIFEST):
        existing = load_manifest(store)
        _check_same_build(store.root, existing, manifest)
        if existing.complete:
            if publisher is not None:
                publisher.finish()
            return _summarize(summary, existing)
        manifest = replace(manifest, engines=_engines(existing.engines, manifest.engines))
    write_manifest(store, manifest)
    units = [t.unit for t in tasks]
    progress = [read_progress(store, shard_name(u.index), u.describe()) for u in units]
    summary.units_already_done = sum(p.done for p in progress)
    summary.units_resumed = sum(not p.done and p.records > 0 for p in progress)
    summary.tokenizer_engine = engine_summary(_engine_entry(tokenizer, run))
    todo = [t for t, p in zip(tasks, progress) if not p.done]
    summary.workers = _worker_count(todo, run, tokenizer)
    summary.stages = {"prepare": [time.perf_counter() - started[0], time.process_time() - started[1]]}
    with BuildProgress(run.progress, units, progress) as bar:
        for result in _run(todo, run, tokenizer, summary.workers, bar.update):
            summary.stages = add_up([summary.stages, result.stages])
            progress[result.unit_index] = result.progress
            if publisher is not None and result.progress.done:
                publisher.unit_done(shard_name(result.unit_index))
            bar.unit_done(result)
    final = replace(
        manifest,
        complete=True,
        table=_shard_table(units, progress, manifest.loss_mask),
        skipped_records=sum(p.skipped for p in progress),
        empty_docs=sum(p.empty_docs for p in progress),
        inexact_cuts=sum(p.inexact_cuts for p in progress),
    )
    write_manifest(store, final)
    if publisher is not None:
        publisher.finish()
    return _summarize(summary, final)


def _engines(before: list[EngineRecord], now: list[EngineRecord]) -> list[EngineRecord]:
    """The engines of the earlier runs of a resumed build, then this run's unless it is one of them."""
    return before + [e for e in now if e not in before]


def _summarize(summary: BuildSummary, manifest: Manifest) -> BuildSummary:
    summary.num_docs, summary.num_tokens = manifest.num_docs, manifest.num_tokens
    summary.num_shards, summary.skipped_records = len(manifest.table), manifest.skipped_records
    summary.empty_docs, summary.inexact_cuts = manifest.empty_docs, manifest.inexact_cuts
    return summary


def _shard_table(units: list[WorkUnit], progress: list[UnitProgress], masked: bool) -> ShardTable:
    rows = [
        ShardInfo(
            shard_name(u.index),
            u.describe(),
            p.docs,
            p.tokens,
            p.tokens_checksum,
            p.offsets_checksum,
            p.mask_checksum if masked else None,
        )
        for u, p in zip(units, progress)
    ]
    return ShardTable.from_rows(rows)


def _check_same_build(root: Path | str, existing: Manifest, new: Manifest) -> None:
    old_config, new_config = build_identity(existing), build_identity(new)
    differences = [
        f"{key}: the cache has {old_config.get(key)}, this build has {new_config.get(key)}"
        for key in sorted(old_config.keys() | new_config.keys())
        if old_config.get(key) != new_config.get(key)
    ]
    if differences:
        raise ConfigMismatchError(
            f"{root} holds a cache built with other settings ({'; '.join(differences)}); use another output "
            "directory, or overwrite=True to start over"
        )
    python = [i for i in new.inputs if i.python]
    unidentified = [i.path for i in python if not i.fingerprint]
    if unidentified:
        raise ConfigMismatchError(
            f"{root} holds a cache built from Python objects ({unidentified[0]}), and streampack cannot tell "
            "whether they still hold the same documents: pass overwrite=True to rebuild it from the current "
            "ones, or give the documents an identity that changes with them, "
            "Documents(items, fingerprint='...'), to resume or reuse the cache"
        )
    changed = _changed_inputs(existing.inputs, new.inputs)
    if changed:
        raise ConfigMismatchError(
            f"{root}: the inputs changed since the ledger was written ({changed}); rerun with overwrite=True "
            "to rebuild from the current inputs"
        )


def _changed_inputs(old: Sequence[InputRecord], new: Sequence[InputRecord]) -> str:
    old_paths, new_paths = [i.path for i in old], [i.path for i in new]
    if old_paths != new_paths:
        return (
            f"the cache was built from {len(old_paths)} inputs starting {old_paths[:2]}, not {new_paths[:2]}"
        )
    for old_input, new_input in zip(old, new):
        before, now = old_input.to_json(), new_input.to_json()
        changed = [
            f"{key} {before.get(key)} -> {now.get(key)}"
            for key in sorted(before | now)
            if before.get(key) != now.get(key)
        ]
        if changed:
            return f"{new_input.path}: {', '.join(changed)}"
    return ""


# ---------------------------------------------------------------------------------------------- running


def _worker_count(todo: list[UnitTask], run: RunOptions, tokenizer: Tokenizer) -> int:
    """Worker processes of the local executor: as asked or chosen, at most one per unit to build."""
    wanted = run.workers or default_workers(tokenizer, os.cpu_count() or 1)
    return min(wanted, max(sum(not t.unit.in_process for t in todo), 1))


def _run(
    todo: list[UnitTask],
    run: RunOptions,
    tokenizer: Tokenizer,
    workers: int,
    report: Callable[[dict[str, int]], None],
) -> Iterable[UnitResult]:
    cores = os.cpu_count() or 1
    in_process = [t for t in todo if t.unit.in_process]
    pooled = [t for t in todo if not t.unit.in_process]
    here = partial(run_units, tokenizer=tokenizer)  # this process: the tokenizer build() loaded
    yield from run_local(here, in_process, workers=1, on_progress=report)
    if run.executor == "ray":
        threads = run.threads or cores  # a Ray task holds one CPU, but its node's cores are its to use
        setup: dict[str, Any] = {"on_progress": report, "initializer": init_worker, "initargs": (threads,)}
        yield from run_ray(run_units, pooled, address=run.ray_address, **setup)
    elif workers == 1:
        yield from run_local(here, pooled, workers=1, on_progress=report)
    else:
        setup = {
            "on_progress": report,
            "initializer": init_worker,
            "initargs": (worker_threads(run, workers),),
        }
        yield from run_local(run_units, pooled, workers=workers, **setup)


def worker_threads(run: RunOptions, workers: int, cores: int | None = None) -> int:
    """Tokenizer threads of each of ``workers`` worker processes: ``run.threads``, else a share of the cores.

    A worker whose threads outnumber its share of the cores fights the other workers' threads for them.
    """
    return run.threads or max(1, (cores or os.cpu_count() or 1) // workers)


def default_workers(tokenizer: Tokenizer, cores: int) -> int:
    """Worker processes when ``workers`` is not given: one per :attr:`Tokenizer.cores_per_worker` cores,
    chosen by measurement per engine (GPT-2 vocabulary, real English text, 2 cores).

    Hugging Face ``tokenizers`` runs best as one process using every core (100 MB: 0.94x its raw
    ``encode_batch_fast`` speed, against 0.78x for two processes whose thread pools fight over the cores):
    8 cores each. tiktoken is fast enough that reading and framing the documents matter: one process per
    core (345 MB: 25-27 s against 36 s for one process). fastokens encodes so fast that one reader feeds
    ~3 cores of it. ``bytes`` holds the GIL: one per core.
    """
    return max(1, cores // tokenizer.cores_per_worker)

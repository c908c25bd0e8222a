"""Building a token cache: plan the work units, run the unfinished ones, then write the complete manifest.

See docs/FORMAT.md for the commit protocol.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streampack.builder.blocks import VERIFY_FIRST, VERIFY_RATE
from streampack.builder.executors import execute, worker_count
from streampack.builder.options import BuildKeywords, CacheSpec, RunOptions, VerifyTokens, split_options
from streampack.builder.publish import Publisher, check_same_build, default_staging_dir, prepare_directory
from streampack.builder.tasks import TokenizerRef, UnitResult, UnitSpec, UnitTask, steady_allocator
from streampack.builder.timings import add_up, mark_process_start
from streampack.errors import OptionsError, StreampackError
from streampack.format.ledger import LedgerEntry
from streampack.format.manifest import Manifest, ShardInfo, ShardTable
from streampack.format.names import LOCK, MANIFEST, dtype_name, shard_name, token_dtype
from streampack.format.sections import (
    BuildSettings,
    Cuts,
    EngineRecord,
    IgnoredEntry,
    IgnoredInputs,
    InputRecord,
    InputRecords,
    TokenizerInfo,
    Verification,
)
from streampack.inputs.discovery import check_output_outside_inputs, discover_inputs
from streampack.inputs.records import Documents, ReadOptions, WorkUnit, refuse_text_for_sft
from streampack.inputs.sft import load_chat_template
from streampack.inputs.units import plan_python_units, plan_units
from streampack.store import LocalStore, is_remote
from streampack.store.files import load_manifest, read_entry, write_manifest
from streampack.store.remote import RemoteStore
from streampack.tokenizer.base import Tokenizer, describe_engine
from streampack.tokenizer.choices import ENGINE_CHOICES
from streampack.tokenizer.load import load_tokenizer
from streampack.tokenizer.pieces import piece_rule
from streampack.tokenizer.specials import BosPolicy, EosPolicy, resolve_bos, resolve_eos

if TYPE_CHECKING:
    from typing_extensions import Unpack


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
    # [wall, CPU] seconds per part of the build (read, encode, write, ...): streampack.builder.timings
    timings: dict[str, list[float]] = field(default_factory=dict)


def build(
    inputs: Any,
    out: str | os.PathLike[str],
    *,
    spec: CacheSpec | None = None,
    run: RunOptions | None = None,
    **options: Unpack[BuildKeywords],
) -> BuildSummary:
    """Build a cache: :func:`streampack.build` without its early start of the tokenizer's load."""
    spec, run = split_options(spec, run, options)
    remote = RemoteStore(out, run.storage_options) if isinstance(out, str) and is_remote(out) else None
    root = Path(out) if remote is None else Path(run.staging_dir or default_staging_dir(remote.url))
    mark_process_start()
    steady_allocator()  # before the tokenizer's tables are allocated
    started = time.perf_counter(), time.process_time()
    paths = _paths(inputs)
    if paths is not None:  # refuse an output that would mix with the inputs before listing them
        check_output_outside_inputs(root, paths)
    read = ReadOptions(spec.text_field, spec.split_lines, spec.unit_bytes, fields=spec.fields)
    units, records, ignored = _plan(inputs, paths, read, spec)
    tokenizer = load_tokenizer(
        spec.tokenizer,
        threads=run.threads or os.cpu_count() or 1,
        special_tokens=spec.special_tokens,
        engine=run.tokenizer_engine,
    )
    pieces = piece_rule(tokenizer.cut_safety, tokenizer.fast_piece_chars, spec.max_piece_chars)
    spec = replace(spec, max_piece_chars=pieces.max_chars)
    eos = resolve_eos(tokenizer, eos=spec.eos, eos_id=spec.eos_id)
    bos = resolve_bos(tokenizer, bos=spec.bos, bos_id=spec.bos_id)
    vocab_size = _vocab_size(tokenizer, eos, bos, allow_new_ids=run.allow_new_ids)
    fingerprint = tokenizer.fingerprint()
    chat_sha256 = None
    if spec.chat is not None:
        chat = load_chat_template(tokenizer, spec.chat, turns=spec.chat_turns, reasoning=spec.chat_reasoning)
        read = replace(read, chat=chat)
        chat_sha256 = chat.sha256  # compared on resume, as the tokenizer's own hash
    manifest = Manifest(
        tokenizer=TokenizerInfo(
            **{**fingerprint, "vocab_size": vocab_size},
            spec=spec.tokenizer,
            cuts=Cuts(tokenizer.cut_safety.exact, tokenizer.cut_safety.reason),
            chat_template_sha256=chat_sha256,
        ),
        dtype=dtype_name(token_dtype(vocab_size)),
        eos=eos,
        bos=bos,
        loss_mask=spec.sft,
        settings=BuildSettings(**spec.to_json()),
        inputs=records,
        units=[u.describe() for u in units],
        ignored_inputs=ignored,
        engines=[_engine_entry(tokenizer, run)],
    )
    engine = tokenizer.engine.name
    shared = UnitSpec(
        root=str(root),
        tokenizer=TokenizerRef(
            spec.tokenizer,
            spec.special_tokens,
            fingerprint["sha256"],
            engine=engine if engine in ENGINE_CHOICES else "auto",
        ),
        read=read,
        eos=eos,
        bos=bos,
        vocab_size=vocab_size,
        dtype=manifest.dtype,
        pieces=pieces,
        # without storage_options: the credentials of object storage stay out of the tasks' pickles
        run=replace(run, verify_tokens=_verify_mode(tokenizer, run), storage_options=None),
    )
    store = LocalStore(root)
    try:
        store.makedirs()
    except OSError as e:
        raise StreampackError(
            f"cannot create {root}: {e.strerror}; choose a writable output directory"
        ) from None
    with store.lock(LOCK):
        publisher, complete = None, None
        if remote is None:
            prepare_directory(store, run.overwrite)
        else:  # built in the staging directory, published unit by unit
            publisher = Publisher(remote, store, {shard_name(u.index): u.describe() for u in units})
            complete = publisher.begin(manifest, overwrite=run.overwrite)
        if complete is not None:
            summary = _summarize(BuildSummary(out=root), complete)
        else:
            tasks = [UnitTask(shared, u) for u in units]
            summary = _build_locked(store, manifest, tasks, run, tokenizer, started, publisher)
    summary.out = root if remote is None else remote.url
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
    """One line for a manifest's engine entry: which engine computed the ids, why, and how it was checked."""
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
        check_same_build(store.root, existing, manifest)
        if existing.complete:
            if publisher is not None:
                publisher.finish()
            return _summarize(summary, existing)
        # the engines of the earlier runs, then this run's unless it is one of them
        engines = existing.engines + [e for e in manifest.engines if e not in existing.engines]
        manifest = replace(manifest, engines=engines)
    write_manifest(store, manifest)
    units = [t.unit for t in tasks]
    entries = [read_entry(store, shard_name(u.index), u.describe()) for u in units]
    summary.units_already_done = sum(p.done for p in entries)
    summary.units_resumed = sum(not p.done and p.records > 0 for p in entries)
    summary.tokenizer_engine = engine_summary(_engine_entry(tokenizer, run))
    todo = [t for t, p in zip(tasks, entries) if not p.done]
    summary.workers = worker_count(todo, run, tokenizer)
    summary.timings = {"prepare": [time.perf_counter() - started[0], time.process_time() - started[1]]}
    with BuildProgress(run.progress, units, entries) as bar:
        for result in execute(todo, run, tokenizer, summary.workers, bar.update):
            summary.timings = add_up([summary.timings, result.timings])
            entries[result.unit_index] = result.entry
            if publisher is not None and result.entry.done:
                publisher.unit_done(shard_name(result.unit_index))
            bar.unit_done(result)
    rows = [
        ShardInfo(shard_name(u.index), u.describe(), p.docs, p.tokens, p.tokens_checksum, p.offsets_checksum)
        for u, p in zip(units, entries)
    ]
    if manifest.loss_mask:
        rows = [replace(row, mask_checksum=p.mask_checksum) for row, p in zip(rows, entries)]
    final = replace(
        manifest,
        complete=True,
        table=ShardTable.from_rows(rows),
        skipped_records=sum(p.skipped for p in entries),
        empty_docs=sum(p.empty_docs for p in entries),
        inexact_cuts=sum(p.inexact_cuts for p in entries),
    )
    write_manifest(store, final)
    if publisher is not None:
        publisher.finish()
    return _summarize(summary, final)


def _summarize(summary: BuildSummary, manifest: Manifest) -> BuildSummary:
    summary.num_docs, summary.num_tokens = manifest.num_docs, manifest.num_tokens
    summary.num_shards, summary.skipped_records = len(manifest.table), manifest.skipped_records
    summary.empty_docs, summary.inexact_cuts = manifest.empty_docs, manifest.inexact_cuts
    return summary


def _paths(inputs: Any) -> list[str | os.PathLike[str]] | None:
    """``inputs`` as a list of paths when they are a path or a list of them; None for Python documents."""
    if isinstance(inputs, (str, os.PathLike)):
        return [inputs]
    if isinstance(inputs, (list, tuple)) and all(isinstance(i, (str, os.PathLike)) for i in inputs):
        return list(inputs)
    return None


def _plan(
    inputs: Any, paths: list[str | os.PathLike[str]] | None, read: ReadOptions, spec: CacheSpec
) -> tuple[list[WorkUnit], InputRecords, IgnoredInputs]:
    """The work units of ``inputs``, the manifest's record of each input read, and what discovery skipped."""
    if paths is None:  # Python documents
        items = inputs.items if isinstance(inputs, Documents) else inputs
        fingerprint = inputs.fingerprint if isinstance(inputs, Documents) else None
        if fingerprint is None:  # a Hugging Face dataset's changes with its data and transforms
            fingerprint = getattr(items, "_fingerprint", None)
        try:
            count: int | None = len(items)  # type: ignore[arg-type]
        except TypeError:  # not Sized, or endless
            count = None
        fingerprint = fingerprint if isinstance(fingerprint, str) else None
        record = InputRecord(f"python:{type(items).__name__}", count, None, fingerprint)
        return plan_python_units(items), InputRecords([record.to_json()]), IgnoredInputs()
    found = discover_inputs(paths)
    if spec.sft:
        refuse_text_for_sft(found.files, "fields=[...]" if spec.fields is not None else "chat=...")
    # As JSON, made once: the manifest is written twice and its identity taken from it (10^4 .txt inputs)
    records = InputRecords([f.stat_json() for f in found.files])
    if not found.ignored:
        return plan_units(found.files, read), records, IgnoredInputs()
    reasons = Counter(e.reason.split(" of ")[0] for e in found.ignored)  # "duplicate of X": "duplicate"
    first = tuple(IgnoredEntry(e.path, e.reason) for e in found.ignored[:20])
    ignored = IgnoredInputs(len(found.ignored), dict(sorted(reasons.items())), first)
    return plan_units(found.files, read), records, ignored


class BuildProgress:
    """A tqdm bar over input bytes, with documents and tokens/s; silent when disabled."""

    def __init__(self, enabled: bool, units: Sequence[WorkUnit], progress: Sequence[LedgerEntry]) -> None:
        self.sizes = {u.index: _unit_size(u) for u in units}
        self.read: dict[int, int] = {}
        self.docs = sum(p.docs for p in progress)
        self.tokens = 0
        self.started = time.perf_counter()
        self.bar: Any = None
        if enabled:  # (importing tqdm takes ~0.1 s)
            from tqdm import tqdm

            done = sum(self.sizes[u.index] for u, p in zip(units, progress) if p.done)
            total = sum(self.sizes.values())
            self.bar = tqdm(
                total=total, initial=done, unit="B", unit_scale=True, desc="build", dynamic_ncols=True
            )

    def update(self, event: dict[str, int]) -> None:
        """Count one batch's documents, tokens and input bytes."""
        self.docs += event["docs"]
        self.tokens += event["tokens"]
        unit = event["unit"]
        step = min(event["bytes"], self.sizes[unit] - self.read.get(unit, 0))
        self.read[unit] = self.read.get(unit, 0) + step
        if self.bar is not None:
            self.bar.update(step)
            rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
            self.bar.set_postfix_str(f"{self.docs:,} docs, {rate / 1e6:.2f}M tok/s", refresh=False)

    def unit_done(self, result: UnitResult) -> None:
        """Complete the bar's share of a finished unit."""
        unit = result.unit_index
        if self.bar is not None:
            self.bar.update(self.sizes[unit] - self.read.get(unit, 0))
        self.read[unit] = self.sizes[unit]

    def __enter__(self) -> BuildProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def _unit_size(unit: WorkUnit) -> int:
    if unit.file is None:
        return 0
    if unit.stop is not None and unit.file.format == "jsonl":
        return unit.stop - unit.start
    return sum(f.size for f in unit.files)

"""The ``streampack`` command line: build, info, verify, upgrade, decode, bench, mix, which, demo.

User errors print one line on stderr (no traceback) and exit 1; an interrupted build (Ctrl-C, or SIGTERM)
says how to resume and exits 130 (143 for SIGTERM).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import click
import numpy as np

from streampack.builder.coordinator import build as build_cache
from streampack.builder.coordinator import engine_summary
from streampack.builder.options import CacheSpec, RunOptions, default
from streampack.builder.stagetimes import render as render_stages
from streampack.errors import OptionsError, StreampackError, TokenizerError
from streampack.format import FORMAT_VERSION, OFFSET_DTYPE, Manifest, upgrade_manifest
from streampack.reader import Cache
from streampack.reader import open as open_cache
from streampack.reader.verify import verify as verify_cache
from streampack.store import disk_error
from streampack.store.localcopy import CachedStore
from streampack.store.remote import is_remote
from streampack.tokenizer.base import Tokenizer
from streampack.tokenizer.choices import ENGINE_CHOICES, SPECIAL_TOKENS
from streampack.tokenizer.load import load_tokenizer


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="streampack")
def cli() -> None:
    """Tokenize a corpus into an on-disk token cache, and inspect it."""


_SPEC, _RUN = CacheSpec, RunOptions


@cli.command()
@click.argument("inputs", nargs=-1, required=True)
@click.option(
    "--out",
    "-o",
    required=True,
    type=click.Path(file_okay=False),
    help="Cache directory, or an fsspec URL (s3://bucket/prefix) to build in --stage and upload there.",
)
@click.option(
    "--tokenizer",
    "-t",
    default=default(_SPEC, "tokenizer"),
    show_default=True,
    help="'bytes'; a tokenizer.json path or folder; or tiktoken:DIR/NAME.tiktoken, with NAME.json beside "
    "it holding 'pat_str' and 'special_tokens'.",
)
@click.option(
    "--special-tokens",
    type=click.Choice(SPECIAL_TOKENS),
    default=default(_SPEC, "special_tokens"),
    show_default=True,
    help="text: special-token strings in documents (e.g. <|endoftext|>) are plain text; parse: their ids.",
)
@click.option(
    "--workers",
    "-j",
    type=click.IntRange(min=1),
    help="Worker processes [default: one per 8 cores for tokenizer.json, one per core otherwise].",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    help="Tokenizer threads per worker [default: the cores divided among the workers].",
)
@click.option(
    "--text-field",
    default=default(_SPEC, "text_field"),
    show_default=True,
    help="JSON key / Parquet column of the text.",
)
@click.option("--split-lines", is_flag=True, help="One document per line of .txt inputs (default: per file).")
@click.option(
    "--fields",
    metavar="A,B,...",
    help="SFT: build each document from these fields, each tokenized on its own; all but the last are the "
    "prompt (no loss), the last and the EOS are the target. Writes a loss mask beside each shard.",
)
@click.option(
    "--chat",
    metavar="FIELD",
    help="SFT: build each document from the list of {role, content} messages in FIELD, rendered with the "
    "chat template of the tokenizer_config.json beside the tokenizer.json; the assistant turns and the EOS "
    "are the target. Writes a loss mask beside each shard (needs jinja2: pip install 'streampack[chat]').",
)
@click.option("--eos-id", type=click.IntRange(min=0), help="EOS id to append [default: the tokenizer's].")
@click.option("--no-eos", is_flag=True, help="Append no EOS after documents.")
@click.option(
    "--bos",
    is_flag=True,
    help="Put the tokenizer's BOS id before every document (the bos_token of a tokenizer_config.json beside "
    "the tokenizer.json, else an added token like <s> or <|begin_of_text|>).",
)
@click.option("--bos-id", type=click.IntRange(min=0), help="Put this BOS id before every document.")
@click.option(
    "--allow-new-ids",
    is_flag=True,
    help="Allow an --eos-id or --bos-id outside the tokenizer's vocabulary (the cache's vocab_size grows "
    "past it); without it such an id is refused.",
)
@click.option(
    "--on-bad-record",
    type=click.Choice(["error", "skip"]),
    default=default(_RUN, "on_bad_record"),
    show_default=True,
    help="error: stop at the first bad record (what was committed stays); skip: skip and count them.",
)
@click.option("--overwrite", is_flag=True, help="Delete the existing cache in --out and start over.")
@click.option("--progress/--no-progress", default=None, help="Progress bar [default: when stderr is a tty].")
@click.option(
    "--unit-mb",
    type=click.IntRange(min=1),
    default=default(_SPEC, "unit_bytes") >> 20,
    show_default=True,
    help="Split large uncompressed JSONL and Parquet inputs into work units of this size.",
)
@click.option(
    "--engine",
    type=click.Choice(["local", "ray"]),
    default=default(_RUN, "engine"),
    show_default=True,
    help="local: a process pool here; ray: Ray tasks on a cluster (--out on shared storage).",
)
@click.option("--ray-address", help="Ray cluster address [default: a running one, else a new local one].")
@click.option(
    "--tokenizer-engine",
    type=click.Choice(ENGINE_CHOICES),
    default=default(_RUN, "tokenizer_engine"),
    show_default=True,
    help="What computes the token ids (the same ids whichever): auto picks fastokens where it is installed "
    "(a dependency where it has wheels) and proven to reproduce the tokenizer exactly in this special-token "
    "mode, else the tokenizer's own library (tokenizers for a tokenizer.json, tiktoken for tiktoken:); "
    "build and info say which ran and why.",
)
@click.option(
    "--verify-tokens",
    type=click.Choice(["sample", "all", "none"]),
    default=default(_RUN, "verify_tokens"),
    show_default=True,
    help="When another engine than the tokenizer's own library computes the ids, re-encode with the latter "
    "and stop at the first difference: sample (the first 20 records and 0.1% of the rest), all, none.",
)
@click.option(
    "--stage",
    type=click.Path(file_okay=False),
    help="With --out URL: local directory the shards are built in before upload [default: one per URL "
    "under the temp directory].",
)
@click.option(
    "--max-piece-chars",
    type=click.IntRange(min=1),
    help="Tokenize longer documents in pieces of at most N characters "
    "[default: 100000 where cuts at spaces provably keep the tokenizer's tokens, else 1000000].",
)
@click.option(
    "--profile",
    is_flag=True,
    help="After the summary, print where the time went: seconds per stage (read, pieces, encode, write, "
    "...) summed over the worker processes.",
)
@click.option("--batch-chars", type=click.IntRange(min=1), default=default(_RUN, "batch_chars"), hidden=True)
@click.option(
    "--commit-seconds", type=click.FloatRange(min=0), default=default(_RUN, "commit_seconds"), hidden=True
)
@click.option(
    "--commit-mb",
    type=click.FloatRange(min=0),
    default=default(_RUN, "commit_bytes") / (1 << 20),
    hidden=True,
)
def build(
    inputs: tuple[str, ...],
    out: str,
    tokenizer: str,
    special_tokens: str,
    workers: int | None,
    threads: int | None,
    text_field: str,
    split_lines: bool,
    fields: str | None,
    chat: str | None,
    eos_id: int | None,
    no_eos: bool,
    bos: bool,
    bos_id: int | None,
    allow_new_ids: bool,
    on_bad_record: str,
    overwrite: bool,
    progress: bool | None,
    unit_mb: int,
    engine: str,
    ray_address: str | None,
    tokenizer_engine: str,
    verify_tokens: str,
    stage: str | None,
    profile: bool,
    max_piece_chars: int | None,
    batch_chars: int,
    commit_seconds: float,
    commit_mb: float,
) -> None:
    """Tokenize INPUTS (files, directories, globs, URLs) into a token cache in --out.

    Rerunning the same command after an interruption resumes where it stopped.
    """
    try:
        spec = CacheSpec(
            tokenizer=tokenizer,
            special_tokens=special_tokens,  # type: ignore[arg-type]  # click checked the choice
            eos=not no_eos,
            eos_id=eos_id,
            bos=bos,
            bos_id=bos_id,
            text_field=text_field,
            split_lines=split_lines,
            fields=None if fields is None else tuple(f.strip() for f in fields.split(",")),
            chat=chat,
            unit_bytes=unit_mb << 20,
            max_piece_chars=max_piece_chars,
        )
        run = RunOptions(
            workers=workers,
            threads=threads,
            engine=engine,  # type: ignore[arg-type]
            tokenizer_engine=tokenizer_engine,  # type: ignore[arg-type]
            verify_tokens=verify_tokens,  # type: ignore[arg-type]
            ray_address=ray_address,
            on_bad_record=on_bad_record,  # type: ignore[arg-type]
            overwrite=overwrite,
            progress=sys.stderr.isatty() if progress is None else progress,
            batch_chars=batch_chars,
            commit_bytes=max(int(commit_mb * (1 << 20)), 1),
            commit_seconds=commit_seconds,
            stage=stage,
            profile=profile,
            allow_new_ids=allow_new_ids,
        )
    except OptionsError as e:
        raise click.UsageError(_in_cli_terms(str(e))) from None
    summary = build_cache(list(inputs), out, spec=spec, run=run)
    resumed = ""
    if summary.units_already_done or summary.units_resumed:
        resumed = (
            f" (resumed: {summary.units_already_done} units already done, {summary.units_resumed} partial)"
        )
    click.echo(
        f"built {summary.out}: {summary.num_docs:,} documents, {summary.num_tokens:,} tokens in "
        f"{summary.num_shards} shards, {summary.seconds:.1f} s{resumed}"
    )
    if summary.tokenizer_engine:
        click.echo(f"tokenizer engine: {summary.tokenizer_engine}")
    if summary.skipped_records:
        noun = "record" if summary.skipped_records == 1 else "records"
        click.echo(f"skipped {summary.skipped_records:,} bad {noun} (--on-bad-record skip)")
    if summary.empty_docs:
        noun = "document" if summary.empty_docs == 1 else "documents"
        click.echo(f"left out {summary.empty_docs:,} empty or whitespace-only {noun}")
    if summary.inexact_cuts:
        click.echo(
            f"note: {summary.inexact_cuts:,} cuts of very long documents may have changed the tokens next to "
            "them (see `streampack info`)"
        )
    if profile:
        click.echo(render_stages(summary.stages, summary.seconds, summary.workers))


# Library messages name Python parameters; the CLI shows them as its flags.
_CLI_TERMS = {
    'on_bad_record="skip"': "--on-bad-record skip",
    "overwrite=True": "--overwrite",
    "eos_id=N": "--eos-id N",
    "bos_id=N": "--bos-id N",
    "eos_id=": "--eos-id ",
    "bos_id=": "--bos-id ",
    "eos=False": "--no-eos",
    "allow_new_ids=True": "--allow-new-ids",
    "text_field=": "--text-field ",
    "fields=[...]": "--fields A,B",
    "chat=...": "--chat FIELD",
    "output directory": "--out",
}


def _in_cli_terms(message: str) -> str:
    for python, flag in _CLI_TERMS.items():
        message = message.replace(python, flag)
    return message


@cli.command()
@click.argument("cache_dir", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def info(cache_dir: str, as_json: bool) -> None:
    """Describe the cache in CACHE_DIR: documents, tokens, shards, tokenizer, document lengths."""
    stats = cache_stats(open_cache(cache_dir))
    if as_json:
        click.echo(json.dumps(stats, indent=2))
        return
    width = max(map(len, stats))
    for key, value in stats.items():
        shown = f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else value
        click.echo(f"{key:<{width}}  {shown}")


def cache_stats(cache: Cache) -> dict[str, Any]:
    """The figures ``streampack info`` prints."""
    lengths = cache.doc_lengths()
    quantiles = np.percentile(lengths, [50, 99]) if len(lengths) else [0, 0]
    # From the shard table: mapping every token file would download it from object storage.
    size = cache.num_tokens * cache.dtype.itemsize + cache.num_docs * OFFSET_DTYPE.itemsize
    if cache.has_loss_mask:
        size += cache.num_tokens  # one byte per token
    tokenizer = cache.manifest.tokenizer
    remote = isinstance(cache.store, CachedStore)
    where: dict[str, Any] = {"path": cache.store.uri if remote else str(cache.root)}
    if remote:
        where["local_copy"] = str(cache.root)
    return {
        **where,
        "num_docs": cache.num_docs,
        "num_tokens": cache.num_tokens,
        "num_shards": cache.num_shards,
        "bytes": int(size),
        "tokenizer": f"{tokenizer['kind']}:{tokenizer['name']} ({tokenizer.get('spec', '?')})",
        "vocab_size": cache.vocab_size,
        "dtype": cache.dtype.name,
        "eos_id": cache.eos_id,
        "bos_id": cache.bos_id,
        "special_tokens": cache.manifest.settings.get("special_tokens", "not recorded"),
        "tokenizer_engine": _engines_summary(cache.manifest.engines),
        "sft": _sft_summary(cache.manifest),
        "loss_mask": cache.has_loss_mask,
        "no_target_docs": _no_target_docs(cache),
        "inputs": _inputs_read(cache.manifest.inputs),
        "ignored_inputs": _ignored_summary(cache.manifest.ignored_inputs),
        "skipped_records": cache.manifest.skipped_records,
        "empty_docs": cache.manifest.empty_docs,
        "inexact_cuts": _cuts_summary(cache.manifest),
        "doc_tokens_mean": round(float(lengths.mean()), 1) if len(lengths) else 0.0,
        "doc_tokens_p50": int(quantiles[0]),
        "doc_tokens_p99": int(quantiles[1]),
    }


def _no_target_docs(cache: Cache) -> int:
    """Documents with no target token (every ``output="dict"`` label ``-100``, whatever the ``seq_len``):
    in an SFT cache, e.g. a conversation without an assistant turn built without EOS. Reads the masks."""
    from streampack.samples.packing import has_target

    count = 0
    for shard in range(cache.num_shards):
        ends = np.asarray(cache.shard_offsets(shard), dtype=np.int64)
        starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        keep = ends > starts
        mask = cache.shard_loss_mask(shard) if cache.has_loss_mask else None
        count += int(np.count_nonzero(~has_target(mask, starts[keep], (ends - starts)[keep])))
    return count


def _engines_summary(engines: list[dict[str, Any]]) -> str:
    """Which engines computed the ids (over the runs of a resumed build), why, and how they were verified."""
    if not engines:
        return "not recorded"
    return "; then ".join(engine_summary(e) for e in engines)


def _sft_summary(manifest: Manifest) -> str:
    """What an SFT build made its documents of, and that its shards carry a loss mask."""
    fields, chat = manifest.settings.get("fields"), manifest.settings.get("chat")
    if fields:
        return f"fields {', '.join(fields)} (loss on {fields[-1]} and EOS; loss mask: yes)"
    if chat:
        return f"chat messages in {chat!r} (loss on assistant turns and EOS; loss mask: yes)"
    return "no (plain text; no loss mask)"


def _inputs_read(inputs: list[dict[str, Any]]) -> str:
    paths = [i["path"] for i in inputs]
    if len(paths) <= 2:
        return ", ".join(paths) or "none"
    return f"{len(paths):,} files: {paths[0]} .. {paths[-1]}"


def _ignored_summary(ignored: dict[str, Any]) -> str:
    """Entries under the input directories and globs that were not read, by reason."""
    if not ignored:
        return "none"
    reasons = ", ".join(f"{n:,} {reason}" for reason, n in ignored["by_reason"].items())
    first = ignored["first"][0]
    return f"{ignored['count']:,} ({reasons}), e.g. {first['path']} ({first['reason']})"


def _cuts_summary(manifest: Manifest) -> str:
    """How many cuts of long documents may have changed tokens, and why cuts at spaces are exact or not."""
    cuts = manifest.tokenizer.get("cuts")
    if not cuts:
        return f"{manifest.inexact_cuts:,}"
    exact = "exact" if cuts["exact"] else "not proven exact"
    return f"{manifest.inexact_cuts:,}; cuts at spaces: {exact} ({cuts['reason']})"


@cli.command()
@click.argument("cache_dir", type=click.Path())
def verify(cache_dir: str) -> None:
    """Check every file of the cache in CACHE_DIR (or every object under a URL: read from object storage,
    never from a local copy): checksums, offsets, token ids, EOS and BOS, ledger, plans; list anything
    unknown. Exit 1 if any damage is found."""
    report = verify_cache(cache_dir)
    for note in report.notes:
        click.echo(f"note: {note}")
    if not report.ok:
        for problem in report.problems:
            click.echo(f"error: {problem}", err=True)
        sys.exit(1)
    checked = f"{_size(report.bytes_checked)} checked"
    if report.bytes_checked and report.seconds:
        checked += f" at {_size(report.bytes_checked / report.seconds)}/s"
    where = " from object storage" if is_remote(cache_dir) else ""
    click.echo(f"ok: {report.path} ({checked}{where})")


@cli.command()
@click.argument("cache_dir", type=click.Path())
def upgrade(cache_dir: str) -> None:
    """Rewrite the manifest of a cache made by an older streampack in the current format (its shards are
    untouched); version 1 manifests open ~20x slower at 10^5 shards."""
    if is_remote(cache_dir):
        raise click.UsageError(
            f"{cache_dir}: upgrade rewrites a local cache's manifest; copy the cache to a local directory, "
            "upgrade it there, and upload its manifest.json"
        )
    version = upgrade_manifest(cache_dir)
    if version == FORMAT_VERSION:
        click.echo(f"{cache_dir}: already format version {FORMAT_VERSION}")
    else:
        click.echo(f"{cache_dir}: manifest upgraded from format version {version} to {FORMAT_VERSION}")


def _size(count: float) -> str:
    """A byte count as people read it: ``812 bytes``, ``12.3 kB``, ``4.5 MB``, ``1.2 GB`` (SI units)."""
    if count < 1000:
        return f"{count:.0f} bytes"
    for unit in ("kB", "MB", "GB"):
        count /= 1000
        if count < 1000:
            return f"{count:.1f} {unit}"
    return f"{count / 1000:,.1f} TB"


@cli.command()
@click.argument("cache_dir", type=click.Path())
@click.option("--doc", "doc_index", type=int, help="Document index.")
@click.option("--sample", "sample_index", type=int, help="Packed sample index (with --seq-len).")
@click.option("--seq-len", type=click.IntRange(min=1), help="Tokens per packed sample.")
@click.option(
    "--tokenizer",
    "-t",
    help="Tokenizer SPEC to decode with, even if it differs from the cache's [default: the one that built "
    "the cache, if unchanged].",
)
@click.option("--ids", is_flag=True, help="Print token ids instead of text.")
def decode(
    cache_dir: str,
    doc_index: int | None,
    sample_index: int | None,
    seq_len: int | None,
    tokenizer: str | None,
    ids: bool,
) -> None:
    """Print document --doc, or packed sample --sample of --seq-len tokens, of the cache as text.

    Decodes with the tokenizer that built the cache, refusing it if its file changed since (the manifest
    holds its sha256); --tokenizer decodes with another one.
    """
    if (doc_index is None) == (sample_index is None):
        raise click.UsageError("give exactly one of --doc I or --sample I (with --seq-len L)")
    if sample_index is not None and seq_len is None:
        raise click.UsageError("--sample needs --seq-len: the sample is tokens [I*L, (I+1)*L) of the stream")
    cache = open_cache(cache_dir)
    try:
        if doc_index is not None:
            tokens = cache.doc(doc_index)
        else:
            assert seq_len is not None and sample_index is not None  # checked above
            tokens = cache.sequences(seq_len)[sample_index]
    except IndexError as e:
        raise StreampackError(str(e)) from None
    if ids:
        click.echo(" ".join(map(str, tokens.tolist())))
        return
    click.echo(_decoder(cache, tokenizer).decode(tokens.tolist()))


def _decoder(cache: Cache, given: str | None) -> Tokenizer:
    """The tokenizer ``given``, else the one that built ``cache`` if its file is still the same.

    The manifest records the tokenizer's spec as the build was given it (a relative path is taken from the
    directory the build ran in) and the sha256 of its definition: a file edited since would decode the
    ids into other text, silently. A tokenizer given explicitly is used whatever its hash, with a warning.
    """
    built_with = cache.manifest.tokenizer
    spec = given or str(built_with.get("spec", "bytes"))
    path = spec.removeprefix("tiktoken:")
    if given is None and spec != "bytes" and not Path(path).exists():
        where = (
            "which no longer exists"
            if os.path.isabs(path)
            else f"a path relative to where the build ran, which does not exist from {os.getcwd()}"
        )
        raise TokenizerError(
            f"the cache was built with tokenizer {spec!r}, {where}: pass --tokenizer PATH to decode with it"
        )
    decoder = load_tokenizer(spec)
    expected, actual = built_with.get("sha256"), decoder.fingerprint()["sha256"]
    if expected and actual != expected:
        mismatch = f"tokenizer {spec!r} has sha256 {actual}, but the cache was built with sha256 {expected}"
        if given is None:
            raise TokenizerError(
                f"{mismatch}: the file changed since the build, and may decode the ids into other text; "
                "pass --tokenizer PATH to decode with it (or another) anyway"
            )
        click.echo(f"warning: {mismatch}; decoding with it as asked", err=True)
    return decoder


_SHUFFLE_BLOCK = click.option(
    "--shuffle-block",
    type=click.IntRange(min=1),
    help="Block-shuffle: samples per block of consecutive samples [default: 4096 with --shuffle-window].",
)
_SHUFFLE_WINDOW = click.option(
    "--shuffle-window",
    type=click.IntRange(min=1),
    help="Block-shuffle: blocks shuffled together [default: 32 with --shuffle-block].",
)


def _shuffle(no_shuffle: bool, block: int | None, window: int | None) -> Any:
    """What ``shuffle=`` the loader options given on the command line mean."""
    from streampack.order.blockshuffle import BlockShuffle

    if block is None and window is None:
        return not no_shuffle
    if no_shuffle:
        raise click.UsageError("--no-shuffle reads in stream order: give it without --shuffle-block/-window")
    given = {"block": block, "window": window}
    return BlockShuffle(**{key: value for key, value in given.items() if value is not None})


@cli.command()
@click.argument("cache_dir", type=click.Path())
@click.option("--seq-len", type=click.IntRange(min=1), required=True, help="Tokens per sample.")
@click.option("--batch-size", type=click.IntRange(min=1), required=True, help="Global batch size.")
@click.option(
    "--workers", type=click.IntRange(min=0), default=0, show_default=True, help="DataLoader workers (torch)."
)
@click.option("--steps", type=click.IntRange(min=1), default=200, show_default=True, help="Batches to time.")
@click.option("--seed", type=int, default=0, show_default=True, help="Shuffle seed.")
@_SHUFFLE_BLOCK
@_SHUFFLE_WINDOW
@click.option(
    "--layout",
    type=click.Choice(["windows", "packed", "documents"]),
    default="windows",
    show_default=True,
    help="Samples: fixed windows (+1 token of overlap), whole documents packed best-fit, or one per sample.",
)
def bench(
    cache_dir: str,
    seq_len: int,
    batch_size: int,
    workers: int,
    steps: int,
    seed: int,
    shuffle_block: int | None,
    shuffle_window: int | None,
    layout: str,
) -> None:
    """Time the shuffled loader on CACHE_DIR: samples/s, tokens/s and memory per process.

    With --workers N the batches go through streampack.torch.DataLoader (needs the torch extra).
    """
    from streampack.loader import Loader

    cache = open_cache(cache_dir)
    try:
        samples = (
            cache.sequences(seq_len, overlap=1) if layout == "windows" else getattr(cache, layout)(seq_len)
        )
        shuffle = _shuffle(False, shuffle_block, shuffle_window)
        loader = Loader(samples, batch_size=batch_size, seed=seed, shuffle=shuffle)
    except ValueError as e:
        raise StreampackError(str(e)) from None
    batches: Any = loader
    if workers:
        try:
            from streampack.torch import DataLoader
        except ImportError as e:
            raise StreampackError(str(e)) from None
        batches = DataLoader(loader, num_workers=workers, persistent_workers=True)
    result = _time_batches(iter(batches), steps)
    rate = result["rows"] / result["seconds"]
    click.echo(f"cache       {cache.root} ({cache.num_tokens:,} tokens, {cache.dtype.name})")
    shape = f"seq_len {seq_len}+1" if layout == "windows" else f"{layout}, seq_len {seq_len}"
    if samples.pad_id is not None:
        shape += f", {samples.layout.padding:.1%} padding"  # type: ignore[union-attr]
    how = "shuffled" if shuffle is True else f"block-shuffled ({shuffle.block} x {shuffle.window})"
    click.echo(f"loader      {shape}, global batch {batch_size}, {how}, {workers} workers")
    click.echo(f"first batch {result['first']:.3f} s")
    click.echo(f"throughput  {rate:,.0f} samples/s, {rate * seq_len / 1e6:,.2f} M tokens/s ({steps} batches)")
    click.echo(f"memory      RssAnon main {result['main_mb']}; workers {result['workers_mb'] or 'none'}")


def _time_batches(batches: Any, steps: int) -> dict[str, Any]:
    """Draw one batch (timed apart: startup), then ``steps`` more; read the memory of every process."""
    import time

    start = time.perf_counter()
    next(batches)
    first = time.perf_counter() - start
    rows, start = 0, time.perf_counter()
    for _ in range(steps):
        rows += len(next(batches))
    seconds = time.perf_counter() - start
    workers = [_rss_anon(pid) for pid in _children()]
    return {
        "first": first,
        "seconds": seconds,
        "rows": rows,
        "main_mb": _rss_anon("self"),
        "workers_mb": " / ".join(workers),
    }


def _rss_anon(pid: int | str) -> str:
    """Anonymous resident memory of a process (``RssAnon``: not the page cache of mapped files)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return f"{int(line.split()[1]) / 1024:.1f} MB"
    except OSError:
        pass
    return "n/a"


def _children() -> list[int]:
    """Process ids of this process's children (Linux /proc), e.g. DataLoader workers."""
    me, found = str(os.getpid()), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[1] == me:
            found.append(int(stat.parent.name))
    return sorted(found)


@cli.command()
@click.option(
    "--config", "config_path", required=True, type=click.Path(dir_okay=False), help="Mixture YAML or JSON."
)
@click.option(
    "--steps", type=click.IntRange(min=0), default=0, show_default=True, help="Batches to look ahead."
)
@click.option("--batch-size", type=click.IntRange(min=1), help="Global batch size (needed with --steps).")
@click.option(
    "--state", "state_path", type=click.Path(dir_okay=False), help="Start from a loader state (JSON)."
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def mix(config_path: str, steps: int, batch_size: int | None, state_path: str | None, as_json: bool) -> None:
    """Show a mixture's plan: per source, its weight, realised share and epoch after --steps batches.

    Nothing is read but the caches' manifests: the proportions come from the order alone, exactly, also
    far ahead. With --state, from where a saved loader state (Loader.state_dict() as JSON) stands, with the
    config's weights after it: the plan of a run resumed with this config.

    The config's keys (unknown ones are refused): seq_len and sources (required); weights, or stages
    (a list of {at: SAMPLES or {tokens: N}, weights: {...}}); layout (windows, packed, documents),
    overlap, seed, shuffle (true, false or {block: B, window: W}), block_size, stop (never,
    first_exhausted); for sources in object storage, local_dir, max_local_bytes and storage_options.
    A source is a cache directory (relative to the config file), a URL (s3://bucket/prefix), or
    {path: ..., local_dir: ..., max_local_bytes: ..., storage_options: ...}. For example:

    \b
        seq_len: 2048
        seed: 0
        sources:
          web: caches/web
          code: s3://bucket/code
        stages:
          - {at: 0, weights: {web: 0.9, code: 0.1}}
          - {at: {tokens: 2.0e+10}, weights: {web: 0.7, code: 0.3}}
    """
    from streampack.loader import Loader
    from streampack.loader.mixconfig import load_mixture

    if steps and batch_size is None:
        raise click.UsageError("--steps needs --batch-size: the batches' size decides how far they reach")
    mixture = load_mixture(config_path)
    loader = Loader(mixture, batch_size=batch_size or 1)
    if state_path is not None:
        try:
            state = json.loads(Path(state_path).read_text())
        except (OSError, ValueError) as e:
            raise StreampackError(f"cannot read the loader state {state_path}: {e}") from None
        loader.load_state_dict(state)
    from streampack.order import MAX_POSITION

    position = min(loader.position + steps * (batch_size or 1), MAX_POSITION)  # as realised() counts
    if loader.order.end is not None:
        position = min(position, loader.order.end)
    report = loader.realised(steps)
    if as_json:
        rows = [vars(progress) for progress in report]
        click.echo(json.dumps({"position": position, "end": loader.order.end, "sources": rows}, indent=2))
        return
    seq_len = getattr(next(iter(mixture.sources.values())), "seq_len", None)
    tokens = f" ({position * seq_len:,} tokens)" if seq_len else ""
    ends = "never (each source wraps)" if loader.order.end is None else f"at position {loader.order.end:,}"
    click.echo(
        f"mixture     {config_path}: {len(report)} sources, blocks of {mixture.block_size:,}, ends {ends}"
    )
    click.echo(f"position    {position:,} samples{tokens}")
    for first, counts in loader.order.fingerprint()["schedule"]:
        shares = ", ".join(f"{name} {count / mixture.block_size:.4g}" for name, count in counts.items())
        click.echo(f"from        position {first * mixture.block_size:,}: {shares}")
    click.echo(f"{'source':<16} {'weight':>8} {'served':>14} {'share':>8} {'samples':>14} {'epoch':>9}")
    for p in report:
        click.echo(
            f"{p.name:<16} {p.weight:>8.4f} {p.served:>14,} {p.share:>8.4f} {p.size:>14,} {p.epoch:>9.3f}"
        )


@cli.command()
@click.argument("data", type=click.Path(exists=True))
@click.option(
    "--seq-len",
    type=click.IntRange(min=1),
    help="Tokens per sample (a mixture config sets its own: give none, or the same).",
)
@click.option(
    "--overlap", type=click.IntRange(min=0), help="Extra tokens per sample, as trained with [default: 0]."
)
@click.option("--batch-size", type=click.IntRange(min=1), help="Global batch size [default: the state's].")
@click.option(
    "--seed", type=int, help="Shuffle seed of the run [default: 0; a mixture config sets its own, as above]."
)
@click.option(
    "--no-shuffle",
    is_flag=True,
    help="The run read samples in stream order (a mixture config sets its own shuffle, as above).",
)
@_SHUFFLE_BLOCK
@_SHUFFLE_WINDOW
@click.option(
    "--world-size",
    type=click.IntRange(min=1),
    help="Ranks of the run, to say which rank read each row [default: the state's, else 1].",
)
@click.option(
    "--step", type=click.IntRange(min=0), help="The step, from the start of the run (or of --state)."
)
@click.option(
    "--state",
    "state_path",
    type=click.Path(dir_okay=False),
    help="A saved loader state (JSON): the batch a run resumed from it serves first (--step N: N later).",
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def which(
    data: str,
    seq_len: int | None,
    overlap: int | None,
    batch_size: int | None,
    seed: int | None,
    no_shuffle: bool,
    shuffle_block: int | None,
    shuffle_window: int | None,
    world_size: int | None,
    step: int | None,
    state_path: str | None,
    as_json: bool,
) -> None:
    """Print the documents of one step's batch with their input file and line.

    DATA is a cache directory, or a mixture config (YAML or JSON). Nothing needs to have been logged:
    the batch is recomputed from the run's settings (those of its Loader), and each document's line is
    found by reading its part of the inputs again, which must be where and as they were at build time.
    """
    from streampack.loader.provenance import position_of
    from streampack.loader.provenance import which as find

    if step is None and state_path is None:
        raise click.UsageError("give --step N (from the start of the run), --state FILE, or both")
    state = _read_state(state_path) if state_path is not None else None
    batch_size = batch_size or (state or {}).get("batch_size")
    if not isinstance(batch_size, int):
        raise click.UsageError("give --batch-size B: the global batch size of the run")
    world_size = world_size or (state or {}).get("world_size") or 1
    shuffle = (no_shuffle, shuffle_block, shuffle_window)
    loader = _run_loader(data, seq_len, overlap, batch_size, seed, shuffle, world_size)
    position = position_of(loader, step, state=state)
    docs = find(loader, step, state=state)
    if as_json:
        rows = [{**dataclasses.asdict(doc), "location": doc.location, "tokens": doc.tokens} for doc in docs]
        click.echo(json.dumps({"position": position, "documents": rows}, indent=2))
        return
    rows_count = sum(len(doc.placements) for doc in docs)
    click.echo(
        f"position {position:,}: {len(docs)} documents in {rows_count} runs of tokens, batch of "
        f"{batch_size} over {world_size} rank{'s' if world_size > 1 else ''}"
    )
    mixed = Path(data).is_file()
    source = f"{'source':<12} " if mixed else ""
    click.echo(f"{source}{'doc':>10} {'tokens':>7}  {'rank:row[columns]':<24} location")
    for doc in docs:
        placed = " ".join(f"{p.rank}:{p.row}[{p.columns[0]}:{p.columns[1]}]" for p in doc.placements)
        name = f"{doc.source:<12} " if mixed else ""
        click.echo(f"{name}{doc.doc:>10} {doc.tokens:>7}  {placed:<24} {doc.location}")


def _read_state(path: str) -> dict[str, Any]:
    try:
        state = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise StreampackError(f"cannot read the loader state {path}: {e}") from None
    if not isinstance(state, dict):
        raise StreampackError(f"{path}: a loader state is a JSON object (Loader.state_dict()), got {state!r}")
    return state


def _run_loader(
    data: str,
    seq_len: int | None,
    overlap: int | None,
    batch_size: int,
    seed: int | None,
    shuffle: tuple[bool, int | None, int | None],
    world_size: int,
) -> Any:
    """The Loader of a run over a cache directory or a mixture config, as ``which`` was told it."""
    from streampack.loader import Loader
    from streampack.loader.mixconfig import load_mixture

    if Path(data).is_file():
        dataset: Any = load_mixture(data)
        _check_agrees_with_config(data, dataset, seq_len, overlap, seed, shuffle)
        options: dict[str, Any] = {}
    else:
        if seq_len is None:
            raise click.UsageError("give --seq-len L: the tokens per sample of the run")
        dataset = open_cache(data).sequences(seq_len, overlap=overlap or 0)
        options = {"seed": seed or 0, "shuffle": _shuffle(*shuffle)}
    try:
        return Loader(dataset, batch_size=batch_size, world_size=world_size, **options)
    except ValueError as e:
        raise StreampackError(str(e)) from None


def _check_agrees_with_config(
    path: str,
    mixture: Any,
    seq_len: int | None,
    overlap: int | None,
    seed: int | None,
    shuffle: tuple[bool, int | None, int | None],
) -> None:
    """Refuse run settings given on the command line that contradict the mixture config's own.

    A config sets its samples' length, overlap, seed and shuffle itself; the same values given again (as
    a script that passes them for a cache does) are accepted.
    """
    from streampack.order.blockshuffle import shuffle_fingerprint

    first = next(iter(mixture.sources.values()))
    checks: list[tuple[str, object, object, str]] = [
        (f"--seq-len {seq_len}", seq_len, getattr(first, "seq_len", None), "seq_len"),
        (f"--overlap {overlap}", overlap, getattr(first, "overlap", 0), "overlap"),
        (f"--seed {seed}", seed, mixture.seed, "seed"),
    ]
    no_shuffle, block, window = shuffle
    if no_shuffle or block is not None or window is not None:
        flags = [f"--shuffle-{key} {value}" for key, value in (("block", block), ("window", window)) if value]
        given = shuffle_fingerprint(_shuffle(no_shuffle, block, window))
        own = shuffle_fingerprint(mixture.shuffle)
        checks.append((" ".join(flags) if flags else "--no-shuffle", given, own, "shuffle"))
    contradictions = [
        f"{flags} (the config has {key}: {_shown(own)})"
        for flags, given, own, key in checks
        if given is not None and given != own
    ]
    if contradictions:
        raise click.UsageError(
            f"{'; '.join(contradictions)}: the mixture config {path} sets these itself; leave the flags out "
            "(or give the config's values), or edit the config"
        )


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    return str(value)


@cli.command()
@click.option(
    "--out",
    "-o",
    default="demo-cache",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Cache directory to build (a demo cache already there is replaced).",
)
@click.option("--workers", "-j", type=click.IntRange(min=1), help="Worker processes [default: cores].")
def demo(out: str, workers: int | None) -> None:
    """Build a cache from this Python's own standard library sources with the bytes tokenizer, show it."""
    from streampack.cli.demo import run_demo

    run_demo(Path(out), workers=workers)


INTERRUPTED = "interrupted; rerun the same command to resume"
SIGTERM_STATUS = 128 + signal.SIGTERM  # what a shell reports for a process that SIGTERM ended: 143


def main() -> None:
    """Console-script entry point.

    SIGTERM (how Slurm, Kubernetes and ``kill`` stop a job) stops a command as Ctrl-C does: the command
    unwinds, so a build stops its workers, releases its lock and leaves no shared-memory objects behind;
    the exit status is 143 (128 + 15) for SIGTERM, 130 for Ctrl-C.
    """
    terminated: list[bool] = []
    signal.signal(signal.SIGTERM, functools.partial(_interrupt_on_sigterm, terminated))
    try:
        status, message = _run_cli()
    except KeyboardInterrupt:  # a signal while an error was being handled
        status, message = 130, INTERRUPTED
    if terminated:  # whatever the unwinding raised (e.g. a worker that the same SIGTERM ended)
        status, message = SIGTERM_STATUS, INTERRUPTED
    if message:
        click.echo(message, err=True)
    sys.exit(status)


def _interrupt_on_sigterm(terminated: list[bool], signum: int, frame: FrameType | None) -> None:
    if terminated:
        return  # already unwinding: let the cleanup finish
    terminated.append(True)
    raise KeyboardInterrupt


def _run_cli() -> tuple[int, str]:
    """Run the command; return the exit status and the line to print on stderr (if any)."""
    try:
        cli.main(standalone_mode=False)
    except (click.exceptions.Abort, KeyboardInterrupt):
        return 130, INTERRUPTED
    except click.ClickException as e:
        e.show()
        return e.exit_code, ""
    except StreampackError as e:
        return 1, f"error: {_in_cli_terms(str(e))}"
    except OSError as e:  # one the library did not turn into a StreampackError: still one line, with the file
        if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            message = str(disk_error(e, Path(e.filename or "?")))
        else:
            message = f"{e.filename or 'I/O'}: {e.strerror or e}"
        return 1, f"error: {message}"
    return 0, ""

"""``streampack info``, ``verify``, ``upgrade`` and ``decode``: look at a cache."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click
import numpy as np

from streampack.builder.coordinator import engine_summary
from streampack.cli.sources import declared, source_options
from streampack.errors import StreampackError, TokenizerError
from streampack.format.manifest import FORMAT_VERSION
from streampack.format.names import OFFSET_DTYPE
from streampack.reader import Cache
from streampack.reader import open as open_cache
from streampack.reader.verify import verify as verify_cache
from streampack.store import is_remote
from streampack.store.files import upgrade_manifest
from streampack.store.localcopy import CachedStore
from streampack.tokenizer.base import Tokenizer
from streampack.tokenizer.load import load_tokenizer
from streampack.tokenizer.preload import TIKTOKEN_PREFIX


@click.command()
@click.argument("cache_dir", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@source_options()
def info(cache_dir: str, as_json: bool, **source: Any) -> None:
    """Describe the cache in CACHE_DIR: documents, tokens, shards, tokenizer, document lengths. CACHE_DIR
    may hold another format's token files (a Megatron prefix, llm.c, datatrove, OLMo or MDS shards...)."""
    stats = cache_stats(open_cache(cache_dir, **declared(source)))
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
    manifest = cache.manifest
    tokenizer, settings, ignored = manifest.tokenizer, manifest.settings, manifest.ignored_inputs
    remote = isinstance(cache.store, CachedStore)
    where: dict[str, Any] = {"path": cache.store.uri if remote else str(cache.root)}
    if remote:
        where["local_copy"] = str(cache.root)
    if settings.fields:
        sft = f"fields {', '.join(settings.fields)} (loss on {settings.fields[-1]} and EOS; loss mask: yes)"
    elif settings.chat:
        sft = f"chat messages in {settings.chat!r} (loss on assistant turns and EOS; loss mask: yes)"
    else:
        sft = "no (plain text; no loss mask)"
    paths = [i.path for i in manifest.inputs]
    inputs = (
        ", ".join(paths) or "none" if len(paths) <= 2 else f"{len(paths):,} files: {paths[0]} .. {paths[-1]}"
    )
    skipped = "none"
    if ignored.count:  # entries of the input directories and globs that were not read, by reason
        reasons = ", ".join(f"{n:,} {reason}" for reason, n in ignored.by_reason.items())
        skipped = f"{ignored.count:,} ({reasons}), e.g. {ignored.first[0].path} ({ignored.first[0].reason})"
    inexact = f"{manifest.inexact_cuts:,}"
    if tokenizer.cuts:  # why cuts at spaces are exact or not
        exact = "exact" if tokenizer.cuts.exact else "not proven exact"
        inexact += f"; cuts at spaces: {exact} ({tokenizer.cuts.reason})"
    return {
        **where,
        "num_docs": cache.num_docs,
        "num_tokens": cache.num_tokens,
        "num_shards": cache.num_shards,
        "bytes": int(size),
        "tokenizer": f"{tokenizer.kind}:{tokenizer.name} ({tokenizer.spec or '?'})",
        "vocab_size": cache.vocab_size,
        "dtype": cache.dtype.name,
        "eos_id": cache.eos_id,
        "bos_id": cache.bos_id,
        "special_tokens": settings.special_tokens or "not recorded",
        "tokenizer_engine": "; then ".join(map(engine_summary, manifest.engines)) or "not recorded",
        "sft": sft,
        "loss_mask": cache.has_loss_mask,
        "no_target_docs": _no_target_docs(cache),
        "inputs": inputs or "none",
        "ignored_inputs": skipped,
        "skipped_records": manifest.skipped_records,
        "empty_docs": manifest.empty_docs,
        "inexact_cuts": inexact,
        "doc_tokens_mean": round(float(lengths.mean()), 1) if len(lengths) else 0.0,
        "doc_tokens_p50": int(quantiles[0]),
        "doc_tokens_p99": int(quantiles[1]),
    }


def _no_target_docs(cache: Cache) -> int:
    """Documents with no target token (every ``output="dict"`` label ``-100``): in an SFT cache, e.g. a
    conversation without an assistant turn built without EOS."""
    from streampack.samples.packing import has_target

    count = 0
    for shard in range(cache.num_shards):
        ends = np.asarray(cache.shard_offsets(shard), dtype=np.int64)
        starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        keep = ends > starts
        mask = cache.shard_loss_mask(shard) if cache.has_loss_mask else None
        count += int(np.count_nonzero(~has_target(mask, starts[keep], (ends - starts)[keep])))
    return count


@click.command()
@click.argument("cache_dir", type=click.Path())
@source_options()
def verify(cache_dir: str, **source: Any) -> None:
    """Check every file of the cache in CACHE_DIR (or every object under a URL: read from object storage,
    never from a local copy): checksums, offsets, token ids, EOS and BOS, ledger, plans; list anything
    unknown. Exit 1 if any damage is found. Another format's token files get the checks they allow: what
    their format records (headers, indexes, counts; a note says which), and every token against
    --vocab-size, --eos-id and --bos-id where given."""
    report = verify_cache(cache_dir, **declared(source))
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


@click.command()
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


@click.command()
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
    holds its sha256); --tokenizer decodes with another one, and is needed where the cache records none
    (another format's files, or a cache converted from them).
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
    """The tokenizer ``given``, else the one that built ``cache`` if its file is unchanged (its sha256):
    an edited file would decode the ids into other text, silently. Refused where the cache records none,
    rather than guessed. A tokenizer given is used whatever its hash, with a warning.
    """
    built_with = cache.manifest.tokenizer
    spec = given or built_with.spec or ("bytes" if built_with.kind == "bytes" else None)
    if spec is None:
        raise TokenizerError(
            f"{cache.root}: the cache records no tokenizer to decode with (tokenizer {built_with.kind}:"
            f"{built_with.name}): pass --tokenizer SPEC, the one its ids are of (a tokenizer.json, "
            "tiktoken:RANKS or bytes), or --ids to print the ids"
        )
    path = spec.removeprefix(TIKTOKEN_PREFIX)
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
    expected, actual = built_with.sha256, decoder.fingerprint()["sha256"]
    if expected and actual != expected:
        mismatch = f"tokenizer {spec!r} has sha256 {actual}, but the cache was built with sha256 {expected}"
        if given is None:
            raise TokenizerError(
                f"{mismatch}: the file changed since the build, and may decode the ids into other text; "
                "pass --tokenizer PATH to decode with it (or another) anyway"
            )
        click.echo(f"warning: {mismatch}; decoding with it as asked", err=True)
    return decoder

"""``streampack build``: tokenize a corpus into a token cache, and the summary it prints.

Library messages name Python parameters; :func:`in_cli_terms` shows them as this command's flags (the
``streampack`` group uses it for every error it prints).
"""

from __future__ import annotations

import sys

import click

from streampack.builder.coordinator import build as build_cache
from streampack.builder.options import CacheSpec, RunOptions, default
from streampack.builder.stagetimes import render as render_stages
from streampack.errors import OptionsError

_SPEC, _RUN = CacheSpec, RunOptions


@click.command()
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
    type=click.Choice(["text", "parse"]),
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
    type=click.Choice(["auto", "tokenizers", "tiktoken", "fastokens"]),
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
        raise click.UsageError(in_cli_terms(str(e))) from None
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


def in_cli_terms(message: str) -> str:
    """``message`` with the Python parameters it names shown as the CLI's flags."""
    for python, flag in _CLI_TERMS.items():
        message = message.replace(python, flag)
    return message

"""``streampack build``: tokenize a corpus into a token cache, and the summary it prints; and
:func:`in_cli_terms`, which shows the Python parameters library messages name as the CLI's flags.
"""

from __future__ import annotations

import dataclasses
import operator
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, get_args, get_type_hints

import click

from streampack.builder.coordinator import build as build_cache
from streampack.builder.options import CacheSpec, RunOptions
from streampack.builder.timings import render as render_timings
from streampack.cli.sources import stacked
from streampack.errors import OptionsError


def _same(value: Any) -> Any:
    return value


_SPEC_FIELDS = frozenset(f.name for f in dataclasses.fields(CacheSpec))
Owner = type[CacheSpec] | type[RunOptions]


@dataclass(frozen=True)
class Flag:
    """One option of ``build``: the :class:`CacheSpec` or :class:`RunOptions` field it sets, and how.

    Its default and a ``Literal`` field's choices come from the dataclasses, so the command cannot drift
    from them.

    Attributes:
        field: the field's name, which names the click parameter (and the flag, unless ``decls`` does).
        decls: the option's flags, where they are not ``--field-name`` (``"--tokenizer", "-t"``).
        type: the click type (default: a ``Literal`` field's choices, else what the default is).
        shown: the field's default as the option's (``--unit-mb`` counts MB).
        value: the option's value as the field's (``--no-eos`` gives ``eos=False``).

    ``help``, ``is_flag``, ``metavar`` and ``hidden`` are click's.
    """

    field: str
    help: str | None = None
    decls: tuple[str, ...] = ()
    type: click.ParamType | None = None
    is_flag: bool = False
    metavar: str | None = None
    hidden: bool = False
    shown: Callable[[Any], Any] = _same
    value: Callable[[Any], Any] = _same

    @property
    def owner(self) -> Owner:
        """The class the field is on."""
        return CacheSpec if self.field in _SPEC_FIELDS else RunOptions

    def option(self) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """The ``click.option`` decorator of this flag."""
        initial = self.shown(self.owner.__dataclass_fields__[self.field].default)
        kind = self.type
        if kind is None:
            allowed = get_args(get_type_hints(self.owner)[self.field])
            if allowed and all(isinstance(a, str) for a in allowed):  # a Literal of strings
                kind = click.Choice(list(allowed))
        return click.option(
            *(self.decls or ("--" + self.field.replace("_", "-"),)),
            self.field,
            type=kind,
            is_flag=self.is_flag or None,  # None: click reads --a/--no-a as a flag
            default=initial,
            show_default=initial is not None and not self.is_flag and not self.hidden,
            metavar=self.metavar,
            hidden=self.hidden,
            help=self.help,
        )


_MB = 1 << 20
_POSITIVE = click.IntRange(min=1)

#: The options of ``build`` in the order ``--help`` lists them, one per field of CacheSpec and RunOptions
#: but those in NO_FLAG.
FLAGS = [
    Flag(
        "tokenizer",
        "'bytes'; a tokenizer.json path or folder; or tiktoken:DIR/NAME.tiktoken, with NAME.json beside it "
        "holding 'pat_str' and 'special_tokens'.",
        ("--tokenizer", "-t"),
    ),
    Flag(
        "special_tokens",
        "text: special-token strings in documents (e.g. <|endoftext|>) are plain text; parse: their ids.",
    ),
    Flag(
        "workers",
        "Worker processes [default: one per 8 cores for tokenizer.json, one per core otherwise].",
        ("--workers", "-j"),
        type=_POSITIVE,
    ),
    Flag(
        "threads",
        "Tokenizer threads per worker [default: the cores divided among the workers].",
        type=_POSITIVE,
    ),
    Flag("text_field", "JSON key / Parquet column of the text."),
    Flag("split_lines", "One document per line of .txt inputs (default: per file).", is_flag=True),
    Flag(
        "fields",
        "SFT: build each document from these fields, each tokenized on its own; all but the last are the "
        "prompt (no loss), the last and the EOS are the target. Writes a loss mask beside each shard.",
        metavar="A,B,...",
        value=lambda names: None if names is None else tuple(f.strip() for f in names.split(",")),
    ),
    Flag(
        "chat",
        "SFT: build each document from the list of {role, content} messages in FIELD, rendered with the "
        "chat template of the tokenizer_config.json beside the tokenizer.json; the assistant turns and the "
        "EOS are the target. Writes a loss mask beside each shard (needs jinja2: pip install "
        "'streampack[chat]').",
        metavar="FIELD",
    ),
    Flag("chat_turns", "Chat builds: all: every assistant turn is a target; last: the last one only."),
    Flag(
        "chat_reasoning",
        "Chat builds: train: the assistant turns' reasoning, as the template prints it, is a target; mask: "
        "each turn's target starts after it.",
    ),
    Flag("eos_id", "EOS id to append [default: the tokenizer's].", type=click.IntRange(min=0)),
    Flag(
        "eos",
        "Append no EOS after documents.",
        ("--no-eos",),
        is_flag=True,
        shown=operator.not_,
        value=operator.not_,
    ),
    Flag(
        "bos",
        "Put the tokenizer's BOS id before every document (the bos_token of a tokenizer_config.json beside "
        "the tokenizer.json, else an added token like <s> or <|begin_of_text|>).",
        is_flag=True,
    ),
    Flag("bos_id", "Put this BOS id before every document.", type=click.IntRange(min=0)),
    Flag(
        "allow_new_ids",
        "Allow an --eos-id or --bos-id outside the tokenizer's vocabulary (the cache's vocab_size grows "
        "past it); without it such an id is refused.",
        is_flag=True,
    ),
    Flag(
        "on_bad_record",
        "error: stop at the first bad record (what was committed stays); skip: skip and count them.",
    ),
    Flag("overwrite", "Delete the existing cache in --out and start over.", is_flag=True),
    Flag(
        "progress",
        "Progress bar [default: when stderr is a tty].",
        ("--progress/--no-progress",),
        shown=lambda _: None,  # decided when the command runs
        value=lambda shown: sys.stderr.isatty() if shown is None else shown,
    ),
    Flag(
        "unit_bytes",
        "Split large uncompressed JSONL and Parquet inputs into work units of this size.",
        ("--unit-mb",),
        type=_POSITIVE,
        shown=lambda size: size >> 20,
        value=lambda mb: mb << 20,
    ),
    Flag("executor", "local: a process pool here; ray: Ray tasks on a cluster (--out on shared storage)."),
    Flag("ray_address", "Ray cluster address [default: a running one, else a new local one]."),
    Flag(
        "tokenizer_engine",
        "What computes the token ids (the same ids whichever): auto picks fastokens where installed (a "
        "dependency where it has wheels) and proven to reproduce the tokenizer exactly in this special-token "
        "mode, else the tokenizer's own library (tokenizers for a tokenizer.json, tiktoken for tiktoken:); "
        "gigatoken (the fast extra) runs only when named. build and info say which ran and why.",
    ),
    Flag(
        "verify_tokens",
        "When another engine than the tokenizer's own library computes the ids, re-encode with the latter "
        "and stop at the first difference: sample (the first 20 records and 0.1% of the rest), all, none.",
    ),
    Flag(
        "staging_dir",
        "With --out URL: local directory the shards are built in before upload [default: one per URL "
        "under the temp directory].",
        type=click.Path(file_okay=False),
    ),
    Flag(
        "max_piece_chars",
        "Tokenize longer documents in pieces of at most N characters "
        "[default: 100000 where cuts at spaces provably keep the tokenizer's tokens, else 1000000].",
        type=_POSITIVE,
    ),
    Flag(
        "profile",
        "After the summary, print where the time went: timings in seconds (read, parse, encode, write, "
        "...) summed over the worker processes.",
        is_flag=True,
    ),
    Flag("batch_chars", type=_POSITIVE, hidden=True),
    Flag("commit_seconds", type=click.FloatRange(min=0), hidden=True),
    Flag(
        "commit_bytes",
        decls=("--commit-mb",),
        type=click.FloatRange(min=0),
        hidden=True,
        shown=lambda size: size / _MB,
        value=lambda mb: max(int(mb * _MB), 1),
    ),
]

#: The fields no flag sets, and why.
NO_FLAG = {
    (RunOptions, "storage_options"): "the object store's credentials and endpoints come from the environment",
}


def options_from_flags(given: Mapping[str, Any]) -> tuple[CacheSpec, RunOptions]:
    """The :class:`CacheSpec` and :class:`RunOptions` the options of ``build`` (by field name) give;
    :class:`OptionsError` for a value the dataclasses refuse."""
    values: dict[type, dict[str, Any]] = {CacheSpec: {}, RunOptions: {}}
    for flag in FLAGS:
        values[flag.owner][flag.field] = flag.value(given[flag.field])
    return CacheSpec(**values[CacheSpec]), RunOptions(**values[RunOptions])


@click.command()
@click.argument("inputs", nargs=-1, required=True)
@click.option(
    "--out",
    "-o",
    required=True,
    type=click.Path(file_okay=False),
    help="Cache directory, or an fsspec URL (s3://bucket/prefix) to build in --staging-dir and upload there.",
)
@stacked([flag.option() for flag in FLAGS])
def build(inputs: tuple[str, ...], out: str, **given: Any) -> None:
    """Tokenize INPUTS (files, directories, globs, URLs) into a token cache in --out.

    Rerunning the same command after an interruption resumes where it stopped.
    """
    try:
        spec, run = options_from_flags(given)
    except OptionsError as e:
        raise click.UsageError(in_cli_terms(str(e))) from None
    summary = build_cache(list(inputs), out, spec=spec, run=run)
    done, partial = summary.units_already_done, summary.units_resumed
    resumed = f" (resumed: {done} units already done, {partial} partial)" if done or partial else ""
    shards = f"{summary.num_shards} shard{'' if summary.num_shards == 1 else 's'}"
    click.echo(
        f"built {summary.out}: {summary.num_docs:,} documents, {summary.num_tokens:,} tokens in {shards}, "
        f"{summary.seconds:.1f} s{resumed}"
    )
    if summary.tokenizer_engine:
        click.echo(f"tokenizer engine: {summary.tokenizer_engine}")
    if summary.skipped_records:
        click.echo(f"skipped {_counted(summary.skipped_records, 'bad record')} (--on-bad-record skip)")
    if summary.empty_docs:
        click.echo(f"left out {_counted(summary.empty_docs, 'empty or whitespace-only document')}")
    if summary.inexact_cuts:
        click.echo(
            f"note: {summary.inexact_cuts:,} cuts of very long documents may have changed the tokens next to "
            "them (see `streampack info`)"
        )
    if run.profile:
        click.echo(render_timings(summary.timings, summary.seconds, summary.workers))


def _counted(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


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

"""Options several commands share: what ``streampack.open`` may be told that another format's token files
do not say (:class:`streampack.reader.foreign.opening.ForeignOptions`), under its keywords' names; and the old
names of renamed flags, kept working."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import click

from streampack.reader.foreign.opening import READERS

F = TypeVar("F", bound=Callable[..., Any])
#: The formats streampack reads.
SOURCE_FORMATS = list(READERS)
SOURCE_DTYPES = ["uint16", "uint32"]


def old_flag(old: str, new: str, name: str, **kwargs: Any) -> Callable[[F], F]:
    """A hidden option ``old``, the name a flag had before it became ``new``: scripts that use it keep
    working, with a one-line warning naming ``new``. Its value goes to the parameter ``name``."""

    def warn(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is not None:
            click.echo(f"warning: {old} is deprecated; use {new}", err=True)
        return value

    return click.option(old, name, hidden=True, callback=warn, **kwargs)


def source_options(*, loose: bool = False) -> Callable[[F], F]:
    """The options that tell ``streampack.open`` what another format's files do not say.

    Args:
        loose: take any ``--format`` and ``--dtype`` (``open`` checks them): ``export`` reads its old
            spellings, where they named what it writes.
    """
    formats = None if loose else click.Choice(SOURCE_FORMATS)
    dtypes = None if loose else click.Choice(SOURCE_DTYPES)
    options = [
        click.option("--format", "source_format", type=formats,
                     help="Source: the format of its files (recognised from them by default)."),
        old_flag("--from", "--format", "old_from", type=click.Choice(SOURCE_FORMATS)),
        click.option("--eos-id", type=int, help="Source: the id that ends every document (nanoGPT, OLMo)."),
        click.option("--bos-id", type=int, help="Source: the id that starts every document (llm.c's)."),
        click.option("--dtype", "source_dtype", type=dtypes,
                     help="Source: the token dtype of headerless files (nanoGPT, OLMo): uint16 or uint32."),
        old_flag("--token-dtype", "--dtype", "old_token_dtype", type=click.Choice(SOURCE_DTYPES)),
        click.option("--tokenizer", help="Source: the tokenizer its ids are of (mixtures check it)."),
        click.option("--vocab-size", type=int, help="Source: every id is below it."),
    ]  # fmt: skip

    return stacked(options)


def stacked(options: Sequence[Callable[[F], F]]) -> Callable[[F], F]:
    """One decorator of click ``options``, which ``--help`` lists in their order."""

    def decorate(command: F) -> F:
        for option in reversed(options):  # click lists the decorator applied last first
            command = option(command)
        return command

    return decorate


def declared(given: Mapping[str, Any]) -> dict[str, Any]:
    """The keywords of ``streampack.open`` that the source options (by parameter name) gave."""
    named = {
        "format": given["source_format"] or given["old_from"],
        "dtype": given["source_dtype"] or given["old_token_dtype"],
        **{key: given[key] for key in ("eos_id", "bos_id", "tokenizer", "vocab_size")},
    }
    return {key: value for key, value in named.items() if value is not None}

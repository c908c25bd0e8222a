"""The options of the commands that read another format's token files: what ``streampack.open`` may be
told that those files do not say (:class:`streampack.interop.reading.ForeignOptions`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from streampack.interop.reading import READERS

F = TypeVar("F", bound=Callable[..., Any])
#: The formats streampack reads.
SOURCE_FORMATS = list(READERS)


def source_options(command: F) -> F:
    """The options that tell ``streampack.open`` what another format's files do not say."""
    options = [
        click.option("--from", "source_format", type=click.Choice(SOURCE_FORMATS),
                     help="The format of the source's files (recognised from them by default)."),
        click.option("--eos-id", type=int, help="Source: the id that ends every document (nanoGPT, OLMo)."),
        click.option("--bos-id", type=int, help="Source: the id that starts every document (llm.c's)."),
        click.option("--token-dtype", type=click.Choice(["uint16", "uint32"]),
                     help="Source: the token dtype of headerless files (nanoGPT, OLMo)."),
        click.option("--tokenizer", help="Source: the tokenizer its ids are of (mixtures check it)."),
        click.option("--vocab-size", type=int, help="Source: every id is below it."),
    ]  # fmt: skip
    for option in reversed(options):
        command = option(command)
    return command


def declared(
    source_format: str | None,
    eos_id: int | None,
    bos_id: int | None,
    token_dtype: str | None,
    tokenizer: str | None,
    vocab_size: int | None,
) -> dict[str, Any]:
    """The keywords of ``streampack.open`` the source options gave."""
    given = {"format": source_format, "eos_id": eos_id, "bos_id": bos_id, "dtype": token_dtype}
    given.update(tokenizer=tokenizer, vocab_size=vocab_size)
    return {key: value for key, value in given.items() if value is not None}

"""The ``streampack`` command line.

A user error prints one line on stderr (no traceback) and exits 1; streampack's warnings print one
``warning:`` line; an interrupted command (Ctrl-C, SIGTERM) says how to resume and exits 130 (143).
"""

from __future__ import annotations

import errno
import functools
import signal
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TextIO

import click

from streampack.cli import audit, build, demo, export, inspect, training
from streampack.cli.build import in_cli_terms
from streampack.cli.inspect import cache_stats
from streampack.errors import DocumentBoundaryWarning, StreampackError
from streampack.store import disk_error

__all__ = ["INTERRUPTED", "SIGTERM_STATUS", "cache_stats", "cli", "main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="streampack")
def cli() -> None:
    """Tokenize a corpus into an on-disk token cache, and inspect it."""


for _command in (
    build.build,
    inspect.info,
    inspect.verify,
    inspect.upgrade,
    inspect.decode,
    export.export,
    export.convert,
    training.bench,
    training.mix,
    training.which,
    audit.audit,
    demo.demo,
):
    cli.add_command(_command)


INTERRUPTED = "interrupted; rerun the same command to resume"
SIGTERM_STATUS = 128 + signal.SIGTERM  # what a shell reports for a process that SIGTERM ended: 143


def main() -> None:
    """Console-script entry point.

    SIGTERM (how Slurm, Kubernetes and ``kill`` stop a job) stops a command as Ctrl-C does: it unwinds, so
    a build stops its workers, releases its lock and leaves no shared memory behind.
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
    with warnings.catch_warnings():  # (restores showwarning after the command)
        warnings.showwarning = functools.partial(_show_warning, warnings.showwarning)
        try:
            cli.main(standalone_mode=False)
        except (click.exceptions.Abort, KeyboardInterrupt):
            return 130, INTERRUPTED
        except click.ClickException as e:
            e.show()
            return e.exit_code, ""
        except StreampackError as e:
            return 1, f"error: {in_cli_terms(str(e))}"
        except OSError as e:  # not turned into a StreampackError: still one line, with the file
            if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                message = str(disk_error(e, Path(e.filename or "?")))
            else:
                message = f"{e.filename or 'I/O'}: {e.strerror or e}"
            return 1, f"error: {message}"
        return 0, ""


def _show_warning(
    python: Callable[..., object],
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """Print streampack's warnings as one ``warning:`` line, in the CLI's terms; others as ``python`` does."""
    if issubclass(category, DocumentBoundaryWarning):
        click.echo(f"warning: {in_cli_terms(str(message))}", err=True)
    else:
        python(message, category, filename, lineno, file, line)

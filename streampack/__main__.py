"""The ``streampack`` command (and ``python -m streampack``): it keeps numpy's BLAS threads from starting
(:mod:`streampack._blas`), starts what a build will first wait on, then imports and runs the command line
(:mod:`streampack.cli`)."""

from __future__ import annotations

import sys

from streampack._blas import no_blas_threads


def main() -> None:
    """Console-script entry point: numpy's BLAS threads kept from starting; for a ``build`` of a
    ``tokenizer.json`` (or of cl100k/o200k-pattern ranks), fastokens begins to load it on a thread of its own
    (:mod:`streampack.tokenizer.preload`) while the command line is imported (~0.25 s on the main thread);
    then the command runs as :func:`streampack.cli.main` runs it."""
    no_blas_threads()
    named = build_tokenizer_named(sys.argv[1:])
    if named is not None:
        from streampack.tokenizer import preload

        preload.start(*named)
    from streampack.cli import main as run

    run()


def build_tokenizer_named(args: list[str]) -> tuple[str, str] | None:
    """The ``--tokenizer`` and ``--tokenizer-engine`` of a ``build`` command line; None for any other
    command line. A guess from the words alone, before the options are parsed: a wrong one costs a load that
    is never taken."""
    if not args or args[0] != "build" or {"-h", "--help"} & set(args):
        return None
    options = dict(_option_values(args[1:]))
    tokenizer = options.get("--tokenizer", options.get("-t"))
    return None if tokenizer is None else (tokenizer, options.get("--tokenizer-engine", "auto"))


def _option_values(args: list[str]) -> list[tuple[str, str]]:
    """(option, value) for each ``--name value``, ``--name=value`` and ``-t value`` in ``args``."""
    pairs = []
    for i, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if equals and name.startswith("--"):
            pairs.append((name, value))
        elif arg.startswith("-") and i + 1 < len(args):
            pairs.append((arg, args[i + 1]))
    return pairs


if __name__ == "__main__":
    main()

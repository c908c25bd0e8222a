"""``python -m streampack.cli``: the ``streampack`` command."""

from streampack.cli import main

main()

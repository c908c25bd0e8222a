"""``python -m streampack.cli``: the ``streampack`` command, as ``python -m streampack`` runs it but for the
early load of a build's tokenizer (:mod:`streampack.__main__`), which this package's imports come before."""

from streampack.cli import main

main()

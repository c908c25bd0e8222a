"""``python -m streampack.cli``: the ``streampack`` command, without the early tokenizer load."""

from streampack.cli import main

main()

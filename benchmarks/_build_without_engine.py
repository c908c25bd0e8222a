"""``streampack`` with the fast engine's work taken out: a diagnostic row of ``bench_build.py``.

Runs the ``streampack`` command (its console script's start-up included) as given
(``python _build_without_engine.py build ... --verify-tokens none``), with ``fastokens``' batch call
replaced by one that encodes nothing: each text gets ``len(text) // 3`` ids of 0 (about the tokens a GPT-2
text makes: the benchmark corpus's 345 MB are 115 M tokens), views of one buffer of zeros made once.
Everything else a build does runs as it does: the tokenizer's load, reading, parsing, cutting, framing,
writing, committing. What such a build costs is what the build's own work costs beside the engine's; the
ids are wrong, so its sampled check is left out (``--verify-tokens none``) and its cache is thrown away.
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np

from streampack.__main__ import main
from streampack.tokenizer import engines

_ZEROS = np.zeros(64 << 20, dtype=np.uint32)  # more ids than any batch of 1 MiB of text gets


def _encode_nothing(self: engines.FastokensEngine, texts: list[str]) -> engines.FlatIds:
    lengths = np.fromiter((len(t) // 3 for t in texts), dtype=np.intp, count=len(texts))
    offsets = np.zeros(len(texts) + 1, dtype=np.intp)
    np.cumsum(lengths, out=offsets[1:])
    return _ZEROS[: offsets[-1]], offsets


if __name__ == "__main__":
    # a build that ran another engine, or a renamed call left in place, would measure the engine after all
    if importlib.util.find_spec("fastokens") is None or not hasattr(engines.FastokensEngine, "encode_flat"):
        sys.exit("_build_without_engine.py: fastokens is not installed, or its engine has no encode_flat")
    engines.FastokensEngine.encode_flat = _encode_nothing  # type: ignore[method-assign]
    sys.argv = ["streampack", *sys.argv[1:]]
    main()

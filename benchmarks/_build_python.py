"""Worker: ``streampack.build`` of a Hugging Face dataset saved with ``save_to_disk``, as a user runs it.

``datasets.load_from_disk(DIR)`` (memory-mapped Arrow), then ``streampack.build(dataset, OUT,
tokenizer=T, overwrite=True, profile=True)``: the dataset is read by index ranges of the ``Dataset``
(:mod:`streampack.inputs.python`). Prints one JSON line: ``num_tokens``, ``seconds`` (the build's own),
``load_s`` (``load_from_disk``), ``engines`` (the manifest's) and ``stages`` (the build's stage table,
markdown lines, as ``build --profile`` prints it).

Usage: ``python benchmarks/_build_python.py --dataset DIR --tokenizer T --out DIR``
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", required=True, help="a folder written by Dataset.save_to_disk")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import datasets

    import streampack

    start = time.perf_counter()
    dataset = datasets.load_from_disk(args.dataset)
    load_s = time.perf_counter() - start
    summary = streampack.build(dataset, args.out, tokenizer=args.tokenizer, overwrite=True, profile=True)
    stages: list[str] = []
    try:  # the table `build --profile` prints; only a report detail, so a moved module costs just that
        from streampack.builder.timings import render

        stages = render(summary.timings, summary.seconds, summary.workers).splitlines()
    except ImportError:
        pass
    manifest = json.loads((Path(args.out) / "manifest.json").read_text())
    print(
        json.dumps(
            {
                "num_tokens": summary.num_tokens,
                "seconds": summary.seconds,
                "load_s": load_s,
                "engines": manifest.get("engines", []),
                "stages": stages,
            }
        )
    )


if __name__ == "__main__":
    main()

"""``streampack demo``: the whole flow on text every Python install ships, its own standard library."""

from __future__ import annotations

import itertools
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import click
import numpy as np

from streampack.builder.coordinator import build
from streampack.cli.inspect import cache_stats
from streampack.inputs.records import Documents
from streampack.reader import open as open_cache

DEMO_SEQ_LEN = 256
DEMO_BATCH = 8


@click.command()
@click.option(
    "--out",
    "-o",
    default="demo-cache",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Cache directory to build (a demo cache already there is replaced).",
)
@click.option("--workers", "-j", type=click.IntRange(min=1), help="Worker processes [default: cores].")
def demo(out: str, workers: int | None) -> None:
    """Build a cache from this Python's own standard library sources with the bytes tokenizer, show it."""
    run_demo(Path(out), workers=workers)


def stdlib_sources() -> list[Path]:
    """The standard library's top-level ``.py`` files: a few MB of real text on every machine."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def _texts(paths: list[Path]) -> Iterator[dict[str, str]]:
    for path in paths:
        yield {"text": path.read_text(encoding="utf-8", errors="replace"), "path": path.name}


def run_demo(out: Path, *, workers: int | None = None) -> None:
    """Build ``out`` from the standard library with the bytes tokenizer, print its info and a few batches."""
    paths = stdlib_sources()
    click.echo(f"building {out} from {len(paths)} standard-library files with the 'bytes' tokenizer")
    summary = build(Documents(_texts(paths)), out, tokenizer="bytes", workers=workers, overwrite=True)
    click.echo(
        f"built {summary.num_docs:,} documents, {summary.num_tokens:,} tokens in {summary.seconds:.1f} s\n"
    )
    cache = open_cache(out)
    for key, value in cache_stats(cache).items():
        click.echo(f"  {key:<16} {value}")
    click.echo(f"\nfirst {DEMO_BATCH}-row batches of {DEMO_SEQ_LEN}-token packed sequences:")
    batches = _demo_batches(cache)
    for step, batch in enumerate(batches):
        preview = bytes(int(t) for t in batch[0, :48] if t < 256).decode("utf-8", "replace")
        click.echo(f"  batch {step}: shape {batch.shape}, row 0 starts {preview!r}")


def _demo_batches(cache: object) -> list[np.ndarray]:
    from streampack.loader import Loader

    loader = Loader(cache.sequences(DEMO_SEQ_LEN), batch_size=DEMO_BATCH, seed=0)  # type: ignore[attr-defined]
    return list(itertools.islice(loader, 3))

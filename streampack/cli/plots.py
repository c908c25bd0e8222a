"""The pictures of ``streampack audit --plot`` and ``mix --plot``, drawn into a PNG with matplotlib."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import numpy as np

from streampack.errors import extra_needed

__all__ = ["plot_audit", "plot_mix", "plot_option"]

_POINTS = 200  # positions sampled per curve: the order is pure, any position costs the same


def plot_option(what: str) -> Callable[[Any], Any]:
    """The ``--plot FILE.png`` option of a command that draws ``what``."""
    return click.option(
        "--plot", "plot_path", type=click.Path(dir_okay=False), help=f"Also draw {what} into this PNG."
    )


def _pyplot() -> Any:
    with extra_needed("--plot", "matplotlib", "plot"):
        import matplotlib

        matplotlib.use("Agg")  # a file, never a window: this runs in terminals and on clusters
        import matplotlib.pyplot as plt
    return plt


def plot_audit(report: Any, loaders: list[Any], path: str | Path) -> None:
    """Draw coverage per source and epoch, and each source's cursor over the run's steps with the resumes
    marked, into ``path``; ``loaders`` are those of the report's legs."""
    plt = _pyplot()
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8))
    for source in report.sources:
        for leg, loader in zip(report.legs, loaders, strict=True):
            if source.name not in loader.order.names:
                continue
            j = loader.order.names.index(source.name)
            start, stop = leg.positions
            positions = np.unique(np.linspace(start, stop, _POINTS).astype(np.int64))
            cursors = [loader.order.consumed(int(p))[j] / max(source.size, 1) for p in positions]
            steps = leg.steps[0] + (positions - start) / leg.stride
            top.plot(steps, cursors, color=f"C{report.sources.index(source)}",
                     label=source.name if leg.index == 0 else None)  # fmt: skip
    for leg in report.legs[1:]:
        top.axvline(leg.steps[0], color="grey", linestyle="--", linewidth=0.8)
    top.set_xlabel("trainer step (dashed: resumes)")
    top.set_ylabel("epochs served (cursor / samples per epoch)")
    top.legend()
    labels, once, twice, skipped = [], [], [], []
    for source in report.sources:
        for epoch, (o, t, s) in enumerate(source.coverage):
            labels.append(f"{source.name}\nepoch {epoch}")
            size = max(source.size, 1)
            once.append(o / size)
            twice.append(t / size)
            skipped.append(s / size)
    x = np.arange(len(labels))
    bottom.bar(x, once, label="served once", color="C2")
    bottom.bar(x, twice, bottom=once, label="served twice", color="C3")
    bottom.bar(x, skipped, bottom=np.add(once, twice), label="skipped", color="C7")
    bottom.set_xticks(x, labels, fontsize=7)
    bottom.set_ylabel("share of the epoch's samples")
    bottom.legend()
    verdict = "clean" if report.clean else f"NOT clean ({len(report.findings)} findings)"
    figure.suptitle(f"streampack audit: {verdict}")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def plot_mix(loader: Any, end: int, path: str | Path) -> None:
    """Draw each source's weight in force and realised share over the positions ``[0, end]`` of a mixture's
    run into ``path``."""
    plt = _pyplot()
    order = loader.order
    batch = loader.options.batch_size
    positions = np.unique(np.linspace(1, max(end, 1), _POINTS).astype(np.int64))
    weights = np.array([order.weights(int(p)) for p in positions])
    shares = np.array([np.array(order.consumed(int(p))) / p for p in positions])
    figure, axes = plt.subplots(figsize=(10, 5))
    steps = positions / batch
    for j, name in enumerate(order.names):
        axes.plot(steps, weights[:, j], color=f"C{j}", linestyle="--", label=f"{name} weight")
        axes.plot(steps, shares[:, j], color=f"C{j}", label=f"{name} realised")
    axes.set_xlabel(f"step (global batch {batch})")
    axes.set_ylabel("share of the stream")
    axes.legend()
    figure.suptitle("streampack mix: weights in force (dashed) and realised shares")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)

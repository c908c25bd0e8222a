"""``streampack bench``, ``mix`` and ``which``: a run's loader, timed, planned and traced to input lines."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import time
from pathlib import Path
from typing import Any

import click

from streampack.cli.plots import plot_option
from streampack.cli.sources import declared, old_flag, source_options
from streampack.errors import StreampackError
from streampack.reader import open as open_cache

_SHUFFLE_BLOCK = click.option(
    "--shuffle-block",
    type=click.IntRange(min=1),
    help="Block-shuffle: samples per block of consecutive samples [default: 4096 with --shuffle-window].",
)
_SHUFFLE_WINDOW = click.option(
    "--shuffle-window",
    type=click.IntRange(min=1),
    help="Block-shuffle: blocks shuffled together [default: 32 with --shuffle-block].",
)


def _shuffle(no_shuffle: bool, block: int | None, window: int | None) -> Any:
    """The ``shuffle=`` of the loader options given on the command line."""
    from streampack.order.blockshuffle import BlockShuffle

    if block is None and window is None:
        return not no_shuffle
    if no_shuffle:
        raise click.UsageError("--no-shuffle reads in stream order: give it without --shuffle-block/-window")
    given = {"block": block, "window": window}
    return BlockShuffle(**{key: value for key, value in given.items() if value is not None})


@click.command()
@click.argument("cache_dir", type=click.Path())
@click.option("--seq-len", type=click.IntRange(min=1), required=True, help="Tokens per sample.")
@click.option("--batch-size", type=click.IntRange(min=1), required=True, help="Global batch size.")
@click.option(
    "--loader-workers",
    type=click.IntRange(min=0),
    help="DataLoader worker processes (torch) [default: 0, the loader alone].",
)
@old_flag("--workers", "--loader-workers", "old_workers", type=click.IntRange(min=0))
@click.option("--steps", type=click.IntRange(min=1), default=200, show_default=True, help="Batches to time.")
@click.option("--seed", type=int, default=0, show_default=True, help="Shuffle seed.")
@_SHUFFLE_BLOCK
@_SHUFFLE_WINDOW
@click.option(
    "--layout",
    type=click.Choice(["windows", "packed", "documents"]),
    default="windows",
    show_default=True,
    help="Samples: fixed windows (+1 token of overlap), whole documents packed best-fit, or one per sample.",
)
def bench(
    cache_dir: str,
    seq_len: int,
    batch_size: int,
    loader_workers: int | None,
    old_workers: int | None,
    steps: int,
    seed: int,
    shuffle_block: int | None,
    shuffle_window: int | None,
    layout: str,
) -> None:
    """Time the shuffled loader on CACHE_DIR: samples/s, tokens/s and memory per process.

    With --loader-workers N the batches go through streampack.torch.DataLoader (needs the torch extra).
    """
    from streampack.loader import Loader

    workers = loader_workers if loader_workers is not None else old_workers or 0

    cache = open_cache(cache_dir)
    try:
        samples = (
            cache.sequences(seq_len, overlap=1) if layout == "windows" else getattr(cache, layout)(seq_len)
        )
        shuffle = _shuffle(False, shuffle_block, shuffle_window)
        loader = Loader(samples, batch_size=batch_size, seed=seed, shuffle=shuffle)
    except ValueError as e:
        raise StreampackError(str(e)) from None
    batches: Any = loader
    if workers:
        try:
            from streampack.torch import DataLoader
        except ImportError as e:
            raise StreampackError(str(e)) from None
        batches = DataLoader(loader, num_workers=workers, persistent_workers=True)
    batches = iter(batches)
    start = time.perf_counter()
    next(batches)
    first, start = time.perf_counter() - start, time.perf_counter()
    rows = sum(len(next(batches)) for _ in range(steps))
    rate = rows / (time.perf_counter() - start)
    click.echo(f"cache       {cache.root} ({cache.num_tokens:,} tokens, {cache.dtype.name})")
    shape = f"seq_len {seq_len}+1" if layout == "windows" else f"{layout}, seq_len {seq_len}"
    if samples.pad_id is not None:
        shape += f", {samples.layout.padding:.1%} padding"  # type: ignore[union-attr]
    how = "shuffled" if shuffle is True else f"block-shuffled ({shuffle.block} x {shuffle.window})"
    click.echo(f"loader      {shape}, global batch {batch_size}, {how}, {workers} workers")
    click.echo(f"first batch {first:.3f} s")
    click.echo(f"throughput  {rate:,.0f} samples/s, {rate * seq_len / 1e6:,.2f} M tokens/s ({steps} batches)")
    children = " / ".join(_rss_anon(child.pid) for child in multiprocessing.active_children())
    click.echo(f"memory      RssAnon main {_rss_anon('self')}; workers {children or 'none'}")


def _rss_anon(pid: int | str | None) -> str:
    """Anonymous resident memory of a process (``RssAnon``: not the page cache of mapped files)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return f"{int(line.split()[1]) / 1024:.1f} MB"
    except OSError:
        pass
    return "n/a"


@click.command()
@click.option(
    "--config", "config_path", required=True, type=click.Path(dir_okay=False), help="Mixture YAML or JSON."
)
@click.option(
    "--steps", type=click.IntRange(min=0), default=0, show_default=True, help="Batches to look ahead."
)
@click.option("--batch-size", type=click.IntRange(min=1), help="Global batch size (needed with --steps).")
@click.option(
    "--state", "state_path", type=click.Path(dir_okay=False), help="Start from a loader state (JSON)."
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@plot_option("the weights in force and realised shares over the run's steps")
def mix(
    config_path: str,
    steps: int,
    batch_size: int | None,
    state_path: str | None,
    as_json: bool,
    plot_path: str | None,
) -> None:
    """Show a mixture's plan: per source, its weight, realised share and epoch after --steps batches.

    Nothing is read but the caches' manifests: the proportions come from the order alone, exactly, also
    far ahead. With --state, from where a saved loader state (Loader.state_dict() as JSON) stands, with the
    config's weights after it: the plan of a run resumed with this config.

    The config's keys (unknown ones are refused; docs/guide/mixtures.md describes each): seq_len,
    sources, weights or stages, layout, overlap, seed, shuffle, block_size, stop, exclude, and for caches
    in object storage local_dir, max_local_bytes, storage_options. A source is a cache directory, a URL
    (s3://bucket/prefix) or {path: ..., follow: true, exclude: ..., ...}. For example:

    \b
        seq_len: 2048
        seed: 0
        sources:
          web: caches/web
          code: s3://bucket/code
        stages:
          - {at: 0, weights: {web: 0.9, code: 0.1}}
          - {at: {tokens: 2.0e+10}, weights: {web: 0.7, code: 0.3}}
    """
    from streampack.loader import Loader
    from streampack.runs.mixconfig import load_mixture

    if steps and batch_size is None:
        raise click.UsageError("--steps needs --batch-size: the batches' size decides how far they reach")
    mixture = load_mixture(config_path)
    loader = Loader(mixture, batch_size=batch_size or 1)
    if state_path is not None:
        loader.load_state_dict(_read_state(state_path))
    from streampack.order import MAX_POSITION

    position = min(loader.position + steps * (batch_size or 1), MAX_POSITION)  # as realised() counts
    if loader.order.end is not None:
        position = min(position, loader.order.end)
    report = loader.realised(steps)
    if plot_path is not None:
        from streampack.cli.plots import plot_mix

        plot_mix(loader, position, plot_path)
    if as_json:
        rows = [vars(progress) for progress in report]
        click.echo(json.dumps({"position": position, "end": loader.order.end, "sources": rows}, indent=2))
        return
    seq_len = getattr(next(iter(mixture.sources.values())), "seq_len", None)
    tokens = f" ({position * seq_len:,} tokens)" if seq_len else ""
    ends = "never (each source wraps)" if loader.order.end is None else f"at position {loader.order.end:,}"
    click.echo(
        f"mixture     {config_path}: {len(report)} sources, blocks of {mixture.block_size:,}, ends {ends}"
    )
    click.echo(f"position    {position:,} samples{tokens}")
    for first, counts in loader.order.fingerprint()["schedule"]:
        shares = ", ".join(f"{name} {count / mixture.block_size:.4g}" for name, count in counts.items())
        click.echo(f"from        position {first * mixture.block_size:,}: {shares}")
    click.echo(f"{'source':<16} {'weight':>8} {'served':>14} {'share':>8} {'samples':>14} {'epoch':>9}")
    for p in report:
        click.echo(
            f"{p.name:<16} {p.weight:>8.4f} {p.served:>14,} {p.share:>8.4f} {p.size:>14,} {p.epoch:>9.3f}"
        )


@click.command()
@click.argument("data", type=click.Path())
@click.option(
    "--seq-len",
    type=click.IntRange(min=1),
    help="Tokens per sample (a mixture config sets its own: give none, or the same).",
)
@click.option(
    "--overlap", type=click.IntRange(min=0), help="Extra tokens per sample, as trained with [default: 0]."
)
@click.option("--batch-size", type=click.IntRange(min=1), help="Global batch size [default: the state's].")
@click.option(
    "--seed", type=int, help="Shuffle seed of the run [default: 0; a mixture config sets its own, as above]."
)
@click.option(
    "--no-shuffle",
    is_flag=True,
    help="The run read samples in stream order (a mixture config sets its own shuffle, as above).",
)
@_SHUFFLE_BLOCK
@_SHUFFLE_WINDOW
@click.option(
    "--world-size",
    type=click.IntRange(min=1),
    help="Ranks of the run, to say which rank read each row [default: the state's, else 1].",
)
@click.option(
    "--step",
    type=click.IntRange(min=0),
    help="The global batch, counted from the start of the run (or of --state); with gradient accumulation "
    "of k batches, trainer step S read batches S*k to S*k+k-1.",
)
@click.option(
    "--state",
    "state_path",
    type=click.Path(dir_okay=False),
    help="A saved loader state (JSON): the batch a run resumed from it serves first (--step N: N later).",
)
@click.option(
    "--exclude",
    "exclude_path",
    type=click.Path(dir_okay=False),
    help="A YAML/JSON file whose exclude: list the run was given (a mixture config's own is read too).",
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@source_options()
def which(
    data: str,
    seq_len: int | None,
    overlap: int | None,
    batch_size: int | None,
    seed: int | None,
    no_shuffle: bool,
    shuffle_block: int | None,
    shuffle_window: int | None,
    world_size: int | None,
    step: int | None,
    state_path: str | None,
    exclude_path: str | None,
    as_json: bool,
    **source: Any,
) -> None:
    """Print the documents of one step's batch with their input file and line.

    DATA is a cache directory, or a mixture config (YAML or JSON). Nothing needs to have been logged:
    the batch is recomputed from the run's settings (those of its Loader), and each document's line is
    found by reading its part of the inputs again, which must be where and as they were at build time.
    DATA may hold another format's token files: each document is then named by its file and its index
    there (Megatron's IndexedDataset[i], the i-th document of a .ds...).

    With the run's exclusions (a mixture config's exclude:, --exclude FILE), a document one names is
    marked "excluded (mask)" (served with no loss) or "excluded (skip from position P)" (served before it
    took effect), and a step whose positions one skips or masks says so.
    """
    from streampack.loader import Loader
    from streampack.runs.mixconfig import is_config, load_mixture, mixture_exclusions
    from streampack.runs.provenance import excluded_steps, position_of
    from streampack.runs.provenance import which as find

    if step is None and state_path is None:
        raise click.UsageError("give --step N (from the start of the run), --state FILE, or both")
    state = _read_state(state_path) if state_path is not None else None
    batch_size = batch_size or (state or {}).get("batch_size")
    if not isinstance(batch_size, int):
        raise click.UsageError("give --batch-size B: the global batch size of the run")
    world_size = world_size or (state or {}).get("world_size") or 1
    shuffle = (no_shuffle, shuffle_block, shuffle_window)
    mixed = is_config(data)
    if mixed:
        dataset: Any = load_mixture(data)
        _check_agrees_with_config(data, dataset, seq_len, overlap, seed, shuffle)
        options: dict[str, Any] = {"exclude": mixture_exclusions(data)}
    else:
        if seq_len is None:
            raise click.UsageError("give --seq-len L: the tokens per sample of the run")
        dataset = open_cache(data, **declared(source)).sequences(seq_len, overlap=overlap or 0)
        options = {"exclude": [], "seed": seed or 0, "shuffle": _shuffle(*shuffle)}
    if exclude_path is not None:
        options["exclude"] += mixture_exclusions(exclude_path)
    if any(entry.mode == "mask" for entry in options["exclude"]):
        options["output"] = "dict"  # mask mode has labels to mask
    try:
        loader = Loader(dataset, batch_size=batch_size, world_size=world_size, **options)
    except ValueError as e:
        raise StreampackError(str(e)) from None
    position = position_of(loader, step, state=state)
    docs = find(loader, step, state=state)
    notes = excluded_steps(loader, step, state=state)
    # A step from the state's position on is of its last leg: the loss weights its last resume recorded.
    loss_weights = ((state or {}).get("history") or [{}])[-1].get("loss_weights")
    if as_json:
        rows = [{**dataclasses.asdict(doc), "location": doc.location, "tokens": doc.tokens} for doc in docs]
        shown = {"position": position, "documents": rows, "excluded": notes, "loss_weights": loss_weights}
        click.echo(json.dumps(shown, indent=2))
        return
    rows_count = sum(len(doc.placements) for doc in docs)
    click.echo(
        f"position {position:,}: {len(docs)} documents in {rows_count} runs of tokens, batch of "
        f"{batch_size} over {world_size} rank{'s' if world_size > 1 else ''}"
    )
    for note in notes:
        click.echo(f"excluded: {note}")
    if loss_weights is not None:
        from streampack.runs.audit import describe_loss_weights

        click.echo(
            f"loss weights: {describe_loss_weights(loss_weights)} (the state's, as its last resume gave them)"
        )
    accumulated = int(((state or {}).get("history") or [{}])[-1].get("batches_per_step", 1))
    if accumulated > 1 and step is not None:
        click.echo(
            f"note: the trainer took {accumulated} batches a step: --step counts batches, so this is "
            f"batch {step % accumulated + 1} of {accumulated} of trainer step {step // accumulated:,} "
            "after the state's"
        )
    heading = f"{'source':<12} " if mixed else ""
    click.echo(f"{heading}{'doc':>10} {'tokens':>7}  {'rank:row[columns]':<24} location")
    for doc in docs:
        placed = " ".join(f"{p.rank}:{p.row}[{p.columns[0]}:{p.columns[1]}]" for p in doc.placements)
        name = f"{doc.source:<12} " if mixed else ""
        mark = f"  excluded ({doc.excluded})" if doc.excluded else ""
        click.echo(f"{name}{doc.doc:>10} {doc.tokens:>7}  {placed:<24} {doc.location}{mark}")


def _read_state(path: str) -> dict[str, Any]:
    from streampack.runs.audit import read_state_file

    return dict(read_state_file(path))


def _check_agrees_with_config(
    path: str,
    mixture: Any,
    seq_len: int | None,
    overlap: int | None,
    seed: int | None,
    shuffle: tuple[bool, int | None, int | None],
) -> None:
    """Refuse run settings on the command line that contradict the mixture config's own (the same values
    given again are accepted)."""
    from streampack.order.blockshuffle import shuffle_fingerprint

    first = next(iter(mixture.sources.values()))
    checks: list[tuple[str, object, object, str]] = [
        (f"--seq-len {seq_len}", seq_len, getattr(first, "seq_len", None), "seq_len"),
        (f"--overlap {overlap}", overlap, getattr(first, "overlap", 0), "overlap"),
        (f"--seed {seed}", seed, mixture.seed, "seed"),
    ]
    no_shuffle, block, window = shuffle
    if no_shuffle or block is not None or window is not None:
        flags = [f"--shuffle-{key} {value}" for key, value in (("block", block), ("window", window)) if value]
        given = shuffle_fingerprint(_shuffle(no_shuffle, block, window))
        own = shuffle_fingerprint(mixture.shuffle)
        checks.append((" ".join(flags) if flags else "--no-shuffle", given, own, "shuffle"))
    contradictions = [
        f"{flags} (the config has {key}: {_shown(own)})"
        for flags, given, own, key in checks
        if given is not None and given != own
    ]
    if contradictions:
        raise click.UsageError(
            f"{'; '.join(contradictions)}: the mixture config {path} sets these itself; leave the flags out "
            "(or give the config's values), or edit the config"
        )


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    return str(value)

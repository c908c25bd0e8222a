"""``streampack audit``: what a run saw, recomputed from its last loader state, with a verdict."""

from __future__ import annotations

import json
import sys

import click

from streampack.cli.plots import plot_option
from streampack.errors import StreampackError


@click.command()
@click.argument("state_path", metavar="STATE.json", type=click.Path(dir_okay=False))
@click.argument("data", type=click.Path())
@click.option("--seq-len", type=click.IntRange(min=1), help="Checked against the run's history (not needed).")
@click.option("--seed", type=int, help="Checked against the run's history (not needed).")
@click.option(
    "--exclude",
    "exclude_path",
    type=click.Path(dir_okay=False),
    help="A YAML/JSON file whose exclude: list is the run's exclusions [default: DATA's, for a mixture "
    "config].",
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@plot_option("coverage per source and epoch, resumes marked (the plot extra),")
def audit(
    state_path: str,
    data: str,
    seq_len: int | None,
    seed: int | None,
    exclude_path: str | None,
    as_json: bool,
    plot_path: str | None,
) -> None:
    """Recompute every sample a run consumed from its last loader state, and say whether each was served
    once within its epoch; exit 1 unless the run is clean.

    STATE.json is the run's last loader state (Loader.state_dict() as JSON, or streampack_loader.json of
    a streampack.hf checkpoint); its history says how each stretch between resumes was read. DATA is what
    the run read: a cache directory or a mixture config, as for `streampack which`. Nothing is read but
    the manifests: the samples come from the pure order, so a run of 10^6 steps takes seconds.

    A resume whose data state and model checkpoint are of different steps (the trainer's step is recorded
    by streampack.hf and streampack.lightning) shows as positions served twice or skipped, with the steps.

    A run with exclusions is audited with them re-applied where its history says they were in force (the
    state records their digests only): they come from the mixture config's exclude:, or --exclude FILE.
    """
    from streampack.runs.audit import audit as run_audit
    from streampack.runs.audit import leg_loaders, run_exclusions
    from streampack.runs.mixconfig import mixture_exclusions

    try:
        with open(state_path) as file:
            state = json.load(file)
    except (OSError, ValueError) as e:
        raise StreampackError(f"cannot read the loader state {state_path}: {e}") from None
    exclude = run_exclusions(data, None if exclude_path is None else mixture_exclusions(exclude_path))
    report = run_audit(state, data, seq_len=seq_len, seed=seed, exclude=exclude)
    if plot_path is not None:
        from streampack.cli.plots import plot_audit

        exclusions = state.get("exclusions") or []
        loaders = leg_loaders(state["history"], data, exclude, exclusions, order=state.get("order"))
        plot_audit(report, loaders, plot_path)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        click.echo(report.text())
    if not report.clean:
        sys.exit(1)

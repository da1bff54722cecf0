"""``autofit worker``: evaluate trials of a stored study, beside any number of other workers."""

from __future__ import annotations

import contextlib
import sys

import click

from autofit.cli.options import db_option, handle_errors, json_option
from autofit.report import console


@click.command()
@click.argument("study", required=False)
@click.option("--study", "-s", "study_option", default=None, hidden=True, help="STUDY, as earlier versions took it.")
@click.option(
    "--heartbeat",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="Seconds between a running trial's pings to the database.",
)
@click.option(
    "--grace",
    type=click.IntRange(min=2),
    default=60,
    show_default=True,
    help="Seconds of silence after which another worker takes a trial's worker for dead.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress output.")
@db_option
@json_option
@handle_errors
def worker(study, study_option, heartbeat, grace, quiet, db_url, as_json):
    """Join STUDY through the shared database and evaluate trials until its budget is spent.

    Start it on every node that should help (`autofit search ... --workers 0` creates the
    study). Workers share one Optuna study: no trial is run twice, none is lost, and the
    study ends with exactly its trial budget; a worker that dies mid-trial is noticed by the
    heartbeat and its trial is run again by another.
    """
    from autofit.search.loop import request_from_study, run_worker
    from autofit.store import Store

    if study is not None and study_option is not None and study != study_option:
        raise click.UsageError(f"two studies given, {study!r} and --study {study_option!r}: give one")
    study = study if study is not None else study_option
    if study is None:
        raise click.UsageError("give the study to join: autofit worker STUDY (its name or id: `autofit history`)")
    if grace <= heartbeat:
        raise click.ClickException(f"--grace ({grace}) must be longer than --heartbeat ({heartbeat})")
    store = Store(db_url)
    rec = store.get_study(study)
    term = console.terminal(stderr=True, quiet=quiet or as_json)
    progress = None if (quiet or as_json) else console.SearchProgress(term, request_from_study(rec))
    with progress if progress is not None else contextlib.nullcontext():  # closes the live display on Ctrl-C
        outcome = run_worker(store, rec.name, progress=progress, heartbeat=(heartbeat, grace))
    if as_json:
        click.echo(console.dumps(console.outcome_dict(outcome, [])))
    elif not quiet:
        term.print(
            f"worker done: study {outcome.study.name} is {outcome.study.status}; "
            f"{sum(outcome.counts().values())} results stored"
        )
    if outcome.interrupted:
        sys.exit(130)

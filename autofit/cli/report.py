"""``autofit report``: a self-contained HTML page (plots, tables, configs) of a stored study."""

from __future__ import annotations

import click

from autofit.cli.options import db_option, handle_errors, json_option
from autofit.report import console


@click.command(name="report")
@click.argument("study")
@click.option(
    "--out",
    default=None,
    metavar="DIR",
    help="Directory for report.html and the plots (PNG and SVG) [default: autofit-out/STUDY].",
)
@db_option
@json_option
@handle_errors
def report_cmd(study, out, db_url, as_json):
    """Write STUDY's report: report.html (opens offline) and its plots as PNG and SVG."""
    from autofit.report.html import write_report
    from autofit.store import Store
    from autofit.store.store import study_dir

    store = Store(db_url)
    rec = store.get_study(study)
    files = write_report(store, rec.id, out or study_dir(rec))
    if as_json:
        click.echo(console.dumps(files.as_dict()))
        return
    term = console.terminal(stderr=True)
    for note in files.notes:
        term.print(f"[yellow]note[/yellow]: {note}", highlight=False)
    click.echo(f"report: {files.html}")

"""The ``autofit`` command: thin click shells over the library.

Each command parses its options (``options.py`` holds the shared stacks), makes one
library call and hands the result to ``autofit.report.console`` to print; library errors
become one line and an exit code here, at the edge, and nowhere else. The top layer:
may import everything below it, and nothing in autofit imports it.
"""

from __future__ import annotations

import sys

import click

from autofit.cli.catalog import gpus, models
from autofit.cli.db import db
from autofit.cli.estimate import estimate
from autofit.cli.history import best, export_cmd, history, show
from autofit.cli.options import interrupted
from autofit.cli.report import report_cmd
from autofit.cli.search import search
from autofit.cli.worker import worker


class _Group(click.Group):
    """Usage errors as one line too (``Error: …``), like every other error of autofit."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as exc:
            click.echo(f"Error: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort as exc:
            if isinstance(exc.__cause__, KeyboardInterrupt):  # Ctrl-C outside a command's body
                interrupted()
            click.echo("Aborted.", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="autofit")
def cli() -> None:
    """Find the fastest LLM training plan that fits the GPUs you have."""


cli.add_command(search)
cli.add_command(worker)
cli.add_command(estimate)
cli.add_command(gpus)
cli.add_command(models)
cli.add_command(history)
cli.add_command(show)
cli.add_command(best)
cli.add_command(export_cmd)
cli.add_command(report_cmd)
cli.add_command(db)


def main() -> None:
    cli(prog_name="autofit")

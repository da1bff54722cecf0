"""``autofit gpus`` and ``autofit models``: the catalogs."""

from __future__ import annotations

import click

from autofit.cli.options import handle_errors, json_option
from autofit.report import console
from autofit.specs import GPUS, MODELS


@click.command()
@json_option
@handle_errors
def gpus(as_json: bool) -> None:
    """List the GPU catalog (dense peak rates from vendor datasheets)."""
    if as_json:
        click.echo(console.dumps([console.gpu_dict(g) for g in GPUS.values()]))
        return
    console.terminal().print(console.gpus_table(GPUS.values()))


@click.command()
@json_option
@handle_errors
def models(as_json: bool) -> None:
    """List the registered model architectures."""
    if as_json:
        click.echo(console.dumps([m.as_dict() for m in MODELS.values()]))
        return
    console.terminal().print(console.models_table(MODELS.values()))

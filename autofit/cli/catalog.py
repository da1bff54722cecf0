"""``autofit gpus`` and ``autofit models``: the catalogs."""

from __future__ import annotations

import click

from autofit.cli.options import handle_errors, json_option
from autofit.report import console
from autofit.specs import GPUS, MODELS


@click.command()
@click.option(
    "--custom",
    "custom",
    metavar="GPU",
    default=None,
    help="Show one GPU as --gpus reads it instead: a memory (24GiB) or a YAML spec's path (or a catalog name).",
)
@json_option
@handle_errors
def gpus(custom: str | None, as_json: bool) -> None:
    """List the GPU catalog (dense peak rates from vendor datasheets)."""
    from autofit.specs.cluster import parse_cluster

    cards = [parse_cluster(custom).gpu] if custom else list(GPUS.values())  # as --gpus reads it
    if as_json:
        click.echo(console.dumps([console.gpu_dict(g) for g in cards]))
        return
    term = console.terminal()
    term.print(console.gpus_table(cards))
    for g in cards:
        if custom:
            term.print(f"source: {g.source}", highlight=False)
        if g.assumption:
            term.print(f"[yellow]assumed[/yellow]: {g.assumption}", highlight=False)


@click.command()
@json_option
@handle_errors
def models(as_json: bool) -> None:
    """List the registered model architectures."""
    if as_json:
        click.echo(console.dumps([m.as_dict() for m in MODELS.values()]))
        return
    console.terminal().print(console.models_table(MODELS.values()))

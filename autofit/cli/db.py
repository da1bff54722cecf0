"""``autofit db``: create, inspect and upgrade the database's schema (Alembic migrations)."""

from __future__ import annotations

import click

from autofit.cli.options import db_option, handle_errors, json_option
from autofit.report import console
from autofit.store import Store


@click.group()
def db() -> None:
    """Inspect and upgrade autofit's database schema."""


@db.command()
@db_option
@handle_errors
def upgrade(db_url: str | None) -> None:
    """Migrate the database to this autofit's schema (a new database is created)."""
    with Store(db_url, check_schema=False) as store:
        before, after = store.upgrade()
        if before == after:
            click.echo(f"{store.masked_url}: already at revision {after}")
        else:
            click.echo(f"{store.masked_url}: upgraded from {before or 'an empty database'} to revision {after}")


@db.command()
@db_option
@json_option
@handle_errors
def current(db_url: str | None, as_json: bool) -> None:
    """Show the database's schema revision and whether it needs `autofit db upgrade`."""
    with Store(db_url, check_schema=False) as store:
        info = store.schema_info()
    if as_json:
        click.echo(console.dumps(info.as_dict()))
        return
    click.echo(f"database: {info.url}")
    click.echo(f"current:  {info.current or '(empty: no autofit schema yet)'}")
    click.echo(f"head:     {info.head}")
    if info.up_to_date:
        click.echo("up to date")
    elif info.known:
        click.echo("needs `autofit db upgrade`")
    else:
        click.echo("written by a newer autofit: upgrade autofit")

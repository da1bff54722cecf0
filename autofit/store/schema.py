"""Alembic, driven from code: the config is built from the package path (no alembic.ini),
so migrations run the same from a wheel install as from a source checkout.

Our version table is ``autofit_alembic_version``; Optuna's Alembic keeps the default
``alembic_version`` in the same database, and neither sees the other's revisions.
"""

from __future__ import annotations

import functools
import os
import zlib
from typing import TYPE_CHECKING, Any

from sqlalchemy import inspect, text

from autofit.store.models import TABLE_PREFIX, VERSION_TABLE, Base, include_name

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.script import ScriptDirectory
    from sqlalchemy.engine import Connection


def _script_location() -> str:
    """The Alembic scripts: ``migrations/`` beside ``autofit/`` in a source checkout, shipped
    inside the wheel as the package ``autofit.migrations`` (see ``pyproject.toml``)."""
    import importlib.util

    spec = importlib.util.find_spec("autofit.migrations")
    if spec is not None and spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "migrations")


SCRIPT_LOCATION = _script_location()

# Concurrent first opens of one PostgreSQL database wait for each other on this lock.
_PG_LOCK_KEY = zlib.crc32(b"autofit-migrations")


def alembic_config(script_location: str = SCRIPT_LOCATION, connection: Connection | None = None) -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", script_location.replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection  # env.py migrates on this connection
    return cfg


@functools.lru_cache(maxsize=8)
def script_directory(script_location: str = SCRIPT_LOCATION) -> ScriptDirectory:
    """Parsed once per process: every Store() checks its database against it."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config(script_location))


def revisions(script_location: str = SCRIPT_LOCATION) -> list[str]:
    """Every revision, oldest first."""
    script = script_directory(script_location)
    return [r.revision for r in reversed(list(script.walk_revisions()))]


def head(script_location: str = SCRIPT_LOCATION) -> str:
    heads = script_directory(script_location).get_heads()
    if len(heads) != 1:
        raise RuntimeError(f"autofit's migrations have {len(heads)} heads {heads}; merge them")
    return heads[0]


def current(connection: Connection) -> str | None:
    from alembic.migration import MigrationContext

    ctx = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    return ctx.get_current_revision()


def autofit_tables(connection: Connection) -> list[str]:
    return sorted(t for t in inspect(connection).get_table_names() if t.startswith(TABLE_PREFIX) and t != VERSION_TABLE)


# Optuna's RDB storage tables (optuna/storages/_rdb/models.py, plus its Alembic version
# table): they live beside autofit's by design. A test checks this list against Optuna's models.
OPTUNA_TABLES = frozenset(
    {
        "studies",
        "study_directions",
        "study_user_attributes",
        "study_system_attributes",
        "trials",
        "trial_user_attributes",
        "trial_system_attributes",
        "trial_params",
        "trial_values",
        "trial_intermediate_values",
        "trial_heartbeats",
        "version_info",
        "alembic_version",
    }
)


def foreign_tables(connection: Connection) -> list[str]:
    """Tables that are neither autofit's nor Optuna's: another application's database."""
    return sorted(
        t for t in inspect(connection).get_table_names() if not t.startswith(TABLE_PREFIX) and t not in OPTUNA_TABLES
    )


def upgrade(connection: Connection, target: str = "head", script_location: str = SCRIPT_LOCATION) -> None:
    """Migrate on ``connection`` in one transaction, holding a lock that serializes migrators.

    The caller commits. On SQLite, foreign keys are off during the migration, because
    batch migrations copy tables; the caller turns them back on.
    """
    from alembic import command

    dialect = connection.dialect.name
    if dialect == "sqlite":
        connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
        connection.exec_driver_sql("BEGIN IMMEDIATE")  # the write lock, waiting up to busy_timeout
    elif dialect == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_LOCK_KEY})
    command.upgrade(alembic_config(script_location, connection), target)


def diff(connection: Connection) -> list[Any]:
    """What differs between the ORM classes and the database's autofit tables (empty: nothing)."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    ctx = MigrationContext.configure(
        connection,
        opts={"version_table": VERSION_TABLE, "compare_type": True, "include_name": include_name},
    )
    return compare_metadata(ctx, Base.metadata)

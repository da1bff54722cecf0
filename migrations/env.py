"""Alembic environment for autofit's store, run by ``autofit.store.schema.upgrade``."""

from alembic import context

from autofit.store.models import VERSION_TABLE, Base, include_name

connection = context.config.attributes.get("connection")
if context.is_offline_mode() or connection is None:
    raise RuntimeError("autofit's migrations run through `autofit db upgrade` (autofit.store.Store.upgrade)")

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    version_table=VERSION_TABLE,  # never Optuna's "alembic_version"
    render_as_batch=connection.dialect.name == "sqlite",  # SQLite cannot ALTER much; batch mode copies the table
    compare_type=True,
    include_name=include_name,  # Optuna's tables live in the same database; leave them alone
)
with context.begin_transaction():
    context.run_migrations()

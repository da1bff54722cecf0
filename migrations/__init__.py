"""autofit's Alembic migrations: the only way the store's schema changes.

They run through ``autofit.store.Store.upgrade`` (``autofit db upgrade``), which builds
the Alembic config in code, so no alembic.ini is needed. To add a revision after editing
``models.py``, autogenerate it against a database at the current head::

    from alembic import command
    from autofit.store import Store, schema
    store = Store("sqlite:///dev.db")
    with store.engine.connect() as conn:
        command.revision(schema.alembic_config(connection=conn), "what changed",
                         autogenerate=True, rev_id="0002")

Then read the generated file: keep data migrations on frozen copies of the tables
(never import ``autofit.store.models`` from a revision), and commit a fixture database
made by the previous revision (``tests/store/fixtures/make_fixture.py``).
"""

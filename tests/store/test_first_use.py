"""Opening a database for the first time: concurrent creators, and other applications' databases."""

from __future__ import annotations

import multiprocessing
import sqlite3
import subprocess
import sys
import time

import pytest
from sqlalchemy import create_engine, text

from autofit.errors import StoreError
from autofit.store import Store
from autofit.store.schema import OPTUNA_TABLES

PROCESSES = 4
FILES = 100


def _open_each(paths, barrier, queue):
    """Child: open every path at the same moment as its siblings; report what failed."""
    errors = []
    for path in paths:
        try:
            barrier.wait(timeout=60)
            Store(path).close()
        except Exception as exc:  # noqa: BLE001 - the parent asserts there are none
            errors.append(f"{path}: {type(exc).__name__}: {exc}")
    queue.put(errors)


@pytest.mark.slow
def test_processes_creating_the_same_new_sqlite_file_at_once_all_succeed(tmp_path):
    """Several processes open each new file at the same moment (``autofit history & autofit
    history`` on a new --db). Before the switch to WAL waited, 1-9% of the files (depending
    on the machine's load) failed one of their openers with "database is locked" from
    ``PRAGMA journal_mode=WAL``."""
    Store("sqlite:///:memory:").close()  # imports and Alembic's scripts are loaded before the fork
    ctx = multiprocessing.get_context("fork")
    paths = [str(tmp_path / f"new{i}.db") for i in range(FILES)]
    barrier, queue = ctx.Barrier(PROCESSES), ctx.Queue()
    procs = [ctx.Process(target=_open_each, args=(paths, barrier, queue)) for _ in range(PROCESSES)]
    for p in procs:
        p.start()
    errors = [e for _ in procs for e in queue.get(timeout=300)]
    for p in procs:
        p.join(timeout=60)
    assert errors == [], f"{len(errors)} failed opens, e.g. {errors[:3]}"
    assert all(p.exitcode == 0 for p in procs)
    for path in paths:  # each file is whole: at head, in WAL mode
        with Store(path) as store:
            assert store.current_revision() == Store.head_revision()
        with sqlite3.connect(path) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


HOLD = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
conn.execute("CREATE TABLE other_app (id INTEGER)")  # rolled back: the file ends up empty
print("held", flush=True)
time.sleep(float(sys.argv[2]))
conn.execute("ROLLBACK")
"""


def test_a_new_file_waits_for_a_writer_in_another_process_instead_of_failing(tmp_path):
    """Another process holds the write lock of a new (not yet WAL) file, as an autofit
    process does while it creates one: the switch to WAL must wait like any write. SQLite
    skips busy_timeout for that switch, so before the fix this failed within a millisecond
    with "database is locked" (deterministically; the test above needs luck)."""
    path = tmp_path / "held.db"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path), "1.5"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with Store(str(path)) as store:
            assert store.current_revision() == Store.head_revision()
        assert time.monotonic() - t0 >= 1.0  # it waited for the writer
    finally:
        holder.wait(timeout=60)
    assert holder.returncode == 0


def test_optuna_table_list_matches_optuna():
    from optuna.storages._rdb.models import BaseModel

    assert OPTUNA_TABLES == set(BaseModel.metadata.tables) | {"alembic_version"}


def _make_tables(url: str, *names: str) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        for name in names:
            conn.execute(text(f"CREATE TABLE {name} (id INTEGER PRIMARY KEY)"))
    engine.dispose()


def _tables(url: str) -> set[str]:
    from sqlalchemy import inspect

    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_another_applications_database_is_refused_untouched(db_url):
    _make_tables(db_url, "users", "orders", "invoices", "payments")
    with pytest.raises(StoreError) as err:
        Store(db_url)
    msg = str(err.value)
    assert "another application's tables (invoices, orders, payments and 1 more)" in msg
    assert ("a new file" in msg) if db_url.startswith("sqlite") else ("an empty database" in msg)
    assert "\n" not in msg
    assert _tables(db_url) == {"users", "orders", "invoices", "payments"}  # nothing added
    with pytest.raises(StoreError, match="another application's tables"):  # `autofit db upgrade` too
        Store(db_url, check_schema=False).upgrade()
    assert _tables(db_url) == {"users", "orders", "invoices", "payments"}


def test_optuna_only_and_autofit_databases_are_accepted(db_url):
    import optuna

    optuna.create_study(storage=db_url, study_name="before-autofit")
    with Store(db_url) as store:
        assert store.current_revision() == Store.head_revision()
    _make_tables(db_url, "notes")  # another table added later: autofit's database stays usable
    with Store(db_url) as store:
        assert store.list_studies() == []

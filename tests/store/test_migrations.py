"""Migrations: the ORM matches the migrated schema, old databases upgrade without losing
rows, mismatched ones are refused clearly, and Optuna's tables live beside ours."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap

import optuna
import pytest
import sqlalchemy as sa
from sqlalchemy import create_engine, inspect, text

from autofit.errors import StoreError
from autofit.results import Status
from autofit.store import Store, schema
from autofit.store.models import Base
from tests.store.samples import ALLOWED, gpt2_ctx, gpt2_results

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FUTURE = "9999"
HEAD = "0003"


@pytest.fixture(scope="session")
def future_store(tmp_path_factory):
    """A Store class whose migrations have one more revision than this autofit's.

    It copies the real revisions and adds a real one on top that rebuilds
    ``autofit_studies`` (SQLite batch mode copies the table) while ``autofit_trials``
    points at it with ON DELETE CASCADE: the way a future migration would, so the test
    proves that upgrading loses no trial.
    """
    location = tmp_path_factory.mktemp("future") / "migrations"
    shutil.copytree(schema.SCRIPT_LOCATION, location, ignore=shutil.ignore_patterns("__pycache__"))
    (location / "versions" / f"{FUTURE}_future.py").write_text(
        textwrap.dedent(f'''
        import sqlalchemy as sa
        from alembic import op

        revision = "{FUTURE}"
        down_revision = "{Store.head_revision()}"
        branch_labels = None
        depends_on = None


        def upgrade():
            sqlite = op.get_bind().dialect.name == "sqlite"
            with op.batch_alter_table("autofit_studies", recreate="always" if sqlite else "auto") as batch:
                batch.add_column(sa.Column("note", sa.Text(), nullable=True))
            op.execute("UPDATE autofit_studies SET note = 'upgraded'")


        def downgrade():
            with op.batch_alter_table("autofit_studies") as batch:
                batch.drop_column("note")
    ''')
    )

    class FutureStore(Store):
        script_location = str(location)

    return FutureStore


def _fill(store: Store) -> tuple[int, list]:
    study = store.create_study(gpt2_ctx(), evaluator="analytic", allowed=ALLOWED, name="kept")
    records = [store.record_trial(study.id, r) for r in gpt2_results(gpt2_ctx())]
    return study.id, records


def test_new_database_is_created_at_head(db_url):
    with Store(db_url) as store:
        assert store.current_revision() == Store.head_revision() == HEAD
        assert Store.revisions() == ["0001", "0002", "0003"]
        with store.engine.connect() as conn:
            tables = set(inspect(conn).get_table_names())
        assert {"autofit_studies", "autofit_trials", "autofit_alembic_version"} <= tables
        assert not tables & {"studies", "trials", "alembic_version"}  # Optuna's names stay free
        assert store.upgrade() == (HEAD, HEAD)  # idempotent


def test_orm_matches_migrated_schema(store):
    assert store.schema_diff() == []


def test_schema_diff_sees_a_drift(db_url):
    """The comparison the test above relies on does detect a difference."""
    with Store(db_url) as store:
        with store.engine.begin() as conn:
            conn.execute(text("ALTER TABLE autofit_trials ADD COLUMN stray INTEGER"))
        diff = store.schema_diff()
    assert [(d[0], d[3].name) for d in diff] == [("remove_column", "stray")]


def test_optuna_and_autofit_share_one_database(store):
    storage = store.optuna_storage()
    study = optuna.create_study(storage=storage, study_name="shared", direction="maximize")
    for _ in range(3):
        trial = study.ask()
        study.tell(trial, trial.suggest_int("micro_batch", 1, 8))
    assert storage.get_current_version() == storage.get_head_version()  # Optuna's own revision, untouched

    ours = store.create_study(gpt2_ctx(), evaluator="analytic", optuna_study_name="shared")
    store.record_trial(ours.id, gpt2_results(gpt2_ctx())[0], number=0, optuna_trial_id=study.trials[0]._trial_id)
    with store.engine.connect() as conn:
        tables = set(inspect(conn).get_table_names())
        assert {
            "studies",
            "trials",
            "alembic_version",
            "autofit_studies",
            "autofit_trials",
            "autofit_alembic_version",
        } <= tables
        assert conn.execute(text("SELECT version_num FROM autofit_alembic_version")).scalar_one() == HEAD
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == storage.get_head_version()
    assert store.schema_diff() == []
    with Store(store.url) as again:  # reopening sees our revision, not Optuna's
        assert len(again.trials(ours.id)) == 1
    assert len(optuna.load_study(study_name="shared", storage=storage).trials) == 3


def test_optuna_first_then_autofit(db_url):
    """A database Optuna created before autofit ever opened it gets autofit's tables too."""
    storage = optuna.storages.RDBStorage(db_url)
    optuna.create_study(storage=storage, study_name="first")
    storage.engine.dispose()
    with Store(db_url) as store:
        assert store.current_revision() == HEAD and store.schema_diff() == []
        assert optuna.load_study(study_name="first", storage=store.optuna_storage()).study_name == "first"


def test_every_revision_has_a_fixture_database():
    """make_fixture.py must be run before each new revision is added."""
    for revision in Store.revisions():
        assert os.path.exists(os.path.join(FIXTURES, f"autofit-{revision}.db")), revision
        assert os.path.exists(os.path.join(FIXTURES, f"autofit-{revision}.json")), revision


def _migrated(revision: str, trial: dict) -> dict:
    """A trial row as a fixture of ``revision`` recorded it, with the data migrations after
    that revision applied (what upgrading to the head must turn it into)."""
    trial = json.loads(json.dumps(trial))
    if revision < "0002" and trial["status"] == "pruned" and (trial.get("extra") or {}).get("pruned_by") != "pruner":
        trial["status"] = "screened"  # 0002: screened out before evaluation is not pruned by the pruner
    return trial


def _study_now(study: dict) -> dict:
    """A study record as a fixture recorded it, under today's names: the record's ``backend``
    is ``evaluator`` (the database column kept its name; only the record's key changed)."""
    study = dict(study)
    if "backend" in study:
        study["evaluator"] = study.pop("backend")
    return study


def _subset(expected, actual, where=""):
    """Every value the fixture recorded is still there (new columns may add keys)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), where
        for key, value in expected.items():
            assert key in actual, f"{where}.{key} is gone"
            _subset(value, actual[key], f"{where}.{key}")
    else:
        assert expected == actual, where


@pytest.mark.parametrize("revision", Store.revisions())
def test_fixture_database_upgrades_to_head_keeping_every_row(revision, tmp_path):
    path = tmp_path / "old.db"
    shutil.copy(os.path.join(FIXTURES, f"autofit-{revision}.db"), path)
    with open(os.path.join(FIXTURES, f"autofit-{revision}.json")) as fh:
        manifest = json.load(fh)
    assert manifest["revision"] == revision
    with Store(str(path), check_schema=False) as store:
        assert store.current_revision() == revision
        assert store.upgrade() == (revision, Store.head_revision())
    with Store(str(path)) as store:
        assert store.schema_diff() == []
        summaries = store.list_studies()
        assert len(summaries) == len(manifest["studies"]) == 2
        for expected, summary in zip(manifest["studies"], summaries):
            _subset(_study_now(expected["study"]), summary.study.as_dict(), summary.study.name)
            trials = store.trials(summary.study.id)
            assert len(trials) == len(expected["trials"])
            for want, got in zip(expected["trials"], trials):
                _subset(_migrated(revision, want), got.as_dict(), f"{summary.study.name}#{got.number}")
        gpt2 = store.get_study("fixture-gpt2")
        assert gpt2.context().model.fingerprint == gpt2.model_fingerprint
        assert store.find_finished_study(gpt2.request_key) == gpt2


def _down_to(store: Store, revision: str) -> None:
    """Take ``store``'s database back to ``revision`` with the migrations' own downgrades.

    Rows for an old revision are written at the head (today's Store) and then taken down:
    the ORM maps today's columns, and the downgrades rename them back."""
    from alembic import command

    with store.engine.connect() as conn:
        sqlite = conn.dialect.name == "sqlite"
        if sqlite:  # as schema.upgrade does: batch mode copies tables, which must not cascade
            conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
        command.downgrade(schema.alembic_config(Store.script_location, conn), revision)
        conn.commit()
        if sqlite:
            conn.exec_driver_sql("PRAGMA foreign_keys=ON")
    assert store.current_revision() == revision


def test_0002_tells_screened_from_pruned_by_the_pruner(db_url):
    """Revision 0001 stored both as ``pruned``; ``extra.pruned_by`` says which one a row was."""
    ctx = gpt2_ctx()
    fast, slow, oom, screened = gpt2_results(ctx)
    old_screened = dataclasses.replace(screened, status=Status.PRUNED)  # how 0001's search recorded it
    by_pruner = dataclasses.replace(slow, evaluator="measured", status=Status.PRUNED, extra={"pruned_by": "pruner"})
    with Store(db_url) as store:
        study = store.create_study(ctx, evaluator="measured", name="old")
        for r in (fast, old_screened, by_pruner, oom):
            store.record_trial(study.id, r)
        _down_to(store, "0001")
        assert store.upgrade() == ("0001", HEAD)
    with Store(db_url) as store:
        assert [t.status for t in store.trials(study.id)] == [Status.FITS, Status.SCREENED, Status.PRUNED, Status.OOM]
        assert store.list_studies()[0].counts == {"fits": 1, "screened": 1, "pruned": 1, "oom": 1}
        _down_to(store, "0001")  # down: both are "pruned" again, told apart by extra
        with store.engine.connect() as conn:
            statuses = conn.execute(text("SELECT status FROM autofit_trials ORDER BY id")).scalars().all()
        assert statuses == ["fits", "pruned", "pruned", "oom"]
        assert store.upgrade() == ("0001", HEAD)  # and up again
        assert [t.status for t in store.trials(study.id)] == [Status.FITS, Status.SCREENED, Status.PRUNED, Status.OOM]


def test_0002_recovers_the_memory_budget_of_a_cpu_study(db_url):
    """0001 stored a ``--gpus 1xcpu --cpu-mem-budget`` study's cluster without the budget;
    every evaluation recorded it as its capacity, and the upgrade writes it back."""
    from autofit.evaluators.analytic import AnalyticEvaluator
    from autofit.plan import Plan
    from autofit.search.request import build_context

    ctx = build_context("gpt2", "1xcpu", seq_len=256, global_batch=8, cpu_mem_budget="3GiB")
    with Store(db_url) as store:
        study = store.create_study(ctx, evaluator="analytic", name="cpu")
        store.record_trial(study.id, AnalyticEvaluator().evaluate(Plan(micro_batch=8, grad_accum=1), ctx))
        store.create_study(ctx, evaluator="analytic", name="cpu-empty")
        studies = sa.table("autofit_studies", sa.column("id", sa.Integer()), sa.column("cluster", sa.JSON()))
        with store.engine.begin() as conn:  # what 0001's autofit wrote: the name only
            for row in conn.execute(sa.select(studies)).all():
                cluster = {k: v for k, v in row.cluster.items() if k != "cpu_memory_bytes"}
                conn.execute(studies.update().where(studies.c.id == row.id).values(cluster=cluster))
        assert store.get_study("cpu").context().capacity_bytes != 3 * 2**30  # lost: this machine's RAM
        _down_to(store, "0001")
        store.upgrade()
    with Store(db_url) as store:
        assert store.get_study("cpu").context() == ctx
        assert "cpu_memory_bytes" not in store.get_study("cpu-empty").cluster  # nothing to recover it from


def test_old_database_is_refused_then_upgraded_keeping_rows(db_url, future_store):
    with Store(db_url) as store:  # made by this autofit: its head revision, with data
        study_id, records = _fill(store)
    with pytest.raises(StoreError) as err:
        future_store(db_url)
    masked = Store(db_url, check_schema=False).masked_url
    message = str(err.value)
    assert message == (
        f"database {masked} has schema revision {HEAD}, older than this autofit's {FUTURE}; "
        f"run `autofit db upgrade --db {masked}`"
    )

    with future_store(db_url, check_schema=False) as newer:
        assert newer.schema_info().needs_upgrade
        assert newer.upgrade() == (HEAD, FUTURE)
        with newer.engine.connect() as conn:
            assert conn.execute(text("SELECT note FROM autofit_studies")).scalars().all() == ["upgraded"]
    with future_store(db_url) as newer:  # opens now without complaint
        assert newer.trials(study_id) == records
        assert newer.get_study("kept").id == study_id


def test_newer_database_is_refused(db_url, future_store):
    with future_store(db_url) as newer:  # a new database, created by the "newer autofit"
        assert newer.current_revision() == FUTURE
    with pytest.raises(
        StoreError, match=f"schema revision {FUTURE}, unknown to this autofit .*a newer autofit wrote it"
    ):
        Store(db_url)
    with Store(db_url, check_schema=False) as store:
        info = store.schema_info()
        assert (info.current, info.known, info.needs_upgrade) == (FUTURE, False, False)
        with pytest.raises(StoreError, match="a newer autofit wrote it"):
            store.upgrade()


def test_tables_without_a_revision_are_refused(db_url):
    engine = create_engine(db_url)
    Base.metadata.create_all(engine)
    engine.dispose()
    with pytest.raises(StoreError, match="has autofit tables .* but no revision in autofit_alembic_version"):
        Store(db_url)


@pytest.mark.slow
def test_concurrent_first_opens_migrate_once(db_url, tmp_path):
    """Four processes open one new database at once: one migrates, the others wait and find it done."""
    code = "import sys; from autofit.store import Store; s = Store(sys.argv[1]); print(s.current_revision())"
    env = {**os.environ, "PYTHONPATH": ROOT}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, db_url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err for _, err in outs]
    assert [out.strip() for out, _ in outs] == [HEAD] * 4
    with Store(db_url) as store:
        assert store.schema_diff() == []


def test_0003_names_the_column_evaluator_and_back(db_url):
    """The study's evaluator column is renamed on the way up and back on the way down, values kept."""
    with Store(db_url) as store:
        study = store.create_study(gpt2_ctx(), evaluator="simulated", name="renamed")
        _down_to(store, "0002")
        with store.engine.connect() as conn:
            columns = {c["name"] for c in inspect(conn).get_columns("autofit_studies")}
            assert "backend" in columns and "evaluator" not in columns
            assert conn.execute(text("SELECT backend FROM autofit_studies")).scalars().all() == ["simulated"]
        assert store.upgrade() == ("0002", HEAD)
        assert store.get_study("renamed").evaluator == "simulated" and store.schema_diff() == []
        assert store.get_study(study.id).request_key == study.request_key

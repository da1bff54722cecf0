"""The Store's API on real databases: round trips, queries, errors, URL handling."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from autofit.errors import StoreError
from autofit.evaluators.analytic import AnalyticEvaluator
from autofit.plan import Plan
from autofit.results import MemoryAnatomy, Status
from autofit.store import Store, StudyStatus, default_path, request_key, resolve_url
from autofit.store.models import ANATOMY_COLUMNS, StudyModel, TrialModel
from tests.store.samples import ALLOWED, gpt2_ctx, gpt2_results, llama_ctx, llama_results

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _study(store, ctx=None, **kw):
    kw.setdefault("evaluator", "analytic")
    kw.setdefault("allowed", ALLOWED)
    return store.create_study(ctx or gpt2_ctx(), **kw)


def test_round_trip_study_and_trials(store):
    ctx = llama_ctx()
    study = _study(store, ctx, budget={"trials": 50, "timeout_s": 600.0}, optuna_study_name="opt-1")
    assert re.fullmatch(r"llama-3.2-1b-2xA10-[0-9a-f]{6}", study.name)
    assert study.status is StudyStatus.RUNNING and study.finished_at is None
    assert study.model_fingerprint == ctx.model.fingerprint and study.cluster_label == "2xA10"
    assert study.gpu_name == "A10" and (study.seq_len, study.global_batch) == (2048, 16)
    assert study.workload["lengths"]["histogram"] == [[200, 30], [900, 50], [2048, 20]]
    assert study.allowed == {
        "methods": ["full", "lora", "qlora"],
        "optimizers": ["adamw"],
        "precisions": ["bf16-mixed"],
    }
    assert study.budget == {"trials": 50, "timeout_s": 600.0} and study.headroom == 0.05
    assert study.versions["sqlalchemy"] and study.versions["python"] and "autofit" in study.versions
    assert study.optuna_study_name == "opt-1"
    assert store.get_study(study.name) == study == store.get_study(study.id) == store.get_study(str(study.id))
    assert study.context() == ctx  # model (hf_extra included), cluster, workload and headroom rebuilt

    results = llama_results(ctx) + gpt2_results(gpt2_ctx())[3:]
    records = [store.record_trial(study.id, r, optuna_trial_id=10 + i) for i, r in enumerate(results)]
    assert [r.number for r in records] == [0, 1, 2]
    read = store.trials(study.id)
    assert read == records
    for record, result in zip(read, results):
        assert store.trial_result(record) == result  # plan, status, anatomy, throughput, extra, reason
        assert record.plan_id == result.plan.plan_id and record.evaluator == "analytic"
    assert (
        read[2].memory is None
        and read[2].throughput is None
        and read[2].extra == {"note": "no anatomy", "scores": [1.5, 2]}
    )


def test_anatomy_is_stored_in_columns_named_as_the_anatomy(store):
    assert ANATOMY_COLUMNS == tuple(f.name for f in dataclasses.fields(MemoryAnatomy))
    study = _study(store)
    fast = gpt2_results(gpt2_ctx())[0]
    record = store.record_trial(study.id, fast)
    with store.session_scope() as s:
        row = s.get(TrialModel, record.id)
        assert {c: getattr(row, c) for c in ANATOMY_COLUMNS} == fast.memory.as_dict()
        assert row.device_total > 2**32  # BigInteger: 7.35 GiB does not fit 32 bits
        assert (row.tokens_per_sec, row.step_time_s) == (fast.throughput.tokens_per_sec, fast.throughput.step_time_s)
        assert row.throughput == fast.throughput.as_dict() and row.capacity_bytes == 24146608128


def test_measured_result_is_kept_beside_the_prediction_and_overrides_it(store):
    study = _study(store)
    fast, slow, oom, screened = gpt2_results(gpt2_ctx())
    for r in (fast, slow, oom, screened):
        store.record_trial(study.id, r)
    assert (
        store.best_trial(study.model_fingerprint, "1xA10").plan == fast.plan
    )  # the OOM plan is faster but does not fit

    measured = dataclasses.replace(fast, evaluator="measured", status=Status.OOM, reason="CUDA out of memory in step 1")
    store.record_trial(study.id, measured, number=0)
    rows = [t for t in store.trials(study.id) if t.plan_id == fast.plan.plan_id]
    assert sorted(t.evaluator for t in rows) == ["analytic", "measured"] and {t.number for t in rows} == {0}
    assert store.best_trial(study.model_fingerprint, "1xA10").plan == slow.plan  # measured OOM beats predicted fit
    summary = store.list_studies()[0]
    assert summary.best.plan == slow.plan
    assert summary.counts == {"fits": 2, "oom": 2, "screened": 1} and summary.n_trials == 5


def test_best_trial_across_studies_and_filters(store):
    fp = gpt2_ctx().model.fingerprint
    assert store.best_trial(fp, "1xA10") is None
    a = _study(store, gpt2_ctx(seq_len=1024, global_batch=32))
    for r in gpt2_results(gpt2_ctx(seq_len=1024, global_batch=32)):
        store.record_trial(a.id, r)
    # the same tokens per step in shorter sequences: cheaper attention, the same fixed costs per step
    b = _study(store, gpt2_ctx(seq_len=512, global_batch=64))
    short = [AnalyticEvaluator().evaluate(Plan(micro_batch=16, grad_accum=4), gpt2_ctx(seq_len=512, global_batch=64))]
    store.record_trial(b.id, short[0])
    assert short[0].tokens_per_sec > gpt2_results(gpt2_ctx())[0].tokens_per_sec

    best = store.best_trial(fp, "1xA10")
    assert (best.study_id, best.plan, best.status) == (b.id, short[0].plan, Status.FITS)
    assert store.best_trial(fp, "1xA10", seq_len=1024).study_id == a.id
    assert store.best_trial(fp, "1xA10", seq_len=1024, global_batch=32).tokens_per_sec == pytest.approx(
        gpt2_results(gpt2_ctx())[0].tokens_per_sec, rel=1e-9
    )
    assert store.best_trial(fp, "1xA10", global_batch=128) is None
    assert store.best_trial(fp, "2xA10") is None
    assert store.best_trial(llama_ctx().model.fingerprint, "1xA10") is None
    # the fast plan needs 8.2 GiB of the A10's 22.49 GiB: it fits with 60% headroom, not with 70%
    assert store.best_trial(fp, "1xA10", seq_len=1024, headroom=0.6).plan == gpt2_results(gpt2_ctx())[0].plan
    assert store.best_trial(fp, "1xA10", seq_len=1024, headroom=0.7).plan == gpt2_results(gpt2_ctx())[1].plan


def test_identical_requests_share_a_key_and_find_the_latest_finished_study(store):
    ctx = gpt2_ctx()
    key = request_key(ctx, evaluator="analytic", allowed=ALLOWED)
    shuffled = {k: list(reversed(v)) for k, v in reversed(list(ALLOWED.items()))}
    assert request_key(gpt2_ctx(), evaluator="analytic", allowed=shuffled) == key
    assert request_key(ctx, evaluator="simulated", allowed=ALLOWED) != key
    assert request_key(ctx, evaluator="analytic", allowed={"methods": ["full"]}) != key
    assert request_key(gpt2_ctx(seq_len=512), evaluator="analytic", allowed=ALLOWED) != key
    assert request_key(dataclasses.replace(ctx, headroom=0.1), evaluator="analytic", allowed=ALLOWED) != key
    renamed = dataclasses.replace(ctx, model=dataclasses.replace(ctx.model, name="my-gpt2", source="/tmp/x"))
    assert request_key(renamed, evaluator="analytic", allowed=ALLOWED) == key  # same architecture, same answer

    assert store.find_finished_study(key) is None
    first = _study(store)
    assert first.request_key == key
    assert store.find_finished_study(key) is None  # running
    store.finish_study(first.id)
    second = _study(store)
    assert store.find_finished_study(key).id == first.id
    store.finish_study(second.id, "finished")
    assert store.find_finished_study(key).id == second.id
    interrupted = _study(store)
    store.finish_study(interrupted.id, StudyStatus.INTERRUPTED)
    assert store.find_finished_study(key).id == second.id


def test_finish_and_resume(store):
    study = _study(store)
    done = store.finish_study(study.id, StudyStatus.INTERRUPTED)
    assert done.status is StudyStatus.INTERRUPTED and done.finished_at is not None
    assert done.updated_at >= study.updated_at and done.created_at == study.created_at
    again = store.resume_study(study.id)
    assert again.status is StudyStatus.RUNNING and again.finished_at is None
    with pytest.raises(ValueError):
        store.finish_study(study.id, StudyStatus.RUNNING)
    with pytest.raises(StoreError, match=r"no study with id 999; see `autofit history`"):
        store.finish_study(999)


def test_list_studies_filters_and_summaries(store):
    g = _study(store)
    for r in gpt2_results(gpt2_ctx()):
        store.record_trial(g.id, r)
    llama = _study(store, llama_ctx())
    empty = _study(store, gpt2_ctx(seq_len=128))
    assert [s.study.id for s in store.list_studies()] == [empty.id, llama.id, g.id]  # newest first
    assert [s.study.id for s in store.list_studies(model="GPT2")] == [empty.id, g.id]
    assert [s.study.id for s in store.list_studies(model=llama_ctx().model.fingerprint)] == [llama.id]
    assert [s.study.id for s in store.list_studies(gpu="a10")] == [empty.id, llama.id, g.id]
    assert [s.study.id for s in store.list_studies(gpu="2xa10")] == [llama.id]
    assert [s.study.id for s in store.list_studies(model="gpt2", gpu="2xA10")] == []
    assert store.list_studies(model="mistral-7b") == []
    by_id = {s.study.id: s for s in store.list_studies()}
    assert by_id[g.id].best_plan == gpt2_results(gpt2_ctx())[0].plan
    assert by_id[g.id].best_tokens_per_sec == pytest.approx(gpt2_results(gpt2_ctx())[0].tokens_per_sec, rel=1e-9)
    assert by_id[g.id].counts == {"fits": 2, "oom": 1, "screened": 1}
    assert by_id[empty.id].best is None and by_id[empty.id].n_trials == 0
    assert by_id[g.id].as_dict()["best"]["plan_id"] == gpt2_results(gpt2_ctx())[0].plan.plan_id


def test_unknown_study_and_duplicate_names(store):
    with pytest.raises(StoreError, match=r"^no study named 'nope'; see `autofit history`$"):
        store.get_study("nope")
    with pytest.raises(StoreError, match="no study with id 42"):
        store.get_study(42)
    with pytest.raises(StoreError, match="no study with id 7"):
        store.record_trial(7, gpt2_results(gpt2_ctx())[0])
    with pytest.raises(StoreError, match="no study with id 7"):
        store.trials(7)
    named = _study(store, name="baseline")
    assert store.get_study("baseline") == named
    with pytest.raises(StoreError, match="a study named 'baseline' already exists"):
        _study(store, name="baseline")
    with pytest.raises(StoreError, match="not only digits"):
        _study(store, name="123")
    assert len(store.list_studies()) == 1


def test_session_scope_rolls_back_and_reports_one_masked_line(store):
    study = _study(store)
    with pytest.raises(RuntimeError):
        with store.session_scope() as s:
            s.get(StudyModel, study.id).status = "failed"
            s.flush()
            raise RuntimeError("boom")
    assert store.get_study(study.id).status is StudyStatus.RUNNING

    with pytest.raises(StoreError) as err:
        with store.session_scope() as s:
            s.get(StudyModel, study.id).model_name = "changed"
            s.add(
                StudyModel(
                    **{
                        c: getattr(s.get(StudyModel, study.id), c)
                        for c in (
                            "name",
                            "model_name",
                            "model_fingerprint",
                            "model_spec",
                            "cluster",
                            "cluster_label",
                            "gpu_name",
                            "workload",
                            "seq_len",
                            "global_batch",
                            "allowed",
                            "evaluator",
                            "budget",
                            "headroom",
                            "versions",
                            "status",
                            "request_key",
                        )
                    }
                )
            )
    message = str(err.value)
    assert message.startswith(f"database error ({store.masked_url}): ") and "\n" not in message
    assert re.search(r"unique|duplicate", message, re.I)
    assert store.get_study(study.id).model_name == "gpt2"  # the whole unit of work was rolled back
    with store.session_scope() as s:
        assert s.scalars(select(StudyModel)).all()[0].id == study.id


def test_records_are_frozen(store):
    study = _study(store)
    trial = store.record_trial(study.id, gpt2_results(gpt2_ctx())[0])
    summary = store.list_studies()[0]
    for record in (study, trial, summary, store.schema_info()):
        with pytest.raises(dataclasses.FrozenInstanceError):
            record.id = 5  # type: ignore[misc]


def test_sqlite_pragmas(tmp_path):
    with Store(str(tmp_path / "a.db")) as store:
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1


def test_deleting_a_study_deletes_its_trials(store):
    study = _study(store)
    store.record_trial(study.id, gpt2_results(gpt2_ctx())[0])
    with store.session_scope() as s:
        s.delete(s.get(StudyModel, study.id))
    with store.session_scope() as s:
        assert s.scalars(select(TrialModel)).all() == []


# -- URLs ---------------------------------------------------------------------------------
def test_url_resolution_order(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert default_path() == str(tmp_path / "data" / "autofit" / "autofit.db")
    assert not (tmp_path / "data").exists()
    with Store() as store:
        assert store.url == f"sqlite:///{tmp_path}/data/autofit/autofit.db"
        assert store.current_revision() == Store.head_revision()
    monkeypatch.setenv("AUTOFIT_DB", str(tmp_path / "env" / "env.db"))
    with Store() as store:
        assert store.url == f"sqlite:///{tmp_path}/env/env.db"
    with Store(f"sqlite:///{tmp_path}/explicit.db") as store:
        assert store.url == f"sqlite:///{tmp_path}/explicit.db"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("AUTOFIT_DB")
    assert resolve_url().database == f"{tmp_path}/home/.local/share/autofit/autofit.db"
    assert (tmp_path / "home" / ".local" / "share" / "autofit").is_dir()


def test_bare_and_relative_paths_are_sqlite_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_url("sub/x.db").render_as_string() == f"sqlite:///{tmp_path}/sub/x.db"
    assert resolve_url("sqlite:///rel.db").database == f"{tmp_path}/rel.db"
    assert resolve_url("postgresql://u@h/db").drivername == "postgresql+psycopg"


def test_masked_url_never_shows_the_password():
    store = Store("postgresql://u:secret@host/db", check_schema=False)  # no connection is made
    assert store.masked_url == "postgresql+psycopg://u:***@host/db"
    assert "secret" not in repr(store) and "secret" in store.url
    with pytest.raises(StoreError) as err:
        Store("mysqlx://u:secret@host/db")
    assert "secret" not in str(err.value) and "u:***@host" in str(err.value)


def test_unreachable_database_is_one_line_without_the_password(pg_admin):
    _, url = pg_admin
    bad = url.set(password="hunter2", database="autofit_no_such_database").render_as_string(hide_password=False)
    with pytest.raises(StoreError) as err:
        Store(bad)
    message = str(err.value)
    assert "hunter2" not in message and "\n" not in message
    assert message.startswith("database error (postgresql+psycopg://postgres:***@")
    assert "autofit_no_such_database" in message


@pytest.mark.parametrize(
    "url, fragment",
    [
        ("nosuchdb://h/x", "unknown database URL scheme 'nosuchdb'"),
        ("://nothing", "cannot read database URL"),
        ("/proc/autofit-nope/x.db", "cannot create the database directory /proc/autofit-nope"),
    ],
)
def test_bad_urls(url, fragment):
    with pytest.raises(StoreError, match=re.escape(fragment)):
        Store(url)


@pytest.mark.parametrize(
    "url, fragment",
    [
        ("postgresql://postgres@127.0.0.1:notaport/x", "its port 'notaport' is not a number"),
        ("postgresql://postgres:s3cr3t/pw@127.0.0.1:notaport/x", "postgresql://postgres:***@127.0.0.1:notaport/x"),
        ("postgresql://postgres@[::1/x", "its IPv6 host lacks the closing ']'"),
        ("postgresql://postgres:s3cr3t@[::1/x", "'postgresql://postgres:***@[::1/x'"),
        ("postgresql://postgres@::1/x", "an IPv6 host goes in brackets"),
        ("postgresql://postgres@h:/x", "its port '' is not a number"),
        (
            "postgresql://postgres:s3cr3t@127.0.0.1:99999/x",
            "postgresql://postgres:***@127.0.0.1:99999/x has port 99999, outside 1-65535",
        ),
        ("postgresql://postgres:s3cr3t@h:0/x", "has port 0, outside 1-65535"),
    ],
)
def test_malformed_postgres_urls_are_one_masked_line(url, fragment):
    with pytest.raises(StoreError) as err:
        resolve_url(url)  # refused before any connection is tried
    message = str(err.value)
    assert fragment in message and "\n" not in message, message
    assert "postgresql+psycopg://USER" in message  # the fix: how a URL is written
    assert "s3cr3t" not in message


def test_autofit_db_must_be_absolute_or_a_url(tmp_path, monkeypatch):
    """$AUTOFIT_DB is global: a relative SQLite path there would be a new database per directory."""
    monkeypatch.chdir(tmp_path)
    for value in ("garbage", "sub/a.db", "sqlite:///rel.db"):
        monkeypatch.setenv("AUTOFIT_DB", value)
        with pytest.raises(
            StoreError, match=r"^AUTOFIT_DB=.* names a relative path.*absolute path \(e.g. " + re.escape(str(tmp_path))
        ):
            Store()
    assert list(tmp_path.iterdir()) == []  # no file named garbage, no sub/
    monkeypatch.setenv("AUTOFIT_DB", str(tmp_path / "abs.db"))
    assert resolve_url().database == str(tmp_path / "abs.db")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("AUTOFIT_DB", "~/h.db")
    assert resolve_url().database == str(tmp_path / "home" / "h.db")
    monkeypatch.setenv("AUTOFIT_DB", "garbage")
    assert resolve_url("garbage").database == str(tmp_path / "garbage")  # an explicit --db may be relative


@pytest.mark.parametrize(
    "name", ["../../escape", "a/b", "..", ".hidden", "-rf", "with space", "x" * 101, "", "123", "naïve", "a\nb"]
)
def test_study_names_that_are_not_safe_path_components_are_refused(store, name):
    with pytest.raises(StoreError) as err:
        _study(store, name=name)
    message = str(err.value)
    assert message.startswith("study name ") and "letters, digits, '.', '_' or '-'" in message
    assert "\n" not in message
    assert store.list_studies() == []  # nothing stored


def test_safe_study_names_and_generated_ones(store):
    for name in ("baseline", "v1.2_lora-A", "7b-run", " padded "):
        assert _study(store, name=name).name == name.strip()
    odd = dataclasses.replace(gpt2_ctx(), model=dataclasses.replace(gpt2_ctx().model, name=".." + "x/" * 80))
    generated = _study(store, odd).name
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", generated), generated


def test_paths_that_cannot_hold_a_database(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match=re.escape(f"{tmp_path}/file is a file")):
        Store(str(tmp_path / "file" / "sub" / "x.db"))
    with pytest.raises(StoreError, match="is a directory"):
        Store(str(tmp_path))


def test_in_memory_sqlite_works_but_not_with_optuna():
    with Store("sqlite://") as store:
        study = _study(store)
        store.record_trial(study.id, gpt2_results(gpt2_ctx())[0])
        assert len(store.trials(study.id)) == 1
        with pytest.raises(StoreError, match="in-memory"):
            store.optuna_storage()


def test_importing_the_store_does_not_import_torch():
    code = "import sys, autofit.store, autofit.cli.db; assert 'torch' not in sys.modules, 'torch imported'"
    env = {**os.environ, "PYTHONPATH": ROOT}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)


# -- the answer: one rule, in Python (autofit.results) and in the store's SQL ---------------------
def _plans(ctx):
    gb = ctx.workload.global_batch
    ev = AnalyticEvaluator()
    return [ev.evaluate(Plan(micro_batch=mb, grad_accum=gb // mb), ctx) for mb in (1, 2, 4, 8)]


def _as(result, evaluator, status, tokens):
    throughput = dataclasses.replace(result.throughput, tokens_per_sec=tokens) if tokens is not None else None
    return dataclasses.replace(result, evaluator=evaluator, status=status, throughput=throughput)


def _python_answer(store, study_id):
    """The Python rule's winner among the study's rows, as the row it came from."""
    from autofit.results import winner

    trials = store.trials(study_id)
    results = [t.result() for t in trials]
    best = winner(results)
    return None if best is None else next(t for t, r in zip(trials, results) if r is best)


def test_store_best_and_the_python_rule_agree(store):
    """A measured fit supersedes the prediction of its plan (slower than predicted), a measured
    OOM overrides a predicted fit (the fastest prediction): the store's SQL answer (``best_trial``,
    ``list_studies``) and ``autofit.results.winner`` pick the same row."""
    from autofit.results import winner

    ctx = gpt2_ctx()
    a, b, c, _ = _plans(ctx)
    study = _study(store, ctx)
    rows = [
        (a, "analytic", Status.FITS, 300.0),  # predicted fastest ...
        (b, "analytic", Status.FITS, 150.0),
        (c, "analytic", Status.FITS, 250.0),  # predicted second ...
        (c, "measured", Status.FITS, 120.0),  # ... measured slower than b's prediction
        (a, "measured", Status.OOM, None),  # ... measured out of memory
    ]
    for r, evaluator, status, tokens in rows:
        store.record_trial(study.id, _as(r, evaluator, status, tokens))
    expected = _python_answer(store, study.id)
    assert (expected.plan, expected.evaluator, expected.tokens_per_sec) == (b.plan, "analytic", 150.0)
    assert store.best_trial(study.model_fingerprint, ctx.cluster.label).id == expected.id
    assert store.list_studies()[0].best.id == expected.id
    # the naive answer (fastest fitting row, superseded or not) would be a's prediction
    assert max((t for t in store.trials(study.id) if t.fits), key=lambda t: t.tokens_per_sec).plan == a.plan
    assert winner([t.result() for t in store.trials(study.id)]).plan == b.plan


_EVALUATORS = ("analytic", "simulated", "measured", "hand-made")  # an unknown name ranks below all


@functools.lru_cache(maxsize=1)
def _gpt2_plans():
    return tuple(_plans(gpt2_ctx()))


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 3),
            st.sampled_from(_EVALUATORS),
            st.sampled_from([Status.FITS, Status.FITS, Status.OOM, Status.SCREENED, Status.PRUNED]),
            st.sampled_from([100.0, 200.0, 300.0, None]),
            st.integers(0, 5),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_store_best_and_the_python_rule_agree_on_any_study(evaluations):
    """Any mix of evaluators, statuses, ties and trial numbers (rows of one plan recorded out of order)."""
    ctx = gpt2_ctx()
    plans = _gpt2_plans()
    with Store("sqlite://") as store:
        study = _study(store, ctx)
        for plan, evaluator, status, tokens, number in evaluations:
            store.record_trial(study.id, _as(plans[plan], evaluator, status, tokens), number=number)
        expected = _python_answer(store, study.id)
        best = store.best_trial(study.model_fingerprint, ctx.cluster.label)
        assert (best.id if best else None) == (expected.id if expected else None)
        summary = store.list_studies()[0].best
        assert (summary.id if summary else None) == (expected.id if expected else None)


# -- round trips --------------------------------------------------------------------------------
def test_a_cpu_study_keeps_its_memory_budget(store):
    """``--gpus 1xcpu --cpu-mem-budget`` sets the capacity every evaluation is judged by; a study
    read back (show, report, export, workers) judges by the same, not by this machine's RAM."""
    from autofit.search.loop import SearchRequest, request_from_study
    from autofit.search.request import build_context

    ctx = build_context("gpt2", "1xcpu", seq_len=256, global_batch=8, cpu_mem_budget="3GiB")
    assert ctx.capacity_bytes == 3 * 2**30
    study = store.create_study(ctx, evaluator="measured")
    back = store.get_study(study.id).context()
    assert back == ctx and back.capacity_bytes == back.cluster.gpu.memory_bytes == 3 * 2**30
    assert back.budget_bytes == ctx.budget_bytes
    request = request_from_study(store.get_study(study.id))
    assert request.ctx == ctx and request.request_key == SearchRequest(ctx=ctx, evaluator="measured").request_key
    assert study.request_key == request_key(ctx, evaluator="measured")


def test_a_trial_result_round_trips_through_its_dict(store):
    from autofit.results import TrialResult

    for r in [*gpt2_results(gpt2_ctx()), *llama_results(llama_ctx())]:
        assert TrialResult.from_dict(r.as_dict()) == r
        assert TrialResult.from_dict(json.loads(json.dumps(r.as_dict()))) == r


# -- retries while the database is away ---------------------------------------------------------
class _Flaky:
    """A store call that loses its connection ``fails`` times, then answers."""

    masked_url = "postgresql+psycopg://u:***@h/db"

    def __init__(self, fails: int, exc: BaseException | None = None):
        self.fails, self.calls = fails, 0
        self.exc = exc

    def _lost(self) -> BaseException:
        from sqlalchemy.exc import OperationalError

        return OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused\nsecond line"))

    def call(self) -> int:
        from autofit.store.store import retrying

        @retrying
        def once(self) -> int:
            self.calls += 1
            if self.calls <= self.fails:
                raise self.exc or self._lost()
            return 42

        return once(self)


@pytest.fixture
def waits(monkeypatch):
    """The backoff's sleeps, recorded instead of slept; 30 s of retries as by default."""
    import time

    from autofit.store import store as store_module

    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    monkeypatch.setattr(store_module, "RETRY_TOTAL_S", 30.0)
    return slept


def test_a_store_call_retries_a_lost_connection_with_backoff(waits):
    flaky = _Flaky(fails=3)
    assert flaky.call() == 42 and flaky.calls == 4
    assert waits == [0.5, 1.0, 2.0]


def test_a_store_call_gives_up_after_the_retry_time_in_one_line(waits):
    flaky = _Flaky(fails=1000)
    with pytest.raises(StoreError) as err:
        flaky.call()
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]  # 31.5 s waited: the 30 s are spent
    assert flaky.calls == 8
    assert str(err.value) == (
        "the database (postgresql+psycopg://u:***@h/db) is unreachable after 32 s of retries: "
        "(builtins.ConnectionRefusedError) connection refused; what was stored is kept — resume with --resume"
    )
    assert err.value.__cause__ is not None and "connection refused" in str(err.value.__cause__)


def test_a_query_the_database_rejects_is_raised_at_once(waits):
    from sqlalchemy.exc import IntegrityError

    rejected = IntegrityError("INSERT", {}, ValueError("duplicate key"))
    flaky = _Flaky(fails=1, exc=rejected)
    with pytest.raises(IntegrityError) as err:
        flaky.call()
    assert err.value is rejected and flaky.calls == 1 and waits == []
    refused = StoreError("study 7 not found")
    with pytest.raises(StoreError) as err:
        _Flaky(fails=1, exc=refused).call()
    assert err.value is refused and waits == []


def test_a_locked_sqlite_file_is_retried_but_not_other_sqlite_errors(waits):
    import sqlite3

    from sqlalchemy.exc import OperationalError

    locked = OperationalError("INSERT", {}, sqlite3.OperationalError("database is locked"))
    assert _Flaky(fails=2, exc=locked).call() == 42 and waits == [0.5, 1.0]
    broken = OperationalError("SELECT", {}, sqlite3.OperationalError("no such table: x"))
    with pytest.raises(OperationalError):
        _Flaky(fails=1, exc=broken).call()
    assert waits == [0.5, 1.0]


def test_the_backoff_restarts_once_the_database_answers(waits):
    from autofit.store.store import Backoff

    lost = _Flaky(0)._lost()
    backoff = Backoff()
    assert all(backoff.retry(lost) for _ in range(7)) and not backoff.retry(lost)
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0] and backoff.waited == 31.5
    assert not backoff.retry(StoreError("not a lost connection"))
    backoff.clear()
    assert backoff.waited == 0 and backoff.retry(lost) and waits[-1] == 0.5

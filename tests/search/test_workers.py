"""Many workers, one study: exact budgets, nothing lost or run twice (real processes, real databases)."""

import json
import os
import subprocess
import sys

import click
import optuna
import pytest
from click.testing import CliRunner

from autofit.cli import cli
from autofit.search.loop import SearchRequest, prepare_search
from autofit.search.request import build_context
from autofit.search.space import Allowed
from autofit.search.workers import gpu_subsets
from autofit.store import Store


def make_study(db_url, trials, global_batch=8):
    ctx = build_context("gpt2", "1xA10", seq_len=1024, global_batch=global_batch)
    req = SearchRequest(ctx=ctx, allowed=Allowed(), evaluator="analytic", trials=trials)
    with Store(db_url) as store:
        rec, finished = prepare_search(req, store)
    assert not finished
    return rec


def start_worker(db_url, study):
    env = {**os.environ, "AUTOFIT_DB": db_url}
    return subprocess.Popen(
        [sys.executable, "-m", "autofit", "worker", study, "--quiet"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def check_exact_budget(db_url, rec, budget):
    """The budget is a number of evaluated plans: exactly ``budget`` stored, none twice,
    every one linked to its Optuna trial; Optuna's other finished trials are duplicates."""
    with Store(db_url) as store:
        study = optuna.load_study(study_name=rec.optuna_study_name, storage=store.optuna_storage())
        states = [t.state.name for t in study.trials]
        assert "RUNNING" not in states and "WAITING" not in states
        rows = store.trials(rec.id)
        assert len(rows) == budget
        ids = [r.optuna_trial_id for r in rows]
        assert None not in ids and len(set(ids)) == len(ids)  # every row linked, none twice
        by_id = {t._trial_id: t for t in study.trials}
        assert all(i in by_id for i in ids)
        # every other finished trial proposed a plan another trial had evaluated (or was evaluating)
        for t in study.trials:
            if t.state.name in ("COMPLETE", "PRUNED") and t._trial_id not in ids:
                assert t.user_attrs.get("duplicate")
        assert len({r.plan_id for r in rows}) == len(rows)
        assert store.get_study(rec.id).status.value == "finished"
        return rows, study.trials


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.ranks("three worker processes, a core each")
def test_three_workers_on_postgresql_split_the_budget_exactly(pg_url):
    rec = make_study(pg_url, trials=15)
    procs = [start_worker(pg_url, rec.name) for _ in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    check_exact_budget(pg_url, rec, 15)


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.ranks("three worker processes, a core each")
def test_three_workers_keep_the_budget_exact_when_the_sampler_proposes_duplicates(pg_url):
    """A small space (180 plans) and a budget of 40 make TPE propose evaluated plans in
    every run; before the fix 3 of 5 such runs stored fewer plans than the budget."""
    rec = make_study(pg_url, trials=40, global_batch=1)
    procs = [start_worker(pg_url, rec.name) for _ in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    _, trials = check_exact_budget(pg_url, rec, 40)
    assert any(t.user_attrs.get("duplicate") for t in trials)


@pytest.mark.slow
@pytest.mark.ranks("two worker processes, a core each")
def test_two_workers_on_sqlite(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    rec = make_study(url, trials=10)
    procs = [start_worker(url, rec.name) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    check_exact_budget(url, rec, 10)


@pytest.mark.slow
@pytest.mark.ranks("--parallel 2 starts two worker processes")
def test_parallel_local_workers_from_the_cli(tmp_path):
    db = f"sqlite:///{tmp_path / 'p.db'}"
    r = CliRunner().invoke(
        cli,
        [
            "search",
            "--model",
            "gpt2",
            "--gpus",
            "1xA10",
            "--seq-len",
            "1024",
            "--global-batch",
            "8",
            "--evaluator",
            "analytic",
            "--trials",
            "8",
            "--parallel",
            "2",
            "--db",
            db,
            "--out",
            str(tmp_path / "o"),
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["best"]["fits"]
    with Store(db) as store:
        rec = store.get_study(data["study"])
    check_exact_budget(db, rec, 8)


def test_workers_zero_creates_the_study_and_a_worker_finishes_it(tmp_path):
    db = f"sqlite:///{tmp_path / 'w.db'}"
    args = [
        "search",
        "--model",
        "gpt2",
        "--gpus",
        "1xA10",
        "--seq-len",
        "1024",
        "--global-batch",
        "8",
        "--evaluator",
        "analytic",
        "--trials",
        "5",
        "--db",
        db,
        "--out",
        "",
        "--json",
    ]
    r = CliRunner().invoke(cli, [*args, "--workers", "0"])
    assert r.exit_code == 0, r.output
    study = json.loads(r.stdout)["study"]
    assert f"autofit worker {study}" in r.stderr
    w = CliRunner().invoke(cli, ["worker", study, "--db", db, "--json"])
    assert w.exit_code == 0, w.output
    assert json.loads(w.stdout)["best"]["fits"]
    with Store(db) as store:
        check_exact_budget(db, store.get_study(study), 5)


def test_worker_takes_its_study_as_the_first_argument(tmp_path):
    """STUDY is positional, as in show/export/report; ``--study`` (earlier versions) still reads the same."""
    db = f"sqlite:///{tmp_path / 'a.db'}"
    for args, fragment in [
        ([], "give the study to join: autofit worker STUDY"),
        (["a", "--study", "b"], "two studies given, 'a' and --study 'b'"),
        (["nope"], "no study named 'nope'"),
        (["--study", "nope"], "no study named 'nope'"),
    ]:
        r = CliRunner().invoke(cli, ["worker", *args, "--db", db])
        assert r.exit_code != 0 and fragment in r.output, (args, r.output)
        assert "Traceback" not in r.output


def test_gpu_subsets_are_disjoint_and_sized():
    assert gpu_subsets(4, 2, 8) == ["0,1", "2,3", "4,5", "6,7"]
    assert gpu_subsets(3, 1, 0) == [None, None, None]
    from autofit.errors import AutofitError

    with pytest.raises(AutofitError, match="needs 3 × 4 = 12 GPUs"):
        gpu_subsets(3, 4, 8)


def test_parallel_auto_adds_a_worker_per_8_simulated_trials(monkeypatch):
    from types import SimpleNamespace

    from autofit.search import workers

    monkeypatch.setattr(workers.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(workers, "_available_memory", lambda: 24 * 2**30)

    def auto(evaluator, trials):
        return workers.auto_parallel(SimpleNamespace(evaluator=evaluator, trials=trials))

    assert auto("simulated", 8) == 1  # the main command: a second worker would not answer sooner
    assert auto("simulated", 16) == 2
    assert auto("simulated", 64) == 2  # two cores
    assert auto("analytic", 400) == 1 and auto("measured", 64) == 1
    monkeypatch.setattr(workers, "_available_memory", lambda: 3 * 2**30)
    assert auto("simulated", 64) == 1  # room for one worker's 2 GiB


def test_parallel_option_takes_auto_or_a_count():
    from autofit.cli.options import ParallelType

    t = ParallelType()
    assert t.convert("auto", None, None) == "auto" and t.convert("AUTO", None, None) == "auto"
    assert t.convert("3", None, None) == 3 and t.convert(2, None, None) == 2
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(click.BadParameter, match="neither auto nor a count"):
            t.convert(bad, None, None)

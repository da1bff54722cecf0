"""Optuna's own tools read autofit's database as it is (the commands in the README), and none of
them names a plan that does not fit as the best trial."""

import dataclasses
import io
import json
import subprocess
import sys
import wsgiref.util
from pathlib import Path

import pytest

from autofit.results import Status


def optuna_study(study):
    import optuna

    with study.store() as store:
        rec = store.get_study(study.name)
        rows = store.trials(rec.id)
    loaded = optuna.load_study(study_name=rec.optuna_study_name, storage=study.url)
    assert {t.number: t.user_attrs["plan_id"] for t in loaded.trials if t.number in {r.number for r in rows}} == {
        r.number: r.plan_id for r in rows
    }
    return loaded, {r.number: r.tokens_per_sec for r in rows if r.fits}


def dashboard_get(url, path):
    """optuna-dashboard's JSON API on the storage ``url``, as its web page calls it."""
    dashboard = pytest.importorskip("optuna_dashboard", reason="pip install optuna-dashboard to check it")
    app = dashboard.wsgi(url)
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "QUERY_STRING": "", "wsgi.input": io.BytesIO()}
    wsgiref.util.setup_testing_defaults(environ)
    status = []
    body = b"".join(app(environ, lambda s, h, *a: status.append(s)))
    assert status[0].startswith("200"), (path, status)
    return json.loads(body)


def best_trial_by_every_tool(url, study) -> dict[str, int]:
    """The trial each Optuna tool names as the best: ``Study.best_trial`` (constraint-aware), the
    ``optuna best-trial`` command, optuna-dashboard's API (the storage's constraint-blind
    ``get_best_trial``), and a reader who knows nothing of constraints or states beyond COMPLETE."""
    complete = [t for t in study.trials if t.state.name == "COMPLETE"]
    cli = subprocess.run(
        [str(Path(sys.executable).parent / "optuna"), "best-trial", "--study-name", study.study_name]
        + ["--storage", url, "-f", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    summary = next(
        s for s in dashboard_get(url, "/api/studies")["study_summaries"] if s["study_name"] == study.study_name
    )
    detail = dashboard_get(url, f"/api/studies/{summary['study_id']}")
    return {
        "Study.best_trial": study.best_trial.number,
        "optuna best-trial": json.loads(cli.stdout)["number"],
        "optuna-dashboard": detail["best_trials"][0]["number"],
        "highest COMPLETE value": max(complete, key=lambda t: t.value).number,
    }


def stored_rows(study):
    with study.store() as store:
        return store.trials(store.get_study(study.name).id)


def assert_infeasible_plans_are_pruned(loaded, rows):
    """Every plan that does not fit is a PRUNED trial with a violated constraint (what TPE learns the
    boundary from) and no value of its own; every fitting one is COMPLETE with its tokens/s."""
    by_id = {t._trial_id: t for t in loaded.trials}
    for row in rows:
        if row.optuna_trial_id is None:  # a re-measurement: no Optuna trial
            continue
        t = by_id[row.optuna_trial_id]
        if row.fits:
            assert t.state.name == "COMPLETE" and t.value == pytest.approx(row.tokens_per_sec)
        elif row.status is not Status.PRUNED:
            assert t.state.name == "PRUNED" and t.value is None, (row.status, t.state)
            assert max(t.constraints.values()) > 0 and t.user_attrs["status"] == row.status.value


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning", "ignore::UserWarning")
def test_optuna_matplotlib_visualization_reads_our_storage(fitting_study):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as ovm

    study, values = optuna_study(fitting_study)
    assert {t.number: t.value for t in study.trials if t.number in values} == pytest.approx(values)
    ax = ovm.plot_optimization_history(study)
    drawn = {round(y, 3) for c in ax.collections for _, y in c.get_offsets().tolist()}
    assert drawn == {round(v, 3) for v in values.values()}  # a re-proposed plan repeats a stored value
    ax = ovm.plot_param_importances(study)
    params = {name for t in study.trials for name in t.params}
    labels = {t.get_text() for t in ax.get_yticklabels()}
    assert labels and labels <= params
    plt.close("all")


def test_optuna_dashboard_serves_our_study(fitting_study):
    study, values = optuna_study(fitting_study)
    summaries = dashboard_get(fitting_study.url, "/api/studies")["study_summaries"]
    assert [s["study_name"] for s in summaries] == [study.study_name]
    detail = dashboard_get(fitting_study.url, f"/api/studies/{summaries[0]['study_id']}")
    got = {t["number"]: t["values"][0] for t in detail["trials"] if t["number"] in values}
    assert got == pytest.approx(values)
    attrs = {a["key"]: a["value"] for a in detail["user_attrs"]}  # what the study is, on its page
    assert (attrs["autofit_study"], attrs["model"], attrs["gpus"]) == (fitting_study.name, "gpt2", "1xA10")
    assert "autofit's answer" in detail["note"]["body"]


def test_no_tool_names_a_plan_that_does_not_fit(tight_study):
    """mistral-7b on 2xA10: plans that do not fit are PRUNED, so every tool names a fitting plan, the
    same one. Where autofit's answer is a simpler plan within the time error of that one, the study
    says so (``autofit_answer``, and the dashboard's note)."""
    loaded, _ = optuna_study(tight_study)
    rows = stored_rows(tight_study)
    assert any(not r.fits for r in rows) and any(r.fits for r in rows)
    assert_infeasible_plans_are_pruned(loaded, rows)
    named = best_trial_by_every_tool(tight_study.url, loaded)
    assert len(set(named.values())) == 1, named
    trial = loaded.trials[named["Study.best_trial"]]
    outcome = tight_study.outcome
    fastest = outcome.tiebreak.fastest
    assert trial.user_attrs["plan_id"] == fastest.plan.plan_id
    answer = loaded.user_attrs["autofit_answer"]
    assert answer["plan_id"] == outcome.best.plan.plan_id
    if fastest is not outcome.best:
        assert answer["optuna_best_trial"] == trial.number and "simpler plan" in answer["why"]
    else:
        assert "optuna_best_trial" not in answer


class _ExactEvaluator:
    """A stand-in for an expensive backend: the analytic figures, stated without a time error (so
    the fastest fitting plan is the answer); every full fine-tuning plan runs out of memory when
    evaluated, as a plan the screen let through may."""

    name = "simulated"

    def evaluate(self, plan, ctx, on_step=None):
        from autofit.evaluators.analytic import AnalyticEvaluator

        r = AnalyticEvaluator().evaluate(plan, ctx)
        if r.fits and plan.method.value == "full":
            return dataclasses.replace(r, status=Status.OOM, reason="out of memory at step 1", evaluator=self.name)
        return dataclasses.replace(r, evaluator=self.name, extra={**r.extra, "time_error": 0.0})


def test_every_tool_names_autofits_winner(tmp_path, monkeypatch):
    """A study where plans are screened out and others run out of memory when evaluated: the
    dashboard's API, ``optuna best-trial``, ``Study.best_trial`` and the highest COMPLETE value all
    name autofit's answer (issue 18)."""
    import optuna

    import autofit.search.loop as loop
    from autofit.search.request import build_context
    from autofit.store import Store

    monkeypatch.setattr(loop, "get_evaluator", lambda backend, **kw: _ExactEvaluator())
    url = f"sqlite:///{tmp_path / 'autofit.db'}"
    ctx = build_context("llama-3.2-1b", "1xA10", seq_len=2048, global_batch=8)
    with Store(url) as store:
        out = loop.run_search(loop.SearchRequest(ctx=ctx, evaluator="simulated", trials=14), store)
        rows = store.trials(out.study.id)
    statuses = {r.status for r in rows}
    assert {Status.SCREENED, Status.OOM, Status.FITS} <= statuses, statuses
    loaded = optuna.load_study(study_name=out.study.optuna_study_name, storage=url)
    assert_infeasible_plans_are_pruned(loaded, rows)
    named = best_trial_by_every_tool(url, loaded)
    assert {loaded.trials[n].user_attrs["plan_id"] for n in named.values()} == {out.best.plan.plan_id}, named
    assert loaded.user_attrs["autofit_answer"]["trials"] == [named["Study.best_trial"]]
    assert loaded.user_attrs["gpus"] == "1xA10" and loaded.user_attrs["seq_len"] == 2048


def test_a_study_where_nothing_fits_has_no_best_trial(hopeless_study):
    """llama-3-70b on one T4: every trial is PRUNED, so no tool names a best trial."""
    loaded, values = optuna_study(hopeless_study)
    assert not values and {t.state.name for t in loaded.trials} == {"PRUNED"}
    with pytest.raises(ValueError):  # "Record does not exist": no COMPLETE trial
        _ = loaded.best_trial
    assert loaded.user_attrs["autofit_answer"] is None

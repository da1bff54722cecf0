"""Optuna's own tools read autofit's database as it is (the commands in the README)."""

import io
import json
import wsgiref.util

import pytest


def optuna_study(study):
    import optuna

    with study.store() as store:
        rec = store.get_study(study.name)
        rows = store.trials(rec.id)
    loaded = optuna.load_study(study_name=rec.optuna_study_name, storage=study.url)
    assert {t.number: t.user_attrs["plan_id"] for t in loaded.trials if t.number in {r.number for r in rows}} == {
        r.number: r.plan_id for r in rows
    }
    return loaded, {r.number: r.tokens_per_sec for r in rows}


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
    dashboard = pytest.importorskip("optuna_dashboard", reason="pip install optuna-dashboard to check it")
    study, values = optuna_study(fitting_study)
    app = dashboard.wsgi(fitting_study.url)

    def get(path):
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "QUERY_STRING": "", "wsgi.input": io.BytesIO()}
        wsgiref.util.setup_testing_defaults(environ)
        status = []
        body = b"".join(app(environ, lambda s, h, *a: status.append(s)))
        assert status[0].startswith("200"), (path, status)
        return json.loads(body)

    summaries = get("/api/studies")["study_summaries"]
    assert [s["study_name"] for s in summaries] == [study.study_name]
    detail = get(f"/api/studies/{summaries[0]['study_id']}")
    got = {t["number"]: t["values"][0] for t in detail["trials"] if t["number"] in values}
    assert got == pytest.approx(values)

"""PostgreSQL restarted in the middle of a search: retries, then the study completes, nothing lost.

Restarts the local server with Debian's ``pg_ctlcluster`` (root only); skipped elsewhere.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import optuna
import pytest

from autofit.store import Store

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.alone("it restarts the PostgreSQL server that other workers' tests are using"),
]


def _cluster():
    if os.geteuid() != 0 or not shutil.which("pg_ctlcluster") or not os.path.isdir("/etc/postgresql"):
        pytest.skip("restarting PostgreSQL needs root and Debian's pg_ctlcluster (the local service)")
    versions = sorted(os.listdir("/etc/postgresql"))
    if not versions:
        pytest.skip("no local PostgreSQL cluster under /etc/postgresql")
    return versions[-1]


def test_search_survives_a_postgresql_restart(pg_url):
    version = _cluster()
    budget = 120
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "autofit",
            "search",
            "-m",
            "gpt2",
            "-g",
            "1xA10",
            "--seq-len",
            "1024",
            "--global-batch",
            "8",
            "--evaluator",
            "analytic",
            "--trials",
            str(budget),
            "--out",
            "",
            "--json",
        ],
        env={**os.environ, "AUTOFIT_DB": pg_url},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with Store(pg_url) as store:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # wait until the search is well under way
            studies = store.list_studies()
            if studies and store.trials(studies[0].study.id).__len__() >= 10:
                break
            time.sleep(0.2)
        else:
            proc.kill()
            pytest.fail("the search did not start")
    subprocess.run(["pg_ctlcluster", version, "main", "restart"], check=True, timeout=120)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    data = json.loads(out)
    with Store(pg_url) as store:
        rec = store.get_study(data["study"])
        assert rec.status.value == "finished"
        study = optuna.load_study(study_name=rec.optuna_study_name, storage=store.optuna_storage())
        assert not {"RUNNING", "WAITING"} & {t.state.name for t in study.trials}
        rows = store.trials(rec.id)
        assert len(rows) == len({r.plan_id for r in rows}) == budget  # the budget of evaluated plans, exactly
        ids = [r.optuna_trial_id for r in rows]
        assert len(set(ids)) == len(ids) and None not in ids

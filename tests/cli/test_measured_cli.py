"""``autofit search --evaluator measured`` end to end on this machine's CPU (issue 5's "done means").

A tiny local config.json, the local CPU as the target with a 20.25 MiB budget per rank, 8
trials of 4 sequences of 128 tokens a step (two warm-up steps, one timed): the screen enqueues
the predicted-best plans, measured runs stop at the first allocation over the budget, the
analytic screen prunes plans predicted over it, Optuna's pruner may stop slow runs (at the third
step), every trial is stored, and the winner's exported files are the files its trial ran with.
The budget sits where the fused-loss plans' real peaks (about 5% above the analytic estimate)
cross it while their estimates stay inside the screen's margin (lora at micro-batch 4: 19.9 MiB
estimated, 21.0 MiB real).
"""

from __future__ import annotations

import hashlib
import json
import time

import pytest
from click.testing import CliRunner

from autofit.cli import cli
from autofit.plan import complexity
from autofit.results import ranked, tied
from autofit.store import Store
from tests.conftest import tiny

BUDGET = int(20.25 * 2**20)


@pytest.mark.slow
def test_measured_search_end_to_end_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    model = tmp_path / "tiny-mistral"
    tiny("mistral-7b").to_hf_config().save_pretrained(model)
    db = f"sqlite:///{tmp_path / 'a.db'}"
    out = tmp_path / "out"
    t0 = time.perf_counter()
    r = CliRunner().invoke(
        cli,
        [
            "search",
            "--model",
            str(model),
            "--gpus",
            "1xcpu",
            "--evaluator",
            "measured",
            "--trials",
            "8",
            "--cpu-mem-budget",
            "20.25MiB",
            "--headroom",
            "0",
            "--seq-len",
            "128",
            "--global-batch",
            "4",
            "--steps",
            "1",
            "--db",
            db,
            "--out",
            str(out),
            "--work-dir",
            str(tmp_path / "trials"),
            "--json",
        ],
    )
    wall = time.perf_counter() - t0
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    with Store(db) as store:
        study = store.get_study(data["study"])
        rows = [store.trial_result(t) for t in store.trials(study.id)]
    print(f"wall {wall:.1f} s; " + "; ".join(f"{x.status.value}: {x.plan.summary()}" for x in rows))
    assert study.evaluator == "measured" and study.status.value == "finished"
    assert sum(data["counts"].values()) == len(rows) >= 6  # the sampler may propose a plan twice

    measured = [x for x in rows if x.evaluator == "measured"]
    for x in measured:
        assert x.extra["device"] == "cpu" and x.extra["cpu_mem_budget"] == BUDGET
        assert x.extra["predicted"]["evaluator"] == "analytic"  # the stored pair
    fits = [x for x in measured if x.status.value == "fits"]
    ooms = [x for x in measured if x.status.value == "oom"]
    screened = [x for x in rows if x.status.value == "screened" and x.reason.startswith("predicted not to fit")]
    assert fits and ooms and screened
    for x in ooms:  # stopped at the first allocation over the budget, within its first steps
        assert x.extra["budget_hit"]["budget"] == BUDGET and x.extra["budget_hit"]["step"] <= 1
        assert x.memory.peak_allocated > BUDGET
    assert all(x.memory.peak_allocated <= BUDGET for x in fits)
    assert all(x.evaluator == "analytic" and x.memory.device_total > BUDGET for x in screened)

    # the answer: the simplest plan within the time error of the fastest, each plan by its latest
    # measurement (tied plans are measured again before the answer)
    standing = ranked(rows)
    best, fastest = standing[0], max(standing, key=lambda x: x.tokens_per_sec)
    assert best.evaluator == "measured" and best.fits
    assert tied(fastest, best) and complexity(best.plan) <= complexity(fastest.plan)
    assert data["best"]["plan_id"] == best.plan.plan_id
    # the exported files are the ones the winning trial ran with; plan.json adds what it measured
    exported = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()}
    ran = dict(best.extra["exported_sha256"])
    assert exported.keys() == ran.keys()
    assert exported.pop("plan.json") != ran.pop("plan.json") and exported == ran
    record = json.loads((out / "plan.json").read_text())
    assert record["plan_id"] == best.plan.plan_id and record["expected"]["evaluator"] == "measured"
    assert record["expected"]["tokens_per_sec"] == best.tokens_per_sec

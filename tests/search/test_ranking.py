"""The answer under the time model's error: ties go to the simpler plan; measured ties are run again."""

import dataclasses

import pytest

from autofit.evaluators.analytic import AnalyticEvaluator
from autofit.plan import Offload, Plan, Sharding, complexity
from autofit.results import (
    DEFAULT_TIME_ERROR,
    Status,
    Throughput,
    TrialResult,
    ranked,
    tiebreak,
    tied,
    time_error,
    winner,
)
from autofit.search.loop import REMEASURE_RUNS, SearchRequest, remeasure_candidates, run_search
from autofit.search.request import build_context
from autofit.search.space import Allowed

QLORA = Plan(method="qlora", lora_rank=16, micro_batch=1, grad_accum=16, fused_loss=True)
OFFLOADED = QLORA.replace(sharding="zero2", offload="optimizer")


def result(plan, tokens_per_sec, evaluator="analytic", **extra):
    return TrialResult(
        plan=plan,
        status=Status.FITS,
        evaluator=evaluator,
        throughput=Throughput(tokens_per_sec=tokens_per_sec, step_time_s=1.0),
        extra=extra,
    )


# -- the tie rule --------------------------------------------------------------------------------
def test_a_plan_one_percent_faster_with_zero2_and_offload_loses_to_the_plain_plan():
    """The issue's case: on one GPU, ZeRO-2 + CPU optimizer offload predicted 1% faster is a tie,
    and the plain plan is the answer; the fastest is named beside it with what it adds."""
    plain, offloaded = result(QLORA, 3000.0), result(OFFLOADED, 3030.0)
    for order in ([offloaded, plain], [plain, offloaded]):
        assert winner(order) is plain
        assert ranked(order) == (plain, offloaded)
    tb = tiebreak([offloaded, plain])
    assert tb.answer is plain and tb.fastest is offloaded and tb.simpler
    assert tb.gain == pytest.approx(0.01) and tb.error == DEFAULT_TIME_ERROR["analytic"]
    assert tb.changes == ("sharding none → zero2", "offload none → optimizer→cpu")
    d = tb.as_dict()
    assert d["within_error"] and d["fastest_plan_id"] == OFFLOADED.plan_id and d["answer_plan_id"] == QLORA.plan_id


def test_a_plan_faster_beyond_the_error_wins_however_complex():
    plain, offloaded = result(QLORA, 3000.0), result(OFFLOADED, 3000.0 * 1.4)
    assert winner([plain, offloaded]) is offloaded
    tb = tiebreak([plain, offloaded])
    assert not tb.simpler and tb.gain == 0.0 and tb.changes == () and tb.ties == (offloaded,)


def test_the_tie_uses_the_larger_error_of_the_two():
    """Two plans tie when the slower reaches the faster / (1 + e), e the larger of their errors."""
    fast, slow = result(OFFLOADED, 1100.0, time_error=0.05), result(QLORA, 1000.0, time_error=0.05)
    assert not tied(fast, slow) and winner([fast, slow]) is fast  # 10% apart, ±5%
    loose = dataclasses.replace(slow, extra={"time_error": 0.12})
    assert tied(fast, loose) and winner([fast, loose]) is loose
    exact = result(QLORA, 1100.0 / 1.05, time_error=0.05)
    assert tied(fast, exact)  # the boundary is a tie


def test_among_ties_the_simplest_then_the_fastest_then_the_first_evaluated():
    a = result(QLORA.replace(micro_batch=2, grad_accum=8), 1000.0)
    b = result(QLORA, 1040.0)  # mb1: more accumulation, so less simple than a
    c = result(OFFLOADED, 1100.0)
    d = result(QLORA.replace(micro_batch=2, grad_accum=8, attention="flash2"), 1090.0)
    assert ranked([c, b, a, d]) == (a, c, d, b)  # the answer, then the others fastest first
    same = result(a.plan.replace(precision="bf16-true"), 1000.0)  # as simple as a, as fast
    assert complexity(same.plan) == complexity(a.plan)
    assert winner([c, same, a]) is same and winner([c, a, same]) is a
    faster_same = result(a.plan.replace(precision="bf16-true"), 1010.0)
    assert winner([c, a, faster_same]) is faster_same  # equally simple: the faster


def test_a_measurement_is_judged_by_its_own_error():
    """A measured result's error is its noise floor, widened by the spread of its timed steps
    and of its runs; an evaluator that states its error (``extra["time_error"]``) is believed."""
    steady = result(QLORA, 1000.0, "measured", step_times_s=[1.0, 1.0, 1.0])
    assert time_error(steady) == DEFAULT_TIME_ERROR["measured"]
    noisy = result(QLORA, 1000.0, "measured", step_times_s=[0.8, 1.0, 1.2])
    assert time_error(noisy) == pytest.approx(2 * 0.2 / 3**0.5)  # twice the standard error of the mean
    rerun = result(QLORA, 1000.0, "measured", runs_tokens_per_sec=[1100.0, 1000.0])
    assert time_error(rerun) == pytest.approx(100 / 1050)
    assert time_error(result(QLORA, 1.0, time_error=0.07)) == 0.07
    assert time_error(result(QLORA, 1.0, "hand-made")) == 0.0  # no stated error: exact ties only
    # measured 5% apart: no tie (±3%); the plain plan is the answer only when within the noise
    fast, slow = result(OFFLOADED, 1050.0, "measured"), result(QLORA, 1000.0, "measured")
    assert winner([fast, slow]) is fast
    assert winner([dataclasses.replace(fast, throughput=Throughput(1020.0, 1.0)), slow]) is slow


# -- the main command's model on one GPU ---------------------------------------------------------
@pytest.mark.parametrize("gpus", ["1xRTX4090", "1xA100-80GB", "1xH100-80GB"])
def test_on_one_gpu_the_answer_shards_or_offloads_only_for_a_gain_beyond_the_error(gpus, tmp_path):
    from autofit.store import Store

    ctx = build_context("mistral-7b", gpus)
    with Store(f"sqlite:///{tmp_path / 'a.db'}") as store:
        out = run_search(SearchRequest(ctx=ctx, evaluator="analytic", trials=20), store)
    best, tb = out.best, out.tiebreak
    assert best is not None and tb.answer is best and tied(tb.fastest, best)
    fitting = [r for r in out.results if r.fits]
    plain = [r for r in fitting if r.plan.sharding is Sharding.NONE and r.plan.offload is Offload.NONE]
    if best.plan.sharding is not Sharding.NONE or best.plan.offload is not Offload.NONE:
        # only when no plain plan is within the error of it
        assert not plain or not tied(best, max(plain, key=lambda r: r.tokens_per_sec))
    else:
        assert best in plain
    assert all(complexity(best.plan) <= complexity(r.plan) for r in tb.ties)


# -- measured studies: the contenders are run again --------------------------------------------------
def test_remeasure_candidates_are_the_measured_ties_run_fewer_than_twice():
    a, b = result(QLORA, 1000.0, "measured"), result(OFFLOADED, 1010.0, "measured")
    far = result(QLORA.replace(micro_batch=2, grad_accum=8), 500.0, "measured")
    assert remeasure_candidates([a, b, far]) == [b, a]  # fastest first
    assert remeasure_candidates([a, far]) == []  # one contender: nothing to decide
    again = dataclasses.replace(b, extra={"runs_tokens_per_sec": [1010.0, 1012.0]})
    assert remeasure_candidates([a, b, far, again]) == [a]  # b has had its runs
    predicted = result(OFFLOADED, 1010.0)  # an estimate is not run again
    assert remeasure_candidates([a, predicted]) == []


class _NoisyMeasurement:
    """Stands in for the measured evaluator: the analytic figures, 6% slower on a plan's second run."""

    name = "measured"

    def __init__(self):
        self.runs = {}

    def evaluate(self, plan, ctx, on_step=None):
        n = self.runs[plan.plan_id] = self.runs.get(plan.plan_id, 0) + 1
        r = AnalyticEvaluator().evaluate(plan, ctx)
        if r.throughput is not None and n > 1:
            r = dataclasses.replace(
                r, throughput=dataclasses.replace(r.throughput, tokens_per_sec=r.tokens_per_sec * 0.94)
            )
        return dataclasses.replace(r, evaluator="measured", extra={**r.extra, "time_error": None})


def test_a_measured_study_runs_its_contenders_again_before_the_answer(store, monkeypatch):
    import autofit.search.loop as loop

    stub = _NoisyMeasurement()
    monkeypatch.setattr(loop, "get_evaluator", lambda backend, **kw: stub)
    ctx = build_context("llama-3.2-1b", "1xA10", seq_len=2048, global_batch=8)
    events = []
    req = SearchRequest(ctx=ctx, allowed=Allowed.parse(methods="lora"), evaluator="measured", trials=6)
    out = run_search(req, store, progress=lambda e, d: events.append((e, d)))
    rows = store.trials(out.study.id)
    first = {}
    for t in rows:
        first.setdefault(t.plan_id, t.result())
    measured_first = [r for r in first.values() if r.evaluator == "measured"]
    expected = {r.plan.plan_id for r in remeasure_candidates(measured_first)}
    assert expected  # the study has ties to settle
    again = [t for t in rows if t.result().extra.get("remeasured")]
    # the contenders are measured again until the ties are settled (a run may settle them before
    # every first contender has had its second run)
    assert again and {t.plan_id for t in again} <= expected
    assert len({t.plan_id for t in rows}) == 6  # the budget is plans
    assert all(stub.runs[p] <= REMEASURE_RUNS for p in stub.runs)
    assert [d["number"] for e, d in events if e == "remeasure"] == [t.number for t in again]
    for t in again:
        r = t.result()
        assert t.optuna_trial_id is None and t.number > max(
            x.number for x in rows if not x.result().extra.get("remeasured")
        )
        assert r.extra["runs_tokens_per_sec"] == [pytest.approx(first[t.plan_id].tokens_per_sec), r.tokens_per_sec]
        assert r.extra["predicted"] == first[t.plan_id].extra["predicted"]  # the stored pair is kept
    results = [t.result() for t in rows]
    assert remeasure_candidates(results) == []  # settled
    assert out.best is winner(out.results) and out.best.plan.plan_id in {t.plan_id for t in rows}
    assert out.best.evaluator == "measured"

"""The search loop end to end on the analytic backend, against SQLite and PostgreSQL."""

import dataclasses

import pytest

from autofit.plan import complexity
from autofit.results import Status, ranked, tied
from autofit.search.loop import SearchRequest, candidates, run_search, screen
from autofit.search.request import build_context
from autofit.search.space import Allowed, SearchSpace


def request(model="gpt2", gpus="1xA10", trials=12, seq_len=1024, global_batch=8, **allowed):
    ctx = build_context(model, gpus, seq_len=seq_len, global_batch=global_batch)
    return SearchRequest(ctx=ctx, allowed=Allowed.parse(**allowed), evaluator="analytic", trials=trials)


def test_screening_ranks_fitting_plans_first_and_enqueues_every_method():
    space = SearchSpace(request().ctx)
    scored = screen(space)
    fits = [r for _, r in scored if r.fits]
    assert fits and scored[0][1].fits
    assert [r.tokens_per_sec for r in fits] == sorted((r.tokens_per_sec for r in fits), reverse=True)
    picks = candidates(scored, 4)
    assert {p["method"] for p in picks[:3]} == {"full", "lora", "qlora"}


def test_search_stores_every_trial_and_returns_the_answer_of_the_whole_space(store):
    req = request()
    out = run_search(req, store)
    assert not out.from_store and not out.interrupted
    rows = store.trials(out.study.id)
    assert len(rows) == len(out.results) >= 8  # duplicates proposed by the sampler are not stored twice
    assert len({r.plan_id for r in rows}) == len(rows)
    assert out.best is not None and out.best.fits
    # the answer: the simplest plan within the time error of the fastest (results.ranked)
    fastest = max((r for r in out.results if r.fits), key=lambda r: r.tokens_per_sec)
    assert tied(fastest, out.best) and complexity(out.best.plan) <= complexity(fastest.plan)
    # the global batch is the user's in every plan
    assert all(r.plan.micro_batch * r.plan.grad_accum == 8 for r in out.results)
    # the screen enqueued its predicted answer first: the answer of the whole space is found
    space_answer = ranked([r for _, r in screen(SearchSpace(req.ctx))])[0]
    assert out.best.plan == space_answer.plan
    assert set(out.best_per_method) == {"full", "lora", "qlora"}
    assert store.get_study(out.study.name).status.value == "finished"


def test_an_identical_request_is_answered_from_the_store(store):
    first = run_search(request(), store)
    again = run_search(request(), store)
    assert again.from_store and again.study.id == first.study.id
    assert len(store.trials(first.study.id)) == len(first.results)
    fresh = run_search(request(), store, fresh=True)
    assert fresh.study.id != first.study.id and not fresh.from_store


def test_nothing_fits_says_what_it_would_take(store):
    out = run_search(request("llama-3-70b", "1xT4", trials=6, seq_len=4096, global_batch=4), store)
    assert out.best is None and out.closest is not None
    assert all(r.status is Status.OOM for r in out.results)
    text = " ".join(out.advice)
    assert "needs" in text and ("fits" in text or "smaller model" in text)


def _optuna_trials(store, rec):
    import optuna

    return optuna.load_study(study_name=rec.optuna_study_name, storage=store.optuna_storage()).trials


def test_interrupted_search_resumes_without_rerunning_finished_plans(store):
    req = request(trials=10)
    seen = []

    def stop_after_three(event, data):
        if event == "trial-done":
            seen.append(data["result"].plan.plan_id)
            if len(seen) == 3:
                raise KeyboardInterrupt

    out = run_search(req, store, progress=stop_after_three)
    assert out.interrupted and len(store.trials(out.study.id)) == 3
    assert store.get_study(out.study.id).status.value == "interrupted"
    done = run_search(req, store, resume=True)
    assert done.study.id == out.study.id and not done.interrupted
    rows = store.trials(out.study.id)
    assert len(rows) == 10  # the budget is 10 evaluated plans, exactly
    assert len({r.plan_id for r in rows}) == len(rows)  # nothing evaluated twice
    states = [t.state.name for t in _optuna_trials(store, done.study)]
    assert states.count("FAIL") == 1  # the trial Ctrl-C stopped after its result was stored: not run again
    assert "WAITING" not in states and "RUNNING" not in states


def test_a_plan_interrupted_before_its_result_is_run_again_on_resume(store):
    """Ctrl-C inside an evaluation loses that trial; --resume queues its plan first (issue 12)."""
    req = request(trials=8)
    started = []

    def stop_in_the_fourth(event, data):
        if event == "trial-start":
            started.append(data["plan"].plan_id)
            if len(started) == 4:
                raise KeyboardInterrupt  # as if Ctrl-C landed while the plan was evaluated

    out = run_search(req, store, progress=stop_in_the_fourth)
    lost = started[3]
    assert out.interrupted and lost not in {r.plan_id for r in store.trials(out.study.id)}
    events = []
    done = run_search(req, store, resume=True, progress=lambda e, d: events.append((e, d)))
    rows = store.trials(done.study.id)
    assert lost in {r.plan_id for r in rows} and len(rows) == 8
    assert ("requeued", {"numbers": [3]}) in events
    trials = _optuna_trials(store, done.study)
    retry = [t for t in trials if t.system_attrs.get("failed_trial") == 3]
    assert len(retry) == 1 and retry[0].state.name == "COMPLETE"  # queued once, by Optuna's retry callback


def test_duplicates_do_not_use_up_the_budget(store):
    """A plan the sampler proposes again is not an evaluation: the study still stores exactly
    ``trials`` plans (before the fix: 21 of 24 with this seed)."""
    ctx = build_context("gpt2", "1xT4", seq_len=1024, global_batch=16)
    req = SearchRequest(ctx=ctx, allowed=Allowed(), evaluator="analytic", trials=24, seed=4)
    out = run_search(req, store)
    rows = store.trials(out.study.id)
    assert len(rows) == 24 and len({r.plan_id for r in rows}) == 24
    trials = _optuna_trials(store, out.study)
    assert any(t.user_attrs.get("duplicate") for t in trials)  # the seed does propose duplicates
    assert out.ending == "done"


def test_a_space_smaller_than_the_budget_is_exhausted_not_looped(store):
    """Every plan evaluated before the budget: the search stops and says so."""
    ctx = build_context("gpt2", "1xcpu", seq_len=1024, global_batch=1)
    allowed = Allowed.parse(methods="full")  # 8 plans
    size = SearchSpace(ctx, allowed).size()
    req = SearchRequest(ctx=ctx, allowed=allowed, evaluator="analytic", trials=size + 10)
    events = []
    out = run_search(req, store, progress=lambda e, d: events.append(e))
    rows = store.trials(out.study.id)
    assert out.exhausted and "exhausted" in events
    assert len(rows) == size and len({r.plan_id for r in rows}) == size
    assert store.get_study(out.study.id).status.value == "finished"


def test_warm_start_enqueues_past_winners_mapped_into_the_new_space(store):
    from autofit.search.loop import warm_start

    first = run_search(request(global_batch=8), store)
    new = request(global_batch=12)  # a new workload: micro-batches must divide 12 now
    space = SearchSpace(new.ctx, new.allowed)
    params = warm_start(new, store, space)
    assert params
    plan = space.suggest(__import__("optuna").trial.FixedTrial(params[0]))
    old = first.best.plan
    assert plan.method == old.method and plan.attention == old.attention and plan.sharding == old.sharding
    assert 12 % plan.micro_batch == 0
    # the same request again: the past winner is also the screen's first pick, and the queue
    # still holds as many distinct plans as a cold start's
    from autofit.search.loop import ENQUEUE_MAX, prepare_search

    again, _ = prepare_search(request(global_batch=8), store, fresh=True)
    study = __import__("optuna").load_study(study_name=again.optuna_study_name, storage=store.optuna_storage())
    queued = [t.system_attrs["fixed_params"] for t in study.trials]
    assert len(queued) == ENQUEUE_MAX and all(q not in queued[:i] for i, q in enumerate(queued))
    # a model of the same family with another size borrows its nearest relative's winners
    kin = SearchRequest(ctx=build_context("gpt2-xl", "1xA10", seq_len=1024, global_batch=8), evaluator="analytic")
    assert warm_start(kin, store, SearchSpace(kin.ctx, kin.allowed))
    # another GPU type starts cold
    cold = SearchRequest(ctx=build_context("gpt2", "1xL4", seq_len=1024, global_batch=8), evaluator="analytic")
    assert warm_start(cold, store, SearchSpace(cold.ctx, cold.allowed)) == []


def test_a_measured_study_searches_and_enqueues_only_plans_it_can_measure(store):
    """On 2xcpu a fused loss is not measured (multi-rank, no Liger): the analytic screen ranks
    such plans first; in a measured study they are not in the space, so no trial of the budget
    goes to a ``failed`` result."""
    import dataclasses

    import optuna

    from autofit.evaluators.measured import not_measurable
    from autofit.search.loop import prepare_search
    from tests.conftest import tiny

    ctx = build_context("gpt2", "2xcpu", seq_len=256, global_batch=16, cpu_mem_budget="120MiB")
    ctx = dataclasses.replace(ctx, model=tiny("mistral-7b", layers=4, vocab_size=4000))
    req = SearchRequest(ctx=ctx, allowed=Allowed.parse(methods="full"), evaluator="measured", trials=12)
    analytic = SearchSpace(ctx, req.allowed)
    favourites = [analytic.suggest(_Replay(p)) for p in candidates(screen(analytic), 6)]
    assert any(p.fused_loss for p in favourites)  # what the screen would enqueue in the full space
    space = req.space()
    plans = list(space.enumerate())
    assert plans and all(not not_measurable(p, ctx, "cpu") for p in plans)
    assert len(plans) == sum(not p.fused_loss for p in analytic.enumerate())
    rec, finished = prepare_search(req, store)
    assert not finished
    study = optuna.load_study(study_name=rec.optuna_study_name, storage=store.optuna_storage())
    enqueued = [space.suggest(_Replay(t.system_attrs["fixed_params"])) for t in study.trials]
    assert [p.plan_id for p in enqueued] == [space.suggest(_Replay(p)).plan_id for p in candidates(screen(space), 6)]
    # one process, no engine: a fused loss runs there, and a measured study still searches it
    single = dataclasses.replace(req, ctx=build_context("gpt2", "1xcpu", seq_len=256, global_batch=16))
    assert any(p.fused_loss for p in single.space().enumerate())


class _Replay:
    def __init__(self, params):
        self.params = params

    def suggest_categorical(self, name, choices):
        return self.params[name]


def test_warm_start_keeps_the_tokens_per_micro_batch_when_the_sequence_grows(store):
    import optuna

    from autofit.search.loop import warm_start

    old = run_search(request(global_batch=8, seq_len=512), store).best.plan
    assert old.micro_batch >= 2  # else keeping the micro-batch and keeping the tokens agree
    longer = request(global_batch=8, seq_len=1024)
    space = SearchSpace(longer.ctx, longer.allowed)
    plan = space.suggest(optuna.trial.FixedTrial(warm_start(longer, store, space)[0]))
    assert plan.micro_batch == old.micro_batch // 2


def test_a_warm_plan_predicted_not_to_fit_the_new_workload_is_not_enqueued(store, monkeypatch):
    import optuna

    from autofit.search import loop as search

    req = request(trials=12)
    scored = screen(SearchSpace(req.ctx, req.allowed))
    doomed = next(p for p, r in scored if not r.fits)
    good = next(p for p, r in scored if r.fits)
    monkeypatch.setattr(search, "warm_start", lambda *a, **k: [doomed, good])
    events = []
    rec, _ = search.prepare_search(req, store, progress=lambda e, d: events.append((e, d)))
    queued = [
        t.system_attrs["fixed_params"]
        for t in optuna.load_study(study_name=rec.optuna_study_name, storage=store.optuna_storage()).trials
    ]
    assert doomed not in queued and queued[0] == good
    assert ("warm-start", {"n": 1, "dropped": 1}) in events


def test_a_search_stopped_by_an_error_is_marked_failed_and_resumes(store, monkeypatch):
    """Not left ``running``: ``failed``, and ``--resume`` finds it and runs it to its budget."""
    req = request(trials=6)
    real = type(store).record_trial
    calls = []

    def breaks_at_the_third(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the disk is on fire")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(store), "record_trial", breaks_at_the_third)
    with pytest.raises(RuntimeError, match="on fire"):
        run_search(req, store)
    (summary,) = store.list_studies()
    assert summary.study.status.value == "failed"
    monkeypatch.undo()
    done = run_search(req, store, resume=True)
    assert done.study.id == summary.study.id and not done.interrupted
    assert len(store.trials(done.study.id)) == 6
    assert store.get_study(done.study.id).status.value == "finished"


def test_a_trial_orphaned_inside_ask_by_a_lost_connection_is_failed_not_waited_for(store, monkeypatch):
    """The database goes away after ``ask`` created a trial but before the objective ran: that
    trial must be failed and its slot reused, or the
    search waits for it forever at the end of its budget (seen once under a PostgreSQL restart)."""
    import sqlite3

    import optuna
    from sqlalchemy.exc import OperationalError

    real = optuna.samplers.TPESampler.before_trial  # called by Trial.__init__, inside study.ask()
    calls = []

    def drops_once(self, study, trial):
        calls.append(trial.number)
        if len(calls) == 3:
            raise OperationalError("SELECT ...", {}, sqlite3.OperationalError("database is locked"))
        return real(self, study, trial)

    monkeypatch.setattr(optuna.samplers.TPESampler, "before_trial", drops_once)
    req = dataclasses.replace(request(trials=6), timeout_s=60)
    out = run_search(req, store)
    assert out.ending == "done"  # before: "timeout", waiting on the orphan with 5 of 6 evaluated
    assert len(store.trials(out.study.id)) == 6
    states = [t.state.name for t in _optuna_trials(store, out.study)]
    assert "RUNNING" not in states and states.count("FAIL") == 1


class _StubEvaluator:
    """A stand-in for an expensive backend: the analytic figures under another name; the
    pruner stops every plan of one method (what the measured evaluator returns then)."""

    name = "simulated"

    def evaluate(self, plan, ctx, on_step=None):
        from autofit.evaluators.analytic import AnalyticEvaluator

        r = dataclasses.replace(AnalyticEvaluator().evaluate(plan, ctx), evaluator=self.name)
        if r.fits and plan.method.value == "lora":
            return dataclasses.replace(
                r, status=Status.PRUNED, reason="stopped at step 2: cannot beat the best", extra={"pruned_by": "pruner"}
            )
        return r


def test_screened_and_pruned_are_two_statuses(store, monkeypatch):
    """A plan predicted not to fit is ``screened`` (never evaluated); a run the pruner stops is
    ``pruned``. Both are PRUNED Optuna trials (no COMPLETE value to be shown as the best), told
    apart by the ``status`` user attribute and by their constraints: a screened plan's are violated."""
    import optuna

    import autofit.search.loop as loop

    monkeypatch.setattr(loop, "get_evaluator", lambda backend, **kw: _StubEvaluator())
    ctx = build_context("llama-3.2-1b", "1xA10", seq_len=2048, global_batch=8)
    out = run_search(SearchRequest(ctx=ctx, evaluator="simulated", trials=16), store)
    rows = store.trials(out.study.id)
    screened = [t for t in rows if t.status is Status.SCREENED]
    pruned = [t for t in rows if t.status is Status.PRUNED]
    assert screened and pruned
    assert all(t.evaluator == "analytic" and t.reason.startswith("predicted not to fit") for t in screened)
    assert all(t.evaluator == "simulated" and t.extra["pruned_by"] == "pruner" for t in pruned)
    assert out.counts()["screened"] == len(screened) and out.counts()["pruned"] == len(pruned)
    study = optuna.load_study(study_name=out.study.optuna_study_name, storage=store.optuna_storage())
    by_id = {t._trial_id: t for t in study.trials}
    assert {by_id[t.optuna_trial_id].state for t in pruned + screened} == {optuna.trial.TrialState.PRUNED}
    assert {by_id[t.optuna_trial_id].user_attrs["status"] for t in screened} == {"screened"}
    assert {by_id[t.optuna_trial_id].user_attrs["status"] for t in pruned} == {"pruned"}
    assert all(max(by_id[t.optuna_trial_id].constraints.values()) > 0 for t in screened)
    assert all(max(by_id[t.optuna_trial_id].constraints.values()) <= 0 for t in pruned)


def test_the_work_loop_waits_out_an_outage_with_the_stores_backoff(monkeypatch):
    """PostgreSQL away: the loop waits as a store call does, then says how to resume."""
    import time
    import types

    from sqlalchemy.exc import IntegrityError, OperationalError

    from autofit.errors import AutofitError
    from autofit.search.loop import _Outage
    from autofit.store import store as store_module

    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    monkeypatch.setattr(store_module, "RETRY_TOTAL_S", 30.0)
    outage = _Outage(types.SimpleNamespace(masked_url="postgresql+psycopg://u:***@h/db"))
    lost = OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused"))
    for _ in range(7):
        outage.wait_or_raise(lost)
    assert slept == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    with pytest.raises(AutofitError) as err:
        outage.wait_or_raise(lost)
    assert str(err.value) == (
        "the database (postgresql+psycopg://u:***@h/db) is unreachable after 32 s of retries; "
        "every finished trial is stored — resume with `autofit search ... --resume`"
    )
    assert err.value.__cause__ is lost and len(slept) == 7
    outage.clear()  # a trial ran: the next outage starts over
    outage.wait_or_raise(lost)
    assert slept[-1] == 0.5
    rejected = IntegrityError("INSERT", {}, ValueError("duplicate key"))
    with pytest.raises(IntegrityError) as err:
        outage.wait_or_raise(rejected)
    assert err.value is rejected and len(slept) == 8

"""The search: an Optuna study over the space, every trial stored, the answer (the fastest fitting plan,
or the simplest within the time error of it) returned.

How a study runs (``run_search``):

1. *Screening.* The whole space is scored with the analytic evaluator (microseconds per
   plan). The predicted-fastest fitting plans — the best of each method first — are
   ``enqueue_trial``-ed so the expensive evaluator spends its budget where winners are.
2. *Sampling.* Optuna's TPE sampler (multivariate, grouped for the conditional space)
   proposes the rest; fit is the constraint (``Trial.set_constraint``), effective
   tokens/s the objective.
3. *Pruning before evaluation.* Every proposed plan is scored analytically first; a plan
   predicted not to fit is recorded as ``screened`` with its reason and costs nothing more
   (Optuna still sees it as an infeasible trial, so the sampler learns the boundary).
   Measured runs report per-step throughput through ``trial.report`` and Optuna's pruner
   stops the ones that cannot win (recorded as ``pruned``).
4. Every evaluation is a row in the store; the answer is read back from the store: the simplest
   plan within the time error of the fastest (``autofit.results.ranked``).
5. *Re-measurement.* In a measured study, once the budget is spent, the measured plans within
   the time error of the fastest one (``autofit.results.tied``) are measured once more, each
   run stored as a further row of its plan, so one short run's noise does not pick the
   winner; the answer reads the latest run and a time error widened by the runs' spread.

The budget is a number of *evaluated plans*. A plan the sampler proposes again is not
evaluated twice and does not count; after a few such proposals in a row the screen's best
unevaluated plan is queued, and when every plan of the space is evaluated the search stops
(``exhausted``) instead of looping.

Progress events (``progress(event, data)``): ``start`` {study, budget, done, best},
``screening`` {space}, ``screened`` {n, fits}, ``warm-start`` {n, dropped}, ``trial-start`` {number,
plan}, ``trial-done`` {number, result}, ``trial-duplicate`` {number, result} (the sampler
proposed a plan already evaluated; nothing new is stored), ``requeued`` {numbers} (trials lost
with their worker, whose plans are queued again), ``exhausted`` {n}, ``remeasure`` {number, plan,
tokens_per_sec} (then ``trial-done``).

Ctrl-C, wherever it lands, leaves finished trials stored and the study marked
``interrupted``; the trial it cut short is failed and its plan queued again when the study
is resumed (``--resume``).
"""

from __future__ import annotations

import dataclasses
import secrets
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from autofit.errors import AutofitError
from autofit.evaluators import get_evaluator
from autofit.evaluators.analytic import AnalyticEvaluator
from autofit.evaluators.base import StepReport
from autofit.plan import Method, Plan
from autofit.results import (
    MemoryAnatomy,
    Status,
    Throughput,
    Tiebreak,
    TrialResult,
    authoritative,
    best_per_method,
    ranked,
    tiebreak,
    tied,
)
from autofit.search import calibration
from autofit.search.space import Allowed, SearchSpace
from autofit.specs import Target

DEFAULT_TRIALS = {"analytic": 40, "simulated": 8, "measured": 12}
ENQUEUE_MAX = 6
# A real run settles what the estimate cannot: before a measured trial, only plans the
# analytic estimate puts more than this far over the budget are pruned. Its peaks are
# within a few percent of real steps (tests/evaluators/test_analytic.py), and a plan
# wrongly pruned may be the winner, while one wrongly run stops at its first step.
SCREEN_MARGIN = {"measured": 0.05}


@dataclass(frozen=True)
class SearchRequest:
    ctx: Target
    allowed: Allowed = field(default_factory=Allowed)
    evaluator: str = "analytic"  # resolved: analytic | simulated | measured
    trials: int = 40
    timeout_s: float | None = None
    seed: int = 0
    # keyword options of the evaluator (measured: steps, trial timeout, work dir)
    evaluator_options: Mapping[str, Any] = field(default_factory=dict)
    calibrate: bool = True  # correct predictions by what was measured on this GPU type

    @property
    def request_key(self) -> str:
        """Identical requests share this key (the budget is not part of it)."""
        from autofit.store import request_key

        return request_key(self.ctx, evaluator=self.evaluator, allowed=self.allowed.as_dict())

    def space(self) -> SearchSpace:
        """The plans this request searches: for a measured study, only what it can run (fused
        losses where they run)."""
        single_rank = False
        if self.evaluator == "measured":
            from autofit.evaluators.measured import device_kind, liger_runs

            single_rank = not liger_runs(self.ctx, device_kind(self.ctx))
        return SearchSpace(
            self.ctx,
            self.allowed,
            fused_loss_single_rank_only=single_rank,
        )

    @property
    def budget(self) -> dict[str, Any]:
        """What workers need to run the study the same way (node-local options stay out)."""
        portable = {k: v for k, v in self.evaluator_options.items() if k in _PORTABLE_OPTIONS}
        return {"trials": self.trials, "timeout_s": self.timeout_s, "seed": self.seed, "evaluator": portable}


@dataclass(frozen=True)
class SearchOutcome:
    study: Any  # autofit.store.StudyRecord
    results: tuple[TrialResult, ...]
    best: TrialResult | None
    best_per_method: dict[str, TrialResult]
    tiebreak: Tiebreak | None = None  # the answer beside the fastest plan (None when nothing fits)
    closest: TrialResult | None = None
    advice: tuple[str, ...] = ()
    from_store: bool = False
    ending: str = "done"  # why the search stopped: done | interrupted | exhausted | timeout (work())
    elapsed_s: float = 0.0

    @property
    def interrupted(self) -> bool:
        return self.ending == "interrupted"

    @property
    def exhausted(self) -> bool:
        """Every plan of the space was evaluated before the budget was spent."""
        return self.ending == "exhausted"

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.results:
            out[r.status.value] = out.get(r.status.value, 0) + 1
        return out


Progress = Callable[[str, dict[str, Any]], None]


def _constraint(result: TrialResult, ctx: Target) -> list[float]:
    """Optuna's convention: <= 0 is feasible. Relative excess of device and host memory; a plan that
    ran out of memory below the budget (a real run's fragmentation, a spike the figures miss) is
    infeasible all the same, barely: every plan stored as not fitting violates a constraint."""
    if result.memory is None or result.status in (Status.FAILED, Status.TIMEOUT):
        return [1.0, 1.0]
    m = result.memory
    device = (m.device_total - ctx.budget_bytes) / ctx.budget_bytes
    host = (m.host_bytes - ctx.cluster.host_memory_bytes) / ctx.cluster.host_memory_bytes
    if result.status is Status.OOM and max(device, host) <= 0:
        device = OOM_BELOW_BUDGET
    return [device, host]


OOM_BELOW_BUDGET = 1e-3  # the constraint of a plan that ran out of memory below the budget: just infeasible


def _set_constraints(trial, result: TrialResult, ctx: Target) -> None:
    device, host = _constraint(result, ctx)
    trial.set_constraint("device_memory", device)
    trial.set_constraint("host_memory", host)


def _told(result: TrialResult) -> float:
    """What the trial's Optuna record says: a fitting plan's tokens/s, COMPLETE. Any other outcome
    (screened out, over the budget, failed, stopped by the pruner) ends the trial PRUNED, its
    constraints already set. TPE still learns the boundary from it: it ranks an infeasible trial by
    its constraint violation whatever its state, and it reads PRUNED trials as it reads COMPLETE
    ones (``optuna/samplers/_tpe/sampler.py``: ``_split_trials``, ``_get_infeasible_trial_score``;
    the group search space with ``include_pruned=True``). And no Optuna tool can show such a plan as
    the best trial: ``Study.best_trial``, the storage's ``get_best_trial`` that optuna-dashboard
    calls (constraint-blind), and a reader who takes the highest COMPLETE value all see COMPLETE
    trials only."""
    import optuna

    if not result.fits:
        raise optuna.TrialPruned(result.reason or str(result.status))
    return result.tokens_per_sec


def screen(space: SearchSpace, cal: calibration.Calibration | None = None) -> list[tuple[dict[str, Any], TrialResult]]:
    """Every plan of the space with its analytic result (calibrated if given), fastest fitting first."""
    ev = AnalyticEvaluator()
    scored = [(params, ev.evaluate(plan, space.ctx)) for params, plan in space.enumerate_params()]
    if cal is not None:
        scored = [(params, cal.apply(r, space.ctx)) for params, r in scored]
    scored.sort(key=lambda pr: (not pr[1].fits, -pr[1].tokens_per_sec))
    return scored


def candidates(scored: list[tuple[dict[str, Any], TrialResult]], k: int) -> list[dict[str, Any]]:
    """What to enqueue: each method's predicted answer (the simplest plan within the time error
    of its fastest, ``autofit.results.ranked``), the predicted answer's method first, then the
    other plans as the answer rule ranks them. So the simpler of two plans the estimate cannot
    tell apart is the one evaluated first, and a simpler plan is never left unevaluated behind
    a complex one it ties."""
    params_of = {r.plan.plan_id: p for p, r in scored}
    fitting = [r for _, r in scored if r.fits]
    picks: list[dict[str, Any]] = []
    seen: set[str] = set()
    for r in (*best_per_method(fitting).values(), *ranked(fitting)):
        if r.plan.plan_id in seen:
            continue
        seen.add(r.plan.plan_id)
        picks.append(params_of[r.plan.plan_id])
        if len(picks) >= k:
            break
    return picks


class _Objective:
    def __init__(self, request: SearchRequest, space: SearchSpace, store, study_id: int, progress: Progress | None):
        self.request, self.space, self.store, self.study_id = request, space, store, study_id
        self.claim: _Claim | None = None  # held until this trial's plan is known not to be a duplicate
        self.current: int | None = None  # number of the trial being evaluated
        self.duplicates_in_a_row = 0  # plans the sampler proposed again, since the last new one
        self.progress = progress or (lambda event, data: None)
        self.screen = AnalyticEvaluator()
        gpu = request.ctx.cluster.gpu.name
        self.calibrations = {
            ev: (calibration.from_store(store, gpu, ev) if request.calibrate else None)
            for ev in ("analytic", "simulated")
        }
        self.evaluator = (
            None
            if request.evaluator == "analytic"
            else get_evaluator(request.evaluator, **dict(request.evaluator_options))
        )
        self._by_prediction: list[tuple[dict[str, Any], str]] | None = None

    def __call__(self, trial) -> float:
        import optuna

        self.current = trial.number
        ctx = self.request.ctx
        try:
            plan = self.space.suggest(trial)
            trial.set_user_attr("plan_id", plan.plan_id)
            known = {t.plan_id: t for t in self.store.trials(self.study_id)}  # by any worker
            in_flight = _in_flight(trial.study, exclude=trial.number)
        finally:  # other workers may claim now: this trial's plan is marked, the check is done
            if self.claim is not None:
                self.claim.release()
        self.progress("trial-start", {"number": trial.number, "plan": plan})
        if plan.plan_id in known or plan.plan_id in in_flight:
            # proposed again: no new evaluation, and the budget still has the slot (the
            # work loop claims another trial); the sampler learns the known value
            self.duplicates_in_a_row += 1
            trial.set_user_attr("duplicate", True)
            if plan.plan_id not in known:  # being evaluated by another worker: no value yet
                raise optuna.TrialPruned(f"plan {plan.plan_id} is being evaluated by another worker")
            result = known[plan.plan_id].result()
            _set_constraints(trial, result, ctx)
            self.progress("trial-duplicate", {"number": trial.number, "result": result})
            return _told(result)
        self.duplicates_in_a_row = 0
        predicted = self._calibrated(self.screen.evaluate(plan, ctx))
        if self.evaluator is None:
            result = predicted
        elif not _may_fit(predicted, ctx, SCREEN_MARGIN.get(self.request.evaluator, 0.0)):
            result = dataclasses.replace(
                predicted, status=Status.SCREENED, reason=f"predicted not to fit: {predicted.reason}"
            )
        else:
            result = self._calibrated(self.evaluator.evaluate(plan, ctx, on_step=self._reporter(trial)))
            # the stored pair: this evaluation beside the estimate it was screened by
            result = dataclasses.replace(result, extra={**result.extra, "predicted": _prediction(predicted)})
        self.store.record_trial(self.study_id, result, number=trial.number, optuna_trial_id=trial._trial_id)
        trial.set_user_attr("status", result.status.value)
        _set_constraints(trial, result, ctx)
        self.progress("trial-done", {"number": trial.number, "result": result})
        return _told(result)

    def remeasure(self, earlier: TrialResult, runs: list[float]) -> TrialResult:
        """``earlier``'s plan measured once more, to its end (no pruner: it ran to the end
        before), with the estimate it was screened by and every run's tokens/s
        (``extra["runs_tokens_per_sec"]``, this one last when it fits)."""
        result = self.evaluator.evaluate(earlier.plan, self.request.ctx)
        extra = {**result.extra, "remeasured": True}
        if result.fits:
            extra["runs_tokens_per_sec"] = [*runs, result.tokens_per_sec]
        if "predicted" in earlier.extra:
            extra["predicted"] = earlier.extra["predicted"]
        return dataclasses.replace(result, extra=extra)

    def next_unevaluated(self, taken: set[str]) -> dict[str, Any] | None:
        """Params of the plan the analytic screen ranks first among those not in ``taken``
        (where the sampler only proposes plans already evaluated)."""
        if self._by_prediction is None:
            cal = self.calibrations.get("analytic")
            self._by_prediction = [(p, r.plan.plan_id) for p, r in measurable(screen(self.space, cal), self.request)]
        return next((p for p, plan_id in self._by_prediction if plan_id not in taken), None)

    def _calibrated(self, result: TrialResult) -> TrialResult:
        cal = self.calibrations.get(result.evaluator)
        return cal.apply(result, self.request.ctx) if cal is not None else result

    def _reporter(self, trial) -> Callable[[StepReport], bool]:
        def on_step(report: StepReport) -> bool:
            trial.report(report.tokens_per_sec, report.step)
            return not trial.should_prune()

        return on_step


def _in_flight(study, exclude: int | None = None) -> set[str]:
    """Plans of the trials being evaluated now (any worker), from the ``plan_id`` each marks first."""
    from optuna.trial import TrialState

    return {
        t.user_attrs["plan_id"]
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if t.number != exclude and "plan_id" in t.user_attrs
    }


def measurable(
    scored: list[tuple[dict[str, Any], TrialResult]], request: SearchRequest
) -> list[tuple[dict[str, Any], TrialResult]]:
    """What is worth enqueuing: for a measured study, only plans the measured evaluator can
    run on the target (``measured.not_measurable``: e.g. a paged optimizer on the CPU target);
    such a plan would spend a trial of the budget on a ``failed`` result."""
    if request.evaluator != "measured":
        return scored
    from autofit.evaluators.measured import device_kind, not_measurable

    device = device_kind(request.ctx)
    return [(p, r) for p, r in scored if not not_measurable(r.plan, request.ctx, device)]


def _may_fit(predicted: TrialResult, ctx: Target, margin: float) -> bool:
    """Fits, or is over the budget by no more than ``margin`` of it (device and host)."""
    if predicted.fits:
        return True
    m = predicted.memory
    if m is None or margin <= 0:
        return False
    return m.device_total <= ctx.budget_bytes * (1 + margin) and m.host_bytes <= ctx.cluster.host_memory_bytes * (
        1 + margin
    )


def _prediction(predicted: TrialResult) -> dict[str, Any]:
    """The estimate a measured row is stored with (``TrialResult.embedded_prediction`` reads it)."""
    m, t = predicted.memory, predicted.throughput
    raw = predicted.extra.get("raw")
    if raw:  # store what the model predicted, not the calibrated figures: calibration learns from it
        m = MemoryAnatomy.from_dict(raw["memory"])
        t = Throughput.from_dict(raw["throughput"]) if raw.get("throughput") else None
    return {
        "evaluator": predicted.evaluator,
        "status": predicted.status.value,
        "reason": predicted.reason,
        "tokens_per_sec": predicted.tokens_per_sec,
        **({k: getattr(m, k) for k in ("peak_allocated", "peak_reserved", "device_total")} if m else {}),
        "memory": m.as_dict() if m else None,
        "throughput": t.as_dict() if t else None,
    }


def _sampler(seed: int):
    """TPE over the conditional space; it reads the constraints each trial sets."""
    import optuna

    with _quiet_experimental():  # group=True
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, n_startup_trials=4)


_PORTABLE_OPTIONS = ("warmup_steps", "timed_steps", "timeout_s")
HEARTBEAT_INTERVAL_S = 10  # how often a running trial pings the database
HEARTBEAT_GRACE_S = 60  # after this silence a trial's worker is taken for dead


def request_from_study(rec) -> SearchRequest:
    """The request a stored study was made for (workers rebuild it from the database).

    The CPU target's memory budget comes back with the cluster (``ClusterSpec.from_dict``),
    and the measured evaluator enforces the target's capacity, as in the process that created it."""
    b = rec.budget or {}
    options = dict(b.get("evaluator") or {})
    return SearchRequest(
        ctx=rec.context(),
        allowed=Allowed.from_dict(rec.allowed),
        evaluator=rec.evaluator,
        trials=int(b.get("trials", 1)),
        timeout_s=b.get("timeout_s"),
        seed=int(b.get("seed", 0)),
        evaluator_options=options if rec.evaluator == "measured" else {},
    )


def prepare_search(
    request: SearchRequest,
    store,
    *,
    fresh: bool = False,
    resume: bool = False,
    study_name: str | None = None,
    progress: Progress | None = None,
    warm: bool = True,
):
    """The study to work on: an identical finished one (answer from the store), the one to
    resume, or a new one with the screened candidates enqueued. Returns ``(record, finished)``."""
    progress = progress or (lambda event, data: None)
    if fresh and resume:
        raise AutofitError("--fresh starts a new study and --resume continues a stored one; give only one")
    if study_name is not None and not resume:  # a stored study of an older autofit may still be resumed by name
        from autofit.store.store import check_study_name

        study_name = check_study_name(study_name)  # before an identical finished study answers instead
    space = request.space()  # refuses an impossible request before anything is stored
    key = request.request_key
    if not fresh and not resume:
        done = store.find_finished_study(key)
        if done is not None:
            return done, True
    study_rec = None
    if resume:
        study_rec = store.get_study(study_name) if study_name else store.find_resumable_study(key)
        if study_rec is None:
            raise AutofitError("no interrupted study of this request to resume; run without --resume")
        study_rec = store.resume_study(study_rec.id)
    else:
        study_rec = store.create_study(
            request.ctx,
            evaluator=request.evaluator,
            allowed=request.allowed.as_dict(),
            budget=request.budget,
            name=study_name,
            optuna_study_name=f"autofit-{secrets.token_hex(8)}",
        )
    with interrupted_marks(store, study_rec):
        _open_study(request, store, study_rec, space, resume=resume, progress=progress, warm=warm)
    return study_rec, False


def _open_study(
    request: SearchRequest, store, study_rec, space: SearchSpace, *, resume: bool, progress: Progress, warm: bool
) -> None:
    """Optuna's study for ``study_rec``: screened and enqueued when new; on resume, trials
    the dead process left running are failed (the work loop queues their plans again)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=study_rec.optuna_study_name,
        storage=store.optuna_storage(),
        direction="maximize",
        load_if_exists=True,
    )
    for key, value in study_attrs(study_rec).items():  # what the study is, for Optuna's tools
        study.set_user_attr(key, value)
    if resume:  # trials left running by the process that died: nobody will finish them
        from optuna.trial import TrialState

        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            study.tell(t.number, state=TrialState.FAIL)
    stored = store.trials(study_rec.id)
    fitting = [t for t in stored if t.fits and t.tokens_per_sec]
    progress(
        "start",
        {
            "study": study_rec.name,
            "budget": request.trials,
            "done": len({t.plan_id for t in stored}),
            "best": max(fitting, key=lambda t: t.tokens_per_sec).result() if fitting else None,
        },
    )
    if not study.trials:
        progress("screening", {"space": space})
        cal = calibration.from_store(store, request.ctx.cluster.gpu.name, "analytic") if request.calibrate else None
        if cal is not None:
            progress("calibration", {"calibration": cal})
        scored = screen(space, cal)
        progress("screened", {"n": len(scored), "fits": sum(r.fits for _, r in scored)})
        warm_params = warm_start(request, store, space, exclude=study_rec.id) if warm else []
        if warm_params:
            # a past winner the screen would prune under the new workload would only spend a trial
            margin = SCREEN_MARGIN.get(request.evaluator, 0.0)
            runnable = [p for p, r in scored if _may_fit(r, request.ctx, margin)]
            kept = [p for p in warm_params if p in runnable]
            progress("warm-start", {"n": len(kept), "dropped": len(warm_params) - len(kept)})
            warm_params = kept
        k = min(ENQUEUE_MAX, max(1, request.trials // 2))
        queue: list[dict[str, Any]] = []
        for params in warm_params + candidates(measurable(scored, request), k + len(warm_params)):
            if params not in queue:  # a past winner may be the screen's pick too
                queue.append(params)
        for params in queue[: max(k, len(warm_params))]:
            study.enqueue_trial(params, skip_if_exists=True)


def study_attrs(study_rec) -> dict[str, Any]:
    """The Optuna study's user attributes: the autofit study it belongs to and the request it
    answers (optuna-dashboard and ``optuna studies`` show them; the names are autofit's CLI's)."""
    workload = study_rec.workload
    return {
        "autofit_study": study_rec.name,
        "model": study_rec.model_name,
        "gpus": study_rec.cluster_label,
        "seq_len": study_rec.seq_len,
        "global_batch": int(workload["global_batch"]),
        "evaluator": study_rec.evaluator,
    }


def publish_answer(store, outcome: SearchOutcome) -> None:
    """Write the study's answer into its Optuna study once a run of the study ends: the user
    attribute ``autofit_answer`` (None when nothing fits) and, where optuna-dashboard is
    installed, the study's note, which the dashboard shows above the trials.

    Optuna's tools name the COMPLETE trial of the highest value (``_told``). That is the answer,
    unless autofit chose a simpler plan within the time error of the fastest
    (``autofit.results.tiebreak``), or a re-measurement (outside Optuna) reordered the tied plans.
    No value per trial could make them agree then: which of two tied plans wins depends on the
    other plans, and Optuna never changes a finished trial. So the answer is stated beside them,
    with the trial that Optuna names instead and why."""
    import optuna
    from optuna.trial import TrialState

    study = optuna.load_study(study_name=outcome.study.optuna_study_name, storage=store.optuna_storage())
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    top = max(complete, key=lambda t: t.value, default=None)
    answer = _answer_attr(store, outcome, top)
    study.set_user_attr("autofit_answer", answer)
    try:
        from optuna_dashboard import save_note
    except ImportError:  # the dashboard is a separate install; the user attribute says the same
        return
    save_note(study, _answer_note(answer))


def _answer_attr(store, outcome: SearchOutcome, top) -> dict[str, Any] | None:
    """``autofit_answer``: the answer's plan, its trials, and Optuna's best trial where that differs."""
    best = outcome.best
    if best is None:
        return None
    rows = store.trials(outcome.study.id)  # a re-measurement's row has no Optuna trial
    numbers = {t.number for t in rows if t.plan_id == best.plan.plan_id and t.optuna_trial_id is not None}
    answer: dict[str, Any] = {
        "plan_id": best.plan.plan_id,
        "plan": best.plan.summary(),
        "tokens_per_sec": round(best.tokens_per_sec, 1),
        "evaluator": best.evaluator,
        "trials": sorted(numbers),
    }
    if top is not None and top.user_attrs.get("plan_id") != best.plan.plan_id:
        tb = outcome.tiebreak
        answer["optuna_best_trial"] = top.number
        answer["why"] = (
            f"autofit prefers the simpler plan within the time error ({tb.error:.0%}) of the fastest"
            if tb is not None and tb.fastest is not best
            else "a re-measurement of the tied plans changed their order"
        )
    return answer


def _answer_note(answer: dict[str, Any] | None) -> str:
    """The dashboard's study note (Markdown) for ``autofit_answer``."""
    if answer is None:
        return "## autofit's answer\n\nNo plan fits: every trial is PRUNED. `autofit show` says what would fit."
    lines = [
        "## autofit's answer",
        "",
        f"Trial {', '.join(f'#{n}' for n in answer['trials'])}: `{answer['plan']}`, "
        f"{answer['tokens_per_sec']:,.0f} tokens/s ({answer['evaluator']}).",
    ]
    if "optuna_best_trial" in answer:
        lines += ["", f"Optuna's best trial is #{answer['optuna_best_trial']}: {answer['why']}."]
    lines += ["", "Plans that do not fit are PRUNED trials, with their constraints; `autofit show` has the rest."]
    return "\n".join(lines)


@contextmanager
def interrupted_marks(store, study_rec) -> Iterator[None]:
    """A Ctrl-C inside the block marks the study ``interrupted`` (``--resume`` continues it)
    before it propagates; a second Ctrl-C cannot leave the study ``running``. An error marks
    it ``failed``."""
    try:
        yield
    except KeyboardInterrupt:
        with sigint_deferred():
            store.finish_study(study_rec.id, "interrupted")
        raise
    except Exception as exc:
        _mark_failed(store, study_rec, exc)
        raise


def _mark_failed(store, study_rec, exc: Exception) -> None:
    """A search stopped by an error is ``failed`` (``--resume`` continues it once the cause is
    fixed), not left ``running``. Not when the database itself is the error: the write would
    only wait for it again, and a ``running`` study is resumable too."""
    from autofit.errors import StoreError

    if isinstance(exc, StoreError):
        return
    try:
        with sigint_deferred():
            store.finish_study(study_rec.id, "failed")
    except AutofitError:
        pass  # the original error is the one to report


@contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold Ctrl-C until the block is done, then deliver it (main thread only; elsewhere a no-op).

    For the few writes that must not be cut in half by a second Ctrl-C: a study's final status.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[tuple] = []
    previous = signal.signal(signal.SIGINT, lambda *args: caught.append(args))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught and callable(previous):
        previous(*caught[0])  # Python's default handler raises KeyboardInterrupt


WARM_START_MAX = 3


def warm_start(request: SearchRequest, store, space: SearchSpace, exclude: int | None = None) -> list[dict[str, Any]]:
    """Params of the best plans stored for this model (or the nearest of its family) on this GPU type.

    Each past winner is mapped into the new space: same techniques, and the micro-batch
    that divides the new per-GPU batch with the tokens per micro-batch nearest the old
    (activations scale with them: a winner at the memory edge stays there when the
    sequence doubles only if its micro-batch halves); plans the new request cannot run are
    skipped. They are re-evaluated under the new workload like any trial.
    """
    ctx = request.ctx
    past = [s for s in store.list_studies(gpu=ctx.cluster.gpu.name) if s.best is not None and s.study.id != exclude]
    same = [s for s in past if s.study.model_fingerprint == ctx.model.fingerprint]
    if not same:  # the nearest model of the same family and size
        kin = [s for s in past if s.study.model_spec.get("model_type") == ctx.model.model_type]
        if kin:
            nearest = min(kin, key=lambda s: abs(int(s.study.model_spec.get("n_params", 0)) - ctx.model.n_params))
            same = [s for s in kin if s.study.model_fingerprint == nearest.study.model_fingerprint]
    wanted = sorted(same, key=lambda s: -(s.best.tokens_per_sec or 0))
    index: dict[tuple, list[tuple[dict[str, Any], Plan]]] = {}
    for params, plan in space.enumerate_params():
        index.setdefault(_technique_key(plan), []).append((params, plan))
    out: list[dict[str, Any]] = []
    for s in wanted:
        old = s.best.result().plan
        options = index.get(_technique_key(old))
        if not options:
            continue
        old_tokens = old.micro_batch * s.study.seq_len
        params, _ = min(
            options, key=lambda pp: (abs(pp[1].micro_batch * ctx.workload.seq_len - old_tokens), pp[1].micro_batch)
        )
        if params not in out:
            out.append(params)
        if len(out) >= WARM_START_MAX:
            break
    return out


def _technique_key(plan: Plan) -> tuple:
    d = plan.as_dict()
    d.pop("micro_batch")
    d.pop("grad_accum")
    return tuple(sorted(d.items()))


class _Claim:
    """The study lock, held from the budget check until the new trial exists (released by the objective)."""

    def __init__(self, cm):
        self._cm = cm
        self._held = False

    def __enter__(self) -> _Claim:
        self._cm.__enter__()
        self._held = True
        return self

    def release(self) -> None:
        if self._held:
            self._held = False
            self._cm.__exit__(None, None, None)

    def __exit__(self, *exc) -> None:
        self.release()


def work(
    request: SearchRequest,
    store,
    study_rec,
    *,
    progress: Progress | None = None,
    seed: int | None = None,
    heartbeat: tuple[int | None, int | None] = (None, None),
    poll_s: float = 1.0,
) -> str:
    """Evaluate trials of the study until its budget of evaluated plans is met.

    Returns why it stopped: ``done`` (budget met), ``interrupted`` (Ctrl-C), ``exhausted``
    (every plan of the space is evaluated) or ``timeout``.

    Any number of these loops, in any processes on any hosts sharing the database, split
    one study: each claims a trial under the study lock only while evaluated + running
    trials are under the budget, so the study ends with exactly ``trials`` evaluated plans.
    A trial that proposes a plan already evaluated (or being evaluated) is not one: its
    slot is claimed again. A trial lost with its worker (a heartbeat gone silent, Ctrl-C,
    a process killed) has its plan queued again (``_requeue_lost``).
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # its failed-trial tracebacks: we report what happened
    space = request.space()
    study = optuna.load_study(
        study_name=study_rec.optuna_study_name,
        storage=store.optuna_storage(*heartbeat),
        sampler=_sampler(request.seed if seed is None else seed),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=2),
    )
    objective = _Objective(request, space, store, study_rec.id, progress)
    report = progress or (lambda event, data: None)
    deadline = time.monotonic() + request.timeout_s if request.timeout_s else None
    outage = _Outage(store)
    try:
        while deadline is None or time.monotonic() < deadline:
            try:
                with _Claim(store.study_lock(study_rec.id)) as claim:
                    step = _claim_and_run(
                        request,
                        store,
                        study_rec.id,
                        study,
                        objective,
                        claim,
                        report,
                        deadline,
                        stale=bool(heartbeat[0]),
                    )
                if step in ("done", "exhausted"):
                    return step
                if step == "ran":
                    outage.clear()
                    continue
            except _NothingToClaim:
                pass
            except Exception as exc:  # noqa: BLE001 - only database outages are retried
                exc = _unmasked(exc)
                if isinstance(exc, KeyboardInterrupt):
                    return "interrupted"
                outage.wait_or_raise(exc)
                if objective.current is not None and outage.fail_trial(study, objective.current):
                    objective.current = None
                continue
            time.sleep(poll_s)  # the rest of the budget is running in other workers
    except KeyboardInterrupt:
        return "interrupted"
    return "timeout"


def _claim_and_run(
    request: SearchRequest,
    store,
    study_id: int,
    study,
    objective: _Objective,
    claim: _Claim,
    report: Progress,
    deadline: float | None,
    *,
    stale: bool,
) -> str | None:
    """Under the study lock: ``done`` when the budget of evaluated plans is met, ``exhausted``
    when no plan is left, ``ran`` after one trial, None when the rest of the budget is
    running elsewhere (raises ``_NothingToClaim`` when only running plans are left)."""
    import optuna

    if stale:
        with _quiet_experimental():
            optuna.storages.fail_stale_trials(study)
    stored = store.trials(study_id)
    evaluated = {t.plan_id for t in stored}
    if len(evaluated) >= request.trials:
        return "ran" if _remeasure_next(request, store, study_id, stored, objective, report) else "done"
    trials = study.get_trials(deepcopy=False)
    requeued = _requeue_lost(study, trials, {t.optuna_trial_id for t in stored})
    if requeued:
        report("requeued", {"numbers": requeued})
        trials = study.get_trials(deepcopy=False)
    running = sum(t.state.name == "RUNNING" for t in trials)
    if len(evaluated) + running >= request.trials:
        return None
    if objective.duplicates_in_a_row:  # the sampler proposed evaluated plans: any left?
        left = objective.next_unevaluated(evaluated | _in_flight(study))
        if left is None and not running:
            if _remeasure_next(request, store, study_id, stored, objective, report):
                return "ran"
            report("exhausted", {"n": len(evaluated)})
            return "exhausted"
        if left is None:  # the last plans are running in other workers: wait
            raise _NothingToClaim
        if objective.duplicates_in_a_row >= DUPLICATES_IN_A_ROW and not any(t.state.name == "WAITING" for t in trials):
            study.enqueue_trial(left)  # it keeps proposing them: the screen's next goes first
            objective.duplicates_in_a_row = 0
    objective.claim = claim
    objective.current = _next_trial_number(study)  # known before ask() can fail half-way
    remaining = None if deadline is None else max(1.0, deadline - time.monotonic())
    study.optimize(objective, n_trials=1, timeout=remaining, catch=(AutofitError,))
    objective.current = None
    return "ran"


REMEASURE_RUNS = 2  # measured runs of a plan tied with the best, at most, before the answer


def remeasure_candidates(results: Iterable[TrialResult]) -> list[TrialResult]:
    """The measured plans to run once more before the answer, fastest first: where more than one
    fitting measured plan is within the time error of the fastest measured one
    (``autofit.results.tied``: one short run's noise decides between them), those of them
    measured fewer than :data:`REMEASURE_RUNS` times (any outcome counts as a run)."""
    results = list(results)
    measured = [r for r in ranked(results) if r.evaluator == "measured"]
    if len(measured) < 2:
        return []
    fastest = max(measured, key=lambda r: r.tokens_per_sec)
    contenders = [r for r in measured if tied(fastest, r)]
    if len(contenders) < 2:
        return []
    runs = Counter(r.plan.plan_id for r in results if r.evaluator == "measured")
    return sorted((r for r in contenders if runs[r.plan.plan_id] < REMEASURE_RUNS), key=lambda r: -r.tokens_per_sec)


def _remeasure_next(
    request: SearchRequest, store, study_id: int, stored: list, objective: _Objective, report: Progress
) -> bool:
    """Under the study lock, once the budget is spent: measure the first of
    :func:`remeasure_candidates` again and store the run as one more row of its plan (the
    latest measurement is the plan's; the runs' spread widens its time error). Returns
    whether it ran one. Outside Optuna: the plan is known and the sampler learns nothing
    from it; holding the lock keeps other workers from measuring the same plan meanwhile."""
    if request.evaluator != "measured":
        return False
    results = [t.result() for t in stored]
    candidates = remeasure_candidates(results)
    if not candidates:
        return False
    earlier = candidates[0]
    number = max(t.number for t in stored) + 1
    report("remeasure", {"number": number, "plan": earlier.plan, "tokens_per_sec": earlier.tokens_per_sec})
    same = earlier.plan.plan_id
    runs = [r.tokens_per_sec for r in results if r.plan.plan_id == same and r.evaluator == "measured" and r.fits]
    result = objective.remeasure(earlier, runs)
    store.record_trial(study_id, result, number=number)
    report("trial-done", {"number": number, "result": result})
    return True


def _next_trial_number(study) -> int:
    """The number of the trial ``study.ask()`` gives next: the first waiting one (Optuna's
    ``Study._pop_waiting_trial_id``), else a new one. Exact under the study lock, where no
    other worker asks or enqueues."""
    trials = study.get_trials(deepcopy=False)
    return next((t.number for t in trials if t.state.name == "WAITING"), len(trials))


class _NothingToClaim(Exception):
    """Every plan left is being evaluated by another worker."""


DUPLICATES_IN_A_ROW = 8  # proposals of evaluated plans before the screen's next plan is queued
RETRY_LOST_MAX = 3  # times a lost trial's plan is queued again (a plan that kills its worker stops)


def _requeue_lost(study, trials, stored_trial_ids: set[int | None]) -> list[int]:
    """Queue again the plans of trials lost with their worker; returns their numbers.

    Lost: Optuna failed the trial (a heartbeat gone silent, Ctrl-C inside it, a resume
    failing what a killed process left running, a result that could not be told) and no
    result of it is stored. A plan that fails on its own is stored with its status
    (``failed``, ``oom``, ``timeout``), so it is never queued again. Optuna's own retry
    callback does the queueing, so ``retry_history`` links each retry to the lost trial.
    Call under the study lock: two workers must not queue one plan twice.
    """
    from optuna.storages import RetryHeartbeatStaleTrialCallback
    from optuna.trial import TrialState

    retried = {n for t in trials for n in t.system_attrs.get("retry_history", ())}
    out = []
    for t in trials:
        if (
            t.state is not TrialState.FAIL
            or t.number in retried
            or t._trial_id in stored_trial_ids
            or len(t.system_attrs.get("retry_history", ())) >= RETRY_LOST_MAX
        ):
            continue
        with _quiet_experimental():
            RetryHeartbeatStaleTrialCallback()(study, t)
        out.append(t.number)
    return out


@contextmanager
def _quiet_experimental() -> Iterator[None]:
    """Optuna's ExperimentalWarning on APIs autofit relies on deliberately (heartbeat, retry, group)."""
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


def _unmasked(exc: BaseException) -> BaseException:
    """The exception Optuna hid. When Study.tell fails or is interrupted inside
    ``optuna.study._optimize._run_trial`` (Optuna 4-5), its ``finally`` reads a variable that
    was never set, and the UnboundLocalError carries the real cause (a Ctrl-C, a lost
    database connection) only as its ``__context__``."""
    if isinstance(exc, UnboundLocalError) and exc.__context__ is not None and "updated_state" in str(exc):
        return exc.__context__
    return exc


class _Outage:
    """The store's backoff while the database is away (PostgreSQL restarting), around the
    work loop's whole claim; one clear error, that says how to resume, after too long."""

    def __init__(self, store):
        from autofit.store.store import Backoff

        self.store = store
        self.backoff = Backoff()

    def clear(self) -> None:
        self.backoff.clear()

    def wait_or_raise(self, exc: BaseException) -> None:
        from autofit.store.store import is_transient

        if not is_transient(exc):
            raise exc
        if not self.backoff.retry(exc):
            raise AutofitError(
                f"the database ({self.store.masked_url}) is unreachable after {self.backoff.waited:.0f} s of retries; "
                "every finished trial is stored — resume with `autofit search ... --resume`"
            ) from exc

    @staticmethod
    def fail_trial(study, number: int) -> bool:
        """Our trial whose result could not be told, or that ``ask`` created before the
        connection broke: mark it failed, so its slot is claimed again (and its plan queued
        again). Left running, nothing would ever finish it and the budget would wait for it."""
        from optuna.trial import TrialState

        try:
            trials = study.get_trials(deepcopy=False)
            if number < len(trials) and trials[number].state is TrialState.RUNNING:
                study.tell(number, state=TrialState.FAIL)
            return True
        except Exception:  # noqa: BLE001 - still unreachable: try again after the next wait
            return False


def run_search(
    request: SearchRequest,
    store,
    *,
    fresh: bool = False,
    resume: bool = False,
    study_name: str | None = None,
    progress: Progress | None = None,
    workers: int = 1,
    warm: bool = True,
) -> SearchOutcome:
    """Run (or answer from the store, or resume) the study for ``request``.

    ``workers=0`` only creates the study (screened and enqueued) for ``autofit worker``s.
    """
    t0 = time.perf_counter()
    study_rec, finished = prepare_search(
        request, store, fresh=fresh, resume=resume, study_name=study_name, progress=progress, warm=warm
    )
    if finished:
        return _outcome(request, store, study_rec, from_store=True, elapsed=time.perf_counter() - t0)
    if workers <= 0:
        return _outcome(request, store, study_rec, elapsed=time.perf_counter() - t0)
    try:
        ending = work(request, store, study_rec, progress=progress)
    except KeyboardInterrupt:  # work() returns on Ctrl-C; this is one landing outside its loop
        ending = "interrupted"
    except Exception as exc:
        _mark_failed(store, study_rec, exc)
        raise
    with sigint_deferred():  # a second Ctrl-C waits until the status and the answer are written
        study_rec = store.finish_study(study_rec.id, "interrupted" if ending == "interrupted" else "finished")
        outcome = _outcome(request, store, study_rec, ending=ending, elapsed=time.perf_counter() - t0)
        publish_answer(store, outcome)
    return outcome


def run_worker(
    store,
    study: str,
    *,
    progress: Progress | None = None,
    heartbeat: tuple[int, int] = (HEARTBEAT_INTERVAL_S, HEARTBEAT_GRACE_S),
) -> SearchOutcome:
    """``autofit worker``: join a stored study and evaluate until its budget is spent."""
    t0 = time.perf_counter()
    rec = store.get_study(study)
    if rec.status.value == "finished":
        return _outcome(request_from_study(rec), store, rec, from_store=True)
    request = request_from_study(rec)
    ending = work(request, store, rec, progress=progress, seed=secrets.randbelow(2**31), heartbeat=heartbeat)
    if ending == "interrupted":  # an interrupted worker leaves the study to the others
        return _outcome(request, store, store.get_study(rec.id), ending=ending, elapsed=time.perf_counter() - t0)
    with sigint_deferred():
        rec = store.finish_study(rec.id, "finished")
        outcome = _outcome(request, store, rec, ending=ending, elapsed=time.perf_counter() - t0)
        publish_answer(store, outcome)
    return outcome


def stored_outcome(request: SearchRequest, store, rec) -> SearchOutcome:
    """The answer of a finished study, read from the store."""
    return _outcome(request, store, rec, from_store=True)


def follow(
    store, study: str, *, progress: Progress | None = None, poll_s: float = 2.0, alive: Callable[[], bool] | None = None
) -> SearchOutcome:
    """``autofit search --wait``: report a study's trials as workers finish them, until it is done.

    ``alive``: whether the workers we started still run (stop following when none does).
    """
    t0 = time.perf_counter()
    rec = store.get_study(study)
    request = request_from_study(rec)
    seen: set[int] = set()
    while True:
        for t in store.trials(rec.id):
            if t.id not in seen:
                seen.add(t.id)
                if progress:
                    progress("trial-done", {"number": t.number, "result": t.result()})
        rec = store.get_study(rec.id)
        if rec.status.value != "running":
            break
        if alive is not None and not alive():
            rec = store.get_study(rec.id)
            if rec.status.value == "running":
                raise AutofitError(
                    f"every worker of study {rec.name} stopped before it finished; "
                    f"start more with `autofit worker {rec.name}`"
                )
            break
        time.sleep(poll_s)
    return _outcome(request, store, rec, elapsed=time.perf_counter() - t0)


def _outcome(
    request: SearchRequest, store, study_rec, *, from_store: bool = False, ending: str = "done", elapsed: float = 0.0
) -> SearchOutcome:
    """The study's answer by the rule every command shares (``autofit.results.ranked``)."""
    results = tuple(store.trial_result(t) for t in store.trials(study_rec.id))
    fitting = ranked(results)
    best = fitting[0] if fitting else None
    closest, advice = None, ()
    if best is None:
        with_memory = [r for r in authoritative(results)[0] if r.memory is not None]
        closest = min(with_memory, key=lambda r: r.memory.device_total, default=None)
        advice = tuple(what_it_would_take(request, closest))
    return SearchOutcome(
        study=study_rec,
        results=results,
        best=best,
        best_per_method=best_per_method(fitting),
        tiebreak=tiebreak(fitting),
        closest=closest,
        advice=advice,
        from_store=from_store,
        ending=ending,
        elapsed_s=elapsed,
    )


def _host_ram_advice(request: SearchRequest) -> list[str]:
    """Plans that fail only on the node's host memory (offload): the least host RAM that fits one."""
    ctx = request.ctx
    roomy = dataclasses.replace(ctx.cluster, host_memory_bytes=2**60)  # no host limit: GPU memory decides
    try:
        scored = screen(SearchSpace(dataclasses.replace(ctx, cluster=roomy), request.allowed))
    except AutofitError:
        return []
    fitting = [r for _, r in scored if r.fits and r.memory is not None]
    if not fitting:
        return []
    least = min(fitting, key=lambda r: (r.memory.host_bytes, -r.tokens_per_sec))
    have = ctx.cluster.host_memory_bytes
    if least.memory.host_bytes <= have:  # host memory is not what stops it
        return []
    need = -(-least.memory.host_bytes // 2**30)  # whole GiB, rounded up
    return [
        f"with ≥ {need} GiB of host RAM per node (--host-mem {need}GiB; the node has {have / 2**30:.0f} GiB, "
        f"{ctx.cluster.host_memory_origin}) fits: {least.plan.summary()}"
    ]


def what_it_would_take(request: SearchRequest, closest: TrialResult | None) -> list[str]:
    """When nothing fits: the changes that would make a plan fit, each checked analytically."""
    from autofit.specs import GPUS, ClusterSpec, Workload

    ctx = request.ctx
    out: list[str] = []

    def fits_with(ctx2: Target, allowed: Allowed | None = None) -> TrialResult | None:
        try:
            space = SearchSpace(ctx2, allowed or request.allowed)
        except AutofitError:
            return None
        best = screen(space)
        return best[0][1] if best and best[0][1].fits else None

    if closest is not None and closest.memory is not None:
        need = closest.memory.device_total
        out.append(
            f"the closest plan ({closest.plan.summary()}) needs {need / 2**30:.1f} GiB per GPU; "
            f"{ctx.cluster.gpu.name} has {ctx.capacity_bytes / 2**30:.1f} GiB"
        )
    out.extend(_host_ram_advice(request))
    if Method.QLORA not in request.allowed.methods:
        allowed = dataclasses.replace(request.allowed, methods=request.allowed.methods + (Method.QLORA,))
        r = fits_with(ctx, allowed)
        if r:
            out.append(
                f"allowing QLoRA (--methods {','.join(m.value for m in allowed.methods)}) fits: {r.plan.summary()}"
            )
    for factor in (2, 4, 8):
        world = ctx.cluster.gpus_per_node * factor
        if world > 16 or ctx.workload.global_batch % world:
            continue
        c2 = dataclasses.replace(ctx.cluster, gpus_per_node=world)
        r = fits_with(dataclasses.replace(ctx, cluster=c2))
        if r:
            out.append(f"{world}x{ctx.cluster.gpu.name} fits: {r.plan.summary()} at {r.tokens_per_sec:,.0f} tokens/s")
            break
    for gpu in sorted(GPUS.values(), key=lambda g: g.memory_bytes):
        if gpu.memory_bytes <= ctx.cluster.gpu.memory_bytes:
            continue
        c2 = ClusterSpec(gpu=gpu, gpus_per_node=ctx.cluster.gpus_per_node, nodes=ctx.cluster.nodes)
        r = fits_with(dataclasses.replace(ctx, cluster=c2))
        if r:
            out.append(f"{ctx.cluster.gpus_per_node}x{gpu.name} fits: {r.plan.summary()}")
            break
    seq = ctx.workload.seq_len // 2
    while seq >= 128:
        w2 = Workload(seq_len=seq, global_batch=ctx.workload.global_batch, lengths=ctx.workload.lengths)
        r = fits_with(dataclasses.replace(ctx, workload=w2))
        if r:
            out.append(f"--seq-len {seq} fits: {r.plan.summary()}")
            break
        seq //= 2
    if len(out) <= 1:
        out.append("no change autofit knows of makes it fit; try a smaller model")
    return out

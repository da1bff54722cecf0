"""The search: an Optuna study over the space, every trial stored, the fastest fitting plan returned.

How a study runs (``run_search``):

1. *Screening.* The whole space is scored with the analytic evaluator (microseconds per
   plan). The predicted-fastest fitting plans — the best of each method first — are
   ``enqueue_trial``-ed so the expensive evaluator spends its budget where winners are.
2. *Sampling.* Optuna's TPE sampler (multivariate, grouped for the conditional space)
   proposes the rest; fit is the constraint (``Trial.set_constraint``), effective
   tokens/s the objective.
3. *Pruning before evaluation.* Every proposed plan is scored analytically first; a plan
   predicted not to fit is recorded as ``pruned`` with its reason and costs nothing more
   (Optuna still sees it as an infeasible trial, so the sampler learns the boundary).
   Measured runs report per-step throughput through ``trial.report`` and Optuna's pruner
   stops the ones that cannot win.
4. Every evaluation is a row in the store; the answer is read back from the store.

Ctrl-C stops between trials' evaluations cleanly: finished trials stay, the study is
marked ``interrupted`` and ``--resume`` (or the same command) continues it.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from autofit.errors import AutofitError
from autofit.evaluators import get_evaluator
from autofit.evaluators.analytic import AnalyticEvaluator
from autofit.evaluators.base import EvalContext, Status, StepReport, TrialResult
from autofit.plan import Method, Plan
from autofit.space import Allowed, SearchSpace

DEFAULT_TRIALS = {"analytic": 40, "simulated": 8, "measured": 12}
ENQUEUE_MAX = 6
# A real run settles what the estimate cannot: before a measured trial, only plans the
# analytic estimate puts more than this far over the budget are pruned. Its peaks are
# within a few percent of real steps (tests/evaluators/test_analytic.py), and a plan
# wrongly pruned may be the winner, while one wrongly run stops at its first step.
SCREEN_MARGIN = {"measured": 0.05}


@dataclass(frozen=True)
class SearchRequest:
    ctx: EvalContext
    allowed: Allowed = field(default_factory=Allowed)
    backend: str = "analytic"  # resolved: analytic | simulated | measured
    trials: int = 40
    timeout_s: float | None = None
    seed: int = 0
    # keyword options of the backend's evaluator (measured: steps, trial timeout, work dir)
    evaluator_options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def request_key(self) -> str:
        """Identical requests share this key (the budget is not part of it)."""
        from autofit.store import request_key

        return request_key(self.ctx, backend=self.backend, allowed=self.allowed.as_dict())

    @property
    def budget(self) -> dict[str, Any]:
        return {"trials": self.trials, "timeout_s": self.timeout_s, "seed": self.seed}


@dataclass(frozen=True)
class SearchOutcome:
    study: Any  # autofit.store.StudyRecord
    results: tuple[TrialResult, ...]
    best: TrialResult | None
    best_per_method: dict[str, TrialResult]
    closest: TrialResult | None = None
    advice: tuple[str, ...] = ()
    from_store: bool = False
    interrupted: bool = False
    elapsed_s: float = 0.0

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.results:
            out[r.status.value] = out.get(r.status.value, 0) + 1
        return out


Progress = Callable[[str, dict[str, Any]], None]


def _constraint(result: TrialResult, ctx: EvalContext) -> list[float]:
    """Optuna's convention: <= 0 is feasible. Relative excess of device and host memory."""
    if result.memory is None or result.status in (Status.FAILED, Status.TIMEOUT):
        return [1.0, 1.0]
    m = result.memory
    return [
        (m.device_total - ctx.budget_bytes) / ctx.budget_bytes,
        (m.host_bytes - ctx.cluster.host_memory_bytes) / ctx.cluster.host_memory_bytes,
    ]


def _set_constraints(trial, result: TrialResult, ctx: EvalContext) -> None:
    device, host = _constraint(result, ctx)
    trial.set_constraint("device_memory", device)
    trial.set_constraint("host_memory", host)


def screen(space: SearchSpace) -> list[tuple[dict[str, Any], TrialResult]]:
    """Every plan of the space with its analytic result, fastest fitting first."""
    ev = AnalyticEvaluator()
    scored = [(params, ev.evaluate(plan, space.ctx)) for params, plan in space.enumerate_params()]
    scored.sort(key=lambda pr: (not pr[1].fits, -pr[1].tokens_per_sec))
    return scored


def candidates(scored: list[tuple[dict[str, Any], TrialResult]], k: int) -> list[dict[str, Any]]:
    """What to enqueue: the predicted best of each method, then the next best overall."""
    fitting = [(p, r) for p, r in scored if r.fits]
    picks: list[dict[str, Any]] = []
    seen: set[str] = set()
    by_method: dict[str, tuple[dict, TrialResult]] = {}
    for p, r in fitting:
        by_method.setdefault(r.plan.method.value, (p, r))
    ordered = sorted(by_method.values(), key=lambda pr: -pr[1].tokens_per_sec) + fitting
    for p, r in ordered:
        if r.plan.plan_id in seen:
            continue
        seen.add(r.plan.plan_id)
        picks.append(p)
        if len(picks) >= k:
            break
    return picks


class _Objective:
    def __init__(self, request: SearchRequest, space: SearchSpace, store, study_id: int,
                 known: dict[str, TrialResult], progress: Progress | None):
        self.request, self.space, self.store, self.study_id = request, space, store, study_id
        self.known = known  # plan_id -> result already evaluated in this study
        self.progress = progress or (lambda event, data: None)
        self.screen = AnalyticEvaluator()
        self.evaluator = (None if request.backend == "analytic"
                          else get_evaluator(request.backend, **dict(request.evaluator_options)))

    def __call__(self, trial) -> float:
        import optuna

        ctx = self.request.ctx
        plan = self.space.suggest(trial)
        trial.set_user_attr("plan_id", plan.plan_id)
        self.progress("trial-start", {"number": trial.number, "plan": plan})
        if plan.plan_id in self.known:  # the sampler proposed a plan already evaluated
            result = self.known[plan.plan_id]
            _set_constraints(trial, result, ctx)
            trial.set_user_attr("duplicate", True)
            return result.tokens_per_sec
        predicted = self.screen.evaluate(plan, ctx)
        if self.evaluator is None:
            result = predicted
        elif not _may_fit(predicted, ctx, SCREEN_MARGIN.get(self.request.backend, 0.0)):
            result = dataclasses.replace(predicted, status=Status.PRUNED,
                                         reason=f"predicted not to fit: {predicted.reason}")
        else:
            result = self.evaluator.evaluate(plan, ctx, on_step=self._reporter(trial))
            # the stored pair: this evaluation beside the estimate it was screened by
            result = dataclasses.replace(result, extra={**result.extra, "predicted": _prediction(predicted)})
        self.known[plan.plan_id] = result
        self.store.record_trial(self.study_id, result, number=trial.number, optuna_trial_id=trial._trial_id)
        trial.set_user_attr("status", result.status.value)
        _set_constraints(trial, result, ctx)
        self.progress("trial-done", {"number": trial.number, "result": result})
        if result.status is Status.PRUNED and result.extra.get("pruned_by") == "pruner":
            raise optuna.TrialPruned(result.reason)
        return result.tokens_per_sec

    def _reporter(self, trial) -> Callable[[StepReport], bool]:
        def on_step(report: StepReport) -> bool:
            trial.report(report.tokens_per_sec, report.step)
            return not trial.should_prune()

        return on_step


def _may_fit(predicted: TrialResult, ctx: EvalContext, margin: float) -> bool:
    """Fits, or is over the budget by no more than ``margin`` of it (device and host)."""
    if predicted.fits:
        return True
    m = predicted.memory
    if m is None or margin <= 0:
        return False
    return (m.device_total <= ctx.budget_bytes * (1 + margin)
            and m.host_bytes <= ctx.cluster.host_memory_bytes * (1 + margin))


def _prediction(predicted: TrialResult) -> dict[str, Any]:
    m = predicted.memory
    return {
        "evaluator": predicted.evaluator,
        "status": predicted.status.value,
        "tokens_per_sec": predicted.tokens_per_sec,
        **({k: getattr(m, k) for k in ("peak_allocated", "peak_reserved", "device_total")} if m else {}),
    }


def _sampler(seed: int):
    """TPE over the conditional space; it reads the constraints each trial sets."""
    import warnings

    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # group=True
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, n_startup_trials=4)


def run_search(request: SearchRequest, store, *, fresh: bool = False, resume: bool = False,
               study_name: str | None = None, progress: Progress | None = None) -> SearchOutcome:
    """Run (or answer from the store, or resume) the study for ``request``."""
    import optuna

    t0 = time.perf_counter()
    progress = progress or (lambda event, data: None)
    space = SearchSpace(request.ctx, request.allowed)
    key = request.request_key

    if not fresh and not resume:
        done = store.find_finished_study(key)
        if done is not None:
            return _outcome(request, store, done, from_store=True, elapsed=time.perf_counter() - t0)

    study_rec = None
    if resume:
        study_rec = store.get_study(study_name) if study_name else store.find_resumable_study(key)
        if study_rec is None:
            raise AutofitError("no interrupted study of this request to resume; run without --resume")
    if study_rec is None:
        study_rec = store.create_study(
            request.ctx, backend=request.backend, allowed=request.allowed.as_dict(), budget=request.budget,
            name=study_name, optuna_study_name=f"autofit-{secrets.token_hex(8)}",
        )
    else:
        study_rec = store.resume_study(study_rec.id)

    known = {r.plan.plan_id: r for r in (store.trial_result(t) for t in store.trials(study_rec.id))}
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=study_rec.optuna_study_name, storage=store.optuna_storage(), direction="maximize",
        sampler=_sampler(request.seed), pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=2),
        load_if_exists=True,
    )
    finished = [t for t in study.trials if t.state.is_finished()]
    remaining = request.trials - len(finished)
    if not finished:
        progress("screening", {"space": space})
        scored = screen(space)
        progress("screened", {"n": len(scored), "fits": sum(r.fits for _, r in scored)})
        for params in candidates(scored, min(ENQUEUE_MAX, max(1, request.trials // 2))):
            study.enqueue_trial(params, skip_if_exists=True)
    interrupted = False
    if remaining > 0:
        objective = _Objective(request, space, store, study_rec.id, known, progress)
        try:
            study.optimize(objective, n_trials=remaining, timeout=request.timeout_s, catch=(AutofitError,))
        except KeyboardInterrupt:
            interrupted = True
    study_rec = store.finish_study(study_rec.id, "interrupted" if interrupted else "finished")
    return _outcome(request, store, study_rec, interrupted=interrupted, elapsed=time.perf_counter() - t0)


def _outcome(request: SearchRequest, store, study_rec, *, from_store: bool = False, interrupted: bool = False,
             elapsed: float = 0.0) -> SearchOutcome:
    results = tuple(store.trial_result(t) for t in store.trials(study_rec.id))
    fitting = [r for r in results if r.fits]
    best = max(fitting, key=lambda r: r.tokens_per_sec, default=None)
    per_method: dict[str, TrialResult] = {}
    for r in sorted(fitting, key=lambda r: -r.tokens_per_sec):
        per_method.setdefault(r.plan.method.value, r)
    closest, advice = None, ()
    if best is None:
        with_memory = [r for r in results if r.memory is not None]
        closest = min(with_memory, key=lambda r: r.memory.device_total, default=None)
        advice = tuple(what_it_would_take(request, closest))
    return SearchOutcome(
        study=study_rec, results=results, best=best, best_per_method=per_method, closest=closest,
        advice=advice, from_store=from_store, interrupted=interrupted, elapsed_s=elapsed,
    )


def what_it_would_take(request: SearchRequest, closest: TrialResult | None) -> list[str]:
    """When nothing fits: the changes that would make a plan fit, each checked analytically."""
    from autofit.specs import GPUS, ClusterSpec, Workload

    ctx = request.ctx
    out: list[str] = []

    def fits_with(ctx2: EvalContext, allowed: Allowed | None = None) -> TrialResult | None:
        try:
            space = SearchSpace(ctx2, allowed or request.allowed)
        except AutofitError:
            return None
        best = screen(space)
        return best[0][1] if best and best[0][1].fits else None

    if closest is not None and closest.memory is not None:
        need = closest.memory.device_total
        out.append(f"the closest plan ({closest.plan.summary()}) needs {need / 2**30:.1f} GiB per GPU; "
                   f"{ctx.cluster.gpu.name} has {ctx.capacity_bytes / 2**30:.1f} GiB")
    if Method.QLORA not in request.allowed.methods:
        allowed = dataclasses.replace(request.allowed, methods=request.allowed.methods + (Method.QLORA,))
        r = fits_with(ctx, allowed)
        if r:
            out.append(f"allowing QLoRA (--methods {','.join(m.value for m in allowed.methods)}) fits: {r.plan.summary()}")
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

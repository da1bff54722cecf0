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

Progress events (``progress(event, data)``): ``start`` {study, budget, done, best},
``screening`` {space}, ``screened`` {n, fits}, ``warm-start`` {n, dropped}, ``trial-start`` {number,
plan}, ``trial-done`` {number, result}, ``trial-duplicate`` {number, result} (the sampler
proposed a plan already evaluated; nothing new is stored).

Ctrl-C stops between trials' evaluations cleanly: finished trials stay, the study is
marked ``interrupted`` and ``--resume`` (or the same command) continues it.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from autofit import calibration
from autofit.errors import AutofitError
from autofit.evaluators import get_evaluator
from autofit.evaluators.analytic import AnalyticEvaluator
from autofit.evaluators.base import EvalContext, MemoryAnatomy, Status, StepReport, Throughput, TrialResult
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
    calibrate: bool = True  # correct predictions by what was measured on this GPU type

    @property
    def request_key(self) -> str:
        """Identical requests share this key (the budget is not part of it)."""
        from autofit.store import request_key

        return request_key(self.ctx, backend=self.backend, allowed=self.allowed.as_dict())

    def space(self) -> SearchSpace:
        """The plans this request searches: for a measured study, only fused losses it can run."""
        single_rank = False
        if self.backend == "measured":
            from autofit.evaluators.measured import device_kind, liger_runs

            single_rank = not liger_runs(self.ctx, device_kind(self.ctx))
        return SearchSpace(self.ctx, self.allowed, fused_loss_single_rank_only=single_rank)

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


def screen(space: SearchSpace, cal: calibration.Calibration | None = None) -> list[tuple[dict[str, Any], TrialResult]]:
    """Every plan of the space with its analytic result (calibrated if given), fastest fitting first."""
    ev = AnalyticEvaluator()
    scored = [(params, ev.evaluate(plan, space.ctx)) for params, plan in space.enumerate_params()]
    if cal is not None:
        scored = [(params, cal.apply(r, space.ctx)) for params, r in scored]
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
    def __init__(self, request: SearchRequest, space: SearchSpace, store, study_id: int, progress: Progress | None):
        self.request, self.space, self.store, self.study_id = request, space, store, study_id
        self.claim: _Claim | None = None  # released as soon as the trial exists
        self.current: int | None = None  # number of the trial being evaluated
        self.progress = progress or (lambda event, data: None)
        self.screen = AnalyticEvaluator()
        gpu = request.ctx.cluster.gpu.name
        self.calibrations = {
            ev: (calibration.from_store(store, gpu, ev) if request.calibrate else None)
            for ev in ("analytic", "simulated")
        }
        self.evaluator = (None if request.backend == "analytic"
                          else get_evaluator(request.backend, **dict(request.evaluator_options)))

    def __call__(self, trial) -> float:
        import optuna

        if self.claim is not None:
            self.claim.release()
        self.current = trial.number
        ctx = self.request.ctx
        plan = self.space.suggest(trial)
        trial.set_user_attr("plan_id", plan.plan_id)
        self.progress("trial-start", {"number": trial.number, "plan": plan})
        known = {t.plan_id: t for t in self.store.trials(self.study_id)}  # by any worker
        if plan.plan_id in known:  # the sampler proposed a plan already evaluated
            result = known[plan.plan_id].result()
            _set_constraints(trial, result, ctx)
            trial.set_user_attr("duplicate", True)
            self.progress("trial-duplicate", {"number": trial.number, "result": result})
            return result.tokens_per_sec
        predicted = self._calibrated(self.screen.evaluate(plan, ctx))
        if self.evaluator is None:
            result = predicted
        elif not _may_fit(predicted, ctx, SCREEN_MARGIN.get(self.request.backend, 0.0)):
            result = dataclasses.replace(predicted, status=Status.PRUNED,
                                         reason=f"predicted not to fit: {predicted.reason}")
        else:
            result = self._calibrated(self.evaluator.evaluate(plan, ctx, on_step=self._reporter(trial)))
            # the stored pair: this evaluation beside the estimate it was screened by
            result = dataclasses.replace(result, extra={**result.extra, "predicted": _prediction(predicted)})
        self.store.record_trial(self.study_id, result, number=trial.number, optuna_trial_id=trial._trial_id)
        trial.set_user_attr("status", result.status.value)
        _set_constraints(trial, result, ctx)
        self.progress("trial-done", {"number": trial.number, "result": result})
        if result.status is Status.PRUNED and result.extra.get("pruned_by") == "pruner":
            raise optuna.TrialPruned(result.reason)
        return result.tokens_per_sec

    def _calibrated(self, result: TrialResult) -> TrialResult:
        cal = self.calibrations.get(result.evaluator)
        return cal.apply(result, self.request.ctx) if cal is not None else result

    def _reporter(self, trial) -> Callable[[StepReport], bool]:
        def on_step(report: StepReport) -> bool:
            trial.report(report.tokens_per_sec, report.step)
            return not trial.should_prune()

        return on_step


def measurable(scored: list[tuple[dict[str, Any], TrialResult]],
               request: SearchRequest) -> list[tuple[dict[str, Any], TrialResult]]:
    """What is worth enqueuing: for a measured study, only plans the measured evaluator can
    run on the target (``measured.not_measurable``: e.g. a paged optimizer on the CPU target);
    such a plan would spend a trial of the budget on a ``failed`` result."""
    if request.backend != "measured":
        return scored
    from autofit.evaluators.measured import device_kind, not_measurable

    device = device_kind(request.ctx)
    return [(p, r) for p, r in scored if not not_measurable(r.plan, request.ctx, device)]


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

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # group=True
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, n_startup_trials=4)


_PORTABLE_OPTIONS = ("warmup_steps", "timed_steps", "timeout_s")
HEARTBEAT_INTERVAL_S = 10  # how often a running trial pings the database
HEARTBEAT_GRACE_S = 60  # after this silence a trial's worker is taken for dead
_OK_STATES = ("COMPLETE", "PRUNED")


def request_from_study(rec) -> SearchRequest:
    """The request a stored study was made for (workers rebuild it from the database)."""
    from autofit.plan import LoraTargets, Optimizer, Precision

    a = rec.allowed
    allowed = Allowed(
        methods=tuple(Method(m) for m in a.get("methods", [])) or Allowed().methods,
        optimizers=tuple(Optimizer(o) for o in a.get("optimizers", [])) or Allowed().optimizers,
        precisions=tuple(Precision(p) for p in a.get("precisions", [])),
        lora_ranks=tuple(int(r) for r in a.get("lora_ranks", [])) or Allowed().lora_ranks,
        lora_targets=LoraTargets((a.get("lora_targets") or ["all-linear"])[0]),
    )
    b = rec.budget or {}
    options = dict(b.get("evaluator") or {})
    if rec.backend == "measured" and rec.cluster.get("gpu") == "CPU":
        options["cpu_mem_budget"] = rec.context().capacity_bytes
    return SearchRequest(ctx=rec.context(), allowed=allowed, backend=rec.backend, trials=int(b.get("trials", 1)),
                         timeout_s=b.get("timeout_s"), seed=int(b.get("seed", 0)),
                         evaluator_options=options if rec.backend == "measured" else {})


def prepare_search(request: SearchRequest, store, *, fresh: bool = False, resume: bool = False,
                   study_name: str | None = None, progress: Progress | None = None, warm: bool = True):
    """The study to work on: an identical finished one (answer from the store), the one to
    resume, or a new one with the screened candidates enqueued. Returns ``(record, finished)``."""
    import optuna

    progress = progress or (lambda event, data: None)
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
            request.ctx, backend=request.backend, allowed=request.allowed.as_dict(), budget=request.budget,
            name=study_name, optuna_study_name=f"autofit-{secrets.token_hex(8)}",
        )
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=study_rec.optuna_study_name, storage=store.optuna_storage(),
                                direction="maximize", load_if_exists=True)
    if resume:  # trials left running by the process that died: nobody will finish them
        from optuna.trial import TrialState

        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            study.tell(t.number, state=TrialState.FAIL)
    stored = [t for t in store.trials(study_rec.id) if t.fits and t.tokens_per_sec]
    progress("start", {"study": study_rec.name, "budget": request.trials,
                       "done": sum(t.state.is_finished() for t in study.trials),
                       "best": max(stored, key=lambda t: t.tokens_per_sec).result() if stored else None})
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
            margin = SCREEN_MARGIN.get(request.backend, 0.0)
            runnable = [p for p, r in scored if _may_fit(r, request.ctx, margin)]
            kept = [p for p in warm_params if p in runnable]
            progress("warm-start", {"n": len(kept), "dropped": len(warm_params) - len(kept)})
            warm_params = kept
        k = min(ENQUEUE_MAX, max(1, request.trials // 2))
        queue: list[dict[str, Any]] = []
        for params in warm_params + candidates(measurable(scored, request), k + len(warm_params)):
            if params not in queue:  # a past winner may be the screen's pick too
                queue.append(params)
        for params in queue[:max(k, len(warm_params))]:
            study.enqueue_trial(params, skip_if_exists=True)
    return study_rec, False


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
        params, _ = min(options, key=lambda pp: (abs(pp[1].micro_batch * ctx.workload.seq_len - old_tokens),
                                                 pp[1].micro_batch))
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

    def __enter__(self) -> "_Claim":
        self._cm.__enter__()
        self._held = True
        return self

    def release(self) -> None:
        if self._held:
            self._held = False
            self._cm.__exit__(None, None, None)

    def __exit__(self, *exc) -> None:
        self.release()


def work(request: SearchRequest, store, study_rec, *, progress: Progress | None = None, seed: int | None = None,
         heartbeat: tuple[int | None, int | None] = (None, None), poll_s: float = 1.0) -> bool:
    """Evaluate trials of the study until its trial budget is met; True if interrupted (Ctrl-C).

    Any number of these loops, in any processes on any hosts sharing the database, split
    one study: each claims a trial under the study lock only while finished + running
    trials are under the budget, so the study ends with exactly ``trials`` finished
    trials. With a heartbeat, a trial whose worker died is failed by Optuna after the
    grace period and its slot is claimed again.
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = request.space()
    study = optuna.load_study(
        study_name=study_rec.optuna_study_name, storage=store.optuna_storage(*heartbeat),
        sampler=_sampler(request.seed if seed is None else seed),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=2),
    )
    objective = _Objective(request, space, store, study_rec.id, progress)
    deadline = time.monotonic() + request.timeout_s if request.timeout_s else None
    outage = _Outage(store)
    try:
        while deadline is None or time.monotonic() < deadline:
            try:
                with _Claim(store.study_lock(study_rec.id)) as claim:
                    if heartbeat[0]:
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                            optuna.storages.fail_stale_trials(study)
                    states = [t.state.name for t in study.get_trials(deepcopy=False)]
                    done = sum(s in _OK_STATES for s in states)
                    if done >= request.trials:
                        return False
                    if done + states.count("RUNNING") < request.trials:
                        objective.claim = claim
                        remaining = None if deadline is None else max(1.0, deadline - time.monotonic())
                        study.optimize(objective, n_trials=1, timeout=remaining, catch=(AutofitError,))
                        objective.current = None
                        outage.clear()
                        continue
            except Exception as exc:  # noqa: BLE001 - only database outages are retried
                exc = _unmasked(exc)
                if isinstance(exc, KeyboardInterrupt):
                    return True
                outage.wait_or_raise(exc)
                if objective.current is not None and outage.fail_trial(study, objective.current):
                    objective.current = None
                continue
            time.sleep(poll_s)  # the rest of the budget is running in other workers
    except KeyboardInterrupt:
        return True
    return False


def _unmasked(exc: BaseException) -> BaseException:
    """The exception Optuna hid. When Study.tell fails or is interrupted inside
    ``optuna.study._optimize._run_trial`` (Optuna 4-5), its ``finally`` reads a variable that
    was never set, and the UnboundLocalError carries the real cause (a Ctrl-C, a lost
    database connection) only as its ``__context__``."""
    if isinstance(exc, UnboundLocalError) and exc.__context__ is not None and "updated_state" in str(exc):
        return exc.__context__
    return exc


class _Outage:
    """Backoff while the database is away (PostgreSQL restarting); one clear error after too long."""

    def __init__(self, store):
        self.store = store
        self.clear()

    def clear(self) -> None:
        self.delay, self.waited = 0.5, 0.0

    def wait_or_raise(self, exc: BaseException) -> None:
        from autofit.store.store import RETRY_TOTAL_S, is_transient

        if not is_transient(exc):
            raise exc
        if self.waited >= RETRY_TOTAL_S:
            raise AutofitError(
                f"the database ({self.store.masked_url}) is unreachable after {self.waited:.0f} s of retries; "
                "every finished trial is stored — resume with `autofit search ... --resume`"
            ) from exc
        time.sleep(self.delay)
        self.waited += self.delay
        self.delay = min(self.delay * 2, 8.0)

    @staticmethod
    def fail_trial(study, number: int) -> bool:
        """Our trial whose result could not be told: mark it failed so its slot is claimed again."""
        from optuna.trial import TrialState

        try:
            if study.trials[number].state is TrialState.RUNNING:
                study.tell(number, state=TrialState.FAIL)
            return True
        except Exception:  # noqa: BLE001 - still unreachable: try again after the next wait
            return False


def run_search(request: SearchRequest, store, *, fresh: bool = False, resume: bool = False,
               study_name: str | None = None, progress: Progress | None = None,
               workers: int = 1, warm: bool = True) -> SearchOutcome:
    """Run (or answer from the store, or resume) the study for ``request``.

    ``workers=0`` only creates the study (screened and enqueued) for ``autofit worker``s.
    """
    t0 = time.perf_counter()
    study_rec, finished = prepare_search(request, store, fresh=fresh, resume=resume, study_name=study_name,
                                         progress=progress, warm=warm)
    if finished:
        return _outcome(request, store, study_rec, from_store=True, elapsed=time.perf_counter() - t0)
    if workers <= 0:
        return _outcome(request, store, study_rec, elapsed=time.perf_counter() - t0)
    interrupted = work(request, store, study_rec, progress=progress)
    study_rec = store.finish_study(study_rec.id, "interrupted" if interrupted else "finished")
    return _outcome(request, store, study_rec, interrupted=interrupted, elapsed=time.perf_counter() - t0)


def run_worker(store, study: str, *, progress: Progress | None = None,
               heartbeat: tuple[int, int] = (HEARTBEAT_INTERVAL_S, HEARTBEAT_GRACE_S)) -> SearchOutcome:
    """``autofit worker``: join a stored study and evaluate until its budget is spent."""
    t0 = time.perf_counter()
    rec = store.get_study(study)
    if rec.status.value == "finished":
        return _outcome(request_from_study(rec), store, rec, from_store=True)
    request = request_from_study(rec)
    interrupted = work(request, store, rec, progress=progress, seed=secrets.randbelow(2**31), heartbeat=heartbeat)
    if not interrupted:
        rec = store.finish_study(rec.id, "finished")
    return _outcome(request, store, store.get_study(rec.id), interrupted=interrupted,
                    elapsed=time.perf_counter() - t0)


def stored_outcome(request: SearchRequest, store, rec) -> SearchOutcome:
    """The answer of a finished study, read from the store."""
    return _outcome(request, store, rec, from_store=True)


def follow(store, study: str, *, progress: Progress | None = None, poll_s: float = 2.0,
           alive: Callable[[], bool] | None = None) -> SearchOutcome:
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
                raise AutofitError(f"every worker of study {rec.name} stopped before it finished; "
                                   f"start more with `autofit worker --study {rec.name}`")
            break
        time.sleep(poll_s)
    return _outcome(request, store, rec, elapsed=time.perf_counter() - t0)


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

"""Search efficiency: how close to the true fastest fitting plan each strategy gets within a trial budget.

    python benchmarks/search_efficiency.py            # full: 5 seeds, budgets 5/10/20/40, writes results/
    python benchmarks/search_efficiency.py --quick    # 1 seed, budgets 5/10/20, under a minute at low load; prints only
    python benchmarks/search_efficiency.py --build-oracle-only   # (re)fill the simulated oracle table, resumable
    python benchmarks/search_efficiency.py --rebuild-oracle      # recompute the simulated oracle from scratch

**Oracle.** Every plan of the request's space (``SearchSpace.enumerate_params()``) is
evaluated; the optimum is the fastest plan whose ``TrialResult.fits``.

* ``analytic`` oracle, all five requests (seq 2048, gpt2-xl 1024: its positions; global batch 16, methods full/lora/qlora).
  *Circular for autofit*: autofit's search scores the whole space with the same analytic
  evaluator before the study starts (``search.screen`` / ``search.candidates``) and enqueues
  the predicted best, so under this oracle it finds the optimum at its first trial by
  construction. The non-circular figure is the ablation **autofit TPE alone**: the real
  ``search.run_search`` (same store, same ``_Objective`` with ``Trial.set_constraint``, same
  ``search._sampler``), but nothing enqueued — ``search.candidates`` is patched to return no
  plans for the run and warm start is off (no library change). Because nothing is enqueued,
  a TPE-alone trajectory does not depend on the budget, so one 40-trial run per seed gives
  every budget as a prefix.
* ``simulated`` oracle, gpt2-xl on 1xT4: every plan through ``SimulatedEvaluator`` (a real
  training step under fake tensors). A trace takes 13-54 s on this 2-core VM (measured: full
  sdpa 13 s ... qlora/full + checkpointing + eager 48-54 s), and the 600-plan space at global batch 16
  has 240 distinct traces (~2 h on one core), so this mode uses the *same request at global
  batch 2* (micro-batch 1 or 2): 240 plans, 96 distinct traces, every technique of the space
  kept (methods, checkpointing, attention, sharding, offload, fused loss) — only the
  micro-batch axis is shorter. Results are cached per plan in
  ``results/oracle/simulated-gpt2-xl-1xT4-seq1024-gb2.jsonl`` (one ``TrialResult.as_dict()``
  per line, appended as each plan finishes, done plans skipped on restart). Here autofit's
  search runs with backend ``simulated`` whose evaluator is replaced by a lookup into that
  table (``search.get_evaluator`` patched), so its analytic screen and pruning are genuinely
  different from the oracle.

**Strategies** (budget = evaluated trials; median over seeds):

* ``autofit``: ``search.run_search`` with a temporary SQLite ``autofit.store.Store``,
  ``SearchRequest.trials = budget``. The budget counts every finished trial, including ones
  the analytic screen pruned before evaluation and duplicates the sampler proposed (strict).
* ``autofit TPE alone``: above, without the screening enqueue.
* ``random``: uniform samples without replacement from ``enumerate_params()``.
* ``deepspeed-autotuner``: DeepSpeed's autotuner in its default ``fast`` mode, re-implemented
  from its documentation and source (deepspeed/autotuning/README.md "Autotuning Workflow and
  Scope", "Configuring Train Micro-Batch Size", "Fast Mode", "Tuning algorithms";
  docs/_tutorials/autotuning.md; deepspeed/autotuning/autotuner.py ``tune``, ``tune_space``,
  ``get_min_max_micro_batch_size``, ``get_tuning_micro_batch_size_list``,
  ``run_tuning_micro_batch_sizes``, ``get_instantiation_memory_required_per_gpu``, checked
  against deepspeed 0.19.8 as installed in this venv; constants from
  deepspeed/autotuning/constants.py). The user's autotuning config: ``"autotuning": {"enabled":
  true, "max_train_batch_size": <global batch>}`` and ``"zero_optimization": {"stage": "all"}``
  (the README's default; the 0.19.8 code falls back to stage 0 alone when no stage is given,
  which would only make this baseline narrower). Rules implemented:
    1. One model-info profile experiment (forward only, micro-batch 1) gives the activation
       memory per micro-batch; it is charged one trial. Its figure is read from the oracle's
       anatomy of the base plan at micro-batch 1 (activations + logits).
    2. ZeRO stages are explored in the order 0, 1, 2, 3. A stage is tuned only if
       ``gpu_mem > instantiation_memory(stage) + activation_mem``, where instantiation memory
       assumes Adam: params 2N/grads 2N/optimizer 16N bytes with fp16 enabled, else 4N/4N/8N,
       optimizer states divided by the GPU count from stage 1, gradients from stage 2,
       parameters at stage 3 (gpu_mem = the GPU's total memory). When stage 3 does not pass,
       "no tuning is performed".
    3. Per stage: ``calculated_max_mbs = (gpu_mem - instantiation) // activation_mem``; skip the
       stage when it is below the previous stage's max micro-batch. Min micro-batch: 1 at the
       first tuned stage (the user's ``train_micro_batch_size_per_gpu`` is "auto"), the
       previous stage's max after that; it must run or the stage ends. Max: try
       ceil(1.05·m), m, int(0.95·m) with m = min(calculated max,
       ``max_train_micro_batch_size_per_gpu``), then a binary search between min and max that
       stops when throughput improves by less than 5% (``METRIC_PERCENT_DIFF_CONST``).
    4. ``max_train_batch_size`` is set to the user's global batch (the documented way to keep
       it), so ``max_train_micro_batch_size_per_gpu`` = the per-GPU batch and gradient
       accumulation = per-GPU batch // micro-batch. A micro-batch that does not divide the
       per-GPU batch is run as the largest divisor below it (autofit keeps the user's global
       batch exactly); an experiment already run is not run again (the autotuner skips
       experiments whose results exist) — both in DeepSpeed's favour.
    5. Tuning list: at most ``num_tuning_micro_batch_sizes`` = 3 sizes from max(min, max//2) to
       max with a constant stride, all run; then smaller sizes below max with the same
       gradient accumulation, kept while each is > 5% faster.
    6. Fast mode returns after the micro-batch phase of every stage (``tune_space``: ``if
       self.fast_enabled() or stage == 0: return``), so ``tuner_early_stopping`` (5) and
       ``tuner_num_trials`` (50), which bound the non-fast ZeRO-configuration tuner, never
       apply. The best experiment over all stages is the answer.
  Base plan (the user's, everything the autotuner does not tune): full fine-tuning, the GPU's
  mixed precision (bf16-mixed; fp16-mixed on T4), AdamW, no checkpointing, sdpa, no fused
  loss, no offload. ZeRO stage k → sharding zero{k} (stage 0 → none); on one GPU, where ZeRO
  divides nothing, a stage-k experiment is scored as the stage-0 plan but still charged.
* ``halve-until-fits``: like accelerate's ``find_executable_batch_size``: the base plan at
  micro-batch = per-GPU batch, halved (gradient accumulation doubled) on every OOM; one
  trial per try; stops at the first that fits.

Reported per strategy and budget: best found as a fraction of the oracle optimum (0 when
nothing fits) and the number of trials spent on plans that do not fit.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

from _deepspeed import instantiation_bytes
from _machine import machine

from autofit.evaluators.analytic import AnalyticEvaluator
from autofit.evaluators.base import Evaluator
from autofit.plan import (
    Attention,
    Checkpointing,
    Method,
    Offload,
    Optimizer,
    Plan,
    Precision,
    Sharding,
)
from autofit.results import Status, TrialResult, ranked
from autofit.search import loop as search
from autofit.search.space import Allowed, SearchSpace
from autofit.specs import Target, Workload, parse_cluster, resolve_model

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ORACLE_DIR = RESULTS / "oracle"
DATE = datetime.date.today().isoformat()
BUDGETS = (5, 10, 20, 40)
GOAL_FRACTION = 0.98
GOAL_TRIALS = 10


# -- requests -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    model: str
    gpus: str
    seq_len: int = 2048
    global_batch: int = 16
    allowed: Allowed = field(default_factory=Allowed)  # methods full, lora, qlora

    @property
    def label(self) -> str:
        return f"{self.model} on {self.gpus}" + (
            f" (global batch {self.global_batch})" if self.global_batch != 16 else ""
        )

    @property
    def slug(self) -> str:
        return f"{self.model}-{self.gpus}-seq{self.seq_len}-gb{self.global_batch}"

    def ctx(self) -> Target:
        return Target(
            resolve_model(self.model),
            parse_cluster(self.gpus),
            Workload(seq_len=self.seq_len, global_batch=self.global_batch),
        )

    def space(self) -> SearchSpace:
        return SearchSpace(self.ctx(), self.allowed)


REQUESTS = (
    Request("mistral-7b", "2xA10"),
    Request("llama-3-8b", "1xA100-80GB"),
    Request("llama-3-70b", "8xH100"),
    Request("qwen2.5-7b", "1xRTX4090"),
    Request("gpt2-xl", "1xT4", seq_len=1024),  # GPT-2 has 1,024 learned positions: longer is refused
)
SIM_REQUEST = Request("gpt2-xl", "1xT4", seq_len=1024, global_batch=2)


# -- results on disk ----------------------------------------------------------------------------
def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "optuna", "peft", "bitsandbytes", "sqlalchemy"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    try:
        out["autofit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        out["autofit"] = "unknown"
    return out


# -- the oracle ---------------------------------------------------------------------------------
class Oracle:
    """Every plan of a request's space with its result; ``best`` is the fastest that fits."""

    def __init__(self, request: Request, kind: str, table: dict[str, TrialResult]):
        self.request, self.kind = request, kind
        self.ctx = request.ctx()
        self.space = SearchSpace(self.ctx, request.allowed)
        self.entries = list(self.space.enumerate_params())  # (params, plan)
        missing = [p.plan_id for _, p in self.entries if p.plan_id not in table]
        if missing:
            raise RuntimeError(
                f"{kind} oracle for {request.label}: {len(missing)} of {len(self.entries)} plans "
                "have no result (run --build-oracle-only)"
            )
        self.table = table
        fitting = [table[p.plan_id] for _, p in self.entries if table[p.plan_id].fits]
        self.best = max(fitting, key=lambda r: r.tokens_per_sec, default=None)
        self.n_fit = len(fitting)

    @property
    def optimum(self) -> float:
        return self.best.tokens_per_sec if self.best else 0.0

    def result(self, plan: Plan) -> TrialResult:
        return self.table[plan.plan_id]

    def fraction(self, r: TrialResult | None) -> float:
        return (r.tokens_per_sec / self.optimum) if (r is not None and r.fits and self.optimum) else 0.0


def analytic_oracle(request: Request) -> Oracle:
    ctx, ev = request.ctx(), AnalyticEvaluator()
    table = {plan.plan_id: ev.evaluate(plan, ctx) for _, plan in request.space().enumerate_params()}
    return Oracle(request, "analytic", table)


def oracle_path(request: Request) -> Path:
    return ORACLE_DIR / f"simulated-{request.slug}.jsonl"


def read_table(path: Path) -> dict[str, TrialResult]:
    table: dict[str, TrialResult] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line another process is writing right now
                continue
            if "plan_id" in row:
                table[row["plan_id"]] = TrialResult.from_dict(row["result"])
    return table


def build_simulated_oracle(
    request: Request, rebuild: bool = False, reverse: bool = False, log: Callable[[str], None] = print
) -> None:
    """Simulate every plan not yet in the table, appending one line per plan (resumable).

    Plans are ordered by ``TraceKey`` so plans that share a trace follow each other and hit
    the evaluator's trace cache (sharding/offload/grad-accum >= 2 variants cost milliseconds).
    A second process may work from the other end (``reverse``): each re-reads the table
    before a plan and skips what the other has done; a line is one ``write`` on an
    append-only file."""
    from autofit.evaluators.simulated import SimulatedEvaluator, TraceCache, TraceDevice, TraceKey

    path = oracle_path(request)
    path.parent.mkdir(parents=True, exist_ok=True)
    if rebuild and path.exists():
        path.unlink()
    done = set(read_table(path))
    ctx = request.ctx()
    target = TraceDevice.of(ctx.cluster.gpu)
    entries = list(SearchSpace(ctx, request.allowed).enumerate_params())
    entries.sort(key=lambda pp: repr(TraceKey.of(pp[1], ctx.model, ctx.workload, target)))
    todo = [(params, plan) for params, plan in entries if plan.plan_id not in done]
    if reverse:
        todo.reverse()
    log(f"simulated oracle {request.label}: {len(entries)} plans, {len(done)} done, {len(todo)} to simulate")
    ev = SimulatedEvaluator(TraceCache())
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(row: dict[str, Any]) -> None:  # one write() per line: safe beside another appender
        os.write(fd, (json.dumps(row, default=str) + "\n").encode())
        os.fsync(fd)

    try:
        if not done:
            append(
                {
                    "meta": {
                        "request": request.slug,
                        "allowed": request.allowed.as_dict(),
                        "plans": len(entries),
                        "versions": versions(),
                        "machine": machine(),
                    }
                }
            )
        t0 = time.perf_counter()
        for i, (params, plan) in enumerate(todo, 1):
            if plan.plan_id in read_table(path):  # done by the other process
                continue
            r = ev.evaluate(plan, ctx)
            append({"plan_id": plan.plan_id, "params": params, "result": r.as_dict()})
            log(
                f"  [{i}/{len(todo)}] {time.perf_counter() - t0:7.0f} s  {r.duration_s:5.1f} s  {r.status.value:6s} "
                f"{r.tokens_per_sec:8.0f} tok/s  {plan.summary()}"
            )
    finally:
        os.close(fd)


def simulated_oracle(request: Request) -> Oracle:
    return Oracle(request, "simulated", read_table(oracle_path(request)))


class ReplayEvaluator(Evaluator):
    """The simulated evaluator's stored result for the plan (exact replay of the oracle table)."""

    name = "simulated"

    def __init__(self, table: dict[str, TrialResult]):
        self.table = table

    def evaluate(self, plan: Plan, ctx: Target, on_step=None) -> TrialResult:
        return self.table[plan.plan_id]


# -- strategies ---------------------------------------------------------------------------------
EVAL, PRUNED, DUPLICATE, PROFILE = "eval", "pruned", "duplicate", "profile"


@dataclass
class Run:
    """One strategy run: the results of its trials in order and what each trial was: an
    evaluation (``eval``), pruned by autofit's analytic screen before evaluation (``pruned``,
    costs no evaluation), a plan the sampler proposed again (``duplicate``: its stored result,
    nothing evaluated) or DeepSpeed's model-info profile experiment (``profile``, no result)."""

    results: list[TrialResult | None]
    kinds: list[str]

    def prefix(self, budget: int) -> Run:
        return Run(self.results[:budget], self.kinds[:budget])

    def best_fraction(self, oracle: Oracle) -> float:
        return max((oracle.fraction(r) for r in self.results), default=0.0)

    def oom(self) -> int:
        """Evaluated trials whose plan did not fit."""
        return sum(1 for r, k in zip(self.results, self.kinds) if k == EVAL and r is not None and not r.fits)

    def count(self, kind: str) -> int:
        return self.kinds.count(kind)

    def first_reaching(self, oracle: Oracle, fraction: float) -> int | None:
        for i, r in enumerate(self.results, 1):
            if oracle.fraction(r) >= fraction - 1e-12:
                return i
        return None


@contextlib.contextmanager
def temp_store() -> Iterator[Any]:
    from autofit.store import Store

    with tempfile.TemporaryDirectory(prefix="autofit-bench-") as d:
        store = Store(f"sqlite:///{d}/bench.db")
        try:
            yield store
        finally:
            store.close()


def autofit_run(
    oracle: Oracle,
    budget: int,
    seed: int,
    *,
    screen: bool = True,
    store=None,
    warm: bool = True,
    request: Request | None = None,
) -> Run:
    """The real ``search.run_search``; trials in the order they finished (duplicates included)."""
    req = request or oracle.request
    backend = "analytic" if oracle.kind == "analytic" else "simulated"
    sreq = search.SearchRequest(ctx=req.ctx(), allowed=req.allowed, evaluator=backend, trials=budget, seed=seed)
    events: list[tuple[TrialResult, str]] = []

    def progress(event: str, data: dict[str, Any]) -> None:
        if event == "trial-done":
            r = data["result"]
            events.append((r, PRUNED if r.status is Status.SCREENED else EVAL))
        elif event == "trial-duplicate":  # a plan already evaluated: counted, nothing evaluated
            events.append((data["result"], DUPLICATE))

    patches = []
    if oracle.kind == "simulated":
        patches.append(mock.patch.object(search, "get_evaluator", lambda name, **kw: ReplayEvaluator(oracle.table)))
    if not screen:
        patches.append(mock.patch.object(search, "candidates", lambda scored, k: []))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        st = store if store is not None else stack.enter_context(temp_store())
        search.run_search(sreq, st, fresh=True, progress=progress, warm=warm and screen)
    return Run([r for r, _ in events], [k for _, k in events])


def random_run(oracle: Oracle, budget: int, seed: int) -> Run:
    plans = [p for _, p in oracle.entries]
    picks = random.Random(seed).sample(plans, min(budget, len(plans)))
    return Run([oracle.result(p) for p in picks], [EVAL] * len(picks))


def base_plan(ctx: Target, micro_batch: int, sharding: Sharding = Sharding.NONE) -> Plan:
    """The user's plan the baselines start from (full fine-tuning, mixed precision, AdamW, sdpa)."""
    per_rank = ctx.workload.global_batch // ctx.cluster.world_size
    prec = Precision.BF16_MIXED if ctx.cluster.gpu.supports_bf16 else Precision.FP16_MIXED
    return Plan(
        method=Method.FULL,
        precision=prec,
        optimizer=Optimizer.ADAMW,
        micro_batch=micro_batch,
        grad_accum=per_rank // micro_batch,
        checkpointing=Checkpointing.NONE,
        attention=Attention.SDPA,
        sharding=sharding,
        offload=Offload.NONE,
        fused_loss=False,
    )


def halve_run(oracle: Oracle) -> Run:
    ctx = oracle.ctx
    mb = ctx.workload.global_batch // ctx.cluster.world_size
    out: list[TrialResult | None] = []
    while mb >= 1:
        r = oracle.result(base_plan(ctx, mb))
        out.append(r)
        if r.fits:
            break
        mb //= 2
    return Run(out, [EVAL] * len(out))


METRIC_PERCENT_DIFF_CONST = 0.05  # deepspeed/autotuning/constants.py
NUM_TUNING_MICRO_BATCH_SIZES = 3  # autotuning config default


def deepspeed_run(oracle: Oracle) -> tuple[Run, list[str]]:
    """DeepSpeed's fast-mode autotuner (see the module docstring for the rules); returns the run
    and a log of its decisions."""
    ctx = oracle.ctx
    world = ctx.cluster.world_size
    per_rank = ctx.workload.global_batch // world
    divisors = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
    stage_sharding = {0: Sharding.NONE, 1: Sharding.ZERO1, 2: Sharding.ZERO2, 3: Sharding.ZERO3}
    results: list[TrialResult | None] = []
    notes: list[str] = []
    metric: dict[tuple[int, int], float] = {}
    records: dict[int, list[tuple[int, float]]] = {}  # stage -> [(mbs, metric)]

    def run(stage: int, mbs: int) -> float:
        eff = max([d for d in divisors if d <= mbs] or [1])
        key = (stage, eff)
        if key not in metric:
            sharding = stage_sharding[stage] if world > 1 else Sharding.NONE
            r = oracle.result(base_plan(ctx, eff, sharding))
            results.append(r)
            metric[key] = r.tokens_per_sec if r.fits else 0.0
            notes.append(f"z{stage} mbs {eff}: {f'{r.tokens_per_sec:.0f} tok/s' if r.fits else r.status.value}")
        records.setdefault(stage, []).append((eff, metric[key]))
        return metric[key]

    # 1. model-info profile experiment (charged one trial)
    prof = oracle.result(base_plan(ctx, 1))
    results.append(None)
    act = (prof.memory.activations + prof.memory.logits) if prof.memory else 0
    notes.append(f"profile: activation memory at mbs 1 = {act / 2**30:.2f} GiB")
    n = ctx.model.n_params
    fp16 = base_plan(ctx, 1).precision is Precision.FP16_MIXED
    gpu_mem = ctx.capacity_bytes
    cap = per_rank  # max_train_micro_batch_size_per_gpu = max_train_batch_size // GPUs

    def inst(stage: int) -> float:
        return instantiation_bytes(n, stage, world, fp16)

    def min_max(stage: int, min_mbs: int, calc_max: int) -> tuple[int, int]:
        if min_mbs > calc_max:
            return -1, -1
        used: list[int] = []
        if min_mbs < 1:
            mbs = 1
            if not run(stage, mbs):
                return -1, -1  # min_train_micro_batch_size_per_gpu (1) == mbs
            used.append(mbs)
            min_mbs = mbs
        else:
            if not run(stage, min_mbs):
                return -1, -1
            used.append(min_mbs)
        mx = min(calc_max, cap)
        for mbs in (math.ceil(1.05 * mx), mx, int(0.95 * mx)):
            if mbs > cap or mbs < 1:
                continue
            if mbs in used:
                return min_mbs, mbs
            if run(stage, mbs):
                used.append(mbs)
                return min_mbs, mbs
        recs = records.get(stage, [])
        prev = recs[min(range(len(recs)), key=lambda i: abs(recs[i][0] - min_mbs))][1] if recs else None
        low, high = min_mbs, mx
        while low < high:
            mid = (low + high) // 2
            if mid == low:
                break
            if mid not in used:
                m = run(stage, mid)
                if m:
                    low = mid
                    used.append(mid)
                    if prev and (m - prev) / prev < METRIC_PERCENT_DIFF_CONST:
                        notes.append(f"z{stage}: throughput plateaus at mbs {low}")
                        break
                    prev = m
                else:
                    high = mid - 1
            else:
                low = mid
        return min_mbs, low

    def tuning_list(mn: int, mx: int) -> list[int]:
        if mn <= 0 or mx <= 0:
            return []
        if mn < mx // 2:
            mn = mx // 2
        stride = (mx - mn) // NUM_TUNING_MICRO_BATCH_SIZES or 1
        min_gas = per_rank // mx
        ls = [m for m in range(mn, mx, stride) if mx // m != min_gas]
        return ls + [mx]

    def run_list(ls: list[int], mn: int, stage: int) -> None:
        ls = sorted(ls)
        mx = ls[-1]
        mx_metric = 0.0
        for m in ls:
            v = run(stage, m)
            if m == mx:
                mx_metric = v
        lo = ls[-2] + 1 if len(ls) > 1 else mn
        best = mx_metric
        stride = (mx - lo) // 3 or 1
        for m in reversed(range(lo, mx, stride)):
            v = run(stage, m)
            if v and v > best * (1 + METRIC_PERCENT_DIFF_CONST):
                best = v
            else:
                break

    def tune_space(stage: int, prev_max: int) -> tuple[int, int, float]:
        calc_max = int(gpu_mem - inst(stage)) // act if act else cap
        if calc_max < prev_max:
            notes.append(f"z{stage}: calculated max mbs {calc_max} < previous max {prev_max}: skipped")
            return 0, 0, 0.0
        mn, mx = min_max(stage, prev_max, calc_max)
        if mx < prev_max or mx <= 0:
            return 0, 0, 0.0
        ls = tuning_list(mn, mx)
        if not ls:
            return 0, 0, 0.0
        run_list(ls, mn, stage)
        best = max(records.get(stage, []), key=lambda x: x[1], default=(0, 0.0))
        return mx, best[0], best[1]

    mbs = max_mbs = 0
    for stage in (0, 1, 2, 3):
        need = inst(stage) + act
        if gpu_mem <= need:
            notes.append(
                f"z{stage}: needs {need / 2**30:.1f} GiB (model states + activations) > "
                f"{gpu_mem / 2**30:.1f} GiB: not runnable" + ("; no tuning is performed" if stage == 3 else "")
            )
            continue
        nmax, nmbs, _ = tune_space(stage, max_mbs)
        if stage < 3 and nmbs > mbs:
            mbs, max_mbs = nmbs, nmax
    return Run(results, [EVAL if r is not None else PROFILE for r in results]), notes


# -- the benchmark ------------------------------------------------------------------------------
STRATEGIES = ("autofit", "autofit TPE alone", "random", "deepspeed-autotuner", "halve-until-fits")


def bench_request(oracle: Oracle, seeds: list[int], budgets: tuple[int, ...], log: Callable[[str], None]) -> dict:
    out: dict[str, Any] = {
        "request": oracle.request.label,
        "oracle": oracle.kind,
        "space": len(oracle.entries),
        "fits": oracle.n_fit,
        "optimum": {"tokens_per_sec": oracle.optimum, "plan": oracle.best.plan.summary() if oracle.best else None},
        "strategies": {s: {} for s in STRATEGIES},
    }
    if oracle.kind != "analytic":  # how the screen's model compares with this oracle
        ev, ctx = AnalyticEvaluator(), oracle.ctx
        pred = {p.plan_id: ev.evaluate(p, ctx) for _, p in oracle.entries}
        screen_best = max((r for r in pred.values() if r.fits), key=lambda r: r.tokens_per_sec)
        # the answer rule (results.ranked): the simplest plan within the time error of the fastest
        screen_answer = ranked(pred.values())[0]
        oracle_answer = ranked(oracle.table.values())[0]
        out["analytic_vs_oracle"] = {
            "fit_agreement": sum(pred[i].fits == oracle.table[i].fits for i in pred),
            "plans": len(pred),
            "screen_best": screen_best.plan.summary(),
            "screen_best_fraction": oracle.fraction(oracle.table[screen_best.plan.plan_id]),
            "screen_answer": screen_answer.plan.summary(),
            "screen_answer_fraction": oracle.fraction(oracle.table[screen_answer.plan.plan_id]),
            "oracle_answer": oracle_answer.plan.summary(),
            "oracle_answer_fraction": oracle.fraction(oracle_answer),
        }
    t0 = time.perf_counter()
    ds, notes = deepspeed_run(oracle)
    out["deepspeed_log"] = notes
    halve = halve_run(oracle)
    max_b = max(budgets)
    tpe = {s: autofit_run(oracle, max_b, s, screen=False) for s in seeds}
    rnd = {s: random_run(oracle, max_b, s) for s in seeds}
    autofit_runs: dict[int, list[Run]] = {}
    for b in budgets:
        autofit_runs[b] = [autofit_run(oracle, b, s) for s in seeds]
        per: dict[str, list[Run]] = {
            "autofit": autofit_runs[b],
            "autofit TPE alone": [tpe[s].prefix(b) for s in seeds],
            "random": [rnd[s].prefix(b) for s in seeds],
            "deepspeed-autotuner": [ds.prefix(b)],
            "halve-until-fits": [halve.prefix(b)],
        }
        for name, runs in per.items():
            fr = [r.best_fraction(oracle) for r in runs]
            out["strategies"][name][b] = {
                "best_fraction_median": statistics.median(fr),
                "best_fraction_min": min(fr),
                "best_fraction": fr,
                "oom_median": statistics.median([r.oom() for r in runs]),
                "trials_used_median": statistics.median([len(r.results) for r in runs]),
                "expensive_median": statistics.median([r.count(EVAL) for r in runs]),
                "pruned_median": statistics.median([r.count(PRUNED) for r in runs]),
                "duplicate_median": statistics.median([r.count(DUPLICATE) for r in runs]),
            }
        log(
            f"  budget {b:2d}: "
            + "  ".join(f"{n} {out['strategies'][n][b]['best_fraction_median']:.1%}" for n in STRATEGIES)
        )
    # trials to reach 98% of the optimum, within the largest budget (autofit: its runs at that budget)
    out["reach98"] = {
        name: [r.first_reaching(oracle, GOAL_FRACTION) for r in runs]
        for name, runs in (
            ("autofit", autofit_runs[max_b]),
            ("autofit TPE alone", list(tpe.values())),
            ("random", list(rnd.values())),
            ("deepspeed-autotuner", [ds]),
            ("halve-until-fits", [halve]),
        )
    }
    out["autofit_trace"] = {
        s: [round(oracle.fraction(r), 4) for r in run.results] for s, run in zip(seeds, autofit_runs[max_b])
    }
    out["seconds"] = time.perf_counter() - t0
    return out


BASELINES = ("random", "deepspeed-autotuner", "halve-until-fits")


def verdict(res: dict, budgets: tuple[int, ...]) -> dict[str, Any]:
    """The issue's goal: >= 98% within 10 trials (every seed) and ahead of every baseline (random,
    DeepSpeed autotuner, halve-until-fits) at every budget (medians; a tie is not ahead). The
    TPE-alone ablation is autofit without its screen, compared apart."""
    st = res["strategies"]
    af = st["autofit"]
    within = [b for b in budgets if b <= GOAL_TRIALS]
    reach = bool(within) and af[within[-1]]["best_fraction_min"] >= GOAL_FRACTION

    def compare(names: tuple[str, ...]) -> tuple[list[str], list[str]]:
        behind, ties = [], []
        for name in names:
            for b in budgets:
                a, o = af[b]["best_fraction_median"], st[name][b]["best_fraction_median"]
                if a < o - 1e-9:
                    behind.append(f"{name} @ {b}: autofit {a:.1%} < {o:.1%}")
                elif abs(a - o) <= 1e-9:
                    ties.append(f"{name} @ {b} ({a:.1%})")
        return behind, ties

    behind, ties = compare(BASELINES)
    ab_behind, ab_ties = compare(("autofit TPE alone",))
    return {
        "reach98_within10": reach,
        "ahead_everywhere": not behind and not ties,
        "behind": behind,
        "ties": ties,
        "ablation_behind": ab_behind,
        "ablation_ties": ab_ties,
    }


def fmt_cell(c: dict, show_expensive: bool = False) -> str:
    s = f"{c['best_fraction_median']:.1%}"
    if c["best_fraction_min"] < c["best_fraction_median"] - 1e-9:
        s += f" (min {c['best_fraction_min']:.0%})"
    s += f" · {c['oom_median']:g} OOM"
    if show_expensive:
        s += f" · {c['expensive_median']:g} eval"
        if c["pruned_median"]:
            s += f", {c['pruned_median']:g} pruned"
        if c["duplicate_median"]:
            s += f", {c['duplicate_median']:g} dup"
    return s


def table(res: dict, budgets: tuple[int, ...]) -> list[str]:
    lines = ["| strategy | " + " | ".join(f"{b} trials" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for name in STRATEGIES:
        cells = []
        for b in budgets:
            c = res["strategies"][name][b]
            cell = fmt_cell(c, show_expensive=name.startswith("autofit"))
            if name in ("deepspeed-autotuner", "halve-until-fits") and c["trials_used_median"] < b:
                cell += f" (stopped after {c['trials_used_median']:g})"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


NOTES = """Notes on reading this:

- **The analytic oracle is circular for autofit.** autofit's search scores the whole space with
  the analytic evaluator before its study starts and enqueues the predicted best plans
  (`search.prepare_search` → `screen` → `candidates`); when the oracle *is* that evaluator,
  autofit's first trial is the optimum by construction. The analytic rows therefore measure
  the wiring (the screen's pick reaches the study and is stored), not search skill. The
  non-circular figures are (a) **autofit TPE alone** — the same `run_search`, store, objective
  (`Trial.set_constraint`) and `search._sampler`, with nothing enqueued (`search.candidates`
  patched to return no plans, warm start off) — and (b) the **simulated oracle** section, where
  autofit's analytic screen is a different model from the oracle it is judged by.
- TPE alone does not depend on the budget when nothing is enqueued, so each seed runs once at
  the largest budget and smaller budgets are its prefixes; autofit runs once per budget and
  seed (its number of enqueued plans, `min(6, trials // 2)`, depends on the budget).
- DeepSpeed autotuner and halve-until-fits tune only micro-batch (and ZeRO stage) on the
  user's base plan: full fine-tuning, the GPU's mixed precision, AdamW, no checkpointing,
  sdpa, no offload. "stopped after n" means the strategy had nothing more to try. Its
  decisions are listed per request.
- The simulated oracle covers gpt2-xl on 1xT4 at global batch 2 (micro-batch 1 or 2), not 16:
  a fake-tensor trace takes 13-54 s on this shared 2-core VM and the global-batch-16 space has
  240 distinct traces (~2-3 h); global batch 2 keeps every technique axis and has 96 traces.
  The table (`results/oracle/simulated-gpt2-xl-1xT4-seq1024-gb2.jsonl`) is replayed exactly;
  `--rebuild-oracle` recomputes it.
"""


def _int_keys(res: dict) -> dict:
    """JSON turns the budget keys into strings; turn them back."""
    for name, per in res["strategies"].items():
        res["strategies"][name] = {int(b): c for b, c in per.items()}
    return res


def header(doc: dict, title: str, script: str) -> list[str]:
    """Title, machine, versions and every command that contributed to ``doc``."""
    lines = [
        f"# {title} — {DATE}",
        "",
        f"Machine: {doc['machine']} (shared with other sessions' test runs). "
        + ", ".join(f"{k} {val}" for k, val in doc["versions"].items() if k != "autofit")
        + ".",
        "",
        "```",
    ]
    lines += [
        f"$ python benchmarks/{script} {' '.join(r['argv'])}".rstrip()
        + f"   # {r['wall_s']:.0f} s"
        + (f", autofit {r['autofit']}" if r.get("autofit") else "")
        + (f", load average at the end {r['load'][0]:.1f}" if r.get("load") else "")
        for r in doc["runs"]
    ]
    return lines + ["```", ""]


def render(doc: dict) -> str:
    budgets = tuple(doc["budgets"])
    results = doc["results"]
    lines = header(doc, "Search efficiency", "search_efficiency.py")
    lines += [
        f"Seeds: {len(doc['seeds'])} (median reported; `min` shown where a seed did worse). Budgets: "
        f"{', '.join(map(str, budgets))} trials. Each cell: best plan found as a fraction of the oracle optimum · "
        "trials spent on plans that do not fit (evaluated and OOM); autofit cells add how the budget went: "
        "evaluations, trials pruned by its analytic screen before evaluation (no evaluation cost) and duplicates "
        "(the sampler proposed a plan already evaluated; Optuna counts the trial, nothing is evaluated). "
        "DeepSpeed and halve-until-fits are deterministic (one run).",
        "",
        "Goal (issue): autofit reaches >= 98% of the optimum within 10 trials on every request and is ahead "
        "of every baseline at every budget.",
        "",
        "| request | oracle | autofit ≥ 98% within 10 trials (worst seed) | autofit ahead of every baseline "
        "(random, DeepSpeed autotuner, halve-until-fits) at every budget (medians; a tie is not ahead) | "
        "autofit vs its own TPE alone (ablation) |",
        "|---|---|---|---|---|",
    ]
    for res in results:
        vd = verdict(res, budgets)
        res["verdict"] = vd
        ab = (
            "ahead at every budget"
            if not vd["ablation_behind"] and not vd["ablation_ties"]
            else "; ".join(
                [f"behind {b}" for b in vd["ablation_behind"]]
                + [f"tied @ {t.split(' @ ')[1]}" for t in vd["ablation_ties"]]
            )
        )
        lines.append(
            f"| {res['request']} | {res['oracle']} | "
            f"{'met' if vd['reach98_within10'] else '**NOT met**'} "
            f"({res['strategies']['autofit'][10]['best_fraction_min']:.1%}) | "
            + (
                "met"
                if vd["ahead_everywhere"]
                else "**NOT met**: "
                + "; ".join([f"behind {b}" for b in vd["behind"]] + [f"tied with {t}" for t in vd["ties"]])
            )
            + f" | {ab} |"
        )
    if doc.get("findings"):
        lines += ["", "## Findings (read from the figures below)", "", doc["findings"]]
    lines += ["", NOTES]
    for res in results:
        lines += [
            f"## {res['request']} — {res['oracle']} oracle",
            "",
            f"{res['space']} plans, {res['fits']} fit; optimum {res['optimum']['tokens_per_sec']:,.0f} tokens/s: "
            f"{res['optimum']['plan']}. ({res['seconds']:.0f} s)",
            "",
        ]
        if res.get("analytic_vs_oracle"):
            a = res["analytic_vs_oracle"]
            lines += [
                f"The analytic screen against this oracle: same fit verdict on {a['fit_agreement']} of "
                f"{a['plans']} plans; its predicted best ({a['screen_best']}) is "
                f"{a['screen_best_fraction']:.1%} of the optimum.",
                "",
            ]
            if "screen_answer" in a:
                lines += [
                    f"Under the answer rule (the simplest plan within the time error of the fastest, "
                    f"`results.ranked`), the screen answers {a['screen_answer']} ({a['screen_answer_fraction']:.1%} "
                    f"of the optimum) and the oracle's own table {a['oracle_answer']} "
                    f"({a['oracle_answer_fraction']:.1%}).",
                    "",
                ]
        lines += table(res, budgets) + [""]
        lines.append(
            "Trials to reach 98% of the optimum (per seed; – = not within the largest budget): "
            + "; ".join(f"{n}: {', '.join(str(x) if x else '–' for x in xs)}" for n, xs in res["reach98"].items())
            + "."
        )
        lines += ["", "DeepSpeed autotuner decisions: " + "; ".join(res["deepspeed_log"]) + "."]
        lines.append("")
    for note in doc.get("notes", []):
        lines += [f"Note: {note}", ""]
    return "\n".join(lines)


def write(doc: dict, out: str, render_doc: Callable[[dict], str] | None = None) -> None:
    """The report (``render_doc``, default this script's) and its raw JSON beside it."""
    Path(out).write_text((render_doc or render)(doc) + "\n")
    Path(out).with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"\nwrote {out}")


def merged(paths: list[str], findings: str | None, fix: Callable[[dict], dict] = lambda r: r) -> dict:
    """One document from the raw JSON of runs made in parts (``--merge``)."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    doc = {
        **docs[0],
        "runs": [r for d in docs for r in d["runs"]],
        "results": [fix(r) for d in docs for r in d["results"]],
        "notes": [n for d in docs for n in d.get("notes", [])],
    }
    if findings:
        doc["findings"] = Path(findings).read_text().strip()
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 seed, budgets 5/10/20; prints only (unless --out)")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument(
        "--out", default=None, help="results markdown (default: results/<date>-search-efficiency.md, full runs)"
    )
    ap.add_argument("--build-oracle-only", action="store_true", help="fill the simulated oracle table and exit")
    ap.add_argument("--rebuild-oracle", action="store_true", help="recompute the simulated oracle table")
    ap.add_argument(
        "--reverse",
        action="store_true",
        help="with --build-oracle-only: work from the other end (a second process beside the first)",
    )
    ap.add_argument(
        "--part",
        choices=("all", "analytic", "simulated"),
        default="all",
        help="only the analytic-oracle requests or only the simulated-oracle one",
    )
    ap.add_argument("--model", default=None, help="only the requests of this model")
    ap.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="write one report (--out) from the raw JSON of runs made with --part",
    )
    ap.add_argument(
        "--findings",
        default=None,
        metavar="MD",
        help="with --merge: a reader's summary of these figures, printed under the summary table",
    )
    args = ap.parse_args()
    if args.merge:
        doc = merged(args.merge, args.findings, _int_keys)
        print(render(doc))
        write(doc, args.out or str(RESULTS / f"{DATE}-search-efficiency.md"))
        return
    if args.build_oracle_only or args.rebuild_oracle:
        build_simulated_oracle(SIM_REQUEST, rebuild=args.rebuild_oracle, reverse=args.reverse)
        if args.build_oracle_only:
            return
    t_start = time.perf_counter()
    v = versions()  # the library as loaded now (other sessions may commit while this runs)
    seeds = list(range(args.seeds if args.seeds else (1 if args.quick else 5)))
    budgets = (5, 10, 20) if args.quick else BUDGETS

    def log(s: str) -> None:
        print(s, flush=True)

    results, notes = [], []
    for req in REQUESTS if args.part in ("all", "analytic") else ():
        if args.model and req.model != args.model:
            continue
        oracle = analytic_oracle(req)
        log(
            f"{req.label} [analytic oracle]: {len(oracle.entries)} plans, {oracle.n_fit} fit, optimum "
            f"{oracle.optimum:,.0f} tok/s ({oracle.best.plan.summary()})"
        )
        results.append(bench_request(oracle, seeds, budgets, log))
    if args.part in ("all", "simulated") and args.model in (None, SIM_REQUEST.model):
        table_ = read_table(oracle_path(SIM_REQUEST))
        n_plans = SIM_REQUEST.space().size()
        if len(table_) < n_plans:
            notes.append(
                f"simulated oracle table {oracle_path(SIM_REQUEST).name} has {len(table_)} of {n_plans} "
                "plans; run --build-oracle-only first — simulated part skipped"
            )
            log(notes[-1])
        else:
            oracle = simulated_oracle(SIM_REQUEST)
            log(
                f"{SIM_REQUEST.label} [simulated oracle, replayed]: {len(oracle.entries)} plans, {oracle.n_fit} fit, "
                f"optimum {oracle.optimum:,.0f} tok/s ({oracle.best.plan.summary()})"
            )
            results.append(bench_request(oracle, seeds, budgets, log))
    wall = time.perf_counter() - t_start
    doc = {
        "versions": v,
        "machine": machine(),
        "runs": [{"argv": sys.argv[1:], "wall_s": wall, "autofit": v["autofit"], "load": os.getloadavg()}],
        "seeds": seeds,
        "budgets": list(budgets),
        "results": results,
        "notes": notes,
    }
    print()
    print(render(doc))
    suffix = "" if args.part == "all" else f"-{args.part}"
    out = args.out or (None if args.quick else str(RESULTS / f"{DATE}-search-efficiency{suffix}.md"))
    if out:
        write(doc, out)


if __name__ == "__main__":
    main()

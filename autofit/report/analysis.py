"""What the tables, plots and report show, computed from stored results and evaluator calls.

``report.py``, ``plots.py`` and ``htmlreport.py`` only format. Every number they show
comes from here: from the ``TrialResult``s a study stored (:func:`standing`: the winner,
the runners-up, why the others lost, the Pareto front, predictions beside measurements)
or from real analytic evaluations (:func:`technique_effects`: one technique toggled at a
time from the winner). Imports without torch.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from autofit.evaluators.analytic import AnalyticEvaluator
from autofit.plan import (
    DEFAULT_CHECKPOINT_EVERY,
    Attention,
    Checkpointing,
    Method,
    Offload,
    Optimizer,
    Plan,
    Precision,
    Sharding,
    plan_changes,
    plan_problems,
)

# the answer's rule and the evaluators' fidelity live with the results (one home for every command)
from autofit.results import (  # noqa: F401  (re-exported)
    Status,
    Tiebreak,
    TrialResult,
    authoritative,
    best_per_method,
    fidelity,
    ranked,
    tiebreak,
    tied,
)
from autofit.specs import Target


# -- a study's standing --------------------------------------------------------------------------
@dataclass(frozen=True)
class Loss:
    """The plans that ended with one status, and why most of them lost."""

    status: str
    count: int
    reason: str  # the most common reason class among them
    reason_count: int
    nearest: TrialResult | None = None  # the one closest to winning (fastest; or least over the budget)
    over_bytes: int = 0  # for plans over the memory budget: how far the nearest one is over

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "count": self.count,
            "reason": self.reason,
            "reason_count": self.reason_count,
            "nearest": self.nearest.as_dict() if self.nearest else None,
            "over_bytes": self.over_bytes,
        }


@dataclass(frozen=True)
class Standing:
    """A study's answer and the evidence around it.

    ``results`` holds one result per plan: its most faithful evaluation (a measurement
    overrides a prediction). ``evaluations`` keeps every evaluation of every plan, so a
    prediction can be shown beside its measurement.
    """

    ctx: Target
    results: tuple[TrialResult, ...]
    ranked: tuple[TrialResult, ...]  # fitting plans: the winner, then the others fastest first
    best_per_method: dict[str, TrialResult]
    tiebreak: Tiebreak | None  # the winner beside the fastest plan: what the fastest adds, within the error
    losses: tuple[Loss, ...]
    pareto: tuple[TrialResult, ...]  # fitting plans no other fitting plan beats on memory and speed both
    closest: tuple[TrialResult, ...]  # plans with a memory figure, least device memory first
    evaluations: dict[str, tuple[TrialResult, ...]] = field(default_factory=dict)  # plan_id -> by fidelity

    @property
    def best(self) -> TrialResult | None:
        return self.ranked[0] if self.ranked else None

    def runners_up(self, k: int = 3) -> tuple[TrialResult, ...]:
        return self.ranked[1 : 1 + k]

    def speed_vs_best(self, r: TrialResult) -> float | None:
        """``r``'s tokens/s as a fraction of the winner's."""
        best = self.best
        if best is None or not best.tokens_per_sec:
            return None
        return r.tokens_per_sec / best.tokens_per_sec

    def over_budget(self, r: TrialResult) -> int | None:
        """Bytes per GPU over the fit budget (negative: to spare), or None without a memory figure."""
        return None if r.memory is None else r.memory.device_total - self.ctx.budget_bytes

    def counts(self) -> dict[str, int]:
        return dict(Counter(r.status.value for r in self.results))

    def anatomy_subjects(self, k: int = 4) -> tuple[AnatomyGroup, ...]:
        """What the anatomy plot compares: the winner and its runners-up, or, when nothing
        fits, the plans closest to fitting; each with all its evaluations (predicted, measured)."""
        if self.ranked:
            picks = [("winner", self.ranked[0])] + [(f"#{i + 2}", r) for i, r in enumerate(self.runners_up(k - 1))]
        else:
            picks = [("closest" if i == 0 else f"closest #{i + 1}", r) for i, r in enumerate(self.closest[:k])]
        return tuple(
            AnatomyGroup(role, r.plan, tuple(e for e in self.evaluations.get(r.plan.plan_id, (r,)) if e.memory))
            for role, r in picks
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "best": self.best.as_dict() if self.best else None,
            "tiebreak": self.tiebreak.as_dict() if self.tiebreak else None,
            "runners_up": [r.as_dict() for r in self.runners_up()],
            "best_per_method": {k: v.as_dict() for k, v in self.best_per_method.items()},
            "losses": [loss.as_dict() for loss in self.losses],
            "pareto": [r.plan.plan_id for r in self.pareto],
            "counts": self.counts(),
            "capacity_bytes": self.ctx.capacity_bytes,
            "budget_bytes": self.ctx.budget_bytes,
        }


@dataclass(frozen=True)
class AnatomyGroup:
    role: str  # "winner", "#2", "closest", ...
    plan: Plan
    results: tuple[TrialResult, ...]  # every evaluation with a memory anatomy, least faithful first


def pareto_front(results: Iterable[TrialResult]) -> tuple[TrialResult, ...]:
    """Fitting plans for which no other fitting plan needs less (or equal) memory and runs
    faster (or equally fast) with one of the two strictly better; least memory first."""
    fitting = sorted(
        (r for r in results if r.fits and r.memory is not None and r.throughput),
        key=lambda r: (r.memory.device_total, -r.tokens_per_sec),
    )
    front: list[TrialResult] = []
    for r in fitting:
        if not front or r.tokens_per_sec > front[-1].tokens_per_sec:
            front.append(r)
    return tuple(front)


_NUMBER = re.compile(r"\d[\d,]*(\.\d+)?")


def reason_class(r: TrialResult, ctx: Target, winner: TrialResult | None = None) -> str:
    """A reason that many plans share (numbers removed), to say why most of them lost."""
    if r.fits:
        if winner is not None and tied(*sorted((r, winner), key=lambda x: -x.tokens_per_sec)):
            return "within the time error of the winner, not simpler"
        return "slower than the winner"
    m = r.memory
    if m is not None and r.status in (Status.OOM, Status.SCREENED):
        prefix = "predicted " if r.status is Status.SCREENED else ""
        if m.device_total > ctx.budget_bytes:
            return f"{prefix}over the GPU memory budget, {m.bottleneck}"
        if m.host_bytes > ctx.cluster.host_memory_bytes:
            return f"{prefix}over the host memory for offload"
    if r.status is Status.PRUNED:
        return "pruned: its throughput could not beat the best so far"
    text = (r.reason or r.status.value).split(";")[0].strip()
    return _NUMBER.sub("N", text)[:100]


def standing(results: Iterable[TrialResult], ctx: Target) -> Standing:
    """The answer (``autofit.results.ranked``: the one rule every command shares) and the evidence around it."""
    results = list(results)
    chosen, evaluations = authoritative(results)
    fitting = ranked(results)
    closest = tuple(sorted((r for r in chosen if r.memory is not None), key=lambda r: r.memory.device_total))
    winner = fitting[0] if fitting else None
    losses = []
    for status in Status:
        group = [r for r in chosen if r.status is status and r is not winner]
        if not group:
            continue
        reasons = Counter(reason_class(r, ctx, winner) for r in group)
        reason, n = reasons.most_common(1)[0]
        nearest, over = None, 0
        if status is Status.FITS:
            nearest = max(group, key=lambda r: r.tokens_per_sec)
        else:
            over_budget = [r for r in group if r.memory is not None and r.memory.device_total > ctx.budget_bytes]
            if over_budget:
                nearest = min(over_budget, key=lambda r: r.memory.device_total)
                over = nearest.memory.device_total - ctx.budget_bytes
        losses.append(Loss(status.value, len(group), reason, n, nearest, over))
    return Standing(
        ctx=ctx,
        results=chosen,
        ranked=fitting,
        best_per_method=best_per_method(fitting),
        tiebreak=tiebreak(fitting),
        losses=tuple(losses),
        pareto=pareto_front(chosen),
        closest=closest,
        evaluations=evaluations,
    )


# -- one technique at a time ---------------------------------------------------------------------
@dataclass(frozen=True)
class Toggle:
    """The winner with one technique changed, evaluated analytically."""

    technique: str  # checkpointing, fused loss, attention, sharding, offload, micro-batch, method, ...
    label: str  # "checkpointing none → full"
    plan: Plan
    result: TrialResult
    memory_delta: int  # device_total bytes, toggled minus baseline
    speed_delta: float  # tokens/s, toggled minus baseline
    speed_ratio: float  # toggled / baseline tokens/s (0 when the baseline has no speed)

    def as_dict(self) -> dict[str, Any]:
        return {
            "technique": self.technique,
            "label": self.label,
            "plan": self.plan.as_dict(),
            "plan_id": self.plan.plan_id,
            "fits": self.result.fits,
            "device_total": self.result.memory.device_total if self.result.memory else None,
            "tokens_per_sec": self.result.tokens_per_sec,
            "memory_delta": self.memory_delta,
            "speed_delta": self.speed_delta,
            "speed_ratio": self.speed_ratio,
        }


@dataclass(frozen=True)
class Effects:
    baseline: TrialResult  # the plan toggled from, evaluated analytically like every toggle
    toggles: tuple[Toggle, ...]
    skipped: tuple[tuple[str, tuple[str, ...]], ...]  # (label, problems) of toggles that are not valid plans
    # what every figure here comes from; a study's answer may come from a more faithful one,
    # so plots and tables name it beside their numbers
    evaluator: str = "analytic"

    def as_dict(self) -> dict[str, Any]:
        return {
            "evaluator": self.evaluator,
            "baseline": self.baseline.as_dict(),
            "toggles": [t.as_dict() for t in self.toggles],
            "skipped": [{"label": label, "problems": list(p)} for label, p in self.skipped],
        }


def _allowed_list(allowed: Mapping[str, Sequence[Any]] | None, key: str, default: Sequence[Any]) -> list[Any]:
    values = list((allowed or {}).get(key) or [])
    return values or list(default)


def _context_parallel_candidates(plan: Plan) -> Iterator[tuple[str, str, Plan, list[Plan]]]:
    """Each sequence over twice (half) as many GPUs, at the same global batch: half (twice) the
    data-parallel ranks, so twice (half) the accumulation; falling back to FSDP with sdpa."""
    cp, ga = plan.context_parallel, plan.grad_accum
    doubled = plan.replace(context_parallel=cp * 2, grad_accum=ga * 2)
    fallback = doubled.replace(sharding=Sharding.FSDP, offload=Offload.NONE, attention=Attention.SDPA)
    yield "context parallelism", f"context parallel {cp} → {cp * 2} (grad-accum {ga} → {ga * 2})", doubled, [fallback]
    if cp > 1 and ga % 2 == 0:
        label = f"context parallel {cp} → {cp // 2} (grad-accum {ga} → {ga // 2})"
        yield "context parallelism", label, plan.replace(context_parallel=cp // 2, grad_accum=ga // 2), []


def _switch_candidates(plan: Plan) -> Iterator[tuple[str, str, Plan, list[Plan]]]:
    """Each checkpointing (selective with each of its policies: a period, op-level), and each
    on/off technique flipped."""
    policies = [(c, None, False) for c in Checkpointing if c is not Checkpointing.SELECTIVE]
    policies += [(Checkpointing.SELECTIVE, DEFAULT_CHECKPOINT_EVERY, False), (Checkpointing.SELECTIVE, None, True)]
    for ckpt, every, ops in policies:
        changed = plan.replace(checkpointing=ckpt, checkpoint_every=every, checkpoint_ops=ops)
        if changed != plan:
            yield "checkpointing", plan_changes(plan, changed)[0], changed, []
    toggles = (
        ("fused_loss", "fused loss"),
        ("fused_kernels", "fused kernels"),
        ("torch_compile", "torch.compile"),
        ("offload_activations", "activation offload"),
        ("optimizer_in_backward", "optimizer in backward"),
    )
    for name, technique in toggles:
        on = getattr(plan, name)
        yield technique, f"{technique} {'on → off' if on else 'off → on'}", plan.replace(**{name: not on}), []


def _candidates(
    plan: Plan, ctx: Target, allowed: Mapping[str, Sequence[Any]] | None
) -> Iterator[tuple[str, str, Plan, list[Plan]]]:
    """``(technique, label, plan, fallbacks)``: fallbacks are tried in order when ``plan`` is
    invalid; they change the one companion knob the technique needs (offload needs a sharding)."""
    yield from _switch_candidates(plan)
    for a in Attention:
        if a is not plan.attention:
            yield "attention", f"attention {plan.attention.value} → {a.value}", plan.replace(attention=a), []
    for s in Sharding:
        if s is plan.sharding:
            continue
        fallbacks = [plan.replace(sharding=s, offload=o) for o in Offload if o is not plan.offload]
        yield "sharding", f"sharding {plan.sharding.value} → {s.value}", plan.replace(sharding=s), fallbacks
    for o in Offload:
        if o is plan.offload:
            continue
        fallbacks = [
            plan.replace(offload=o, sharding=s)
            for s in (Sharding.ZERO2, Sharding.ZERO3, Sharding.FSDP, Sharding.NONE)
            if s is not plan.sharding
        ]
        yield "offload", f"offload {plan.offload.value} → {o.value}", plan.replace(offload=o), fallbacks
    mb, ga = plan.micro_batch, plan.grad_accum
    if ga % 2 == 0:
        yield (
            "micro-batch",
            f"micro-batch ×2 ({mb} → {mb * 2}, grad-accum {ga} → {ga // 2})",
            plan.replace(micro_batch=mb * 2, grad_accum=ga // 2),
            [],
        )
    if mb % 2 == 0:
        yield (
            "micro-batch",
            f"micro-batch ÷2 ({mb} → {mb // 2}, grad-accum {ga} → {ga * 2})",
            plan.replace(micro_batch=mb // 2, grad_accum=ga * 2),
            [],
        )
    yield from _context_parallel_candidates(plan)
    ranks = [int(r) for r in _allowed_list(allowed, "lora_ranks", [16])]
    for m in _allowed_list(allowed, "methods", Method.values()):
        m = Method(m)
        if m is plan.method:
            continue
        rank = None if m is Method.FULL else (plan.lora_rank or ranks[0])
        yield "method", f"method {plan.method.value} → {m.value}", plan.replace(method=m, lora_rank=rank), []
    if plan.is_peft:
        for r in ranks:
            if r != plan.lora_rank:
                yield "LoRA rank", f"LoRA rank {plan.lora_rank} → {r}", plan.replace(lora_rank=r), []
    for o in _allowed_list(allowed, "optimizers", [Optimizer.ADAMW.value]):
        o = Optimizer(o)
        if o is not plan.optimizer:
            yield "optimizer", f"optimizer {plan.optimizer.value} → {o.value}", plan.replace(optimizer=o), []
    for p in _allowed_list(allowed, "precisions", []):
        p = Precision(p)
        if p is not plan.precision:
            yield "precision", f"precision {plan.precision.value} → {p.value}", plan.replace(precision=p), []
    if ctx.workload.lengths is not None:
        yield (
            "packing",
            f"packing {'on → off' if plan.packing else 'off → on'}",
            plan.replace(packing=not plan.packing),
            [],
        )


def _valid_variant(
    technique: str, label: str, variant: Plan, fallbacks: list[Plan], ctx: Target
) -> tuple[str, Plan, list[str]]:
    """The variant, or the first valid fallback with its companion knob named in the label; else,
    where only torch.compile stands in the way (it is not modelled with QLoRA, Liger's kernels,
    ...), the variant without it. The problems of the variant where none is valid."""
    problems = plan_problems(variant, ctx.model, ctx.cluster, ctx.workload)
    if not problems:
        return label, variant, []
    for alt in fallbacks:
        if not plan_problems(alt, ctx.model, ctx.cluster, ctx.workload):
            changed = alt.sharding if technique == "offload" else alt.offload
            return f"{label} (with {'sharding' if technique == 'offload' else 'offload'} {changed.value})", alt, []
    plain = variant.replace(torch_compile=False)
    if variant.torch_compile and technique != "torch.compile":
        if not plan_problems(plain, ctx.model, ctx.cluster, ctx.workload):
            return f"{label} (without torch.compile)", plain, []
    return label, variant, problems


def technique_effects(plan: Plan, ctx: Target, allowed: Mapping[str, Sequence[Any]] | None = None) -> Effects:
    """Toggle one technique at a time from ``plan`` and evaluate each variant analytically.

    Quality-affecting choices (method, LoRA rank, optimizer, precision) are toggled only to
    what ``allowed`` (``Allowed.as_dict()`` or a study's stored ``allowed``) permits. A
    toggle that is not a valid plan is skipped with its problems; for sharding and offload
    the companion knob is adjusted first (offload on one GPU needs a ZeRO stage).
    """
    ev = AnalyticEvaluator()
    baseline = ev.evaluate(plan, ctx)
    if baseline.memory is None:  # a derived block the census cannot trace under it (errors.CensusError)
        return Effects(baseline, (), ((plan.summary(), (baseline.reason or str(baseline.status),)),))
    base_mem = baseline.memory.device_total
    toggles: list[Toggle] = []
    skipped: list[tuple[str, tuple[str, ...]]] = []
    seen = {plan.plan_id}
    for technique, label, variant, fallbacks in _candidates(plan, ctx, allowed):
        label, variant, problems = _valid_variant(technique, label, variant, fallbacks, ctx)
        if problems:
            skipped.append((label, tuple(problems)))
            continue
        if variant.plan_id in seen:
            continue
        seen.add(variant.plan_id)
        r = ev.evaluate(variant, ctx)
        if r.memory is None:
            skipped.append((label, (r.reason or str(r.status),)))
            continue
        ratio = r.tokens_per_sec / baseline.tokens_per_sec if baseline.tokens_per_sec else 0.0
        toggles.append(
            Toggle(
                technique,
                label,
                variant,
                r,
                r.memory.device_total - base_mem,
                r.tokens_per_sec - baseline.tokens_per_sec,
                ratio,
            )
        )
    return Effects(baseline, tuple(toggles), tuple(skipped))

"""What an evaluation returns: the memory anatomy, the throughput, the status (DESIGN.md's vocabulary).

Every layer above the evaluators reads these types (the store keeps them, the search ranks
them, reports draw them), so they live below all of them. Imports without torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from autofit.plan import Plan, complexity, plan_changes
from autofit.specs import Target

COMPONENTS = ("weights", "gradients", "optimizer", "activations", "temporary", "logits", "overhead")
TENSOR_COMPONENTS = COMPONENTS[:-1]  # what tensors hold; overhead is added on top of them
TOTALS = ("peak_allocated", "peak_reserved", "device_total")

# The evaluators, least faithful first: a measurement of a plan overrides its predictions.
EVALUATORS = ("analytic", "simulated", "measured")


def fidelity(evaluator: str) -> int:
    """How faithful an evaluator is: its place in :data:`EVALUATORS`; -1 for a name it lacks.

    The store's SQL (``autofit.store.store._fidelity``) spells out the same numbers."""
    try:
        return EVALUATORS.index(evaluator)
    except ValueError:
        return -1


class Status(str, Enum):
    FITS = "fits"
    OOM = "oom"
    SCREENED = "screened"  # predicted not to fit, so never evaluated (search screening)
    PRUNED = "pruned"  # a measured run the pruner stopped early: it could not beat the best so far
    FAILED = "failed"
    TIMEOUT = "timeout"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class MemoryAnatomy:
    """Per-rank memory at the peak moment, in bytes (DESIGN.md's vocabulary).

    The six tensor components sum to ``peak_allocated``; ``overhead`` is what the
    allocator, the CUDA context and NCCL add on top, so all seven sum to ``device_total``.
    ``host_bytes`` is host memory per node the plan needs (offload + processes).
    """

    weights: int
    gradients: int
    optimizer: int
    activations: int
    temporary: int
    logits: int
    overhead: int
    peak_allocated: int
    peak_reserved: int
    device_total: int
    host_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: int(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MemoryAnatomy:
        return cls(**{f.name: int(d.get(f.name, 0) or 0) for f in dataclasses.fields(cls)})

    @property
    def components(self) -> dict[str, int]:
        return {c: getattr(self, c) for c in COMPONENTS}

    @property
    def bottleneck(self) -> str:
        return bottleneck(self.components)


@dataclass(frozen=True)
class Throughput:
    tokens_per_sec: float  # effective: real (non-padding) tokens of the whole cluster
    step_time_s: float  # one optimizer step
    compute_s: float = 0.0
    comm_s: float = 0.0
    offload_s: float = 0.0
    flops_per_step: float = 0.0  # per rank
    mfu: float = 0.0  # model FLOPs utilization of the rank's dense peak

    def as_dict(self) -> dict[str, float]:
        return {f.name: float(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Throughput:
        return cls(**{f.name: float(d.get(f.name, 0.0) or 0.0) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class TrialResult:
    plan: Plan
    status: Status
    evaluator: str
    memory: MemoryAnatomy | None = None
    throughput: Throughput | None = None
    capacity_bytes: int = 0
    reason: str = ""  # why it is oom / pruned / failed, in one line
    duration_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.status is Status.FITS

    @property
    def tokens_per_sec(self) -> float:
        return self.throughput.tokens_per_sec if self.throughput else 0.0

    def embedded_prediction(self) -> TrialResult | None:
        """The estimate a measured result was screened by, stored inside it (the stored pair)."""
        p = self.extra.get("predicted") if self.extra else None
        if not p or not p.get("memory"):
            return None
        return TrialResult(
            plan=self.plan,
            status=Status(p["status"]),
            evaluator=p["evaluator"],
            memory=MemoryAnatomy.from_dict(p["memory"]),
            throughput=Throughput.from_dict(p["throughput"]) if p.get("throughput") else None,
            capacity_bytes=self.capacity_bytes,
            reason=p.get("reason", ""),
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrialResult:
        """The inverse of :meth:`as_dict` (its derived keys ``plan_id``, ``fits``, ``bottleneck`` are ignored)."""
        return cls(
            plan=Plan.from_dict(d["plan"]),
            status=Status(d["status"]),
            evaluator=d["evaluator"],
            memory=MemoryAnatomy.from_dict(d["memory"]) if d.get("memory") is not None else None,
            throughput=Throughput.from_dict(d["throughput"]) if d.get("throughput") is not None else None,
            capacity_bytes=int(d.get("capacity_bytes") or 0),
            reason=d.get("reason") or "",
            duration_s=float(d.get("duration_s") or 0.0),
            extra=dict(d.get("extra") or {}),
        )

    def as_dict(self) -> dict[str, Any]:
        """The JSON schema of ``autofit estimate --json`` (and of stored results)."""
        return {
            "plan": self.plan.as_dict(),
            "plan_id": self.plan.plan_id,
            "status": self.status.value,
            "evaluator": self.evaluator,
            "memory": self.memory.as_dict() if self.memory else None,
            "capacity_bytes": self.capacity_bytes,
            "fits": self.fits,
            "bottleneck": self.memory.bottleneck if self.memory else None,
            "throughput": self.throughput.as_dict() if self.throughput else None,
            "reason": self.reason,
            "duration_s": self.duration_s,
            **({"extra": self.extra} if self.extra else {}),
        }


# -- a study's answer -----------------------------------------------------------------------------
# The rule, in one place: per plan, its most faithful evaluation counts (the latest among
# equally faithful ones). Two fitting plans whose speeds are within the time model's error
# (:func:`time_error`) are a tie: the answer is the simplest plan (``autofit.plan.complexity``)
# among those tied with the fastest, the faster of equally simple ones, then the plan evaluated
# first (so a measurement that confirms a prediction never demotes its plan). The rest follow
# fastest first. ``autofit.store.store`` selects each plan's authoritative fitting rows in SQL
# and applies this rule to them (``ranked_among``) for its queries across studies
# (``best_trial``, ``list_studies``); a test holds the two together.
def authoritative(results: Iterable[TrialResult]) -> tuple[tuple[TrialResult, ...], dict[str, tuple[TrialResult, ...]]]:
    """One result per plan (the most faithful; the latest among equals), in the order plans
    first appear, and every evaluation by plan (one per evaluator, the latest, least faithful
    first; a measured row's embedded prediction counts as an evaluation where no row of that
    evaluator exists)."""
    by_plan: dict[str, list[TrialResult]] = {}
    for r in results:
        by_plan.setdefault(r.plan.plan_id, []).append(r)
    chosen, evaluations = [], {}
    for plan_id, rs in by_plan.items():
        chosen.append(max(enumerate(rs), key=lambda ir: (fidelity(ir[1].evaluator), ir[0]))[1])
        have = {r.evaluator for r in rs}
        embedded = []
        for r in rs:  # a measured row carries the estimate it was screened by
            p = r.embedded_prediction()
            if p is not None and p.evaluator not in have:
                embedded.insert(0, p)
                have.add(p.evaluator)
        latest: dict[str, TrialResult] = {}
        for _, r in sorted(enumerate(embedded + rs), key=lambda ir: (fidelity(ir[1].evaluator), ir[0])):
            latest[r.evaluator] = r
        evaluations[plan_id] = tuple(sorted(latest.values(), key=lambda r: fidelity(r.evaluator)))
    return tuple(chosen), evaluations


# The relative error within which two tokens/s figures of an evaluator cannot be told apart, where
# a result does not state its own (``extra["time_error"]``). A measurement's is its noise floor
# between runs of one plan; the analytic and simulated ones, their roofline's error.
DEFAULT_TIME_ERROR = {"analytic": 0.15, "simulated": 0.15, "measured": 0.03}


def time_error(result: TrialResult) -> float:
    """The relative error of ``result``'s tokens/s (0.12: ±12%): ``extra["time_error"]`` where the
    evaluator states it, else :data:`DEFAULT_TIME_ERROR` (0 for an evaluator it lacks). A
    measurement's is at least its noise floor, and wider where its own timings say so: twice the
    relative standard error of the mean of its timed steps, and the relative range of its
    runs where the plan was measured again (``extra["runs_tokens_per_sec"]``)."""
    extra = result.extra or {}
    if extra.get("time_error") is not None:
        return float(extra["time_error"])
    error = DEFAULT_TIME_ERROR.get(result.evaluator, 0.0)
    if result.evaluator == "measured":
        runs = extra.get("runs_tokens_per_sec") or ()
        error = max(error, _mean_spread(extra.get("step_times_s") or ()), _range(runs))
    return error


def _mean_spread(times: Iterable[float]) -> float:
    """Twice the standard error of the mean of ``times``, relative to the mean (0 under two)."""
    xs = [float(t) for t in times]
    n = len(xs)
    if n < 2:
        return 0.0
    mean = sum(xs) / n
    if mean <= 0:
        return 0.0
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return 2.0 * (var / n) ** 0.5 / mean


def _range(values: Iterable[float]) -> float:
    """(max - min) / mean of ``values`` (0 under two)."""
    xs = [float(v) for v in values]
    if len(xs) < 2 or sum(xs) <= 0:
        return 0.0
    return (max(xs) - min(xs)) / (sum(xs) / len(xs))


def tied(faster: TrialResult, slower: TrialResult) -> bool:
    """Whether ``slower`` is within the time error of ``faster``: its tokens/s at least
    ``faster``'s / (1 + e), e the larger of the two results' :func:`time_error`."""
    e = max(time_error(faster), time_error(slower))
    return slower.tokens_per_sec >= faster.tokens_per_sec / (1.0 + e)


def ranked(results: Iterable[TrialResult]) -> tuple[TrialResult, ...]:
    """A study's fitting plans, each by its most faithful evaluation: first the answer, the
    simplest plan (``autofit.plan.complexity``) among those :func:`tied` with the fastest (the
    faster of equally simple ones), then the others fastest first; among equally fast ones, the
    plan that appears first in ``results`` (the store's order: trial number, then id).
    ``ranked(...)[0]`` is the study's answer (see :func:`winner`)."""
    chosen, _ = authoritative(results)
    return ranked_among(chosen)


def ranked_among(chosen: Iterable[TrialResult]) -> tuple[TrialResult, ...]:
    """:func:`ranked`'s order over results that already count as their plans' evaluations
    (``authoritative``'s choice, or the store's rows of it across studies, where one plan may
    appear once per study): no two of them are merged."""
    fastest_first = sorted((r for r in chosen if r.fits and r.throughput is not None), key=lambda r: -r.tokens_per_sec)
    if not fastest_first:
        return ()
    top = fastest_first[0]
    ties = [r for r in fastest_first if tied(top, r)]
    answer = min(ties, key=lambda r: complexity(r.plan))  # min keeps the first (the fastest) of equals
    return (answer, *(r for r in fastest_first if r is not answer))


def winner(results: Iterable[TrialResult]) -> TrialResult | None:
    """The answer of a study: the simplest fitting plan within the time error of the fastest,
    a measurement superseding the predictions of the same plan. One of the given objects (``is``
    finds its row), or None."""
    best = ranked(results)
    return best[0] if best else None


def best_per_method(results: Iterable[TrialResult]) -> dict[str, TrialResult]:
    """The answer among each method's plans (:func:`ranked`'s rule, method by method), the
    answer's method first, then by how each method's first plan ranks."""
    by_method: dict[str, list[TrialResult]] = {}
    for r in ranked(results):
        by_method.setdefault(r.plan.method.value, []).append(r)
    return {m: ranked(rs)[0] for m, rs in by_method.items()}


@dataclass(frozen=True)
class Tiebreak:
    """Why the answer is the plan it is: the fastest plan by its figures, the plans tied with it,
    and what the fastest does differently from the answer with the gain it is predicted to buy."""

    answer: TrialResult
    fastest: TrialResult  # the fastest fitting plan (the answer itself when no simpler one ties)
    ties: tuple[TrialResult, ...]  # the plans within the time error of the fastest, fastest first
    error: float  # the relative time error the answer and the fastest are compared with

    @property
    def gain(self) -> float:
        """How much faster the fastest plan is than the answer (0.01: 1%)."""
        a = self.answer.tokens_per_sec
        return self.fastest.tokens_per_sec / a - 1.0 if a else 0.0

    @property
    def changes(self) -> tuple[str, ...]:
        """What the fastest plan does differently from the answer (``autofit.plan.plan_changes``)."""
        return plan_changes(self.answer.plan, self.fastest.plan)

    @property
    def simpler(self) -> bool:
        """Whether the answer is a simpler plan than the fastest one."""
        return self.answer is not self.fastest

    def as_dict(self) -> dict[str, Any]:
        return {
            "answer_plan_id": self.answer.plan.plan_id,
            "fastest_plan_id": self.fastest.plan.plan_id,
            "fastest": self.fastest.as_dict() if self.simpler else None,
            "fastest_tokens_per_sec": self.fastest.tokens_per_sec,
            "fastest_evaluator": self.fastest.evaluator,
            "gain": self.gain,
            "time_error": self.error,
            "within_error": self.simpler,
            "changes": list(self.changes),
            "ties": len(self.ties),
        }


def tiebreak(results: Iterable[TrialResult]) -> Tiebreak | None:
    """The answer of :func:`ranked` beside the fastest plan (None when nothing fits)."""
    best = ranked(results)
    if not best:
        return None
    answer = best[0]
    fastest = max(best, key=lambda r: r.tokens_per_sec)  # the first of equally fast ones
    if fastest.tokens_per_sec == answer.tokens_per_sec:
        fastest = answer
    ties = tuple(r for r in sorted(best, key=lambda r: -r.tokens_per_sec) if tied(fastest, r))
    return Tiebreak(answer, fastest, ties, max(time_error(answer), time_error(fastest)))


def judge(memory: MemoryAnatomy, ctx: Target) -> tuple[Status, str]:
    """Fits when ``device_total <= capacity × (1 - headroom)`` and the host has room.

    An estimate's 95% margin on real GPUs is reported beside the decision, not in it
    (``evaluators.costs.fit_margin_extra``; docs/EVALUATORS.md says why).
    """
    budget = ctx.budget_bytes
    if memory.device_total > budget:
        over = memory.device_total - budget
        return Status.OOM, (
            f"needs {memory.device_total / 2**30:.2f} GiB per GPU, {over / 2**30:.2f} GiB over the "
            f"{budget / 2**30:.2f} GiB budget ({ctx.cluster.gpu.name}, {ctx.headroom:.0%} headroom); "
            f"{memory.bottleneck}"
        )
    if memory.host_bytes > ctx.cluster.host_memory_bytes:
        return Status.OOM, (
            f"needs {memory.host_bytes / 2**30:.1f} GiB of host memory per node for offload, "
            f"the node has {ctx.cluster.host_memory_bytes / 2**30:.0f} GiB (--host-mem)"
        )
    return Status.FITS, ""


def fit_margin_of(result: TrialResult) -> dict[str, Any]:
    """The 95% margin an estimate carries (``{}`` for a measurement or the CPU target):
    ``fraction``, ``bytes`` and whether the plan still fits with it (``fits_with_margin``)."""
    return dict((result.extra or {}).get("fit_margin") or {})


def bottleneck(components: dict[str, float]) -> str:
    """``activation-bound``, ``optimizer-bound`` or ``weight-bound``: what dominates the peak."""
    groups = {
        "activation-bound": components.get("activations", 0)
        + components.get("logits", 0)
        + components.get("temporary", 0),
        "optimizer-bound": components.get("optimizer", 0) + components.get("gradients", 0),
        "weight-bound": components.get("weights", 0),
    }
    return max(groups, key=lambda k: groups[k])

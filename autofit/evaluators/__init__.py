"""Evaluators: one interface (``base.Evaluator``), several fidelities.

Torch is imported only by the fidelities that build models (simulated, measured).
"""

from __future__ import annotations

from autofit.errors import AutofitError
from autofit.evaluators.base import EvalContext, Evaluator, TrialResult

BACKENDS = ("auto", "analytic", "simulated", "measured")


def get_evaluator(name: str) -> Evaluator:
    """The evaluator for a concrete backend name."""
    if name == "analytic":
        from autofit.evaluators.analytic import AnalyticEvaluator

        return AnalyticEvaluator()
    if name == "simulated":
        from autofit.evaluators.simulated import SimulatedEvaluator

        return SimulatedEvaluator()
    raise AutofitError(f"backend {name!r} is not available; use one of: analytic, simulated")


def resolve_backend(name: str, ctx: EvalContext) -> str:
    """``auto``: the most faithful evaluator available for the target cluster.

    ``measured`` when the target GPUs are present locally (once that backend exists: the
    check goes here), else ``simulated``, which needs no GPU.
    """
    if name not in BACKENDS:
        raise AutofitError(f"unknown backend {name!r}; use one of {', '.join(BACKENDS)}")
    if name != "auto":
        return name
    # measured: when local GPUs match ctx.cluster (same GPU type, enough of them) -> "measured"
    return "simulated"


def evaluate(plan, ctx: EvalContext, backend: str = "auto") -> TrialResult:
    """Validate ``plan`` for ``ctx`` (raising PlanError with every problem) and evaluate it."""
    from autofit.plan import validate_plan

    validate_plan(plan, ctx.model, ctx.cluster, ctx.workload)
    return get_evaluator(resolve_backend(backend, ctx)).evaluate(plan, ctx)


__all__ = ["BACKENDS", "EvalContext", "Evaluator", "TrialResult", "evaluate", "get_evaluator", "resolve_backend"]

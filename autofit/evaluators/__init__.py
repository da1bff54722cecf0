"""Evaluators: one interface (``base.Evaluator``), three fidelities (analytic, simulated,
measured), and ``evaluate(plan, target)`` that validates a plan and picks the most faithful
evaluator available.

May import results, export (the measured evaluator launches the exported files),
techniques, plan and specs; never the store, the search, the report or the CLI. Torch is
imported only by the fidelities that build models (simulated, measured), and by the analytic
evaluator only for a derived block its formulas do not describe (``traced.py``).
"""

from __future__ import annotations

from autofit.errors import AutofitError
from autofit.evaluators.base import Evaluator
from autofit.results import EVALUATORS, TrialResult
from autofit.specs import Target

EVALUATOR_CHOICES = ("auto", *EVALUATORS)  # auto: the most faithful one available for the target


def get_evaluator(name: str, **options) -> Evaluator:
    """The evaluator for a concrete evaluator name; ``options`` go to the measured evaluator
    (``warmup_steps``, ``timed_steps``, ``timeout_s``, ``cpu_mem_budget``, ``work_dir``, ``env``)."""
    if name == "analytic":
        from autofit.evaluators.analytic import AnalyticEvaluator

        return AnalyticEvaluator()
    if name == "simulated":
        from autofit.evaluators.simulated import SimulatedEvaluator

        return SimulatedEvaluator()
    if name == "measured":
        from autofit.evaluators.measured import MeasuredEvaluator

        return MeasuredEvaluator(**options)
    raise AutofitError(f"evaluator {name!r} is not available; use one of: analytic, simulated, measured")


def resolve_evaluator(name: str, ctx: Target) -> str:
    """``auto``: the most faithful evaluator available for the target cluster."""
    if name not in EVALUATOR_CHOICES:
        raise AutofitError(f"unknown evaluator {name!r}; use one of {', '.join(EVALUATOR_CHOICES)}")
    if ctx.cluster.gpu.analytic_only and name in ("simulated", "measured"):
        raise AutofitError(
            f"the {name} evaluator cannot model {ctx.cluster.gpu.name}: it traces the kernels CUDA PyTorch runs, "
            "not ROCm's; use --evaluator analytic (or auto)"
        )
    if name == "measured":
        from autofit.evaluators.measured import target_device

        target_device(ctx)  # raises, in one line, when this machine cannot run the target
        return name
    if name != "auto":
        return name
    return _auto(ctx)


def _auto(ctx: Target) -> str:
    """Measure when this machine has the target GPUs (model and count, one node), else simulate;
    analytic-only GPUs (AMD) get the analytic evaluator.

    The local-CPU target (``1xcpu``) is never measured by ``auto``: it exists to plan and
    test without a GPU, where a real run takes minutes; ``--evaluator measured`` asks for one.
    """
    if ctx.cluster.gpu.analytic_only:  # AMD: no trace says which ROCm kernels run (specs.gpus)
        return "analytic"
    if ctx.cluster.gpu.kind == "cuda" and ctx.cluster.nodes == 1:
        from autofit.evaluators.measured import local_gpus_match

        if local_gpus_match(ctx.cluster):
            return "measured"
    return "simulated"


def evaluate(plan, ctx: Target, evaluator: str = "auto", **options) -> TrialResult:
    """Validate ``plan`` for ``ctx`` (raising PlanError with every problem) and evaluate it.

    ``options`` configure the measured evaluator and are ignored by the estimators.
    """
    from autofit.plan import validate_plan

    validate_plan(plan, ctx.model, ctx.cluster, ctx.workload)
    name = resolve_evaluator(evaluator, ctx)
    return get_evaluator(name, **(options if name == "measured" else {})).evaluate(plan, ctx)


__all__ = ["EVALUATOR_CHOICES", "Target", "Evaluator", "TrialResult", "evaluate", "get_evaluator", "resolve_evaluator"]

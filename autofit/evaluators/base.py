"""The evaluator interface: ``Evaluator.evaluate(plan, target) -> TrialResult``.

Evaluators *return* a result whose status says fits, OOM, failed or timeout; they raise
only for programmer errors. The result types live in :mod:`autofit.results`. Imports
without torch.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from autofit.plan import Plan
from autofit.results import Status, TrialResult
from autofit.specs import Target


@dataclass(frozen=True)
class StepReport:
    """What a measured run reports after each step (for pruning)."""

    step: int
    tokens_per_sec: float
    peak_bytes: int


StepCallback = Callable[[StepReport], bool]  # return False to stop the run (pruned)


class Evaluator(abc.ABC):
    """One fidelity of evaluation."""

    name: ClassVar[str]

    @abc.abstractmethod
    def evaluate(self, plan: Plan, ctx: Target, on_step: StepCallback | None = None) -> TrialResult:
        """Evaluate ``plan``; never raise for a plan that does not fit or fails to run."""

    def failed(self, plan: Plan, ctx: Target, reason: str, started: float) -> TrialResult:
        """The result of a plan this evaluator could not evaluate (``started``: ``time.perf_counter()``)."""
        return TrialResult(
            plan=plan,
            status=Status.FAILED,
            evaluator=self.name,
            capacity_bytes=ctx.capacity_bytes,
            reason=reason,
            duration_s=time.perf_counter() - started,
        )

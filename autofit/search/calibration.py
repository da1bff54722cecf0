"""Calibration: learn how far predictions are from measurements on a GPU type, and correct them.

Every measured trial is stored with the estimate it was screened by (the stored pair).
For a GPU type (the local CPU counts as its own type), the ratio measured / predicted of
each memory component, of ``peak_allocated`` and ``device_total``, and of tokens/s is
collected over all fitting pairs; a robust centre (the median after dropping ratios more
than 3 median absolute deviations away) becomes that figure's correction factor. Later
predictions on that GPU type are multiplied by it; the raw figures stay in the result
(``extra["raw"]``) and both are reported. ``--no-calibration`` turns it off.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from autofit.results import TENSOR_COMPONENTS, MemoryAnatomy, Status, TrialResult, judge
from autofit.specs import Target

KEYS = (*TENSOR_COMPONENTS, "peak_allocated", "device_total", "tokens_per_sec")
MIN_PAIRS = 3
OUTLIER_MADS = 3.0


def robust_centre(values: list[float]) -> float:
    """Median after removing values more than ``OUTLIER_MADS`` median absolute deviations away."""
    med = statistics.median(values)
    mad = statistics.median(abs(v - med) for v in values)
    if mad == 0:
        return med
    kept = [v for v in values if abs(v - med) <= OUTLIER_MADS * mad]
    return statistics.median(kept)


@dataclass(frozen=True)
class Calibration:
    gpu: str
    evaluator: str  # the fidelity it corrects (analytic, simulated)
    n_pairs: int
    factors: dict[str, float]

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def apply(self, result: TrialResult, ctx: Target) -> TrialResult:
        """A calibrated copy of a prediction (re-judged for fit); raw figures kept in ``extra``."""
        if result.evaluator != self.evaluator or result.memory is None:
            return result
        m, f = result.memory, self.factors
        scaled = {c: getattr(m, c) * f.get(c, 1.0) for c in TENSOR_COMPONENTS}
        peak = m.peak_allocated * f.get("peak_allocated", 1.0)
        total_scaled = sum(scaled.values()) or 1.0
        comps = {c: int(v * peak / total_scaled) for c, v in scaled.items()}  # sum to the calibrated peak
        peak_allocated = sum(comps.values())
        device_total = max(int(m.device_total * f.get("device_total", 1.0)), peak_allocated)
        reserved = min(device_total, peak_allocated + (m.peak_reserved - m.peak_allocated))
        memory = MemoryAnatomy(
            **comps,
            overhead=device_total - peak_allocated,
            peak_allocated=peak_allocated,
            peak_reserved=reserved,
            device_total=device_total,
            host_bytes=m.host_bytes,
        )
        t = result.throughput
        throughput = t
        if t is not None and "tokens_per_sec" in f:
            k = f["tokens_per_sec"]
            throughput = dataclasses.replace(
                t, tokens_per_sec=t.tokens_per_sec * k, step_time_s=t.step_time_s / k, mfu=t.mfu * k
            )
        status, reason = result.status, result.reason
        if status in (Status.FITS, Status.OOM):
            status, reason = judge(memory, ctx)
        extra = {
            **result.extra,
            "raw": {"memory": m.as_dict(), "throughput": t.as_dict() if t else None, "status": result.status.value},
            "calibration": {"gpu": self.gpu, "n_pairs": self.n_pairs, "factors": self.factors},
        }
        return dataclasses.replace(
            result, status=status, reason=reason, memory=memory, throughput=throughput, extra=extra
        )


def learn(pairs: Iterable[tuple[TrialResult, TrialResult]], gpu: str, evaluator: str) -> Calibration | None:
    """From (predicted, measured) pairs of one fidelity on one GPU type; None under ``MIN_PAIRS``."""
    ratios: dict[str, list[float]] = {k: [] for k in KEYS}
    n = 0
    for predicted, measured in pairs:
        if predicted.evaluator != evaluator or predicted.memory is None or measured.memory is None:
            continue
        n += 1
        for k in KEYS:
            if k == "tokens_per_sec":
                p, q = predicted.tokens_per_sec, measured.tokens_per_sec
            else:
                p, q = getattr(predicted.memory, k), getattr(measured.memory, k)
            if p and q and p > 0 and q > 0:
                ratios[k].append(q / p)
    if n < MIN_PAIRS:
        return None
    factors = {k: robust_centre(v) for k, v in ratios.items() if len(v) >= MIN_PAIRS}
    return Calibration(gpu=gpu, evaluator=evaluator, n_pairs=n, factors=factors)


def from_store(store, gpu: str, evaluator: str) -> Calibration | None:
    """The calibration of ``evaluator`` on ``gpu`` learned from every stored measured pair."""
    pairs = []
    for rec in store.measured_trials(gpu):
        measured = rec.result()
        predicted = measured.embedded_prediction()
        if predicted is not None:
            pairs.append((predicted, measured))
    return learn(pairs, gpu, evaluator)


def for_context(ctx: Target, evaluator: str, db_url: str | None = None) -> Calibration | None:
    """The calibration for a one-off estimate: only from a database that already exists
    (an estimate never creates the default database just to look for pairs)."""
    import os

    from autofit.store import Store
    from autofit.store.store import ENV_VAR, default_path

    if db_url is None and not os.environ.get(ENV_VAR) and not os.path.exists(default_path()):
        return None
    with Store(db_url) as store:
        return from_store(store, ctx.cluster.gpu.name, evaluator)

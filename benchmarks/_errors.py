"""Per-component error summaries shared by the accuracy benchmarks."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping

SMALL = 0.01  # components under 1% of the peak are compared in points of the peak (the tests' rule)


def component_errors(
    ref: Mapping[str, float], other: Mapping[str, float], peak: float, small: float = SMALL
) -> dict[str, float]:
    """|other - ref| per component: relative to ``ref``, or in points of ``peak`` when both are small."""
    out = {}
    for comp, r in ref.items():
        s = other.get(comp, 0)
        if max(r, s) < small * peak:
            out[comp] = abs(s - r) / peak
        else:
            out[comp] = abs(s - r) / max(r, 1)
    return out


# reference components, other components, reference peak, other peak
Case = tuple[Mapping[str, float], Mapping[str, float], float, float]


def summary_table(cases: Iterable[Case], label: str, small: float = SMALL) -> list[str]:
    """Markdown rows: the peak's error and each component's, median and worst over all cases.

    A component's error is given two ways: relative to itself (over the cases where the
    reference component is at least ``small`` of the peak: a few KiB of scalars would
    otherwise read as thousands of percent), and in points of the peak (how far it moves
    the peak; every case).
    """
    cases = list(cases)

    def pct(xs: list[float]) -> tuple[str, str]:
        return (f"{statistics.median(xs) * 100:.3f}%", f"{max(xs) * 100:.3f}%") if xs else ("–", "–")

    rows = [
        f"| {label} | cases | median rel. | worst rel. | cases ≥ {small:.0%} of peak "
        "| median, points of peak | worst, points of peak |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    med, worst = pct([abs(op - rp) / rp for _, _, rp, op in cases])
    rows.append(f"| **peak** | {len(cases)} | {med} | {worst} | {len(cases)} | {med} | {worst} |")
    for comp in cases[0][0] if cases else {}:
        rel = [abs(o.get(comp, 0) - r[comp]) / r[comp] for r, o, p, _ in cases if r[comp] >= small * p]
        pts = [abs(o.get(comp, 0) - r[comp]) / p for r, o, p, _ in cases]
        (m1, w1), (m2, w2) = pct(rel), pct(pts)
        rows.append(f"| {comp} | {len(cases)} | {m1} | {w1} | {len(rel)} | {m2} | {w2} |")
    return rows

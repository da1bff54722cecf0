"""Per-component error summaries shared by the accuracy benchmarks."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping

SMALL = 0.01  # components under 1% of the peak are compared in points of the peak (the tests' rule)


def component_errors(ref: Mapping[str, int], other: Mapping[str, int], peak: int,
                     small: float = SMALL) -> dict[str, float]:
    """|other - ref| per component: relative to ``ref``, or in points of ``peak`` when both are small."""
    out = {}
    for comp, r in ref.items():
        s = other.get(comp, 0)
        if max(r, s) < small * peak:
            out[comp] = abs(s - r) / peak
        else:
            out[comp] = abs(s - r) / max(r, 1)
    return out


def summary_table(per_case: Iterable[Mapping[str, float]], peaks: Iterable[float], label: str) -> list[str]:
    """Markdown rows: median and worst |error| of the peak and of each component over all cases."""
    per_case, peaks = list(per_case), [abs(p) for p in peaks]
    rows = [f"| {label} | cases | median abs error | worst abs error |", "|---|---:|---:|---:|"]
    if peaks:
        rows.append(f"| **peak** | {len(peaks)} | {statistics.median(peaks) * 100:.3f}% | {max(peaks) * 100:.3f}% |")
    comps: dict[str, list[float]] = {}
    for case in per_case:
        for comp, err in case.items():
            comps.setdefault(comp, []).append(err)
    for comp, errs in comps.items():
        rows.append(f"| {comp} | {len(errs)} | {statistics.median(errs) * 100:.3f}% | {max(errs) * 100:.3f}% |")
    return rows

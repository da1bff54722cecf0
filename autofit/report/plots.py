"""Figures of a study, drawn with matplotlib's object API on the Agg canvas (no pyplot, no
global backend switch), written as PNG and SVG. Formatting only: every value drawn comes
from :mod:`autofit.report.analysis` (stored results, analytic evaluations).

matplotlib is imported lazily (``pip install 'autofit[plot]'``); the colour of each
anatomy component is fixed here and used by every figure and by the HTML report.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autofit.results import COMPONENTS, fidelity
from autofit.specs.units import GiB

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from autofit.report.analysis import AnatomyGroup, Effects, Standing
    from autofit.specs import Target


# One colour per DESIGN.md component (Okabe-Ito, readable by colour-blind people), everywhere.
COMPONENT_COLORS = {
    "weights": "#0072B2",
    "gradients": "#56B4E9",
    "optimizer": "#D55E00",
    "activations": "#009E73",
    "temporary": "#F0E442",
    "logits": "#E69F00",
    "overhead": "#999999",
}
STATUS_STYLE = {  # status -> (colour, marker)
    "fits": ("#009E73", "o"),
    "oom": ("#D55E00", "X"),
    "screened": ("#999999", "s"),
    "pruned": ("#56B4E9", "D"),
    "failed": ("#000000", "x"),
    "timeout": ("#CC79A7", "v"),
}
CAPACITY_COLOR = "#B00020"
BUDGET_COLOR = "#6A3D9A"
EVALUATOR_HATCH = {
    "analytic": "",
    "simulated": "..",
    "measured": "//",
}  # one per evaluator of autofit.results.EVALUATORS

PLOTS = {  # file stem -> what it shows
    "memory-anatomy": "Memory anatomy of the winner and the runners-up",
    "memory-vs-speed": "Memory against tokens/s for every trial",
    "technique-effects": "The effect of each technique, one at a time from the winner (analytic estimates)",
}

_RC = {
    "svg.fonttype": "none",  # text stays text: smaller files, searchable and selectable
    "svg.hashsalt": "autofit",  # stable element ids: the same study draws the same SVG
    "font.size": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
}


def _mpl():
    try:
        import matplotlib
    except ImportError as exc:  # an optional extra
        raise ImportError("plots need matplotlib: pip install 'autofit[plot]'") from exc
    from matplotlib.figure import Figure

    return matplotlib, Figure


def _wrap(text: str, width: int = 30) -> str:
    return "\n".join(textwrap.wrap(text, width=width, break_long_words=False)) or text


def _capacity_lines(ax, ctx: Target, horizontal: bool = True) -> None:
    line = ax.axhline if horizontal else ax.axvline
    cap, budget = ctx.capacity_bytes / GiB, ctx.budget_bytes / GiB
    line(cap, color=CAPACITY_COLOR, lw=1.4, label=f"{ctx.cluster.gpu.name} capacity {cap:.1f} GiB")
    line(
        budget, color=BUDGET_COLOR, lw=1.2, ls="--", label=f"fit budget {budget:.1f} GiB ({ctx.headroom:.0%} headroom)"
    )


# -- (a) memory anatomy --------------------------------------------------------------------------
def anatomy_figure(groups: Sequence[AnatomyGroup], ctx: Target) -> Figure:
    """Stacked bars of the seven components per plan, every evaluation of a plan side by
    side (prediction, measurement), against the GPU's capacity and the fit budget."""
    matplotlib, Figure = _mpl()
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(max(7.0, 2.3 * len(groups) + 2.5), 5.6), layout="constrained")
        ax = fig.add_subplot()
        for gi, group in enumerate(groups):
            _anatomy_bars(ax, gi, group)
        _capacity_lines(ax, ctx)
        ax.set_xticks(range(len(groups)), [f"{g.role}\n{_wrap(g.plan.summary())}" for g in groups], fontsize=7.5)
        ax.tick_params(axis="x", pad=16 if any(len(g.results) > 1 for g in groups) else 4)
        ax.set_ylabel("GiB per GPU (device_total)")
        ax.set_ylim(
            0,
            max(
                [ctx.capacity_bytes / GiB * 1.08]
                + [r.memory.device_total / GiB * 1.15 for g in groups for r in g.results]
            ),
        )
        ax.set_xlim(-0.6, len(groups) - 0.4)
        ax.set_title(
            f"Memory anatomy per GPU: {ctx.model.name} on {ctx.cluster.label}, "
            f"seq {ctx.workload.seq_len}, global batch {ctx.workload.global_batch}"
        )
        _anatomy_legend(ax, groups)
    return fig


def _anatomy_bars(ax, gi: int, group: AnatomyGroup) -> None:
    """The stacked bars of one plan at x = ``gi``: one bar per evaluation, each annotated with
    its total (host memory, the status where it does not fit) and, where several, its evaluator."""
    n = len(group.results)
    width = 0.75 / max(n, 1)
    for ri, r in enumerate(group.results):
        x = gi + (ri - (n - 1) / 2) * width
        bottom = 0.0
        for comp in COMPONENTS:
            value = getattr(r.memory, comp) / GiB
            ax.bar(
                x,
                value,
                width * 0.92,
                bottom=bottom,
                color=COMPONENT_COLORS[comp],
                hatch=EVALUATOR_HATCH[r.evaluator],
                edgecolor="white",
                linewidth=0.4,
                label=comp if (gi, ri) == (0, 0) else None,
                gid=f"bar-{gi}-{r.evaluator}-{comp}",
            )
            bottom += value
        note = f"{r.memory.device_total / GiB:.2f}"
        if r.memory.host_bytes:
            note += f"\nhost {r.memory.host_bytes / GiB:.0f} GiB"
        if not r.fits:
            note += f"\n{r.status.value}"
        ax.annotate(
            note,
            (x, bottom),
            xytext=(0, 2),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=7.5,
            color="#222222" if r.fits else CAPACITY_COLOR,
        )
        if n > 1:
            ax.annotate(
                r.evaluator,
                (x, 0),
                xytext=(0, -11),
                textcoords="offset points",
                ha="center",
                va="top",
                fontsize=7,
                color="#444444",
                annotation_clip=False,
            )


def _anatomy_legend(ax, groups: Sequence[AnatomyGroup]) -> None:
    """The components, and, where plans were evaluated more than one way, the hatch of each evaluator."""

    handles, labels = ax.get_legend_handles_labels()
    shown = sorted({r.evaluator for g in groups for r in g.results}, key=fidelity)
    if len(shown) > 1:  # say which bar is a prediction and which a measurement
        from matplotlib.patches import Patch

        for ev in shown:
            handles.append(Patch(facecolor="white", edgecolor="#444444", hatch=EVALUATOR_HATCH[ev]))
            labels.append(ev)
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=8)


# -- (b) memory vs tokens/s ----------------------------------------------------------------------
def tradeoff_figure(standing: Standing) -> Figure:
    """Every trial's device memory against its tokens/s, the fit boundary and the Pareto front."""
    matplotlib, Figure = _mpl()
    ctx = standing.ctx
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(8.5, 5.2), layout="constrained")
        ax = fig.add_subplot()
        plotted = [r for r in standing.results if r.memory is not None and r.throughput is not None]
        xmax = max([ctx.capacity_bytes / GiB * 1.1] + [r.memory.device_total / GiB * 1.05 for r in plotted])
        ax.axvspan(ctx.budget_bytes / GiB, xmax, color=CAPACITY_COLOR, alpha=0.06, lw=0, label="does not fit")
        _capacity_lines(ax, ctx, horizontal=False)
        for status, (color, marker) in STATUS_STYLE.items():
            pts = [r for r in plotted if r.status.value == status]
            if pts:
                ax.scatter(
                    [r.memory.device_total / GiB for r in pts],
                    [r.tokens_per_sec for r in pts],
                    s=28,
                    c=color,
                    marker=marker,
                    alpha=0.85,
                    linewidths=0.5,
                    label=f"{status} ({len(pts)})",
                    gid=f"trials-{status}",
                )
        if standing.pareto:
            xs = [r.memory.device_total / GiB for r in standing.pareto]
            ys = [r.tokens_per_sec for r in standing.pareto]
            ax.plot(
                xs,
                ys,
                drawstyle="steps-post",
                color="#222222",
                lw=1.2,
                marker="D",
                ms=4,
                label=f"Pareto front ({len(xs)})",
                gid="pareto",
            )
        best = standing.best
        if best is not None:
            ax.scatter(
                [best.memory.device_total / GiB],
                [best.tokens_per_sec],
                s=220,
                marker="*",
                c="#F0E442",
                edgecolors="#222222",
                linewidths=0.8,
                zorder=5,
                label="winner",
                gid="winner",
            )
            ax.annotate(
                _wrap(best.plan.summary(), 40),
                (best.memory.device_total / GiB, best.tokens_per_sec),
                xytext=(10, -4),
                textcoords="offset points",
                fontsize=7,
                va="top",
            )
        xmin = min([ctx.budget_bytes / GiB] + [r.memory.device_total / GiB for r in plotted])
        if xmax / max(xmin, 1e-3) > 20:  # a few huge plans would squash the ones that matter
            ax.set_xscale("log")
            ax.set_xlim(xmin / 1.3, xmax)
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        else:
            ax.set_xlim(0, xmax)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("GiB per GPU (device_total)")
        ax.set_ylabel("tokens/s (effective, whole cluster)")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.set_title(f"Memory against speed: {len(plotted)} plans of {ctx.model.name} on {ctx.cluster.label}")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=8)
    return fig


# -- (c) technique effects -----------------------------------------------------------------------
def effects_figure(
    effects: Effects, ctx: Target, subject: str = "the winner", answer_evaluator: str | None = None
) -> Figure:
    """One bar pair per toggled technique: Δ device memory (GiB) and Δ tokens/s (%).

    Every number is the effects' evaluator's (analytic); where the study's answer comes from
    another (``answer_evaluator``), the title says so, so the plot is not read as the answer's."""
    matplotlib, Figure = _mpl()
    toggles = effects.toggles
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(10.0, 1.4 + 0.34 * max(len(toggles), 1)), layout="constrained")
        ax_mem, ax_speed = fig.subplots(1, 2, sharey=True)
        ys = list(range(len(toggles)))[::-1]
        labels = [t.label + ("" if t.result.fits else "  (does not fit)") for t in toggles]
        mem = [t.memory_delta / GiB for t in toggles]
        speed = [(t.speed_ratio - 1.0) * 100 for t in toggles]
        hatches = ["" if t.result.fits else "//" for t in toggles]
        bars = ax_mem.barh(ys, mem, color=["#0072B2" if v <= 0 else "#D55E00" for v in mem], hatch=None, gid="memory")
        for bar, h in zip(bars, hatches):
            bar.set_hatch(h)
        bars = ax_speed.barh(ys, speed, color=["#009E73" if v >= 0 else "#E69F00" for v in speed], gid="speed")
        for bar, h in zip(bars, hatches):
            bar.set_hatch(h)
        for ax, values, fmt in ((ax_mem, mem, "{:+.2f} GiB"), (ax_speed, speed, "{:+.1f}%")):
            ax.axvline(0, color="#222222", lw=0.8)
            for y, v in zip(ys, values):
                ax.annotate(
                    fmt.format(v),
                    (v, y),
                    xytext=(3 if v >= 0 else -3, 0),
                    textcoords="offset points",
                    ha="left" if v >= 0 else "right",
                    va="center",
                    fontsize=7,
                )
            lo, hi = min(values + [0.0]), max(values + [0.0])
            span = hi - lo or 1.0
            ax.set_xlim(lo - (0.5 if lo < 0 else 0.1) * span, hi + (0.4 if hi > 0 else 0.1) * span)
        headroom = (ctx.budget_bytes - effects.baseline.memory.device_total) / GiB
        ax_mem.axvline(headroom, color=BUDGET_COLOR, lw=1.0, ls="--")
        ax_mem.annotate(
            "fit budget",
            (headroom, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(-3, -2),
            textcoords="offset points",
            ha="right",
            va="top",
            fontsize=7,
            color=BUDGET_COLOR,
        )
        ax_mem.set_xlim(min(ax_mem.get_xlim()[0], headroom * 1.1), max(ax_mem.get_xlim()[1], headroom * 1.1))
        ax_mem.set_yticks(ys, labels, fontsize=8)
        b = effects.baseline
        ax_mem.set_xlabel(
            f"Δ GiB per GPU (baseline {b.memory.device_total / GiB:.2f} GiB; budget {ctx.budget_bytes / GiB:.1f} GiB)"
        )
        ev = effects.evaluator
        ax_speed.set_xlabel(f"Δ tokens/s, % ({ev}; baseline {b.tokens_per_sec:,.0f} tokens/s {ev})")
        ax_mem.set_title(f"memory ({ev})")
        ax_speed.set_title(f"speed ({ev})")
        other = (
            f"; {ev} estimates, not the {answer_evaluator} figures of the answer"
            if answer_evaluator and answer_evaluator != ev
            else ""
        )
        fig.suptitle(
            f"One technique at a time from {subject} ({ctx.model.name} on {ctx.cluster.label}, {ev}{other}):\n"
            f"{b.plan.summary()}",
            fontsize=9,
        )
    return fig


# -- files ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlotFile:
    name: str  # file stem, a key of PLOTS
    title: str
    png: Path
    svg: Path

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "png": str(self.png), "svg": str(self.svg)}


def save(fig: Figure, out_dir: str | Path, name: str, dpi: int = 110) -> PlotFile:
    """Write ``name.png`` and ``name.svg``; both carry no date, so reruns give the same files."""
    matplotlib, _ = _mpl()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png, svg = out / f"{name}.png", out / f"{name}.svg"
    with matplotlib.rc_context(_RC):
        fig.savefig(png, format="png", dpi=dpi, metadata={"Software": None})
        fig.savefig(svg, format="svg", metadata={"Date": None, "Creator": None})
    return PlotFile(name, PLOTS.get(name, name), png, svg)


def write_plots(standing: Standing, effects: Effects | None, out_dir: str | Path) -> list[PlotFile]:
    """The three figures of a study as PNG + SVG files in ``out_dir``."""
    files = []
    groups = standing.anatomy_subjects()
    if groups:
        files.append(save(anatomy_figure(groups, standing.ctx), out_dir, "memory-anatomy"))
    if standing.results:
        files.append(save(tradeoff_figure(standing), out_dir, "memory-vs-speed"))
    if effects is not None and effects.toggles:
        subject = "the winner" if standing.best is not None else "the closest plan"
        answer = standing.best.evaluator if standing.best is not None else None
        files.append(save(effects_figure(effects, standing.ctx, subject, answer), out_dir, "technique-effects"))
    return files

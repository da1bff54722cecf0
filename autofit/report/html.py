"""``autofit report``: one self-contained HTML page per study, with its plots beside it.

:func:`write_report` reads a study back from the store, asks :mod:`autofit.report.analysis` for
the answer and the technique effects, draws the figures (:mod:`autofit.report.plots`), shows
the winner's exported files inline (as ``autofit export`` would write them), and writes
``report.html`` plus each figure as PNG and SVG into the output directory. The page
embeds the PNGs as ``data:`` URIs and carries its CSS inline: it needs no network, no
JavaScript and no other file to open. Formatting only; the numbers come from the store
and from analytic evaluations.

The functions here prepare plain values (formatted numbers, the rows of each table); the
markup is the Jinja2 template ``templates/report.html.j2``, rendered with autoescape on, so
every value, a stored name included, is escaped. No value is passed as ``Markup``: the only
non-text data, the PNGs, are base64, which escaping leaves as it is.
"""

from __future__ import annotations

import base64
import datetime
import functools
import importlib.metadata
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from autofit.errors import AutofitError, ReportError
from autofit.results import COMPONENTS, TOTALS, TrialResult
from autofit.specs import Target
from autofit.specs.units import GiB

REPORT_NAME = "report.html"


@dataclass(frozen=True)
class ReportFiles:
    """What ``write_report`` wrote, and what it had to leave out (with why)."""

    study: str
    out_dir: Path
    html: Path
    plots: tuple[Any, ...] = ()  # autofit.report.plots.PlotFile
    configs: tuple[str, ...] = ()  # names of the exported files shown inline
    notes: tuple[str, ...] = ()  # sections left out, each with its reason
    best: TrialResult | None = None
    standing: Any = None  # autofit.report.analysis.Standing
    effects: Any = None  # autofit.report.analysis.Effects

    def as_dict(self) -> dict[str, Any]:
        return {
            "study": self.study,
            "out_dir": str(self.out_dir),
            "html": str(self.html),
            "plots": [p.as_dict() for p in self.plots],
            "configs": list(self.configs),
            "notes": list(self.notes),
            "best": self.best.as_dict() if self.best else None,
            "standing": self.standing.as_dict() if self.standing is not None else None,
            "technique_effects": self.effects.as_dict() if self.effects is not None else None,
        }


@functools.cache
def _template() -> jinja2.Template:
    """The page's template; autoescape is on, so every value it interpolates is escaped."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("autofit.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    return env.get_template("report.html.j2")


@dataclass(frozen=True)
class Cell:
    """A table cell whose text the template draws as ``kind`` says: plain (""), a ``status``
    badge, ``bold``, or after a colour ``swatch`` (``color``)."""

    text: Any
    kind: str = ""
    color: str = ""


@dataclass(frozen=True)
class Table:
    """A titled table for the template: one class per column ("num", "wrap", both or none)."""

    id: str
    caption: str
    header: Sequence[str]
    rows: list[list[Cell]]
    classes: list[str]
    winner_rows: frozenset[int]


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f}"


def _table(
    table_id: str,
    caption: str,
    header: Sequence[str],
    rows: Iterable[Sequence[Any]],
    numeric: Iterable[int] = (),
    wrap: Iterable[int] = (),
    winner_rows: Iterable[int] = (),
) -> Table:
    """A titled table. Only the ``wrap`` columns (plans, reasons) may wrap; numbers are right-aligned."""
    numeric, wrap = set(numeric), set(wrap)
    classes = [
        " ".join((["num"] if i in numeric else []) + (["wrap"] if i in wrap else [])) for i in range(len(header))
    ]
    cells = [[c if isinstance(c, Cell) else Cell(c) for c in row] for row in rows]
    return Table(table_id, caption, header, cells, classes, frozenset(winner_rows))


def _anatomy_rows(results: Sequence[TrialResult], ctx: Target) -> list[list[Any]]:
    from autofit.report.plots import COMPONENT_COLORS

    rows: list[list[Any]] = []
    for comp in COMPONENTS:
        row: list[Any] = [Cell(comp, "swatch", COMPONENT_COLORS[comp])]
        for r in results:
            value = getattr(r.memory, comp)
            row += [_gib(value), f"{value / r.memory.device_total:.1%}" if r.memory.device_total else ""]
        rows.append(row)
    for total in TOTALS:
        row = [Cell(total, "bold" if total == "device_total" else "")]
        for r in results:
            row += [_gib(getattr(r.memory, total)), ""]
        rows.append(row)
    row = ["fit budget per GPU"]
    for _ in results:
        row += [_gib(ctx.budget_bytes), f"of {_gib(ctx.capacity_bytes)}"]
    rows.append(row)
    return rows


def render_html(
    rec,
    ctx: Target,
    trials: Sequence[Any],
    standing,
    effects,
    plots: Sequence[Any],
    configs: dict[str, str] | None,
    notes: Sequence[str],
    db_url: str,
) -> str:
    """The page. ``plots`` are PlotFiles (their PNGs are embedded); ``configs`` name -> text."""
    return _template().render(
        title=f"autofit report: {rec.name}",
        study=_study_line(rec, ctx, trials, standing),
        answer=_answer(rec, ctx, trials, standing),
        figures=[_figure(plot) for plot in plots],
        plot_notes=[note for note in notes if note.startswith("plots")],
        tables=_tables(rec, ctx, standing, effects),
        skipped=effects.skipped if effects is not None and effects.toggles else (),
        trials=_trials_table(trials, standing.best),
        configs=configs or {},
        export_command=f"autofit export {shlex.quote(rec.name)}",
        config_notes=[note for note in notes if note.startswith("configs")],
        optuna_study=rec.optuna_study_name or "-",
        db_url=db_url,
        commands=optuna_commands(rec, db_url),
        version=importlib.metadata.version("autofit"),
        written=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}",
        study_id=rec.id,
    )


# -- what the sections of the page show, top to bottom (the markup is the template's)
def _study_line(rec, ctx: Target, trials: Sequence[Any], standing) -> str:
    """The line under the title: model, cluster, workload, evaluator, state of the study."""
    counts = ", ".join(f"{n} {s}" for s, n in sorted(standing.counts().items()))
    return (
        f"{ctx.model.name} ({ctx.model.n_params / 1e9:.2f}B parameters) on "
        f"{ctx.cluster.label} ({_gib(ctx.capacity_bytes)} GiB per GPU, {ctx.headroom:.0%} headroom) · "
        f"seq {ctx.workload.seq_len} · global batch {ctx.workload.global_batch} · {rec.evaluator} · "
        f"study {rec.status} · {len(trials)} evaluations ({counts}) · created "
        f"{rec.created_at:%Y-%m-%d %H:%M} UTC"
    )


def _answer(rec, ctx: Target, trials: Sequence[Any], standing) -> dict[str, Any]:
    """The answer: the winner, or why there is none (no evaluations yet, or nothing fits)."""
    from autofit.report.console import margin_text, tiebreak_lines, why

    best = standing.best
    if best is not None:
        t, m = best.throughput, best.memory
        return {
            "winner": best.plan.summary(),
            "figures": f"{t.tokens_per_sec:,.0f} tokens/s · {t.step_time_s:.2f} s/step · MFU {t.mfu:.0%} · "
            f"{_gib(m.device_total)} of {_gib(ctx.capacity_bytes)} GiB per GPU (budget {_gib(ctx.budget_bytes)})"
            f"{margin_text(best)} · {m.bottleneck} · evaluated by {best.evaluator} · plan {best.plan.plan_id}",
            "tiebreak": tiebreak_lines(standing.tiebreak) if standing.tiebreak is not None else [],
        }
    if not trials:
        return {"winner": None, "empty": True, "status": rec.status}
    closest = standing.closest[0] if standing.closest else None
    return {
        "winner": None,
        "empty": False,
        "model": ctx.model.name,
        "cluster": ctx.cluster.label,
        "seq_len": ctx.workload.seq_len,
        "closest": closest.plan.summary() if closest is not None else None,
        "closest_gib": _gib(closest.memory.device_total) if closest is not None else None,
        "closest_why": why(closest) if closest is not None else None,
    }


def _figure(plot) -> dict[str, str]:
    """A figure (a PlotFile): its PNG as base64 for a ``data:`` URI, and the files beside the page."""
    data = base64.b64encode(Path(plot.png).read_bytes()).decode("ascii")
    return {"name": plot.name, "title": plot.title, "data": data, "png": plot.png.name, "svg": plot.svg.name}


def _tables(rec, ctx: Target, standing, effects) -> list[Table]:
    """The tables above the trials: anatomy, the standing of the methods, the losses, technique effects."""
    return [
        *_anatomy_table(ctx, standing),
        *_method_tables(rec, standing),
        *_losses_table(standing),
        *_effects_table(effects, standing.best),
    ]


def _anatomy_table(ctx: Target, standing) -> list[Table]:
    """The memory anatomy of the winner (or the closest plan), one column pair per evaluation."""
    groups = standing.anatomy_subjects(1)
    if not groups:
        return []
    g = groups[0]
    header = ["component"]
    for r in g.results:
        header += [f"{r.evaluator} GiB", "share"]
    what = "winner" if standing.best is not None else "closest plan"
    return [
        _table(
            "anatomy",
            f"Memory anatomy of the {what}, per GPU: {g.plan.summary()}",
            header,
            _anatomy_rows(g.results, ctx),
            numeric=range(1, len(header)),
        )
    ]


def _method_tables(rec, standing) -> list[Table]:
    """The best plan per method and the runners-up; only where a plan fits."""
    if standing.best is None:
        return []
    allowed = rec.allowed.get("methods") or []
    rows = [
        [
            method,
            r.plan.summary(),
            _gib(r.memory.device_total),
            f"{r.tokens_per_sec:,.0f}",
            f"{standing.speed_vs_best(r):.0%}",
            r.memory.bottleneck,
        ]
        for method, r in standing.best_per_method.items()
    ]
    rows += [[m, "nothing of this method fits", "", "", "", ""] for m in allowed if m not in standing.best_per_method]
    tables = [
        _table(
            "best-per-method",
            "Best plan per method",
            ["method", "plan", "device GiB", "tokens/s", "vs winner", "bottleneck"],
            rows,
            numeric=[2, 3, 4],
            wrap=[1],
        )
    ]
    rows = [
        [
            f"#{i}",
            r.plan.summary(),
            _gib(r.memory.device_total),
            f"{r.tokens_per_sec:,.0f}",
            f"{standing.speed_vs_best(r):.1%}",
            r.memory.bottleneck,
        ]
        for i, r in enumerate(standing.runners_up(), start=2)
    ]
    if rows:
        tables.append(
            _table(
                "runners-up",
                "Runners-up",
                ["rank", "plan", "device GiB", "tokens/s", "vs winner", "bottleneck"],
                rows,
                numeric=[0, 2, 3, 4],
                wrap=[1],
            )
        )
    return tables


def _losses_table(standing) -> list[Table]:
    """Why the other plans lost, one row per status."""
    from autofit.report.console import loss_text

    if not standing.losses:
        return []
    rows = [[Cell(loss.status, "status"), loss.count, *loss_text(loss, standing)] for loss in standing.losses]
    return [
        _table(
            "losses",
            "Why the others lost",
            ["status", "plans", "most common reason", "closest to winning"],
            rows,
            numeric=[1],
            wrap=[2, 3],
        )
    ]


def _effects_table(effects, answer: TrialResult | None = None) -> list[Table]:
    """One technique toggled at a time (analytic); the template lists the toggles that are not valid plans."""
    if effects is None or not effects.toggles:
        return []
    b = effects.baseline
    other = (
        f" estimates, not the {answer.evaluator} figures of the answer"
        if answer is not None and answer.evaluator != effects.evaluator
        else ""
    )
    rows = [
        [
            t.label,
            "yes" if t.result.fits else "no",
            _gib(t.result.memory.device_total),
            f"{t.memory_delta / GiB:+.2f}",
            f"{t.result.tokens_per_sec:,.0f}",
            f"{(t.speed_ratio - 1) * 100:+.1f}%",
            t.result.memory.bottleneck,
        ]
        for t in effects.toggles
    ]
    return [
        _table(
            "technique-effects",
            f"One technique at a time from {b.plan.summary()} ({effects.evaluator}{other}: "
            f"{_gib(b.memory.device_total)} GiB, {b.tokens_per_sec:,.0f} tokens/s)",
            ["change", "fits", "device GiB", "Δ GiB", "tokens/s", "Δ tokens/s", "bottleneck"],
            rows,
            numeric=[2, 3, 4, 5],
            wrap=[0],
        )
    ]


def _trials_table(trials: Sequence[Any], best: TrialResult | None) -> Table:
    """Every evaluation of the study; the winner's row is starred and highlighted."""
    from autofit.report.console import why

    rows, winners = [], []
    for n, t in enumerate(trials):
        r = t.result()
        m = r.memory
        winner = best is not None and r.plan.plan_id == best.plan.plan_id and r.evaluator == best.evaluator
        if winner:
            winners.append(n)
        rows.append(
            [
                f"★ {t.number}" if winner else t.number,
                Cell(r.status.value, "status"),
                r.evaluator,
                r.plan.summary(),
                _gib(m.device_total) if m else "",
                _gib(m.peak_allocated) if m else "",
                f"{r.tokens_per_sec:,.0f}" if r.tokens_per_sec else "",
                f"{r.throughput.step_time_s:.2f}" if r.throughput else "",
                m.bottleneck if m else "",
                why(r),
            ]
        )
    return _table(
        "trials",
        f"Every evaluation ({len(trials)})",
        [
            "#",
            "status",
            "evaluator",
            "plan",
            "device GiB",
            "peak_alloc GiB",
            "tokens/s",
            "s/step",
            "bottleneck",
            "why it lost",
        ],
        rows,
        numeric=[0, 4, 5, 6, 7],
        wrap=[3, 9],
        winner_rows=winners,
    )


def optuna_commands(rec, db_url: str) -> str:
    """Shell commands to look further; the stored names are quoted (a name is never code)."""
    return (
        f"autofit show {shlex.quote(rec.name)}\n"
        f"optuna-dashboard '{db_url}'   # pip install optuna-dashboard; open http://127.0.0.1:8080\n"
        f"optuna trials --study-name {shlex.quote(rec.optuna_study_name or '')} --storage '{db_url}'"
    )


def _configs(best: TrialResult, ctx: Target) -> tuple[dict[str, str] | None, str | None]:
    """The winner's exported files as {name: text}, or a note saying why they are missing."""
    try:
        from autofit.export import export_files
    except ImportError as exc:
        return None, f"configs: the exporter (autofit.export) is not available in this installation ({exc})"
    try:
        return export_files(best.plan, ctx, expected=best), None
    except AutofitError as exc:
        return None, f"configs: the winner could not be exported: {exc}"


def write_report(store, study: str | int, out_dir: str | Path) -> ReportFiles:
    """Write ``report.html`` and the figures (PNG + SVG) of ``study`` into ``out_dir``."""
    from autofit.report import analysis

    rec = store.get_study(study)
    trials = store.trials(rec.id)
    ctx = rec.context()
    standing = analysis.standing([t.result() for t in trials], ctx)
    subject = standing.best or (standing.closest[0] if standing.closest else None)
    effects = analysis.technique_effects(subject.plan, ctx, rec.allowed) if subject is not None else None
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReportError(f"cannot create the report directory {out}: {exc.strerror or exc}") from None
    notes: list[str] = []
    plots: list[Any] = []
    try:
        from autofit.report import plots as plotting

        plots = plotting.write_plots(standing, effects, out)
    except ImportError as exc:
        notes.append(f"plots: {exc}")
    except OSError as exc:
        raise ReportError(f"cannot write the plots into {out}: {exc.strerror or exc}") from None
    configs = None
    if standing.best is not None:
        configs, note = _configs(standing.best, ctx)
        if note:
            notes.append(note)
    else:
        notes.append("configs: no plan fits, so there is nothing to export")
    page = render_html(rec, ctx, trials, standing, effects, plots, configs, notes, store.masked_url)
    path = out / REPORT_NAME
    try:
        path.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise ReportError(f"cannot write {path}: {exc.strerror or exc}") from None
    return ReportFiles(
        rec.name, out, path, tuple(plots), tuple(configs or ()), tuple(notes), standing.best, standing, effects
    )

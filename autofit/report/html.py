"""``autofit report``: one self-contained HTML page per study, with its plots beside it.

:func:`write_report` reads a study back from the store, asks :mod:`autofit.report.analysis` for
the answer and the technique effects, draws the figures (:mod:`autofit.report.plots`), exports
the winner's config files into a temporary directory to show them inline, and writes
``report.html`` plus each figure as PNG and SVG into the output directory. The page
embeds the PNGs as ``data:`` URIs and carries its CSS inline: it needs no network, no
JavaScript and no other file to open. Formatting only; the numbers come from the store
and from analytic evaluations.
"""

from __future__ import annotations

import base64
import datetime
import html
import importlib.metadata
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f}"


def _table(
    table_id: str,
    caption: str,
    header: Sequence[str],
    rows: Iterable[Sequence[Any]],
    numeric: Iterable[int] = (),
    raw: Iterable[int] = (),
    wrap: Iterable[int] = (),
    winner_rows: Iterable[int] = (),
) -> str:
    """A titled HTML table; cells are escaped except the columns in ``raw`` (already HTML).
    Only the ``wrap`` columns (plans, reasons) may wrap; numbers are right-aligned."""
    numeric, raw, wrap, winner_rows = set(numeric), set(raw), set(wrap), set(winner_rows)

    def cls(i: int) -> str:
        names = (["num"] if i in numeric else []) + (["wrap"] if i in wrap else [])
        return f' class="{" ".join(names)}"' if names else ""

    out = [
        f'<h3 id="{table_id}-title">{_e(caption)}</h3><table id="{table_id}" '
        f'aria-labelledby="{table_id}-title"><thead><tr>'
    ]
    out += [f"<th{cls(i)}>{_e(h)}</th>" for i, h in enumerate(header)]
    out.append("</tr></thead><tbody>")
    for n, row in enumerate(rows):
        cells = []
        for i, cell in enumerate(row):
            text = str(cell) if i in raw else _e(cell)
            cells.append(f"<td{cls(i)}>{text}</td>")
        out.append(('<tr class="winner">' if n in winner_rows else "<tr>") + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _status(status: str) -> str:
    return f'<span class="status {_e(status)}">{_e(status)}</span>'


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:2rem auto;max-width:1200px;
padding:0 1rem;color:#1b1b1b}
h1{font-size:1.6rem;margin-bottom:.2rem}h2{margin-top:2.2rem;border-bottom:1px solid #ddd;padding-bottom:.2rem}
.sub{color:#555}.answer{font-size:1.1rem;padding:.8rem 1rem;border-left:4px solid #009E73;background:#f3faf7}
.answer.none{border-color:#B00020;background:#fdf3f4}.plan{font-family:ui-monospace,Menlo,Consolas,monospace}
.tiebreak{color:#555;margin:-.6rem 0 1rem;padding:0 1rem 0 1.25rem}
h3{font-size:1rem;margin:1.4rem 0 .3rem}table{border-collapse:collapse;margin:0 0 1rem;font-size:13px}
th,td{border-bottom:1px solid #e4e4e4;padding:.25rem .6rem;text-align:left;vertical-align:top;white-space:nowrap}
th{background:#f6f6f6}td.wrap{white-space:normal;min-width:16rem}td.num,th.num{text-align:right;
font-variant-numeric:tabular-nums}
tr.winner td{font-weight:600;background:#fffbe6}.swatch{display:inline-block;width:.9em;height:.9em;
margin-right:.4em;vertical-align:-.1em;border:1px solid #0003}.status{font-weight:600}
.status.fits{color:#007a5a}.status.oom{color:#B00020}.status.screened{color:#8a6d00}.status.pruned{color:#8a6d00}.status.failed,
.status.timeout{color:#8a3b77}figure{margin:1rem 0 2rem}figure img{max-width:100%;height:auto;
border:1px solid #eee}figcaption{color:#555;font-size:.9rem}.note{padding:.5rem .8rem;background:#fff8e1;
border-left:4px solid #E69F00}pre{background:#f6f8fa;padding:.8rem;overflow-x:auto;font-size:12px}
details{margin:.4rem 0}summary{cursor:pointer;font-weight:600}code{font-family:ui-monospace,Menlo,monospace}
"""


def _anatomy_rows(results: Sequence[TrialResult], ctx: Target) -> list[list[str]]:
    from autofit.report.plots import COMPONENT_COLORS

    rows = []
    for comp in COMPONENTS:
        swatch = f'<span class="swatch" style="background:{COMPONENT_COLORS[comp]}"></span>{_e(comp)}'
        row = [swatch]
        for r in results:
            value = getattr(r.memory, comp)
            row += [_gib(value), f"{value / r.memory.device_total:.1%}" if r.memory.device_total else ""]
        rows.append(row)
    for total in TOTALS:
        row = [f"<b>{total}</b>" if total == "device_total" else total]
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
    sections = (
        _header(rec, ctx, trials, standing),
        _answer(rec, ctx, trials, standing),
        _figures(plots, notes),
        _tables(rec, ctx, trials, standing, effects),
        _config_files(rec, configs, notes),
        _looking_further(rec, db_url),
    )
    return "\n".join(part for section in sections for part in section)


# -- the sections of the page, top to bottom; each returns its parts (the page joins them with newlines)
def _header(rec, ctx: Target, trials: Sequence[Any], standing) -> list[str]:
    """The document head (title, inline CSS), the title and the study line."""
    title = f"autofit report: {rec.name}"
    counts = ", ".join(f"{n} {s}" for s, n in sorted(standing.counts().items()))
    return [
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
        f'<meta name="viewport" content="width=device-width,initial-scale=1"><style>{_CSS}</style></head><body>',
        f"<h1>{_e(title)}</h1>",
        f'<p class="sub" id="study">{_e(ctx.model.name)} ({ctx.model.n_params / 1e9:.2f}B parameters) on '
        f"{_e(ctx.cluster.label)} ({_gib(ctx.capacity_bytes)} GiB per GPU, {ctx.headroom:.0%} headroom) · "
        f"seq {ctx.workload.seq_len} · global batch {ctx.workload.global_batch} · {_e(rec.evaluator)} · "
        f"study {_e(rec.status)} · {len(trials)} evaluations ({_e(counts)}) · created "
        f"{rec.created_at:%Y-%m-%d %H:%M} UTC</p>",
    ]


def _answer(rec, ctx: Target, trials: Sequence[Any], standing) -> list[str]:
    """The answer: the winner, or why there is none (no evaluations yet, or nothing fits)."""
    from autofit.report.console import margin_text, tiebreak_lines, why

    best = standing.best
    if best is not None:
        t, m = best.throughput, best.memory
        lines = tiebreak_lines(standing.tiebreak) if standing.tiebreak is not None else []
        tiebreak = [f'<p class="tiebreak" id="tiebreak">{"<br>".join(_e(x) for x in lines)}</p>'] if lines else []
        return [
            f'<p class="answer" id="answer">Winner: <b class="plan" id="winner-plan">'
            f"{_e(best.plan.summary())}</b><br>{t.tokens_per_sec:,.0f} tokens/s · {t.step_time_s:.2f} s/step · "
            f"MFU {t.mfu:.0%} · {_gib(m.device_total)} of {_gib(ctx.capacity_bytes)} GiB per GPU "
            f"(budget {_gib(ctx.budget_bytes)}){_e(margin_text(best))} · {_e(m.bottleneck)} · "
            f"evaluated by {_e(best.evaluator)} · "
            f"plan {_e(best.plan.plan_id)}</p>",
            *tiebreak,
        ]
    if not trials:
        return [
            f'<p class="answer none" id="answer">This study has no evaluations yet ({_e(rec.status)}); '
            f"continue it with <code>autofit search … --resume</code>.</p>"
        ]
    closest = standing.closest[0] if standing.closest else None
    extra = ""
    if closest is not None:
        extra = (
            f"<br>Closest: <span class=plan>{_e(closest.plan.summary())}</span> needs "
            f"{_gib(closest.memory.device_total)} GiB per GPU ({_e(why(closest))})"
        )
    return [
        f'<p class="answer none" id="answer">No plan fits {_e(ctx.model.name)} on {_e(ctx.cluster.label)} '
        f"at seq {ctx.workload.seq_len}.{extra}</p>"
    ]


def _missing(notes: Sequence[str], section: str) -> list[str]:
    """The notes of ``write_report`` that say why ``section`` ("plots", "configs") is missing."""
    return [f'<p class="note" id="{section}-missing">{_e(note)}</p>' for note in notes if note.startswith(section)]


def _figures(plots: Sequence[Any], notes: Sequence[str]) -> list[str]:
    """Every figure, its PNG embedded as a ``data:`` URI, with links to the files beside the page."""
    parts = ['<h2 id="plots">Plots</h2>']
    for plot in plots:
        data = base64.b64encode(Path(plot.png).read_bytes()).decode("ascii")
        parts.append(
            f'<figure id="figure-{_e(plot.name)}"><img id="plot-{_e(plot.name)}" alt="{_e(plot.title)}" '
            f'src="data:image/png;base64,{data}"><figcaption>{_e(plot.title)} · files beside this page: '
            f'<a href="{_e(plot.png.name)}">{_e(plot.png.name)}</a>, '
            f'<a href="{_e(plot.svg.name)}">{_e(plot.svg.name)}</a></figcaption></figure>'
        )
    return parts + _missing(notes, "plots")


def _tables(rec, ctx: Target, trials: Sequence[Any], standing, effects) -> list[str]:
    """The tables: anatomy, the standing of the methods, the losses, technique effects, every trial."""
    return [
        '<h2 id="tables">Tables</h2>',
        *_anatomy_table(ctx, standing),
        *_method_tables(rec, standing),
        *_losses_table(standing),
        *_effects_table(effects, standing.best),
        _trials_table(trials, standing.best),
    ]


def _anatomy_table(ctx: Target, standing) -> list[str]:
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
            raw=[0],
        )
    ]


def _method_tables(rec, standing) -> list[str]:
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
    parts = [
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
        parts.append(
            _table(
                "runners-up",
                "Runners-up",
                ["rank", "plan", "device GiB", "tokens/s", "vs winner", "bottleneck"],
                rows,
                numeric=[0, 2, 3, 4],
                wrap=[1],
            )
        )
    return parts


def _losses_table(standing) -> list[str]:
    """Why the other plans lost, one row per status."""
    from autofit.report.console import loss_text

    if not standing.losses:
        return []
    rows = [[_status(loss.status), loss.count, *map(_e, loss_text(loss, standing))] for loss in standing.losses]
    return [
        _table(
            "losses",
            "Why the others lost",
            ["status", "plans", "most common reason", "closest to winning"],
            rows,
            numeric=[1],
            raw=[0, 2, 3],
            wrap=[2, 3],
        )
    ]


def _effects_table(effects, answer: TrialResult | None = None) -> list[str]:
    """One technique toggled at a time (analytic), and the toggles that are not valid plans."""
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
    parts = [
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
    if effects.skipped:
        items = "".join(f"<li>{_e(label)}: {_e('; '.join(problems))}</li>" for label, problems in effects.skipped)
        parts.append(
            f'<details id="skipped-toggles"><summary>Changes that are not valid plans '
            f"({len(effects.skipped)})</summary><ul>{items}</ul></details>"
        )
    return parts


def _trials_table(trials: Sequence[Any], best: TrialResult | None) -> str:
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
                _status(r.status.value),
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
        raw=[1],
        wrap=[3, 9],
        winner_rows=winners,
    )


def _config_files(rec, configs: dict[str, str] | None, notes: Sequence[str]) -> list[str]:
    """The winner's exported config files inline, or why they are missing."""
    parts = ['<h2 id="configs">Config files of the winner</h2>']
    if configs:
        parts.append(
            f"<p>Written by <code>autofit export {_e(shlex.quote(rec.name))}</code>; launch them unchanged.</p>"
        )
        parts += [
            f'<details open class="config"><summary>{_e(name)}</summary><pre><code>{_e(text)}</code></pre></details>'
            for name, text in configs.items()
        ]
    return parts + _missing(notes, "configs")


def _looking_further(rec, db_url: str) -> list[str]:
    """Where to look next (the Optuna study, commands), and the closing line with version and date."""
    version = importlib.metadata.version("autofit")
    written = datetime.datetime.now(datetime.timezone.utc)
    return [
        '<h2 id="optuna">Looking further</h2>',
        f"<p>The Optuna study of this search is <code>{_e(rec.optuna_study_name or '-')}</code> in "
        f"<code>{_e(db_url)}</code>:</p><pre><code>{_e(optuna_commands(rec, db_url))}</code></pre>",
        f'<p class="sub">autofit {_e(version)} · written {written:%Y-%m-%d %H:%M} UTC · every figure comes from '
        f"the store (study id {rec.id}) or, for the technique effects, from the analytic evaluator.</p>"
        "</body></html>",
    ]


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

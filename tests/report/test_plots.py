"""The figures draw exactly what the store and the analytic evaluator say, as PNG and SVG."""

import dataclasses
import struct
import xml.etree.ElementTree as ET

import pytest

from autofit.report import analysis
from autofit.results import COMPONENTS

pytest.importorskip("matplotlib")

from matplotlib.colors import to_rgba  # noqa: E402

from autofit.report import plots  # noqa: E402

GiB = 2**30


def standing_of(study, extra=()):
    with study.store() as store:
        rec = store.get_study(study.name)
        for r in extra:
            store.record_trial(rec.id, r)
        ctx = rec.context()
        return rec, analysis.standing([t.result() for t in store.trials(rec.id)], ctx)


def bars(ax, prefix):
    return {p.get_gid(): p for p in ax.patches if (p.get_gid() or "").startswith(prefix)}


def png_size(path):
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_every_component_has_its_own_colour():
    assert tuple(plots.COMPONENT_COLORS) == COMPONENTS
    assert len({to_rgba(c) for c in plots.COMPONENT_COLORS.values()}) == len(COMPONENTS)


def test_every_status_and_every_evaluator_has_its_own_style():
    from autofit.results import EVALUATORS, Status

    assert tuple(plots.STATUS_STYLE) == tuple(s.value for s in Status)
    assert len(set(plots.STATUS_STYLE.values())) == len(Status)
    assert tuple(plots.EVALUATOR_HATCH) == EVALUATORS
    assert len(set(plots.EVALUATOR_HATCH.values())) == len(EVALUATORS)


def test_anatomy_bars_stack_the_components_against_capacity_and_budget(tight_study):
    rec, st = standing_of(tight_study)
    groups = st.anatomy_subjects(4)
    fig = plots.anatomy_figure(groups, st.ctx)
    ax = fig.axes[0]
    assert len(groups) == 4 and groups[0].plan == st.best.plan
    for gi, group in enumerate(groups):
        (r,) = group.results
        drawn = bars(ax, f"bar-{gi}-analytic-")
        assert len(drawn) == len(COMPONENTS)
        bottom = 0.0
        for comp in COMPONENTS:
            bar = drawn[f"bar-{gi}-analytic-{comp}"]
            assert bar.get_height() == pytest.approx(getattr(r.memory, comp) / GiB)
            assert bar.get_y() == pytest.approx(bottom)
            assert bar.get_facecolor() == to_rgba(plots.COMPONENT_COLORS[comp])  # one colour per component
            bottom += bar.get_height()
        assert bottom == pytest.approx(r.memory.device_total / GiB)
    levels = sorted(line.get_ydata()[0] for line in ax.lines)
    assert levels == pytest.approx(sorted([st.ctx.capacity_bytes / GiB, st.ctx.budget_bytes / GiB]))
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert list(COMPONENTS) == [lab for lab in labels if lab in COMPONENTS]


def test_a_measurement_stands_beside_its_prediction(fitting_study, tmp_path):
    study = fitting_study.copy(tmp_path / "m.db")
    _, before = standing_of(study)
    w = before.best
    measured_memory = dataclasses.replace(
        w.memory, activations=w.memory.activations * 2, device_total=w.memory.device_total + w.memory.activations
    )
    _, st = standing_of(study, [dataclasses.replace(w, evaluator="measured", memory=measured_memory)])
    fig = plots.anatomy_figure(st.anatomy_subjects(2), st.ctx)
    ax = fig.axes[0]
    predicted, measured = bars(ax, "bar-0-analytic-"), bars(ax, "bar-0-measured-")
    assert len(predicted) == len(measured) == len(COMPONENTS)
    p, m = predicted["bar-0-analytic-activations"], measured["bar-0-measured-activations"]
    assert m.get_x() > p.get_x() and m.get_width() == pytest.approx(p.get_width())
    assert m.get_height() == pytest.approx(2 * p.get_height())
    assert m.get_hatch() == plots.EVALUATOR_HATCH["measured"] and not p.get_hatch()
    assert {"analytic", "measured"} <= {t.get_text() for t in ax.get_legend().get_texts()}
    assert len(bars(ax, "bar-1-")) == len(COMPONENTS)  # the runner-up has no measurement: one bar


def test_memory_vs_speed_shows_every_trial_the_boundary_and_the_pareto_front(tight_study):
    _, st = standing_of(tight_study)
    fig = plots.tradeoff_figure(st)
    ax = fig.axes[0]
    by_gid = {c.get_gid(): c for c in ax.collections}
    for status in ("fits", "oom"):
        expected = sorted(
            (r.memory.device_total / GiB, r.tokens_per_sec) for r in st.results if r.status.value == status
        )
        drawn = sorted(map(tuple, by_gid[f"trials-{status}"].get_offsets().tolist()))
        assert len(drawn) == len(expected) > 0
        for d, e in zip(drawn, expected):
            assert d == pytest.approx(e)
    pareto = next(line for line in ax.lines if line.get_gid() == "pareto")
    assert list(pareto.get_xdata()) == pytest.approx([r.memory.device_total / GiB for r in st.pareto])
    assert list(pareto.get_ydata()) == pytest.approx([r.tokens_per_sec for r in st.pareto])
    (star,) = by_gid["winner"].get_offsets().tolist()
    assert star == pytest.approx([st.best.memory.device_total / GiB, st.best.tokens_per_sec])
    boundary = sorted(line.get_xdata()[0] for line in ax.lines if line.get_gid() != "pareto")
    assert boundary == pytest.approx(sorted([st.ctx.budget_bytes / GiB, st.ctx.capacity_bytes / GiB]))


def test_technique_effects_are_one_bar_pair_per_toggle(tight_study):
    rec, st = standing_of(tight_study)
    effects = analysis.technique_effects(st.best.plan, st.ctx, rec.allowed)
    fig = plots.effects_figure(effects, st.ctx)
    ax_mem, ax_speed = fig.axes
    mem = [p for p in ax_mem.patches if p.get_gid() == "memory"] or ax_mem.containers[0].patches
    speed = [p for p in ax_speed.patches if p.get_gid() == "speed"] or ax_speed.containers[0].patches
    assert len(mem) == len(speed) == len(effects.toggles)
    assert [b.get_width() for b in mem] == pytest.approx([t.memory_delta / GiB for t in effects.toggles])
    assert [b.get_width() for b in speed] == pytest.approx([(t.speed_ratio - 1) * 100 for t in effects.toggles])
    labels = [t.get_text() for t in ax_mem.get_yticklabels()]
    assert [lab.split("  (")[0] for lab in labels] == [t.label for t in effects.toggles]
    assert sum("does not fit" in lab for lab in labels) == sum(not t.result.fits for t in effects.toggles)


def test_files_are_png_and_parseable_svg_and_stable(tight_report, tmp_path):
    st, files = tight_report.standing, list(tight_report.plots)
    assert [f.name for f in files] == ["memory-anatomy", "memory-vs-speed", "technique-effects"]
    for f in files:
        width, height = png_size(f.png)
        assert width > 600 and height > 300
        root = ET.parse(f.svg).getroot()
        assert root.tag == "{http://www.w3.org/2000/svg}svg"
        texts = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
        assert st.ctx.model.name in texts  # text stays text (svg.fonttype none)
    anatomy_text = ET.parse(files[0].svg).getroot()
    assert all(c in ET.tostring(anatomy_text, encoding="unicode") for c in COMPONENTS)
    again = plots.save(plots.anatomy_figure(st.anatomy_subjects(), st.ctx), tmp_path, "memory-anatomy")
    assert again.svg.read_bytes() == files[0].svg.read_bytes()  # no dates, stable ids: reruns give the same file


def test_nothing_fits_still_draws_the_closest_plans(hopeless_study, tmp_path):
    rec, st = standing_of(hopeless_study)
    effects = analysis.technique_effects(st.closest[0].plan, st.ctx, rec.allowed)
    files = plots.write_plots(st, effects, tmp_path)
    assert [f.name for f in files] == ["memory-anatomy", "memory-vs-speed", "technique-effects"]
    ax = plots.anatomy_figure(st.anatomy_subjects(), st.ctx).axes[0]
    assert "closest" in ax.get_xticklabels()[0].get_text()

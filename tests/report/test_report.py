"""Progress, tables and the HTML report, on real searches stored in real databases."""

import base64
import html
import io
import re
import sys

import pytest
from rich.console import Console

from autofit.report import analysis
from autofit.report import console as report
from autofit.search.loop import SearchRequest, run_search
from autofit.search.space import Allowed
from tests.showcase import search_request


@pytest.fixture
def sqlite_store(tmp_path):
    """Progress does not depend on the database; the store tests cover PostgreSQL."""
    from autofit.store import Store

    with Store(f"sqlite:///{tmp_path / 'progress.db'}") as s:
        yield s


def plain_console(width=220):
    return Console(file=io.StringIO(), width=width, force_terminal=False, color_system=None)


def terminal_console(width=160):
    return Console(file=io.StringIO(), width=width, force_terminal=True, color_system="standard")


# -- progress --------------------------------------------------------------------------------------
def test_plain_progress_is_one_line_per_trial_with_status_memory_speed_and_best(sqlite_store):
    store = sqlite_store
    req = search_request("mistral-7b", "2xA10", trials=10, seq_len=2048, global_batch=16)
    console = plain_console()
    progress = report.SearchProgress(console, req)
    assert not progress.live
    with progress:
        out = run_search(req, store, progress=progress)
    text = console.file.getvalue()
    assert "\x1b[" not in text  # no cursor movement or colour on a pipe
    lines = text.splitlines()
    assert lines[0].startswith(f"study {out.study.name}: mistral-7b on 2xA10") and "budget 10 trials" in lines[0]
    trial_lines = [line for line in lines if re.match(r"\[\s*\d+/10", line)]
    rows = store.trials(out.study.id)
    assert len(trial_lines) == len(rows)
    for line, row in zip(trial_lines, rows):
        r = row.result()
        assert f"#{row.number} " in line and r.status.value in line and r.plan.summary() in line
        assert f"{r.memory.device_total / 2**30:.2f}/{r.capacity_bytes / 2**30:.2f} GiB" in line
        assert (f"{r.tokens_per_sec:,.0f} tok/s" in line) and (r.fits or r.reason in line)
    best_lines = [line for line in lines if "best so far:" in line]
    assert best_lines and out.best.plan.summary() in best_lines[-1]
    assert f"{out.best.tokens_per_sec:,.0f} tokens/s" in best_lines[-1]


def test_live_progress_shows_the_count_the_current_plan_and_the_best(sqlite_store):
    store = sqlite_store
    req = search_request("gpt2", "1xA10", trials=8, seq_len=1024, global_batch=8)
    console = terminal_console(width=200)  # a plan with every technique is a 120-character summary
    progress = report.SearchProgress(console, req)
    assert progress.live
    panels = []

    def spy(event, data):
        progress(event, data)
        if event == "trial-start" and data["number"] == 5:
            c = Console(file=io.StringIO(), width=160, color_system=None)
            c.print(progress.panel())
            panels.append((data["plan"], c.file.getvalue()))

    with progress:
        out = run_search(req, store, progress=spy)
    plan, panel = panels[0]
    assert "trial 6/8" in panel and f"#5 {plan.summary()}" in panel and "evaluating" in panel
    assert "best so far" in panel and "tokens/s" in panel and "fits" in panel
    raw = console.file.getvalue()
    assert raw.count("\x1b[?25l") == 1 and raw.rstrip().endswith("\x1b[2K")  # the cursor was hidden, ...
    assert raw.rfind("\x1b[?25h") > raw.rfind("\x1b[?25l")  # ... shown again, and the panel erased
    assert progress.best.plan == out.best.plan
    for row in store.trials(out.study.id):
        assert f"#{row.number:<4d}" in raw and row.plan.summary() in raw  # a permanent line per trial


def test_ctrl_c_closes_the_live_display_and_the_search_stops_cleanly(sqlite_store):
    store = sqlite_store
    req = search_request("gpt2", "1xA10", trials=10, seq_len=1024, global_batch=8)
    console = terminal_console()
    progress = report.SearchProgress(console, req)
    done = []

    def interrupt_after_two(event, data):
        progress(event, data)
        if event == "trial-done":
            done.append(data)
            if len(done) == 2:
                raise KeyboardInterrupt

    with progress:
        out = run_search(req, store, progress=interrupt_after_two)
    assert out.interrupted and len(store.trials(out.study.id)) == 2
    assert progress._live is None and console.file.getvalue().rfind("\x1b[?25h") > 0
    # a Ctrl-C that escapes the search (during screening, say) still closes the display
    console2 = terminal_console()
    with pytest.raises(KeyboardInterrupt):
        with report.SearchProgress(console2, req) as p2:
            p2("screening", {"space": None})
            raise KeyboardInterrupt
    assert console2.file.getvalue().rfind("\x1b[?25h") > console2.file.getvalue().rfind("\x1b[?25l") >= 0


def test_a_ctrl_c_inside_optunas_bookkeeping_is_an_interrupt_too(sqlite_store, monkeypatch):
    """Optuna's _run_trial turns a KeyboardInterrupt raised in Study.tell into an
    UnboundLocalError; the search must still stop as interrupted, keeping what it stored."""
    store = sqlite_store
    import optuna.study._optimize as optimize

    real, calls = optimize._tell_with_warning, []

    def tell(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(optimize, "_tell_with_warning", tell)
    out = run_search(search_request("gpt2", "1xA10", trials=8, seq_len=1024, global_batch=8), store)
    assert out.interrupted and store.get_study(out.study.id).status.value == "interrupted"
    assert len(store.trials(out.study.id)) == 3  # the third was stored before Optuna's tell was interrupted


def test_duplicates_and_the_start_are_reported(tmp_path):
    from autofit.store import Store

    events = []
    ctx = search_request("gpt2", "1xA10", trials=8, seq_len=1024, global_batch=1).ctx  # a small space: 60 plans
    # half the space: the sampler proposes a plan again long before (how soon depends on the
    # predicted speeds it learns from)
    req = SearchRequest(ctx=ctx, allowed=Allowed.parse(methods="lora"), evaluator="analytic", trials=30)
    with Store(f"sqlite:///{tmp_path / 'a.db'}") as store:
        out = run_search(req, store, progress=lambda e, d: events.append((e, d)))
        rows = store.trials(out.study.id)
    start = [d for e, d in events if e == "start"]
    assert start == [{"study": out.study.name, "budget": 30, "done": 0, "best": None}]
    done = [d["number"] for e, d in events if e == "trial-done"]
    dups = [d["number"] for e, d in events if e == "trial-duplicate"]
    assert len(done) == len(rows) == 30  # a duplicate does not use up the budget
    assert sorted(done + dups) == list(range(30 + len(dups)))
    assert dups  # the sampler (seed 0) proposes a plan of this small space again
    for e, d in events:
        if e == "trial-duplicate":
            assert d["result"].plan.plan_id in {r.plan_id for r in rows}


# -- tables -----------------------------------------------------------------------------------------
def test_the_answer_tables_name_the_winner_the_runners_up_and_why_others_lost(tight_study):
    with tight_study.store() as store:
        rec = store.get_study(tight_study.name)
        trials = store.trials(rec.id)
    st = analysis.standing([t.result() for t in trials], rec.context())
    console = Console(record=True, width=250, file=io.StringIO())
    report.print_answer(console, st, rec.allowed["methods"])
    text = console.export_text()
    best = st.best
    assert f"winner: {best.plan.summary()}" in text
    assert f"{best.tokens_per_sec:,.0f} tokens/s" in text and best.memory.bottleneck in text
    assert f"{best.memory.device_total / 2**30:.2f} of {rec.context().capacity_bytes / 2**30:.2f} GiB" in text
    for title in ("memory anatomy of the winner", "best plan per method", "runners-up", "why the others lost"):
        assert title in text
    lines = report.tiebreak_lines(st.tiebreak)  # the simplest within the error, beside the fastest
    flat = " ".join(text.split())  # a line longer than the console wraps
    assert lines and all(" ".join(line.split()) in flat for line in lines)
    assert st.tiebreak.simpler == (st.tiebreak.fastest is not best)
    if st.tiebreak.simpler:
        assert st.tiebreak.fastest.plan.summary() in lines[1] and "; ".join(st.tiebreak.changes) in lines[1]
    for r in st.runners_up():
        assert r.plan.summary() in text and f"{r.tokens_per_sec / best.tokens_per_sec:.1%}" in text
    for loss in st.losses:
        assert re.search(rf"{loss.status}\s+│\s+{loss.count}\s+│", text), loss.status
        assert f"({loss.reason_count} of {loss.count})" in text
    oom = next(loss for loss in st.losses if loss.status == "oom")
    assert f"{oom.over_bytes / 2**30:.2f} GiB over the budget" in text
    assert "nothing of this method fits" in text  # full fine-tuning of mistral-7b fits no A10

    console = Console(record=True, width=250, file=io.StringIO())
    console.print(report.trials_table(trials, best))
    rows = console.export_text().splitlines()
    marked = [line for line in rows if "★" in line]
    (number,) = [t.number for t in trials if t.plan_id == best.plan.plan_id and t.evaluator == best.evaluator]
    assert len(marked) == 1 and f"★{number} " in marked[0]
    assert sum(" oom " in line for line in rows) == sum(t.status.value == "oom" for t in trials)


# -- the HTML report ---------------------------------------------------------------------------------
def test_the_report_is_self_contained_html_with_plots_tables_and_configs(tight_study, tight_report, tmp_path):
    from autofit.export import export_plan

    files = tight_report
    with tight_study.store() as store:
        ctx = store.get_study(tight_study.name).context()
        masked_url = store.masked_url
    page = files.html.read_text(encoding="utf-8")
    st = files.standing
    assert files.html == files.out_dir / "report.html" and not files.notes
    assert f'id="winner-plan">{st.best.plan.summary()}</b>' in page
    tiebreak = re.search(r'<p class="tiebreak" id="tiebreak">(.*?)</p>', page).group(1)
    assert [html.unescape(x) for x in tiebreak.split("<br>")] == report.tiebreak_lines(st.tiebreak)
    assert not re.search("[<>\"']", tiebreak.replace("<br>", ""))  # each line escaped
    for table in ("anatomy", "best-per-method", "runners-up", "losses", "technique-effects", "trials"):
        assert f'<table id="{table}"' in page
    assert page.count('<tr class="winner">') == 1
    from autofit.report.plots import COMPONENT_COLORS

    swatches = re.findall(r'<span class="swatch" style="background:(#\w+)"></span>(\w+)', page)
    assert dict((comp, color) for color, comp in swatches) == COMPONENT_COLORS  # the plots' colours
    # the plots: embedded PNGs identical to the files beside the page
    imgs = re.findall(r'<img id="plot-([\w-]+)" alt="[^"]*" src="data:image/png;base64,([^"]+)"', page)
    assert [name for name, _ in imgs] == ["memory-anatomy", "memory-vs-speed", "technique-effects"]
    for name, data in imgs:
        assert base64.b64decode(data) == (files.out_dir / f"{name}.png").read_bytes()
        assert (files.out_dir / f"{name}.svg").stat().st_size > 1000
    # offline: no script, no stylesheet or image from anywhere else
    assert "<script" not in page
    assert not re.findall(r'(?:src|href)="(?!data:|[\w.-]+\.(?:png|svg)")', page)
    # the configs, exactly as the exporter writes them
    exported = export_plan(st.best.plan, ctx, tmp_path / "exported", expected=st.best)  # as `autofit export` does
    assert list(files.configs) == [p.name for p in exported]
    shown = dict(
        re.findall(r'<details open class="config"><summary>([^<]*)</summary><pre><code>(.*?)</code>', page, re.S)
    )
    assert list(shown) == [p.name for p in exported]
    for path in exported:
        assert not re.search("[<>\"']", shown[path.name])  # escaped: no file can open a tag or end an attribute
        assert html.unescape(shown[path.name]) == path.read_text()
    assert f"optuna-dashboard '{masked_url}'" in html.unescape(page)
    data = files.as_dict()
    assert data["best"]["plan_id"] == st.best.plan.plan_id and len(data["plots"]) == 3


def test_without_the_exporter_the_report_says_so(fitting_study, monkeypatch):
    from autofit.report import html as htmlreport

    with fitting_study.store() as store:
        rec = store.get_study(fitting_study.name)
        trials = store.trials(rec.id)
        url = store.masked_url
    ctx = rec.context()
    st = analysis.standing([t.result() for t in trials], ctx)
    assert htmlreport._configs(st.best, ctx)[0]  # with the exporter: the files
    monkeypatch.setitem(sys.modules, "autofit.export", None)  # import fails as if it were not installed
    configs, note = htmlreport._configs(st.best, ctx)
    assert configs is None and note.startswith("configs: the exporter (autofit.export) is not available")
    page = htmlreport.render_html(rec, ctx, trials, st, None, [], configs, [note], url)
    assert 'id="configs-missing"' in page and "autofit.export" in page
    assert '<table id="trials"' in page and st.best.plan.summary() in page  # the rest is there


def test_stored_names_are_escaped_in_the_report(fitting_study, tmp_path):
    """A name from the store is text, never markup: a study, model or Optuna study named like
    a tag shows as that text and opens no element."""
    from sqlalchemy import update

    from autofit.report.html import write_report
    from autofit.store.models import StudyModel

    study = fitting_study.copy(tmp_path / "named.db")
    name, model, optuna_name = '<script>alert("study")</script>', "<img src=x onerror='alert(1)'>", 'a&b"><b>x'
    with study.store() as store:
        rec = store.get_study(study.name)
        with store.session_scope() as s:
            values = {"name": name, "model_spec": {**rec.model_spec, "name": model}, "optuna_study_name": optuna_name}
            s.execute(update(StudyModel).where(StudyModel.id == rec.id).values(**values))
        files = write_report(store, name, tmp_path / "out")
    page = files.html.read_text(encoding="utf-8")
    assert "<script" not in page and "<img src=x" not in page and "<b>x" not in page
    assert html.unescape(re.search("<title>(.*?)</title>", page).group(1)) == f"autofit report: {name}"
    assert html.unescape(re.search("<h1>(.*?)</h1>", page).group(1)) == f"autofit report: {name}"
    assert html.unescape(re.search('<p class="sub" id="study">(.*?)</p>', page).group(1)).startswith(f"{model} (")
    shown = re.search("The Optuna study of this search is <code>(.*?)</code>", page).group(1)
    assert html.unescape(shown) == optuna_name and not re.search('[<>"]', shown)
    assert html.unescape(page).count(name) >= 4  # title, heading, export and show commands


def test_a_study_where_nothing_fits_reports_the_closest_plan(hopeless_study, tmp_path):
    from autofit.report.html import write_report

    with hopeless_study.store() as store:
        files = write_report(store, hopeless_study.name, tmp_path)
    page = files.html.read_text()
    closest = files.standing.closest[0]
    assert 'class="answer none"' in page and "No plan fits llama-3-70b on 1xT4" in page
    assert closest.plan.summary() in page
    assert [p.name for p in files.plots] == ["memory-anatomy", "memory-vs-speed", "technique-effects"]
    assert files.effects.baseline.plan == closest.plan
    assert any("nothing to export" in n for n in files.notes)


@pytest.mark.postgres
def test_the_report_reads_postgresql_too(pg_url, tmp_path, monkeypatch):
    from autofit.report.html import write_report
    from autofit.store import Store

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the figures are tested on SQLite; this is about reading
    with Store(pg_url) as store:
        out = run_search(search_request("gpt2", "1xA10", trials=4, seq_len=1024, global_batch=8), store)
        files = write_report(store, out.study.name, tmp_path)
    assert out.best.plan.summary() in files.html.read_text()
    assert files.best.plan.plan_id == out.best.plan.plan_id


def test_without_matplotlib_the_report_keeps_the_tables(fitting_study, tmp_path, monkeypatch):
    from autofit.report.html import write_report

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if autofit[plot] were not installed
    with fitting_study.store() as store:
        files = write_report(store, fitting_study.name, tmp_path)
    page = files.html.read_text()
    assert files.plots == () and not list(tmp_path.glob("*.png"))
    assert any(n.startswith("plots:") and "pip install 'autofit[plot]'" in n for n in files.notes)
    assert 'id="plots-missing"' in page and "<img" not in page
    assert '<table id="anatomy"' in page and '<table id="trials"' in page


def test_progress_says_when_plans_are_queued_again_and_when_the_space_is_exhausted():
    req = search_request("gpt2", "1xA10", trials=8, seq_len=1024, global_batch=8)
    console = plain_console()
    progress = report.SearchProgress(console, req)
    progress("start", {"study": "s", "budget": 8, "done": 3, "best": None})
    progress("requeued", {"numbers": [3, 5]})
    progress("exhausted", {"n": 6})
    text = console.file.getvalue()
    assert "resuming after 3 trials" in text
    assert "#3, #5; queued again" in text and "Ctrl-C" in text
    assert "every plan of the space is evaluated (6)" in text

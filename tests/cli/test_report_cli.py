"""``autofit search`` shows progress and says where the report is; ``autofit report`` and ``show``."""

import json
import re

from click.testing import CliRunner

from autofit.cli import cli

ARGS = [
    "--model",
    "gpt2",
    "--gpus",
    "1xA10",
    "--seq-len",
    "1024",
    "--global-batch",
    "8",
    "--evaluator",
    "analytic",
    "--trials",
    "6",
]


def run(*args, ok=True):
    r = CliRunner().invoke(cli, [str(a) for a in args])
    if ok:
        assert r.exit_code == 0, r.output
    return r


def test_search_shows_progress_the_answer_and_writes_the_report(tmp_path):
    db, out = f"sqlite:///{tmp_path / 'a.db'}", tmp_path / "out"
    r = run("search", *ARGS, "--db", db, "--out", out)
    progress = r.stderr.splitlines()
    assert progress[0].startswith("study gpt2-1xA10-") and "budget 6 trials" in progress[0]
    trial_lines = [line for line in progress if re.match(r"\[\s*\d+/6 ", line)]
    assert len(trial_lines) >= 5 and all(" GiB " in line and "tok/s" in line for line in trial_lines)
    assert any("best so far:" in line for line in progress)
    assert "winner" in r.stdout and "why the others lost" in r.stdout
    assert f"report: {out / 'report.html'}" in r.stdout.replace("\n", "")
    assert (out / "report.html").exists() and (out / "memory-anatomy.svg").exists()
    study = re.search(r"study (gpt2-1xA10-\w+)", progress[0]).group(1)
    assert f"autofit report {study} --out {out} --db {db}" in r.stdout.replace("\n", "")

    # --quiet: no progress; --no-report: only the command that writes it
    quiet = run("search", *ARGS, "--db", db, "--out", tmp_path / "q", "--quiet", "--no-report")
    assert quiet.stderr == "" and "winner" in quiet.stdout
    assert f"report: autofit report {study} --out {tmp_path / 'q'} --db {db}" in quiet.stdout.replace("\n", "")
    assert not (tmp_path / "q" / "report.html").exists()
    # --json: nothing but JSON, no progress, no report
    data = json.loads(run("search", *ARGS, "--db", db, "--out", tmp_path / "j", "--json").stdout)
    assert data["study"] == study and data["runners_up"] and "losses" in data
    assert not (tmp_path / "j" / "report.html").exists()


def test_report_command_writes_the_page_and_its_plots(tmp_path, monkeypatch):
    db = f"sqlite:///{tmp_path / 'a.db'}"
    searched = json.loads(run("search", *ARGS, "--db", db, "--out", "", "--json").stdout)
    monkeypatch.chdir(tmp_path)  # the default --out is relative to the working directory
    data = json.loads(run("report", searched["study"], "--db", db, "--json").stdout)
    assert data["html"] == f"autofit-out/{searched['study']}/report.html"
    assert (tmp_path / data["html"]).exists()
    assert data["best"]["plan_id"] == searched["best"]["plan_id"]
    assert [p["name"] for p in data["plots"]] == ["memory-anatomy", "memory-vs-speed", "technique-effects"]
    for p in data["plots"]:
        assert open(p["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n" and p["svg"].endswith(".svg")
    assert "accelerate_config.yaml" in data["configs"]
    assert data["technique_effects"]["toggles"] and data["standing"]["best"]["plan_id"] == data["best"]["plan_id"]
    r = run("report", "--help")
    assert "report.html" in r.stdout and "autofit-out/STUDY" in r.stdout


def test_report_and_show_of_an_unknown_study_are_one_clear_line(tmp_path):
    db = f"sqlite:///{tmp_path / 'a.db'}"
    for cmd in (["report", "no-such-study", "--out", tmp_path], ["show", "no-such-study"]):
        r = run(*cmd, "--db", db, ok=False)
        assert r.exit_code != 0 and "no study named" in r.output and "Traceback" not in r.output


def test_show_marks_the_winner_and_explains_the_losses(tight_study):
    r = CliRunner().invoke(cli, ["show", tight_study.name, "--db", tight_study.url], terminal_width=250)
    text = r.stdout
    assert r.exit_code == 0, r.output
    assert text.count("★") == 1 and "device GiB" in text and "tokens/s" in text and "bottleneck" in text
    assert "why the others lost" in text and "best plan per method" in text and " oom " in text
    assert f"autofit report {tight_study.name}" in text
    shown = json.loads(run("show", tight_study.name, "--db", tight_study.url, "--json").stdout)
    assert shown["standing"]["best"]["plan_id"] == tight_study.outcome.best.plan.plan_id


def test_a_stored_name_that_is_a_path_never_puts_the_report_outside_autofit_out(tmp_path, monkeypatch):
    """Names are checked at creation, but an older database may hold any name: the default
    report directory must stay under ./autofit-out whatever the stored name is."""
    from sqlalchemy import update

    from autofit.store import Store
    from autofit.store.models import StudyModel

    db = f"sqlite:///{tmp_path / 'a.db'}"
    searched = json.loads(run("search", *ARGS, "--db", db, "--out", "", "--json").stdout)
    with Store(db) as store:
        study_id = store.get_study(searched["study"]).id
        with store.session_scope() as s:  # what a database from before the name check may hold
            s.execute(update(StudyModel).where(StudyModel.id == study_id).values(name="../../escape"))
    work = tmp_path / "deep" / "work"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    data = json.loads(run("report", "../../escape", "--db", db, "--json").stdout)
    assert data["html"] == f"autofit-out/study-{study_id}/report.html"
    assert (work / data["html"]).exists()
    assert list(tmp_path.rglob("escape")) == []  # nothing beside or above the working directory

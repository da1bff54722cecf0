"""Ctrl-C wherever it lands: one line, exit 130, the study marked ``interrupted`` (issue 12).

The interrupts are real SIGINTs raised in this process (Python's own handler turns them into
KeyboardInterrupt), at the moments a user's Ctrl-C can land: during screening, and a second
one while the first is being recorded.
"""

import json
import signal

import pytest
from click.testing import CliRunner

from autofit.cli import cli
from autofit.store import Store

ARGS = [
    "search",
    "-m",
    "gpt2",
    "-g",
    "1xA10",
    "--seq-len",
    "1024",
    "--global-batch",
    "8",
    "--evaluator",
    "analytic",
    "--methods",
    "lora",  # a third of the default space: each search screens it several times
    "--trials",
    "6",
    "--out",
    "",
]


@pytest.fixture(autouse=True)
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt, as at a terminal. A runner started in the background by a shell
    without job control inherits SIGINT ignored, and Python then installs no handler of its own."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def only_study(db):
    with Store(db) as store:
        (summary,) = store.list_studies()
        return summary.study, store.trials(summary.study.id)


def assert_one_line_130(r):
    assert r.exit_code == 130, r.output
    assert "Traceback" not in r.output and "KeyboardInterrupt" not in r.output
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("interrupted"), r.stderr


def test_ctrl_c_during_screening_marks_the_study_interrupted(tmp_path, monkeypatch):
    import autofit.search.loop

    def interrupted_screen(*args, **kwargs):
        signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(autofit.search.loop, "screen", interrupted_screen)
    db = f"sqlite:///{tmp_path / 'a.db'}"
    r = CliRunner().invoke(cli, [*ARGS, "--db", db, "--quiet"])
    assert_one_line_130(r)
    study, trials = only_study(db)
    assert study.status.value == "interrupted" and trials == []  # before: "running", and exit 1

    monkeypatch.undo()  # --resume screens and runs it to its budget
    r = CliRunner().invoke(cli, [*ARGS, "--db", db, "--resume", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["study"] == study.name
    study, trials = only_study(db)
    assert study.status.value == "finished" and len(trials) == 6


def test_a_second_ctrl_c_while_the_first_is_recorded_still_marks_the_study(tmp_path, monkeypatch):
    import autofit.search.loop

    real_finish = Store.finish_study

    def second_ctrl_c(self, study_id, status):
        signal.raise_signal(signal.SIGINT)  # lands while the status is written
        return real_finish(self, study_id, status)

    monkeypatch.setattr(autofit.search.loop, "work", lambda *args, **kwargs: "interrupted")  # the first Ctrl-C
    monkeypatch.setattr(Store, "finish_study", second_ctrl_c)
    db = f"sqlite:///{tmp_path / 'b.db'}"
    r = CliRunner().invoke(cli, [*ARGS, "--db", db, "--quiet"])
    assert_one_line_130(r)
    study, _ = only_study(db)
    assert study.status.value == "interrupted"  # before: left "running"

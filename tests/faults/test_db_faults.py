"""The database under stress: a writer holding the lock, two searches at once, file modes."""

import json
import os
import sqlite3
import stat
import subprocess
import sys
import threading
import time

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
    "--trials",
    "5",
    "--out",
    "",
    "--json",
]


def test_search_waits_for_a_writer_that_holds_the_lock(tmp_path):
    path = tmp_path / "locked.db"
    Store(f"sqlite:///{path}").close()  # migrate first
    held = threading.Event()

    def hold():
        conn = sqlite3.connect(path, timeout=30)
        conn.execute("BEGIN EXCLUSIVE")
        held.set()
        time.sleep(3)
        conn.rollback()
        conn.close()

    t = threading.Thread(target=hold)
    t.start()
    held.wait()
    t0 = time.monotonic()
    r = CliRunner().invoke(cli, [*ARGS, "--db", f"sqlite:///{path}"])
    t.join()
    assert r.exit_code == 0, r.output
    assert time.monotonic() - t0 >= 2.5  # it waited for the lock instead of failing
    assert json.loads(r.stdout)["best"]["fits"]


def test_two_identical_searches_at_once_both_finish_as_two_studies(tmp_path):
    db = f"sqlite:///{tmp_path / 'two.db'}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "autofit", *ARGS, "--db", db],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-1500:]
        outs.append(json.loads(out))
    with Store(db) as store:
        studies = store.list_studies()
        # either both ran (two finished studies) or one answered from the other's store entry
        assert all(s.study.status.value == "finished" for s in studies) and 1 <= len(studies) <= 2
        for s in studies:
            assert len(store.trials(s.study.id)) == s.n_trials > 0
    assert outs[0]["best"]["plan_id"] == outs[1]["best"]["plan_id"]


def test_files_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        db = tmp_path / "perm.db"
        r = CliRunner().invoke(
            cli, [*ARGS[:-3], "--trials", "2", "--db", f"sqlite:///{db}", "--out", str(tmp_path / "out"), "--json"]
        )
        assert r.exit_code == 0, r.output
    finally:
        os.umask(old)
    for f in [db, *(tmp_path / "out").iterdir()]:
        mode = stat.S_IMODE(f.stat().st_mode)
        assert not mode & stat.S_IWOTH and not mode & stat.S_IROTH, (f, oct(mode))


def test_a_relative_autofit_db_is_refused_and_creates_nothing(tmp_path, monkeypatch):
    """AUTOFIT_DB=garbage used to create a SQLite file named ``garbage`` in whatever directory
    a command ran from; the variable is global, so it must be absolute or a URL."""
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["history"], env={"AUTOFIT_DB": "garbage"})
    assert r.exit_code != 0 and "Traceback" not in r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "AUTOFIT_DB='garbage' names a relative path" in lines[0], r.output
    assert f"absolute path (e.g. {tmp_path}/garbage)" in lines[0]
    assert list(tmp_path.iterdir()) == []
    r = CliRunner().invoke(cli, ["history", "--db", "here.db"], env={"AUTOFIT_DB": "garbage"})  # --db wins
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("here.db-")) == ["here.db"]


def test_a_bad_work_dir_is_refused_before_a_study_exists(tmp_path):
    from tests.conftest import tiny

    tiny("gpt2").to_hf_config().save_pretrained(tmp_path / "tiny")
    (tmp_path / "afile").write_text("x")
    db = f"sqlite:///{tmp_path / 'w.db'}"
    Store(db).close()
    r = CliRunner().invoke(
        cli,
        [
            "search",
            "-m",
            str(tmp_path / "tiny"),
            "-g",
            "1xcpu",
            "--evaluator",
            "measured",
            "--trials",
            "2",
            "--seq-len",
            "64",
            "--global-batch",
            "2",
            "--out",
            "",
            "--work-dir",
            str(tmp_path / "afile" / "sub"),
            "--db",
            db,
        ],
    )
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert r.output.strip().splitlines() == [
        f"Error: cannot create work directory {tmp_path}/afile/sub: {tmp_path}/afile is a file; "
        "give --work-dir a directory that exists or can be created"
    ]
    with Store(db) as store:
        assert store.list_studies() == []  # no study left `running`

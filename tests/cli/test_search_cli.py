"""``autofit search`` and the history commands through click, on SQLite and PostgreSQL."""

import json

import pytest
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


def search(db_url, out, *extra):
    return json.loads(run("search", *ARGS, "--db", db_url, "--out", out, "--json", *extra).stdout)


def test_search_exports_and_history_reads_it_back(db_url, tmp_path):
    out = tmp_path / "out"
    data = search(db_url, out)
    assert data["best"]["fits"] and not data["from_store"]
    tiebreak = data["tiebreak"]  # the answer beside the fastest plan, as the console shows it
    assert tiebreak["answer_plan_id"] == data["best"]["plan_id"] and tiebreak["time_error"] > 0
    assert tiebreak["within_error"] == (tiebreak["fastest_plan_id"] != tiebreak["answer_plan_id"])
    assert tiebreak["fastest_tokens_per_sec"] >= data["best"]["throughput"]["tokens_per_sec"]
    assert {p.rsplit("/", 1)[-1] for p in data["exported"]} >= {"accelerate_config.yaml", "trainer_args.json"}
    # plan.json carries what the answer was judged by, for train.py to set beside what it gets
    record = json.loads((out / "plan.json").read_text())
    assert record["plan_id"] == data["best"]["plan_id"] and record["expected"]["evaluator"] == "analytic"
    assert record["expected"]["tokens_per_sec"] == data["best"]["throughput"]["tokens_per_sec"]
    assert record["expected"]["peak_allocated_bytes"] == data["best"]["memory"]["peak_allocated"]
    study = data["study"]

    again = search(db_url, tmp_path / "out2")
    assert again["from_store"] and again["study"] == study and again["best"]["plan_id"] == data["best"]["plan_id"]

    hist = json.loads(run("history", "--db", db_url, "--json").stdout)
    assert [h["name"] for h in hist] == [study]
    assert hist[0]["best"]["plan_id"] == data["best"]["plan_id"]

    shown = json.loads(run("show", study, "--db", db_url, "--json").stdout)
    assert len(shown["trials"]) == sum(data["counts"].values())

    best = json.loads(run("best", "--model", "gpt2", "--gpus", "1xA10", "--db", db_url, "--json").stdout)
    # both say what the stored answer assumed of the cluster (here: the host memory), as search did
    assert best["assumptions"] == shown["assumptions"] == data["assumptions"] != []
    assert best["cluster"] == shown["cluster"] == data["cluster"]
    assert best["plan_id"] == data["best"]["plan_id"]

    exported = json.loads(run("export", study, "--out", tmp_path / "again", "--db", db_url, "--json").stdout)
    assert sorted(p.rsplit("/", 1)[-1] for p in exported["files"]) == sorted(
        p.rsplit("/", 1)[-1] for p in data["exported"]
    )
    assert json.loads((tmp_path / "again" / "plan.json").read_text()) == record


def test_tables_render(db_url, tmp_path):
    r = run("search", *ARGS, "--db", db_url, "--out", tmp_path / "o")
    assert "winner" in r.output and "best plan per method" in r.output
    assert "gpt2" in run("history", "--db", db_url).output


def test_best_without_a_stored_plan_exits_non_zero(db_url):
    r = run("best", "--model", "gpt2", "--gpus", "1xA10", "--db", db_url, ok=False)
    assert r.exit_code == 1 and "no stored plan fits" in r.output


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["show", "no-such-study"], "no study named"),
        (["export", "no-such-study", "--out", "x"], "no study named"),
    ],
)
def test_unknown_study(db_url, args, fragment):
    r = run(*args, "--db", db_url, ok=False)
    assert r.exit_code != 0 and fragment in r.output and "Traceback" not in r.output


def test_bad_db_url_is_one_line(tmp_path):
    r = run("search", *ARGS, "--db", "mysqlx://nope/db", "--out", tmp_path, ok=False)
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_unwritable_out_keeps_the_study(tmp_path):
    db = f"sqlite:///{tmp_path / 'a.db'}"
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    r = run("search", *ARGS, "--db", db, "--out", blocker / "sub", ok=False)
    assert r.exit_code != 0 and "Traceback" not in r.output
    hist = json.loads(run("history", "--db", db, "--json").stdout)
    assert len(hist) == 1 and hist[0]["status"] == "finished"
    study = hist[0]["name"]
    ok = json.loads(run("export", study, "--out", tmp_path / "fine", "--db", db, "--json").stdout)
    assert ok["files"]


def test_study_file_and_override(tmp_path):
    cfg = tmp_path / "s.yaml"
    cfg.write_text("model: gpt2\ngpus: 1xA10\nseq_len: 512\nglobal_batch: 8\nbackend: analytic\ntrials: 4\n")
    db = f"sqlite:///{tmp_path / 'a.db'}"
    data = json.loads(run("search", "--config", cfg, "--seq-len", "1024", "--db", db, "--out", "", "--json").stdout)
    hist = json.loads(run("history", "--db", db, "--json").stdout)
    assert hist[0]["workload"]["seq_len"] == 1024  # the command line wins over the file
    assert data["best"]["fits"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: gpt2\nflavour: x\n")
    r = run("search", "--config", bad, "--db", db, ok=False)
    assert r.exit_code != 0 and "unknown key 'flavour'" in r.output


def test_passwords_never_appear_in_output(tmp_path, pg_url):
    """A database URL with a password: search, history and errors show it masked."""
    from sqlalchemy.engine import make_url

    url = make_url(pg_url).set(password="s3cr3t-pw").render_as_string(hide_password=False)
    r = CliRunner().invoke(cli, ["search", *ARGS, "--db", url, "--out", str(tmp_path / "o")])
    h = CliRunner().invoke(cli, ["history", "--db", url])
    bad = CliRunner().invoke(cli, ["show", "nope", "--db", url])
    for out in (r.output, h.output, bad.output):
        assert "s3cr3t-pw" not in out
    assert "***" in r.output  # the masked URL is shown (trust auth ignores the password)


def test_a_name_an_identical_finished_study_answers_instead_is_not_silent(tmp_path):
    """--name with an identical request already answered: the answer comes from the store and
    a note says the name was not used (before: silently ignored)."""
    db = f"sqlite:///{tmp_path / 'n.db'}"
    first = search(db, "")
    r = run("search", *ARGS, "--db", db, "--out", "", "--json", "--name", "mine")
    assert json.loads(r.stdout)["study"] == first["study"]
    assert f"study {first['study']} already answers" in r.stderr and "'mine'" in r.stderr
    assert "--fresh" in r.stderr
    fresh = json.loads(run("search", *ARGS, "--db", db, "--out", "", "--json", "--name", "mine", "--fresh").stdout)
    assert fresh["study"] == "mine"


def test_the_worker_hint_is_shell_quoted(tmp_path):
    """The printed `autofit worker` line is pasted into a shell: the database path and the
    study name are one word each there, and `$(...)` in them is never run. New names are
    refused unless safe, but a study of an older database can still be resumed by its name."""
    import shlex

    from sqlalchemy import text

    from autofit.store import Store
    from autofit.store.store import resolve_url

    path = tmp_path / "it's $(touch pwned).db"
    created = run("search", *ARGS, "--db", str(path), "--out", "", "--workers", "0", "--json")
    bad = "a b;$(touch pwned)"
    with Store(str(path)) as store:
        with store.engine.begin() as conn:
            conn.execute(
                text("UPDATE autofit_studies SET name = :bad WHERE name = :name"),
                {"bad": bad, "name": json.loads(created.stdout)["study"]},
            )
    r = run("search", *ARGS, "--db", str(path), "--out", "", "--workers", "0", "--resume", "--name", bad)
    line = next(ln for ln in r.stderr.splitlines() if "autofit worker" in ln)
    argv = shlex.split(line)
    assert argv[argv.index("worker") + 1] == bad
    assert resolve_url(argv[argv.index("--db") + 1]).database == str(path)
    assert not (tmp_path / "pwned").exists()


def test_export_show_history_and_best_pick_the_same_trial(db_url, tmp_path):
    """A measured OOM overrides the fastest prediction and a measured fit comes in slower than
    predicted: every command answers with the one rule (``autofit.results.ranked``), so the
    trial ``export`` writes is the winner ``show`` marks (export used to take the fastest
    fitting row, superseded or not)."""
    import dataclasses

    from autofit.results import Status
    from autofit.search.loop import request_from_study, stored_outcome
    from autofit.store import Store
    from tests.store.samples import gpt2_ctx, gpt2_results

    ctx = gpt2_ctx()
    fast, slow, _, _ = gpt2_results(ctx)
    with Store(db_url) as store:
        rec = store.create_study(ctx, evaluator="measured", name="superseded")
        store.record_trial(rec.id, fast)  # #0: predicted fastest
        store.record_trial(rec.id, slow)  # #1
        store.record_trial(
            rec.id,
            dataclasses.replace(
                fast, evaluator="measured", status=Status.OOM, throughput=None, reason="CUDA out of memory"
            ),
        )  # #2
        store.finish_study(rec.id)
        outcome = stored_outcome(request_from_study(rec), store, store.get_study(rec.id))
    shown = json.loads(run("show", "superseded", "--db", db_url, "--json").stdout)
    winner = shown["standing"]["best"]
    numbers = [
        t["number"]
        for t in shown["trials"]
        if (t["plan_id"], t["evaluator"]) == (winner["plan_id"], winner["evaluator"])
    ]
    assert winner["plan_id"] == slow.plan.plan_id and numbers == [1]
    exported = json.loads(run("export", "superseded", "--out", tmp_path / "cfg", "--db", db_url, "--json").stdout)
    assert exported["trial"] == 1
    assert outcome.best.plan == slow.plan  # the search's own answer
    assert json.loads(run("history", "--db", db_url, "--json").stdout)[0]["best"]["number"] == 1
    best = json.loads(run("best", "--model", "gpt2", "--gpus", "1xA10", "--db", db_url, "--json").stdout)
    # both say what the stored answer assumed of the cluster (here: the host memory), as search does
    assert best["assumptions"] == shown["assumptions"] == list(ctx.cluster.assumptions()) != []
    assert best["cluster"] == shown["cluster"] == ctx.cluster.as_dict()
    for cmd in (["show", "superseded"], ["best", "--model", "gpt2", "--gpus", "1xA10"]):
        assert "assumed: host memory per node assumed" in " ".join(run(*cmd, "--db", db_url).stdout.split())
    assert best["trial"] == 1


def test_backend_is_still_read_as_the_earlier_name_of_evaluator(tmp_path):
    """``--backend`` (the option's first name) and a study file's ``backend:`` key still work."""
    db = f"sqlite:///{tmp_path / 'alias.db'}"
    args = [a if a != "--evaluator" else "--backend" for a in ARGS]
    first = json.loads(run("search", *args, "--db", db, "--out", "", "--json").stdout)
    assert first["best"]["evaluator"] == "analytic"
    cfg = tmp_path / "study.yaml"
    cfg.write_text("model: gpt2\ngpus: 1xA10\nseq_len: 1024\nglobal_batch: 8\nevaluator: simulated\ntrials: 6\n")
    r = run("search", "--config", cfg, "--evaluator", "analytic", "--db", db, "--out", "", "--json")
    assert json.loads(r.stdout)["from_store"]  # the command line's evaluator overrode the file's: the same request

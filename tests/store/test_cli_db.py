"""`autofit db upgrade` and `autofit db current` through click's CliRunner."""

from __future__ import annotations

import json

from click.testing import CliRunner

from autofit.cli import cli
from autofit.store import Store


def run(*args: str, env: dict | None = None):
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


def test_upgrade_creates_then_reports_head(db_url):
    masked = Store(db_url, check_schema=False).masked_url
    r = run("db", "current", "--db", db_url, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == {
        "url": masked,
        "current": None,
        "head": "0003",
        "up_to_date": False,
        "needs_upgrade": True,
        "known": True,
    }
    r = run("db", "upgrade", "--db", db_url)
    assert r.exit_code == 0, r.output
    assert r.output == f"{masked}: upgraded from an empty database to revision 0003\n"
    r = run("db", "upgrade", "--db", db_url)
    assert r.output == f"{masked}: already at revision 0003\n"
    info = json.loads(run("db", "current", "--db", db_url, "--json").output)
    assert (info["current"], info["up_to_date"], info["needs_upgrade"]) == ("0003", True, False)
    with Store(db_url) as store:
        assert store.schema_diff() == []


def test_current_as_text_and_from_the_environment(tmp_path):
    path = tmp_path / "env.db"
    r = run("db", "upgrade", env={"AUTOFIT_DB": str(path)})
    assert r.exit_code == 0 and path.exists()
    r = run("db", "current", env={"AUTOFIT_DB": str(path)})
    assert r.output.splitlines() == [f"database: sqlite:///{path}", "current:  0003", "head:     0003", "up to date"]


def test_bad_db_is_one_clear_line(tmp_path):
    for args, fragment in [
        (["db", "current", "--db", "nosuchdb://x/y"], "unknown database URL scheme 'nosuchdb'"),
        (["db", "upgrade", "--db", "/proc/autofit-nope/a.db"], "cannot create the database directory"),
        (
            ["db", "upgrade", "--db", "postgresql://u:secret@127.0.0.1:1/db"],
            "database error (postgresql+psycopg://u:***@",
        ),
    ]:
        r = run(*args)
        assert r.exit_code == 1, r.output
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: ") and fragment in lines[0], r.output
        assert "secret" not in r.output


def test_db_commands_have_help():
    assert run("db", "--help").exit_code == 0
    for name in ("upgrade", "current"):
        r = run("db", name, "--help")
        assert r.exit_code == 0 and "--db URL" in r.output

"""The migrations travel in the wheel: build it, install it into a fresh venv, upgrade a database."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIGRATION_FILES = [  # migrations/ of the checkout, shipped as the package autofit.migrations
    "autofit/migrations/env.py",
    "autofit/migrations/script.py.mako",
    "autofit/migrations/versions/0001_initial.py",
    "autofit/migrations/versions/0002_screened_status.py",
    "autofit/migrations/versions/0003_evaluator_column.py",
]


@pytest.mark.slow
def test_wheel_carries_the_migrations_and_upgrades_from_an_install(tmp_path):
    src = tmp_path / "src"  # a copy, so the build leaves nothing in the checkout
    src.mkdir()
    for folder in ("autofit", "migrations"):
        shutil.copytree(os.path.join(ROOT, folder), src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = (tmp_path / "dist").glob("autofit-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in MIGRATION_FILES:
        assert path in names, path
    # what an export's train.py needs on the training machine: its template and autofit.launch
    assert {
        "autofit/export/templates/train.py",
        "autofit/launch.py",
        "autofit/report/templates/report.html.j2",
    } <= names
    versions = {os.path.basename(n) for n in names if n.startswith("autofit/migrations/versions/")}
    from autofit.store import Store

    for rev in Store.revisions():
        assert any(v.startswith(f"{rev}_") for v in versions), rev

    # A fresh venv sees the dependencies through a path entry, but autofit only from the wheel.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    with open(os.path.join(purelib, "deps.pth"), "w") as fh:
        fh.write(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)], check=True
    )

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AUTOFIT_DB")}
    where = subprocess.run(
        [str(py), "-c", "import autofit.store; print(autofit.store.__file__)"],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    ).stdout.strip()
    assert where.startswith(purelib), where
    db = tmp_path / "wheel.db"
    r = subprocess.run(
        [str(venv / "bin" / "autofit"), "db", "upgrade", "--db", f"sqlite:///{db}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"sqlite:///{db}: upgraded from an empty database to revision {Store.head_revision()}"
    with Store(str(db)) as store:
        assert store.current_revision() == Store.head_revision() and store.schema_diff() == []


def test_the_wheel_lists_every_package_of_the_tree():
    """pyproject.toml lists autofit's packages by hand (migrations/ is mapped in); none is left out."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        listed = set(tomllib.load(fh)["tool"]["setuptools"]["packages"])
    found = {"autofit.migrations", "autofit.migrations.versions"}
    for dirpath, _dirs, files in os.walk(os.path.join(ROOT, "autofit")):
        if "__init__.py" in files:
            found.add(os.path.relpath(dirpath, ROOT).replace(os.sep, "."))
    assert listed == found

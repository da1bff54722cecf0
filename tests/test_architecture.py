"""The architecture holds by test, not by hope: the pipeline's import layers (import-linter's
contracts in pyproject.toml), a docstring per folder, short functions, and ruff's rules."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
MAX_FUNCTION_LINES = 80


def _lint_imports(cwd: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": cwd}
    return subprocess.run(
        [os.path.join(BIN, "lint-imports"), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_no_module_imports_a_layer_above_it():
    r = _lint_imports(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


def test_an_import_that_climbs_breaks_the_contract(tmp_path):
    """The contract is live: a copy of the tree where the specs import the CLI fails it."""
    for folder in ("autofit", "migrations"):
        shutil.copytree(os.path.join(ROOT, folder), tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path / "pyproject.toml")
    units = tmp_path / "autofit" / "specs" / "units.py"
    units.write_text(units.read_text() + "\n\ndef _climb():\n    from autofit.search import loop  # noqa: F401\n")
    r = _lint_imports(str(tmp_path))
    assert r.returncode != 0
    assert "autofit.specs.units -> autofit.search.loop" in r.stdout


def _packages() -> list[str]:
    found = []
    for dirpath, _dirs, files in os.walk(os.path.join(ROOT, "autofit")):
        if "__init__.py" in files:
            found.append(os.path.join(dirpath, "__init__.py"))
    return sorted(found)


@pytest.mark.parametrize("init", _packages(), ids=lambda p: os.path.relpath(os.path.dirname(p), ROOT))
def test_every_folder_says_what_it_owns_and_may_import(init):
    with open(init) as fh:
        doc = ast.get_docstring(ast.parse(fh.read()))
    assert doc and len(doc.split()) >= 25, f"{init}: a one-paragraph docstring says what the folder owns"
    if not init.endswith(os.path.join("autofit", "__init__.py")):
        assert "import" in doc, f"{init}: the docstring says what the folder may import"


def test_no_function_is_longer_than_a_screen():
    long = []
    for dirpath, _dirs, files in os.walk(os.path.join(ROOT, "autofit")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path) as fh:
                    tree = ast.parse(fh.read())
                for node in ast.walk(tree):
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        n = node.end_lineno - node.lineno + 1
                        if n > MAX_FUNCTION_LINES:
                            long.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "\n".join(long)


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_passes(command):
    r = subprocess.run(
        [os.path.join(BIN, "ruff"), *command, "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr

"""Real studies for the report, plot and progress tests: small analytic searches stored in
SQLite files, made once per session. Tests that change a study copy its file first.

``tests/conftest.py`` registers this module as a plugin, so each study is made once per
session whichever module asks for it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from autofit.search.loop import SearchOutcome, SearchRequest, run_search
from autofit.search.request import build_context
from autofit.search.space import Allowed


@dataclass(frozen=True)
class Study:
    path: Path  # the SQLite file
    request: SearchRequest
    outcome: SearchOutcome

    @property
    def url(self) -> str:
        return f"sqlite:///{self.path}"

    @property
    def name(self) -> str:
        return self.outcome.study.name

    def copy(self, dest: Path) -> Study:
        """The same study in a file of its own (to record more evaluations into)."""
        shutil.copy(self.path, dest)
        return Study(dest, self.request, self.outcome)

    def store(self):
        from autofit.store import Store

        return Store(self.url)


def search_request(model: str, gpus: str, *, trials: int, seq_len: int, global_batch: int) -> SearchRequest:
    ctx = build_context(model, gpus, seq_len=seq_len, global_batch=global_batch)
    return SearchRequest(ctx=ctx, allowed=Allowed(), evaluator="analytic", trials=trials)


def make_study(path: Path, request: SearchRequest, progress=None) -> Study:
    from autofit.store import Store

    with Store(f"sqlite:///{path}") as store:
        outcome = run_search(request, store, progress=progress)
    return Study(path, request, outcome)


@pytest.fixture(scope="session")
def fitting_study(tmp_path_factory) -> Study:
    """gpt2 on one A10: every method fits; a winner, runners-up and slower plans."""
    req = search_request("gpt2", "1xA10", trials=12, seq_len=1024, global_batch=8)
    return make_study(tmp_path_factory.mktemp("fitting") / "autofit.db", req)


@pytest.fixture(scope="session")
def tight_study(tmp_path_factory) -> Study:
    """mistral-7b on 2xA10: a winner, and plans that lose by OOM."""
    req = search_request("mistral-7b", "2xA10", trials=16, seq_len=2048, global_batch=16)
    return make_study(tmp_path_factory.mktemp("tight") / "autofit.db", req)


@pytest.fixture(scope="session")
def hopeless_study(tmp_path_factory) -> Study:
    """llama-3-70b on one T4: nothing fits."""
    req = search_request("llama-3-70b", "1xT4", trials=6, seq_len=4096, global_batch=4)
    return make_study(tmp_path_factory.mktemp("hopeless") / "autofit.db", req)


@pytest.fixture(scope="session")
def tight_report(tight_study, tmp_path_factory):
    """The report of ``tight_study`` (autofit.report.html.ReportFiles), written once."""
    from autofit.report.html import write_report

    with tight_study.store() as store:
        return write_report(store, tight_study.name, tmp_path_factory.mktemp("tight-report"))

"""The analytic evaluator's block censuses kept on disk (evaluators/census_cache.py)."""

from __future__ import annotations

import json

import pytest

from autofit.evaluators import census_cache, traced
from autofit.plan import Plan
from tests.evaluators.test_derived import tiny_derived

PLAN = traced._census_plan(Plan(precision="bf16-true", micro_batch=1))


def _clear() -> None:
    for fn in (traced._terms, traced._compiled_work, traced._eager_saved):
        fn.cache_clear()


def _refuse(*_args, **_kwargs):
    raise AssertionError("census run where the disk had it")


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv(census_cache.ENV_VAR, str(tmp_path))
    _clear()
    yield tmp_path
    _clear()


def test_a_census_is_run_once_and_read_back_in_a_new_process(folder, monkeypatch):
    """A second process (the in-process caches cleared) reads each census from disk, the same values."""
    spec = tiny_derived("olmo2", layers=1)
    compiled = traced._compiled_key(Plan(precision="bf16-true", micro_batch=1, torch_compile=True))
    first = (traced._terms(spec, PLAN, True, (8, 0)), traced._compiled_work(spec, compiled, True, (8, 0)))
    assert len(list(folder.glob("*.json"))) == 2
    _clear()
    monkeypatch.setattr(traced, "_census", _refuse)
    assert (traced._terms(spec, PLAN, True, (8, 0)), traced._compiled_work(spec, compiled, True, (8, 0))) == first
    # other kernels, another model: a census of their own
    with pytest.raises(AssertionError, match="census run"):
        traced._terms(spec, PLAN, False, (9, 0))
    with pytest.raises(AssertionError, match="census run"):
        traced._terms(tiny_derived("arcee", layers=1), PLAN, True, (8, 0))


def test_an_unreadable_file_is_run_again_and_replaced(folder):
    spec = tiny_derived("olmo2", layers=1)
    value = traced._terms(spec, PLAN, True, (8, 0))
    (path,) = folder.glob("*.json")
    path.write_text("{not json")
    _clear()
    assert traced._terms(spec, PLAN, True, (8, 0)) == value
    assert tuple(json.loads(path.read_text())) == value


def test_off_keeps_nothing_and_a_folder_that_cannot_be_written_is_left_out(tmp_path, monkeypatch):
    spec = tiny_derived("olmo2", layers=1)
    monkeypatch.setenv(census_cache.ENV_VAR, "off")
    _clear()
    value = traced._terms(spec, PLAN, True, (8, 0))
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv(census_cache.ENV_VAR, str(blocked / "census"))  # a folder under a file
    _clear()
    assert traced._terms(spec, PLAN, True, (8, 0)) == value
    assert list(tmp_path.iterdir()) == [blocked]
    _clear()


def test_a_library_version_is_in_the_name(monkeypatch):
    """Another torch (or transformers, peft, ...) names every census anew."""
    from importlib import metadata

    census_cache.stamp.cache_clear()
    before = census_cache.stamp()
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda dist: "0.0" if dist == "torch" else real(dist))
    census_cache.stamp.cache_clear()
    try:
        assert census_cache.stamp() != before
    finally:
        census_cache.stamp.cache_clear()

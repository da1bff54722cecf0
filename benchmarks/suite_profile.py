"""Where the test suite's time goes: the slowest tests, time per file, per marker and per kind of work.

    python benchmarks/suite_profile.py RUN.xml [BASELINE.xml] --wall SECONDS [--baseline-wall SECONDS]
                                        [--out benchmarks/results/DATE-suite-profile.md]

``RUN.xml`` is pytest's JUnit XML of one whole run (``PYTEST_ADDOPTS="--junitxml=RUN.xml" .ci/run``);
its per-test times are setup + call + teardown, so a session fixture's cost falls on the first
test that asks for it. Under pytest-xdist they add up to more than the wall time: the workers
run side by side, and the sum says how much work there is, the wall time how long it took.
``--wall`` is the run's wall time (the JUnit file's own ``time`` is the controller's, which under
xdist is the same). With ``BASELINE.xml``, every table gets the baseline's column beside it.

Markers (``slow``, ``postgres``, ``gpu``, ``alone``, ``ranks``) are read by collecting the suite
in this process (``pytest --collect-only``, no tests run). The kinds of work are named per file
(``KINDS``): what a test file mostly spends its time on, read from the files themselves.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import io
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import machine, uptime  # noqa: E402

MARKERS = ("slow", "postgres", "gpu", "alone", "ranks")

# What each file's tests mostly spend their time on (the rest: "unit and store").
KINDS = {
    "multi-rank runs (2-rank DeepSpeed, FSDP, DDP, context parallelism; children launched)": (
        "tests/evaluators/test_measured_slow.py",
        "tests/export/test_launch.py",
        "tests/evaluators/test_context.py",
    ),
    "measured children and searches in subprocesses (kill, interrupt, calibration, workers)": (
        "tests/evaluators/test_measured.py",
        "tests/cli/test_measured_cli.py",
        "tests/search/test_calibration.py",
        "tests/faults/test_kill.py",
        "tests/faults/test_interrupt.py",
        "tests/search/test_workers.py",
        "tests/faults/test_pg_restart.py",
    ),
    "simulated traces (fake-tensor steps, unroll, censuses)": (
        "tests/evaluators/test_unroll.py",
        "tests/evaluators/test_simulated.py",
        "tests/evaluators/test_mixers.py",
        "tests/evaluators/test_derived.py",
        "tests/evaluators/test_compiled.py",
        "tests/evaluators/test_moe.py",
        "tests/evaluators/test_families.py",
        "tests/evaluators/test_selective_checkpointing.py",
        "tests/evaluators/test_census_cache.py",
        "tests/specs/test_derive.py",
    ),
    "real CPU steps against the analytic estimate": (
        "tests/evaluators/test_analytic.py",
        "tests/evaluators/test_memory_mechanisms.py",
        "tests/evaluators/test_allocator.py",
        "tests/evaluators/test_offload.py",
        "tests/evaluators/test_fused.py",
        "tests/evaluators/test_lora_8bit.py",
        "tests/evaluators/test_zero.py",
        "tests/evaluators/test_optimizer_in_backward.py",
        "tests/evaluators/test_timing.py",
    ),
    "analytic searches in process (loop, ranking, report, CLI)": (
        "tests/search/test_loop.py",
        "tests/search/test_ranking.py",
        "tests/search/test_space.py",
        "tests/search/test_studies.py",
        "tests/report/test_analysis.py",
        "tests/report/test_report.py",
        "tests/report/test_plots.py",
        "tests/cli/test_cli.py",
        "tests/cli/test_cli_gpus.py",
        "tests/cli/test_search_cli.py",
        "tests/cli/test_report_cli.py",
        "tests/test_optuna_tools.py",
    ),
    "Chromium (the report in a headless browser)": ("tests/report/test_report_browser.py",),
    "Hypothesis (parsers fuzzed)": ("tests/test_fuzz_parsers.py",),
}


def read_junit(path: Path) -> dict[str, float]:
    """``node id -> seconds`` (setup + call + teardown) from pytest's JUnit XML."""
    times: dict[str, float] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "")
        parts = module.split(".")
        # classname is the module path with dots, plus the class for tests in classes
        for cut in range(len(parts), 0, -1):
            candidate = "/".join(parts[:cut]) + ".py"
            if (ROOT / candidate).exists():
                nodeid = "::".join([candidate, *parts[cut:], case.get("name", "")])
                break
        else:
            nodeid = f"{module}::{case.get('name', '')}"
        times[nodeid] = times.get(nodeid, 0.0) + float(case.get("time", 0.0))
    return times


def collect_markers() -> dict[str, set[str]]:
    """``node id -> markers`` of every collected test (collection only, in this process)."""
    import pytest

    class Collector:
        def __init__(self) -> None:
            self.marks: dict[str, set[str]] = {}

        def pytest_collection_modifyitems(self, items):
            for item in items:
                self.marks[item.nodeid] = {m.name for m in item.iter_markers() if m.name in MARKERS}

    collector = Collector()
    args = ["-o", "addopts=", "--collect-only", "-qq", "-p", "no:cacheprovider", str(ROOT / "tests")]
    with contextlib.redirect_stdout(io.StringIO()):
        pytest.main(args, plugins=[collector])
    return collector.marks


def kind_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    for kind, files in KINDS.items():
        if path in files:
            return kind
    return "unit and store tests"


def fmt(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds:,.1f}"


def table(
    title: str, rows: dict[str, float], base: dict[str, float] | None, counts: dict[str, int], limit: int | None = None
) -> list[str]:
    head = f"| {title} | tests | seconds |" + (" baseline s |" if base is not None else "")
    sep = "|---|---:|---:|" + ("---:|" if base is not None else "")
    lines = [head, sep]
    for key, secs in sorted(rows.items(), key=lambda kv: -kv[1])[:limit]:
        extra = f" {fmt(base.get(key))} |" if base is not None else ""
        lines.append(f"| {key} | {counts.get(key, 0)} | {fmt(secs)} |{extra}")
    return lines


def group(times: dict[str, float], key) -> tuple[dict[str, float], dict[str, int]]:
    secs: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    for nodeid, s in times.items():
        for k in key(nodeid):
            secs[k] += s
            counts[k] += 1
    return dict(secs), dict(counts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("baseline", type=Path, nargs="?")
    ap.add_argument("--wall", type=float, required=True, help="the run's wall time in seconds (pytest's own)")
    ap.add_argument("--baseline-wall", type=float)
    ap.add_argument("--ci-wall", type=float, help=".ci/run from start to end, bootstrap included (seconds)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    run = read_junit(args.run)
    base = read_junit(args.baseline) if args.baseline else None
    marks = collect_markers()

    def markers_of(nodeid: str) -> list[str]:
        found = sorted(marks.get(nodeid, set()))
        return found or ["(none)"]

    by_file, file_counts = group(run, lambda n: [n.split("::", 1)[0]])
    by_marker, marker_counts = group(run, markers_of)
    by_kind, kind_counts = group(run, lambda n: [kind_of(n)])
    base_file = group(base, lambda n: [n.split("::", 1)[0]])[0] if base else None
    base_marker = group(base, markers_of)[0] if base else None
    base_kind = group(base, lambda n: [kind_of(n)])[0] if base else None

    total = sum(run.values())
    out = [
        f"# Test-suite profile, {dt.date.today().isoformat()}",
        "",
        f"Machine: {machine()}. Load when written: `{uptime()}`.",
        "",
        "Written by `benchmarks/suite_profile.py` from pytest's JUnit XML of whole runs; a test's seconds are",
        "setup + call + teardown (a session fixture's cost falls on the first test that asks for it).",
        "",
        "| | this run | baseline |",
        "|---|---:|---:|",
        f"| tests | {len(run)} | {len(base) if base else ''} |",
        f"| pytest wall time (s) | {fmt(args.wall)} | {fmt(args.baseline_wall)} |",
        f"| sum of test times (s) | {fmt(total)} | {fmt(sum(base.values())) if base else ''} |",
    ]
    if args.ci_wall:
        out.append(f"| `.ci/run` from start to end (s) | {fmt(args.ci_wall)} | |")
    out += ["", "## Per kind of work", ""]
    out += table("kind", by_kind, base_kind, kind_counts)
    out += ["", "## Per marker (a test with two markers counts under both)", ""]
    out += table("marker", by_marker, base_marker, marker_counts)
    out += ["", "## The 40 slowest tests", "", "| seconds | baseline s | test |", "|---:|---:|---|"]
    for nodeid, secs in sorted(run.items(), key=lambda kv: -kv[1])[:40]:
        out.append(f"| {fmt(secs)} | {fmt(base.get(nodeid)) if base else ''} | `{nodeid}` |")
    out += ["", "## Per file", ""]
    out += table("file", by_file, base_file, file_counts)
    text = "\n".join(out) + "\n"
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)


if __name__ == "__main__":
    main()

"""How long the main job takes to answer (goal: <= 60 s on 2 cores), with the evaluators' speed beside it.

    python benchmarks/time_to_answer.py [--quick] [--runs 3] [--parallel 1,2]
                                        [--out benchmarks/results/DATE-time-to-answer.md]

The main job is the README's command, run as it is typed, in a fresh process:

    autofit search --model mistral-7b --gpus 2xA10

with default settings (backend ``auto``, which is ``simulated`` without a local 2xA10; its
default trial budget; seq 2048, global batch 16; the report written into ``--out``'s default
``autofit-out`` under a temporary working directory). The only option added is ``--db
sqlite:///<fresh temporary file>``, so that no stored study answers it and the user's
database is untouched. Each run is timed wall-clock from the subprocess start to its exit
(Python start-up and imports included) and read back from its database (trials, statuses,
the winner, the summed evaluator time). ``--parallel 1,2`` also times the same command with
``--parallel 2`` (two local worker processes share the study; runs alternate between the
settings so that both see the same load); the goal is judged on the command as typed.

In the same run, the evaluators are timed in this process:

* analytic: plans per second over a random sample of the valid mistral-7b × 2xA10 plans
  (``benchmarks/analytic_speed.py``'s ``valid_plans``), the search's screening workload;
* simulated: seconds for one plan with an empty trace cache, for a few mistral-7b plans on
  2xA10 at the same workload (the plan shapes of ``benchmarks/simulated_speed.py``'s
  ``PLANS``, made valid for 2 GPUs and global batch 16).

``--quick``: one search run, 2,000 analytic plans, one simulated plan (about 2 minutes).
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the sibling benchmark scripts

from _machine import machine, uptime, versions  # noqa: E402

GOAL_S = 60.0
MODEL, GPUS = "mistral-7b", "2xA10"


def autofit_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("autofit")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "autofit"]


def one_search(i: int, parallel: int = 1) -> dict:
    from autofit.store import Store

    work = Path(tempfile.mkdtemp(prefix=f"autofit-tta-{i}-"))
    db = f"sqlite:///{work / 'autofit.db'}"
    cmd = autofit_cmd() + ["search", "--model", MODEL, "--gpus", GPUS, "--db", db]
    if parallel > 1:
        cmd += ["--parallel", str(parallel)]
    env = {k: v for k, v in os.environ.items() if k != "AUTOFIT_DB"}
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
        raise SystemExit(f"run {i}: `{' '.join(cmd)}` exited with {proc.returncode}")
    with Store(db) as store:
        studies = store.list_studies()
        rec = studies[0].study
        trials = store.trials(rec.id)
    fitting = [t for t in trials if t.fits and t.tokens_per_sec]
    best = max(fitting, key=lambda t: t.tokens_per_sec, default=None)
    statuses: dict[str, int] = {}
    for t in trials:
        statuses[t.status.value] = statuses.get(t.status.value, 0) + 1
    by_eval: dict[str, float] = {}
    for t in trials:
        by_eval[t.evaluator] = by_eval.get(t.evaluator, 0.0) + t.duration_s
    out = {
        "parallel": parallel,
        "wall_s": wall,
        "cpu_s": cpu,
        "backend": rec.evaluator,
        "trials": len(trials),
        "statuses": statuses,
        "eval_s": by_eval,
        "n_sim": sum(1 for t in trials if t.evaluator == "simulated"),
        "best": best.plan.summary() if best else None,
        "best_tps": best.tokens_per_sec if best else 0.0,
        "report": (work / "autofit-out" / "report.html").exists(),
    }
    shutil.rmtree(work, ignore_errors=True)
    print(
        f"  run {i + 1} (--parallel {parallel}): {wall:.1f} s wall, {cpu:.1f} s CPU, backend {out['backend']}, {out['trials']} trials {statuses}, "
        f"evaluator time {', '.join(f'{k} {v:.1f} s' for k, v in by_eval.items())}; best {out['best']} "
        f"({out['best_tps']:,.0f} tokens/s)",
        flush=True,
    )
    return out


def analytic_rate(n: int) -> tuple[int, float, int]:
    from analytic_speed import valid_plans

    from autofit.evaluators.analytic import AnalyticEvaluator
    from autofit.search.request import build_context

    ctx = build_context(MODEL, GPUS)  # the CLI's defaults: seq 2048, global batch 16
    plans = valid_plans(ctx)
    sample = [random.Random(i).choice(plans) for i in range(n)]
    ev = AnalyticEvaluator()
    t0 = time.perf_counter()
    for p in sample:
        ev.evaluate(p, ctx)
    dt = time.perf_counter() - t0
    return len(plans), n / dt, n


def simulated_times(names: list[str]) -> list[tuple[str, str, float, str]]:
    from simulated_speed import PLANS

    from autofit.evaluators.simulated import SimulatedEvaluator, TraceCache
    from autofit.plan import Plan, plan_problems
    from autofit.search.request import build_context

    ctx = build_context(MODEL, GPUS)
    per_rank = ctx.workload.global_batch // ctx.cluster.world_size
    out = []
    for name in names:
        plan = Plan(micro_batch=1, grad_accum=per_rank, **PLANS[name])
        problems = plan_problems(plan, ctx.model, ctx.cluster, ctx.workload)
        if problems:
            out.append((name, plan.summary(), float("nan"), "invalid: " + "; ".join(problems)))
            continue
        t0 = time.perf_counter()
        r = SimulatedEvaluator(TraceCache()).evaluate(plan, ctx)
        dt = time.perf_counter() - t0
        out.append((name, plan.summary(), dt, f"{r.status.value}, {r.tokens_per_sec:,.0f} tokens/s"))
        print(f"  simulated {plan.summary()}: {dt:.1f} s ({r.status.value})", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one search run, 2,000 analytic plans, one simulated plan")
    ap.add_argument("--runs", type=int, default=None, help="search runs per setting (default 3; --quick: 1)")
    ap.add_argument("--parallel", default="1", help="comma-separated --parallel settings to time (e.g. 1,2)")
    ap.add_argument("--analytic-n", type=int, default=None, help="analytic plans to score (default 20,000)")
    ap.add_argument("--sim-plans", default=None, help="simulated_speed.PLANS names (default full,qlora,zero3)")
    ap.add_argument(
        "--out",
        default=None,
        help="results file (default: benchmarks/results/DATE-time-to-answer.md; --quick writes nothing unless given)",
    )
    args = ap.parse_args()
    runs = args.runs or (1 if args.quick else 3)
    n_analytic = args.analytic_n or (2000 if args.quick else 20000)
    sim_names = (args.sim_plans or ("full" if args.quick else "full,qlora,zero3")).split(",")

    load_before = uptime()
    print(f"load: {load_before}", flush=True)
    print(f"`autofit search --model {MODEL} --gpus {GPUS}` x {runs}:", flush=True)
    t_all = time.perf_counter()
    settings = [int(k) for k in args.parallel.split(",")]
    searches = [one_search(i * len(settings) + j, k) for i in range(runs) for j, k in enumerate(settings)]
    print("analytic evaluator:", flush=True)
    n_valid, rate, n = analytic_rate(n_analytic)
    print(f"  {rate:,.0f} plans/s over {n} plans ({n_valid} valid)", flush=True)
    print("simulated evaluator (empty trace cache per plan):", flush=True)
    sims = simulated_times(sim_names)
    total = time.perf_counter() - t_all
    load_after = uptime()

    walls = [s["wall_s"] for s in searches if s["parallel"] == 1] or [s["wall_s"] for s in searches]
    worst, med = max(walls), statistics.median(walls)
    met = worst <= GOAL_S
    verdict = (
        f"**met**: {worst:.1f} s at worst"
        if met
        else f"**NOT met**: {worst:.1f} s at worst (median {med:.1f} s), {worst - GOAL_S:.1f} s over"
    )
    today = datetime.date.today().isoformat()
    cmd = "python benchmarks/time_to_answer.py " + " ".join(sys.argv[1:])
    lines = [
        f"# Time to answer: `autofit search --model {MODEL} --gpus {GPUS}` — {today}",
        "",
        f"Machine: {machine()}; the 2 cores are shared with other sessions, so timings carry their noise.",
        f"Load (uptime) before: `{load_before}`; after: `{load_after}`.",
        f"Versions: {versions('torch', 'transformers', 'peft', 'bitsandbytes', 'optuna', 'sqlalchemy')}.",
        f"Command: `{cmd}` ({total:.0f} s in all).",
        "",
        f"Each run: `autofit search --model {MODEL} --gpus {GPUS} --db sqlite:///<fresh temp file>` in a fresh "
        "process and an empty temporary working directory (default options otherwise: backend auto, report "
        "written to `autofit-out/`), wall-clock from start to exit.",
        "",
        f"Goal: at most {GOAL_S:.0f} s on 2 cores — {verdict}. CPU is the search process's user+sys time "
        "(its own and its children's), less sensitive to the other sessions' load than wall time.",
        *[
            f"With `--parallel {k}`: median {statistics.median(w):.1f} s, worst {max(w):.1f} s."
            for k in settings
            if k > 1
            for w in [[x["wall_s"] for x in searches if x["parallel"] == k]]
        ],
        "",
        "| run | option | wall | CPU (user+sys) | backend | trials (statuses) | evaluator time stored | best plan | tokens/s "
        "| report |",
        "|---|---|---:|---:|---|---|---|---|---:|---|",
    ]
    for i, s in enumerate(searches):
        st = ", ".join(f"{k} {v}" for k, v in sorted(s["statuses"].items()))
        ev = ", ".join(f"{k} {v:.1f} s" for k, v in s["eval_s"].items())
        opt = f"--parallel {s['parallel']}" if s["parallel"] > 1 else "as typed"
        lines.append(
            f"| {i + 1} | {opt} | {s['wall_s']:.1f} s | {s['cpu_s']:.1f} s | {s['backend']} | {s['trials']} ({st}) | {ev} | {s['best']} "
            f"| {s['best_tps']:,.0f} | {'written' if s['report'] else 'missing'} |"
        )
    lines += [
        "",
        "Evaluator speed, same run, this process (mistral-7b on 2xA10, seq 2048, global batch 16):",
        "",
        "| evaluator | plan | time | result |",
        "|---|---|---:|---|",
        f"| analytic | {n:,} random plans of the {n_valid:,} valid ones | {1e6 / rate:.0f} µs/plan "
        f"= {rate:,.0f} plans/s | |",
    ]
    for name, summary, dt, res in sims:
        lines.append(f"| simulated (`{name}`) | {summary} | {dt:.1f} s/plan | {res} |")
    lines.append("")
    text = "\n".join(lines)
    print("\n" + text)
    out = Path(args.out) if args.out else (None if args.quick else HERE / "results" / f"{today}-time-to-answer.md")
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"written to {out}")


if __name__ == "__main__":
    main()

"""DeepSpeed ZeRO's (and FSDP2's) peak memory on 2 CPU ranks, measured, against both estimators.

    python benchmarks/zero_memory.py [--plans 0,3] [--out benchmarks/results/FILE.md]
    python benchmarks/zero_memory.py --full-size [--json FILE]

Each plan of the grid runs for real: two gloo ranks launched by ``accelerate launch`` from
the plan's exported files (the measured evaluator; 2 warm-up steps under the storage
tracker), on tiny Mistral, Mixtral and Qwen2-MoE configs (``tests.conftest.tiny``). The
analytic and simulated estimates of the same plan are printed beside the measured per-rank
peak, as ``predicted / measured - 1``, with the moment each estimator finds the peak at.

``--full-size`` prints instead the analytic anatomy of ZeRO plans on real models and GPUs
(no run): what the memory model answers where no GPU can check it here. Run it at two
commits to see what a change to the model moves.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import tempfile
import time

from autofit.evaluators.analytic import estimate
from autofit.evaluators.measured import MeasuredEvaluator
from autofit.evaluators.simulated import SimulatedEvaluator
from autofit.plan import Plan
from autofit.results import Status
from autofit.search.request import with_cpu_budget
from autofit.specs import MODELS, Target, Workload, parse_cluster

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from tests.conftest import tiny  # noqa: E402 - the tiny configs the test-suite trains

MiB, GiB = 2**20, 2**30
BASE = {"precision": "bf16-mixed", "micro_batch": 2, "grad_accum": 2}
GRID = [
    ("mistral-7b", {"sharding": "zero1"}),
    ("mistral-7b", {"sharding": "zero2"}),
    ("mistral-7b", {"sharding": "zero3"}),
    ("mistral-7b", {"sharding": "zero3", "grad_accum": 1}),
    ("mistral-7b", {"sharding": "zero3", "checkpointing": "full"}),
    ("mistral-7b", {"sharding": "zero3", "method": "lora", "lora_rank": 8}),
    ("mistral-7b", {"sharding": "zero2", "optimizer": "adafactor"}),
    ("mixtral-8x7b", {"sharding": "zero2"}),
    ("mixtral-8x7b", {"sharding": "zero3"}),
    ("qwen1.5-moe-a2.7b", {"sharding": "zero3"}),
    # FSDP2 for comparison: its held gradients (costs.held_grads) are counted the same way
    ("mistral-7b", {"sharding": "fsdp", "checkpointing": "full"}),
    ("mixtral-8x7b", {"sharding": "fsdp", "checkpointing": "full"}),
]
FULL_SIZE = [
    ("llama-3.2-1b", "2xA100-80GB", {"sharding": "zero3", "micro_batch": 4}),
    ("mistral-7b", "2xA100-80GB", {"sharding": "zero3", "micro_batch": 1, "checkpointing": "full"}),
    ("mistral-7b", "8xH100", {"sharding": "zero2", "micro_batch": 1, "checkpointing": "full"}),
    ("mistral-7b", "8xH100", {"sharding": "zero3", "micro_batch": 2, "checkpointing": "full"}),
    (
        "mistral-7b",
        "8xH100",
        {"sharding": "zero2", "optimizer": "adafactor", "micro_batch": 1, "checkpointing": "full"},
    ),
    ("mixtral-8x7b", "8xH100", {"sharding": "zero3", "micro_batch": 1, "checkpointing": "full"}),
    ("llama-3-70b", "8xH100", {"sharding": "zero3", "micro_batch": 1, "checkpointing": "full"}),
    ("llama-3-70b", "8xH100", {"sharding": "zero3", "method": "lora", "lora_rank": 16, "micro_batch": 1}),
]


def grid_row(i: int, work: pathlib.Path) -> str:
    name, kw = GRID[i]
    plan = Plan(**{**BASE, **kw})
    cluster = with_cpu_budget(parse_cluster("2xcpu"), "1GiB")
    ctx = Target(tiny(name), cluster, Workload(seq_len=64, global_batch=plan.micro_batch * plan.grad_accum * 2), 0.05)
    r = MeasuredEvaluator(timeout_s=400, env={"OMP_NUM_THREADS": "1"}, work_dir=work).evaluate(plan, ctx)
    if r.status is not Status.FITS:
        return f"| {name} | {plan.summary()} | {r.status.value}: {r.reason} | | | | |"
    measured = r.memory.peak_allocated
    ranks = r.extra["ranks"]
    phase = ranks[0]["memory"].get("peak_phase", "?")
    a = estimate(plan, ctx)
    s = SimulatedEvaluator().evaluate(plan, ctx)
    cells = [
        name,
        plan.summary(),
        f"{measured / MiB:.2f} ({phase})",
        f"{a.memory.peak_allocated / measured - 1:+.1%}",
        a.peak_phase,
        f"{s.memory.peak_allocated / measured - 1:+.1%}",
        str(s.extra.get("peak_phase", "")),
    ]
    return "| " + " | ".join(cells) + " |"


def full_size() -> list[dict]:
    rows = []
    for name, gpus, kw in FULL_SIZE:
        plan = Plan(**{**BASE, "grad_accum": 1, **kw})
        cluster = parse_cluster(gpus)
        ctx = Target(
            MODELS[name], cluster, Workload(seq_len=2048, global_batch=plan.micro_batch * cluster.world_size), 0.05
        )
        e = estimate(plan, ctx)
        comp = {k: round(v / GiB, 2) for k, v in e.memory.components.items()}
        rows.append(
            {
                "model": name,
                "gpus": gpus,
                "plan": plan.summary(),
                "peak_allocated_gib": round(e.memory.peak_allocated / GiB, 2),
                "phase": e.peak_phase,
                "components_gib": comp,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", default=None, help="comma-separated grid indexes (default: all)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--full-size", action="store_true")
    ap.add_argument("--json", default=None, help="with --full-size: write the rows here")
    args = ap.parse_args()
    if args.full_size:
        rows = full_size()
        for r in rows:
            print(f"{r['model']:14s} {r['gpus']:12s} {r['plan']:70s} {r['peak_allocated_gib']:7.2f} GiB  {r['phase']}")
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        return
    picks = [int(x) for x in args.plans.split(",")] if args.plans else range(len(GRID))
    t0 = time.perf_counter()
    lines = [
        "| model (tiny) | plan | measured MiB (phase) | analytic | at | simulated | at |",
        "|---|---|---:|---:|---|---:|---|",
    ]
    with tempfile.TemporaryDirectory() as work:
        for i in picks:
            lines.append(grid_row(i, pathlib.Path(work)))
            print(lines[-1], flush=True)
    head = [
        f"# DeepSpeed ZeRO on 2 CPU ranks: measured vs the estimators ({datetime.date.today().isoformat()})",
        "",
        f"`python benchmarks/zero_memory.py`: {len(picks)} plans, {time.perf_counter() - t0:.0f} s on 2 cores. "
        "Per-rank peak allocated; error = predicted / measured - 1 (never below 0 is the goal).",
        "",
    ]
    text = "\n".join(head + lines) + "\n"
    if args.out:
        pathlib.Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()

"""Op-level selective checkpointing (torchtitan's SelectiveAC) against none, every second block and full.

    python benchmarks/op_checkpointing.py [--gpus 1xA100-80GB] [--seq 4096] [--out benchmarks/results/FILE.md]

For each model and plan, each checkpointing: the peak allocated memory and tokens/s from the
simulated evaluator (the traced step, the policy's dispatch mode running on fake tensors) and the
analytic one, and analytic / simulated. The simulated memory of op-level plans is checked against
real CPU steps in ``tests/evaluators/test_simulated.py``; nothing here was measured on a GPU, and no
published run used op-level checkpointing.
"""

from __future__ import annotations

import argparse
import platform
import time

from _emit import emit  # beside this file

from autofit.evaluators.analytic import estimate
from autofit.evaluators.simulated import SimulatedEvaluator, TraceCache
from autofit.plan import Plan
from autofit.specs import MODELS, Target, Workload, parse_cluster

GiB = 2**30
MODELS_RUN = ["llama-3.2-1b", "llama-3.1-8b", "qwen2.5-7b", "phi-2"]
PLANS = [
    Plan(precision="bf16-mixed", micro_batch=2),
    Plan(method="lora", lora_rank=16, precision="bf16-mixed", micro_batch=2),
    Plan(method="qlora", lora_rank=16, precision="bf16-mixed", micro_batch=2),
]
CHECKPOINTING = {
    "none": {},
    "every 2": {"checkpointing": "selective", "checkpoint_every": 2},
    "ops": {"checkpointing": "selective", "checkpoint_ops": True},
    "full": {"checkpointing": "full"},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="1xA100-80GB")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cache = TraceCache()
    rows, ratios = [], []
    t0 = time.perf_counter()
    for name in MODELS_RUN:
        for base in PLANS:
            for label, kw in CHECKPOINTING.items():
                plan = base.replace(**kw)
                ctx = Target(
                    MODELS[name], parse_cluster(args.gpus), Workload(seq_len=args.seq, global_batch=plan.micro_batch)
                )
                sim = SimulatedEvaluator(cache).evaluate(plan, ctx)
                ana = estimate(plan, ctx)
                sm, am = sim.memory.peak_allocated, ana.memory.peak_allocated
                st, at = sim.tokens_per_sec, ana.throughput.tokens_per_sec
                if label == "ops":
                    ratios.append(am / sm)
                rows.append(
                    f"| {name} | {base.summary()} | {label} | {sm / GiB:.2f} | {am / GiB:.2f} | {am / sm:.3f} "
                    f"| {st:,.0f} | {at:,.0f} |"
                )
                print(rows[-1], flush=True)
    took = time.perf_counter() - t0
    lines = [
        f"# Op-level selective checkpointing ({time.strftime('%Y-%m-%d')})",
        "",
        f"`python benchmarks/op_checkpointing.py --gpus {args.gpus} --seq {args.seq}` on {platform.node() or 'CPU'} "
        f"({took:.0f} s). Peak allocated GiB per GPU and tokens/s, simulated (sim) and analytic (ana). "
        f"Op-level rows, analytic / simulated peak: {min(ratios):.3f} to {max(ratios):.3f}.",
        "",
        "| model | plan | checkpointing | sim GiB | ana GiB | ana / sim | sim tok/s | ana tok/s |",
        "|---|---|---|---:|---:|---:|---:|---:|",
        *rows,
    ]
    return emit(lines, args.out)


if __name__ == "__main__":
    raise SystemExit(main())

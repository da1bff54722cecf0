"""Mixture-of-experts models as both estimators predict them, and what the search answers.

    python benchmarks/moe.py [--seq 2048] [--out benchmarks/results/FILE.md]

For Mixtral-8x7B, Qwen3-30B-A3B and Qwen1.5-MoE-A2.7B (a shared expert), a few plans on the GPUs people fine-tune them on: the
peak allocated memory and tokens/s from the simulated evaluator (transformers' grouped_mm
experts traced on fake tensors, ``evaluators/moe.py``) and the analytic one, and the analytic /
simulated ratio. Then, for model × GPU pairs, the fastest fitting plan of each method over the
whole space as the analytic screen ranks it. Both estimators assume balanced routing
(``ModelSpec.routing_assumption``); the simulated side's memory on the CPU is checked against
real CPU steps in ``tests/evaluators/test_moe.py``. Nothing here was measured on a GPU.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

from _emit import emit  # beside this file
from _frontier import best_per_method, cells  # beside this file

from autofit.evaluators.analytic import estimate
from autofit.evaluators.simulated import SimulatedEvaluator, TraceCache
from autofit.plan import Plan
from autofit.specs import MODELS, Target, Workload, parse_cluster

GiB = 2**30
RUNS = [
    ("mixtral-8x7b", "1xH200", Plan(method="lora", lora_rank=16, precision="bf16-true", micro_batch=1)),
    (
        "mixtral-8x7b",
        "1xH200",
        Plan(method="lora", lora_rank=16, precision="bf16-true", micro_batch=4, checkpointing="full"),
    ),
    (
        "mixtral-8x7b",
        "1xH200",
        Plan(method="qlora", lora_rank=16, precision="bf16-mixed", micro_batch=2, checkpointing="full"),
    ),
    ("mixtral-8x7b", "8xH100", Plan(precision="bf16-mixed", micro_batch=1, checkpointing="full", sharding="fsdp")),
    ("mixtral-8x7b", "8xH100", Plan(precision="bf16-mixed", micro_batch=2, checkpointing="full", sharding="zero3")),
    (
        "qwen3-30b-a3b",
        "1xH100",
        Plan(method="lora", lora_rank=16, precision="bf16-true", micro_batch=1, checkpointing="full"),
    ),
    ("qwen3-30b-a3b", "1xH200", Plan(method="lora", lora_rank=16, precision="bf16-mixed", micro_batch=2)),
    (
        "qwen3-30b-a3b",
        "1xH200",
        Plan(method="qlora", lora_rank=16, precision="bf16-mixed", micro_batch=4, checkpointing="full"),
    ),
    ("qwen3-30b-a3b", "4xH100", Plan(precision="bf16-mixed", micro_batch=2, checkpointing="full", sharding="fsdp")),
    (
        "qwen1.5-moe-a2.7b",
        "1xA10",
        Plan(method="qlora", lora_rank=16, precision="bf16-mixed", micro_batch=1, checkpointing="full"),
    ),
    (
        "qwen1.5-moe-a2.7b",
        "1xA100-80GB",
        Plan(method="lora", lora_rank=16, precision="bf16-mixed", micro_batch=4, checkpointing="full"),
    ),
]
PAIRS = [
    ("mixtral-8x7b", "1xA100-80GB"),
    ("mixtral-8x7b", "1xH200"),
    ("mixtral-8x7b", "8xH100"),
    ("qwen3-30b-a3b", "1xRTX4090"),
    ("qwen3-30b-a3b", "1xH100"),
    ("qwen3-30b-a3b", "2xA100-80GB"),
    ("qwen1.5-moe-a2.7b", "1xRTX4090"),
    ("qwen1.5-moe-a2.7b", "1xA100-80GB"),
]


def frontier() -> list[str]:
    """The fastest fitting plan of each method per pair, by the analytic screen of the whole space."""
    rows = []
    for model, gpus in PAIRS:
        rows.append(f"| {model} | {gpus} | {' | '.join(cells(best_per_method(model, gpus), with_plan=True))} |")
        print(rows[-1], file=sys.stderr)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cache = TraceCache()
    rows, errors = [], []
    t0 = time.perf_counter()
    for name, gpus, plan in RUNS:
        cluster = parse_cluster(gpus)
        ctx = Target(
            MODELS[name], cluster, Workload(seq_len=args.seq, global_batch=plan.micro_batch * cluster.world_size)
        )
        t = time.perf_counter()
        sim = SimulatedEvaluator(cache).evaluate(plan, ctx)
        sim_s = time.perf_counter() - t
        ana = estimate(plan, ctx)
        sm, st = sim.memory.peak_allocated, sim.tokens_per_sec
        am, at = ana.memory.peak_allocated, ana.throughput.tokens_per_sec
        errors.append((am / sm - 1, at / st - 1))
        rows.append(
            f"| {name} | {gpus} | {plan.summary()} | {sm / GiB:.2f} | {am / GiB:.2f} ({am / sm - 1:+.1%}) "
            f"| {st:,.0f} | {at:,.0f} ({at / st - 1:+.1%}) | {sim.memory.weights / GiB:.2f} | {sim.status.value} "
            f"| {sim_s:.1f} |"
        )
        print(rows[-1], file=sys.stderr)
    front = frontier()
    elapsed = time.perf_counter() - t0
    lines = [
        f"# Mixture-of-experts models — {time.strftime('%Y-%m-%d')}",
        "",
        f"Command: `python benchmarks/moe.py --seq {args.seq}` ({elapsed:.0f} s); "
        f"machine: {platform.processor() or platform.machine()}, no GPU. Predictions only: no GPU ran these.",
        f"Routing: {MODELS['mixtral-8x7b'].routing_assumption}.",
        "",
        f"Analytic vs simulated, seq {args.seq}, global batch = micro-batch × GPUs: peak "
        f"{min(e[0] for e in errors):+.1%} to {max(e[0] for e in errors):+.1%}, tokens/s "
        f"{min(e[1] for e in errors):+.1%} to {max(e[1] for e in errors):+.1%}.",
        "",
        "| model | GPUs | plan | simulated peak GiB | analytic peak GiB | simulated tokens/s | analytic tokens/s "
        "| weights GiB | simulated | trace s |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---:|",
        *rows,
        "",
        "Fastest fitting plan of each method over the whole space (analytic screen, seq 2048, global batch 16), "
        "tokens/s (device memory; plan):",
        "",
        "| model | GPUs | full | lora | lora-8bit | qlora |",
        "|---|---|---|---|---|---|",
        *front,
        "",
    ]
    return emit(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())

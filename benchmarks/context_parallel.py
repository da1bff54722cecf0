"""Context parallelism as both estimators predict it, and what the search answers at long sequences.

    python benchmarks/context_parallel.py [--seq 32768] [--out benchmarks/results/FILE.md]

For a few models on 8 GPUs at a long sequence, the same plan with each sequence split over 1, 2,
4 and 8 GPUs (the global batch held: 8 rows per step): the rank's peak allocated memory, its
activations and tokens/s from the simulated evaluator (the traced step on rows of s/cp tokens,
plus the ring's buffers and exchanges from ``evaluators/context.py``) and the analytic one. Then,
for model × GPU × sequence cells, the fastest fitting plan of each method over the whole space as
the analytic screen ranks it, and whether it splits the sequence. Nothing here ran on a GPU: the
ring's buffers are checked against torch's ring functions on CPU ranks
(``tests/evaluators/test_context.py``), its time is a roofline.
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
GPUS = "8xH100"
BATCH = 8  # rows per optimizer step
PLANS = [
    ("llama-3.1-8b", Plan(method="lora", lora_rank=16, sharding="fsdp", checkpointing="full")),
    ("llama-3.1-8b", Plan(sharding="fsdp", checkpointing="full", fused_loss=True)),
    ("qwen2.5-7b", Plan(method="lora", lora_rank=16, sharding="fsdp", checkpointing="full", fused_loss=True)),
]
CELLS = [
    ("llama-3.1-8b", "8xH100", 65536),
    ("llama-3.1-8b", "8xA100-80GB", 32768),
    ("qwen2.5-7b", "4xH100", 32768),
    ("mistral-7b", "8xA10", 16384),
]


def split_rows(seq: int) -> list[str]:
    cache = TraceCache()
    rows = []
    cluster = parse_cluster(GPUS)
    for name, base in PLANS:
        ctx = Target(MODELS[name], cluster, Workload(seq_len=seq, global_batch=BATCH))
        for cp in (1, 2, 4, 8):
            plan = base.replace(context_parallel=cp, micro_batch=1, grad_accum=BATCH * cp // cluster.world_size)
            t = time.perf_counter()
            sim = SimulatedEvaluator(cache).evaluate(plan, ctx)
            sim_s = time.perf_counter() - t
            ana = estimate(plan, ctx)
            sm, am = sim.memory.peak_allocated, ana.memory.peak_allocated
            st, at = sim.tokens_per_sec, ana.throughput.tokens_per_sec
            rows.append(
                f"| {name} | {plan.summary()} | {sm / GiB:.2f} | {am / GiB:.2f} ({am / sm - 1:+.1%}) "
                f"| {sim.memory.activations / GiB:.2f} | {sim.memory.temporary / GiB:.2f} | {st:,.0f} "
                f"| {at:,.0f} ({at / st - 1:+.1%}) | {sim.throughput.comm_s:.2f} | {sim.status.value} | {sim_s:.1f} |"
            )
            print(rows[-1], file=sys.stderr)
    return rows


def frontier() -> list[str]:
    rows = []
    for model, gpus, seq in CELLS:
        cluster = parse_cluster(gpus)
        best = best_per_method(model, gpus, seq_len=seq, global_batch=cluster.world_size)
        split = ", ".join(f"{m} {r.plan.context_parallel}" for m, r in best.items())
        rows.append(f"| {model} | {gpus} | {seq} | {' | '.join(cells(best, with_plan=True))} | {split} |")
        print(rows[-1], file=sys.stderr)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = split_rows(args.seq)
    front = frontier()
    elapsed = time.perf_counter() - t0
    lines = [
        f"# Context parallelism — {time.strftime('%Y-%m-%d')}",
        "",
        f"Command: `python benchmarks/context_parallel.py --seq {args.seq}` ({elapsed:.0f} s); "
        f"machine: {platform.processor() or platform.machine()}, no GPU. Predictions only: no GPU ran these.",
        "",
        f"{GPUS}, seq {args.seq}, {BATCH} rows per step; cp N: each row over N GPUs, {BATCH}·N/8 rows per "
        "data-parallel rank. Peak and tokens/s: simulated, then analytic (its difference from simulated).",
        "",
        "| model | plan | simulated peak GiB | analytic peak GiB | activations GiB | temporary GiB "
        "| simulated tokens/s | analytic tokens/s | comm s | simulated | trace s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
        *rows,
        "",
        "Fastest fitting plan of each method over the whole space (analytic screen; one row per GPU per "
        "step), tokens/s (device memory; plan), and each winner's context-parallel size:",
        "",
        "| model | GPUs | seq | full | lora | lora-8bit | qlora | cp |",
        "|---|---|---:|---|---|---|---|---|",
        *front,
        "",
    ]
    return emit(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())

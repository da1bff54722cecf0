"""LoRA on 16-bit, 8-bit (LLM.int8) and 4-bit (NF4) base weights, as both estimators predict them.

    python benchmarks/lora_8bit.py [--gpus 1xA100-80GB] [--seq 2048] [--out benchmarks/results/FILE.md]

For each model and base plan, with methods lora, lora-8bit and qlora: the peak allocated
memory and tokens/s from the simulated evaluator (the traced step; LLM.int8's CUDA path as
``evaluators/int8.py`` routes it) and the analytic one, and the analytic / simulated ratio.
Then, for common model × GPU pairs, the fastest fitting plan of each method over the whole
search space as the analytic screen ranks it (``--methods full,lora,lora-8bit,qlora``): where
lora-8bit stands against qlora and lora when the search may choose.
The simulated side's memory on the CPU is checked against real CPU steps in
``tests/evaluators/test_simulated.py``; nothing here was measured on a GPU.
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
MODELS_RUN = ["llama-3.2-1b", "mistral-7b", "llama-3.1-8b"]
METHODS = ["lora", "lora-8bit", "qlora"]
PAIRS = [
    ("llama-3.2-1b", "1xT4"),
    ("mistral-7b", "1xA10"),
    ("mistral-7b", "2xA10"),
    ("qwen2.5-7b", "1xRTX4090"),
    ("llama-3.1-8b", "1xL4"),
    ("llama-3.1-8b", "1xA100-80GB"),
    ("llama-2-13b", "1xA100-40GB"),
    ("llama-3-70b", "4xA100-80GB"),
]


def frontier() -> list[str]:
    """The fastest fitting plan of each method per pair, by the analytic screen of the whole space."""
    rows = []
    for model, gpus in PAIRS:
        best = best_per_method(model, gpus)
        order = " > ".join(sorted(best, key=lambda m: -best[m].tokens_per_sec))
        rows.append(f"| {model} | {gpus} | {' | '.join(cells(best))} | {order} |")
    return rows


PLANS = [
    Plan(method="lora", lora_rank=16, precision="bf16-mixed", micro_batch=1),
    Plan(method="lora", lora_rank=16, precision="bf16-mixed", micro_batch=2, checkpointing="full"),
    Plan(method="lora", lora_rank=16, precision="fp16-mixed", micro_batch=4, checkpointing="full"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="1xA100-80GB")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cache = TraceCache()
    rows = []
    errors: dict[str, list[tuple[float, float]]] = {m: [] for m in METHODS}
    t0 = time.perf_counter()
    for name in MODELS_RUN:
        spec = MODELS[name]
        for base in PLANS:
            for method in METHODS:
                plan = base.replace(method=method)
                ctx = Target(spec, parse_cluster(args.gpus), Workload(seq_len=args.seq, global_batch=plan.micro_batch))
                sim = SimulatedEvaluator(cache).evaluate(plan, ctx)
                ana = estimate(plan, ctx)
                sm, st = sim.memory.peak_allocated, sim.tokens_per_sec
                am, at = ana.memory.peak_allocated, ana.throughput.tokens_per_sec
                errors[method].append((am / sm - 1, at / st - 1))
                rows.append(
                    f"| {name} | {plan.summary()} | {sm / GiB:.2f} | {am / GiB:.2f} ({am / sm - 1:+.1%}) "
                    f"| {st:,.0f} | {at:,.0f} ({at / st - 1:+.1%}) | {sim.memory.weights / GiB:.2f} |"
                )
            print(rows[-1], file=sys.stderr)
    front = frontier()
    elapsed = time.perf_counter() - t0
    summary = [
        f"- {m} ({len(e)} plans): peak {min(x[0] for x in e):+.1%} to {max(x[0] for x in e):+.1%}, "
        f"tokens/s {min(x[1] for x in e):+.1%} to {max(x[1] for x in e):+.1%}"
        for m, e in errors.items()
    ]
    lines = [
        f"# LoRA on 16-bit, 8-bit and 4-bit base weights — {time.strftime('%Y-%m-%d')}",
        "",
        f"Command: `python benchmarks/lora_8bit.py --gpus {args.gpus} --seq {args.seq}` ({elapsed:.0f} s); "
        f"machine: {platform.processor() or platform.machine()}, no GPU. Predictions only: no GPU ran these.",
        "",
        f"Analytic vs simulated on {args.gpus}, seq {args.seq}:",
        "",
        *summary,
        "",
        "| model | plan | simulated peak GiB | analytic peak GiB | simulated tokens/s | analytic tokens/s "
        "| weights GiB (simulated) |",
        "|---|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "Fastest fitting plan of each method over the whole space (analytic screen, seq 2048, global batch 16), "
        "tokens/s (device memory):",
        "",
        "| model | GPUs | full | lora | lora-8bit | qlora | order |",
        "|---|---|---:|---:|---:|---:|---|",
        *front,
        "",
    ]
    return emit(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())

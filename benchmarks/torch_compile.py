"""torch.compile of the blocks as both estimators predict it, and how often the screen's winner uses it.

    python benchmarks/torch_compile.py [--seq 4096] [--out benchmarks/results/FILE.md]

For a few models and plans, with and without ``torch_compile``: the rank's peak allocated memory,
its activations and tokens/s from the simulated evaluator (the traced step with AOTAutograd's
partitioned block, ``evaluators/compiled.py``, whose saves equal inductor's on CPU blocks:
``tests/evaluators/test_compiled.py``) and the analytic one (the formulas moved by one traced
compiled block). Then, for model × GPU cells, the fastest fitting plan of each method over the
whole space as the analytic screen ranks it, and whether it compiles. Nothing here ran on a GPU:
the fused kernels' time is the roofline of the bytes inductor's fusion would move.
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
PLANS = [
    ("llama-3.2-1b", "1xH100", Plan(precision="bf16-true", micro_batch=2)),
    ("llama-3.2-1b", "1xH100", Plan(precision="bf16-mixed", micro_batch=2, checkpointing="full")),
    ("llama-3.1-8b", "1xH100", Plan(method="lora", lora_rank=16, precision="bf16-mixed", micro_batch=1)),
    ("llama-3.1-8b", "1xH100", Plan(method="lora", lora_rank=16, precision="bf16-true", micro_batch=2)),
    ("mistral-7b", "1xH100", Plan(method="lora", lora_rank=16, precision="bf16-true", checkpointing="full")),
    ("qwen2.5-7b", "8xH100", Plan(precision="bf16-true", sharding="fsdp", micro_batch=1)),
    ("llama-3.1-8b", "8xH100", Plan(precision="bf16-mixed", sharding="zero3", micro_batch=1, checkpointing="full")),
]
# llama-like blocks, where Liger's kernels compete with compile, and blocks Liger does not patch
CELLS = [
    ("llama-3.1-8b", "1xH100"),
    ("mistral-7b", "1xA100-80GB"),
    ("qwen2.5-7b", "8xH100"),
    ("llama-3.2-1b", "1xA10"),
    ("phi-3-mini", "1xA100-80GB"),
    ("gemma-2b", "1xA10"),
    ("gpt2-xl", "1xA10"),  # at its 1,024 positions
]


def pairs(seq: int) -> list[str]:
    cache = TraceCache()
    rows = []
    for name, gpus, base in PLANS:
        cluster = parse_cluster(gpus)
        ctx = Target(MODELS[name], cluster, Workload(seq_len=seq, global_batch=base.micro_batch * cluster.world_size))
        got = []
        for on in (False, True):
            plan = base.replace(torch_compile=on)
            t = time.perf_counter()
            sim = SimulatedEvaluator(cache).evaluate(plan, ctx)
            sim_s = time.perf_counter() - t
            ana = estimate(plan, ctx)
            got.append((sim, ana, sim_s))
        (s0, a0, _), (s1, a1, t1) = got
        sm0, sm1, am1 = s0.memory.peak_allocated, s1.memory.peak_allocated, a1.memory.peak_allocated
        st0, st1, at1 = s0.tokens_per_sec, s1.tokens_per_sec, a1.throughput.tokens_per_sec
        rows.append(
            f"| {name} | {gpus} | {base.summary()} | {sm0 / GiB:.2f} → {sm1 / GiB:.2f} ({sm1 / sm0 - 1:+.1%}) "
            f"| {am1 / GiB:.2f} ({am1 / sm1 - 1:+.1%}) "
            f"| {s0.memory.activations / GiB:.2f} → {s1.memory.activations / GiB:.2f} "
            f"| {st0:,.0f} → {st1:,.0f} ({st1 / st0 - 1:+.1%}) | {at1:,.0f} ({at1 / st1 - 1:+.1%}) "
            f"| {a0.throughput.tokens_per_sec:,.0f} → {at1:,.0f} | {t1:.1f} |"
        )
        print(rows[-1], file=sys.stderr)
    return rows


def frontier(seq: int) -> list[str]:
    rows = []
    for model, gpus in CELLS:
        cluster = parse_cluster(gpus)
        seq = min(seq, MODELS[model].position_limit or seq)
        best = best_per_method(model, gpus, seq_len=seq, global_batch=8 * cluster.world_size)
        compiled = ", ".join(f"{m} {'yes' if r.plan.torch_compile else 'no'}" for m, r in best.items())
        rows.append(f"| {model} | {gpus} | {seq} | {' | '.join(cells(best, with_plan=True))} | {compiled} |")
        print(rows[-1], file=sys.stderr)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = pairs(args.seq)
    front = frontier(args.seq)
    elapsed = time.perf_counter() - t0
    lines = [
        f"# torch.compile of the blocks — {time.strftime('%Y-%m-%d')}",
        "",
        f"Command: `python benchmarks/torch_compile.py --seq {args.seq}` ({elapsed:.0f} s); "
        f"machine: {platform.processor() or platform.machine()}, no GPU. Predictions only: no GPU ran these.",
        "",
        f"Seq {args.seq}; each row the plan without → with `torch_compile`. Simulated peak and activations, "
        "analytic peak with compile (its difference from simulated), tokens/s simulated and analytic.",
        "",
        "| model | GPUs | plan | simulated peak GiB | analytic peak GiB (compiled) | activations GiB "
        "| simulated tokens/s | analytic tokens/s (compiled) | analytic tokens/s | trace s (compiled) |",
        "|---|---|---|---|---:|---|---|---:|---|---:|",
        *rows,
        "",
        "Fastest fitting plan of each method over the whole space (analytic screen; 8 rows per GPU per step), "
        "tokens/s (device memory; plan), and whether each winner compiles:",
        "",
        "| model | GPUs | seq | full | lora | lora-8bit | qlora | compiled |",
        "|---|---|---:|---|---|---|---|---|",
        *front,
        "",
    ]
    return emit(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())

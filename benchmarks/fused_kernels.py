"""What Liger's fused RMSNorm, SwiGLU and RoPE kernels change, as both estimators predict it.

    python benchmarks/fused_kernels.py [--gpus 1xA100-80GB] [--seq 2048] [--out benchmarks/results/FILE.md]

For each model and plan, with and without ``fused_kernels``: the peak allocated memory and
the tokens/s from the simulated evaluator (the traced step, with ``evaluators.fused``
standing in for the Triton kernels) and the analytic one, and the ratio fused / plain of
each. The simulated side's memory is checked against real CPU steps in
``tests/evaluators/test_simulated.py``; nothing here was measured on a GPU.
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
MODELS_RUN = ["llama-3.2-1b", "llama-3.1-8b", "mistral-7b", "qwen3-8b"]
PLANS = [
    Plan(precision="bf16-true", micro_batch=2, checkpointing="full"),
    Plan(method="lora", lora_rank=16, precision="bf16-mixed", micro_batch=2, checkpointing="full"),
    Plan(precision="bf16-mixed", micro_batch=1),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="1xA100-80GB")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cache = TraceCache()
    rows = []
    t0 = time.perf_counter()
    for name in MODELS_RUN:
        spec = MODELS[name]
        for base in PLANS:
            got = {}
            for fused in (False, True):
                plan = base.replace(fused_kernels=fused)
                ctx = Target(spec, parse_cluster(args.gpus), Workload(seq_len=args.seq, global_batch=plan.micro_batch))
                sim = SimulatedEvaluator(cache).evaluate(plan, ctx)
                ana = estimate(plan, ctx)
                got[fused] = (
                    sim.memory.peak_allocated,
                    sim.tokens_per_sec,
                    ana.memory.peak_allocated,
                    ana.throughput.tokens_per_sec,
                )
            (sm0, st0, am0, at0), (sm1, st1, am1, at1) = got[False], got[True]
            rows.append(
                f"| {name} | {base.summary()} | {sm0 / GiB:.2f} → {sm1 / GiB:.2f} ({sm1 / sm0 - 1:+.1%}) "
                f"| {am0 / GiB:.2f} → {am1 / GiB:.2f} ({am1 / am0 - 1:+.1%}) "
                f"| {st0:,.0f} → {st1:,.0f} ({st1 / st0 - 1:+.1%}) | {at0:,.0f} → {at1:,.0f} ({at1 / at0 - 1:+.1%}) |"
            )
            print(rows[-1], flush=True)
    header = [
        f"# Fused kernels (Liger's RMSNorm, SwiGLU, RoPE): plain → fused, {args.gpus}, seq {args.seq}",
        "",
        f"`python benchmarks/fused_kernels.py --gpus {args.gpus} --seq {args.seq}`: "
        f"{time.perf_counter() - t0:.0f} s on {platform.machine()} ({len(rows)} plan pairs). "
        "Predictions only: no GPU ran these plans.",
        "",
        "| model | plan | peak GiB, simulated | peak GiB, analytic | tokens/s, simulated | tokens/s, analytic |",
        "|---|---|---|---|---|---|",
    ]
    return emit(header + rows, args.out)


if __name__ == "__main__":
    raise SystemExit(main())

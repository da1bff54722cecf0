"""How many plans per second the analytic evaluator scores (goal: >= 10,000/s for llama-3-70b, one core).

    python benchmarks/analytic_speed.py [--model llama-3-70b] [--gpus 8xH100] [--n 20000]

Plans are drawn at random from the valid combinations (the search's screening workload),
so caches only help as much as they would in a search.
"""

from __future__ import annotations

import argparse
import itertools
import random
import time

from autofit.evaluators.analytic import AnalyticEvaluator
from autofit.plan import Plan, plan_problems
from autofit.specs import Target, Workload, parse_cluster, resolve_model


def valid_plans(ctx: Target) -> list[Plan]:
    world = ctx.cluster.world_size
    per_rank = ctx.workload.global_batch // world
    mbs = [m for m in (1, 2, 4, 8, 16) if per_rank % m == 0]
    out = []
    for method, prec, opt, ckpt, attn, shard, off, fused, mb in itertools.product(
        ("full", "lora", "qlora"),
        ("bf16-mixed", "bf16-true"),
        ("adamw", "adamw-8bit", "adafactor"),
        ("none", "full"),
        ("sdpa", "flash2"),
        ("none", "zero1", "zero2", "zero3", "fsdp"),
        ("none", "optimizer", "optimizer+params"),
        (False, True),
        mbs,
    ):
        plan = Plan(
            method=method,
            lora_rank=16 if method != "full" else None,
            precision=prec,
            optimizer=opt,
            checkpointing=ckpt,
            attention=attn,
            sharding=shard,
            offload=off,
            fused_loss=fused,
            micro_batch=mb,
            grad_accum=per_rank // mb,
        )
        if not plan_problems(plan, ctx.model, ctx.cluster, ctx.workload):
            out.append(plan)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3-70b")
    ap.add_argument("--gpus", default="8xH100")
    ap.add_argument("--n", type=int, default=20000)
    args = ap.parse_args()
    ctx = Target(resolve_model(args.model), parse_cluster(args.gpus), Workload(seq_len=4096, global_batch=64))
    plans = valid_plans(ctx)
    sample = [random.Random(i).choice(plans) for i in range(args.n)]
    ev = AnalyticEvaluator()
    t0 = time.perf_counter()
    fits = sum(ev.evaluate(p, ctx).fits for p in sample)
    dt = time.perf_counter() - t0
    print(
        f"{args.model} on {args.gpus}: {len(plans)} valid plans; scored {args.n} in {dt:.2f} s "
        f"= {args.n / dt:,.0f} plans/s ({fits} fit); goal 10,000 plans/s: {'met' if args.n / dt >= 10000 else 'NOT met'}"
    )


if __name__ == "__main__":
    main()

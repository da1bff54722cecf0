"""The unrolled trace against the full trace at full size: identical, and how much faster.

    python benchmarks/unroll_check.py [--models all|a,b] [--plans qlora,full] [--seq 2048]
                                      [--out benchmarks/results/DATE-unroll-check.md]

For each registered model and plan, the simulator traces the step twice in this process:
unrolled (3 periods of decoder layers, ``autofit.evaluators.unroll``) and with every layer.
It prints whether the two are the same step (the canonical storage log, the components of
every storage, the phase marks, the op rows as multisets), the rank's anatomy on the target
(peak allocated, the caching allocator's reserved pool) from each, and both wall times.
tests/evaluators/test_unroll.py checks the same on small variants of every family.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _machine import machine, versions  # noqa: E402

from autofit.evaluators import simulated  # noqa: E402
from autofit.evaluators.unroll import canonical  # noqa: E402
from autofit.plan import Plan  # noqa: E402
from autofit.specs import MODELS, Target, Workload, parse_cluster  # noqa: E402

PLANS = {
    # the main command's answer (QLoRA, plain DDP) and the ZeRO-1 plan it ties with
    "qlora": dict(method="qlora", lora_rank=16, precision="bf16-mixed", attention="sdpa", micro_batch=1, grad_accum=8),
    "qlora-zero1-fused": dict(
        method="qlora",
        lora_rank=16,
        precision="bf16-mixed",
        attention="sdpa",
        fused_loss=True,
        sharding="zero1",
        micro_batch=1,
        grad_accum=8,
    ),
    "full-ckpt-zero3": dict(
        precision="bf16-mixed", attention="flash2", checkpointing="full", sharding="zero3", micro_batch=1, grad_accum=8
    ),
    "lora-8bit-adam": dict(
        method="lora",
        lora_rank=16,
        precision="bf16-mixed",
        attention="eager",
        optimizer="adamw-8bit",
        checkpointing="full",
        micro_batch=2,
        grad_accum=4,
    ),
}
GPUS = "8xA100-80GB"


def check(name: str, plan_name: str, seq: int) -> dict:
    spec = MODELS[name]
    kw = dict(PLANS[plan_name])
    if kw["attention"] not in spec.family.attn_impls:
        kw["attention"] = "eager"
    plan = Plan(**kw)
    cluster = parse_cluster(GPUS)
    seq = min(seq, spec.max_position_embeddings)
    workload = Workload(seq_len=seq, global_batch=plan.micro_batch * plan.grad_accum * cluster.world_size)
    ctx = Target(spec, cluster, workload)
    device = simulated.TraceDevice.of(cluster.gpu)
    t = time.perf_counter()
    u = simulated.run_trace(spec, plan, workload, device)
    u_s = time.perf_counter() - t
    t = time.perf_counter()
    f = simulated.run_trace(spec, plan, workload, device, unrolled=False)
    f_s = time.perf_counter() - t
    same = {
        "log": canonical(u.log) == canonical(f.log),
        "components": [u.kinds[k] for k, d in u.log if d > 0] == [f.kinds[k] for k, d in f.log if d > 0],
        "marks": u.marks == f.marks,
        "ops": all(Counter(u.ops.rows[p]) == Counter(f.ops.rows.get(p, [])) for p in u.ops.rows),
    }
    mu, _ = simulated.anatomy(u, plan, ctx)
    mf, _ = simulated.anatomy(f, plan, ctx)
    return {
        "model": name,
        "layers": f"{u.timings['layers_traced']} of {spec.num_layers}",
        "plan": plan.summary(),
        "events": len(f.log),
        "same": same,
        "anatomy_same": mu == mf,
        "allocated": (mu.peak_allocated, mf.peak_allocated),
        "reserved": (mu.peak_reserved, mf.peak_reserved),
        "unrolled_s": u_s,
        "full_s": f_s,
        "failed": u.timings.get("unroll_failed", ""),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="all")
    ap.add_argument("--plans", default="qlora,full-ckpt-zero3")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    names = list(MODELS) if args.models == "all" else args.models.split(",")
    rows = []
    t0 = time.perf_counter()
    for name in names:
        for plan_name in args.plans.split(","):
            try:
                r = check(name, plan_name, args.seq)
            except Exception as exc:  # noqa: BLE001 - a plan the family cannot run is a row, not a stop
                print(f"{name} {plan_name}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", flush=True)
                continue
            rows.append(r)
            ok = all(r["same"].values()) and r["anatomy_same"]
            print(
                f"{r['model']:24} {r['layers']:>9} {plan_name:18} {'identical' if ok else 'DIFFERENT ' + str(r['same'])}"
                f"  {r['unrolled_s']:5.1f} s vs {r['full_s']:5.1f} s ({r['full_s'] / r['unrolled_s']:.1f}x)",
                flush=True,
            )
    total = time.perf_counter() - t0
    gib = 2**30
    lines = [
        f"# Unrolled vs full simulated traces at full size — {datetime.date.today()}",
        "",
        f"Machine: {machine()}. {versions('torch', 'transformers', 'peft', 'bitsandbytes')}.",
        f"Command: `python benchmarks/unroll_check.py --models {args.models} --plans {args.plans} --seq {args.seq}`"
        f" ({total:.0f} s in all). Target {GPUS}, seq {args.seq} (or the model's positions), micro-batch × 8 GPUs.",
        "",
        "Each row traces one plan twice in this process: unrolled (3 periods of layers) and with every layer. "
        "*identical*: the canonical storage log (sizes, order, which allocation each free frees; a run of frees "
        "with no allocation between compared as a set), every storage's component, the phase marks and the op rows "
        "are equal, and so is the rank's anatomy (peak allocated, reserved pool from the allocator replay).",
        "",
        "| model | layers traced | plan | events | identical | peak allocated GiB | reserved GiB | unrolled | full | speed-up |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ok = all(r["same"].values()) and r["anatomy_same"]
        what = "yes" if ok else "**no**: " + ", ".join(k for k, v in r["same"].items() if not v)
        if r["failed"]:
            what += f" (unroll failed: {r['failed']})"
        lines.append(
            f"| {r['model']} | {r['layers']} | {r['plan']} | {r['events']:,} | {what} | "
            f"{r['allocated'][0] / gib:.2f} | {r['reserved'][0] / gib:.2f} | {r['unrolled_s']:.1f} s | "
            f"{r['full_s']:.1f} s | {r['full_s'] / r['unrolled_s']:.1f}x |"
        )
    n_ok = sum(all(r["same"].values()) and r["anatomy_same"] for r in rows)
    speed = sorted(r["full_s"] / r["unrolled_s"] for r in rows)
    lines += [
        "",
        f"{n_ok} of {len(rows)} identical; speed-up median {speed[len(speed) // 2]:.1f}x "
        f"(range {speed[0]:.1f}–{speed[-1]:.1f}x)."
        if rows
        else "no rows",
        "The first row of a process includes building transformers' and bitsandbytes' modules for the first time.",
    ]
    out = Path(args.out or HERE / "results" / f"{datetime.date.today()}-unroll-check.md")
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Simulated vs analytic anatomy over a grid of plans for every registered model.

    python benchmarks/simulated_vs_analytic.py [--quick] [--models mistral-7b,gpt2] [--gpu A100-80GB]
                                               [--seq 512] [--out benchmarks/results/FILE.md]

For each model and plan: the peak and every component from both evaluators, and the
relative difference. A row is flagged when the peak differs by more than 10%, or a
component does by more than 10% of itself and 1% of the peak (smaller components are a
few KiB of batch tensors and scalars). The flagged rows are what to investigate: the
simulated side is a traced real step (checked against real CPU steps in
tests/evaluators/test_simulated.py), so a flag is usually the closed form's to fix. A
summary table gives the median and worst error of the peak and of each component (analytic
relative to simulated; components under 1% of the peak in points of the peak).
``--quick``: three small models.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

from _errors import summary_table

from autofit.evaluators.analytic import estimate
from autofit.evaluators.simulated import SimulatedEvaluator, TraceCache
from autofit.plan import Plan, plan_problems
from autofit.results import TENSOR_COMPONENTS
from autofit.specs import MODELS, Target, Workload, parse_cluster

MiB = 2**20
PARTS = list(TENSOR_COMPONENTS)


def plans_for(model) -> list[tuple[str, Plan]]:
    attn = "sdpa" if "sdpa" in model.family.attn_impls else "eager"
    fa2 = "flash2" if "flash2" in model.family.attn_impls else attn
    out = [
        ("1x", Plan(precision="bf16-mixed", attention=attn, micro_batch=1)),
        (
            "1x",
            Plan(precision="bf16-true", optimizer="adamw-8bit", checkpointing="full", attention=attn, micro_batch=2),
        ),
        ("1x", Plan(method="lora", lora_rank=16, precision="bf16-mixed", attention=attn, micro_batch=2)),
        (
            "1x",
            Plan(
                method="qlora",
                lora_rank=16,
                precision="bf16-mixed",
                checkpointing="full",
                attention=fa2,
                fused_loss=True,
                micro_batch=2,
            ),
        ),
        ("1x", Plan(precision="bf16-true", optimizer="adafactor", attention="eager", micro_batch=1)),
        ("1x", Plan(precision="32-true", optimizer="sgd", attention=attn, micro_batch=1)),
        ("4x", Plan(precision="bf16-mixed", sharding="zero3", checkpointing="full", attention=fa2, micro_batch=1)),
    ]
    return out


def summarize(path: str) -> list[str]:
    """The summary table of an earlier result file, from its MiB cells (``--summarize FILE``)."""
    cases = []
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 5 + len(PARTS) or not cells[2].replace(",", "").isdigit():
            continue
        sim_peak = int(cells[2].replace(",", ""))
        pairs = [c.replace("⚑", "").replace(",", "").split("/") for c in cells[5 : 5 + len(PARTS)]]
        sim = {c: float(p[0]) for c, p in zip(PARTS, pairs)}
        ana = {c: float(p[1]) for c, p in zip(PARTS, pairs)}
        cases.append((sim, ana, sim_peak, int(cells[3].replace(",", ""))))
    return summary_table(cases, "analytic vs simulated")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--gpu", default="A100-80GB")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--out", default="")
    ap.add_argument("--quick", action="store_true", help="gpt2, qwen2.5-0.5b and llama-3.2-1b only")
    ap.add_argument("--summarize", metavar="FILE", help="print the summary table of an earlier result file")
    args = ap.parse_args()
    if args.summarize:
        print("\n".join(summarize(args.summarize)))
        return
    if args.quick:
        args.models = "gpt2,qwen2.5-0.5b,llama-3.2-1b"
    import torch
    import transformers

    ev = SimulatedEvaluator(TraceCache(size=4))
    lines = [
        f"Machine: 2-core CPU VM, no GPU; Python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}. Target: {args.gpu} (CUDA kernels substituted, see "
        f"autofit/evaluators/simulated.py), seq {args.seq}, global batch = micro-batch × GPUs (grad_accum 1).",
        "",
        "MiB; `Δ` = (simulated − analytic) / analytic of the peak; components as simulated / analytic; "
        "⚑ = peak differs > 10%, or a component > 10% of itself and > 1% of the peak.",
        "",
        "| model | plan | sim peak | ana peak | Δ peak | "
        + " | ".join(PARTS)
        + " | sim phase / ana phase | tokens/s sim / ana | trace s |",
        "|---|---|---:|---:|---:|" + "---|" * len(PARTS) + "---|---|---:|",
    ]
    deltas, cases = [], []
    speed = []  # simulated / analytic tokens/s
    flagged = 0
    for name in args.models.split(","):
        model = MODELS[name]
        seq = min(args.seq, model.max_position_embeddings)
        for count, plan in plans_for(model):
            cluster = parse_cluster(f"{count}{args.gpu}")
            wl = Workload(seq_len=seq, global_batch=plan.micro_batch * cluster.world_size)
            if plan_problems(plan, model, cluster, wl):
                continue
            ctx = Target(model, cluster, wl)
            t0 = time.perf_counter()
            sim = ev.evaluate(plan, ctx)
            dt = time.perf_counter() - t0
            ana = estimate(plan, ctx)
            label = f"{count} · {plan.summary()}"
            if sim.memory is None:
                lines.append(f"| {name} | {label} | failed: {sim.reason} |")
                print(name, label, "FAILED", sim.reason, file=sys.stderr, flush=True)
                continue
            sp, ap_ = sim.memory.peak_allocated, ana.memory.peak_allocated
            d = (sp - ap_) / ap_
            deltas.append(abs(d))
            cases.append(
                ({c: getattr(sim.memory, c) for c in PARTS}, {c: getattr(ana.memory, c) for c in PARTS}, sp, ap_)
            )
            speed.append(sim.tokens_per_sec / ana.throughput.tokens_per_sec)
            flag = abs(d) > 0.10
            cells = []
            for c in PARTS:
                s, a = getattr(sim.memory, c), getattr(ana.memory, c)
                bad = abs(s - a) > 0.10 * max(a, 1) and abs(s - a) > 0.01 * sp
                flag |= bad
                cells.append(f"{s / MiB:,.0f} / {a / MiB:,.0f}" + (" ⚑" if bad else ""))
            flagged += flag
            lines.append(
                f"| {name} | {label} | {sp / MiB:,.0f} | {ap_ / MiB:,.0f} | {d * 100:+.1f}%"
                f"{' ⚑' if abs(d) > 0.10 else ''} | "
                + " | ".join(cells)
                + f" | {sim.extra['peak_phase']} / {ana.peak_phase} | "
                f"{sim.tokens_per_sec:,.0f} / {ana.throughput.tokens_per_sec:,.0f} | {dt:.1f} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    deltas.sort()
    if deltas:
        lines += [
            "",
            f"{len(deltas)} plans; |Δ peak| median {deltas[len(deltas) // 2] * 100:.1f}%, "
            f"worst {deltas[-1] * 100:.1f}%; {flagged} rows flagged.",
        ]
        speed.sort()
        lines += [
            f"tokens/s simulated / analytic: median {speed[len(speed) // 2]:.2f}, range {speed[0]:.2f}–{speed[-1]:.2f}."
        ]
        lines += ["", *summary_table(cases, "analytic vs simulated")]
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

"""Model types no family describes, read from transformers (specs/derive.py), at their real sizes.

    python benchmarks/derived_models.py [--gpus 1xA100-80GB] [--seq 2048] [--types a,b] [--out benchmarks/results/FILE.md]

For each model type, its transformers default config (the size its config class describes): how
long reading it takes, its parameter count, whether the analytic evaluator itemizes its block by
the formulas or traces one block (and why: what its modules show, or the formulas' bytes off one
traced block's by more than 2%), and for three plans the peak allocated memory and
tokens/s of the simulated evaluator (the traced step) and the analytic one, with analytic /
simulated. The simulated traces of these blocks are checked against real CPU steps in
``tests/evaluators/test_derived.py``; nothing here was measured on a GPU.
"""

from __future__ import annotations

import argparse
import platform
import time
import warnings

from _emit import emit  # beside this file

from autofit.evaluators import traced
from autofit.evaluators.analytic import estimate
from autofit.evaluators.simulated import SimulatedEvaluator, TraceCache
from autofit.plan import Plan
from autofit.specs import ModelSpec, Target, Workload, parse_cluster

GiB = 2**30
TYPES = ["starcoder2", "granite", "smollm3", "glm4", "gemma3_text", "olmo", "olmo2", "exaone4", "arcee"]
# mixture-of-experts types (--types moe): read under the balanced-routing assumption
MOE_TYPES = ["olmoe", "granitemoe", "phimoe", "solar_open", "gpt_oss"]
PLANS = [
    Plan(precision="bf16-true", micro_batch=1, checkpointing="full"),
    Plan(method="lora", lora_rank=16, precision="bf16-mixed", micro_batch=1),
    Plan(method="qlora", lora_rank=16, precision="bf16-mixed", micro_batch=1, checkpointing="full"),
]


def read(model_type: str) -> tuple[ModelSpec, float]:
    from transformers import AutoConfig

    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = ModelSpec.from_hf_config(AutoConfig.for_model(model_type).to_dict(), name=model_type)
    return spec, time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="1xA100-80GB")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--types", default="", help="comma-separated model types, or 'moe' (default: the dense list)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    types = MOE_TYPES if args.types == "moe" else [t for t in args.types.split(",") if t] or TYPES
    cache = TraceCache()
    specs, rows, ratios = [], [], {"formulas": [], "traced": []}
    t0 = time.perf_counter()
    for model_type in types:
        spec, took = read(model_type)
        why = traced.formulas_miss(spec)  # the modules' reason, or the formulas' check against one traced block
        how = f"traced: {why}" if why else "formulas (checked against one traced block)"
        specs.append(
            f"| {model_type} | {spec.family.decoder_layer} | {spec.n_params / 1e9:.2f}B | {took:.1f} | {how} |"
        )
        print(specs[-1], flush=True)
        for plan in PLANS:
            if "sdpa" not in spec.family.attn_impls:  # GPT-OSS (attention sinks): eager
                plan = plan.replace(attention="eager")
            ctx = Target(spec, parse_cluster(args.gpus), Workload(seq_len=args.seq, global_batch=plan.micro_batch))
            sim = SimulatedEvaluator(cache).evaluate(plan, ctx)
            t = time.perf_counter()
            ana = estimate(plan, ctx)
            ana_s = time.perf_counter() - t
            sm, am = sim.memory.peak_allocated, ana.memory.peak_allocated
            ratios["traced" if why else "formulas"].append(am / sm)
            rows.append(
                f"| {model_type} | {plan.summary()} | {sm / GiB:.2f} | {am / GiB:.2f} | {am / sm:.3f} "
                f"| {sim.tokens_per_sec:,.0f} | {ana.throughput.tokens_per_sec:,.0f} | {ana_s:.2f} |"
            )
            print(rows[-1], flush=True)
    spans = "; ".join(f"{k}: {min(v):.3f} to {max(v):.3f} ({len(v)} plans)" for k, v in ratios.items() if v)
    lines = [
        f"# Model types no family describes ({time.strftime('%Y-%m-%d')})",
        "",
        f"`python benchmarks/derived_models.py --gpus {args.gpus} --seq {args.seq}"
        f"{' --types ' + args.types if args.types else ''}` on {platform.node() or 'CPU'} "
        f"({time.perf_counter() - t0:.0f} s). Each type at its transformers default config. Analytic / simulated "
        f"peak: {spans}. No GPU measured any of it.",
        "",
        "| model type | block | parameters | read s | analytic block |",
        "|---|---|---:|---:|---|",
        *specs,
        "",
        "Peak allocated GiB per GPU and tokens/s, simulated (sim) and analytic (ana); `ana s` is the analytic "
        "evaluator's time for the plan, the block's trace included where it is traced (cached per plan).",
        "",
        "| model type | plan | sim GiB | ana GiB | ana / sim | sim tok/s | ana tok/s | ana s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]
    return emit(lines, args.out)


if __name__ == "__main__":
    raise SystemExit(main())

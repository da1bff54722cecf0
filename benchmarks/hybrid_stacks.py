"""Hybrid stacks (dense and MoE layers in one stack) as both estimators predict them, and what the search answers.

    python benchmarks/hybrid_stacks.py [--seq 2048] [--out benchmarks/results/FILE.md]

DeepSeek-V3 and its smaller relatives (Moonlight-16B-A3B, DeepSeek-V2-Lite: dense first layers,
multi-head latent attention), GLM-4.5-Air and ERNIE-4.5-21B-A3B, read from their configs
(``specs/derive.py``, kind by kind). For a few plans on the GPUs people fine-tune them on: the
peak allocated memory and tokens/s from the simulated evaluator (the dense layers traced once as a
head, then three layers unrolled to the rest: ``unroll.Depth.head``) and the analytic one (each kind's block, summed layer by layer), and
their ratio. Then, per model × GPUs, the fastest fitting plan of each method over the whole space
as the analytic screen ranks it. Both estimators assume balanced routing. The simulated side is
checked against real CPU steps in ``tests/evaluators/test_derived.py``; nothing here ran on a GPU.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

from _emit import emit  # beside this file
from _frontier import best_per_method, cells, write_configs  # beside this file

from autofit.evaluators.analytic import estimate
from autofit.evaluators.simulated import SimulatedEvaluator, TraceCache
from autofit.plan import Plan
from autofit.specs import Target, Workload, parse_cluster, resolve_model

GiB = 2**30
# the published configs' sizes (config.json of each hub repository); keys a type's defaults cover are left out
_MLA = dict(kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, head_dim=64)
_SMALL_DEEPSEEK = dict(
    hidden_size=2048,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_shared_experts=2,
    n_routed_experts=64,
    num_experts_per_tok=6,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    tie_word_embeddings=False,
    **_MLA,
)
CONFIGS = {
    # moonshotai/Moonlight-16B-A3B
    "moonlight-16b-a3b": dict(
        model_type="deepseek_v3",
        intermediate_size=11264,
        vocab_size=163840,
        max_position_embeddings=8192,
        routed_scaling_factor=2.446,
        **_SMALL_DEEPSEEK,
    ),
    # deepseek-ai/DeepSeek-V2-Lite
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2",
        intermediate_size=10944,
        vocab_size=102400,
        max_position_embeddings=8192,
        **_SMALL_DEEPSEEK,
    ),
    # baidu/ERNIE-4.5-21B-A3B-PT: transformers' Ernie4_5_MoeConfig defaults
    "ernie-4.5-21b-a3b": dict(model_type="ernie4_5_moe"),
    # zai-org/GLM-4.5-Air: transformers' Glm4MoeConfig defaults (its multi-token-prediction layer is not built)
    "glm-4.5-air": dict(model_type="glm4_moe"),
    # deepseek-ai/DeepSeek-V3: transformers' DeepseekV3Config defaults
    "deepseek-v3": dict(model_type="deepseek_v3"),
}
LORA = dict(method="lora", lora_rank=16, precision="bf16-true", checkpointing="full")
QLORA = dict(method="qlora", lora_rank=16, precision="bf16-mixed", checkpointing="full")
RUNS = [
    ("moonlight-16b-a3b", "1xH100", Plan(**LORA, micro_batch=2)),
    ("moonlight-16b-a3b", "1xA100-80GB", Plan(**QLORA, micro_batch=2)),
    ("moonlight-16b-a3b", "8xH100", Plan(precision="bf16-mixed", micro_batch=1, checkpointing="full", sharding="fsdp")),
    ("deepseek-v2-lite", "1xA100-80GB", Plan(**LORA, micro_batch=1)),
    ("deepseek-v2-lite", "1xRTX4090", Plan(**QLORA, micro_batch=1)),
    ("ernie-4.5-21b-a3b", "1xH200", Plan(**LORA, micro_batch=2)),
    ("ernie-4.5-21b-a3b", "4xH100", Plan(precision="bf16-mixed", micro_batch=1, checkpointing="full", sharding="fsdp")),
    ("glm-4.5-air", "8xH100", Plan(**LORA, micro_batch=1, sharding="zero3")),
    ("glm-4.5-air", "2xH200", Plan(**QLORA, micro_batch=1, sharding="zero3")),
    ("deepseek-v3", "8xH200", Plan(**QLORA, micro_batch=1, sharding="zero3")),
]
PAIRS = [("moonlight-16b-a3b", "1xH100"), ("ernie-4.5-21b-a3b", "1xH200"), ("glm-4.5-air", "8xH100")]


def compare(paths: dict[str, str], seq: int) -> tuple[list[str], list[tuple[float, float]]]:
    cache, rows, errors = TraceCache(), [], []
    for name, gpus, plan in RUNS:
        cluster, spec = parse_cluster(gpus), resolve_model(paths[name])
        ctx = Target(spec, cluster, Workload(seq_len=seq, global_batch=plan.micro_batch * cluster.world_size))
        t = time.perf_counter()
        sim = SimulatedEvaluator(cache).evaluate(plan, ctx)
        sim_s = time.perf_counter() - t
        ana = estimate(plan, ctx)
        sm, st = sim.memory.peak_allocated, sim.tokens_per_sec
        am, at = ana.memory.peak_allocated, ana.throughput.tokens_per_sec
        errors.append((am / sm - 1, at / st - 1))
        kinds = " + ".join(f"{n}×{'MoE' if k.family.moe else 'dense'}" for n, k in spec.layer_kinds())
        rows.append(
            f"| {name} ({spec.n_params / 1e9:.2f} B; {kinds}) | {gpus} | {plan.summary()} | {sm / GiB:.2f} "
            f"| {am / GiB:.2f} ({am / sm - 1:+.1%}) | {st:,.0f} | {at:,.0f} ({at / st - 1:+.1%}) "
            f"| {sim.status.value} | {sim_s:.1f} |"
        )
        print(rows[-1], file=sys.stderr)
    return rows, errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_configs(CONFIGS, Path(tmp))
        rows, errors = compare(paths, args.seq)
        front = []
        for name, gpus in PAIRS:
            t = time.perf_counter()
            best = best_per_method(paths[name], gpus)
            front.append(
                f"| {name} | {gpus} | {' | '.join(cells(best, with_plan=True))} | {time.perf_counter() - t:.0f} |"
            )
            print(front[-1], file=sys.stderr)
        routing = resolve_model(paths["deepseek-v3"]).routing_assumption
    elapsed = time.perf_counter() - t0
    lines = [
        f"# Hybrid stacks: dense and MoE layers — {time.strftime('%Y-%m-%d')}",
        "",
        f"Command: `python benchmarks/hybrid_stacks.py --seq {args.seq}` ({elapsed:.0f} s); "
        f"machine: {platform.processor() or platform.machine()}, no GPU. Predictions only: no GPU ran these.",
        f"{routing}.",
        "",
        f"Analytic vs simulated, seq {args.seq}, global batch = micro-batch × GPUs: peak "
        f"{min(e[0] for e in errors):+.1%} to {max(e[0] for e in errors):+.1%}, tokens/s "
        f"{min(e[1] for e in errors):+.1%} to {max(e[1] for e in errors):+.1%}.",
        "",
        "| model (parameters; layers) | GPUs | plan | simulated peak GiB | analytic peak GiB | simulated tokens/s "
        "| analytic tokens/s | simulated | trace s |",
        "|---|---|---|---:|---:|---:|---:|---|---:|",
        *rows,
        "",
        "Fastest fitting plan of each method over the whole space (analytic screen, seq 2048, global batch 16), "
        "tokens/s (device memory; plan), and the screen's seconds:",
        "",
        "| model | GPUs | full | lora | lora-8bit | qlora | s |",
        "|---|---|---|---|---|---|---:|",
        *front,
        "",
    ]
    return emit(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())

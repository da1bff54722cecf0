"""Stacks whose layers mix tokens with Mamba, the gated delta rule or short convolutions, as both
estimators predict them, and what the search answers.

    python benchmarks/mixer_stacks.py [--seq 2048] [--out benchmarks/results/FILE.md]

Qwen3-Next-80B-A3B (gated delta rule beside attention, MoE), Falcon-H1 (Mamba-2 beside attention in every layer), Bamba-9B and
Nemotron-H-8B (Mamba-2 layers with a few attention layers), LFM2-1.2B (short convolutions) and
Qwen3.5-9B (gated delta rule), read from their configs (``specs/derive.py``). For a few plans: the
peak allocated memory and tokens/s from the simulated evaluator (the mixers' torch code, traced)
and the analytic one (each mixer kind's saves, transients, kernels and own products from one
traced block: ``traced.mixer_work``), their ratio, and how long each took. Then, per model × GPUs,
the fastest fitting plan of each method as the analytic screen ranks it. Both estimate what
transformers runs without mamba-ssm, causal-conv1d or flash-linear-attention: their torch code.
The simulated side is checked against real CPU steps in ``tests/evaluators/test_mixers.py``;
nothing here ran on a GPU.
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
LFM2_TYPES = ["conv", "conv", "full_attention"] * 3 + ["conv", "full_attention"] * 3 + ["conv"]
NEMOTRON_H_8B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
CONFIGS = {
    # Qwen/Qwen3-Next-80B-A3B-Instruct: transformers' Qwen3NextConfig defaults
    "qwen3-next-80b-a3b": dict(model_type="qwen3_next"),
    # ai21labs/Jamba-v0.1: transformers' JambaConfig defaults
    "jamba-v0.1": dict(model_type="jamba"),
    # tiiuae/Falcon-H1 defaults of transformers' FalconH1Config
    "falcon-h1": dict(model_type="falcon_h1"),
    # ibm-ai-platform/Bamba-9B
    "bamba-9b": dict(
        model_type="bamba",
        attn_layer_indices=[9, 18, 27],
        mamba_d_state=128,
        mamba_n_heads=128,
        mamba_d_head=64,
        vocab_size=128256,
    ),
    # nvidia/Nemotron-H-8B-Base-8K
    "nemotron-h-8b": dict(
        model_type="nemotron_h",
        hybrid_override_pattern=NEMOTRON_H_8B,
        num_hidden_layers=len(NEMOTRON_H_8B),
        hidden_size=4096,
        intermediate_size=21504,
        num_attention_heads=32,
        num_key_value_heads=8,
        mamba_num_heads=128,
        mamba_head_dim=64,
        ssm_state_size=128,
        n_groups=8,
        chunk_size=128,
        vocab_size=131072,
        mlp_hidden_act="relu2",
    ),
    # LiquidAI/LFM2-1.2B
    "lfm2-1.2b": dict(
        model_type="lfm2",
        hidden_size=2048,
        num_hidden_layers=len(LFM2_TYPES),
        layer_types=LFM2_TYPES,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=65536,
    ),
    # Qwen/Qwen3.5-9B's text model: transformers' Qwen3_5TextConfig defaults
    "qwen3.5-9b": dict(model_type="qwen3_5_text"),
}
LORA = dict(method="lora", lora_rank=16, precision="bf16-true", checkpointing="full")
QLORA = dict(method="qlora", lora_rank=16, precision="bf16-mixed", checkpointing="full")
FULL = dict(precision="bf16-mixed", checkpointing="full")
# Jamba-v0.1 is read (its config above gives the assumption line) but not traced here: its Mamba
# scan's torch code loops over the tokens, and one simulated step of the full model ran past 15
# minutes at 2048 tokens and past 9 at 512 (tests/evaluators/test_mixers.py checks it tiny)
RUNS = [
    ("qwen3-next-80b-a3b", "1xH200", Plan(**QLORA, micro_batch=1)),
    ("qwen3-next-80b-a3b", "8xH100", Plan(**LORA, micro_batch=1, sharding="zero3")),
    ("falcon-h1", "1xH100", Plan(**LORA, micro_batch=2)),
    ("falcon-h1", "1xRTX4090", Plan(**QLORA, micro_batch=1)),
    ("bamba-9b", "1xH100", Plan(**LORA, micro_batch=2)),
    ("bamba-9b", "4xH100", Plan(**FULL, micro_batch=1, sharding="fsdp")),
    ("nemotron-h-8b", "1xA100-80GB", Plan(**LORA, micro_batch=2)),
    ("lfm2-1.2b", "1xRTX4090", Plan(**FULL, micro_batch=2)),
    ("lfm2-1.2b", "1xA10", Plan(**LORA, micro_batch=4)),
    ("qwen3.5-9b", "1xH100", Plan(**QLORA, micro_batch=2)),
]
PAIRS = [("falcon-h1", "1xH100"), ("lfm2-1.2b", "1xRTX4090"), ("bamba-9b", "1xA100-80GB")]


def _layers(spec) -> str:
    """Each kind of layer: its count, and its mixer's class or attention."""
    out = []
    for n, k in spec.layer_kinds():
        what = k.mixer.split("(", 1)[-1].rstrip(")") if k.mixer else ("attention" if k.attends else "MLP")
        out.append(f"{n}×{what}{'+MoE' if k.family.moe else ''}")
    return " + ".join(out)


def compare(paths: dict[str, str], seq: int) -> tuple[list[str], list[tuple[float, float]]]:
    cache, rows, errors = TraceCache(), [], []
    for name, gpus, plan in RUNS:
        cluster, spec = parse_cluster(gpus), resolve_model(paths[name])
        ctx = Target(spec, cluster, Workload(seq_len=seq, global_batch=plan.micro_batch * cluster.world_size))
        t = time.perf_counter()
        sim = SimulatedEvaluator(cache).evaluate(plan, ctx)
        sim_s = time.perf_counter() - t
        t = time.perf_counter()
        ana = estimate(plan, ctx)
        ana_s = time.perf_counter() - t
        sm, st = sim.memory.peak_allocated, sim.tokens_per_sec
        am, at = ana.memory.peak_allocated, ana.throughput.tokens_per_sec
        errors.append((am / sm - 1, at / st - 1))
        rows.append(
            f"| {name} ({spec.n_params / 1e9:.2f} B; {_layers(spec)}) | {gpus} | {plan.summary()} | {sm / GiB:.2f} "
            f"| {am / GiB:.2f} ({am / sm - 1:+.1%}) | {st:,.0f} | {at:,.0f} ({at / st - 1:+.1%}) "
            f"| {sim.status.value} | {sim_s:.1f} | {ana_s:.1f} |"
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
        assumption = resolve_model(paths["jamba-v0.1"]).mixer_assumption
    elapsed = time.perf_counter() - t0
    lines = [
        f"# Mixer stacks: Mamba, gated delta rule and short convolutions beside attention — {time.strftime('%Y-%m-%d')}",
        "",
        f"Command: `python benchmarks/mixer_stacks.py --seq {args.seq}` ({elapsed:.0f} s); "
        f"machine: {platform.processor() or platform.machine()}, no GPU. Predictions only: no GPU ran these.",
        f"Assumed: {assumption}.",
        "Jamba-v0.1 is not here: its Mamba scan's torch code loops over the tokens, and one simulated step of the "
        "full model ran past 15 minutes at 2048 tokens (tests/evaluators/test_mixers.py checks it tiny).",
        "",
        f"Analytic vs simulated, seq {args.seq}, global batch = micro-batch × GPUs: peak "
        f"{min(e[0] for e in errors):+.1%} to {max(e[0] for e in errors):+.1%}, tokens/s "
        f"{min(e[1] for e in errors):+.1%} to {max(e[1] for e in errors):+.1%}. The census cache was empty "
        "(the analytic seconds include each kind's census).",
        "",
        "| model (parameters; layers) | GPUs | plan | simulated peak GiB | analytic peak GiB | simulated tokens/s "
        "| analytic tokens/s | simulated | trace s | analytic s |",
        "|---|---|---|---:|---:|---:|---:|---|---:|---:|",
        *rows,
        "",
        f"Fastest fitting plan of each method over the whole space (analytic screen, seq {args.seq}, global batch 16), "
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

"""Targets and plans the export tests run over: a sweep of valid plans and the golden cases."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from autofit.plan import (
    Attention,
    Checkpointing,
    Method,
    Offload,
    OffloadDevice,
    Optimizer,
    Plan,
    Precision,
    Sharding,
    plan_problems,
)
from autofit.search.request import build_context
from autofit.specs import Target

# (model, gpus per node, nodes, global batch, seq_len): every family, bf16 and fp16-only
# GPUs, one GPU (offload-only sharding), several GPUs, two nodes.
TARGETS = {
    "mistral-2xA10": ("mistral-7b", "2xA10", 1, 16, 2048),
    "llama2-4xV100": ("llama-2-7b", "4xV100", 1, 32, 2048),
    "llama3-70b-2x8xH100": ("llama-3-70b", "8xH100", 2, 64, 4096),
    "qwen2-1xA100": ("qwen2.5-7b", "1xA100", 1, 8, 2048),
    "gpt2-1xT4": ("gpt2", "1xT4", 1, 8, 1024),
    "bert-2xRTX4090": ("bert-large-uncased", "2xRTX4090", 1, 16, 512),
    "gemma2-2xL4": ("gemma-2-9b", "2xL4", 1, 16, 2048),
    "phi3-2xA6000": ("phi-3-mini", "2xA6000", 1, 16, 2048),
}


def target(name: str) -> Target:
    model, gpus, nodes, global_batch, seq_len = TARGETS[name]
    return build_context(model, gpus, nodes=nodes, global_batch=global_batch, seq_len=seq_len)


def sweep(ctx: Target) -> Iterator[Plan]:
    """Every valid combination of method, precision, optimizer, sharding and offload on ``ctx``;
    the secondary knobs (micro-batch, attention, checkpointing, packing, fused loss and kernels) rotate."""
    world = ctx.cluster.world_size
    impls = ctx.model.family.attn_impls
    combos = itertools.product(Method, Precision, Optimizer, Sharding, Offload, OffloadDevice)
    for i, (method, precision, optimizer, sharding, offload, device) in enumerate(combos):
        mb = 1 + i % 2
        attention = [Attention.SDPA, Attention.FLASH2, Attention.EAGER][i % 3]
        if attention.value not in impls or (attention is Attention.FLASH2 and not ctx.cluster.gpu.supports_flash2):
            attention = Attention(impls[0])
        plan = Plan(
            method=method,
            lora_rank=16 if method is not Method.FULL else None,
            lora_targets="attention" if i % 7 == 3 else "all-linear",
            precision=precision,
            optimizer=optimizer,
            micro_batch=mb,
            grad_accum=max(1, ctx.workload.global_batch // (mb * world)),
            checkpointing=[Checkpointing.NONE, Checkpointing.FULL, Checkpointing.SELECTIVE][i % 3],
            checkpoint_every=2 if i % 6 == 2 else None,  # selective: every second block, or op-level
            checkpoint_ops=i % 6 == 5,
            attention=attention,
            sharding=sharding,
            offload=offload,
            offload_device=device,
            packing=attention is Attention.FLASH2 and i % 4 == 1,
            fused_loss=i % 5 == 0,
            fused_kernels=i % 3 == 1 and ctx.model.family.fused_kernels,
        )
        if i % 4 == 2:  # where plan_problems allows it
            compiled = plan.replace(torch_compile=True)
            plan = plan if plan_problems(compiled, ctx.model, ctx.cluster, ctx.workload) else compiled
        if not plan_problems(plan, ctx.model, ctx.cluster, ctx.workload):
            yield plan


def all_sweep_plans() -> list[tuple[str, Target, Plan]]:
    out = []
    for name in TARGETS:
        ctx = target(name)
        out += [(name, ctx, p) for p in sweep(ctx)]
    return out


# The golden cases: plans the analytic evaluator says fit (checked in test_export.py).
GOLDEN = {
    "zero2-bf16-2xA10-mistral-7b": (
        ("mistral-7b", "2xA10", 1, 16, 2048),
        dict(
            method="lora",
            lora_rank=16,
            precision="bf16-mixed",
            micro_batch=1,
            grad_accum=8,
            checkpointing="full",
            attention="flash2",
            sharding="zero2",
        ),
    ),
    "zero3-offload-8xH100-llama-3-70b": (
        ("llama-3-70b", "8xH100", 1, 32, 4096),
        dict(
            method="full",
            precision="bf16-mixed",
            micro_batch=1,
            grad_accum=4,
            checkpointing="full",
            attention="flash2",
            sharding="zero3",
            offload="optimizer",
        ),
    ),
    "fsdp-qlora-2xA100-llama-3-8b": (
        ("llama-3-8b", "2xA100", 1, 16, 4096),
        dict(
            method="qlora",
            lora_rank=16,
            precision="bf16-mixed",
            micro_batch=2,
            grad_accum=4,
            checkpointing="full",
            attention="flash2",
            sharding="fsdp",
            packing=True,
            fused_loss=True,
        ),
    ),
    "single-lora-1xRTX4090-llama-3-8b": (
        ("llama-3-8b", "1xRTX4090", 1, 16, 2048),
        dict(
            method="lora",
            lora_rank=16,
            precision="bf16-mixed",
            optimizer="adamw-8bit",
            micro_batch=2,
            grad_accum=8,
            checkpointing="full",
            attention="sdpa",
            fused_loss=True,
        ),
    ),
}


def golden(name: str) -> tuple[Target, Plan]:
    (model, gpus, nodes, global_batch, seq_len), plan = GOLDEN[name]
    return build_context(model, gpus, nodes=nodes, global_batch=global_batch, seq_len=seq_len), Plan(**plan)

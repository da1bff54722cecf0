"""How a plan's techniques are spelled in the libraries that run them. Imports without torch.

The runtime (which builds and steps models for the simulated and measured evaluators)
and the exporter (which writes the files a user launches) both read these, so the
training autofit simulates and measures is the training the exported files ask for.
Dtypes are torch attribute names (``"bfloat16"``); the runtime turns them into dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autofit.plan import Attention, LoraTargets, Method, Plan, Precision
from autofit.specs import ModelSpec

# transformers' ``attn_implementation`` for each attention kernel
ATTN_IMPL = {Attention.EAGER: "eager", Attention.SDPA: "sdpa", Attention.FLASH2: "flash_attention_2"}

# QLoRA's base weights: bitsandbytes NF4 with double quantization (the QLoRA paper's setting)
NF4_QUANT_TYPE = "nf4"
NF4_DOUBLE_QUANT = True


@dataclass(frozen=True)
class DtypeLayout:
    """Dtypes of one process's model: base weights as loaded, LoRA adapters, autocast (or None)."""

    base: str
    adapter: str
    autocast: str | None


def half_dtype_name(plan: Plan) -> str:
    return "float16" if plan.precision is Precision.FP16_MIXED else "bfloat16"


def dtype_layout(plan: Plan) -> DtypeLayout:
    """How a plan is laid out in one process.

    ``32-true``: fp32 everything. ``bf16-true``: bf16 everything. Mixed on plain torch:
    full fine-tuning keeps fp32 weights under autocast; LoRA/QLoRA keep the frozen base in
    16-bit and the adapters in fp32. Mixed under DeepSpeed or FSDP2: the module computes
    in 16-bit parameters; the engines keep the fp32 master / sharded fp32 copies.
    """
    if plan.precision is Precision.FP32:
        return DtypeLayout("float32", "float32", None)
    if plan.precision is Precision.BF16_TRUE:
        return DtypeLayout("bfloat16", "bfloat16", None)
    half = half_dtype_name(plan)
    if plan.engine != "torch":
        return DtypeLayout(half, half, None)
    if plan.method is Method.FULL:
        return DtypeLayout("float32", "float32", half)
    return DtypeLayout(half, "float32", half)


def lora_target_names(spec: ModelSpec, plan: Plan) -> list[str]:
    """The Linear layers LoRA adapts, named as PEFT matches them (suffixes of module names)."""
    return [
        n for n, _, _, part in spec.linears()
        if plan.lora_targets is LoraTargets.ALL_LINEAR or part == "attention"
    ]


def lora_kwargs(spec: ModelSpec, plan: Plan) -> dict[str, Any]:
    """``peft.LoraConfig`` keyword arguments: alpha = 2·rank, no dropout, no bias training."""
    return {
        "r": plan.lora_rank,
        "lora_alpha": 2 * plan.lora_rank,
        "lora_dropout": 0.0,
        "target_modules": lora_target_names(spec, plan),
        "bias": "none",
    }

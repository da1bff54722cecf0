"""techniques: the one dtype rule every part of autofit reads, and the LoRA target rule."""

import pytest

from autofit.plan import LoraTargets, Method, Plan
from autofit.specs import MODELS
from autofit.techniques import DTYPE_BYTES, dtype_layout, lora_target_names

F32, BF16, F16 = "float32", "bfloat16", "float16"


# (precision, sharding, method) -> base, adapter, autocast, compute, trainable, master, moments
@pytest.mark.parametrize(
    "precision,sharding,method,expected",
    [
        ("32-true", "none", "full", (F32, F32, None, F32, F32, None, F32)),
        ("32-true", "zero2", "lora", (F32, F32, None, F32, F32, None, F32)),
        ("bf16-true", "none", "full", (BF16, BF16, None, BF16, BF16, None, BF16)),  # bf16 moments too
        ("bf16-true", "fsdp", "lora", (BF16, BF16, None, BF16, BF16, None, BF16)),
        ("bf16-true", "zero2", "full", (BF16, BF16, None, BF16, BF16, F32, F32)),  # DeepSpeed: fp32 master + states
        # plain torch: fp32 weights under autocast; LoRA/QLoRA: 16-bit base, fp32 adapters
        ("bf16-mixed", "none", "full", (F32, F32, BF16, BF16, F32, None, F32)),
        ("fp16-mixed", "none", "full", (F32, F32, F16, F16, F32, None, F32)),
        ("bf16-mixed", "none", "lora", (BF16, F32, BF16, BF16, F32, None, F32)),
        ("fp16-mixed", "none", "qlora", (F16, F32, F16, F16, F32, None, F32)),
        # DeepSpeed casts the module to 16-bit and keeps an fp32 master copy
        ("bf16-mixed", "zero2", "full", (BF16, BF16, None, BF16, BF16, F32, F32)),
        ("fp16-mixed", "zero3", "lora", (F16, F16, None, F16, F16, F32, F32)),
        # FSDP2 computes on 16-bit gathers of fp32 shards
        ("bf16-mixed", "fsdp", "full", (BF16, BF16, None, BF16, F32, None, F32)),
        ("bf16-mixed", "fsdp", "qlora", (BF16, BF16, None, BF16, F32, None, F32)),
    ],
)
def test_dtype_layout(precision, sharding, method, expected):
    plan = Plan(
        method=method,
        precision=precision,
        sharding=sharding,
        lora_rank=None if method == "full" else 8,
        offload="optimizer" if sharding == "fsdp" else "none",
    )
    lay = dtype_layout(plan)
    assert (lay.base, lay.adapter, lay.autocast, lay.compute, lay.trainable, lay.master, lay.moments) == expected
    assert lay.grads == lay.trainable
    assert lay.half == (F16 if precision == "fp16-mixed" else BF16)
    assert lay.autocasts is (lay.autocast is not None)
    assert (lay.base_bytes, lay.compute_bytes) == (DTYPE_BYTES[lay.base], DTYPE_BYTES[lay.compute])


def test_lora_targets_name_the_linears_peft_adapts():
    m = MODELS["llama-2-7b"]
    attention = Plan(method=Method.LORA, lora_rank=8, lora_targets=LoraTargets.ATTENTION)
    assert lora_target_names(m, attention) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    every = Plan(method=Method.LORA, lora_rank=8)
    assert lora_target_names(m, every) == [n for n, _, _, _ in m.linears()]
    assert lora_target_names(MODELS["gpt2"], attention) == ["c_attn", "attn.c_proj"]

"""How a plan's techniques are spelled in the libraries that run them. Imports without torch.

The runtime (which builds and steps models for the simulated and measured evaluators),
the cost models (which count the bytes) and the exporter (which writes the files a user
launches) all read these, so the training autofit estimates, simulates and measures is
the training the exported files ask for. Dtypes are torch attribute names
(``"bfloat16"``); the runtime turns them into dtypes, the cost models into bytes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from autofit.plan import Attention, Checkpointing, Method, Plan, Precision
from autofit.specs import ModelSpec

# transformers' ``attn_implementation`` for each attention kernel
ATTN_IMPL = {Attention.EAGER: "eager", Attention.SDPA: "sdpa", Attention.FLASH2: "flash_attention_2"}

# QLoRA's base weights: bitsandbytes NF4 with double quantization (the QLoRA paper's setting)
NF4_QUANT_TYPE = "nf4"
NF4_DOUBLE_QUANT = True
# lora-8bit's base weights: bitsandbytes LLM.int8 with transformers' BitsAndBytesConfig default
# outlier threshold (llm_int8_threshold): input columns holding a value at or above it run in 16-bit
INT8_THRESHOLD = 6.0


# Liger's kernel switches (``liger_kernel_config``, the keyword arguments of
# ``_apply_liger_kernel_to_instance``): the loss where the plan fuses it, RoPE, RMSNorm and
# SwiGLU where it fuses the block's kernels (``Family.fused_kernels``; the memory model
# assumes the model's own ops otherwise). Which families Liger patches at all is ``Family.liger``.
def liger_config(plan: Plan) -> dict[str, bool]:
    kernels = plan.fused_kernels
    return {
        "fused_linear_cross_entropy": plan.fused_loss,
        "cross_entropy": False,
        "rope": kernels,
        "rms_norm": kernels,
        "layer_norm": False,
        "swiglu": kernels,
        "geglu": False,
    }


def checkpointed_layers(plan: Plan, num_layers: int) -> tuple[bool, ...]:
    """Which decoder layers activation checkpointing recomputes: all (full, and op-level
    selective, which recomputes part of each), none, or every ``checkpoint_every``-th counting
    from one (torchtitan's layer-selective rule in ``torchtitan/distributed/activation_checkpoint.py``
    before it kept only the op-level one: layers k-1, 2k-1, ...)."""
    if all_checkpointed(plan):
        return (True,) * num_layers
    if plan.checkpointing is Checkpointing.SELECTIVE and plan.checkpoint_every:
        return tuple((i + 1) % plan.checkpoint_every == 0 for i in range(num_layers))
    return (False,) * num_layers


def all_checkpointed(plan: Plan) -> bool:
    """Every block is checkpointed: full, or op-level selective checkpointing."""
    return plan.checkpointing is Checkpointing.FULL or (
        plan.checkpointing is Checkpointing.SELECTIVE and plan.checkpoint_ops
    )


# Op-level selective checkpointing (``Plan.checkpoint_ops``), torchtitan's ``SelectiveAC``
# (torchtitan/distributed/activation_checkpoint.py, ``_get_default_save_ops`` and
# ``wrapped_policy``): every block runs under ``torch.utils.checkpoint`` with
# ``create_selective_checkpoint_contexts``, whose policy saves the outputs of the
# compute-intensive ops and recomputes every other op in backward, except every second
# ``mm``/``linear`` of a block's forward (counted afresh each forward), which is recomputed too.
# The saved ops, by aten name: torch's partitioner list (``get_default_op_list().compute_intensive_ops``,
# read at run time by ``runtime.op_checkpoint_contexts``) and torchtitan's additions that a
# transformers block can issue. One addition of ours: the CPU's flash kernel, the same op as
# CUDA's on another device (torchtitan never runs on the CPU), so a CPU run saves what a GPU's does.
# The FlashAttention-2 package's ops (flash_attn 2.6+ registers them with torch) are saved for
# the same reason: transformers' flash_attention_2 runs them where torchtitan runs sdpa.
SAC_SAVED_OPS = (
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_fused_attention_overrideable",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten.linear",
    "aten.topk",
    "aten.max",
    "flash_attn._flash_attn_forward",
    "flash_attn._flash_attn_varlen_forward",
)
SAC_COUNTED_OPS = ("aten.mm", "aten.linear")  # every second one of these a block's forward issues is recomputed


# bytes per element, and the short names GPU peak tables and kernel rules use
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SHORT_NAME = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


# -- precision ---------------------------------------------------------------------------
@dataclass(frozen=True)
class DtypeLayout:
    """Every dtype of a plan's training, the one rule all of autofit reads.

    The first four say how one process builds and runs the module: ``base`` the weights
    as loaded (the frozen base under LoRA/QLoRA, every weight in full fine-tuning; the
    residual stream starts in it), ``adapter`` the LoRA adapters, ``autocast`` the
    ``torch.autocast`` dtype (None: no autocast), ``compute`` what matmuls read and write,
    ``half`` the plan's 16-bit dtype (QLoRA computes and stores its packed weights in it).

    The last four say how the engine keeps the trainable state, which can differ from
    the module: ``trainable`` the trainable parameters (FSDP2 keeps fp32 shards of a
    module it gathers in 16-bit), ``grads`` their gradients, ``master`` DeepSpeed's fp32
    copy beside 16-bit parameters (None: none), ``moments`` the optimizer's states.
    """

    base: str
    adapter: str
    autocast: str | None
    compute: str
    half: str
    trainable: str
    grads: str
    master: str | None
    moments: str

    @property
    def autocasts(self) -> bool:
        return self.autocast is not None

    @property
    def base_bytes(self) -> int:
        return DTYPE_BYTES[self.base]

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.compute]


def dtype_layout(plan: Plan) -> DtypeLayout:
    """The dtypes of ``plan``; see :class:`DtypeLayout`. They depend on its precision, whether it
    trains every weight, and its engine alone: one layout each (an analytic estimate asks 16 times)."""
    return _dtype_layout(plan.precision, plan.method is Method.FULL, plan.engine)


@functools.cache
def _dtype_layout(precision: Precision, full: bool, engine: str) -> DtypeLayout:
    """:func:`dtype_layout` of a plan of ``precision``, full fine-tuning or not, on ``engine``.

    In the module: ``32-true`` is fp32 everything, ``bf16-true`` bf16 everything (moments
    too). Mixed precision on plain torch keeps fp32 weights under autocast for full
    fine-tuning, and for LoRA/QLoRA a 16-bit frozen base with fp32 adapters (PEFT's
    ``autocast_adapter_dtype``), also under autocast. Under DeepSpeed or FSDP2 the module
    computes on 16-bit parameters (DeepSpeed casts the module; FSDP2's
    MixedPrecisionPolicy gathers in 16-bit) and the engine keeps the fp32 copies: the
    master weights (DeepSpeed) or the sharded parameters themselves (FSDP2).
    """
    fp32 = precision is Precision.FP32
    mixed = precision in (Precision.BF16_MIXED, Precision.FP16_MIXED)
    half = "float16" if precision is Precision.FP16_MIXED else "bfloat16"
    if fp32:
        base = adapter = "float32"
    elif precision is Precision.BF16_TRUE:
        base = adapter = "bfloat16"
    elif engine != "torch":
        base = adapter = half
    else:
        base, adapter = ("float32" if full else half), "float32"
    autocast = half if mixed and engine == "torch" else None
    # trainable state: fp32 in full precision, and in mixed precision wherever the engine
    # is not DeepSpeed (which keeps 16-bit parameters and a separate fp32 master copy)
    trainable = "float32" if fp32 or (mixed and engine != "deepspeed") else half
    wide = trainable == "float32"
    deepspeed = engine == "deepspeed"
    return DtypeLayout(
        base=base,
        adapter=adapter,
        autocast=autocast,
        compute=autocast or base,
        half=half,
        trainable=trainable,
        grads=trainable,
        master="float32" if deepspeed and not wide else None,
        moments="float32" if deepspeed or wide else trainable,
    )


# -- LoRA --------------------------------------------------------------------------------
def model_notes(spec: ModelSpec, plan: Plan) -> dict[str, str]:
    """What a result on an MoE model states beside its figures (``TrialResult.extra``): the
    routing it assumes, and for 8- or 4-bit base weights that bitsandbytes replaces only
    ``nn.Linear`` layers, so transformers 5's fused 3-D experts stay in 16-bit
    (``transformers.integrations.bitsandbytes.replace_with_bnb_linear``; bitsandbytes issue
    #1849): QLoRA saves the attention's weights, not the experts'."""
    # a model type no family describes: how it was read and itemized
    notes = {"block": spec.derivation} if spec.derived else {}
    if spec.mixer_assumption:  # its Mamba or delta-rule mixers, estimated as their torch code runs
        notes["mixer"] = spec.mixer_assumption
    if not spec.has_experts:
        return notes
    notes["routing"] = spec.routing_assumption
    if plan.quantized:
        experts = sum(
            n * k.num_experts * 3 * k.hidden_size * k.expert_width for n, k in spec.layer_kinds() if k.family.moe
        )
        notes["note"] = (
            f"bitsandbytes quantizes nn.Linear layers only: the {experts / 1e9:.1f}B expert parameters stay 16-bit "
            f"under {plan.method.value} (transformers 5 keeps them as fused 3-D tensors; bitsandbytes issue #1849)"
        )
    return notes


def lora_target_names(spec: ModelSpec, plan: Plan) -> list[str]:
    """The Linear layers LoRA adapts, named as PEFT matches them (suffixes of module names).

    A registered MoE block's shared-expert MLP is named with its module (``shared_expert.gate_proj``):
    PEFT 0.22 rewrites a Qwen2-MoE target that is or ends in ``.gate_proj``/``.up_proj``/``.down_proj``
    into LoRA on every routed expert's fused 3-D weights as well, unless no routed expert's parameter
    ends in the rewritten name (``peft.utils.transformers_weight_conversion._convert_peft_config_moe``).
    The qualified name still matches the one Linear it means, under every PEFT version.
    """
    shared = {spec.family.mlp_out, *spec.family.mlp_in} if spec.family.moe and not spec.derived else set()
    return [
        f"shared_expert.{n}" if n in shared else n for n, _, _, part in spec.linears() if plan.lora_targets.covers(part)
    ]


def lora_kwargs(spec: ModelSpec, plan: Plan) -> dict[str, Any]:
    """``peft.LoraConfig`` keyword arguments: alpha = 2·rank, the plan's dropout, no bias training, and
    for a causal LM its task (``get_peft_model`` then gives a ``PeftModelForCausalLM``, what the Trainer
    and generation expect; peft has no masked-LM task, so BERT's adapters stay a plain ``PeftModel``)."""
    kwargs: dict[str, Any] = {"task_type": "CAUSAL_LM"} if spec.family.task == "causal-lm" else {}
    return {
        **kwargs,
        "r": plan.lora_rank,
        "lora_alpha": 2 * plan.lora_rank,
        "lora_dropout": plan.lora_dropout,
        "target_modules": lora_target_names(spec, plan),
        "bias": "none",
    }


# -- DeepSpeed ---------------------------------------------------------------------------
def deepspeed_buckets(model: ModelSpec) -> dict[str, int]:
    """Concrete bucket sizes (elements) autofit writes into ds_config.json and the memory model counts.

    Follows the rules transformers' DeepSpeed integration applies to ``"auto"``:
    reduce bucket = hidden², stage-3 prefetch = 0.9·hidden², persistence = 10·hidden.
    """
    h = model.hidden_size
    return {
        "reduce_bucket_size": h * h,
        "allgather_bucket_size": h * h,
        "stage3_prefetch_bucket_size": int(0.9 * h * h),
        "stage3_param_persistence_threshold": 10 * h,
        "stage3_max_live_parameters": 10**9,
        "stage3_max_reuse_distance": 10**9,
        "sub_group_size": 10**9,  # DeepSpeed's default, written out: ZeRO-3 steps this many elements at a time
    }

"""Plan: one combination of memory techniques, and the rules that say which combine.

A :class:`Plan` is frozen and carries no model or cluster; :func:`plan_problems` checks
it against a model, a cluster and a workload and returns *every* problem, each naming
its fix; :func:`validate_plan` raises them together in one :class:`PlanError` (the
torchtune habit). ``plan_id`` is a stable hash of the canonical form, so the same plan
gets the same id in every study and database.

Imports without torch.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from autofit.errors import PlanError
from autofit.specs import ClusterSpec, ModelSpec, Workload


class _Choice(str, Enum):
    def __str__(self) -> str:  # click and f-strings show the value
        return self.value

    @classmethod
    def values(cls) -> list[str]:
        return [m.value for m in cls]

    @classmethod
    def aliases(cls) -> dict[str, str]:
        """The names the tools people come from give the members (:data:`ALIASES`), alias → value."""
        return ALIASES.get(cls, {})

    @classmethod
    def _missing_(cls, value: object) -> _Choice | None:
        """A value in any case, with ``_`` for ``-``, or another tool's name for it:
        ``Attention("flash_attention_2")`` is ``Attention.FLASH2``. Everything that reads a plan
        field (CLI, study files, stored plans) goes through here."""
        if not isinstance(value, str):
            return None
        key = value.strip().lower()
        for candidate in (key, key.replace("_", "-")):
            canonical = candidate if candidate in cls._value2member_map_ else cls.aliases().get(candidate)
            if canonical is not None:
                return cls._value2member_map_[canonical]
        return None

    @classmethod
    def choices_text(cls) -> str:
        """``eager, sdpa, flash2 (also flash_attention_2)``: what an error lists."""
        text = ", ".join(cls.values())
        return f"{text} (also {', '.join(cls.aliases())})" if cls.aliases() else text


class Method(_Choice):
    FULL = "full"
    LORA = "lora"
    QLORA = "qlora"  # 4-bit NF4 base weights (bitsandbytes) + LoRA adapters
    LORA_8BIT = "lora-8bit"  # LLM.int8 base weights (bitsandbytes Linear8bitLt) + LoRA adapters


class LoraTargets(_Choice):
    ALL_LINEAR = "all-linear"  # every projection of every block (QLoRA paper default)
    ATTENTION = "attention"  # q, k, v, o only

    def covers(self, part: str) -> bool:
        """Whether LoRA adapts a Linear of this ``part`` (``ModelSpec.linears``: "attention", "mlp", or
        "frozen": one no target reaches, ``specs/derive.py``)."""
        return part == "attention" or (self is LoraTargets.ALL_LINEAR and part == "mlp")


class Precision(_Choice):
    FP32 = "32-true"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "fp16-mixed"
    BF16_TRUE = "bf16-true"


class Optimizer(_Choice):
    ADAMW = "adamw"
    ADAMW_8BIT = "adamw-8bit"
    PAGED_ADAMW_8BIT = "paged-adamw-8bit"
    ADAFACTOR = "adafactor"
    SGD = "sgd"


class Checkpointing(_Choice):
    NONE = "none"
    FULL = "full"  # every block recomputed in backward; only block inputs are kept
    # every k-th block (``Plan.checkpoint_every``) recomputed, the others keep their saves
    # (torchtitan's layer-selective activation checkpointing, ``selective_ac_option = k``)
    SELECTIVE = "selective"


DEFAULT_CHECKPOINT_EVERY = 2  # selective checkpointing's default: every second block


class Attention(_Choice):
    EAGER = "eager"
    SDPA = "sdpa"
    FLASH2 = "flash2"


class Sharding(_Choice):
    NONE = "none"  # one GPU, or DDP over several
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"
    FSDP = "fsdp"  # FSDP2, full sharding


class Offload(_Choice):
    NONE = "none"
    OPTIMIZER = "optimizer"
    OPTIMIZER_PARAMS = "optimizer+params"


class OffloadDevice(_Choice):
    CPU = "cpu"
    NVME = "nvme"


# The names the tools people come from give the same choices: transformers' attn_implementation, the
# Trainer's OptimizerNames (``transformers.training_args``), accelerate's --mixed_precision. A value with
# ``_`` for ``-`` is accepted besides (``paged_adamw_8bit``); these are the names that differ.
ALIASES: dict[type[_Choice], dict[str, str]] = {
    Attention: {"flash_attention_2": "flash2"},
    Optimizer: {
        "adamw_torch": "adamw",
        "adamw_torch_fused": "adamw",
        "adamw_bnb_8bit": "adamw-8bit",
        "adamw_8bit": "adamw-8bit",
        "paged_adamw_8bit": "paged-adamw-8bit",
    },
    Precision: {"bf16": "bf16-mixed", "fp16": "fp16-mixed", "no": "32-true", "fp32": "32-true"},
}

_ENUM_FIELDS: dict[str, type[_Choice]] = {
    "method": Method,
    "lora_targets": LoraTargets,
    "precision": Precision,
    "optimizer": Optimizer,
    "checkpointing": Checkpointing,
    "attention": Attention,
    "sharding": Sharding,
    "offload": Offload,
    "offload_device": OffloadDevice,
}


@dataclass(frozen=True)
class Plan:
    """One technique combination. Strings are accepted for every enum field."""

    method: Method = Method.FULL
    lora_rank: int | None = None
    lora_targets: LoraTargets = LoraTargets.ALL_LINEAR
    # dropout on each adapter's input (peft ``LoraConfig.lora_dropout``; peft's default 0.0). A
    # training choice the user makes, never searched: above 0 every adapted Linear keeps its own
    # dropped copy of its input and a mask for backward (peft ``lora.Linear.forward``)
    lora_dropout: float = 0.0
    precision: Precision = Precision.BF16_MIXED
    optimizer: Optimizer = Optimizer.ADAMW
    micro_batch: int = 1
    grad_accum: int = 1
    checkpointing: Checkpointing = Checkpointing.NONE
    # selective checkpointing's policy, one of two: its period (blocks k-1, 2k-1, ... are
    # checkpointed; techniques.checkpointed_layers), or op-level (every block checkpointed, the
    # outputs of its matmuls and attention kernels saved: torchtitan's SelectiveAC; techniques.SAC_*)
    checkpoint_every: int | None = None
    checkpoint_ops: bool = False
    attention: Attention = Attention.SDPA
    sharding: Sharding = Sharding.NONE
    offload: Offload = Offload.NONE
    offload_device: OffloadDevice = OffloadDevice.CPU
    packing: bool = False
    fused_loss: bool = False
    # saved activations to host memory in forward, back in backward (torchtune's
    # OffloadActivations rules; autofit.evaluators.offload)
    offload_activations: bool = False
    # each parameter's optimizer step runs as soon as its gradient is accumulated, which is
    # then freed (torchtune's optimizer_in_bwd; runtime.BackwardOptimizer)
    optimizer_in_backward: bool = False
    # Liger's fused RMSNorm, SwiGLU and RoPE kernels in every block (the Trainer's
    # use_liger_kernel; autofit.evaluators.fused stands in for them off CUDA)
    fused_kernels: bool = False
    # torch.compile of every decoder block with inductor (accelerate's regional compilation, the
    # Trainer's torch_compile; autofit.evaluators.compiled stands in for it on fake tensors)
    torch_compile: bool = False
    # ranks that split each sequence (context parallelism: torch's ring attention over FSDP2,
    # accelerate's ParallelismConfig(cp_size=N)); the data-parallel ranks are world / N
    context_parallel: int = 1

    def __post_init__(self) -> None:
        problems = []
        for name, enum in _ENUM_FIELDS.items():
            value = getattr(self, name)
            if isinstance(value, enum):
                continue
            try:
                object.__setattr__(self, name, enum(value))
            except ValueError:
                problems.append(f"{name} must be one of {enum.choices_text()}, got {value!r}")
        for name in ("micro_batch", "grad_accum", "context_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        k = self.checkpoint_every
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 2):
            problems.append(f"checkpoint_every must be an integer of at least 2, got {k!r}")
        if self.lora_rank is not None and (
            not isinstance(self.lora_rank, int) or isinstance(self.lora_rank, bool) or self.lora_rank < 1
        ):
            problems.append(f"lora_rank must be a positive integer, got {self.lora_rank!r}")
        d = self.lora_dropout
        if isinstance(d, (int, float)) and not isinstance(d, bool) and 0.0 <= d < 1.0:
            object.__setattr__(self, "lora_dropout", float(d))
        else:
            problems.append(f"lora_dropout must be a number in [0, 1), got {d!r}")
        for name in (
            "packing",
            "fused_loss",
            "offload_activations",
            "optimizer_in_backward",
            "fused_kernels",
            "torch_compile",
            "checkpoint_ops",
        ):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be true or false, got {getattr(self, name)!r}")
        if problems:
            raise PlanError(problems)

    # -- derived ----------------------------------------------------------------------
    @property
    def is_peft(self) -> bool:
        return self.method in (Method.LORA, Method.QLORA, Method.LORA_8BIT)

    @property
    def quantized(self) -> bool:
        """Whether the frozen base weights are bitsandbytes-quantized (4-bit or 8-bit)."""
        return self.method in (Method.QLORA, Method.LORA_8BIT)

    @functools.cached_property  # a frozen plan's: asked for hundreds of times an estimate
    def engine(self) -> str:
        """What runs the plan: plain torch (one GPU or DDP), DeepSpeed, or FSDP2."""
        if self.sharding in (Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3):
            return "deepspeed"
        if self.sharding is Sharding.FSDP:
            return "fsdp"
        return "torch"

    def data_parallel(self, world: int) -> int:
        """Ranks that train on different sequences: the world over the context-parallel group."""
        return max(1, world // self.context_parallel)

    @property
    def zero_stage(self) -> int:
        return {Sharding.ZERO1: 1, Sharding.ZERO2: 2, Sharding.ZERO3: 3}.get(self.sharding, 0)

    def as_dict(self) -> dict[str, Any]:
        d = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        for name, default in _LATER_FIELDS.items():  # so plans stored before them keep their ids
            if d[name] == default:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError([f"unknown plan field {k!r} (known: {', '.join(sorted(known))})" for k in unknown])
        return cls(**dict(data))

    @functools.cached_property  # a frozen plan's: the store and the search ask for it again and again
    def plan_id(self) -> str:
        blob = json.dumps(self.as_dict(), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def replace(self, **changes: Any) -> Plan:
        return dataclasses.replace(self, **changes)

    def summary(self) -> str:
        """One line a person can read: ``lora r16 · bf16-mixed · adamw · mb2×ga8 · ckpt · sdpa``."""
        parts = [f"{self.method.value} r{self.lora_rank}" if self.is_peft else self.method.value]
        if self.is_peft and self.lora_targets is not LoraTargets.ALL_LINEAR:
            parts[-1] += f" ({self.lora_targets.value})"
        if self.lora_dropout:
            parts[-1] += f" dropout {self.lora_dropout:g}"
        parts += [self.precision.value, self.optimizer.value, f"mb{self.micro_batch}×ga{self.grad_accum}"]
        if self.checkpointing is Checkpointing.FULL:
            parts.append("ckpt")
        elif self.checkpointing is Checkpointing.SELECTIVE:
            parts.append("ckpt ops" if self.checkpoint_ops else f"ckpt 1/{self.checkpoint_every}")
        parts.append(self.attention.value)
        if self.sharding is not Sharding.NONE:
            shard = self.sharding.value
            if self.offload is not Offload.NONE:
                shard += f"+offload({self.offload.value}→{self.offload_device.value})"
            parts.append(shard)
        if self.context_parallel > 1:
            parts.append(f"cp{self.context_parallel}")
        if self.packing:
            parts.append("packed")
        if self.fused_loss:
            parts.append("fused-loss")
        if self.fused_kernels:
            parts.append("fused-kernels")
        if self.torch_compile:
            parts.append("compiled")
        if self.offload_activations:
            parts.append("act-offload")
        if self.optimizer_in_backward:
            parts.append("opt-in-bwd")
        return " · ".join(parts)


# fields added after plans were first stored: left out of the canonical form (and so of
# ``plan_id``) while they hold their default
_LATER_FIELDS = {
    "checkpoint_every": None,
    "lora_dropout": 0.0,
    "offload_activations": False,
    "optimizer_in_backward": False,
    "fused_kernels": False,
    "checkpoint_ops": False,
    "context_parallel": 1,
    "torch_compile": False,
}


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


_EIGHT_BIT = (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT)


def _quantized_problems(plan: Plan, model: ModelSpec) -> list[str]:
    """Why the plan's 8- or 4-bit base weights cannot run the model."""
    p: list[str] = []
    if plan.quantized and model.uncalled_linears:
        p.append(
            f"{model.model_type}'s blocks read {', '.join(model.uncalled_linears)}'s weight themselves, not through "
            f"the Linear: bitsandbytes' {'4' if plan.method is Method.QLORA else '8'}-bit codes fail there (the real "
            "step raises); use lora or full"
        )
    if plan.method is Method.LORA_8BIT and plan.sharding in (Sharding.ZERO3, Sharding.FSDP):
        # Linear8bitLt keeps its int8 weight and row scales in its MatmulLtState as well as in the
        # parameter (bitsandbytes nn/modules.py, init_8bit_state), so neither engine can shard them;
        # transformers documents 8-bit loading with neither (QLoRA shards through bnb_4bit_quant_storage)
        p.append(
            f"lora-8bit cannot shard its 8-bit weights with {plan.sharding.value} (bitsandbytes' Linear8bitLt keeps "
            "them outside the parameter): use zero2 or none, or qlora with zero3/fsdp"
        )
    return p


def plan_problems(plan: Plan, model: ModelSpec, cluster: ClusterSpec, workload: Workload) -> list[str]:
    """Every reason ``plan`` cannot run ``model`` on ``cluster`` for ``workload``, with fixes."""
    p: list[str] = []
    gpu = cluster.gpu
    world = cluster.world_size
    half = plan.precision is not Precision.FP32

    # LoRA
    if plan.is_peft and plan.lora_rank is None:
        p.append(f"method {plan.method.value} needs a LoRA rank (--lora-rank, e.g. 16)")
    if not plan.is_peft and plan.lora_rank is not None:
        p.append("--lora-rank applies only to the LoRA methods (lora, lora-8bit, qlora); drop it or pick one")
    if not plan.is_peft and plan.lora_dropout:
        p.append("--lora-dropout applies only to the LoRA methods (lora, lora-8bit, qlora); drop it or pick one")
    if plan.method is Method.QLORA and not half:
        p.append("qlora computes in 16-bit: use precision bf16-mixed, fp16-mixed or bf16-true, not 32-true")
    p += _quantized_problems(plan, model)

    # precision and kernels against the GPU
    if plan.precision in (Precision.BF16_MIXED, Precision.BF16_TRUE) and not gpu.supports_bf16:
        p.append(
            f"{plan.precision.value} needs bf16 (compute capability 8.0+); {gpu.name} has "
            f"{gpu.compute_capability[0]}.{gpu.compute_capability[1]}: use fp16-mixed"
        )
    if plan.attention.value not in model.family.attn_impls:
        p.append(
            f"{model.model_type} models do not implement {plan.attention.value} attention; "
            f"use one of {', '.join(model.family.attn_impls)}"
        )
    if plan.attention is Attention.FLASH2:
        if not gpu.supports_flash2:
            p.append(f"flash2 needs compute capability 8.0+; {gpu.name} lacks it: use sdpa")
        if not half:
            p.append("flash2 runs in 16-bit only: use a bf16/fp16 precision or sdpa attention")
        if model.head_dim > 256:
            p.append(f"flash2 supports head_dim up to 256, {model.name} has {model.head_dim}: use sdpa")
    if plan.packing and plan.attention is not Attention.FLASH2:
        p.append(
            "packing needs flash2 attention (padding-free batches keep sequences apart only with "
            "flash2's variable-length kernel); use --attention flash2 or --no-packing"
        )

    p += _batch_problems(plan, model, world, workload)

    # sharding and offload
    if world == 1 and plan.sharding is not Sharding.NONE and plan.offload is Offload.NONE:
        p.append(
            f"{plan.sharding.value} on a single GPU divides nothing; use sharding none, "
            "or add offload (zero2/zero3/fsdp with offload fits bigger models on one GPU)"
        )
    p += _offload_problems(plan)
    if plan.optimizer_in_backward:
        p += _in_backward_problems(plan, world)
    p += _checkpointing_problems(plan, model)
    if plan.fused_kernels and not model.family.fused_kernels:
        p.append(
            f"fused kernels (Liger's RMSNorm, SwiGLU and RoPE) replace a llama-like block; {model.model_type} "
            "models have another: drop --fused-kernels (--fused-loss fuses the loss alone)"
        )
    if plan.torch_compile:
        p += _compile_problems(plan)
        if model.has_experts and not experts_in_bf16(plan.precision, plan.method, plan.sharding):
            p.append(
                "--torch-compile is not modelled for MoE experts outside bf16 (the grouped GEMM's fake kernel "
                "takes bf16 only, and AOTAutograd traces through it): use bf16-true, or bf16-mixed with LoRA "
                "or sharding"
            )
    if plan.optimizer in _EIGHT_BIT and plan.sharding in (Sharding.ZERO3, Sharding.FSDP):
        p.append(
            f"{plan.optimizer.value} (bitsandbytes) does not step on ZeRO-3/FSDP sharded parameters; "
            "use adamw, or sharding zero1/zero2"
        )
    return p


def _batch_problems(plan: Plan, model: ModelSpec, world: int, workload: Workload) -> list[str]:
    """The global batch over the data-parallel ranks, and each row over the context-parallel group."""
    p = []
    dp = plan.data_parallel(world)
    if plan.micro_batch * plan.grad_accum * dp != workload.global_batch:
        p.append(
            f"micro_batch × grad_accum × data-parallel ranks = {plan.micro_batch} × {plan.grad_accum} × "
            f"{dp} = {plan.micro_batch * plan.grad_accum * dp}, but the global batch is "
            f"{workload.global_batch}: pick a factorization of {workload.global_batch}"
        )
    if plan.context_parallel > 1:
        p += _context_parallel_problems(plan, model, world, workload)
    return p


def _context_parallel_problems(plan: Plan, model: ModelSpec, world: int, workload: Workload) -> list[str]:
    """Where torch's context parallelism runs as accelerate 1.16 and the Trainer launch it."""
    cp, p = plan.context_parallel, []
    if world % cp:
        p.append(f"context_parallel {cp} must divide the {world} GPUs (each rank holds 1/{cp} of every sequence)")
    if plan.sharding is not Sharding.FSDP:
        # accelerate.parallelism_config: cp_backend "torch" composes with FSDP2 only
        p.append("context parallelism runs on FSDP2 only (accelerate's ParallelismConfig): use --sharding fsdp")
    if plan.attention is not Attention.SDPA:
        # transformers Trainer._prepare_context_parallel_inputs refuses any other attention
        p.append("context parallelism runs sdpa attention only (torch's ring attention): use --attention sdpa")
    if model.family.task != "causal-lm":
        p.append(f"context parallelism's load balancing needs causal attention; {model.model_type} is not causal")
    elif model.context_parallel_refusal:
        # accelerate refuses what transformers' supports_context_parallel refuses (ModelSpec.context_parallel_refusal)
        p.append(
            f"context parallelism trains full causal attention only, and {model.name}: "
            f"{model.context_parallel_refusal}; drop --context-parallel"
        )
    if workload.seq_len % (2 * cp):
        # torch's round-robin load balancer cuts each sequence into 2 × cp chunks
        p.append(
            f"context parallelism {cp} cuts every sequence into {2 * cp} chunks: --seq-len must divide by {2 * cp}"
        )
    if workload.lengths is not None or plan.packing:
        # accelerate replaces the mask by is_causal in SDPA: padding and packed rows would attend across
        p.append(
            "context parallelism needs full-length rows (accelerate drops the attention mask for is_causal): "
            "give no --lengths, or drop --context-parallel"
        )
    if plan.fused_loss and not model.family.liger:
        # Liger's lce_forward takes the Trainer's shift_labels; autofit's chunked fallback does not
        p.append(
            f"--fused-loss with context parallelism needs Liger's kernel, which has none for {model.model_type}: "
            "drop one of them"
        )
    if plan.offload_activations:
        p.append("--offload-activations with context parallelism is not modelled: drop one of them")
    return p


def _checkpointing_problems(plan: Plan, model: ModelSpec) -> list[str]:
    """Selective checkpointing needs one policy (a period or op-level), and an engine that lets the
    model checkpoint its own layers."""
    k = plan.checkpoint_every
    if plan.checkpointing is not Checkpointing.SELECTIVE:
        flags = (("--checkpoint-every", k is not None), ("--checkpoint-ops", plan.checkpoint_ops))
        return [f"{f} applies only to --checkpointing selective; drop it" for f, on in flags if on]
    p = []
    if k is None and not plan.checkpoint_ops:
        p.append(
            "--checkpointing selective needs a policy: --checkpoint-every K (2: every second block) "
            "or --checkpoint-ops (save matmul and attention outputs, recompute the rest)"
        )
    elif k is not None and plan.checkpoint_ops:
        p.append("--checkpoint-every and --checkpoint-ops are two policies: give one")
    elif plan.checkpoint_ops:
        p += _op_checkpointing_problems(plan, model)
    elif k > model.num_layers:
        p.append(
            f"--checkpoint-every {k} is more than {model.name}'s {model.num_layers} blocks: no block is checkpointed"
        )
    if plan.sharding is Sharding.FSDP:
        p.append(
            "FSDP checkpoints every wrapped block itself (accelerate's fsdp_activation_checkpointing): "
            "use --checkpointing full with fsdp, or zero3 for selective checkpointing"
        )
    return p


def _op_checkpointing_problems(plan: Plan, model: ModelSpec) -> list[str]:
    """What op-level checkpointing is not modelled with (the estimators would guess)."""
    p = []
    if model.has_experts:
        # the experts' GEMMs (torch._grouped_mm, or one mm per expert off CUDA) depend on the routing
        p.append(
            f"--checkpoint-ops is not modelled for mixture-of-experts blocks ({model.model_type}): "
            "use --checkpoint-every K or --checkpointing full"
        )
    if model.analytic_gap:
        # the analytic walk of what the policy saves (analytic.sac_saves) reads the block's formulas
        p.append(
            f"--checkpoint-ops walks the block formulas, which do not describe {model.model_type}'s block "
            f"({model.analytic_gap}): use --checkpoint-every K or --checkpointing full"
        )
    if plan.offload_activations:
        # op-level checkpointing's saved outputs are held by its dispatch mode, not by autograd's
        # saved-tensor hooks, so activation offload would move only the block inputs
        p.append(
            "--checkpoint-ops keeps its saved outputs on the GPU: use --checkpointing full with --offload-activations"
        )
    return p


def experts_in_bf16(precision: Precision, method: Method, sharding: Sharding) -> bool:
    """Whether a model's weights, an MoE block's experts among them, are bf16 as the module runs
    (``techniques.dtype_layout``'s ``base``): bf16-true, or bf16-mixed where the module holds
    16-bit weights (LoRA's frozen base; DeepSpeed's and FSDP2's module)."""
    if precision is Precision.BF16_TRUE:
        return True
    return precision is Precision.BF16_MIXED and (sharding is not Sharding.NONE or method is not Method.FULL)


def _compile_problems(plan: Plan) -> list[str]:
    """What torch.compile of the blocks is not modelled with (evaluators/compiled.py runs AOTAutograd
    on the block: bitsandbytes' quantized parameters do not survive its functionalization, and
    Liger's stand-ins, offload hooks, op-level policies and the ring have not been traced through it)."""
    others = {
        "4-bit base weights (qlora)": plan.method is Method.QLORA,
        "8-bit base weights (lora-8bit)": plan.method is Method.LORA_8BIT,
        "--fused-kernels": plan.fused_kernels,
        "--offload-activations": plan.offload_activations,
        "op-level checkpointing": plan.checkpoint_ops,
        "--context-parallel": plan.context_parallel > 1,
    }
    return [f"--torch-compile is not modelled with {what}; drop one of the two" for what, on in others.items() if on]


def _offload_problems(plan: Plan) -> list[str]:
    """Where the plan's offload cannot go: the engines and optimizers that can offload."""
    p: list[str] = []
    if plan.offload is not Offload.NONE:
        if plan.sharding not in (Sharding.ZERO2, Sharding.ZERO3, Sharding.FSDP):
            p.append("offload needs sharding zero2, zero3 or fsdp")
        if plan.offload is Offload.OPTIMIZER_PARAMS and plan.sharding is Sharding.ZERO2:
            p.append("offloading parameters needs zero3 or fsdp (zero2 offloads only the optimizer)")
        if plan.sharding is Sharding.FSDP and plan.offload is Offload.OPTIMIZER:
            p.append("FSDP offloads parameters, gradients and optimizer together: use offload optimizer+params")
        if plan.offload_device is OffloadDevice.NVME and plan.sharding is not Sharding.ZERO3:
            p.append("NVMe offload (ZeRO-Infinity) needs zero3; use offload device cpu")
        if plan.optimizer in _EIGHT_BIT:
            p.append(f"{plan.optimizer.value} keeps its states on the GPU and cannot be offloaded; use adamw")
        elif plan.engine == "deepspeed" and plan.optimizer is not Optimizer.ADAMW:
            p.append(
                f"DeepSpeed offload runs only Adam-family optimizers on the CPU; use adamw, not {plan.optimizer.value}"
            )
    elif plan.offload_device is not OffloadDevice.CPU:
        p.append("--offload-device applies only with an offload; drop it")
    return p


def _in_backward_problems(plan: Plan, world: int) -> list[str]:
    """Where a step fused into backward cannot run: torchtune's single-device rule (no
    gradient accumulation, no clipping, one process) and no engine that steps itself."""
    p = []
    if plan.grad_accum != 1:
        p.append(
            f"optimizer in backward steps each parameter once its gradient is made, so it cannot accumulate "
            f"{plan.grad_accum} micro-batches: use grad_accum 1 (a micro-batch of the whole per-GPU batch)"
        )
    if world > 1 or plan.engine != "torch":
        p.append("optimizer in backward runs on one GPU without sharding or offload (torchtune's single-device recipe)")
    if plan.precision is Precision.FP16_MIXED:
        p.append(
            "optimizer in backward would step on fp16's loss-scaled gradients (the scaler unscales them only "
            "after backward): use bf16-mixed or bf16-true"
        )
    return p


def validate_plan(plan: Plan, model: ModelSpec, cluster: ClusterSpec, workload: Workload) -> Plan:
    problems = plan_problems(plan, model, cluster, workload)
    if problems:
        raise PlanError(problems)
    return plan


def workload_warnings(model: ModelSpec, workload: Workload) -> list[str]:
    """Things that are allowed but probably not meant."""
    w = []
    if workload.seq_len > model.max_position_embeddings:
        w.append(
            f"--seq-len {workload.seq_len} is beyond {model.name}'s {model.max_position_embeddings} "
            "positions; the model was not trained for it"
        )
    return w


# -- how simple a plan is -------------------------------------------------------------------------
# The answer of a study is the simplest plan among those the time model cannot tell apart from
# the fastest (``autofit.results.ranked``); these say what "simplest" means and what differs.
_SHARDING_RANK = {Sharding.NONE: 0, Sharding.ZERO1: 1, Sharding.ZERO2: 2, Sharding.FSDP: 3, Sharding.ZERO3: 4}
_OFFLOAD_RANK = {Offload.NONE: 0, Offload.OPTIMIZER: 1, Offload.OPTIMIZER_PARAMS: 2}


def moving_parts(plan: Plan) -> tuple[str, ...]:
    """The techniques a plan adds to plain training besides sharding and offload, each one
    more thing to install, configure or debug: LoRA (QLoRA counts twice: 4-bit weights too),
    gradient checkpointing, flash2 attention, a fused loss, fused kernels, packing, activation
    offload, the optimizer in backward, an 8-bit optimizer
    (paged counts twice). Precision and the attention kernels torch ships are not parts."""
    parts: list[str] = []
    if plan.is_peft:
        parts.append(plan.method.value)
    if plan.method is Method.QLORA:
        parts.append("4-bit base weights")
    if plan.method is Method.LORA_8BIT:
        parts.append("8-bit base weights")
    if plan.checkpointing is not Checkpointing.NONE:
        parts.append("gradient checkpointing")
    if plan.attention is Attention.FLASH2:
        parts.append("flash2 attention")
    if plan.fused_loss:
        parts.append("fused loss")
    if plan.fused_kernels:
        parts.append("fused kernels")
    if plan.torch_compile:
        parts.append("torch.compile")
    if plan.packing:
        parts.append("packing")
    if plan.offload_activations:
        parts.append("activation offload")
    if plan.optimizer_in_backward:
        parts.append("optimizer in backward")
    if plan.optimizer in _EIGHT_BIT:
        parts.append("8-bit optimizer")
    if plan.optimizer is Optimizer.PAGED_ADAMW_8BIT:
        parts.append("paged optimizer")
    return tuple(parts)


def complexity(plan: Plan) -> tuple[int, int, int, int]:
    """How much a plan asks of the person who runs it; smaller is simpler, compared in order:

    1. offload: none, the optimizer, optimizer and parameters (host memory, CPU Adam, pinned
       buffers), NVMe above CPU;
    2. sharding: plain torch (one GPU, or DDP), ZeRO-1, ZeRO-2, FSDP, ZeRO-3: no DeepSpeed where
       plain training or DDP does, and the less sharded the better;
    3. the number of :func:`moving_parts` (LoRA, checkpointing, flash2, fused loss, ...);
    4. the larger micro-batch (fewer accumulation steps for the same global batch).

    The order does not depend on the number of GPUs: on one GPU a ZeRO stage only carries an
    offload, on several it is a moving part still, and a plan that needs it to fit has no
    simpler rival anyway (only fitting plans are ranked).
    """
    offload = _OFFLOAD_RANK[plan.offload]
    if plan.offload is not Offload.NONE and plan.offload_device is OffloadDevice.NVME:
        offload += 1
    return (offload, _SHARDING_RANK[plan.sharding], len(moving_parts(plan)), -plan.micro_batch)


def plan_changes(base: Plan, other: Plan) -> tuple[str, ...]:
    """What ``other`` does differently from ``base``, one technique a line, as ``"sharding none →
    zero2"`` (the labels of the report's technique effects); micro-batch and accumulation as one."""
    out: list[str] = []
    if (base.method, base.lora_rank) != (other.method, other.lora_rank):
        out.append(f"method {_method_label(base)} → {_method_label(other)}")
    if _checkpointing_label(base) != _checkpointing_label(other):
        out.append(f"checkpointing {_checkpointing_label(base)} → {_checkpointing_label(other)}")
    for name in ("lora_targets", "lora_dropout", "precision", "optimizer", "attention", "sharding"):
        a, b = getattr(base, name), getattr(other, name)
        if a != b and not (name.startswith("lora_") and not (base.is_peft and other.is_peft)):
            out.append(f"{name.replace('_', ' ')} {_plain(a)} → {_plain(b)}")
    if (base.offload, base.offload_device) != (other.offload, other.offload_device):
        out.append(f"offload {_offload_label(base)} → {_offload_label(other)}")
    toggles = (
        ("fused_loss", "fused loss"),
        ("fused_kernels", "fused kernels"),
        ("torch_compile", "torch.compile"),
        ("packing", "packing"),
        ("offload_activations", "activation offload"),
        ("optimizer_in_backward", "optimizer in backward"),
    )
    for name, label in toggles:
        a, b = getattr(base, name), getattr(other, name)
        if a != b:
            out.append(f"{label} {'on' if a else 'off'} → {'on' if b else 'off'}")
    if (base.micro_batch, base.grad_accum) != (other.micro_batch, other.grad_accum):
        out.append(f"mb{base.micro_batch}×ga{base.grad_accum} → mb{other.micro_batch}×ga{other.grad_accum}")
    return tuple(out)


def _checkpointing_label(plan: Plan) -> str:
    if plan.checkpointing is not Checkpointing.SELECTIVE:
        return plan.checkpointing.value
    return plan.checkpointing.value + (" (ops)" if plan.checkpoint_ops else f" (every {plan.checkpoint_every})")


def _method_label(plan: Plan) -> str:
    return f"{plan.method.value} r{plan.lora_rank}" if plan.is_peft else plan.method.value


def _offload_label(plan: Plan) -> str:
    return "none" if plan.offload is Offload.NONE else f"{plan.offload.value}→{plan.offload_device.value}"

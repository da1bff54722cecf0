"""``trainer_args.json``: the training script's side of the plan, as keyword arguments.

``training_arguments`` for ``transformers.TrainingArguments``, ``model_kwargs`` for
``from_pretrained``, ``peft`` for ``peft.LoraConfig``, ``quantization`` for
``transformers.BitsAndBytesConfig``; ``data`` and ``fused_loss`` say how batches and the
loss must be built for the memory the plan was judged by. LoRA and dtype choices come from
``autofit.techniques``, the module the runtime builds its models with.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from autofit.export.common import DS_CONFIG_NAME, checked, hyperparameters
from autofit.plan import Checkpointing, Method, Offload, Optimizer, Plan, Precision
from autofit.specs import ModelSpec, Target
from autofit.techniques import (
    ATTN_IMPL,
    INT8_THRESHOLD,
    NF4_DOUBLE_QUANT,
    NF4_QUANT_TYPE,
    checkpointed_layers,
    dtype_layout,
    liger_config,
    lora_kwargs,
)

# TrainingArguments.optim for each optimizer (transformers' OptimizerNames values)
OPTIM_NAME = {
    Optimizer.ADAMW: "adamw_torch_fused",
    Optimizer.ADAMW_8BIT: "adamw_bnb_8bit",
    Optimizer.PAGED_ADAMW_8BIT: "paged_adamw_8bit",
    Optimizer.ADAFACTOR: "adafactor",
    Optimizer.SGD: "sgd",
}


def trainer_args(plan: Plan, ctx: Target, *, deepspeed_config_file: str = DS_CONFIG_NAME) -> dict[str, Any]:
    """Everything the training script needs besides the launch config, JSON-serialisable."""
    checked(plan, ctx)
    hp = hyperparameters(plan)
    lay = dtype_layout(plan)
    ta: dict[str, Any] = {
        "per_device_train_batch_size": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "learning_rate": hp.learning_rate,
        "adam_beta1": hp.adam_beta1,
        "adam_beta2": hp.adam_beta2,
        "adam_epsilon": hp.adam_epsilon,
        "weight_decay": hp.weight_decay,
        "max_grad_norm": hp.max_grad_norm,
        "optim": OPTIM_NAME[plan.optimizer],
        # DeepSpeed takes bf16 for bf16-true as well (fp32 master weights); elsewhere
        # bf16-true means a bf16 model without autocast
        "bf16": plan.precision is Precision.BF16_MIXED
        or (plan.precision is Precision.BF16_TRUE and plan.engine == "deepspeed"),
        "fp16": plan.precision is Precision.FP16_MIXED,
    }
    notes = _full_checkpointing(ta, plan)
    if plan.engine == "deepspeed":
        ta["deepspeed"] = deepspeed_config_file
        if plan.optimizer is Optimizer.ADAMW:
            notes.append(
                "DeepSpeed builds the optimizer from ds_config.json ("
                + ("DeepSpeedCPUAdam on the offloaded states" if plan.offload is not Offload.NONE else "torch AdamW")
                + "); optim is not used"
            )

    if plan.context_parallel > 1:
        notes.append(
            f"context parallelism: accelerate_config.yaml's parallelism_config splits every row over "
            f"{plan.context_parallel} ranks (cp_size); the Trainer runs each step in "
            "accelerator.maybe_context_parallel and shifts the labels itself"
        )
    if plan.torch_compile:
        ta["torch_compile"] = True
        notes.append(
            "torch.compile: accelerate_config.yaml's dynamo_config compiles every decoder block with inductor "
            "(regional compilation); the first steps compile, which their step times include"
        )
    if plan.optimizer_in_backward:  # each gradient is stepped and freed inside backward
        ta["max_grad_norm"] = 0.0
    liger = plan.fused_loss and ctx.model.family.liger
    if liger or plan.fused_kernels:  # Family.fused_kernels implies Family.liger (plan_problems)
        ta["use_liger_kernel"] = True
        ta["liger_kernel_config"] = liger_config(plan)

    result: dict[str, Any] = {
        "model": model_reference(ctx.model)[0],
        "training_arguments": ta,
        "model_kwargs": {"attn_implementation": ATTN_IMPL[plan.attention], "dtype": lay.base},
        "peft": None,
        "peft_model_kwargs": None,
        "quantization": None,
        "data": _data(plan, ctx),
        "fused_loss": _fused_loss(plan, liger),
        "fused_kernels": _fused_kernels(plan),
        "selective_checkpointing": _selective_checkpointing(plan, ctx),
        "activation_offloading": _activation_offloading(plan),
        "optimizer_in_backward": _optimizer_in_backward(plan),
    }
    if plan.is_peft:
        result["peft"] = lora_kwargs(ctx.model, plan)
        # fp32 adapters where the memory model keeps the trainable state in fp32: full
        # precision, or mixed precision outside DeepSpeed (which casts the whole module to 16-bit)
        result["peft_model_kwargs"] = {"autocast_adapter_dtype": lay.trainable == "float32"}
    if plan.quantized:
        result["quantization"] = quantization_kwargs(plan)
        notes.append(
            "load with quantization_config=BitsAndBytesConfig(**quantization) and skip "
            "peft.prepare_model_for_kbit_training: it upcasts the unquantized layers to fp32, "
            "which the plan's memory does not include"
        )
    result["notes"] = notes
    return result


# the folder of the export that carries a model config given as a loose file
MODEL_DIR = "model"


def model_reference(spec: ModelSpec) -> tuple[str, dict[str, str]]:
    """What ``from_pretrained`` loads, and the files the export must carry for it.

    A registered name or a hub id: the hub id. A local ``config.json``: its folder, absolute
    (where the weights usually are). Any other config file: ``model/config.json`` inside the
    export, a folder ``from_pretrained`` reads (weights absent: train.py says how to point it at
    them), named relative to the export.
    """
    source = spec.source or spec.name
    path = Path(source)
    if not (source.endswith(".json") and path.is_file()):
        return source, {}
    if path.name == "config.json":
        return str(path.resolve().parent), {}
    return MODEL_DIR, {f"{MODEL_DIR}/config.json": path.read_text(encoding="utf-8")}


# transformers 5.23.0 renamed TrainingArguments' gradient_checkpointing(_kwargs) to
# activation_checkpointing(_kwargs), keeping the old pair as deprecated aliases to be removed in v6
# (training_args.py; checked in the released wheels: 5.22.2 has only the old names, 5.23.0 both)
_CHECKPOINTING_RENAMED = (5, 23)


def _full_checkpointing(ta: dict[str, Any], plan: Plan) -> list[str]:
    """Every block checkpointed: the Trainer's switch, or FSDP's own (accelerate_config.yaml); the notes."""
    ckpt, fsdp = plan.checkpointing is Checkpointing.FULL, plan.engine == "fsdp"
    flag, kwargs = checkpointing_names()
    ta[flag] = ckpt and not fsdp
    if ckpt and fsdp:
        return [
            "activation checkpointing is FSDP's (fsdp_activation_checkpointing in "
            f"accelerate_config.yaml); keep {flag} off"
        ]
    if not ckpt:
        return []
    ta[kwargs] = {"use_reentrant": False}
    if flag != "activation_checkpointing":
        return []
    return [
        "the TrainingArguments names activation_checkpointing(_kwargs) are this transformers'; "
        "versions before the rename call them gradient_checkpointing(_kwargs)"
    ]


@functools.cache
def checkpointing_names() -> tuple[str, str]:
    """The ``TrainingArguments`` fields of activation checkpointing in the installed transformers
    (read from its version: the export imports no transformers)."""
    from importlib.metadata import version

    from packaging.version import Version

    if Version(version("transformers")).release[:2] >= _CHECKPOINTING_RENAMED:
        return "activation_checkpointing", "activation_checkpointing_kwargs"
    return "gradient_checkpointing", "gradient_checkpointing_kwargs"


def quantization_kwargs(plan: Plan) -> dict[str, Any]:
    """``BitsAndBytesConfig`` for QLoRA (the runtime's NF4 double quantization) or lora-8bit
    (LLM.int8 with frozen int8 weights and its outlier threshold, ``techniques.INT8_THRESHOLD``).

    FSDP and ZeRO-3 shard only floating-point tensors, so there the packed 4-bit weights
    are stored in the compute dtype (same bytes, different element type).
    """
    if plan.method is Method.LORA_8BIT:
        return {"load_in_8bit": True, "llm_int8_threshold": INT8_THRESHOLD, "llm_int8_has_fp16_weight": False}
    half = dtype_layout(plan).half
    sharded = plan.engine == "fsdp" or plan.zero_stage == 3
    return {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": NF4_QUANT_TYPE,
        "bnb_4bit_use_double_quant": NF4_DOUBLE_QUANT,
        "bnb_4bit_compute_dtype": half,
        "bnb_4bit_quant_storage": half if sharded else "uint8",
    }


def _data(plan: Plan, ctx: Target) -> dict[str, Any]:
    if plan.packing:
        return {
            "max_length": ctx.workload.seq_len,
            "packing": True,
            # padding-free: a micro-batch becomes one row, sequences kept apart by
            # position ids restarting at 0 (flash-attention's variable-length kernel)
            "data_collator": "transformers.DataCollatorWithFlattening",
            "data_collator_kwargs": {"return_position_ids": True, "separator_id": -100},
        }
    if plan.context_parallel > 1:
        # every row padded to --seq-len, which the load balancer cuts into 2 x cp chunks; the mask is
        # dropped for is_causal, and right padding comes after every real token it could hide
        return {
            "max_length": ctx.workload.seq_len,
            "packing": False,
            "padding_side": "right",
            "data_collator": "transformers.DataCollatorForSeq2Seq",
            "data_collator_kwargs": {
                "padding": "max_length",
                "max_length": ctx.workload.seq_len,
                "label_pad_token_id": -100,
            },
        }
    return {
        "max_length": ctx.workload.seq_len,
        "packing": False,
        # each micro-batch padded to its longest sequence, padding labels ignored
        "data_collator": "transformers.DataCollatorForSeq2Seq",
        "data_collator_kwargs": {"padding": "longest", "label_pad_token_id": -100},
    }


def _no_switch(enabled: bool, helper: str, how: str, library: str) -> dict[str, Any]:
    """A technique Trainer and accelerate have no switch for: the autofit helper the measured
    runs use, and the lines a Trainer script needs."""
    return {"enabled": True, "helper": helper, "how": how, "library": library} if enabled else {"enabled": False}


def _selective_checkpointing(plan: Plan, ctx: Target) -> dict[str, Any]:
    """Every k-th block checkpointed: TrainingArguments' checkpointing flag would switch every block
    on in ``Trainer.train``, so it stays off and the script sets the blocks'
    ``GradientCheckpointingLayer.gradient_checkpointing`` flags itself. (transformers 5's
    ``every_n_layers`` checkpoints layers 0, k, 2k, ...; the plan's are k, 2k, ... counted from 1, as
    torchtitan counts them, and a different set where k does not divide the layers.)"""
    if plan.checkpointing is not Checkpointing.SELECTIVE:
        return {"enabled": False}
    k = plan.checkpoint_every
    flag, kwargs = checkpointing_names()
    if plan.checkpoint_ops:
        return _op_checkpointing(ctx, flag, kwargs)
    return {
        "enabled": True,
        "policy": "layers",
        "every": k,
        "layers": [i for i, on in enumerate(checkpointed_layers(plan, ctx.model.num_layers)) if on],
        "helper": "autofit.evaluators.runtime.enable_checkpointing",
        "how": f"before building the Trainer: `model.{flag}_enable({kwargs}="
        '{"use_reentrant": False})`, then `for i, layer in enumerate(model.model.layers): '
        f"layer.gradient_checkpointing = (i + 1) % {k} == 0` (keep {flag} off in "
        "TrainingArguments: Trainer.train would switch every block on)",
        "library": f"torchtitan's layer-selective activation checkpointing (selective_ac_option = {k})",
    }


def _op_checkpointing(ctx: Target, flag: str, kwargs: str) -> dict[str, Any]:
    """Every block checkpointed under torchtitan's op-level policy: its ``context_fn`` is a function,
    which TrainingArguments' JSON checkpointing kwargs cannot carry, so the script enables it."""
    return {
        "enabled": True,
        "policy": "ops",
        "layers": list(range(ctx.model.num_layers)),
        "helper": "autofit.evaluators.runtime.enable_checkpointing",
        "how": f"before building the Trainer: `model.{flag}_enable({kwargs}="
        '{"use_reentrant": False, "context_fn": autofit.evaluators.runtime.op_checkpoint_contexts})` '
        f"(keep {flag} off in TrainingArguments: Trainer.train would enable it again without the policy)",
        "library": "torchtitan's op-level selective activation checkpointing (SelectiveAC: "
        "torch.utils.checkpoint.create_selective_checkpoint_contexts saving matmul and attention outputs)",
    }


def _activation_offloading(plan: Plan) -> dict[str, Any]:
    return _no_switch(
        plan.offload_activations,
        "autofit.evaluators.offload.ActivationOffload",
        "in a Trainer subclass, build `offload = ActivationOffload(model)` and "
        "`offload.stop_at(model.get_output_embeddings())` once, then run the forward of "
        "compute_loss under `with offload:` (the loss stays on the GPU)",
        "the rules of torchtune's OffloadActivations (TRL: SFTConfig(activation_offloading=True), "
        "which also offloads the loss's tensors)",
    )


def _optimizer_in_backward(plan: Plan) -> dict[str, Any]:
    return _no_switch(
        plan.optimizer_in_backward,
        "autofit.evaluators.runtime.make_optimizer",
        "build the optimizer with `make_optimizer(plan, model)` (a BackwardOptimizer: each parameter "
        "steps in its gradient hook) and pass it as `Trainer(optimizers=(optimizer, None))` with "
        "max_grad_norm 0: the gradients are gone before clipping could see them",
        "torchtune's optimizer_in_bwd (create_optim_in_bwd_wrapper, register_optim_in_bwd_hooks)",
    )


def _fused_kernels(plan: Plan) -> dict[str, Any]:
    if not plan.fused_kernels:
        return {"enabled": False}
    return {
        "enabled": True,
        "kernels": "liger_kernel RMSNorm, SwiGLU and RoPE through use_liger_kernel (pip install liger-kernel; "
        "Triton on a GPU)",
        "fallback": "autofit.evaluators.fused.apply(model) (and fused.rope(model) around each training step) "
        "saves the same tensors with torch ops where Liger cannot run, without its speed",
    }


def _fused_loss(plan: Plan, liger: bool) -> dict[str, Any]:
    if not plan.fused_loss:
        return {"enabled": False}
    if liger:
        return {
            "enabled": True,
            "kernel": "liger_kernel fused_linear_cross_entropy (pip install liger-kernel; CUDA only)",
            "fallback": "autofit.evaluators.runtime.chunked_cross_entropy in a custom compute_loss "
            "gives the same memory where Liger cannot run",
        }
    return {
        "enabled": True,
        "kernel": None,
        "fallback": "Liger has no kernel for this model type: compute the loss with "
        "autofit.evaluators.runtime.chunked_cross_entropy in a custom compute_loss, "
        "or the full logits need more memory than the plan was judged by",
    }

"""``ds_config.json``: the DeepSpeed configuration of a ZeRO plan, with every number concrete.

No ``"auto"``: transformers would fill those in from whatever the training script passes,
and the bucket sizes, batch sizes and precision are exactly what autofit's memory model
assumed when it said the plan fits. The buckets come from ``techniques.deepspeed_buckets``,
the same function the memory model reads.
"""

from __future__ import annotations

from typing import Any

from autofit.errors import ExportError
from autofit.export.common import checked, hyperparameters
from autofit.plan import Offload, OffloadDevice, Optimizer, Plan, Precision
from autofit.specs import ModelSpec, Target
from autofit.techniques import deepspeed_buckets

# ZeRO-Infinity needs a directory on a local NVMe drive of the training machine, which
# autofit cannot know; the README of an export says to edit it (or pass nvme_path).
NVME_PATH = "/local_nvme"

# DeepSpeed's default NVMe parameter buffer (elements); it must hold the largest parameter.
_NVME_PARAM_BUFFER = 10**8


def deepspeed_config(plan: Plan, ctx: Target, *, nvme_path: str = NVME_PATH) -> dict[str, Any]:
    """The complete DeepSpeed config of ``plan`` on ``ctx``'s cluster (DeepSpeed plans only)."""
    if plan.engine != "deepspeed":
        raise ExportError(
            f"plan {plan.summary()!r} runs on {plan.engine}, not DeepSpeed: only sharding "
            "zero1/zero2/zero3 has a ds_config.json"
        )
    checked(plan, ctx)
    hp = hyperparameters(plan)
    cfg: dict[str, Any] = {
        "train_batch_size": plan.micro_batch * plan.grad_accum * ctx.cluster.world_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": hp.max_grad_norm,
    }
    cfg.update(_precision(plan))
    cfg["zero_optimization"] = _zero(plan, ctx.model, ctx.cluster.world_size, nvme_path)
    if plan.optimizer is Optimizer.ADAMW:
        params: dict[str, Any] = {
            "lr": hp.learning_rate,
            "betas": [hp.adam_beta1, hp.adam_beta2],
            "eps": hp.adam_epsilon,
            "weight_decay": hp.weight_decay,
        }
        if plan.offload is Offload.NONE:
            # torch's fused AdamW instead of DeepSpeed's FusedAdam: same states, one kernel,
            # no temporaries, and no CUDA extension to JIT-compile on the user's machine
            # (DeepSpeed passes "fused" on to torch.optim.AdamW: engine.py
            # get_optimizer_configuration; documented in DeepSpeed PR #8512). torch's default
            # foreach AdamW would add a 4-byte sqrt per element of the partition to the step's
            # peak (costs.zero_step_bytes). With offload DeepSpeed picks its CPU Adam
            # (torch_adam would override that choice).
            params["torch_adam"] = True
            params["fused"] = True
        cfg["optimizer"] = {"type": "AdamW", "params": params}
    else:
        # 8-bit (bitsandbytes), Adafactor and SGD are the training script's optimizer
        # (TrainingArguments.optim); ZeRO wraps it but asks for this flag first.
        cfg["zero_allow_untested_optimizer"] = True
    return cfg


def _precision(plan: Plan) -> dict[str, Any]:
    """bf16 or fp16 section. DeepSpeed keeps fp32 master weights and states for both 16-bit
    precisions, which is what the memory model assumes for bf16-true under DeepSpeed too."""
    if plan.precision in (Precision.BF16_MIXED, Precision.BF16_TRUE):
        return {"bf16": {"enabled": True}}
    if plan.precision is Precision.FP16_MIXED:
        return {
            "fp16": {
                "enabled": True,
                "loss_scale": 0,  # dynamic loss scaling
                "initial_scale_power": 16,
                "loss_scale_window": 1000,
                "hysteresis": 2,
                "min_loss_scale": 1,
            }
        }
    return {}


def _zero(plan: Plan, model: ModelSpec, world_size: int, nvme_path: str) -> dict[str, Any]:
    stage = plan.zero_stage
    buckets = deepspeed_buckets(model)
    z: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": True,  # double-buffered gradient bucket, as the memory model counts it
        "contiguous_gradients": True,
        "reduce_bucket_size": buckets["reduce_bucket_size"],
    }
    if stage < 3:
        z["allgather_bucket_size"] = buckets["allgather_bucket_size"]
    else:
        for key in (
            "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "stage3_max_live_parameters",
            "stage3_max_reuse_distance",
            "sub_group_size",
        ):
            z[key] = buckets[key]
        z["stage3_gather_16bit_weights_on_model_save"] = True
    nvme = plan.offload_device is OffloadDevice.NVME
    if plan.offload is not Offload.NONE:
        if nvme:
            z["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True, "buffer_count": 4}
        else:
            z["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if plan.offload is Offload.OPTIMIZER_PARAMS:
        if nvme:
            z["offload_param"] = {
                "device": "nvme",
                "nvme_path": nvme_path,
                "pin_memory": True,
                "buffer_count": 5,
                "buffer_size": nvme_param_buffer(model, world_size),
                "max_in_cpu": 10**9,
            }
        else:
            z["offload_param"] = {"device": "cpu", "pin_memory": True}
    return z


def nvme_param_buffer(model: ModelSpec, world_size: int) -> int:
    """Elements per NVMe parameter buffer. DeepSpeed swaps each rank's partition of a
    parameter through one buffer and refuses a partition larger than it (llama-3-70b's
    1.05e9-element embedding gives 1.3e8-element partitions on 8 GPUs: above the default)."""
    largest = model.largest_tensor()
    return max(_NVME_PARAM_BUFFER, -(-largest // world_size))

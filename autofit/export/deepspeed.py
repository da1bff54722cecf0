"""``ds_config.json``: the DeepSpeed configuration of a ZeRO plan.

What defines the plan is written out: the ZeRO stage, offload, bucket sizes (from
``techniques.deepspeed_buckets``, the function the memory model reads), the optimizer and its
kernel. What the Trainer owns is ``"auto"`` (:data:`TRAINER_OWNED`): batch sizes, clipping, the
optimizer's hyperparameters and bf16/fp16. transformers fills each from ``TrainingArguments``
(``HfTrainerDeepSpeedConfig.trainer_config_process``), so ``trainer_args.json`` is the one place
they are set and the two files cannot disagree; a concrete value there would make the Trainer
refuse to start once the user changes the learning rate in one file only. The export fills them
the same way and parses the result with DeepSpeed's own ``DeepSpeedConfig`` (:func:`validate`).
"""

from __future__ import annotations

import copy
from typing import Any

from autofit.errors import ExportError
from autofit.export.common import checked
from autofit.plan import Offload, OffloadDevice, Optimizer, Plan, Precision
from autofit.specs import ModelSpec, Target
from autofit.techniques import deepspeed_buckets

# ZeRO-Infinity needs a directory on a local NVMe drive of the training machine, which
# autofit cannot know; the README of an export says to edit it (or pass nvme_path).
NVME_PATH = "/local_nvme"

# DeepSpeed's default NVMe parameter buffer (elements); it must hold the largest parameter.
_NVME_PARAM_BUFFER = 10**8


AUTO = "auto"
# what transformers fills from TrainingArguments (HfTrainerDeepSpeedConfig.trainer_config_process),
# each with the trainer_args.json value it comes from (trainer_values)
TRAINER_OWNED = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "optimizer.params.lr",
    "optimizer.params.betas",
    "optimizer.params.eps",
    "optimizer.params.weight_decay",
    "fp16.enabled",
    "bf16.enabled",
)


def deepspeed_config(plan: Plan, ctx: Target, *, nvme_path: str = NVME_PATH) -> dict[str, Any]:
    """The complete DeepSpeed config of ``plan`` on ``ctx``'s cluster (DeepSpeed plans only)."""
    if plan.engine != "deepspeed":
        raise ExportError(
            f"plan {plan.summary()!r} runs on {plan.engine}, not DeepSpeed: only sharding "
            "zero1/zero2/zero3 has a ds_config.json"
        )
    checked(plan, ctx)
    cfg: dict[str, Any] = {
        "train_batch_size": AUTO,
        "train_micro_batch_size_per_gpu": AUTO,
        "gradient_accumulation_steps": AUTO,
        "gradient_clipping": AUTO,
    }
    cfg.update(_precision(plan))
    cfg["zero_optimization"] = _zero(plan, ctx.model, ctx.cluster.world_size, nvme_path)
    if plan.optimizer is Optimizer.ADAMW:
        params: dict[str, Any] = {"lr": AUTO, "betas": AUTO, "eps": AUTO, "weight_decay": AUTO}
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


def trainer_values(training_arguments: dict[str, Any], world_size: int) -> dict[str, Any]:
    """What the Trainer puts in place of each ``"auto"``, from ``trainer_args.json``'s
    ``training_arguments`` on ``world_size`` ranks: the rules of transformers'
    ``HfTrainerDeepSpeedConfig.trainer_config_process`` (a test holds the two together)."""
    ta = training_arguments
    mb, ga = ta["per_device_train_batch_size"], ta["gradient_accumulation_steps"]
    return {
        "train_batch_size": world_size * mb * ga,
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": ga,
        "gradient_clipping": ta["max_grad_norm"],
        "optimizer.params.lr": ta["learning_rate"],
        "optimizer.params.betas": [ta["adam_beta1"], ta["adam_beta2"]],
        "optimizer.params.eps": ta["adam_epsilon"],
        "optimizer.params.weight_decay": ta["weight_decay"],
        "fp16.enabled": ta["fp16"],
        "bf16.enabled": ta["bf16"],
    }


def filled(cfg: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``cfg`` with each ``"auto"`` at a dotted key of ``values`` replaced by its value."""
    out = copy.deepcopy(cfg)
    for key, value in values.items():
        *path, leaf = key.split(".")
        node = out
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(leaf) == AUTO:
            node[leaf] = value
    return out


def validate(cfg: dict[str, Any], training_arguments: dict[str, Any], world_size: int) -> None:
    """Raise ``ExportError`` unless DeepSpeed's own ``DeepSpeedConfig`` accepts ``cfg`` as the Trainer
    fills it. DeepSpeed reads the world size from a process group, which an export has not, and
    would take 1: the global batch (checked with the plan) is left for it to derive."""
    import contextlib
    import logging
    import sys

    # DeepSpeed's logger writes to the sys.stdout of its import (utils/logging.py), where --json
    # goes: imported here, it binds to stderr; imported before, only its level keeps stdout clean
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.runtime.config import DeepSpeedConfig

        logger = logging.getLogger("DeepSpeed")
        level = logger.level
        logger.setLevel(logging.ERROR)
        try:
            config = filled(cfg, trainer_values(training_arguments, world_size))
            config.pop("train_batch_size")
            DeepSpeedConfig(config)
        except Exception as exc:  # noqa: BLE001 - DeepSpeed raises assertions, pydantic and value errors
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and "errors.pydantic.dev" not in ln]
            raise ExportError(f"DeepSpeed refuses the exported ds_config.json: {' '.join(lines)}") from exc
        finally:
            logger.setLevel(level)


def _precision(plan: Plan) -> dict[str, Any]:
    """bf16 or fp16 section, enabled by the Trainer's bf16/fp16 (``"auto"``). DeepSpeed keeps fp32
    master weights and states for both 16-bit precisions, which is what the memory model assumes
    for bf16-true under DeepSpeed too."""
    if plan.precision in (Precision.BF16_MIXED, Precision.BF16_TRUE):
        return {"bf16": {"enabled": AUTO}}
    if plan.precision is Precision.FP16_MIXED:
        return {
            "fp16": {
                "enabled": AUTO,
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

"""``accelerate_config.yaml``: how ``accelerate launch`` starts the plan's processes.

Key names are those of accelerate's ``ClusterConfig`` and of the ``accelerate launch``
options its ``deepspeed_config`` / ``fsdp_config`` sections feed; the tests load every
exported file with accelerate's own loader and launch-argument processing.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from autofit.errors import ExportError
from autofit.export.common import checked, write_files
from autofit.plan import Checkpointing, Method, Offload, Plan, Precision
from autofit.specs import ModelSpec, Target

_MIXED_PRECISION = {
    Precision.BF16_MIXED: "bf16",
    Precision.FP16_MIXED: "fp16",
    Precision.FP32: "no",
    # bf16-true: the model is loaded in bf16 and trained without autocast or fp32 copies
    Precision.BF16_TRUE: "no",
}


def distributed_type(plan: Plan, ctx: Target) -> str:
    if plan.engine == "deepspeed":
        return "DEEPSPEED"
    if plan.engine == "fsdp":
        return "FSDP"
    return "MULTI_GPU" if ctx.cluster.world_size > 1 else "NO"


def accelerate_config(plan: Plan, ctx: Target, deepspeed_config_file: str | None = None) -> dict[str, Any]:
    """The accelerate config of ``plan``; DeepSpeed plans need the path of their ds_config.json.

    A relative ``deepspeed_config_file`` is read from the directory ``accelerate launch``
    runs in, so an export can be copied to the training machine as a whole.
    """
    checked(plan, ctx)
    kind = distributed_type(plan, ctx)
    if kind == "DEEPSPEED" and not deepspeed_config_file:
        raise ExportError("a DeepSpeed plan's accelerate config needs the path of its ds_config.json")
    if kind != "DEEPSPEED" and deepspeed_config_file:
        raise ExportError(f"plan {plan.summary()!r} does not run on DeepSpeed; it takes no ds_config.json")
    cluster = ctx.cluster
    cfg: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": kind,
        "num_processes": cluster.world_size,
        "num_machines": cluster.nodes,
        "machine_rank": 0,
        "gpu_ids": "all",
        "main_training_function": "main",
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
        "debug": False,
    }
    if cluster.nodes > 1:
        cfg["main_process_port"] = 29500
    if kind == "DEEPSPEED":
        # No mixed_precision here: accelerate refuses it next to a deepspeed_config_file
        # and takes the precision from the file's bf16/fp16 section.
        ds: dict[str, Any] = {
            "deepspeed_config_file": deepspeed_config_file,
            # ZeRO-3 partitions weights while from_pretrained loads them; transformers
            # skips that for 4-bit weights, which are partitioned at deepspeed.initialize.
            "zero3_init_flag": plan.zero_stage == 3 and plan.method is not Method.QLORA,
        }
        if cluster.nodes > 1:
            ds["deepspeed_multinode_launcher"] = "standard"
        cfg["deepspeed_config"] = ds
    else:
        cfg["mixed_precision"] = _MIXED_PRECISION[plan.precision]
    if kind == "FSDP":
        cfg["fsdp_config"] = fsdp_config(plan, ctx)
    if plan.context_parallel > 1:
        cfg["parallelism_config"] = parallelism_config(plan, ctx)
    if plan.torch_compile:
        # accelerate launch passes these on as ACCELERATE_DYNAMO_*; the Trainer's TorchDynamoPlugin reads
        # them, and prepare compiles each repeated block in place (utils.compile_regions and its FSDP2 and
        # DeepSpeed forms): what evaluators/compiled.py models
        cfg["dynamo_config"] = {"dynamo_backend": "INDUCTOR", "dynamo_use_regional_compilation": True}
    return cfg


def parallelism_config(plan: Plan, ctx: Target) -> dict[str, Any]:
    """accelerate's ``ParallelismConfig`` as ``accelerate launch`` reads it from the config file
    (keys of its ``--parallelism_config_*`` options; ``utils.launch.prepare_extend_env_parallelism_config``
    passes them on as ``PARALLELISM_CONFIG_*``): FSDP2 shards over the data-parallel ranks and the
    context-parallel group together; the ring exchanges keys and values by all-gather, the
    strategy the memory model reads (``evaluators/context.py``)."""
    cp = plan.context_parallel
    return {
        "parallelism_config_dp_replicate_size": 1,
        "parallelism_config_dp_shard_size": plan.data_parallel(ctx.cluster.world_size),
        "parallelism_config_tp_size": 1,
        "parallelism_config_cp_size": cp,
        "parallelism_config_cp_backend": "torch",
        "parallelism_config_cp_comm_strategy": "allgather",
    }


def fsdp_config(plan: Plan, ctx: Target) -> dict[str, Any]:
    """FSDP2, full sharding per decoder layer, as the memory model assumes: parameters
    resharded after forward (two layers gathered at a time), optional CPU offload of
    parameters, gradients and optimizer states, checkpointing of each wrapped layer
    (:func:`fsdp_wrap_classes`)."""
    qlora = plan.method is Method.QLORA
    return {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": fsdp_wrap_classes(ctx.model),
        "fsdp_reshard_after_forward": True,
        "fsdp_offload_params": plan.offload is not Offload.NONE,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        # rank 0 loads, the others receive shards; accelerate skips that broadcast for 4-bit
        # weights, so QLoRA loads on every rank
        "fsdp_cpu_ram_efficient_loading": not qlora,
        # FSDP checkpoints each wrapped layer itself; TrainingArguments.gradient_checkpointing
        # stays off (transformers refuses both at once)
        "fsdp_activation_checkpointing": plan.checkpointing is Checkpointing.FULL,
    }


def fsdp_wrap_classes(spec: ModelSpec) -> str:
    """The blocks FSDP wraps one by one, comma-separated: the ``_no_split_modules`` transformers
    gives the model (what accelerate itself wraps when none are named:
    ``FullyShardedDataParallelPlugin.set_auto_wrap_policy``), read without building it.

    ``PreTrainedModel.post_init`` makes a model's ``_no_split_modules`` its class's own joined with
    its children's, the base model's among them (modeling_utils.py); a test builds every family
    and compares. Reading the classes imports the model's transformers module, and torch: FSDP
    exports only. A model class that names none falls back to the family's ``decoder_layer``.
    """
    return ",".join(_no_split_modules(spec.model_type, spec.family.task)) or spec.family.decoder_layer


@functools.cache
def _no_split_modules(model_type: str, task: str) -> tuple[str, ...]:
    import transformers
    from transformers.models.auto import modeling_auto

    heads = (
        modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
        if task == "masked-lm"
        else modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    )
    names: set[str] = set()
    for mapping in (heads, modeling_auto.MODEL_MAPPING_NAMES):
        name = mapping.get(model_type)
        cls = getattr(transformers, name, None) if name else None
        names.update(getattr(cls, "_no_split_modules", None) or ())
    return tuple(sorted(names))


def accelerate_yaml(plan: Plan, ctx: Target, deepspeed_config_file: str | None = None) -> str:
    import yaml

    return yaml.safe_dump(accelerate_config(plan, ctx, deepspeed_config_file), sort_keys=True)


def write_accelerate_yaml(
    plan: Plan, ctx: Target, path: str | os.PathLike, deepspeed_config_file: str | None = None
) -> Path:
    """Write the accelerate config to ``path`` (atomically); returns the path."""
    path = Path(path)
    return write_files(path.parent, {path.name: accelerate_yaml(plan, ctx, deepspeed_config_file)})[0]

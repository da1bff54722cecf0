"""ds_config.json, read back by DeepSpeed's own config parser at the plan's world size."""

from __future__ import annotations

import json

import pytest

from autofit.errors import ExportError
from autofit.export import deepspeed_config, trainer_args
from autofit.export.deepspeed import NVME_PATH, TRAINER_OWNED, filled, nvme_param_buffer, trainer_values
from autofit.plan import Offload, OffloadDevice, Optimizer, Plan, Precision
from autofit.techniques import deepspeed_buckets
from tests.export.plans import TARGETS, sweep, target

_PRECISION = {  # (bf16 enabled, fp16 enabled) in DeepSpeed
    Precision.BF16_MIXED: (True, False),
    Precision.BF16_TRUE: (True, False),
    Precision.FP16_MIXED: (False, True),
    Precision.FP32: (False, False),
}


def _value(device) -> str:
    return getattr(device, "value", device)  # DeepSpeed stores the enum's value


def _auto_keys(value, prefix="") -> set[str]:
    if isinstance(value, dict):
        return {k for key, v in value.items() for k in _auto_keys(v, f"{prefix}{key}.")}
    return {prefix[:-1]} if value == "auto" else set()


def check(plan, ctx, cfg, parsed) -> None:
    """What the Trainer owns is "auto" and nothing else; filled as the Trainer fills it from
    trainer_args.json, every number DeepSpeed parsed is the plan's, and the buckets are the memory
    model's."""
    world = ctx.cluster.world_size
    assert _auto_keys(cfg) <= set(TRAINER_OWNED) and {"train_batch_size", "gradient_clipping"} <= _auto_keys(cfg)
    assert ("optimizer.params.lr" in _auto_keys(cfg)) is (plan.optimizer is Optimizer.ADAMW)
    assert json.loads(json.dumps(cfg)) == cfg  # plain JSON
    assert parsed.world_size == world
    assert parsed.train_batch_size == ctx.workload.global_batch
    assert parsed.train_micro_batch_size_per_gpu == plan.micro_batch
    assert parsed.gradient_accumulation_steps == plan.grad_accum
    assert parsed.gradient_clipping == 1.0
    assert parsed.zero_optimization_stage == plan.zero_stage
    assert (parsed.bfloat16_config.enabled, parsed.float16_config.enabled) == _PRECISION[plan.precision]

    z = parsed.zero_config
    buckets = deepspeed_buckets(ctx.model)
    assert z.reduce_bucket_size == buckets["reduce_bucket_size"]
    assert z.overlap_comm is True and z.contiguous_gradients is True
    if plan.zero_stage < 3:
        assert z.allgather_bucket_size == buckets["allgather_bucket_size"]
    else:
        assert z.prefetch_bucket_size == buckets["stage3_prefetch_bucket_size"]
        assert z.param_persistence_threshold == buckets["stage3_param_persistence_threshold"]
        assert z.max_live_parameters == buckets["stage3_max_live_parameters"]
        assert z.max_reuse_distance == buckets["stage3_max_reuse_distance"]
        assert z.sub_group_size == buckets["sub_group_size"]
        assert z.gather_16bit_weights_on_model_save is True

    device = plan.offload_device.value
    if plan.offload is Offload.NONE:
        assert z.offload_optimizer is None and z.offload_param is None
    else:
        assert _value(z.offload_optimizer.device) == device
        if plan.offload is Offload.OPTIMIZER_PARAMS:
            assert _value(z.offload_param.device) == device
        else:
            assert z.offload_param is None
        if plan.offload_device is OffloadDevice.NVME:
            assert str(z.offload_optimizer.nvme_path) == NVME_PATH

    if plan.optimizer is Optimizer.ADAMW:
        assert parsed.optimizer_name == "adamw"
        assert parsed.optimizer_params["lr"] == (2e-4 if plan.is_peft else 2e-5)
        # torch's fused AdamW on the GPU; with offload nothing may override DeepSpeed's CPU Adam
        assert parsed.optimizer_params.get("torch_adam", False) is (plan.offload is Offload.NONE)
        assert parsed.optimizer_params.get("fused", False) is (plan.offload is Offload.NONE)
    else:
        assert parsed.optimizer_name is None
        assert parsed.zero_allow_untested_optimizer is True


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_deepspeed_plan_parses_at_its_world_size(name, ds_parse):
    ctx = target(name)
    plans = [p for p in sweep(ctx) if p.engine == "deepspeed"]
    # gpt2 on one T4: only offloading stages; otherwise dozens of combinations
    assert len(plans) >= 20
    failures = []
    for plan in plans:
        cfg = deepspeed_config(plan, ctx)
        try:
            check(plan, ctx, cfg, ds_parse(trainer_filled(plan, ctx, cfg), ctx.cluster.world_size))
        except Exception as exc:  # collect them all: one line per failing plan
            failures.append(f"{plan.summary()}: {type(exc).__name__}: {exc}")
    assert not failures, "\n".join(failures[:20])


def trainer_filled(plan, ctx, cfg):
    """``cfg`` with its "auto" values as the Trainer fills them from the exported trainer_args.json."""
    ta = trainer_args(plan, ctx)["training_arguments"]
    return filled(cfg, trainer_values(ta, ctx.cluster.world_size))


def test_parser_rejects_what_a_wrong_export_would_contain(ds_parse):
    """The checks above can fail: DeepSpeed refuses a typo'd key and a batch that does not add up."""
    ctx = target("mistral-2xA10")
    plan = Plan(method="lora", lora_rank=16, micro_batch=2, grad_accum=4, sharding="zero2")
    cfg = trainer_filled(plan, ctx, deepspeed_config(plan, ctx))
    ds_parse(cfg, 2)
    with pytest.raises(AssertionError, match="train_batch_size"):
        ds_parse(cfg, 4)  # the same file on twice the GPUs
    typo = json.loads(json.dumps(cfg))
    typo["zero_optimization"]["reduce_bucket_sise"] = typo["zero_optimization"].pop("reduce_bucket_size")
    with pytest.raises(Exception, match="reduce_bucket_sise"):
        ds_parse(typo, 2)


def test_zero2_bf16_numbers():
    ctx = target("mistral-2xA10")
    plan = Plan(method="lora", lora_rank=16, micro_batch=1, grad_accum=8, sharding="zero2", checkpointing="full")
    cfg = deepspeed_config(plan, ctx)
    assert cfg["train_batch_size"] == "auto" and trainer_filled(plan, ctx, cfg)["train_batch_size"] == 16
    assert cfg["bf16"] == {"enabled": "auto"}
    assert "fp16" not in cfg
    assert cfg["zero_optimization"] == {
        "stage": 2,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 4096 * 4096,
        "allgather_bucket_size": 4096 * 4096,
    }
    assert cfg["optimizer"] == {
        "type": "AdamW",
        "params": {
            "lr": "auto",
            "betas": "auto",
            "eps": "auto",
            "weight_decay": "auto",
            "torch_adam": True,
            "fused": True,
        },
    }


def test_fp16_has_dynamic_loss_scaling_and_fp32_has_no_precision_section(ds_parse):
    ctx = target("llama2-4xV100")
    fp16 = Plan(precision="fp16-mixed", micro_batch=1, grad_accum=8, sharding="zero3", offload="optimizer")
    cfg = deepspeed_config(fp16, ctx)
    assert cfg["fp16"]["enabled"] == "auto" and cfg["fp16"]["loss_scale"] == 0
    parsed = ds_parse(trainer_filled(fp16, ctx, cfg), 4)
    assert parsed.float16_config.enabled and parsed.float16_config.initial_dynamic_scale() == 2**16
    fp32 = fp16.replace(precision="32-true")
    cfg = deepspeed_config(fp32, ctx)
    assert "fp16" not in cfg and "bf16" not in cfg


def test_client_optimizers_leave_the_optimizer_to_the_script():
    ctx = target("mistral-2xA10")
    for opt in ("adamw-8bit", "paged-adamw-8bit", "adafactor", "sgd"):
        cfg = deepspeed_config(Plan(optimizer=opt, micro_batch=1, grad_accum=8, sharding="zero1"), ctx)
        assert "optimizer" not in cfg
        assert cfg["zero_allow_untested_optimizer"] is True


def test_nvme_offload_buffers_hold_the_largest_parameter_partition(ds_parse):
    ctx = target("llama3-70b-2x8xH100")  # 16 GPUs
    plan = Plan(micro_batch=1, grad_accum=4, sharding="zero3", offload="optimizer+params", offload_device="nvme")
    cfg = deepspeed_config(plan, ctx, nvme_path="/mnt/nvme0")
    param = cfg["zero_optimization"]["offload_param"]
    assert param["nvme_path"] == "/mnt/nvme0"
    # 128256 × 8192 embedding over 16 ranks = 65,667,072 elements: under DeepSpeed's 1e8 default
    assert param["buffer_size"] == 10**8 == nvme_param_buffer(ctx.model, 16)
    assert nvme_param_buffer(ctx.model, 8) == 131_334_144  # 8 ranks: above it
    parsed = ds_parse(trainer_filled(plan, ctx, cfg), 16)
    assert parsed.zero_config.offload_param.buffer_size == 10**8


def test_the_export_is_validated_by_deepspeed_with_the_trainers_values(monkeypatch):
    """``export_files`` parses ds_config.json with DeepSpeed's DeepSpeedConfig, filled from the
    trainer_args.json it writes beside it; what DeepSpeed refuses is one ExportError."""
    import autofit.export as export
    from autofit.export.deepspeed import validate

    ctx = target("mistral-2xA10")
    plan = Plan(method="lora", lora_rank=16, micro_batch=2, grad_accum=4, sharding="zero3", offload="optimizer")
    ta = trainer_args(plan, ctx)["training_arguments"]
    validate(deepspeed_config(plan, ctx), ta, 2)
    validate(deepspeed_config(plan, ctx), {**ta, "learning_rate": 3e-5, "per_device_train_batch_size": 8}, 2)
    bad = deepspeed_config(plan, ctx)
    bad["zero_optimization"]["offload_optimizer"]["device"] = "gpu"
    with pytest.raises(ExportError, match="DeepSpeed refuses the exported ds_config.json.*offload_optimizer"):
        validate(bad, ta, 2)
    monkeypatch.setattr(export, "deepspeed_config", lambda plan, ctx, nvme_path: bad)
    with pytest.raises(ExportError, match="DeepSpeed refuses"):
        export.export_files(plan, ctx)


def test_non_deepspeed_plan_has_no_ds_config():
    ctx = target("mistral-2xA10")
    for sharding in ("none", "fsdp"):
        with pytest.raises(ExportError, match="not DeepSpeed"):
            deepspeed_config(Plan(micro_batch=1, grad_accum=8, sharding=sharding), ctx)

"""accelerate_config.yaml, read back by accelerate's loader, launch-argument processing and plugins.

Every swept config is parsed here; test_launch.py launches a DeepSpeed and an FSDP export for
real (on these CPU machines ``accelerate launch`` alone runs an FSDP config undistributed:
FIELD-NOTES; the exported train.py switches to FSDP as the measured runs do).
"""

from __future__ import annotations

import json

import pytest

from autofit.errors import ExportError
from autofit.export import accelerate_config, deepspeed_config, write_accelerate_yaml
from autofit.export.accelerate import fsdp_wrap_classes
from autofit.plan import Checkpointing, Method, Offload, Plan, Precision
from autofit.specs import FAMILIES, MODELS
from tests.export.plans import TARGETS, sweep, target

_MIXED = {Precision.BF16_MIXED: "bf16", Precision.FP16_MIXED: "fp16", Precision.FP32: "no", Precision.BF16_TRUE: "no"}
_KIND = {"deepspeed": "DEEPSPEED", "fsdp": "FSDP"}


def _export_to(tmp_path, plan, ctx):
    ds_file = None
    tmp_path.mkdir(parents=True, exist_ok=True)
    if plan.engine == "deepspeed":
        (tmp_path / "ds_config.json").write_text(json.dumps(deepspeed_config(plan, ctx)))
        ds_file = "ds_config.json"
    return write_accelerate_yaml(plan, ctx, tmp_path / "accelerate_config.yaml", ds_file)


def check(plan, ctx, launch, launched_env) -> None:
    world, nodes = ctx.cluster.world_size, ctx.cluster.nodes
    cfg, env = launch.config, launch.env
    assert launch.unknown_keys == []
    kind = _KIND.get(plan.engine, "MULTI_GPU" if world > 1 else "NO")
    assert cfg.distributed_type.value == kind
    assert (cfg.num_processes, cfg.num_machines, cfg.machine_rank) == (world, nodes, 0)
    assert launch.args.num_processes == world
    assert cfg.use_cpu is False
    if plan.engine == "deepspeed":
        # the precision lives in ds_config.json; accelerate refuses a second statement of it
        assert cfg.mixed_precision is None and env["ACCELERATE_MIXED_PRECISION"] == "no"
        assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
        assert env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == "ds_config.json"
        zero3_init = plan.zero_stage == 3 and plan.method is not Method.QLORA
        assert env["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == str(zero3_init).lower()
        launched_env(env)
        from accelerate.utils import DeepSpeedPlugin

        plugin = DeepSpeedPlugin()  # runs accelerate's checks against the JSON file
        assert plugin.zero_stage == plan.zero_stage
        assert plugin.gradient_accumulation_steps == "auto"  # the Trainer's: filled from trainer_args.json
        assert plugin.zero3_init_flag is zero3_init
        expected_device = plan.offload_device.value if plan.offload is not Offload.NONE else "none"
        assert plugin.offload_optimizer_device == expected_device
    else:
        assert cfg.mixed_precision == _MIXED[plan.precision] == env["ACCELERATE_MIXED_PRECISION"]
        assert cfg.deepspeed_config == {}
    if plan.engine == "fsdp":
        assert env["ACCELERATE_USE_FSDP"] == "true"
        launched_env(env)
        from accelerate.utils import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin()
        assert plugin.fsdp_version == 2
        assert plugin.transformer_cls_names_to_wrap == fsdp_wrap_classes(ctx.model).split(",")
        assert plugin.reshard_after_forward is True
        assert type(plugin.cpu_offload).__name__ == (
            "CPUOffloadPolicy" if plan.offload is not Offload.NONE else "OffloadPolicy"
        )
        assert plugin.activation_checkpointing is (plan.checkpointing is Checkpointing.FULL)
        assert plugin.cpu_ram_efficient_loading is (plan.method is not Method.QLORA)
        assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"
    else:
        assert cfg.fsdp_config == {}


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_plan_loads_and_launches_as_planned(name, tmp_path, accelerate_launch, launched_env):
    ctx = target(name)
    plans = list(sweep(ctx))
    assert len(plans) >= 40
    failures = []
    for i, plan in enumerate(plans):
        d = tmp_path / str(i)
        try:
            check(plan, ctx, accelerate_launch(_export_to(d, plan, ctx)), launched_env)
        except Exception as exc:
            failures.append(f"{plan.summary()}: {type(exc).__name__}: {exc}")
    assert not failures, "\n".join(failures[:20])


def test_accelerate_rejects_what_a_wrong_export_would_contain(tmp_path, accelerate_launch, launched_env):
    """The checks above can fail: an unknown key, and a mixed_precision beside the DeepSpeed file."""
    ctx = target("mistral-2xA10")
    plan = Plan(micro_batch=1, grad_accum=8, sharding="zero2", offload="optimizer")
    path = _export_to(tmp_path, plan, ctx)
    text = path.read_text()

    path.write_text(text + "num_procesess: 2\n")
    with pytest.raises(ValueError, match="unknown keys"):
        accelerate_launch(path)

    path.write_text(text.replace("  zero3_init_flag: false", "  zero3_init_flag: false\n  zero_stgae: 2"))
    assert accelerate_launch(path).unknown_keys == ["zero_stgae"]

    path.write_text(text + "mixed_precision: bf16\n")
    launch = accelerate_launch(path)
    launched_env(launch.env)
    from accelerate.utils import DeepSpeedPlugin

    with pytest.raises(ValueError, match="mixed_precision"):
        DeepSpeedPlugin()


def test_context_parallel_plan_launches_with_accelerates_parallelism_config(tmp_path, accelerate_launch, launched_env):
    """cp 2 on 4 GPUs: accelerate launch passes the sizes on, and accelerate's ParallelismConfig
    (as the Trainer's Accelerator builds it from the environment) splits the 4 ranks as planned."""
    from autofit.search.request import build_context

    ctx = build_context("llama-3.1-8b", "4xH100", seq_len=16384, global_batch=8)
    plan = Plan(micro_batch=1, grad_accum=4, sharding="fsdp", checkpointing="full", context_parallel=2)
    launch = accelerate_launch(_export_to(tmp_path, plan, ctx))
    check(plan, ctx, launch, launched_env)
    env = launch.env
    assert env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    assert (env["PARALLELISM_CONFIG_CP_SIZE"], env["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) == ("2", "2")
    assert env["PARALLELISM_CONFIG_CP_COMM_STRATEGY"] == "allgather"
    launched_env(env)
    from accelerate.parallelism_config import ParallelismConfig

    pc = ParallelismConfig()
    assert (pc.cp_size, pc.dp_shard_size, pc.total_size) == (2, 2, 4)
    assert pc.cp_enabled and pc.cp_handler.cp_comm_strategy == "allgather"
    assert "parallelism_config" not in accelerate_config(plan.replace(context_parallel=1, grad_accum=2), ctx)


def test_single_gpu_torch_plan_runs_undistributed():
    ctx = target("qwen2-1xA100")
    cfg = accelerate_config(Plan(method="lora", lora_rank=16, micro_batch=2, grad_accum=4), ctx)
    assert cfg["distributed_type"] == "NO"
    assert cfg["num_processes"] == 1
    assert cfg["mixed_precision"] == "bf16"
    assert "deepspeed_config" not in cfg and "fsdp_config" not in cfg


def test_two_nodes(tmp_path, accelerate_launch):
    ctx = target("llama3-70b-2x8xH100")
    plan = Plan(micro_batch=1, grad_accum=4, sharding="zero3", checkpointing="full")
    launch = accelerate_launch(_export_to(tmp_path, plan, ctx))
    assert (launch.config.num_processes, launch.config.num_machines) == (16, 2)
    assert launch.config.deepspeed_config["deepspeed_multinode_launcher"] == "standard"
    assert launch.config.main_process_port == 29500


def test_deepspeed_plan_needs_its_file_and_others_refuse_one():
    ctx = target("mistral-2xA10")
    with pytest.raises(ExportError, match="ds_config.json"):
        accelerate_config(Plan(micro_batch=1, grad_accum=8, sharding="zero2"), ctx)
    with pytest.raises(ExportError, match="does not run on DeepSpeed"):
        accelerate_config(Plan(micro_batch=1, grad_accum=8, sharding="fsdp"), ctx, "ds_config.json")


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_fsdp_wraps_each_familys_decoder_layer(model_type):
    """The wrap classes are what transformers itself says must not be split (the built model's
    ``_no_split_modules``, read by the export without building it), and the family's decoder layer,
    which the model repeats num_layers times, is among them."""
    import torch

    from autofit.evaluators.runtime import hf_model_class

    spec = next(m for m in MODELS.values() if m.model_type == model_type)
    spec = spec.variant(
        num_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=min(spec.num_kv_heads, 4) if spec.num_kv_heads < spec.num_heads else 4,
        head_dim=16,
        vocab_size=128,
        name=f"tiny-{model_type}",
    )
    cls = hf_model_class(spec)
    with torch.device("meta"):
        model = cls.from_config(spec.to_hf_config()) if cls.__name__.startswith("Auto") else cls(spec.to_hf_config())
    names = [type(m).__name__ for m in model.modules()]
    assert names.count(FAMILIES[model_type].decoder_layer) == 2
    assert set(fsdp_wrap_classes(spec).split(",")) == set(model._no_split_modules)
    assert FAMILIES[model_type].decoder_layer in model._no_split_modules


def test_compiled_plan_launches_with_regional_compilation(tmp_path, accelerate_launch, launched_env):
    """torch.compile of the blocks: accelerate launch hands inductor and regional compilation to the
    Trainer's TorchDynamoPlugin, which compiles block by block (what evaluators/compiled.py models)."""
    from autofit.search.request import build_context

    ctx = build_context("llama-3.1-8b", "2xH100", seq_len=4096, global_batch=4)
    plan = Plan(method="lora", lora_rank=16, micro_batch=1, grad_accum=2, sharding="fsdp").replace(torch_compile=True)
    launch = accelerate_launch(_export_to(tmp_path, plan, ctx))
    check(plan, ctx, launch, launched_env)
    env = launch.env
    assert env["ACCELERATE_DYNAMO_BACKEND"] == "INDUCTOR"
    assert env["ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"] == "True"
    launched_env(env)
    from accelerate.utils import TorchDynamoPlugin

    plugin = TorchDynamoPlugin(backend="inductor")  # as the Trainer builds it from torch_compile
    assert plugin.use_regional_compilation and plugin.backend.value == "INDUCTOR"
    assert "dynamo_config" not in accelerate_config(plan.replace(torch_compile=False), ctx)

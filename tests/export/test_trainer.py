"""trainer_args.json, constructed by transformers, PEFT and bitsandbytes, and checked against
ds_config.json and the runtime autofit measures with."""

from __future__ import annotations

import json

import pytest

from autofit.evaluators import runtime
from autofit.export import deepspeed_config, trainer_args
from autofit.export.deepspeed import filled, trainer_values
from autofit.plan import Checkpointing, Method, Optimizer, Plan, Precision
from autofit.techniques import dtype_layout
from tests.conftest import tiny
from tests.export.conftest import training_arguments_at
from tests.export.plans import TARGETS, sweep, target

# the optimizer class the Trainer builds for each plan optimizer (what the memory model assumed)
_OPTIMIZER_CLASS = {
    Optimizer.ADAMW: ("torch.optim.adamw", "AdamW"),
    Optimizer.ADAMW_8BIT: ("bitsandbytes.optim.adamw", "AdamW"),
    Optimizer.PAGED_ADAMW_8BIT: ("bitsandbytes.optim.adamw", "AdamW"),
    Optimizer.ADAFACTOR: ("transformers.optimization", "Adafactor"),
    Optimizer.SGD: ("torch.optim.sgd", "SGD"),
}


def _training_arguments(tmp_path, world, ta):
    """The exported kwargs with use_cpu, without which bf16/fp16 are refused on this machine,
    and without the DeepSpeed file, which is checked by transformers' own DeepSpeed step below."""
    kwargs = {k: v for k, v in ta.items() if k != "deepspeed"}
    return training_arguments_at(world)(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kwargs)


def check(plan, ctx, args, tmp_path, cache) -> None:
    import torch
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig, Trainer
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    assert json.loads(json.dumps(args)) == args
    ta = args["training_arguments"]
    world = ctx.cluster.world_size
    key = json.dumps([ta, world], sort_keys=True)
    if key not in cache:
        cache[key] = _training_arguments(tmp_path, world, ta)
    targs = cache[key]
    assert targs.per_device_train_batch_size * targs.gradient_accumulation_steps * world == ctx.workload.global_batch
    assert targs.gradient_checkpointing is (plan.checkpointing is Checkpointing.FULL and plan.engine != "fsdp")
    if targs.gradient_checkpointing:
        assert targs.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert targs.fp16 is (plan.precision is Precision.FP16_MIXED)

    if plan.engine == "deepspeed":
        assert ta["deepspeed"] == "ds_config.json"
        # transformers fills the "auto" values at the plan's world size: as autofit fills them
        cfg = deepspeed_config(plan, ctx)
        hf = HfTrainerDeepSpeedConfig(cfg)
        try:
            hf.trainer_config_process(targs)
            assert hf.mismatches == []
            assert hf.config == filled(cfg, trainer_values(ta, world))
        finally:
            unset_hf_deepspeed_config()
    if plan.engine != "deepspeed" or plan.optimizer is not Optimizer.ADAMW:
        cls, _ = Trainer.get_optimizer_cls_and_kwargs(targs)
        assert (cls.__module__, cls.__name__) == _OPTIMIZER_CLASS[plan.optimizer]

    lay = runtime.layout(plan)
    assert getattr(torch, args["model_kwargs"]["dtype"]) == lay.base_dtype
    assert args["model_kwargs"]["attn_implementation"] == runtime.ATTN_IMPL[plan.attention]

    if plan.is_peft:
        exported = LoraConfig(**args["peft"]).to_dict()
        assert exported == runtime.lora_config(ctx.model, plan).to_dict()
        # PEFT makes the adapters in the dtype the memory model counts for the trainable state
        fp32_adapters = dtype_layout(plan).trainable == "float32"
        assert args["peft_model_kwargs"] == {"autocast_adapter_dtype": fp32_adapters}
    else:
        assert args["peft"] is None and args["peft_model_kwargs"] is None
    if plan.method is Method.QLORA:
        bnb = BitsAndBytesConfig(**args["quantization"])
        assert bnb.load_in_4bit and bnb.bnb_4bit_quant_type == "nf4" and bnb.bnb_4bit_use_double_quant
        assert bnb.bnb_4bit_compute_dtype == runtime.half_dtype(plan)
        sharded = plan.engine == "fsdp" or plan.zero_stage == 3
        assert bnb.bnb_4bit_quant_storage == (runtime.half_dtype(plan) if sharded else torch.uint8)
    elif plan.method is Method.LORA_8BIT:  # the runtime's Linear8bitLt: frozen int8 weights, its threshold
        bnb = BitsAndBytesConfig(**args["quantization"])
        assert bnb.load_in_8bit and not bnb.load_in_4bit and not bnb.llm_int8_has_fp16_weight
        assert bnb.llm_int8_threshold == runtime.INT8_THRESHOLD
        assert plan.engine != "fsdp" and plan.zero_stage < 3
    else:
        assert args["quantization"] is None

    liger = (plan.fused_loss and ctx.model.family.liger) or plan.fused_kernels
    assert targs.use_liger_kernel is liger
    if liger:  # the switches the Trainer hands to _apply_liger_kernel_to_instance
        cfg = targs.liger_kernel_config
        assert cfg["fused_linear_cross_entropy"] is plan.fused_loss
        assert cfg["rope"] is cfg["rms_norm"] is cfg["swiglu"] is plan.fused_kernels
    assert args["fused_loss"]["enabled"] is plan.fused_loss
    assert args["fused_kernels"]["enabled"] is plan.fused_kernels
    sc = args["selective_checkpointing"]
    assert sc["enabled"] is (plan.checkpointing is Checkpointing.SELECTIVE)
    if sc["enabled"] and plan.checkpoint_ops:  # every block, under the op-level policy the script sets
        assert not targs.gradient_checkpointing and sc["policy"] == "ops"
        assert sc["layers"] == list(range(ctx.model.num_layers)) and "op_checkpoint_contexts" in sc["how"]
    elif sc["enabled"]:  # the script's own flags: Trainer.train would switch every block on
        assert not targs.gradient_checkpointing and sc["every"] == plan.checkpoint_every
        assert sc["layers"] == list(range(plan.checkpoint_every - 1, ctx.model.num_layers, plan.checkpoint_every))
    assert args["activation_offloading"]["enabled"] is plan.offload_activations
    assert args["optimizer_in_backward"]["enabled"] is plan.optimizer_in_backward
    if plan.optimizer_in_backward:
        assert targs.max_grad_norm == 0


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_plan_constructs_in_the_libraries(name, tmp_path):
    ctx = target(name)
    plans = list(sweep(ctx))
    assert len(plans) >= 40
    cache: dict = {}
    failures = []
    for plan in plans:
        try:
            check(plan, ctx, trainer_args(plan, ctx), tmp_path, cache)
        except Exception as exc:
            failures.append(f"{plan.summary()}: {type(exc).__name__}: {exc}")
    assert not failures, "\n".join(failures[:20])


def test_the_trainers_values_can_change_in_trainer_args_alone(tmp_path, ds_parse):
    """What the Trainer owns is "auto" in ds_config.json: a learning rate, batch size or clipping
    changed in trainer_args.json alone is filled in, with no mismatch, and DeepSpeed parses the
    result at the world size. The check can fail: a concrete learning rate that differs is refused."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    ctx = target("mistral-2xA10")
    plan = Plan(method="lora", lora_rank=16, micro_batch=1, grad_accum=8, sharding="zero2")
    ta = trainer_args(plan, ctx)["training_arguments"]
    changed = {**ta, "learning_rate": 1e-3, "max_grad_norm": 0.5, "per_device_train_batch_size": 2}
    try:
        hf = HfTrainerDeepSpeedConfig(deepspeed_config(plan, ctx))
        hf.trainer_config_process(_training_arguments(tmp_path, 2, changed))
        assert hf.mismatches == []
        parsed = ds_parse(hf.config, 2)
        assert (parsed.optimizer_params["lr"], parsed.gradient_clipping, parsed.train_batch_size) == (1e-3, 0.5, 32)
        concrete = deepspeed_config(plan, ctx)
        concrete["optimizer"]["params"]["lr"] = 2e-4  # what an export with numbers held
        hf = HfTrainerDeepSpeedConfig(concrete)
        hf.trainer_config_process(_training_arguments(tmp_path, 2, changed))
        assert [m for m in hf.mismatches if "optimizer.params.lr" in m]
    finally:
        unset_hf_deepspeed_config()


def test_the_exported_names_are_the_installed_libraries_own(tmp_path):
    """No deprecated name: activation checkpointing under the TrainingArguments fields this
    transformers has (the export reads them from its version), and the LoRA config's task, so
    ``get_peft_model`` gives the causal-LM wrapper the Trainer expects."""
    import warnings

    from peft import LoraConfig, PeftModelForCausalLM
    from transformers import TrainingArguments

    from autofit.export.trainer import checkpointing_names

    flag, kwargs = checkpointing_names()
    assert {flag, kwargs} <= set(TrainingArguments.__dataclass_fields__)
    assert "deprecated" not in TrainingArguments.__dataclass_fields__[flag].metadata.get("help", "").lower()
    ctx = target("mistral-2xA10")
    args = trainer_args(Plan(method="lora", lora_rank=8, micro_batch=1, grad_accum=8, checkpointing="full"), ctx)
    ta = args["training_arguments"]
    assert ta[flag] is True and ta[kwargs] == {"use_reentrant": False}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # transformers warns on a deprecated name
        _training_arguments(tmp_path, 1, ta)
    assert args["peft"]["task_type"] == "CAUSAL_LM"
    model = runtime.build_model(tiny("mistral-7b"), Plan(method="lora", lora_rank=8))  # the measured runs' model
    assert isinstance(model, PeftModelForCausalLM)
    assert LoraConfig(**args["peft"]).task_type == "CAUSAL_LM"
    bert = Plan(method="lora", lora_rank=8, micro_batch=1, grad_accum=8)
    assert "task_type" not in trainer_args(bert, target("bert-2xRTX4090"))["peft"]


def test_bf16_true_outside_deepspeed_is_a_bf16_model_without_autocast():
    ctx = target("qwen2-1xA100")
    args = trainer_args(Plan(method="lora", lora_rank=8, precision="bf16-true", micro_batch=2, grad_accum=4), ctx)
    assert args["training_arguments"]["bf16"] is False
    assert args["model_kwargs"]["dtype"] == "bfloat16"
    assert args["peft_model_kwargs"] == {"autocast_adapter_dtype": False}  # bf16 adapters, as the runtime has


def test_packing_collator_builds_the_runtime_packed_batch():
    """DataCollatorWithFlattening with the exported kwargs gives what the runtime measured:
    one row, position ids restarting per sequence, no label across a boundary."""
    import torch
    from transformers import DataCollatorWithFlattening

    ctx = target("mistral-2xA10")
    plan = Plan(method="lora", lora_rank=16, attention="flash2", packing=True, micro_batch=2, grad_accum=4)
    data = trainer_args(plan, ctx)["data"]
    assert data["data_collator"] == "transformers.DataCollatorWithFlattening"
    collate = DataCollatorWithFlattening(**data["data_collator_kwargs"])
    a, b = [5, 6, 7], [8, 9]
    batch = collate([{"input_ids": a, "labels": a}, {"input_ids": b, "labels": b}])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9]]
    # the runtime's packed batch has the same shape of labels and positions
    rt = runtime.synthetic_batch(
        ctx.model.variant(vocab_size=100, name="v"), plan, ctx.workload.__class__(seq_len=4, global_batch=16)
    )
    assert rt["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert (rt["labels"][0, [0, 4]] == -100).all() and torch.equal(
        rt["labels"][0, [1, 2, 3]], rt["input_ids"][0, [1, 2, 3]]
    )


def test_context_parallel_rows_are_padded_to_the_full_length_on_the_right():
    """The collator with the exported kwargs gives every row --seq-len tokens (the load balancer
    cuts it into 2 x cp chunks), its padding after the text and out of the loss."""
    from tokenizers import Tokenizer, models
    from transformers import DataCollatorForSeq2Seq, PreTrainedTokenizerFast

    from autofit.search.request import build_context

    ctx = build_context("llama-3.1-8b", "4xH100", seq_len=16, global_batch=8)
    plan = Plan(micro_batch=2, grad_accum=2, sharding="fsdp", context_parallel=2)
    args = trainer_args(plan, ctx)
    data = args["data"]
    assert data["padding_side"] == "right" and any("parallelism_config" in n for n in args["notes"])
    vocab = Tokenizer(models.WordLevel({"<pad>": 0, "x": 1}, unk_token="<pad>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=vocab, pad_token="<pad>")
    tokenizer.padding_side = data["padding_side"]
    collate = DataCollatorForSeq2Seq(tokenizer=tokenizer, **data["data_collator_kwargs"])
    batch = collate([{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}])
    assert batch["input_ids"].shape == (2, 16)
    assert batch["input_ids"][0, :3].tolist() == [5, 6, 7] and batch["labels"][0, 3:].eq(-100).all()


def test_fused_loss_without_a_liger_kernel_names_the_fallback():
    ctx = target("gpt2-1xT4")
    args = trainer_args(Plan(precision="fp16-mixed", micro_batch=1, grad_accum=8, fused_loss=True), ctx)
    assert "use_liger_kernel" not in args["training_arguments"]
    assert args["fused_loss"]["kernel"] is None
    assert "chunked_cross_entropy" in args["fused_loss"]["fallback"]


def test_activation_offloading_names_the_helper_the_measured_runs_use():
    """No Trainer switch: the export names autofit's hooks, and the README says how to use them."""
    import importlib

    from autofit.evaluators.offload import ActivationOffload
    from autofit.export import export_files

    ctx = target("gpt2-1xT4")
    plan = Plan(precision="fp16-mixed", micro_batch=1, grad_accum=8, checkpointing="full", offload_activations=True)
    ao = trainer_args(plan, ctx)["activation_offloading"]
    module, _, name = ao["helper"].rpartition(".")
    assert getattr(importlib.import_module(module), name) is ActivationOffload
    readme = export_files(plan, ctx)["README.md"]
    assert "Activation offloading" in readme and ao["helper"] in readme and "stop_at" in readme


def test_optimizer_in_backward_builds_an_optimizer_the_trainer_takes(tmp_path):
    """The export's helper gives a ``torch.optim.Optimizer`` with per-parameter steps, and
    clipping is off (the gradients are freed inside backward)."""
    import importlib

    import torch

    from autofit.export import export_files

    ctx = target("gpt2-1xT4")
    plan = Plan(precision="32-true", micro_batch=8, checkpointing="full", optimizer_in_backward=True)
    args = trainer_args(plan, ctx)
    ob = args["optimizer_in_backward"]
    module, _, name = ob["helper"].rpartition(".")
    make = getattr(importlib.import_module(module), name)
    model = torch.nn.Linear(4, 4)
    opt = make(plan, model)
    assert isinstance(opt, torch.optim.Optimizer) and len(opt.optimizers) == 2
    opt.remove()
    assert args["training_arguments"]["max_grad_norm"] == 0
    readme = export_files(plan, ctx)["README.md"]
    assert "Optimizer step in backward" in readme and ob["helper"] in readme

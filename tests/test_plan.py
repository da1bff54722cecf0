import pytest

from autofit.errors import PlanError
from autofit.plan import Plan, plan_problems, validate_plan
from autofit.specs import MODELS, Workload, parse_cluster


def test_plan_accepts_strings_and_has_a_stable_id():
    a = Plan(method="lora", lora_rank=16, precision="bf16-mixed", micro_batch=2, grad_accum=4)
    b = Plan.from_dict(a.as_dict())
    assert a == b and a.plan_id == b.plan_id and len(a.plan_id) == 12
    assert a.plan_id != a.replace(micro_batch=4).plan_id


@pytest.mark.parametrize(
    "field,name,canonical",
    [
        ("attention", "flash_attention_2", "flash2"),  # transformers' attn_implementation
        ("attention", "SDPA", "sdpa"),
        ("optimizer", "adamw_torch", "adamw"),  # the Trainer's OptimizerNames
        ("optimizer", "adamw_torch_fused", "adamw"),
        ("optimizer", "adamw_bnb_8bit", "adamw-8bit"),
        ("optimizer", "paged_adamw_8bit", "paged-adamw-8bit"),
        ("precision", "bf16", "bf16-mixed"),  # accelerate's --mixed_precision
        ("precision", "fp16", "fp16-mixed"),
        ("precision", "no", "32-true"),
        ("method", "lora_8bit", "lora-8bit"),
    ],
)
def test_the_names_of_other_tools_are_the_same_choice(field, name, canonical):
    plan = Plan(**{field: name})
    assert getattr(plan, field).value == canonical
    assert plan.plan_id == Plan(**{field: canonical}).plan_id  # one plan, stored under our name


def test_a_bad_value_lists_our_names_and_the_tools():
    with pytest.raises(PlanError, match=r"adamw, adamw-8bit.* \(also adamw_torch, .*adamw_bnb_8bit"):
        Plan(optimizer="adam")


def test_bad_field_values_are_all_reported():
    with pytest.raises(PlanError) as exc:
        Plan(method="bogus", micro_batch=0, precision="fp8")
    assert len(exc.value.problems) == 3


def test_unknown_keys_are_rejected():
    with pytest.raises(PlanError, match="unknown plan field 'rank'"):
        Plan.from_dict({"rank": 3})


def test_validation_collects_every_problem_with_its_fix():
    problems = plan_problems(
        Plan(precision="bf16-mixed", attention="flash2", offload="optimizer", micro_batch=3, grad_accum=1),
        MODELS["llama-3-8b"],
        parse_cluster("1xV100-16GB"),
        Workload(seq_len=512, global_batch=8),
    )
    text = " | ".join(problems)
    assert "use fp16-mixed" in text
    assert "flash2 needs compute capability" in text
    assert "offload needs sharding zero2, zero3 or fsdp" in text
    assert "global batch is 8" in text
    assert len(problems) == 4


@pytest.mark.parametrize(
    "plan,fragment",
    [
        (Plan(method="lora"), "needs a LoRA rank"),
        (Plan(lora_rank=8), "applies only to the LoRA methods"),
        (Plan(method="qlora", lora_rank=8, precision="32-true"), "qlora computes in 16-bit"),
        (Plan(packing=True), "packing needs flash2"),
        (Plan(sharding="zero2", offload="optimizer+params"), "needs zero3 or fsdp"),
        (Plan(sharding="fsdp", offload="optimizer"), "use offload optimizer+params"),
        (Plan(sharding="zero2", offload="optimizer", offload_device="nvme"), "needs zero3"),
        (Plan(sharding="zero3", optimizer="adamw-8bit"), "does not step on ZeRO-3"),
        (Plan(sharding="zero3", offload="optimizer", optimizer="adafactor"), "Adam-family"),
    ],
)
def test_incompatible_combinations_name_the_fix(plan, fragment):
    problems = plan_problems(
        plan, MODELS["mistral-7b"], parse_cluster("2xA100-80GB"), Workload(seq_len=512, global_batch=2)
    )
    assert any(fragment in p for p in problems), problems


def test_single_gpu_sharding_needs_offload():
    c, w, m = parse_cluster("1xA10"), Workload(seq_len=512, global_batch=1), MODELS["gpt2"]
    assert any("divides nothing" in p for p in plan_problems(Plan(sharding="zero2"), m, c, w))
    assert not plan_problems(Plan(sharding="zero2", offload="optimizer"), m, c, w)


def test_gemma2_has_no_sdpa():
    with pytest.raises(PlanError, match="do not implement sdpa"):
        validate_plan(Plan(), MODELS["gemma-2-9b"], parse_cluster("1xA100"), Workload(seq_len=512, global_batch=1))


def test_lora_targets_cover_their_parts():
    from autofit.plan import LoraTargets

    assert LoraTargets.ALL_LINEAR.covers("attention") and LoraTargets.ALL_LINEAR.covers("mlp")
    assert LoraTargets.ATTENTION.covers("attention") and not LoraTargets.ATTENTION.covers("mlp")


# -- how simple a plan is ---------------------------------------------------------------------------
def test_complexity_orders_offload_then_sharding_then_moving_parts_then_the_micro_batch():
    from autofit.plan import complexity, moving_parts

    plain = Plan(micro_batch=4, grad_accum=4)
    order = [
        plain,  # plain training, the largest micro-batch
        plain.replace(micro_batch=2, grad_accum=8),  # more accumulation
        plain.replace(checkpointing="full", fused_loss=True),  # two moving parts
        plain.replace(sharding="zero1"),  # DeepSpeed where plain/DDP training would do
        plain.replace(sharding="zero2"),
        plain.replace(sharding="fsdp"),
        plain.replace(sharding="zero3"),
        plain.replace(sharding="zero2", offload="optimizer"),  # offload: host memory, CPU Adam
        plain.replace(sharding="zero3", offload="optimizer+params"),
        plain.replace(sharding="zero3", offload="optimizer+params", offload_device="nvme"),
    ]
    assert sorted(order, key=complexity) == order
    assert len({complexity(p) for p in order}) == len(order)
    # the moving parts, counted: QLoRA is LoRA and 4-bit weights, a paged 8-bit optimizer two parts
    assert moving_parts(plain) == ()
    assert (
        len(moving_parts(Plan(method="qlora", lora_rank=16)))
        == 2
        > len(moving_parts(Plan(method="lora", lora_rank=16)))
    )
    assert len(moving_parts(plain.replace(optimizer="paged-adamw-8bit"))) == 2
    assert moving_parts(plain.replace(attention="flash2", packing=True)) == ("flash2 attention", "packing")
    assert moving_parts(plain.replace(attention="eager", precision="bf16-true")) == ()  # torch's own kernels


def test_plan_changes_name_each_technique_that_differs():
    from autofit.plan import plan_changes

    simple = Plan(method="lora", lora_rank=16, micro_batch=2, grad_accum=8, fused_loss=True)
    fancy = simple.replace(sharding="zero2", offload="optimizer", micro_batch=4, grad_accum=4)
    assert plan_changes(simple, fancy) == (
        "sharding none → zero2",
        "offload none → optimizer→cpu",
        "mb2×ga8 → mb4×ga4",
    )
    assert plan_changes(simple, simple) == ()
    assert plan_changes(Plan(), Plan(method="qlora", lora_rank=8, fused_loss=True)) == (
        "method full → qlora r8",
        "fused loss off → on",
    )

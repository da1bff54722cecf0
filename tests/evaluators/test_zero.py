"""What DeepSpeed ZeRO holds beyond its partitioned states, as both estimators count it.

The mechanisms were read in DeepSpeed's code and measured on 2 CPU ranks
(``benchmarks/zero_memory.py``; the slow two-rank tests hold the estimators to the measured
peak): the optimizer step's flattened 16-bit and fp32 gradient copies, per ZeRO-3 sub-group;
the whole parameters ZeRO-3 keeps gathered (``stage3_max_live_parameters``,
``stage3_max_reuse_distance``); the whole gradients held beside a block's backward;
Adafactor's unfactored second moment on the flat partition; ZeRO-3's gradient partition,
allocated at setup.
"""

from __future__ import annotations

import pytest

from autofit.evaluators import costs
from autofit.evaluators.analytic import estimate
from autofit.export.deepspeed import deepspeed_config
from autofit.plan import Plan
from autofit.specs import MODELS, Target, Workload, parse_cluster
from autofit.techniques import deepspeed_buckets
from tests.conftest import tiny

GiB = 2**30
FULL = Plan(precision="bf16-mixed", micro_batch=1, grad_accum=1)


def _states(plan, model, gpus="8xH100"):
    cluster = parse_cluster(gpus)
    sb = costs.state_bytes(model, plan)
    return sb, costs.shard_states(plan, model, cluster, sb, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_step_holds_the_flat_16bit_and_fp32_gradient_copies(stage):
    """6 bytes per partition element at the moment the fp32 copy is made (fused AdamW adds none)."""
    model = MODELS["mistral-7b"]
    plan = FULL.replace(sharding=f"zero{stage}")
    sb, st = _states(plan, model, "8xH100")
    partition = model.n_params / 8
    if stage < 3:
        assert st.step_temporary == pytest.approx(6 * partition)
    else:  # one sub-group of 10^9 elements and at most one more parameter at a time
        bound = deepspeed_buckets(model)["sub_group_size"] + model.largest_tensor() / 8
        assert partition < bound and st.step_temporary == pytest.approx(6 * partition)
        big = MODELS["llama-3-70b"]
        _, st70 = _states(plan, big, "8xH100")
        assert st70.step_temporary == pytest.approx(6 * (10**9 + big.largest_tensor() / 8))
        assert st70.step_temporary < 6 * big.n_params / 8 / 4


def test_the_exported_optimizer_is_torch_fused_adamw_which_adds_no_step_temporaries():
    ctx = Target(MODELS["mistral-7b"], parse_cluster("2xA100-80GB"), Workload(seq_len=1024, global_batch=8), 0.05)
    cfg = deepspeed_config(FULL.replace(sharding="zero3", grad_accum=4), ctx)
    assert cfg["optimizer"]["params"]["torch_adam"] is True and cfg["optimizer"]["params"]["fused"] is True
    assert cfg["zero_optimization"]["sub_group_size"] == 10**9


def test_adafactor_keeps_a_whole_second_moment_on_the_flat_partition():
    model = MODELS["mistral-7b"]
    plain = costs.state_bytes(model, FULL.replace(optimizer="adafactor"))
    zero = costs.state_bytes(model, FULL.replace(optimizer="adafactor", sharding="zero2"))
    assert plain.states < 0.01 * model.n_params * 4  # factored: rows + columns
    assert zero.states == 4 * model.n_params  # fp32, one per element, before the 1/dp
    _, st = _states(FULL.replace(optimizer="adafactor", sharding="zero2"), model)
    partition = model.n_params / 8
    # fp32 gradient copy + squared gradient + the variance's clone, the 16-bit gradients freed
    assert st.step_temporary == pytest.approx((4 + 8 - 2) * partition)


def test_zero3_keeps_a_small_model_gathered_whole_and_a_large_one_up_to_max_live():
    small, large = tiny("mistral-7b"), MODELS["mistral-7b"]
    plan = FULL.replace(sharding="zero3")
    assert costs.zero3_gathered_bytes(plan, small, 1.0) == pytest.approx(2 * small.n_params)
    layer = large.layer_params() * 2
    kept = costs.zero3_gathered_bytes(plan, large, layer)
    assert kept == pytest.approx(2 * (10**9 + large.largest_tensor()))
    assert 2 * layer < kept < 2 * large.n_params / 3
    huge = MODELS["llama-3-70b"]  # two 70B blocks are more than 10^9 elements
    assert costs.zero3_gathered_bytes(plan, huge, huge.layer_params() * 2) > 4 * huge.layer_params()


def test_zero3_gradient_partition_is_there_from_setup():
    model = MODELS["mistral-7b"]
    _, z3 = _states(FULL.replace(sharding="zero3"), model)
    _, z2 = _states(FULL.replace(sharding="zero2"), model)
    assert z3.grad_accum_present == z3.gradients > 0
    assert z2.grad_accum_present == 0


def test_zero_and_fsdp_hold_whole_gradients_beside_a_blocks_backward():
    mixtral = tiny("mixtral-8x7b")
    plan = FULL.replace(sharding="zero3")
    sb = costs.state_bytes(mixtral, plan)
    e, w, h = mixtral.num_experts, mixtral.expert_width, mixtral.hidden_size
    assert costs.held_grads(plan, mixtral, sb) == (e * 2 * w * h + e * w * h) * 2
    # FSDP2: one block's whole 16-bit gradients, beside the previous block's reduce-scatter input
    assert costs.held_grads(plan.replace(sharding="fsdp"), mixtral, sb) == pytest.approx(
        2 * sb.trainable_weights / sb.param_elem_bytes / mixtral.num_layers
    )
    assert costs.held_grads(plan.replace(sharding="zero3", method="lora", lora_rank=8), mixtral, sb) == 0


def test_zero3_estimate_of_a_small_model_is_at_least_zero2s_weights_gathered():
    """Under 10^9 parameters ZeRO-3 gathers the whole model through forward and backward."""
    ctx = Target(MODELS["llama-3.2-1b"], parse_cluster("2xA100-80GB"), Workload(seq_len=1024, global_batch=8), 0.05)
    z3 = estimate(FULL.replace(sharding="zero3", micro_batch=4), ctx).memory
    assert z3.temporary >= 2 * ctx.model.n_params

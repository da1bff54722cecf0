"""Selective checkpointing (every k-th block, torchtitan's layer-selective rule): which blocks,
what the plan and the CLI accept, and that it lies between no checkpointing and full.

The simulated evaluator's agreement with real CPU steps is in ``test_simulated.FAST``, the
analytic evaluator's in ``test_simulated.ANALYTIC_PLANS``, the unrolled trace's in
``test_unroll`` (its period covers k).
"""

from __future__ import annotations

import functools

import pytest
import torch

from autofit.errors import PlanError
from autofit.evaluators import runtime as rt
from autofit.evaluators.analytic import estimate
from autofit.plan import Plan, plan_problems
from autofit.search.request import build_context, build_plan
from autofit.specs import Workload, parse_cluster
from autofit.techniques import checkpointed_layers
from tests.conftest import tiny
from tests.evaluators.test_simulated import real_steps


def test_every_kth_block_counted_from_one():
    plan = Plan(checkpointing="selective", checkpoint_every=3)
    assert checkpointed_layers(plan, 7) == (False, False, True, False, False, True, False)
    assert checkpointed_layers(Plan(checkpointing="full"), 3) == (True, True, True)
    assert checkpointed_layers(Plan(), 3) == (False, False, False)
    model = rt.build_model(tiny("llama-2-7b", layers=4), Plan(checkpointing="selective", checkpoint_every=2))
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [False, True, False, True]


def test_the_plan_and_the_cli_say_what_selective_needs():
    spec, cluster, wl = tiny("llama-2-7b", layers=4), parse_cluster("2xA100"), Workload(global_batch=2)
    assert any(
        "needs a policy: --checkpoint-every K" in p
        for p in plan_problems(Plan(checkpointing="selective"), spec, cluster, wl)
    )
    assert any("applies only to" in p for p in plan_problems(Plan(checkpoint_every=2), spec, cluster, wl))
    fsdp = Plan(checkpointing="selective", checkpoint_every=2, sharding="fsdp")
    assert any("fsdp_activation_checkpointing" in p for p in plan_problems(fsdp, spec, cluster, wl))
    with pytest.raises(PlanError, match="at least 2"):
        Plan(checkpointing="selective", checkpoint_every=1)
    ctx = build_context("llama-3.2-1b", "1xA100-80GB", global_batch=2)
    assert build_plan(ctx, checkpointing="selective").checkpoint_every == 2  # the CLI's default


def test_it_lies_between_none_and_full():
    ctx = build_context("llama-3.2-1b", "1xA100-80GB", global_batch=4, seq_len=2048)
    est = {
        name: estimate(build_plan(ctx, micro_batch=4, checkpointing=name), ctx)
        for name in ("none", "selective", "full")
    }
    peaks = {k: e.memory.peak_allocated for k, e in est.items()}
    speed = {k: e.throughput.tokens_per_sec for k, e in est.items()}
    assert peaks["full"] < peaks["selective"] < peaks["none"]
    assert speed["full"] < speed["selective"] < speed["none"]


def test_gradients_are_the_same_as_without_checkpointing():
    spec = tiny("mistral-7b", layers=4)
    wl = Workload(seq_len=64, global_batch=2)
    grads = {}
    for plan in (
        Plan(precision="32-true", micro_batch=2),
        Plan(precision="32-true", micro_batch=2).replace(checkpointing="selective", checkpoint_every=2),
    ):
        torch.manual_seed(0)
        model = rt.build_model(spec, plan)
        (batch,) = rt.batches_for(spec, plan, wl)
        model(**batch).loss.backward()
        grads[plan.checkpointing.value] = {n: p.grad for n, p in model.named_parameters()}
    for name, g in grads["none"].items():
        torch.testing.assert_close(grads["selective"][name], g, msg=name)


OPS = dict(checkpointing="selective", checkpoint_ops=True)  # op-level (torchtitan's SelectiveAC), below
# the real CPU steps that block-level and op-level checkpointing are compared on: each is run once
# for the two tests below (at 256 tokens both lie strictly between none and full)
REAL = {
    "none": {},
    "selective": {"checkpointing": "selective", "checkpoint_every": 2},
    "ops": OPS,
    "full": {"checkpointing": "full"},
}


@functools.cache
def real_peak(name: str) -> int:
    """The peak of two real CPU steps of a 4-layer llama under ``REAL[name]``."""
    spec = tiny("llama-2-7b", layers=4)
    wl = Workload(seq_len=256, global_batch=2)
    return real_steps(spec, Plan(precision="bf16-true", micro_batch=2).replace(**REAL[name]), wl).snapshot().peak


def test_a_real_cpu_step_saves_less_than_none_and_more_than_full():
    acts = {ck: real_peak(ck) for ck in ("none", "selective", "full")}
    assert acts["full"] < acts["selective"] < acts["none"]


# -- op-level selective checkpointing (torchtitan's SelectiveAC) ----------------------------------


def _policy_decisions(monkeypatch, spec, plan) -> list[tuple[str, bool]]:
    """(op, recomputed) for every matmul the policy decides on in one block's forward, in order."""
    import torch.utils.checkpoint as tuc

    seen: list[tuple[str, bool]] = []
    make = tuc.create_selective_checkpoint_contexts

    def spy(policy_fn, *args, **kwargs):
        def logged(ctx, func, *a, **kw):
            decision = policy_fn(ctx, func, *a, **kw)
            if not ctx.is_recompute and func.__name__.split(".")[0] in ("mm", "addmm", "bmm"):
                seen.append((func.__name__.split(".")[0], decision is tuc.CheckpointPolicy.PREFER_RECOMPUTE))
            return decision

        return make(logged, *args, **kwargs)

    monkeypatch.setattr(tuc, "create_selective_checkpoint_contexts", spy)
    model = rt.build_model(spec, plan)
    (batch,) = rt.batches_for(spec, plan, Workload(seq_len=32, global_batch=plan.micro_batch))
    model(**batch).loss.backward()
    return seen


@pytest.mark.parametrize(
    "family,plan",
    [
        ("llama-2-7b", Plan(precision="32-true", **OPS)),
        ("qwen2.5-7b", Plan(method="lora", lora_rank=4, precision="32-true", **OPS)),  # q/k/v biases: addmm
        ("gpt2", Plan(precision="32-true", attention="eager", **OPS)),  # Conv1D's addmm, eager's bmm
    ],
    ids=["llama", "qwen2-lora", "gpt2-eager"],
)
def test_the_policy_recomputes_the_matmuls_the_analytic_counts(monkeypatch, family, plan):
    """The runtime's policy, decision by decision, against ``analytic.sac_saves``' walk of the block:
    which Linear and LoRA GEMMs are recomputed (every second bias-free mm), and that attention's
    matmuls are saved."""
    from autofit.evaluators.analytic import _sac_kernel, sac_saves

    spec = tiny(family, layers=1)
    seen = _policy_decisions(monkeypatch, spec, plan)
    _, _, base, adapters = sac_saves(spec, plan, True, _sac_kernel(spec, plan, "flash"))
    expected, pairs = [], iter(zip(adapters[::2], adapters[1::2], strict=True))
    for (_, _, _, part), again in zip(spec.linears(), base, strict=True):
        expected.append(again)
        if plan.is_peft and plan.lora_targets.covers(part):
            expected += list(next(pairs))
    linears = [again for op, again in seen if op != "bmm"]
    assert linears == expected
    assert [again for op, again in seen if op == "bmm"] == ([False, False] if plan.attention.value == "eager" else [])
    assert False in linears and (True in linears) == (family != "gpt2")  # GPT-2's Conv1D: addmm, all saved


def test_op_level_needs_its_own_policy_and_says_what_it_does_not_model():
    spec, cluster, wl = tiny("llama-2-7b", layers=4), parse_cluster("2xA100"), Workload(global_batch=2)

    def problems(**kw):
        return plan_problems(Plan(**kw), spec, cluster, wl)

    assert any(
        "two policies" in p for p in problems(checkpointing="selective", checkpoint_every=2, checkpoint_ops=True)
    )
    assert any("--checkpoint-ops applies only to" in p for p in problems(checkpointing="full", checkpoint_ops=True))
    assert not problems(**OPS)
    assert any("--offload-activations" in p for p in problems(**OPS, offload_activations=True))
    moe = tiny("mixtral-8x7b", layers=2)
    assert any("mixture-of-experts" in p for p in plan_problems(Plan(**OPS), moe, cluster, wl))
    ctx = build_context("llama-3.2-1b", "1xA100-80GB", global_batch=2)
    plan = build_plan(ctx, checkpointing="selective", checkpoint_ops=True)
    assert plan.checkpoint_every is None and plan.summary().count("ckpt ops") == 1
    assert checkpointed_layers(plan, 3) == (True, True, True)


def test_op_level_gradients_are_the_same_as_without_checkpointing():
    spec = tiny("mistral-7b", layers=2)
    wl = Workload(seq_len=64, global_batch=2)
    grads = {}
    for plan in (Plan(precision="32-true", micro_batch=2), Plan(precision="32-true", micro_batch=2, **OPS)):
        torch.manual_seed(0)
        model = rt.build_model(spec, plan)
        (batch,) = rt.batches_for(spec, plan, wl)
        model(**batch).loss.backward()
        grads[plan.checkpoint_ops] = {n: p.grad for n, p in model.named_parameters()}
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, msg=name)


def test_op_level_lies_between_none_and_full_in_memory_and_time():
    """On a real CPU step (activations at the peak) and in the analytic estimate of a 1B model."""
    real = {name: real_peak(name) for name in ("none", "ops", "full")}
    assert real["full"] < real["ops"] < real["none"]
    ctx = build_context("llama-3.2-1b", "1xA100-80GB", global_batch=4, seq_len=2048)
    est = {
        name: estimate(build_plan(ctx, micro_batch=4, **kw), ctx)
        for name, kw in (("none", {}), ("ops", OPS), ("full", {"checkpointing": "full"}))
    }
    peaks = {k: e.memory.peak_allocated for k, e in est.items()}
    speed = {k: e.throughput.tokens_per_sec for k, e in est.items()}
    assert peaks["full"] < peaks["ops"] < peaks["none"]
    assert speed["full"] < speed["ops"] < speed["none"]

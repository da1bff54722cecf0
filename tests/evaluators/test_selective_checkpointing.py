"""Selective checkpointing (every k-th block, torchtitan's layer-selective rule): which blocks,
what the plan and the CLI accept, and that it lies between no checkpointing and full.

The simulated evaluator's agreement with real CPU steps is in ``test_simulated.FAST``, the
analytic evaluator's in ``test_simulated.ANALYTIC_PLANS``, the unrolled trace's in
``test_unroll`` (its period covers k).
"""

from __future__ import annotations

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
        "needs --checkpoint-every" in p for p in plan_problems(Plan(checkpointing="selective"), spec, cluster, wl)
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


def test_a_real_cpu_step_saves_less_than_none_and_more_than_full():
    spec = tiny("llama-2-7b", layers=4)
    wl = Workload(seq_len=128, global_batch=2)
    acts = {
        ck: real_steps(spec, Plan(precision="bf16-true", micro_batch=2).replace(**kw), wl).snapshot().peak
        for ck, kw in (
            ("none", {}),
            ("selective", {"checkpointing": "selective", "checkpoint_every": 2}),
            ("full", {"checkpointing": "full"}),
        )
    }
    assert acts["full"] < acts["selective"] < acts["none"]

"""The optimizer step in backward (``runtime.BackwardOptimizer``): the same update as the
plain step, gradients freed as they are made, and the plans that cannot run it refused.

The simulated evaluator's agreement with real CPU steps is in ``test_simulated.FAST``.
"""

from __future__ import annotations

import pytest
import torch

from autofit.errors import PlanError
from autofit.evaluators import runtime as rt
from autofit.evaluators.analytic import estimate
from autofit.plan import Plan, validate_plan
from autofit.specs import Target, Workload, parse_cluster
from tests.conftest import tiny
from tests.evaluators.test_simulated import real_steps

WORKLOAD = Workload(seq_len=64, global_batch=2)


def _stepped(spec, plan, steps=2):
    torch.manual_seed(0)
    model = rt.build_model(spec, plan)
    runner = rt.StepRunner(spec, plan, model, rt.make_optimizer(plan, model, lr=1e-3))
    for step in range(steps):
        runner.step(rt.batches_for(spec, plan, WORKLOAD, step=step), step=step)
    runner.close()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "adafactor"])
def test_the_update_is_the_plain_step(optimizer):
    spec = tiny("llama-2-7b", layers=2)
    plan = Plan(precision="32-true", micro_batch=2, optimizer=optimizer)
    plain = _stepped(spec, plan)
    fused = _stepped(spec, plan.replace(optimizer_in_backward=True))
    start = _stepped(spec, plan, steps=0)
    moved = [n for n in plain if not torch.equal(plain[n], start[n])]
    assert moved  # the steps changed the weights ...
    for name, p in plain.items():  # ... and the step in backward changed them the same
        torch.testing.assert_close(fused[name], p, msg=name)


def test_it_is_an_optimizer_to_an_lr_schedule():
    spec = tiny("llama-2-7b", layers=1)
    plan = Plan(precision="bf16-true", micro_batch=2, optimizer_in_backward=True)
    opt = rt.make_optimizer(plan, rt.build_model(spec, plan), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    inner = {g["lr"] for o in opt.optimizers.values() for g in o.param_groups}
    assert inner == {5e-4} and sched.get_last_lr()[0] == 5e-4
    opt.remove()


def test_no_moment_holds_every_gradient():
    spec = tiny("llama-2-7b", layers=3)
    grads = {}
    for in_bwd in (False, True):
        plan = Plan(precision="bf16-true", micro_batch=2, checkpointing="full", optimizer_in_backward=in_bwd)
        tr = real_steps(spec, plan, WORKLOAD)
        most = max(tr.snapshot(i).components["gradients"] for i in range(0, len(tr.log), 50))
        grads[in_bwd] = (most, tr.peak)
    every = sum(p.numel() * 2 for p in rt.build_model(spec, plan).parameters())
    assert grads[False][0] >= 0.99 * every  # all at the end of backward
    largest = spec.vocab_size * spec.hidden_size * 2
    assert grads[True][0] <= largest + 2 * 2**20  # one (the head's or the embedding's) and a block's at most
    assert grads[True][1] < grads[False][1]


@pytest.mark.parametrize(
    "changes,gpus,fix",
    [
        (dict(micro_batch=1, grad_accum=2), "1xA100", "use grad_accum 1"),
        (dict(micro_batch=1), "2xA100", "runs on one GPU"),
        (dict(micro_batch=2, precision="fp16-mixed"), "1xA100", "use bf16-mixed or bf16-true"),
    ],
)
def test_plans_that_cannot_step_in_backward_are_refused_with_the_fix(changes, gpus, fix):
    plan = Plan(optimizer_in_backward=True, **changes)
    with pytest.raises(PlanError) as err:
        validate_plan(plan, tiny("llama-2-7b"), parse_cluster(gpus), WORKLOAD)
    assert len(err.value.problems) == 1 and fix in err.value.problems[0]


def test_the_analytic_evaluator_frees_gradients_as_they_are_made():
    spec = tiny("mistral-7b", layers=3)
    ctx = Target(spec, parse_cluster("1xA100"), Workload(seq_len=256, global_batch=2))
    plan = Plan(precision="bf16-true", micro_batch=2, checkpointing="full")
    plain, fused = estimate(plan, ctx), estimate(plan.replace(optimizer_in_backward=True), ctx)
    assert fused.memory.gradients <= spec.vocab_size * spec.hidden_size * 2 < plain.memory.gradients
    assert fused.memory.peak_allocated < plain.memory.peak_allocated

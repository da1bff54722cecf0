"""Liger's fused RMSNorm, SwiGLU and RoPE as ``autofit.evaluators.fused`` runs them: the same
training, the tensors Liger's Functions save, and the model left as it was outside a forward.

The simulated evaluator's agreement with real CPU steps under fused kernels is in
``test_simulated.FAST``, the analytic evaluator's in ``test_simulated.ANALYTIC_PLANS``, the
unrolled trace's in ``test_unroll``.
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from autofit.evaluators import fused
from autofit.evaluators import runtime as rt
from autofit.plan import Plan, plan_problems
from autofit.search.request import build_context
from autofit.search.space import Allowed, SearchSpace
from autofit.specs import Workload, parse_cluster
from tests.conftest import tiny
from tests.evaluators.test_simulated import real_steps

WORKLOAD = Workload(seq_len=128, global_batch=2)


def _grads(spec, plan):
    torch.manual_seed(0)
    model = rt.build_model(spec, plan)
    runner = rt.StepRunner(spec, plan, model, rt.make_optimizer(plan, model))
    (batch,) = rt.batches_for(spec, plan, WORKLOAD)
    with runner.fused_rope():  # forward and backward: the checkpoint recompute rotates too
        with runner._autocast():
            loss = runner.loss(batch)
        loss.backward()
    runner.close()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["llama-2-7b", "mistral-7b", "qwen3-8b"])
def test_gradients_are_the_same_with_and_without_fused_kernels(family):
    spec = tiny(family, layers=2)
    plan = Plan(precision="32-true", micro_batch=2, checkpointing="full")
    loss, plain = _grads(spec, plan)
    loss_fused, fused_grads = _grads(spec, plan.replace(fused_kernels=True))
    assert loss_fused == pytest.approx(loss, rel=1e-6)
    assert plain.keys() == fused_grads.keys() and plain
    for name, g in plain.items():
        torch.testing.assert_close(fused_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def _saved(fn, *args):
    """The tensors autograd saves for backward while ``fn(*args)`` runs."""
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, saved


def test_each_function_saves_what_ligers_saves():
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(64, requires_grad=True)
    y, saved = _saved(fused.RMSNormFunction.apply, x, w, 1e-6)
    # LigerRMSNormFunction: X (as rows, the input's own storage), W and one fp32 rstd a row
    assert [tuple(t.shape) for t in saved] == [(16, 64), (64,), (16,)]
    assert saved[0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert saved[2].dtype is torch.float32 and y.dtype is torch.bfloat16

    a = torch.randn(2, 8, 128, requires_grad=True).clone()
    b = torch.randn(2, 8, 128, requires_grad=True).clone()
    c, saved = _saved(fused.SiLUMulFunction.apply, a, b)
    assert [t.untyped_storage().data_ptr() for t in saved] == [
        a.untyped_storage().data_ptr(),
        b.untyped_storage().data_ptr(),
    ]
    # LigerSiLUMulFunction's backward writes the gradients over its saved inputs
    ga, gb = torch.autograd.grad(c.sum(), (a, b))
    assert ga.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    assert gb.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()

    q = torch.randn(2, 8, 4, 16, requires_grad=True).clone().transpose(1, 2)  # (batch, heads, seq, dim)
    k = torch.randn(2, 8, 2, 16, requires_grad=True).clone().transpose(1, 2)
    cos, sin = torch.randn(1, 8, 16), torch.randn(1, 8, 16)
    (q2, k2), saved = _saved(fused.RopeFunction.apply, q, k, cos, sin)
    assert [t.shape for t in saved] == [cos.shape, sin.shape]  # LigerRopeFunction saves cos and sin only
    assert q2.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()  # rotated in place


def test_rope_is_patched_only_inside_the_context():
    spec = tiny("llama-2-7b", layers=1)
    model = rt.build_model(spec, Plan(precision="32-true"))
    module = sys.modules[type(model.model.layers[0].self_attn).__module__]
    original = module.apply_rotary_pos_emb
    with fused.rope(model):
        assert module.apply_rotary_pos_emb is fused.rotary_pos_emb
    assert module.apply_rotary_pos_emb is original
    with contextlib.suppress(RuntimeError), fused.rope(model):
        raise RuntimeError
    assert module.apply_rotary_pos_emb is original


def test_fused_kernels_save_less_on_a_real_cpu_step():
    spec = tiny("mistral-7b", layers=3)
    snaps = {}
    for on in (False, True):
        snaps[on] = real_steps(spec, Plan(precision="bf16-true", micro_batch=2, fused_kernels=on), WORKLOAD).snapshot()
    # each norm keeps its bf16 input instead of an fp32 copy and its output; SwiGLU drops silu(gate)
    assert snaps[True].components["activations"] < 0.8 * snaps[False].components["activations"]
    assert snaps[True].components["weights"] == snaps[False].components["weights"]


def test_only_llama_like_blocks_take_them_and_the_space_offers_them_on_gpus():
    gpt2 = tiny("gpt2")
    problems = plan_problems(Plan(fused_kernels=True), gpt2, parse_cluster("1xA100"), Workload(global_batch=1))
    assert len(problems) == 1 and "drop --fused-kernels" in problems[0]
    on_gpu = SearchSpace(build_context("mistral-7b", "1xA10", global_batch=4), Allowed())
    assert {p.fused_kernels for p in on_gpu.enumerate()} == {False, True}
    other = SearchSpace(build_context("gpt2", "1xA10", global_batch=4, seq_len=1024), Allowed())
    assert not any(p.fused_kernels for p in other.enumerate())

"""Activation offloading (``autofit.evaluators.offload``): what it moves, what it keeps, and
that training under it computes the same gradients.

The simulated evaluator's agreement with real CPU steps under offloading is in
``test_simulated.FAST``; the unrolled trace's in ``test_unroll``.
"""

from __future__ import annotations

import pytest
import torch

from autofit.evaluators import runtime as rt
from autofit.evaluators import timing
from autofit.evaluators.analytic import estimate
from autofit.evaluators.memtrack import StorageTracker
from autofit.evaluators.offload import MIN_BYTES, ActivationOffload
from autofit.evaluators.simulated import SimulatedEvaluator, TraceDevice, run_trace
from autofit.plan import Plan
from autofit.specs import Target, Workload, parse_cluster
from tests.conftest import tiny
from tests.evaluators.test_simulated import real_steps

WORKLOAD = Workload(seq_len=128, global_batch=2)  # one micro-batch of 2


def _grads(spec, plan):
    """The gradients of one micro-batch's forward and backward, run as ``StepRunner.step`` runs them."""
    torch.manual_seed(0)
    model = rt.build_model(spec, plan)
    runner = rt.StepRunner(spec, plan, model, rt.make_optimizer(plan, model))
    (batch,) = rt.batches_for(spec, plan, WORKLOAD)
    with runner._offloading():
        loss = runner.loss(batch)
    loss.backward()
    runner.close()
    assert (runner._offload is not None and runner._offload.offloaded_bytes > 0) == plan.offload_activations
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("ckpt", ["none", "full"])
def test_gradients_are_the_same_with_and_without_offloading(ckpt):
    spec = tiny("mistral-7b", layers=2)
    plan = Plan(precision="32-true", micro_batch=2, checkpointing=ckpt)
    plain = _grads(spec, plan)
    offloaded = _grads(spec, plan.replace(offload_activations=True))
    assert plain.keys() == offloaded.keys() and plain
    for name, g in plain.items():
        torch.testing.assert_close(offloaded[name], g, msg=name)


def test_what_is_offloaded_and_what_stays():
    lin = torch.nn.Linear(64, 64)
    hooks = ActivationOffload(lin, device="cpu", tracker=StorageTracker())
    big = torch.randn(8, 64, requires_grad=True)
    small = torch.randn(2, requires_grad=True)
    assert small.numel() * small.element_size() < MIN_BYTES <= big.numel() * big.element_size()
    with hooks.tracker, hooks:
        assert isinstance(hooks._pack(small), torch.Tensor)  # too small: saved as it is
        assert isinstance(hooks._pack(lin.weight), torch.Tensor)  # a parameter stays
        first, again = hooks._pack(big), hooks._pack(big)
        assert not isinstance(first, torch.Tensor) and first[0] is again[0]  # one host copy for both saves
        hooks.stop()  # the head and the loss
        assert isinstance(hooks._pack(big), torch.Tensor)
    assert hooks.offloaded_bytes == big.numel() * big.element_size()
    back = hooks._unpack(first)
    assert torch.equal(back, big) and back.untyped_storage()._cdata != big.untyped_storage()._cdata


def test_offloading_moves_activations_to_the_host_on_a_real_cpu_step():
    spec = tiny("llama-2-7b", layers=3)
    peaks = {}
    for off in (False, True):
        tr = real_steps(spec, Plan(precision="bf16-mixed", micro_batch=2, offload_activations=off), WORKLOAD)
        peaks[off] = (tr.snapshot(), tr.host_peak)
    (plain, no_host), (off, host) = peaks[False], peaks[True]
    assert no_host == 0 and host > 0
    # the plain step peaks holding its activations; the offloaded one peaks elsewhere, holding almost none
    assert plain.components["activations"] > 0.2 * plain.peak
    assert off.peak < plain.peak and off.components["activations"] < 0.05 * off.peak


def test_the_trace_prices_the_host_traffic_and_holds_the_host_memory():
    spec = tiny("mistral-7b", layers=3)
    ctx = Target(spec, parse_cluster("1xA100"), Workload(seq_len=256, global_batch=2))
    base = Plan(precision="bf16-true", micro_batch=2, checkpointing="full")
    plain, off = (SimulatedEvaluator().evaluate(p, ctx) for p in (base, base.replace(offload_activations=True)))
    trace = run_trace(spec, base.replace(offload_activations=True), ctx.workload, TraceDevice("cuda", (8, 0)))
    # checkpointing saves each block's input: what goes to the host is those inputs, the token
    # ids and the final norm's saves (its fp32 input and its bf16 output: 3 block inputs)
    block_input = 2 * 256 * spec.hidden_size * 2
    assert spec.num_layers * block_input < trace.offloaded <= (spec.num_layers + 3) * block_input + 8192
    assert off.memory.host_bytes - plain.memory.host_bytes == pytest.approx(trace.offloaded, abs=2**20)
    assert off.memory.activations < plain.memory.activations
    assert off.throughput.offload_s > 0 == plain.throughput.offload_s
    assert off.tokens_per_sec < plain.tokens_per_sec
    # priced as the host link moving the copies down in forward and up in backward, unhidden
    link = ctx.cluster.gpu.host_link_gbps * timing.default_params().link_efficiency * 1e9
    assert off.throughput.offload_s == pytest.approx(2 * trace.offloaded / link)


def test_the_analytic_evaluator_offloads_every_block():
    spec = tiny("mistral-7b", layers=3)
    ctx = Target(spec, parse_cluster("1xA100"), Workload(seq_len=256, global_batch=2))
    plan = Plan(precision="bf16-mixed", micro_batch=2)
    plain, off = estimate(plan, ctx), estimate(plan.replace(offload_activations=True), ctx)
    assert off.memory.activations < plain.memory.activations
    assert off.memory.host_bytes > plain.memory.host_bytes
    assert off.throughput.tokens_per_sec < plain.throughput.tokens_per_sec

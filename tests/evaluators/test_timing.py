"""The time model: work priced at the fitted rates (autofit/evaluators/timing.py).

What is checked here is mechanism, not accuracy: the accuracy against published runs is
``benchmarks/published_runs.py --throughput`` (results in benchmarks/results/).
"""

from __future__ import annotations

import dataclasses

import pytest

from autofit.evaluators import analytic, timing
from autofit.evaluators.timing import (
    Collective,
    PhaseWork,
    StepWork,
    TimeParams,
    Transfers,
    default_params,
    step_time,
)
from autofit.plan import Plan
from autofit.search.request import build_cluster
from autofit.specs import MODELS, ClusterSpec, Target, Workload, resolve_gpu


def _work(**kw) -> StepWork:
    base = dict(
        dtype="bf16",
        attention_kernel="flash",
        forward=PhaseWork(),
        backward=PhaseWork(),
        optimizer=PhaseWork(),
        micro_batches=1,
    )
    return StepWork(**{**base, **kw})


@pytest.mark.parametrize(
    "cc, gen",
    [
        ((7, 0), "volta"),
        ((7, 5), "turing"),
        ((8, 0), "ampere"),
        ((8, 6), "ampere"),
        ((8, 9), "ada"),
        ((9, 0), "hopper"),
        ((10, 0), "blackwell"),
        ((12, 0), "blackwell"),
    ],
)
def test_generation_of_each_capability(cc, gen):
    assert timing.generation(cc) == gen


def test_the_rates_are_fitted_data_with_provenance():
    p = default_params()
    assert set(timing.GENERATIONS) <= set(p.gemm_efficiency)
    assert set(timing.ATTENTION_KERNELS) <= set(p.attention_efficiency)
    prov = p.provenance
    assert prov["fitted"] and prov["rows"] > 100 and "published_runs.py" in prov["source"]
    assert 0 < prov["leave_one_source_out"]["median_abs_error"] < 1
    assert 0 < timing.time_error("analytic") < 0.5


def test_a_tiny_step_is_bound_by_the_host_issuing_kernels():
    cl = build_cluster("1xA100-80GB")
    p = default_params()
    tiny = _work(forward=PhaseWork(gemms=((2e6, 1e5, 16, 1),), kernels=5000))
    t = step_time(tiny, cl, p)
    assert t.step_s == pytest.approx(5000 * p.host_op_s + p.step_overhead_s, rel=1e-6)
    assert t.overhead_s > 0.9 * t.step_s
    big = _work(forward=PhaseWork(gemms=((2e15, 1e9, 4096, 1),), kernels=5000))
    tb = step_time(big, cl, p)
    assert tb.step_s > 2 * 5000 * p.host_op_s  # the device, not the host, bounds it


def test_gemm_efficiency_falls_with_the_smallest_dimension():
    cl = build_cluster("1xA100-80GB")
    wide = step_time(_work(forward=PhaseWork(gemms=((1e13, 1.0, 4096, 1),))), cl).compute_s
    narrow = step_time(_work(forward=PhaseWork(gemms=((1e13, 1.0, 16, 1),))), cl).compute_s
    assert narrow > 1.5 * wide


def test_a_collective_is_hidden_up_to_the_overlap_of_its_phase():
    cl = build_cluster("8xA100-80GB")
    p = default_params().with_values(comm_overlap=0.5, collective_latency_s=0.0)
    coll = Collective("reduce-scatter", 1e9, 1, "micro", ("backward",))
    alone = step_time(_work(transfers=Transfers((coll,))), cl, p).comm_s
    assert alone == pytest.approx(7 / 8 * 1e9 / (cl.gpu.intra_node_gbps * p.link_efficiency * 1e9))
    long_bwd = PhaseWork(memory_bytes=4 * alone * cl.gpu.memory_bw_gbps * 1e9 * p.memory_efficiency)
    assert step_time(_work(backward=long_bwd, transfers=Transfers((coll,))), cl, p).comm_s == 0.0
    short_bwd = dataclasses.replace(long_bwd, memory_bytes=long_bwd.memory_bytes / 8)  # half a collective
    assert step_time(_work(backward=short_bwd, transfers=Transfers((coll,))), cl, p).comm_s == pytest.approx(
        0.75 * alone, rel=1e-6
    )


def test_across_nodes_a_ring_runs_at_the_node_fabric():
    gpu = resolve_gpu("H100")
    coll = (Collective("all-gather", 1e9, 1, "step"),)
    p = default_params().with_values(collective_latency_s=0.0)
    one_node = step_time(_work(transfers=Transfers(coll)), ClusterSpec(gpu=gpu, gpus_per_node=8), p).comm_s
    slow = step_time(
        _work(transfers=Transfers(coll)), ClusterSpec(gpu=gpu, gpus_per_node=8, nodes=4, inter_node_gbps=25.0), p
    )
    dgx = step_time(
        _work(transfers=Transfers(coll)), ClusterSpec(gpu=gpu, gpus_per_node=8, nodes=4, inter_node_gbps=400.0), p
    )
    assert slow.comm_s > 5 * dgx.comm_s
    assert dgx.comm_s == pytest.approx(
        one_node * (31 / 32) / (7 / 8) * gpu.intra_node_gbps / min(400.0, gpu.intra_node_gbps)
    )


def test_attention_kernels_are_priced_by_kernel_and_generation():
    p = TimeParams.from_dict(
        {**default_params().as_dict(), "attention_efficiency": {"flash": 0.6, "flash@hopper": 0.3, "math": 0.2}}
    )
    attn = PhaseWork(attention=1e14)
    a100, h100 = build_cluster("1xA100-80GB"), build_cluster("1xH100")
    t = lambda cl, k: step_time(_work(attention_kernel=k, forward=attn), cl, p).compute_s  # noqa: E731
    assert t(a100, "flash") == pytest.approx(1e14 / (a100.gpu.peak_flops("bf16") * 0.6))
    assert t(h100, "flash") == pytest.approx(1e14 / (h100.gpu.peak_flops("bf16") * 0.3))
    assert t(a100, "efficient") == pytest.approx(1e14 / (a100.gpu.peak_flops("bf16") * 0.2))  # unknown: math's


def test_analytic_results_carry_the_time_error_and_their_work():
    cl = build_cluster("1xA100-80GB")
    ctx = Target(MODELS["llama-2-7b"], cl, Workload(seq_len=1024, global_batch=8), 0.05)
    plan = Plan(method="lora", lora_rank=8, precision="bf16-true", micro_batch=2, grad_accum=4)
    r = analytic.AnalyticEvaluator().evaluate(plan, ctx)
    assert r.extra["time_error"] == timing.time_error("analytic")
    w = analytic.work(plan, ctx)
    # LoRA: the frozen base's forward and input gradients, no weight gradients (~4 N T)
    n, tokens = MODELS["llama-2-7b"].linear_params(), 2 * 1024
    block = w.forward.gemm_flops + w.backward.gemm_flops
    assert 4 * n * tokens < block < 4.6 * n * tokens
    assert r.throughput.tokens_per_sec == pytest.approx(8 * 1024 / step_time(w, cl).step_s, rel=1e-9)


def test_the_simulated_work_agrees_with_the_analytic_count():
    """The simulator counts the traced ops; the analytic evaluator counts in closed form.
    Their GEMM FLOPs agree closely and their kernel counts within a third (the analytic
    count is Llama-3.2-1B's per block, applied to every family)."""
    from autofit.evaluators import simulated

    cl = build_cluster("1xA100-80GB")
    ctx = Target(MODELS["llama-3.2-1b"], cl, Workload(seq_len=256, global_batch=1), 0.05)
    plan = Plan(method="lora", lora_rank=8, precision="bf16-true", micro_batch=1, grad_accum=1)
    trace = simulated.run_trace(ctx.model, plan, ctx.workload, simulated.TraceDevice.of(cl.gpu))
    sim, ana = simulated.step_work(trace, plan, ctx), analytic.work(plan, ctx)
    for phase in ("forward", "backward"):
        s, a = getattr(sim, phase), getattr(ana, phase)
        assert s.gemm_flops == pytest.approx(a.gemm_flops, rel=0.05), phase
        assert s.kernels == pytest.approx(a.kernels, rel=0.35), phase
    assert sim.attention_kernel == ana.attention_kernel == "flash"

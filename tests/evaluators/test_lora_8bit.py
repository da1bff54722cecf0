"""lora-8bit: LoRA on LLM.int8 base weights (bitsandbytes ``Linear8bitLt``).

The simulated-vs-real CPU agreement runs in ``test_simulated.FAST`` and the analytic-vs-simulated
one in ``ANALYTIC_PLANS``; here, what each part of autofit takes from bitsandbytes: the layers
and their bytes, CUDA's ``MatMul8bitLt`` path in the trace, what it keeps through
checkpointing, and where the plan and the search refuse it.
"""

from __future__ import annotations

import pytest

from autofit.evaluators import analytic, costs
from autofit.evaluators import runtime as rt
from autofit.evaluators.memtrack import StorageTracker
from autofit.evaluators.simulated import TraceDevice, run_trace
from autofit.plan import Method, Plan, Sharding, plan_problems
from autofit.search.request import build_context
from autofit.search.space import Allowed, SearchSpace
from autofit.specs import Target, Workload, parse_cluster
from tests.conftest import tiny

PLAN = Plan(method="lora-8bit", lora_rank=8, precision="bf16-mixed", micro_batch=2)


def test_every_block_linear_is_an_int8_layer_with_its_row_scales():
    spec = tiny("mistral-7b", layers=2)
    model = rt.build_model(spec, PLAN)
    int8 = [
        m
        for m in model.modules()
        if type(m).__name__ == "Linear8bitLt" and type(m).__module__ == "bitsandbytes.nn.modules"
    ]
    wrapped = [m for m in model.modules() if type(m).__module__ == "peft.tuners.lora.bnb"]
    assert len(int8) == len(wrapped) == spec.num_layers * len(spec.linears())  # peft's own 8-bit wrapper
    # the bytes costs.state_bytes counts: int8 weights, one fp32 absmax a row, the rest in 16-bit
    buffers = {id(b) for b in model.buffers()}  # RoPE's frequencies: not weights
    held = sum(t.numel() * t.element_size() for t in rt.state_tensors(model) if id(t) not in buffers)
    assert held == costs.state_bytes(spec, PLAN).weights
    assert all(m.weight.dtype.is_floating_point is False for m in int8)


def test_a_cuda_trace_runs_matmul8bitlt_and_the_cpu_trace_does_not():
    """The CPU trains LLM.int8 through MatMul8bitFp (dequantize + linear); CUDA through
    MatMul8bitLt, whose int8 GEMM the trace costs with its FLOPs (evaluators/int8.py)."""
    spec = tiny("mistral-7b", layers=2)
    wl = Workload(seq_len=128, global_batch=2)
    tokens = 2 * 128
    cuda = run_trace(spec, PLAN, wl, TraceDevice("cuda", (8, 0)))
    cpu = run_trace(spec, PLAN, wl, TraceDevice("cpu"))
    gemms = sorted(f for op, f, *_ in cuda.ops.rows["forward"] if op == "int8_linear_matmul")
    want = sorted(2.0 * tokens * i * o for _, i, o, _ in spec.linears() for _ in range(spec.num_layers))
    assert gemms == want
    assert not any(op.startswith("int8_") for op, *_ in cpu.ops.rows["forward"])
    # the Python wrappers are not kernels; the quantization and the dequantization are
    names = {op for op, *_ in cuda.ops.rows["forward"]}
    assert {"int8_vectorwise_quant", "int8_mm_dequant"} <= names
    assert not names & {"int8_scaled_mm", "int8_mixed_scaled_mm"}


def _real_peak_activations(plan: Plan, spec, wl) -> float:
    model = rt.build_model(spec, plan)
    opt = rt.make_optimizer(plan, model)
    tr = StorageTracker()
    with tr:
        tr.track(rt.state_tensors(model), "weights")
        runner = rt.StepRunner(spec, plan, model, opt, tracker=tr)
        runner.step(rt.batches_for(spec, plan, wl, step=0), step=0)
    runner.close()
    return tr.snapshot().components["activations"]


def test_checkpointing_does_not_free_what_matmul8bit_keeps_on_its_ctx():
    """bitsandbytes keeps each Linear's input as a ctx attribute (``ctx.A`` on the CPU), which
    checkpointing's saved-tensor hooks never see: a checkpointed lora-8bit block keeps those
    inputs, which the analytic evaluator counts as ``_Saves.held``."""
    spec = tiny("llama-2-7b", layers=3)
    wl = Workload(seq_len=128, global_batch=2)
    lora = Plan(method="lora", lora_rank=8, precision="bf16-true", micro_batch=2, checkpointing="full")
    int8 = lora.replace(method="lora-8bit")
    extra = _real_peak_activations(int8, spec, wl) - _real_peak_activations(lora, spec, wl)
    blk, *_ = analytic._micro_batch(int8, Target(spec, parse_cluster("1xcpu"), wl))
    assert blk.held_tok > 0
    # at least every block but the one recomputed keeps its Linears' inputs (tokens × held bytes a
    # token) beyond what plain LoRA keeps; the recomputed one keeps a second set meanwhile
    assert extra >= (spec.num_layers - 1) * 256 * blk.held_tok


@pytest.mark.parametrize("sharding", ["zero3", "fsdp"])
def test_lora_8bit_is_refused_where_its_weights_would_be_sharded(sharding):
    ctx = build_context("mistral-7b", "2xA10")
    plan = PLAN.replace(micro_batch=1, grad_accum=8, sharding=sharding)
    problems = plan_problems(plan, ctx.model, ctx.cluster, ctx.workload)
    assert any("lora-8bit cannot shard its 8-bit weights" in p for p in problems), problems


def test_the_search_offers_lora_8bit_only_where_allowed_and_never_sharded():
    ctx = build_context("mistral-7b", "2xA10")
    default = list(SearchSpace(ctx).enumerate())
    assert not any(p.method is Method.LORA_8BIT for p in default)
    allowed = list(SearchSpace(ctx, Allowed.parse(methods="lora-8bit")).enumerate())
    assert allowed and all(p.method is Method.LORA_8BIT for p in allowed)
    assert {p.sharding for p in allowed} == {Sharding.NONE, Sharding.ZERO1, Sharding.ZERO2}
    assert {p.precision.value for p in allowed} == {"bf16-mixed"}

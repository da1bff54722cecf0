"""What a real GPU stack holds beyond the traced tensors, and the fit decision's margin.

The caching allocator's pool is replayed from the trace (``simulated.reserved``, the model
in ``allocator.py``, tested on its own in test_allocator.py); the cuBLAS workspaces are
allocated through it; LoRA dropout is a plan field that changes the activations; a
predicted fit carries the estimator's 95% margin from the published runs.
"""

from __future__ import annotations

import pytest

from autofit.errors import PlanError, SpecError
from autofit.evaluators import costs
from autofit.evaluators.allocator import replay
from autofit.evaluators.simulated import SimulatedEvaluator, TraceCache, TraceDevice, anatomy
from autofit.export import export_files
from autofit.plan import Plan
from autofit.results import MemoryAnatomy, Status, judge
from autofit.specs import Target, Workload, parse_cluster
from autofit.techniques import lora_kwargs
from tests.conftest import tiny

MiB = 2**20


def _target(gpus="1xA100-40GB", seq=128):
    return Target(tiny("llama-3-8b"), parse_cluster(gpus), Workload(seq_len=seq, global_batch=2), 0.05)


LORA = Plan(method="lora", lora_rank=8, precision="bf16-true", micro_batch=2, grad_accum=1)


# -- LoRA dropout ---------------------------------------------------------------------------
def test_lora_dropout_is_a_plan_field_peft_receives():
    plan = LORA.replace(lora_dropout=0.05)
    assert lora_kwargs(tiny("llama-3-8b"), plan)["lora_dropout"] == 0.05
    assert "dropout 0.05" in plan.summary()
    assert Plan.from_dict(plan.as_dict()) == plan


def test_lora_dropout_at_peft_default_keeps_stored_plan_ids():
    assert "lora_dropout" not in LORA.as_dict()
    assert LORA.replace(lora_dropout=0.1).plan_id != LORA.plan_id


@pytest.mark.parametrize("bad", [-0.1, 1.0, "0.1", True])
def test_lora_dropout_out_of_range_is_refused(bad):
    with pytest.raises(PlanError, match="lora_dropout"):
        LORA.replace(lora_dropout=bad)


def test_lora_dropout_keeps_a_dropped_copy_per_adapter():
    ctx = _target()
    ev = SimulatedEvaluator()
    base = ev.evaluate(LORA, ctx).memory
    dropped = ev.evaluate(LORA.replace(lora_dropout=0.1), ctx).memory
    # every adapted Linear keeps its own dropped input (16-bit) and a bool mask for backward
    assert dropped.activations > base.activations


# -- the caching allocator replay -------------------------------------------------------------
def test_simulated_reserved_is_the_replay_of_the_trace():
    ctx = _target()
    trace = TraceCache().get(ctx.model, LORA, ctx.workload, TraceDevice.of(ctx.cluster.gpu))
    mem, _ = anatomy(trace, LORA, ctx)
    ws = costs.cublas_workspace_bytes(ctx.cluster.gpu.compute_capability)
    log = [(-1, ws), (-2, ws), *trace.log]
    rep = replay(log)
    assert mem.peak_allocated == rep.peak_allocated
    assert mem.peak_reserved == rep.peak_reserved >= mem.peak_allocated
    assert mem.temporary >= 2 * ws  # the workspaces count as allocated


def test_cublas_workspace_follows_torch_defaults():
    # CublasHandlePool.cpp parseChosenWorkspaceSize: ":4096:2:16:8", and 32 MiB on sm90
    assert costs.cublas_workspace_bytes((8, 0)) == 8 * MiB + 128 * 1024
    assert costs.cublas_workspace_bytes((9, 0)) == 32 * MiB


def test_expandable_segments_from_the_environment_change_reserved(monkeypatch):
    ctx = _target(seq=256)
    plan = Plan(precision="bf16-true", micro_batch=2, grad_accum=1)
    default = SimulatedEvaluator().evaluate(plan, ctx)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    expandable = SimulatedEvaluator().evaluate(plan, ctx)
    assert expandable.extra["allocator_conf"] == "expandable_segments:True"
    assert expandable.memory.peak_allocated == default.memory.peak_allocated
    assert expandable.memory.peak_reserved <= default.memory.peak_reserved


def test_a_bad_allocator_setting_is_the_users_error(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:lots")
    with pytest.raises(SpecError, match="max_split_size_mb"):
        SimulatedEvaluator().evaluate(LORA, _target())


def test_the_export_says_which_allocator_setting_was_assumed(monkeypatch):
    ctx = _target()
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert "default caching allocator" in export_files(LORA, ctx)["README.md"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in export_files(LORA, ctx)["README.md"]


# -- the fit margin ---------------------------------------------------------------------------
def _anatomy(total: int) -> MemoryAnatomy:
    return MemoryAnatomy(
        weights=total, gradients=0, optimizer=0, activations=0, temporary=0, logits=0, overhead=0,
        peak_allocated=total, peak_reserved=total, device_total=total,
    )  # fmt: skip


def test_a_close_fit_says_it_would_not_fit_with_the_margin():
    ctx = _target("1xA100-40GB")
    close = _anatomy(int(ctx.budget_bytes * 0.95))
    assert judge(close, ctx)[0] is Status.FITS
    said = costs.fit_margin_extra(0.10, close, ctx.budget_bytes)["fit_margin"]
    assert said["bytes"] == int(close.device_total * 0.10) and not said["fits_with_margin"]
    assert costs.fit_margin_extra(0.01, close, ctx.budget_bytes)["fit_margin"]["fits_with_margin"]
    assert costs.fit_margin_extra(0.0, close, ctx.budget_bytes) == {}


def test_the_cpu_target_has_no_margin():
    assert costs.fit_margin("simulated", "cpu") == 0.0
    assert costs.fit_margin("measured", "cuda") == 0.0


def test_estimates_on_a_gpu_carry_their_margin():
    ctx = _target()
    margin = costs.fit_margin("simulated", "cuda")
    result = SimulatedEvaluator().evaluate(LORA, ctx)
    if margin:
        fm = result.extra["fit_margin"]
        assert fm["fraction"] == margin and fm["bytes"] == int(result.memory.device_total * margin)
        assert fm["fits_with_margin"] == (result.memory.device_total + fm["bytes"] <= ctx.budget_bytes)
    else:
        assert "fit_margin" not in result.extra

"""On a CUDA GPU: the measured evaluator runs real steps there, and the simulator predicts them.

Skipped, with the reason, on machines without a CUDA GPU (CI and the development machines
here have none). ``benchmarks/gpu_check.sh`` is the longer comparison on a real model.
"""

from __future__ import annotations

import pytest

from autofit.evaluators.measured import local_gpus
from autofit.plan import Plan
from autofit.results import Status
from autofit.specs import Target, Workload, parse_cluster
from tests.conftest import tiny

GPUS = local_gpus()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not GPUS, reason="needs a CUDA GPU visible to torch; this machine has none"),
    pytest.mark.skipif(bool(GPUS) and GPUS[0] is None, reason="the local GPU is not in autofit's catalog"),
]

PLANS = {
    "full-mixed": Plan(precision="bf16-mixed", micro_batch=2, grad_accum=2, attention="sdpa"),
    "full-ckpt": Plan(precision="bf16-mixed", micro_batch=2, grad_accum=2, attention="sdpa", checkpointing="full"),
    "lora": Plan(method="lora", lora_rank=8, precision="bf16-mixed", micro_batch=2, grad_accum=2, attention="sdpa"),
    "qlora": Plan(method="qlora", lora_rank=8, precision="bf16-mixed", micro_batch=2, grad_accum=2, attention="sdpa"),
    # the tracked steps run evaluators/compiled.py's stand-in, the timed ones torch.compile's code
    "compiled": Plan(precision="bf16-mixed", micro_batch=2, grad_accum=2, attention="sdpa", torch_compile=True),
}


def gpu_ctx() -> Target:
    # a model big enough that the allocator's rounding and the CUDA context are not the whole story
    spec = tiny(
        "mistral-7b", layers=4, hidden_size=1024, intermediate_size=2816, num_heads=16, head_dim=64, vocab_size=8000
    )
    return Target(spec, parse_cluster(f"1x{GPUS[0].name}"), Workload(seq_len=512, global_batch=4))


def test_auto_measures_on_the_local_gpu():
    from autofit.evaluators import resolve_evaluator

    assert resolve_evaluator("auto", gpu_ctx()) == "measured"


@pytest.mark.parametrize("name", list(PLANS))
def test_measured_on_the_gpu_and_the_simulator_agree(name, tmp_path):
    from autofit.evaluators.measured import MeasuredEvaluator
    from autofit.evaluators.simulated import SimulatedEvaluator

    ctx, plan = gpu_ctx(), PLANS[name]
    real = MeasuredEvaluator(timeout_s=300, work_dir=tmp_path).evaluate(plan, ctx)
    assert real.status is Status.FITS, (real.reason, real.extra.get("stderr_tail"))
    m = real.memory
    assert 0 < m.peak_allocated <= m.peak_reserved < m.device_total  # CUDA context and NCCL are on top
    assert real.tokens_per_sec > 0 and real.extra["engine"]["world_size"] == 1

    sim = SimulatedEvaluator().evaluate(plan, ctx)
    assert sim.memory is not None, sim.reason
    # the CPU grid is byte-exact (test_simulated.py); on CUDA the kernels' workspaces are
    # substituted, so the bound is looser: 10% of the peak, and the reserved figure too
    assert sim.memory.peak_allocated == pytest.approx(m.peak_allocated, rel=0.10)
    assert sim.memory.peak_reserved == pytest.approx(m.peak_reserved, rel=0.10)


def test_a_compiled_plan_runs_torch_compile_in_its_timed_steps(tmp_path):
    """After its tracked steps (the stand-in), the child compiles the blocks with inductor in one
    untimed step; the compiled steps' own peak is kept, and is at most the run's."""
    from autofit.evaluators.measured import MeasuredEvaluator

    real = MeasuredEvaluator(timeout_s=600, work_dir=tmp_path).evaluate(PLANS["compiled"], gpu_ctx())
    assert real.status is Status.FITS, (real.reason, real.extra.get("stderr_tail"))
    memory = real.extra["ranks"][0]["memory"]
    assert 0 < memory["compiled_peak_allocated"] <= memory["peak_allocated"]
    assert memory["standin_peak_allocated"] <= memory["peak_allocated"]

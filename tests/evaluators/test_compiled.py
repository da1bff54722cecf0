"""torch.compile of the blocks: the stand-in (evaluators/compiled.py) against inductor on real CPU
tensors, the fusion count, and what the estimators make of it."""

import functools
import shutil

import pytest
import torch

from autofit.errors import PlanError
from autofit.evaluators import compiled
from autofit.evaluators import runtime as rt
from autofit.evaluators.analytic import AnalyticEvaluator, estimate
from autofit.evaluators.simulated import SimulatedEvaluator, TraceCache
from autofit.plan import Plan, plan_problems, validate_plan
from autofit.specs import Target, Workload, parse_cluster
from tests.conftest import tiny

PLANS = [
    Plan(precision="bf16-true", micro_batch=2),
    Plan(precision="32-true", attention="eager", micro_batch=2),  # inductor rewrites the scores into sdpa
    Plan(precision="bf16-mixed", micro_batch=2),
    Plan(method="lora", lora_rank=8, precision="bf16-true", micro_batch=2),
]


@functools.cache
def _block_saves(spec, plan, how: str) -> tuple[int, tuple[torch.Tensor, ...]]:
    """Bytes of the distinct storages the first block saves for backward (parameters left out), and
    its parameters' gradients, on real CPU tensors (each run once: the eager and stand-in runs serve
    both tests below)."""
    torch.manual_seed(0)
    net = rt.build_model(spec, plan)
    block = [m for m in net.modules() if type(m).__name__ == spec.family.decoder_layer][0]
    if how == "inductor":
        block.compile(backend="inductor")
    elif how == "stand-in":
        compiled.CompiledBlocks([block])
    batch = rt.batches_for(spec, plan, Workload(seq_len=128, global_batch=2))[0]
    own = {t.untyped_storage()._cdata for t in rt.state_tensors(net)}
    inside, seen = [False], {}

    def pack(t):
        key = t.untyped_storage()._cdata
        if inside[0] and key not in own:
            seen[key] = t.untyped_storage().nbytes()
        return t

    block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    block.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    dtype = rt.layout(plan).autocast_dtype
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = net(**batch, use_cache=False)
    out.loss.backward()
    return sum(seen.values()), tuple(p.grad.clone() for p in block.parameters() if p.grad is not None)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="inductor needs a C compiler")
@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.summary())
def test_the_stand_in_saves_what_inductor_saves(plan):
    """The stand-in's partitioned block keeps, to the byte, what torch.compile with inductor keeps,
    and less than eager does."""
    spec = tiny("llama-3.2-1b", layers=1)
    eager, _ = _block_saves(spec, plan, "eager")
    inductor, _ = _block_saves(spec, plan, "inductor")
    stand_in, _ = _block_saves(spec, plan, "stand-in")
    assert stand_in == inductor < eager


@pytest.mark.parametrize("plan", PLANS[:2], ids=lambda p: p.summary())
def test_the_stand_in_computes_eager_gradients(plan):
    spec = tiny("llama-3.2-1b", layers=1)
    _, eager = _block_saves(spec, plan, "eager")
    _, stand_in = _block_saves(spec, plan, "stand-in")
    assert len(eager) == len(stand_in) > 0
    for a, b in zip(eager, stand_in):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-5)


def test_fusion_counts_one_kernel_per_chain_between_library_calls():
    def f(x, w, b):
        y = (x * 2 + b).relu()  # one kernel: reads x and b, writes y
        z = y @ w  # a library GEMM
        return (z.exp() / z.sum(-1, keepdim=True),)  # one kernel: reads z, writes the output

    x, w, b = torch.randn(8, 4), torch.randn(4, 4), torch.randn(4)
    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(x, w, b)
    k = compiled.fused_kernels(gm)
    assert k.count == 2
    assert k.nbytes == (32 + 4 + 32) * 4 + (32 + 32) * 4
    assert compiled.extern_kernels(gm) == 1


def test_compiled_blocks_save_less_and_run_faster_in_both_estimators():
    spec = tiny("llama-3.2-1b", layers=3)
    ctx = Target(spec, parse_cluster("1xH100"), Workload(seq_len=256, global_batch=4))
    cache = TraceCache()
    out = {}
    for on in (False, True):
        plan = Plan(precision="bf16-true", micro_batch=2, grad_accum=2).replace(torch_compile=on)
        out[on] = SimulatedEvaluator(cache).evaluate(plan, ctx), estimate(plan, ctx)
    for i in range(2):
        eager, comp = out[False][i], out[True][i]
        assert comp.memory.activations < 0.85 * eager.memory.activations
        assert comp.throughput.tokens_per_sec > eager.throughput.tokens_per_sec
    sim, ana = out[True]
    assert ana.memory.peak_allocated == pytest.approx(sim.memory.peak_allocated, rel=0.02)
    assert ana.throughput.tokens_per_sec == pytest.approx(sim.throughput.tokens_per_sec, rel=0.08)


def test_what_compile_is_not_modelled_with_is_refused():
    spec = tiny("llama-3.2-1b")
    with pytest.raises(PlanError) as err:
        validate_plan(
            Plan(method="qlora", lora_rank=8, precision="bf16-mixed").replace(torch_compile=True, fused_kernels=True),
            spec,
            parse_cluster("1xH100"),
            Workload(seq_len=256, global_batch=1),
        )
    lines = str(err.value)
    assert "--torch-compile is not modelled with 4-bit base weights (qlora)" in lines
    assert "--torch-compile is not modelled with --fused-kernels" in lines


def test_moe_experts_compile_in_bf16_only_and_the_screen_offers_no_other():
    """The grouped GEMM's fake kernel takes bf16 only, and AOTAutograd traces through it: an MoE
    plan whose experts run in fp32 (full fine-tuning in bf16-mixed on one GPU keeps fp32 weights) or
    fp16 is refused with --torch-compile, and the search does not offer it there; the screen of an
    MoE model on a GPU runs (it crashed on those plans before)."""
    from autofit.search.space import SearchSpace

    spec = tiny("qwen1.5-moe-a2.7b")
    target = (spec, parse_cluster("1xH100"), Workload(seq_len=256, global_batch=1))
    with pytest.raises(PlanError, match="not modelled for MoE experts outside bf16"):
        validate_plan(Plan(precision="bf16-mixed", torch_compile=True), *target)
    validate_plan(Plan(method="lora", lora_rank=8, precision="bf16-mixed", torch_compile=True), *target)
    plans = list(SearchSpace(Target(*target)).enumerate())
    compiled = [p for p in plans if p.torch_compile]
    assert compiled and all(not plan_problems(p, *target) for p in compiled)
    assert {p.method.value for p in compiled} == {"full", "lora"}
    ev = AnalyticEvaluator()
    assert all(ev.evaluate(p, Target(*target)).memory is not None for p in compiled[:: max(1, len(compiled) // 12)])


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "fp16-mixed"])
@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("sharding", ["none", "zero2", "fsdp"])
def test_experts_in_bf16_is_the_dtype_layouts_base(precision, method, sharding):
    from autofit.plan import experts_in_bf16
    from autofit.techniques import dtype_layout

    plan = Plan(method=method, lora_rank=8 if method == "lora" else None, precision=precision, sharding=sharding)
    assert experts_in_bf16(plan.precision, plan.method, plan.sharding) == (dtype_layout(plan).base == "bfloat16")


def test_plan_id_is_unchanged_without_compile():
    plan = Plan(precision="bf16-true")
    assert "torch_compile" not in plan.as_dict()
    assert plan.replace(torch_compile=True).plan_id != plan.plan_id
    assert "compiled" in plan.replace(torch_compile=True).summary()


@pytest.mark.parametrize("plan", [PLANS[0], PLANS[3]], ids=lambda p: p.summary())
def test_one_census_at_a_prime_length_gives_the_two_length_terms(plan):
    """The analytic's single compiled census (terms told apart by divisibility by the prime length)
    agrees with two censuses of the compiled block at 256 and 512 tokens."""
    from autofit.evaluators import traced

    spec = tiny("llama-3.2-1b", layers=1)
    compiled_plan = plan.replace(torch_compile=True)
    _, tok, quad = traced.compiled_work(spec, compiled_plan, False, (9, 0)).saved
    two_lengths = traced._terms(spec, traced._census_plan(compiled_plan), False, (9, 0))
    assert (tok, quad) == pytest.approx(two_lengths, rel=1e-3)  # (the two-length fit spreads a scalar)
    assert traced.compile_delta(spec, compiled_plan, False, (9, 0))[0] < 0


def test_the_reports_toggles_drop_compile_where_a_technique_cannot_have_it():
    from autofit.report import analysis

    spec = tiny("llama-3.2-1b")
    ctx = Target(spec, parse_cluster("1xH100"), Workload(seq_len=256, global_batch=2))
    plan = Plan(method="lora", lora_rank=16, precision="bf16-mixed", micro_batch=2).replace(torch_compile=True)
    effects = analysis.technique_effects(plan, ctx, {"methods": ["lora", "qlora"], "lora_ranks": [16]})
    (qlora,) = [t for t in effects.toggles if t.technique == "method"]
    assert qlora.label == "method lora → qlora (without torch.compile)" and not qlora.plan.torch_compile
    (compile_off,) = [t for t in effects.toggles if t.technique == "torch.compile"]
    assert compile_off.memory_delta > 0  # eager keeps more for backward


@pytest.mark.parametrize("checkpointing", ["none", "full", "ops"])
def test_a_runner_swaps_the_stand_in_for_torch_compile_once_untracked(checkpointing):
    """A measured run's tracked steps run the stand-in (dynamo compiles nothing under the tracker);
    then ``compile_blocks`` compiles every block in place, as accelerate's regional compilation does,
    and the steps after it run through dynamo (here its ``aot_eager`` backend: inductor's C++ compile
    would take minutes on the CPU). Checkpointing is re-enabled without the tracker's recompute
    contexts, whose ``context_fn`` dynamo refuses. The same batches give the same losses either way.
    A checkpointed block (every block, or under the op-level policy) compiles whole, with no graph
    break: without ``runtime.compile_checkpointed_blocks`` dynamo would break at transformers'
    output capturing inside the checkpoint and run the block eagerly (FIELD-NOTES, 2026-12-06)."""
    from autofit.evaluators.memtrack import StorageTracker

    spec = tiny("llama-3.2-1b", layers=2)
    policy = {"checkpointing": "selective", "checkpoint_ops": True} if checkpointing == "ops" else {}
    plan = Plan(method="lora", lora_rank=8, precision="32-true", micro_batch=2, checkpointing="none")
    plan = plan.replace(torch_compile=True, **({"checkpointing": checkpointing} | policy))
    workload = Workload(seq_len=64, global_batch=2)
    losses = {}
    counters = torch._dynamo.utils.counters  # (across tests: counted as differences)
    for swap in (False, True):
        graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = rt.build_model(spec, plan)
        runner = rt.StepRunner(spec, plan, model, rt.make_optimizer(plan, model), tracker=StorageTracker())
        with runner.tracker:
            for step in range(2):
                runner.step(rt.batches_for(spec, plan, workload, step=step), step=step)
        blocks = runner._compiled.blocks
        assert all("forward" in vars(b) for b in blocks)  # the stand-in's
        if swap:
            assert runner.compile_blocks(backend="aot_eager")
            assert not any("forward" in vars(b) for b in blocks) and all(b._compiled_call_impl for b in blocks)
            assert not runner.compile_blocks(backend="aot_eager")  # once
        losses[swap] = [float(runner.step(rt.batches_for(spec, plan, workload, step=s), step=s)) for s in (2, 3)]
        runner.close()
        # the stand-in is AOTAutograd's, without dynamo
        graphs = counters["stats"]["unique_graphs"] - graphs
        assert graphs >= 1 if swap else graphs == 0, (swap, graphs)
        assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)

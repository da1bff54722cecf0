"""Stacks whose layers mix tokens with something other than softmax attention (``specs/derive.py``'s
mixers: Mamba and Mamba-2, the gated delta rule, short convolutions), beside attention layers or in
them: read from transformers' model, traced as its torch code runs, and the analytic block taken
from one traced block, its transients and kernels too (``traced.mixer_work``)."""

from __future__ import annotations

import functools

import pytest
import torch

from autofit.errors import CensusError
from autofit.evaluators import runtime as rt
from autofit.evaluators import traced, unroll
from autofit.plan import Plan
from autofit.specs import ModelSpec, Target, Workload, parse_cluster
from tests.evaluators.test_derived import MOE_ANALYTIC
from tests.evaluators.test_simulated import TraceDevice, assert_matches, measure, run_trace

LINEAR4 = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
SIZES = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32, intermediate_size=704)
# each type's own config keys, at tiny sizes; an attention layer in each
MIXED = {
    "qwen3_next": dict(
        num_hidden_layers=4,
        layer_types=LINEAR4,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=192,
        shared_expert_intermediate_size=192,
    ),
    # Mamba layers, attention at layer 2, experts every other layer: its three kinds in the fewest layers
    # with Mamba on both sides of the attention (a Mamba layer's trace loops over the tokens)
    "jamba": dict(
        num_hidden_layers=4,
        attn_layer_period=4,
        attn_layer_offset=2,
        mamba_d_state=16,
        mamba_dt_rank=16,
        num_experts=4,
        num_experts_per_tok=2,
    ),
    "lfm2": dict(
        num_hidden_layers=4,
        layer_types=["conv", "conv", "full_attention", "conv"],
        block_auto_adjust_ff_dim=False,
        block_ff_dim=704,
    ),
    "bamba": dict(num_hidden_layers=4, attn_layer_indices=[2], mamba_n_heads=8, mamba_d_head=64, mamba_d_state=16),
    # Mamba-2 beside attention in every layer
    "falcon_h1": dict(num_hidden_layers=2, mamba_n_heads=8, mamba_d_head=32, mamba_d_ssm=256, mamba_d_state=16),
    # one mixer a layer: Mamba-2, MLP, attention, MLP
    "nemotron_h": dict(
        num_hidden_layers=4,
        hybrid_override_pattern="M-*-",
        mamba_num_heads=8,
        mamba_head_dim=32,
        ssm_state_size=16,
        n_groups=1,
        chunk_size=64,
    ),
}
SLOW = {"jamba"}  # its Mamba mixer's torch code loops over the tokens: seconds a Mamba layer a plan


@functools.cache
def tiny_mixed(model_type: str) -> ModelSpec:
    from transformers import AutoConfig

    d = AutoConfig.for_model(model_type).to_dict()
    d.update(**SIZES, vocab_size=1000, **MIXED[model_type])
    d.pop("layers_block_type", None)  # Nemotron-H's, from its default pattern
    d.update({k: None for k in ("pad_token_id", "bos_token_id", "eos_token_id") if (d.get(k) or 0) >= 1000})
    return ModelSpec.from_hf_config(d, name=f"tiny-{model_type}")


@pytest.mark.parametrize("model_type", sorted(MIXED))
def test_a_mixed_stack_counts_what_transformers_builds(model_type):
    from transformers import AutoModelForCausalLM

    spec = tiny_mixed(model_type)
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(spec.to_hf_config())
    assert spec.n_params == sum(p.numel() for p in built.parameters())
    kinds = [k for _, k in spec.layer_kinds()]
    mixers = [k for k in kinds if k.mixer]
    assert mixers and all(k.analytic_gap.startswith("it mixes tokens with a token mixer") for k in mixers)
    assert any(k.attends for k in kinds) and 0 < spec.attending_layers < spec.num_layers or model_type == "falcon_h1"
    assert "estimated as their torch code runs" in spec.mixer_assumption


@pytest.mark.parametrize("model_type,frozen", [("falcon_h1", ["mamba.out_proj"]), ("nemotron_h", ["mixer.out_proj"])])
def test_lora_leaves_what_peft_refuses_in_a_mamba_model(model_type, frozen):
    """PEFT refuses LoRA on a Mamba mixer's ``out_proj`` in these types (it raised, and every LoRA
    plan failed): the spec leaves it frozen, and PEFT adapts exactly what the spec counts."""
    spec = tiny_mixed(model_type)
    assert [n for n, _, _, part in spec.linears() if part == "frozen"] == frozen
    plan = Plan(method="lora", lora_rank=8, precision="bf16-true", micro_batch=1)
    net = rt.build_model(spec, plan, device="meta")
    assert sum(p.numel() for p in net.parameters() if p.requires_grad) == spec.lora_params(8, plan.lora_targets)


PLANS = [
    Plan(precision="bf16-true", micro_batch=2),
    Plan(method="lora", lora_rank=8, precision="bf16-mixed", micro_batch=2),
    Plan(method="qlora", lora_rank=8, precision="bf16-mixed", micro_batch=2, checkpointing="full"),
]
SIMULATED = [("qwen3_next", 0), ("qwen3_next", 1), ("lfm2", 1), ("bamba", 2), ("falcon_h1", 1), ("nemotron_h", 0)]


@pytest.mark.parametrize("model_type,plan", [*SIMULATED, pytest.param("jamba", 1, marks=pytest.mark.slow)])
def test_simulated_traces_the_real_step_of_a_mixed_stack(model_type, plan):
    """The fake trace of transformers' torch code for each mixer is the real CPU step (peak within 2%,
    components 5%): the simulator needs nothing of the mixers but their ops."""
    spec, plan = tiny_mixed(model_type), PLANS[plan]
    workload = Workload(seq_len=128, global_batch=plan.micro_batch)
    assert_matches(measure(spec, plan, workload), run_trace(spec, plan, workload, TraceDevice("cpu")))


def assert_analytic_agrees(spec: ModelSpec, plans: list[Plan]) -> None:
    """Against the simulated trace on an A100: each mixer kind's saves, transients, kernels and own
    products from one traced block. The peak never under and at most 30% over (measured 1.01-1.26:
    every save of the block beside its worst transient, where the trace frees some before it); the
    weights at the peak within 2%, or over by autocast's copies where the analytic peak is in the
    forward (Falcon-H1: 18%); the optimizer's states within 1% (allocator blocks); FLOPs within 12%
    (a checkpoint's recompute stops early in the trace); tokens/s within 10% (0.92-1.05)."""
    from autofit.evaluators.analytic import AnalyticEvaluator
    from autofit.evaluators.simulated import SimulatedEvaluator, TraceCache

    cache = TraceCache()
    for plan in plans:
        ctx = Target(spec, parse_cluster("1xA100"), Workload(seq_len=256, global_batch=plan.micro_batch))
        sim, ana = SimulatedEvaluator(cache).evaluate(plan, ctx), AnalyticEvaluator().evaluate(plan, ctx)
        assert 1.0 <= ana.memory.peak_allocated / sim.memory.peak_allocated <= 1.3, plan.summary()
        assert 0.98 <= ana.memory.weights / sim.memory.weights <= 1.2
        assert ana.memory.optimizer == pytest.approx(sim.memory.optimizer, rel=0.01)
        assert ana.throughput.flops_per_step == pytest.approx(sim.throughput.flops_per_step, rel=0.12)
        assert ana.throughput.tokens_per_sec == pytest.approx(sim.throughput.tokens_per_sec, rel=0.1)
        assert sim.extra["mixer"] == ana.extra["mixer"] == spec.mixer_assumption


@pytest.mark.parametrize("model_type", sorted(set(MIXED) - SLOW))
def test_the_analytic_answer_on_a_mixed_stack(model_type):
    """Five plans: full, LoRA and QLoRA with checkpointing, 8-bit Adam, eager attention."""
    plans = [*MOE_ANALYTIC, Plan(precision="bf16-mixed", micro_batch=2, attention="eager")]
    assert_analytic_agrees(tiny_mixed(model_type), plans)


@pytest.mark.slow
def test_the_analytic_answer_on_jamba():
    """Jamba's Mamba mixer, whose torch code loops over the tokens (seconds a Mamba layer), on
    LoRA with checkpointing. About 45 s alone, 60-85 s beside another worker: the trace and
    the censuses loop over 256 tokens, and fewer do not hold the bounds (at 128 tokens the analytic
    peak of Bamba's and Falcon-H1's Mamba-2 blocks is 7-16% under the trace)."""
    assert_analytic_agrees(tiny_mixed("jamba"), [MOE_ANALYTIC[1]])


def test_a_weight_the_mixer_reads_itself_is_no_lora_target_and_refuses_quantization():
    """Jamba's Mamba mixer multiplies by ``dt_proj.weight`` itself, never calling ``dt_proj``: LoRA on
    it would get no gradient (the trace: 12% of the adapters' optimizer states missing), and
    bitsandbytes' 4-bit codes meet the product (the real step raises "expected scalar type
    torch.uint8"). So no target names it, and 8- or 4-bit plans are refused in one line."""
    from autofit.plan import plan_problems

    spec = tiny_mixed("jamba")
    assert spec.uncalled_linears == ("mamba.dt_proj",)
    assert ("mamba.dt_proj", 16, 512, "frozen") in spec.linears()
    lora = Plan(method="lora", lora_rank=8, precision="bf16-true", micro_batch=1)
    net = rt.build_model(spec, lora, device="meta")
    assert not any("dt_proj" in n for n, p in net.named_parameters() if p.requires_grad)
    assert sum(p.numel() for p in net.parameters() if p.requires_grad) == spec.lora_params(8, lora.lora_targets)
    cluster, workload = parse_cluster("1xA100"), Workload(256, 1)
    for method in ("qlora", "lora-8bit"):
        problems = plan_problems(lora.replace(method=method), spec, cluster, workload)
        assert any(p.startswith("jamba's blocks read mamba.dt_proj's weight themselves") for p in problems)
    assert not plan_problems(lora, spec, cluster, workload)
    assert not tiny_mixed("bamba").uncalled_linears  # Mamba-2 calls every Linear it has


def test_a_mixer_kind_is_censused_in_its_own_layer():
    """Each kind is traced in a stack cut after its first layer: Nemotron-H's config takes its depth
    from its pattern, which ``unroll.cut`` cuts too; a cut that does not end in the kind's layer is
    refused, not counted as the wrong layer's."""
    spec = tiny_mixed("nemotron_h")
    kinds = {k.first_layer: k for _, k in spec.layer_kinds()}
    assert sorted(kinds) == [0, 1, 2]
    for first, k in kinds.items():
        cut = unroll.cut(k, first + 1).to_hf_config()
        assert cut.num_hidden_layers == first + 1 and len(cut.layers_block_type) == first + 1
    saves = {first: traced.block_terms(k, PLANS[0], True, (8, 0)) for first, k in kinds.items()}
    assert len(set(saves.values())) == 3  # three kinds, three blocks' saves
    bad = unroll.cut(kinds[0], 4)  # layer 3, an MLP layer, where the Mamba kind's census looks
    with pytest.raises(CensusError, match="cut after layer 0 does not end in that layer"):
        traced._run_census(bad, PLANS[0], 128, True, (8, 0), False, False)


@pytest.mark.slow
def test_a_mixer_that_loops_over_the_tokens_issues_kernels_per_token():
    """Jamba's Mamba mixer runs its selective scan token by token in torch: its kernels grow with the
    sequence; LFM2's short convolution and the delta rule's chunks do not (but per chunk)."""
    cpu = (True, (8, 0))
    jamba = traced.mixer_work(tiny_mixed("jamba").layer_kinds()[0][1], PLANS[0], *cpu)
    lfm2 = traced.mixer_work(tiny_mixed("lfm2").layer_kinds()[0][1], PLANS[0], *cpu)
    assert jamba.fwd_kernels[1] >= 3 and jamba.bwd_kernels[1] >= 3
    assert lfm2.fwd_kernels[1] == lfm2.bwd_kernels[1] == 0
    assert lfm2.fwd_tok > 0 and lfm2.bwd_tok > 0 and jamba.bwd_tok > lfm2.bwd_tok


@pytest.mark.parametrize("model_type", ["lfm2", "glm4_moe"])
def test_a_compiled_plan_of_a_stack_of_several_kinds_is_censused_on_its_main_kind(model_type):
    """A ``torch_compile`` plan's census runs on the stack's most common kind (the screen of LFM2
    crashed: the stack was cut to one layer, leaving the other kinds none)."""
    from autofit.evaluators.analytic import AnalyticEvaluator
    from tests.evaluators.test_derived import tiny_hybrid

    spec = tiny_mixed(model_type) if model_type in MIXED else tiny_hybrid(model_type)
    plan = Plan(precision="bf16-true", micro_batch=1, torch_compile=True)
    ana = AnalyticEvaluator().evaluate(plan, Target(spec, parse_cluster("1xA100"), Workload(256, 1)))
    assert ana.memory is not None and ana.throughput.tokens_per_sec > 0, ana.reason


@pytest.mark.parametrize("model_type", ["bamba", "falcon_h1"])
def test_a_mamba_block_moves_what_its_trace_moves(model_type):
    """The analytic step's memory-bound bytes, forward and backward, are the trace's within 10% on a
    stack of Mamba-2 mixers (measured 0.93-1.02): a mixer's block moves what its census moved, not
    the formulas' multiple of its saves, which gave 0.23-0.42 (a Mamba scan's torch code writes and
    reads far more than the block saves)."""
    from autofit.evaluators import analytic, simulated

    spec = tiny_mixed(model_type)
    for plan in PLANS:
        ctx = Target(spec, parse_cluster("1xA100"), Workload(seq_len=256, global_batch=plan.micro_batch))
        ana = analytic.work(plan, ctx)
        sim = simulated.step_work(run_trace(spec, plan, ctx.workload, TraceDevice.of(ctx.cluster.gpu)), plan, ctx)
        for phase in ("forward", "backward"):
            ratio = getattr(ana, phase).memory_bytes / getattr(sim, phase).memory_bytes
            assert 0.9 <= ratio <= 1.1, (plan.summary(), phase, ratio)


def test_a_mixer_is_censused_over_several_chunks_of_its_scan():
    """A chunked scan of one chunk passes no state between chunks and saves less a token (Falcon-H1's
    chunks are 256 tokens): the census lengths hold 2, 3 and 4 chunks, and the three fit each
    value's terms exactly (per micro-batch, per token, per token per attended position)."""
    kinds = {t: next(k for _, k in tiny_mixed(t).layer_kinds() if k.mixer) for t in ("falcon_h1", "nemotron_h", "lfm2")}
    assert traced.mixer_lengths(kinds["falcon_h1"]) == (512, 768, 1024)  # mamba_chunk_size 256
    assert traced.mixer_lengths(kinds["nemotron_h"]) == (256, 384, 512)  # chunk_size 64: at least 128 tokens
    assert traced.mixer_lengths(kinds["lfm2"]) == (256, 384, 512)  # no chunks
    lengths = (512, 768, 1024)
    assert traced._fit(lengths, [7 + 3 * s + 0.5 * s * s for s in lengths]) == pytest.approx((7, 3, 0.5))


def test_a_multiplied_embedding_is_held_beside_block_0s_input():
    """Falcon-H1 multiplies its embedding's output by ``embedding_multiplier`` in ``model.forward``.
    Under checkpointing, PEFT's plans make that output a leaf that needs a gradient, and its
    AccumulateGrad node holds it until backward, beside the product that block 0 takes in. The
    analytic peak of the full-size model on a 24 GiB card was 16 MiB (one hidden state) under the
    trace's; now it is within 0.1% over."""
    from transformers import AutoConfig

    from autofit.evaluators.analytic import AnalyticEvaluator
    from autofit.evaluators.simulated import SimulatedEvaluator, TraceCache

    spec = ModelSpec.from_hf_config(AutoConfig.for_model("falcon_h1").to_dict(), name="falcon-h1")
    plan = Plan(method="qlora", lora_rank=16, precision="bf16-mixed", micro_batch=1, checkpointing="full")
    ctx = Target(spec, parse_cluster("1xRTX4090"), Workload(seq_len=2048, global_batch=1))
    sim, ana = SimulatedEvaluator(TraceCache()).evaluate(plan, ctx), AnalyticEvaluator().evaluate(plan, ctx)
    assert 1.0 <= ana.memory.peak_allocated / sim.memory.peak_allocated <= 1.001
    assert ana.memory.activations == pytest.approx(sim.memory.activations, rel=0.001)

"""Model types no family describes (specs/derive.py) through the evaluators: the simulated trace
against real CPU steps, the analytic block (formulas or one traced block) against both."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from autofit.evaluators import runtime as rt
from autofit.evaluators import traced
from autofit.evaluators.analytic import estimate
from autofit.plan import Plan
from autofit.specs import ModelSpec, Target, Workload, parse_cluster
from tests.evaluators.test_families import SEQ, saved_by_first_block
from tests.evaluators.test_simulated import TraceDevice, assert_matches, measure, run_trace


@functools.cache
def tiny_derived(model_type: str, layers: int = 2) -> ModelSpec:
    from transformers import AutoConfig

    base = ModelSpec.from_hf_config(AutoConfig.for_model(model_type).to_dict(), name=model_type)
    return base.variant(
        num_layers=layers,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=704,
        vocab_size=1000,
        name=f"tiny-{model_type}",
    )


@functools.cache
def tiny_moe(model_type: str, layers: int = 2) -> ModelSpec:
    """A tiny derived mixture of experts: 4 experts, 2 per token, the family's own config keys."""
    from transformers import AutoConfig

    f = ModelSpec.from_hf_config(AutoConfig.for_model(model_type).to_dict(), name=model_type).family
    d = AutoConfig.for_model(model_type).to_dict()
    sizes = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=32, intermediate_size=704, vocab_size=1000)
    d.update(num_hidden_layers=layers, hidden_size=256, **sizes, **{f.experts_key: 4, f.top_k_key: 2})
    d.update({k: 192 for k in ("moe_intermediate_size", "shared_expert_intermediate_size") if d.get(k)})
    d.update({k: None for k in ("pad_token_id", "bos_token_id", "eos_token_id") if (d.get(k) or 0) >= 1000})
    if isinstance(d.get("layer_types"), list):
        d["layer_types"] = d["layer_types"][:layers]
    return ModelSpec.from_hf_config(d, name=f"tiny-{model_type}")


PLANS = [
    Plan(precision="bf16-true", micro_batch=2),
    Plan(precision="32-true", micro_batch=2, attention="eager"),
    Plan(method="lora", lora_rank=8, precision="bf16-mixed", micro_batch=2),
    Plan(method="qlora", lora_rank=8, precision="bf16-mixed", micro_batch=2, checkpointing="full"),
]
# starcoder2's block is one the formulas know; olmo2 (norms after the branches) and arcee (relu²)
# are traced; falcon's default config is falcon-7b's block (one norm, multi-query), which its
# registered family does not describe
CASES = [(m, p) for m in ("starcoder2", "olmo2", "arcee") for p in PLANS] + [("falcon", p) for p in PLANS[::2]]


def _ids(x):
    return x if isinstance(x, str) else x.summary()


@functools.cache
def real_step(model_type: str, plan: Plan):
    """The real CPU steps of a tiny derived model (each measured once for the tests below)."""
    return measure(tiny_derived(model_type), plan, Workload(seq_len=128, global_batch=plan.micro_batch))


@pytest.mark.parametrize("model_type,plan", CASES, ids=_ids)
def test_simulated_traces_the_real_step_of_a_derived_model(model_type, plan):
    """transformers builds it from the kept config, PEFT and bitsandbytes find its Linear layers by
    their derived names, and the traced step is the real one (peak within 2%, components 5%)."""
    spec = tiny_derived(model_type)
    workload = Workload(seq_len=128, global_batch=plan.micro_batch)
    assert_matches(real_step(model_type, plan), run_trace(spec, plan, workload, TraceDevice("cpu")))


@pytest.mark.parametrize("model_type,plan", CASES, ids=_ids)
def test_the_analytic_peak_of_a_derived_model(model_type, plan):
    """Within 4% of the real CPU step where the formulas itemize the block (as for the registered
    families, test_analytic.py), within 6% where one block is traced (its transients are a llama
    block's)."""
    spec = tiny_derived(model_type)
    workload = Workload(seq_len=128, global_batch=plan.micro_batch)
    real = real_step(model_type, plan).peak
    est = estimate(plan, Target(spec, parse_cluster("1xcpu"), workload)).memory.peak_allocated
    tol = 0.06 if spec.analytic_gap else 0.04
    assert abs(est / real - 1) <= tol, (est, real)


@pytest.mark.parametrize("model_type", ["olmo2", "arcee", "cohere"])
@pytest.mark.parametrize("plan", PLANS[:3], ids=_ids)
def test_the_traced_block_saves_what_autograd_saves(model_type, plan):
    """The fake census of one block at two lengths, as bytes per token and per token², gives
    byte for byte what a real CPU forward's saved-tensor hooks count for one sequence. (With more,
    the RoPE tables the block saves are shared by the batch: the terms count them per sequence.)"""
    spec = tiny_derived(model_type, layers=1)
    tok, quad = traced.block_terms(spec, plan, cpu=True, capability=(8, 0))
    autocast = rt.layout(plan).autocast_dtype  # the real step's autocast, as the runner enters it
    with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
        real = saved_by_first_block(spec, plan.replace(micro_batch=1))
    assert SEQ * (tok + quad * SEQ) == real
    assert quad > 0 if plan.attention.value == "eager" else quad == 0


@pytest.mark.parametrize("model_type", ["falcon", "gemma3_text"])
def test_op_level_checkpointing_of_a_traced_block_is_bounded_from_above(model_type):
    """falcon-7b's block (a mask built for every batch) and Gemma-3's (fp32 norm vectors) are traced
    because the formulas miss what one traced block saves (``traced.formulas_miss``); the policy's
    walk reads the formulas, so op-level checkpointing keeps at most what the block saves: over the
    real CPU step (by 12-31% here), never under it."""
    spec = tiny_derived(model_type)
    assert traced.formulas_miss(spec) and not spec.analytic_gap
    plan = Plan(precision="bf16-true", micro_batch=2, checkpointing="selective", checkpoint_ops=True)
    workload = Workload(seq_len=128, global_batch=2)
    real = measure(spec, plan, workload).peak
    est = estimate(plan, Target(spec, parse_cluster("1xcpu"), workload)).memory.peak_allocated
    assert 1.0 <= est / real <= 1.35


def test_op_level_checkpointing_is_refused_where_the_modules_say_the_formulas_miss():
    from autofit.plan import plan_problems

    plan = Plan(precision="bf16-true", micro_batch=2, checkpointing="selective", checkpoint_ops=True)
    problems = plan_problems(plan, tiny_derived("olmo2"), parse_cluster("1xA100-80GB"), Workload(global_batch=2))
    assert any("--checkpoint-ops walks the block formulas, which do not describe olmo2's block" in p for p in problems)
    assert not plan_problems(plan, tiny_derived("starcoder2"), parse_cluster("1xA100-80GB"), Workload(global_batch=2))


# mixture-of-experts types no family describes: OLMoE (q/k norms over all heads), GPT-OSS (expert
# biases, clamped gate, eager attention with sinks), PhiMoE (router jitter, a Linear subclass for a
# router) and Solar-Open (a shared expert, which PEFT remaps) are traced; GraniteMoE's block is
# Mixtral's and the formulas itemize it
MOE_CASES = [
    ("olmoe", PLANS[0]),
    ("olmoe", PLANS[3]),
    ("gpt_oss", PLANS[1]),
    ("gpt_oss", Plan(method="lora", lora_rank=8, precision="bf16-mixed", micro_batch=2, attention="eager")),
    ("phimoe", PLANS[2]),
    ("solar_open", PLANS[2]),
    ("solar_open", PLANS[3]),
    ("granitemoe", PLANS[3]),
]


@pytest.mark.parametrize("model_type,plan", MOE_CASES, ids=_ids)
def test_simulated_traces_the_real_step_of_a_derived_moe(model_type, plan):
    """The real step routes by its random router, the trace by none: memory does not depend on
    the routing (``evaluators/moe.py``), and the traced step is the real one."""
    spec = tiny_moe(model_type)
    workload = Workload(seq_len=128, global_batch=plan.micro_batch)
    assert_matches(measure(spec, plan, workload), run_trace(spec, plan, workload, TraceDevice("cpu")))


MOE_ANALYTIC = [
    Plan(precision="bf16-mixed", micro_batch=2),
    Plan(method="lora", lora_rank=16, precision="bf16-mixed", checkpointing="full", micro_batch=2),
    Plan(method="qlora", lora_rank=16, precision="bf16-mixed", checkpointing="full", micro_batch=2),
    Plan(precision="bf16-true", optimizer="adamw-8bit", checkpointing="full", micro_batch=2),
]


@pytest.mark.parametrize("model_type", ["olmoe", "solar_open", "granitemoe"])
def test_the_analytic_answer_on_a_derived_moe(model_type):
    """Against the simulated trace on an A100 (3 layers): weights and optimizer within 2%, FLOPs
    within 5% (the experts' grouped GEMMs under the balanced routing), and the peak within 2%
    under and 6% over (measured: GraniteMoE, itemized by the formulas, 1.000-1.006; OLMoE and
    Solar-Open, traced, 0.985-1.042)."""
    spec = tiny_moe(model_type, layers=3)
    for ana in assert_analytic_agrees(spec, peak=(0.98, 1.06), flops=0.05):
        assert ana.extra["block"].startswith(f"{model_type} (")


def assert_analytic_agrees(spec: ModelSpec, peak: tuple[float, float], flops: float) -> list:
    """The analytic answer against the simulated trace on an A100 over ``MOE_ANALYTIC``: the peak's
    ratio within ``peak``, weights and optimizer within 2%, FLOPs within ``flops``, the same routing
    note; the analytic results."""
    from autofit.evaluators.analytic import AnalyticEvaluator
    from autofit.evaluators.simulated import SimulatedEvaluator, TraceCache

    cache, out = TraceCache(), []
    for plan in MOE_ANALYTIC:
        if "sdpa" not in spec.family.attn_impls:
            plan = plan.replace(attention="eager")
        ctx = Target(spec, parse_cluster("1xA100"), Workload(seq_len=256, global_batch=plan.micro_batch))
        sim, ana = SimulatedEvaluator(cache).evaluate(plan, ctx), AnalyticEvaluator().evaluate(plan, ctx)
        assert peak[0] <= ana.memory.peak_allocated / sim.memory.peak_allocated <= peak[1], plan.summary()
        for comp in ("weights", "optimizer"):
            assert getattr(ana.memory, comp) == pytest.approx(getattr(sim.memory, comp), rel=0.02)
        assert ana.throughput.flops_per_step == pytest.approx(sim.throughput.flops_per_step, rel=flops)
        assert sim.extra["routing"] == ana.extra["routing"] == spec.routing_assumption
        out.append(ana)
    return out


def test_peft_adapts_what_a_derived_moe_spec_says():
    """PEFT turns a LoRA target named ``gate_proj``/``up_proj``/``down_proj`` of Solar-Open (and
    every MoE type transformers 5 fused) into LoRA on all routed experts' 3-D weights; the spec marks
    the shared expert's Linears frozen, so no target names them and PEFT adapts exactly the
    attention's. PhiMoE's router subclasses nn.Linear and is no target (PEFT would break its tuple)."""
    solar = tiny_moe("solar_open")
    frozen = [n for n, _, _, part in solar.linears() if part == "frozen"]
    assert frozen == ["mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"]
    assert "LoRA leaves mlp.shared_experts.gate_proj" in solar.derivation
    plan = Plan(method="lora", lora_rank=8, precision="bf16-true", micro_batch=1)
    net = rt.build_model(solar, plan, device="meta")
    trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    assert trainable == solar.lora_params(8, plan.lora_targets) == solar.lora_params(8)
    assert not any("experts" in n for n, p in net.named_parameters() if p.requires_grad)
    assert [n for n, *_ in tiny_moe("phimoe").linears()] == [f"self_attn.{p}_proj" for p in "qkvo"]


# hybrid stacks (ModelSpec.hybrid): dense layers before MoE layers (DeepSeek-V3 and GLM-4.5's
# first_k_dense_replace, ERNIE-4.5's moe_layer_start_index, Qwen-MoE's mlp_only_layers), or every
# other layer dense (decoder_sparse_step)
HYBRID = {
    "deepseek_v3": {"first_k_dense_replace": 1},
    "glm4_moe": {"first_k_dense_replace": 1},
    "ernie4_5_moe": {"moe_layer_start_index": 1},
    "qwen3_moe": {"mlp_only_layers": [0]},
    "qwen2_moe": {"decoder_sparse_step": 2},
}


@functools.cache
def tiny_hybrid(model_type: str, layers: int = 4) -> ModelSpec:
    """A tiny hybrid stack of the type's own config keys (4 experts, 2 per token)."""
    from transformers import AutoConfig

    d = AutoConfig.for_model(model_type).to_dict()
    sizes = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=32, intermediate_size=704, vocab_size=1000)
    d.update(num_hidden_layers=layers, hidden_size=256, **sizes, **HYBRID[model_type])
    d.update({k: 4 for k in ("n_routed_experts", "num_experts", "moe_num_experts") if k in d})
    d.update({k: 2 for k in ("num_experts_per_tok", "moe_k") if k in d})
    d.update({k: 192 for k in ("moe_intermediate_size", "shared_expert_intermediate_size") if d.get(k)})
    d.update({k: None for k in ("pad_token_id", "bos_token_id", "eos_token_id") if (d.get(k) or 0) >= 1000})
    if "n_group" in d:  # DeepSeek's group-limited routing, over the 4 experts
        d.update(n_group=1, topk_group=1)
    if "kv_lora_rank" in d:  # DeepSeek's multi-head latent attention, its query and value heads of other sizes
        d.update(kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
        d.update(head_dim=16, num_key_value_heads=8)
    if isinstance(d.get("layer_types"), list):
        d["layer_types"] = d["layer_types"][:layers]
    return ModelSpec.from_hf_config(d, name=f"tiny-{model_type}")


@pytest.mark.parametrize("model_type,plan", [("glm4_moe", PLANS[2]), ("deepseek_v3", PLANS[0])], ids=_ids)
def test_simulated_traces_the_real_step_of_a_hybrid_stack(model_type, plan):
    """The whole stack is traced (it does not repeat), dense and MoE layers as transformers builds them."""
    spec = tiny_hybrid(model_type)
    workload = Workload(seq_len=128, global_batch=plan.micro_batch)
    assert_matches(measure(spec, plan, workload), run_trace(spec, plan, workload, TraceDevice("cpu")))


@pytest.mark.parametrize("model_type", sorted(HYBRID))
def test_the_analytic_answer_on_a_hybrid_stack(model_type):
    """Against the simulated trace on an A100: each kind's block as any model's, the stack's saves
    layer by layer and one block's worst transients. Weights and optimizer within 2%; the peak never
    under and at most 8% over (measured: 1.00-1.07); FLOPs within 10% (DeepSeek's latent attention,
    queries and values of other head sizes, 0.93-0.95; the others 1.00-1.04)."""
    spec = tiny_hybrid(model_type)
    assert spec.hybrid and len(spec.layer_kinds()) == 2
    for ana in assert_analytic_agrees(spec, peak=(1.0, 1.08), flops=0.1):
        assert ana.extra["block"].startswith(f"{model_type} (") and "layers of 2 kinds" in ana.extra["block"]


@pytest.fixture
def census_refuses_lora(monkeypatch):
    """The census of any LoRA plan raises as PEFT does on a block it cannot adapt (Falcon-H1's Mamba
    projections); no census is kept on disk or in the process before or after."""
    real = traced._run_census

    def refuse_lora(model, plan, *args):
        if plan.is_peft:
            raise ValueError("Module 'out_proj' is incompatible with this model\nsecond line")
        return real(model, plan, *args)

    monkeypatch.setattr(traced, "_run_census", refuse_lora)
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", "off")
    caches = (traced._terms, traced.formulas_miss)
    for fn in caches:
        fn.cache_clear()
    yield
    for fn in caches:
        fn.cache_clear()


def test_a_block_the_census_cannot_trace_fails_that_plan_and_the_screen_goes_on(census_refuses_lora):
    """A derived block transformers, PEFT or a fake kernel refuses under one plan (PEFT refused LoRA
    on Falcon-H1's Mamba projections, and the screen crashed): that plan fails with the reason, and
    the screen ranks the others."""
    from autofit.evaluators.analytic import AnalyticEvaluator
    from autofit.search.loop import screen
    from autofit.search.space import SearchSpace

    ctx = Target(tiny_derived("olmo2"), parse_cluster("1xA100"), Workload(seq_len=256, global_batch=2))
    lora = AnalyticEvaluator().evaluate(Plan(method="lora", lora_rank=8, micro_batch=2), ctx)
    assert lora.status.value == "failed" and lora.memory is None
    assert lora.reason.startswith("one olmo2 block cannot be traced under lora r8") and "second line" in lora.reason
    scored = [r for _, r in screen(SearchSpace(ctx))]
    assert scored[0].fits and scored[0].plan.method.value == "full"
    assert {r.status.value for r in scored if r.plan.is_peft} == {"failed"}


def test_the_reports_toggles_skip_a_variant_the_census_cannot_trace(census_refuses_lora):
    """The report toggles one technique at a time; a toggle whose block cannot be traced (LoRA here)
    is skipped with the reason, the others are evaluated."""
    from autofit.report import analysis

    ctx = Target(tiny_derived("olmo2"), parse_cluster("1xA100"), Workload(seq_len=256, global_batch=2))
    effects = analysis.technique_effects(Plan(precision="bf16-mixed", micro_batch=2), ctx)
    assert effects.toggles and all(t.result.memory is not None for t in effects.toggles)
    assert any("second line" in problem for _, problems in effects.skipped for problem in problems)
    failed = analysis.technique_effects(Plan(method="lora", lora_rank=8, micro_batch=2), ctx)
    assert not failed.toggles and "second line" in failed.skipped[0][1][0]

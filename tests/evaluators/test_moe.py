"""Mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE's shared expert): specs, the grouped
GEMM under fake tensors, the routing assumption in every answer, and the estimators against
real CPU steps and each other (``evaluators/moe.py``)."""

from __future__ import annotations

import json

import pytest
import torch

from autofit.errors import SpecError
from autofit.evaluators import moe
from autofit.evaluators.analytic import estimate
from autofit.evaluators.simulated import SimulatedEvaluator, TraceCache
from autofit.plan import Plan, plan_problems
from autofit.specs import MODELS, Target, Workload, parse_cluster, resolve_model
from tests.conftest import tiny
from tests.evaluators.test_simulated import check

# config.json as the hub has them (Qwen's names the expert count num_experts)
MIXTRAL = {
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.02,
    "rope_theta": 1e6,
    "sliding_window": None,
    "tie_word_embeddings": False,
}
QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "output_router_logits": False,
    "tie_word_embeddings": False,
}
QWEN2_MOE = {  # Qwen1.5-MoE-A2.7B
    "model_type": "qwen2_moe",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 151936,
    "max_position_embeddings": 8192,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
}


def test_published_parameter_counts():
    # the model cards' totals (the meta-device build of each is in tests/specs/test_models.py)
    assert MODELS["mixtral-8x7b"].n_params == 46_702_792_704
    assert MODELS["mixtral-8x22b"].n_params == 140_630_071_296
    assert MODELS["qwen3-30b-a3b"].n_params == 30_532_122_624
    assert MODELS["qwen3-235b-a22b"].n_params == 235_093_634_560
    assert MODELS["qwen1.5-moe-a2.7b"].n_params == 14_315_784_192
    assert MODELS["qwen2-57b-a14b"].n_params == 57_408_658_944
    assert MODELS["qwen2-57b-a14b"].shared_expert_width == 20480
    q = MODELS["qwen3-30b-a3b"]
    assert (q.num_experts, q.experts_per_token, q.expert_width) == (128, 8, 768)
    assert MODELS["mixtral-8x7b"].expert_width == 14336


@pytest.mark.parametrize(
    "name,raw", [("mixtral-8x7b", MIXTRAL), ("qwen3-30b-a3b", QWEN3_MOE), ("qwen1.5-moe-a2.7b", QWEN2_MOE)]
)
def test_a_hub_config_reads_as_the_registered_model(name, raw, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    spec = resolve_model(str(path))
    assert spec.fingerprint == MODELS[name].fingerprint and spec.n_params == MODELS[name].n_params


@pytest.mark.parametrize(
    "change,fragment",
    [
        ({"num_experts_per_tok": None}, "'num_experts_per_tok' is missing; a mixtral mixture-of-experts config"),
        ({"num_local_experts": "8"}, "'num_local_experts' is \"8\" (a string)"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok (9) exceeds num_local_experts (8)"),
        ({"output_router_logits": True}, "'output_router_logits' is true; autofit models mixtral blocks with"),
        ({"router_jitter_noise": 0.01}, "'router_jitter_noise' is 0.01"),
    ],
)
def test_moe_configs_autofit_cannot_route_are_refused_in_one_line(change, fragment, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in {**MIXTRAL, **change}.items() if v is not None}))
    with pytest.raises(SpecError, match=fragment.replace("(", r"\(").replace(")", r"\)")) as info:
        resolve_model(str(path))
    assert "\n" not in str(info.value)


def test_qwen3_moe_with_dense_layers_is_a_hybrid_stack(tmp_path):
    """Dense layers among the MoE ones (mlp_only_layers) are not the registered family's block: the
    config is read from transformers' model kind by kind (specs/derive.py, a hybrid stack)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**QWEN3_MOE, "mlp_only_layers": [0, 1]}))
    spec = resolve_model(str(path))
    assert spec.hybrid and spec.stack[:3] == (0, 0, 1) and [n for n, _ in spec.layer_kinds()] == [2, 46]
    dense = spec.layer_kinds()[0][1].layer_params()
    assert spec.n_params == resolve_model("qwen3-30b-a3b").n_params - 2 * (spec.layer_params() - dense)


@pytest.mark.parametrize("family", ["mixtral-8x7b", "qwen1.5-moe-a2.7b"])
def test_lora_adapts_the_linears_and_leaves_experts_and_router_whole(family):
    """transformers' experts are 3-D parameters and the router a plain one: PEFT's
    target_modules and bitsandbytes' Linear replacement match none of them; a shared expert
    and its gate are Linears, which they match. The names autofit gives PEFT keep the routed
    experts whole under PEFT 0.22 too, which rewrites a bare ``down_proj`` into LoRA on them."""
    import peft

    from autofit.evaluators.runtime import hf_model_class
    from autofit.techniques import lora_kwargs

    spec = tiny(family)
    names = ["q_proj", "k_proj", "v_proj", "o_proj"]
    if spec.shared_expert_width:
        names += ["gate_proj", "up_proj", "down_proj", "shared_expert_gate"]
    assert [n for n, *_ in spec.linears()] == names
    with torch.device("meta"):
        model = hf_model_class(spec).from_config(spec.to_hf_config())
    assert sum(p.numel() for p in model.parameters()) == spec.n_params
    wrapped = peft.get_peft_model(model, peft.LoraConfig(**lora_kwargs(spec, Plan(method="lora", lora_rank=8))))
    trainable = {n: p.numel() for n, p in wrapped.named_parameters() if p.requires_grad}
    assert not [n for n in trainable if ".experts." in n]
    assert sum(trainable.values()) == spec.lora_params(8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_grouped_gemm_outside_bf16_traces_the_real_ops_shapes_and_flops(dtype):
    """The fake grouped GEMM (a dtype its meta function refuses) has the CPU op's output, for
    the forward (2-D x 3-D) and the weight gradient (2-D x 2-D), and 2·M·K·N FLOPs."""
    rows, k, n, groups = 12, 16, 24, 4
    offs = torch.tensor([3, 6, 9, 12], dtype=torch.int32)
    a, b = torch.randn(rows, k, dtype=torch.float32), torch.randn(groups, k, n, dtype=torch.float32)
    at, g = torch.randn(k, rows, dtype=torch.float32), torch.randn(rows, n, dtype=torch.float32)
    bounds = [0, *offs.tolist()]
    for x, y in ((a, b), (at, g)):
        real = torch._grouped_mm(x, y, offs=offs)
        fake = moe._grouped_mm_any_dtype(x.to(dtype), y.to(dtype), offs)
        assert fake.shape == real.shape and fake.dtype == dtype
        # what the CPU op computes: one mm per group of rows (or of the contraction, for the weight gradient)
        if y.dim() == 3:
            groups_mm = [x[s:e] @ y[i] for i, (s, e) in enumerate(zip(bounds, bounds[1:]))]
            assert torch.allclose(real, torch.cat(groups_mm), atol=1e-5)
        else:
            groups_mm = [x[:, s:e] @ y[s:e] for s, e in zip(bounds, bounds[1:])]
            assert torch.allclose(real, torch.stack(groups_mm), atol=1e-5)
        # each group's GEMM: 2 x its rows x K x N (the weight gradient contracts over the rows)
        assert moe.grouped_mm_flops((x, y, offs), real) == sum(2 * (e - s) * k * n for s, e in zip(bounds, bounds[1:]))
    when, _ = moe.fake_decompositions()[torch.ops.aten._grouped_mm.default]
    assert when(a.to(dtype), b.to(dtype), offs) and when(at.to(dtype), g.to(dtype), offs=offs)
    assert not when(a.bfloat16(), b.bfloat16(), offs)  # the meta function takes bf16 itself
    assert not when(b.to(dtype), b.to(dtype))  # a batched 3-D call is none of transformers': left to the meta
    # each group's rows under the balanced routing: 12 rows over 4 experts
    assert moe.grouped_mm_dim((a, b, offs)) == 3 and moe.grouped_mm_dim((at, g, offs)) == 3


# simulated vs real CPU steps (the bounds: peak within 2%, components within 5%); the
# real step routes by its random router, the trace by none: memory does not depend on it
CPU_PLANS = [
    ("mixtral-8x7b", Plan(precision="32-true", micro_batch=2)),
    ("mixtral-8x7b", Plan(method="qlora", lora_rank=8, precision="bf16-mixed", micro_batch=2, checkpointing="full")),
    ("qwen3-30b-a3b", Plan(precision="bf16-mixed", micro_batch=2)),
    ("qwen3-30b-a3b", Plan(method="lora", lora_rank=8, precision="fp16-mixed", micro_batch=2, optimizer="adafactor")),
    ("qwen1.5-moe-a2.7b", Plan(method="qlora", lora_rank=8, precision="bf16-mixed", micro_batch=2)),
    ("qwen1.5-moe-a2.7b", Plan(precision="bf16-true", micro_batch=2, checkpointing="full")),
]


@pytest.mark.parametrize("family,plan", CPU_PLANS, ids=lambda x: x if isinstance(x, str) else x.summary())
def test_simulated_matches_a_real_cpu_moe_step(family, plan):
    check(family, plan)


# analytic vs simulated on an A100 (3 layers); the worst of a wider grid is in the closing note
# of the change that added MoE (Adafactor at micro-batch 1: -4.4%)
ANALYTIC_PLANS = [
    Plan(precision="bf16-mixed", micro_batch=2),
    Plan(method="lora", lora_rank=16, precision="bf16-mixed", checkpointing="full", micro_batch=2),
    Plan(method="qlora", lora_rank=16, precision="bf16-mixed", checkpointing="full", fused_loss=True, micro_batch=2),
    Plan(precision="bf16-true", optimizer="adamw-8bit", checkpointing="full", micro_batch=2),
    Plan(precision="bf16-true", micro_batch=2, checkpointing="selective", checkpoint_every=2),
    Plan(method="lora-8bit", lora_rank=16, precision="bf16-mixed", micro_batch=2),
]
_CACHE = TraceCache()


@pytest.mark.parametrize("family", ["mixtral-8x7b", "qwen3-30b-a3b", "qwen1.5-moe-a2.7b"])
@pytest.mark.parametrize("plan", ANALYTIC_PLANS, ids=lambda p: p.summary())
def test_analytic_agrees_with_simulated_on_moe(family, plan):
    spec = tiny(family, layers=3)
    ctx = Target(spec, parse_cluster("1xA100"), Workload(seq_len=256, global_batch=plan.micro_batch))
    sim = SimulatedEvaluator(_CACHE).evaluate(plan, ctx)
    ana = estimate(plan, ctx)
    assert ana.memory.peak_allocated == pytest.approx(sim.memory.peak_allocated, rel=0.04)
    for comp in ("weights", "optimizer"):
        assert getattr(ana.memory, comp) == pytest.approx(getattr(sim.memory, comp), rel=0.02)
    # the experts' GEMMs: the analytic counts what the trace counts
    assert ana.throughput.flops_per_step == pytest.approx(sim.throughput.flops_per_step, rel=0.05)
    assert sim.extra["routing"] == spec.routing_assumption


def estimate_cli(cli, args: list[str]) -> dict:
    from click.testing import CliRunner

    out = CliRunner().invoke(cli, ["estimate", "--gpus", "1xH100", "--evaluator", "analytic", "--json", *args])
    assert out.exit_code == 0, out.output
    return json.loads(out.output)


def test_every_answer_states_the_routing_and_liger_blocks_are_refused():
    from click.testing import CliRunner

    from autofit.cli import cli

    spec = MODELS["mixtral-8x7b"]
    assert spec.routing_assumption.startswith("MoE routing: each token to 2 of 8 experts, spread evenly")
    assert MODELS["mistral-7b"].routing_assumption == ""
    out = CliRunner().invoke(
        cli, ["estimate", "--model", "qwen3-30b-a3b", "--gpus", "1xH100", "--evaluator", "analytic", "--json"]
    )
    data = json.loads(out.output)
    assert data["extra"]["routing"] in data["assumptions"]
    # 8- and 4-bit base weights leave the experts 16-bit, and the answer says so
    qlora = estimate_cli(cli, ["--model", "mixtral-8x7b", "--method", "qlora", "--checkpointing", "full"])
    assert "the 45.1B expert parameters stay 16-bit under qlora" in qlora["extra"]["note"]
    assert "note" not in estimate_cli(cli, ["--model", "mixtral-8x7b", "--method", "lora"])["extra"]
    ctx = Target(spec, parse_cluster("1xH100"), Workload(seq_len=2048, global_batch=8))
    problems = plan_problems(Plan(precision="bf16-true", fused_kernels=True), spec, ctx.cluster, ctx.workload)
    assert any("fused kernels" in p for p in problems)


def test_a_measured_moe_trial_routes_for_real_and_peaks_where_the_trace_does(tmp_path):
    """The measured child builds the MoE model from the config and trains it with its own router
    (random weights, so some uneven split); on the CPU target (one tracker for both) its peak is
    the simulated one: the routing does not move memory."""
    from autofit.evaluators.measured import MeasuredEvaluator
    from autofit.results import Status
    from tests.evaluators.test_measured import ENV, cpu_ctx

    plan = Plan(method="qlora", lora_rank=8, precision="bf16-mixed", micro_batch=2, grad_accum=2, checkpointing="full")
    ctx = cpu_ctx(model="qwen1.5-moe-a2.7b")
    r = MeasuredEvaluator(warmup_steps=2, timed_steps=1, timeout_s=300, env=ENV, work_dir=tmp_path).evaluate(plan, ctx)
    assert r.status is Status.FITS, (r.reason, r.extra.get("stderr_tail"))
    spec = ctx.model
    engine = r.extra["engine"]
    assert engine["linear4bit"] == spec.num_layers * len(spec.linears())  # attention and the shared expert
    assert engine["trainable_params"] == spec.lora_params(8)
    sim = SimulatedEvaluator().evaluate(plan, ctx)
    assert sim.memory.peak_allocated == pytest.approx(r.memory.peak_allocated, rel=0.02)
    assert sim.extra["routing"] == spec.routing_assumption


def test_the_nvme_buffer_holds_a_whole_expert_tensor():
    """DeepSpeed swaps each rank's partition of a parameter through one NVMe buffer: an MoE
    block's gate_up_proj (all its experts) is the largest parameter, not the embedding."""
    from autofit.export.deepspeed import nvme_param_buffer

    spec = MODELS["qwen3-235b-a22b"]
    experts = 128 * 2 * 1536 * 4096
    assert spec.largest_tensor() == experts > spec.vocab_size * spec.hidden_size
    assert nvme_param_buffer(spec, 1) >= experts

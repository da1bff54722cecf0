"""Model types no family describes, read from the model transformers builds (specs/derive.py)."""

from __future__ import annotations

import json

import pytest

from autofit.errors import SpecError
from autofit.specs import FAMILIES, MODELS, ModelSpec, resolve_model

# model types transformers implements that no family describes: the first ones' blocks are shapes
# the analytic formulas know; the others' are traced (an unknown norm or activation, norms after
# the branches, scaled tensors)
COMMON = ["starcoder2", "granite", "smollm3", "stablelm", "glm", "glm4", "gemma3_text", "internlm3"]
TRACED = {
    "olmo": "its norm OlmoLayerNorm is neither",
    "olmo2": "its block runs attention, norm, MLP, norm in an order",
    "exaone4": "its block runs attention, norm, MLP, norm in an order",
    "arcee": "its MLP's activation 'relu2' is not one the formulas know",
    "cohere": "its norm CohereLayerNorm is neither",
    "gpt_bigcode": "it trains with dropout",
}


def default_spec(model_type: str, **kw) -> ModelSpec:
    from transformers import AutoConfig

    return ModelSpec.from_hf_config(AutoConfig.for_model(model_type, **kw).to_dict(), name=model_type)


def built_params(spec: ModelSpec) -> int:
    """The parameter count of the model transformers builds from the spec's config, on meta."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(spec.to_hf_config())
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@pytest.mark.parametrize("model_type", COMMON + list(TRACED))
def test_a_derived_spec_counts_the_parameters_transformers_builds(model_type):
    spec = default_spec(model_type)
    assert spec.model_type == model_type and model_type not in FAMILIES
    assert spec.n_params == built_params(spec) > 10**8
    tiny = spec.variant(num_layers=2, hidden_size=256, num_heads=8, num_kv_heads=8, head_dim=32, vocab_size=1000)
    assert tiny.n_params == built_params(tiny)
    assert tiny.family.decoder_layer == spec.family.decoder_layer


@pytest.mark.parametrize("model_type", COMMON)
def test_common_block_shapes_are_itemized_by_the_formulas(model_type):
    spec = default_spec(model_type)
    assert spec.analytic_gap == ""
    assert "itemizes it as a block of that shape" in spec.derivation


@pytest.mark.parametrize("model_type,why", TRACED.items())
def test_other_blocks_say_why_they_are_traced(model_type, why):
    spec = default_spec(model_type)
    assert why in spec.analytic_gap
    assert "traces one block" in spec.derivation


# the fields the analytic formulas read, as the families were written by hand
FIELDS = (
    "decoder_layer gated_mlp norm norms_per_layer final_norm qkv_bias out_bias mlp_bias positions activation "
    "norm_position norm_scales_in_fp32 parallel_residual qk_norm head_bias embed_scale logit_softcap"
).split()


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "phi", "gpt_neox"])
def test_the_derived_family_of_a_registered_type_is_the_one_written_by_hand(model_type):
    from transformers import AutoConfig

    from autofit.specs.derive import derive

    (built,) = derive(AutoConfig.for_model(model_type)).blocks
    written = FAMILIES[model_type]
    assert {k: built.family[k] for k in FIELDS} == {k: getattr(written, k) for k in FIELDS}
    assert built.analytic == ""


def test_a_derived_spec_round_trips_through_json_and_registered_ones_keep_their_form():
    spec = default_spec("gemma3_text")
    back = ModelSpec.from_dict(json.loads(json.dumps(spec.as_dict())))
    assert back == spec and back.fingerprint == spec.fingerprint and back.family == spec.family
    assert back.to_hf_config().layer_types == spec.to_hf_config().layer_types
    assert "derived" not in MODELS["llama-3.1-8b"].as_dict()


def test_a_local_config_of_a_new_type_resolves(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("starcoder2", num_hidden_layers=4).save_pretrained(tmp_path)
    spec = resolve_model(str(tmp_path))
    assert spec.model_type == "starcoder2" and spec.num_layers == 4 and spec.source.endswith("config.json")


@pytest.mark.parametrize(
    "config,message",
    [
        ({"model_type": "jetmoe"}, "JetMoeParallelExperts.* no routing assumption for them"),
        ({"model_type": "llama4_text"}, "Llama4TextExperts.* no routing assumption for them"),
        ({"model_type": "olmoe", "output_router_logits": True}, "output_router_logits is true"),
        # Mamba layers only (a GraniteMoeHybrid Mamba layer's post_attention_layernorm is no attention)
        (
            {"model_type": "granitemoehybrid", "num_hidden_layers": 2, "layer_types": ["mamba", "mamba"]},
            "GraniteMoeHybridDecoderLayer has no attention module",
        ),
        ({"model_type": "jamba", "num_hidden_layers": 4}, "JambaMambaDecoderLayer has no attention module"),
        ({"model_type": "zamba2"}, "zamba2's layers 6 and 12 share parameters"),
        (
            {"model_type": "olmoe", "num_experts_per_tok": None},
            "cannot read it as a olmoe config .*num_experts_per_tok",
        ),
        ({"model_type": "mamba"}, "has no num_heads: autofit models transformer decoders"),
        ({"model_type": "rwkv"}, "autofit models transformer decoders"),
        ({"model_type": "internlm2", "hidden_size": 8}, "not one transformers implements"),
        ({"model_type": "t5"}, "no causal-LM class in transformers"),
        ({"model_type": "starcoder2", "hidden_size": "big"}, "starcoder2"),
    ],
)
def test_what_cannot_be_derived_is_refused_in_one_line(config, message):
    with pytest.raises(SpecError, match=message) as exc:
        ModelSpec.from_hf_config(config, name="x")
    assert "\n" not in str(exc.value)


# mixture-of-experts types no family describes whose experts transformers runs as grouped experts
# (``use_experts_implementation``): read with the balanced-routing assumption
MOE = ["olmoe", "gpt_oss", "granitemoe", "phimoe", "solar_open"]


@pytest.mark.parametrize("model_type", MOE)
def test_a_derived_moe_counts_its_experts_as_transformers_builds_them(model_type):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.evaluators.test_derived import tiny_moe

    spec = default_spec(model_type)
    assert spec.family.moe and spec.n_params == built_params(spec) > 10**9
    tiny = tiny_moe(model_type)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **tiny.hf_config_kwargs()))
    experts = next(m for m in model.modules() if hasattr(m, "has_gate"))
    assert (tiny.num_experts, tiny.experts_per_token) == (experts.num_experts, 2) == (4, 2)
    down = experts.down_proj.shape
    assert tiny.expert_width == (down[1] if experts.is_transposed else down[2])
    assert tiny.n_params == built_params(tiny)
    assert tiny.routing_assumption.startswith("MoE routing: each token to 2 of 4 experts")
    assert "4 routed" in tiny.derivation


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_the_derived_family_of_a_registered_moe_is_the_one_written_by_hand(model_type):
    from transformers import AutoConfig

    from autofit.specs.derive import derive

    cfg = AutoConfig.for_model(model_type)
    (built,) = derive(cfg).blocks
    written = FAMILIES[model_type]
    keys = FIELDS + ["experts_key", "top_k_key", "expert_width_key", "router_fp32"]
    assert {k: built.family[k] for k in keys} == {k: getattr(written, k) for k in keys}
    shared = getattr(cfg, written.shared_expert_key) if written.shared_expert_key else 0
    assert built.experts["shared_width"] == shared and built.analytic == ""


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe", "ernie4_5_moe", "qwen3_moe", "qwen2_moe"])
def test_a_hybrid_stack_counts_each_kind_as_transformers_builds_it(model_type):
    """Dense layers beside MoE layers: each kind is read from its first layer, the stack says which
    layer is which, and the counts are the built model's (its Linears: every kind's, each name once)."""
    import torch
    from transformers import AutoModelForCausalLM

    from autofit.specs.derive import _peft_remaps
    from tests.evaluators.test_derived import HYBRID, tiny_hybrid

    spec = tiny_hybrid(model_type)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(spec.to_hf_config())
    assert spec.n_params == sum(p.numel() for p in model.parameters())
    dense = {
        "first_k_dense_replace": (0,),
        "moe_layer_start_index": (0,),
        "mlp_only_layers": (0,),
        "decoder_sparse_step": (0, 2),
    }[next(iter(HYBRID[model_type]))]
    assert spec.hybrid and [spec.stack[i] for i in dense] == [spec.stack[dense[0]]] * len(dense)
    assert {spec.stack[i] for i in range(4) if i not in dense} == {1 - spec.stack[dense[0]]}
    (n_dense, dense_kind), (n_moe, moe_kind) = sorted(spec.layer_kinds(), key=lambda nk: nk[1].family.moe)
    assert (n_dense, n_moe) == (len(dense), 4 - len(dense)) and not dense_kind.family.moe and moe_kind.family.moe
    assert spec.family.moe and spec.layer_params() == moe_kind.layer_params() > dense_kind.layer_params()
    assert spec.linear_params() == sum(n * sum(i * o for _, i, o, _ in k.linears()) for n, k in spec.layer_kinds())
    # where PEFT remaps a target named gate_proj (to the routed experts), it does so in every layer:
    # the dense layers' MLP Linears of those names are frozen too
    remapped = _peft_remaps(model_type)
    for name, _, _, part in dense_kind.linears():
        assert (part == "frozen") == (name.rsplit(".", 1)[-1] in remapped), name
    back = ModelSpec.from_dict(json.loads(json.dumps(spec.as_dict())))
    assert back == spec and back.layer_kinds() == spec.layer_kinds()

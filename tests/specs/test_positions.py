"""How long a sequence a model trains on (``ModelSpec.position_limit``) and the refusal past it."""

import json

import pytest

from autofit.errors import SpecError
from autofit.search.request import build_context
from autofit.specs import ModelSpec, resolve_model


def _scaled(name: str, **rope) -> ModelSpec:
    cfg = resolve_model(name).to_hf_config().to_dict()
    cfg["rope_parameters"] = {"rope_theta": 10000.0, **rope}
    return ModelSpec.from_hf_config(json.loads(json.dumps(cfg)), name=name + "-scaled")


def test_learned_positions_and_unscaled_rope_end_at_the_table():
    assert resolve_model("gpt2-xl").position_limit == 1024
    assert resolve_model("bert-large-uncased").position_limit == 512
    assert resolve_model("llama-2-7b").position_limit == 4096


def test_alibi_has_no_limit():
    assert resolve_model("bloom-7b1").position_limit is None


def test_scaled_rope_multiplies_the_positions_or_the_original_ones():
    assert _scaled("llama-2-7b", rope_type="linear", factor=4.0).position_limit == 16384
    # Llama-3.1's llama3 scaling: 8192 original positions x 8 = 65,536, below the stated 131,072
    spec = _scaled(
        "llama-3.1-8b",
        rope_type="llama3",
        factor=8.0,
        original_max_position_embeddings=8192,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
    )
    assert spec.position_limit == 131072


def test_rope_scaling_reaches_the_transformers_config_and_survives_json():
    spec = _scaled("llama-2-7b", rope_type="yarn", factor=2.0)
    assert spec.to_hf_config().rope_parameters["rope_type"] == "yarn"
    again = ModelSpec.from_dict(json.loads(json.dumps(spec.as_dict())))
    assert again == spec and hash(again) == hash(spec) and again.position_limit == 8192


def test_default_rope_adds_nothing_to_the_spec():
    cfg = resolve_model("llama-2-7b").to_hf_config().to_dict()
    assert ModelSpec.from_hf_config(cfg).fingerprint == resolve_model("llama-2-7b").fingerprint


def test_a_scaling_without_a_factor_is_refused():
    cfg = resolve_model("llama-2-7b").to_hf_config().to_dict()
    cfg["rope_parameters"] = {"rope_type": "linear", "rope_theta": 10000.0}
    with pytest.raises(SpecError, match="RoPE scaling 'linear' needs a 'factor' of at least 1"):
        ModelSpec.from_hf_config(cfg, source="config.json")


@pytest.mark.parametrize(
    "model,seq,fragment",
    [
        ("gpt2-xl", 1025, "gpt2-xl has 1,024 learned positions and fails past them; give --seq-len 1024 or less"),
        ("llama-2-7b", 4097, "trained on 4,096 positions and its config sets no RoPE scaling"),
    ],
)
def test_build_context_refuses_past_the_positions(model, seq, fragment):
    with pytest.raises(SpecError, match=fragment):
        build_context(model, "1xA100", seq_len=seq)
    assert build_context(model, "1xA100", seq_len=seq - 1).workload.seq_len == seq - 1


def test_the_default_global_batch_is_a_multiple_of_the_gpus():
    assert build_context("mistral-7b", "3xA10").workload.global_batch == 18
    assert build_context("mistral-7b", "2xA10").workload.global_batch == 16
    assert build_context("mistral-7b", "32xA10").workload.global_batch == 32

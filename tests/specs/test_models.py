import json

import pytest

from autofit.errors import SpecError
from autofit.specs import MODELS, ModelSpec, resolve_model

REQUIRED = [
    "mistral-7b", "llama-2-7b", "llama-2-13b", "llama-3-8b", "llama-3-70b", "llama-3.2-1b", "llama-3.2-3b",
    "qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-72b", "gemma-2-9b", "phi-3-mini", "gpt2", "gpt2-xl", "bert-large-uncased",
]


def test_registry_has_the_required_models():
    assert set(REQUIRED) <= set(MODELS)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_registry_entry_builds_the_stated_parameter_count_on_meta(name):
    import torch
    import transformers

    spec = MODELS[name]
    cfg = spec.to_hf_config()
    with torch.device("meta"):
        if spec.family.task == "masked-lm":
            model = transformers.BertForMaskedLM(cfg)
        else:
            model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) == spec.n_params
    assert spec.derived_param_count() == spec.n_params
    # the fields come back from the transformers config unchanged
    again = ModelSpec.from_hf_config(cfg, name=name)
    assert again.fingerprint == spec.fingerprint or spec.hf_extra


def test_known_parameter_counts():
    assert MODELS["mistral-7b"].n_params == 7_241_732_096
    assert MODELS["llama-3-70b"].n_params == 70_553_706_496
    assert MODELS["gpt2"].n_params == 124_439_808


def test_a_wrong_stated_count_is_refused():
    fields = MODELS["gpt2"].as_dict()
    fields["n_params"] += 1
    fields["hf_extra"] = ()
    with pytest.raises(SpecError, match="stated parameter count"):
        ModelSpec(**fields)


def test_lora_params_of_llama_attention_and_all_linear():
    m = MODELS["llama-2-7b"]
    # r × (in + out) for q, k, v, o (4096 -> 4096), 32 layers
    assert m.lora_params(8, "attention") == 32 * 4 * 8 * (4096 + 4096)
    mlp = 2 * 8 * (4096 + 11008) + 8 * (11008 + 4096)
    assert m.lora_params(8, "all-linear") == 32 * (4 * 8 * 8192 + mlp)


def test_resolve_by_name_is_case_insensitive():
    assert resolve_model("Mistral-7B") is MODELS["mistral-7b"]


def test_unknown_name_suggests_close_matches():
    with pytest.raises(SpecError, match="did you mean.*mistral-7b"):
        resolve_model("mistral-7")


def test_local_config_json_and_directory(tmp_path):
    cfg = MODELS["qwen2.5-0.5b"].to_hf_config().to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    by_file = resolve_model(str(path))
    by_dir = resolve_model(str(tmp_path))
    assert by_file.n_params == by_dir.n_params == MODELS["qwen2.5-0.5b"].n_params
    assert by_file.fingerprint == MODELS["qwen2.5-0.5b"].fingerprint


def test_config_without_the_needed_fields_is_a_clear_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "vocab_size": 10}))
    with pytest.raises(SpecError, match="lacks the fields hidden_size"):
        resolve_model(str(path))


def test_unsupported_model_type(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "mamba", "hidden_size": 8}))
    with pytest.raises(SpecError, match="not supported"):
        resolve_model(str(path))


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SpecError, match="cannot fetch the config of hub id"):
        resolve_model("some-org/some-model-that-is-not-cached")


def test_variant_rederives_the_count(tiny_model):
    t = tiny_model("mistral-7b")
    assert t.num_layers == 2 and t.n_params == t.derived_param_count() < 10**7

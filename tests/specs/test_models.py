import json

import pytest

from autofit.errors import SpecError
from autofit.plan import LoraTargets
from autofit.specs import MODELS, ModelSpec, resolve_model

REQUIRED = [
    "mistral-7b",
    "llama-2-7b",
    "llama-2-13b",
    "llama-3-8b",
    "llama-3-70b",
    "llama-3.2-1b",
    "llama-3.2-3b",
    "qwen2.5-0.5b",
    "qwen2.5-7b",
    "qwen2.5-72b",
    "gemma-2-9b",
    "phi-3-mini",
    "gpt2",
    "gpt2-xl",
    "bert-large-uncased",
    # the architectures of published fine-tuning runs
    "phi-1_5",
    "phi-2",
    "stablelm-base-alpha-3b",
    "stablelm-base-alpha-7b",
    "gemma-2b",
    "gemma-7b",
    "bloom-7b1",
    "falcon-40b",
    "llama-2-70b",
    "llama-3.1-8b",
    "llama-3.1-70b",
    "llama-3.1-405b",
    "yi-6b",
    "yi-34b",
    # Qwen3 (dense): per-head q/k RMSNorm
    "qwen3-0.6b",
    "qwen3-1.7b",
    "qwen3-4b",
    "qwen3-8b",
    "qwen3-14b",
    "qwen3-32b",
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
    # as the model cards state them (rounded there)
    assert MODELS["phi-2"].n_params == 2_779_683_840  # "2.7B"
    assert MODELS["gemma-2b"].n_params == 2_506_172_416  # 2.51B with the tied embedding
    assert MODELS["bloom-7b1"].n_params == 7_069_016_064  # 7,069,016,064 on the card
    assert MODELS["llama-3.1-405b"].n_params == 405_853_388_800


# -- the families of published fine-tuning runs: config names, per-model block fields, LoRA names --
RAW_CONFIGS = {
    # config.json as the hub has them: the names each family's config class reads
    "phi-2": {
        "model_type": "phi",
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "partial_rotary_factor": 0.4,
        "resid_pdrop": 0.1,
        "embd_pdrop": 0.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "vocab_size": 51200,
    },
    "stablelm-base-alpha-3b": {
        "model_type": "gpt_neox",
        "hidden_size": 4096,
        "intermediate_size": 16384,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "rotary_pct": 0.25,
        "use_parallel_residual": True,
        "hidden_dropout": 0.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "vocab_size": 50688,
    },
    "falcon-40b": {
        "model_type": "falcon",
        "alibi": False,
        "bias": False,
        "hidden_size": 8192,
        "new_decoder_architecture": True,
        "num_attention_heads": 128,
        "num_hidden_layers": 60,
        "num_kv_heads": 8,
        "parallel_attn": True,
        "hidden_dropout": 0.0,
        "vocab_size": 65024,
    },
    "bloom-7b1": {
        "model_type": "bloom",
        "hidden_size": 4096,
        "n_layer": 30,
        "n_head": 32,
        "seq_length": 2048,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "vocab_size": 250880,
    },
}


@pytest.mark.parametrize("name", sorted(RAW_CONFIGS))
def test_a_hub_config_json_reads_as_the_registered_model(name, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(RAW_CONFIGS[name]))
    spec = resolve_model(str(path))
    assert spec.fingerprint == MODELS[name].fingerprint and spec.n_params == MODELS[name].n_params


def test_per_model_block_fields_reach_the_transformers_config():
    phi2 = MODELS["phi-2"]
    cfg = phi2.to_hf_config()
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.4 and cfg.resid_pdrop == 0.1
    assert phi2.rotary_dim == 32 and phi2.dropouts == {"residual"}
    assert MODELS["phi-1_5"].rotary_dim == 32 and not MODELS["phi-1_5"].dropouts  # PhiConfig's defaults
    neox = MODELS["stablelm-base-alpha-3b"]
    assert neox.to_hf_config().rope_parameters["partial_rotary_factor"] == 0.25 and neox.rotary_dim == 32
    assert MODELS["bloom-7b1"].rotary_dim == 0 and MODELS["llama-3.1-8b"].rotary_dim == 128
    assert MODELS["gpt2"].dropouts == {"attention", "residual", "embedding"}


def test_another_block_of_a_registered_type_is_read_from_transformers(tmp_path):
    """A config whose block is not the one its family describes (``Family.config_fixed``) is read
    from the model transformers builds (specs/derive.py), as an unregistered type is."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**RAW_CONFIGS["stablelm-base-alpha-3b"], "use_parallel_residual": False}))
    neox = resolve_model(str(path))
    assert neox.derived and not neox.family.parallel_residual and neox.analytic_gap == ""
    falcon_7b = {**RAW_CONFIGS["falcon-40b"], "new_decoder_architecture": False, "multi_query": True}
    path.write_text(json.dumps(falcon_7b))  # falcon-7b's block: one norm, multi-query
    falcon = resolve_model(str(path))
    assert falcon.derived and falcon.num_kv_heads == 1 and falcon.family.norms_per_layer == 1
    assert falcon.n_params == sum(p.numel() for p in _built(falcon).parameters())


def _built(spec):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(spec.to_hf_config())


def test_family_rules_are_refused_with_the_field_named(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**RAW_CONFIGS["phi-2"], "partial_rotary_factor": 1.5}))
    with pytest.raises(SpecError, match="'partial_rotary_factor' must be a fraction"):
        resolve_model(str(path))
    with pytest.raises(SpecError, match="intermediate_size must be 16,384"):
        ModelSpec(**{**MODELS["bloom-7b1"].as_dict(), "intermediate_size": 1000, "n_params": 0, "hf_extra": ()})
    # a resized BLOOM keeps its MLP 4 x hidden wide
    assert MODELS["bloom-7b1"].variant(hidden_size=64, intermediate_size=99).intermediate_size == 256


@pytest.mark.parametrize("model_type", ["phi", "gpt_neox", "gemma", "falcon", "bloom", "qwen2_moe", "mixtral"])
def test_lora_target_names_are_the_linears_peft_matches(model_type):
    """Every name of ``linears()`` is the suffix of exactly one Linear per block (PEFT's and
    bitsandbytes' matching rule), with the stated in and out features."""
    import torch

    from autofit.evaluators.runtime import hf_model_class

    spec = next(m for m in MODELS.values() if m.model_type == model_type)
    spec = spec.variant(num_layers=2, hidden_size=64, num_heads=4, head_dim=16, intermediate_size=128, vocab_size=128)
    with torch.device("meta"):
        model = hf_model_class(spec).from_config(spec.to_hf_config())
    for name, n_in, n_out, _ in spec.linears():
        found = [m for q, m in model.named_modules() if q == name or q.endswith("." + name)]
        assert len(found) == spec.num_layers, name
        assert all(isinstance(m, torch.nn.Linear) for m in found), name
        assert {(m.in_features, m.out_features) for m in found} == {(n_in, n_out)}, name


def test_a_wrong_stated_count_is_refused():
    fields = MODELS["gpt2"].as_dict()
    fields["n_params"] += 1
    fields["hf_extra"] = ()
    with pytest.raises(SpecError, match="stated parameter count"):
        ModelSpec(**fields)


def test_lora_params_of_llama_attention_and_all_linear():
    m = MODELS["llama-2-7b"]
    # r × (in + out) for q, k, v, o (4096 -> 4096), 32 layers
    assert m.lora_params(8, LoraTargets.ATTENTION) == 32 * 4 * 8 * (4096 + 4096)
    mlp = 2 * 8 * (4096 + 11008) + 8 * (11008 + 4096)
    assert m.lora_params(8, LoraTargets.ALL_LINEAR) == 32 * (4 * 8 * 8192 + mlp)
    assert m.lora_params(8) == m.lora_params(8, LoraTargets.ALL_LINEAR)  # no targets: every Linear


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


def test_a_model_type_that_is_no_transformer_decoder_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "mamba", "hidden_size": 8}))
    with pytest.raises(SpecError, match="mamba config has no num_heads: autofit models transformer decoders"):
        resolve_model(str(path))


def test_a_model_type_transformers_does_not_implement_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "internlm2", "hidden_size": 8}))
    with pytest.raises(SpecError, match="'internlm2' is not one transformers implements.*no remote code"):
        resolve_model(str(path))


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SpecError, match="cannot fetch the config of hub id"):
        resolve_model("some-org/some-model-that-is-not-cached")


def test_variant_rederives_the_count(tiny_model):
    t = tiny_model("mistral-7b")
    assert t.num_layers == 2 and t.n_params == t.derived_param_count() < 10**7


# -- a config.json is user input: wrong types are refused with the field and the file named --
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 704,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
}


@pytest.mark.parametrize(
    "field,value,fragment",
    [
        (
            "hidden_size",
            "4096",
            "'hidden_size' must be a positive integer, got \"4096\" (a string); write it without quotes",
        ),
        ("hidden_size", [4096], "'hidden_size' must be a positive integer, got [4096] (a list)"),
        ("hidden_size", 4096.5, "'hidden_size' must be a positive integer, got 4096.5"),
        ("hidden_size", float("inf"), "'hidden_size' must be a positive integer, got inf"),
        ("hidden_size", 2.0**60, "'hidden_size' is 1,152,921,504,606,846,976, beyond the 131,072"),
        ("num_attention_heads", 0, "'num_attention_heads' must be a positive integer, got 0"),
        ("num_hidden_layers", True, "'num_hidden_layers' must be a positive integer, got true (a boolean)"),
        ("vocab_size", -5, "'vocab_size' must be a positive integer, got -5"),
        ("max_position_embeddings", "8k", "'max_position_embeddings' must be a positive integer"),
        ("max_position_embeddings", 0, "'max_position_embeddings' must be a positive integer, got 0"),
        ("intermediate_size", {"v": 1}, "'intermediate_size' must be a positive integer, got {\"v\": 1} (an object)"),
        ("num_key_value_heads", "2", "'num_key_value_heads' must be a positive integer"),
        ("num_key_value_heads", 0, "'num_key_value_heads' must be a positive integer, got 0"),
        ("head_dim", 0, "'head_dim' must be a positive integer, got 0"),
        ("head_dim", [32], "'head_dim' must be a positive integer"),
        ("tie_word_embeddings", "false", "'tie_word_embeddings' must be true or false, got \"false\" (a string)"),
        ("tie_word_embeddings", 1, "'tie_word_embeddings' must be true or false"),
        ("model_type", ["llama"], '\'model_type\' must be a string such as "llama", got ["llama"] (a list)'),
        ("model_type", None, "lacks 'model_type'"),
    ],
)
def test_config_fields_of_the_wrong_type_are_named_with_the_file(tmp_path, field, value, fragment):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_LLAMA, field: value}))
    with pytest.raises(SpecError) as err:
        resolve_model(str(path))
    message = str(err.value)
    assert fragment in message and str(path) in message and "\n" not in message


def test_gpt2_fields_are_named_as_the_file_names_them(tmp_path):
    cfg = MODELS["gpt2"].to_hf_config().to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**cfg, "n_head": "12"}))
    with pytest.raises(SpecError, match="'n_head' must be a positive integer"):
        resolve_model(str(path))


def test_more_heads_than_hidden_units_without_head_dim(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_LLAMA, "hidden_size": 4}))
    with pytest.raises(SpecError, match=r"'num_attention_heads' \(8\) exceeds 'hidden_size' \(4\)"):
        resolve_model(str(path))


def test_whole_floats_and_nulls_are_read_as_the_numbers_they_are(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                **TINY_LLAMA,
                "hidden_size": 256.0,
                "num_key_value_heads": None,
                "head_dim": None,
                "tie_word_embeddings": None,
            }
        )
    )
    spec = resolve_model(str(path))
    assert spec.hidden_size == 256 and type(spec.hidden_size) is int
    assert spec.num_kv_heads == 8 and spec.head_dim == 32 and spec.tie_word_embeddings is False


def test_a_config_that_is_not_utf8_text(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b'{"model_type": "llama", "name": "\xff\xfe"}')
    with pytest.raises(SpecError, match=r"is not UTF-8 text \(byte 0xff at offset 33\)"):
        resolve_model(str(tmp_path))


def test_a_config_nested_too_deeply(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(SpecError, match="nested too deeply"):
        resolve_model(str(path))


def test_the_spec_itself_refuses_wrong_types_and_absurd_sizes():
    with pytest.raises(SpecError, match="model type"):
        MODELS["gpt2"].variant(model_type=["gpt2"])
    with pytest.raises(SpecError, match="tie_word_embeddings must be true or false"):
        MODELS["gpt2"].variant(tie_word_embeddings="no")
    with pytest.raises(SpecError, match="num_layers 4,096 is beyond the 1,024"):
        MODELS["gpt2"].variant(num_layers=4096)


# -- hub ids: fast and one line when the hub is out of reach; a cached config still serves --
HUB_PROBE = """
import sys, time
t = time.monotonic()
from autofit.errors import SpecError
from autofit.specs import resolve_model
try:
    spec = resolve_model(sys.argv[1])
    print("ok", spec.name, spec.n_params)
except SpecError as exc:
    print("error", exc)
print("transformers" in sys.modules, round(time.monotonic() - t, 2))
"""


def _hub_probe(hub_id, tmp_path, **env):
    import os
    import subprocess
    import sys

    drop = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT", "HF_HUB_CACHE")
    full = {k: v for k, v in os.environ.items() if k not in drop}
    full.update(HF_HOME=str(tmp_path / "hf"), **env)
    proc = subprocess.run(
        [sys.executable, "-c", HUB_PROBE, hub_id], env=full, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    *out, timing = proc.stdout.strip().splitlines()
    imported, seconds = timing.split()
    return "\n".join(out), proc.stderr, imported == "True", float(seconds)


def test_hub_id_offline_says_why_without_loading_transformers(tmp_path):
    out, err, imported, seconds = _hub_probe("nobody/no-such-model", tmp_path, HF_HUB_OFFLINE="1")
    assert out.startswith("error") and "not a registered model, not a local path, and the hub is unreachable" in out
    assert "HF_HUB_OFFLINE" in out and "pass a local config.json" in out
    assert not imported  # transformers (and torch) take seconds to import; a refusal needs neither
    assert err == ""


def test_hub_id_with_the_hub_unreachable_fails_at_once_in_one_line(tmp_path):
    # a refused connection: huggingface_hub's download would retry it 5 times with backoff (23 s)
    out, err, imported, seconds = _hub_probe("nobody/no-such-model", tmp_path, HF_ENDPOINT="http://127.0.0.1:9")
    assert out.startswith("error") and "the hub is unreachable" in out and "\n" not in out
    assert err == "" and not imported
    assert seconds < 10


def _cache_config(tmp_path, hub_id, cfg):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / ("models--" + hub_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text(json.dumps(cfg))


def test_a_cached_hub_config_serves_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants

    _cache_config(tmp_path, "acme/tiny-gpt2", MODELS["gpt2"].to_hf_config().to_dict())
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    spec = resolve_model("acme/tiny-gpt2")
    assert spec.name == spec.source == "acme/tiny-gpt2" and spec.fingerprint == MODELS["gpt2"].fingerprint


def test_a_cached_hub_config_serves_when_the_hub_is_unreachable(tmp_path):
    _cache_config(tmp_path, "acme/tiny-gpt2", MODELS["gpt2"].to_hf_config().to_dict())
    out, _, _, _ = _hub_probe("acme/tiny-gpt2", tmp_path, HF_ENDPOINT="http://127.0.0.1:9")
    assert out == f"ok acme/tiny-gpt2 {MODELS['gpt2'].n_params}"


def test_an_invalid_hub_id_is_named(tmp_path):
    with pytest.raises(SpecError, match="not a valid hub id"):
        resolve_model("a/b/c")

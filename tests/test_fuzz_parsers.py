"""Parsers either return a valid object or raise autofit's own error — never anything else."""

import string

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autofit.errors import AutofitError
from autofit.plan import Plan
from autofit.search.studies import load_study_file
from autofit.specs import parse_cluster
from autofit.specs.units import parse_duration, parse_size

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

gpu_words = st.sampled_from(["A10", "a100-80gb", "H100", "rtx4090", "T4", "cpu", "A10x3", "x", "", "-", "80GB"])
cluster_text = st.one_of(
    st.text(alphabet=string.printable, max_size=20),
    st.builds(
        lambda n, sep, g: f"{n}{sep}{g}", st.integers(-3, 20), st.sampled_from(["x", "X", "*", " x ", ""]), gpu_words
    ),
)


@FUZZ
@given(cluster_text)
def test_cluster_parser(text):
    try:
        c = parse_cluster(text)
    except AutofitError:
        return
    assert c.world_size >= 1 and c.gpu.memory_bytes > 0


plan_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 70),
    st.text(max_size=12),
    st.sampled_from(
        [
            "full",
            "lora",
            "qlora",
            "bf16-mixed",
            "zero3",
            "flash2",
            "adamw-8bit",
            "optimizer+params",
            "nvme",
            "all-linear",
        ]
    ),
)
plan_keys = st.sampled_from(
    [
        "method",
        "lora_rank",
        "lora_targets",
        "precision",
        "optimizer",
        "micro_batch",
        "grad_accum",
        "checkpointing",
        "attention",
        "sharding",
        "offload",
        "offload_device",
        "packing",
        "fused_loss",
        "bogus",
    ]
)


@FUZZ
@given(st.dictionaries(plan_keys, plan_values, max_size=8))
def test_plan_parser(data):
    try:
        plan = Plan.from_dict(data)
    except AutofitError:
        return
    assert Plan.from_dict(plan.as_dict()) == plan


yaml_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=10)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=6,
)
study_keys = st.sampled_from(["model", "gpus", "seq_len", "global_batch", "methods", "trials", "timeout", "x"])


@FUZZ
@given(st.one_of(st.dictionaries(study_keys, yaml_values, max_size=5), yaml_values, st.text(max_size=40)))
def test_study_file_loader(tmp_path_factory, content):
    import yaml

    path = tmp_path_factory.mktemp("s") / "study.yaml"
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    try:
        data = load_study_file(str(path))
    except AutofitError:
        return
    assert isinstance(data, dict)


@FUZZ
@given(st.text(max_size=12))
def test_size_and_duration_parsers(text):
    for parse in (parse_size, parse_duration):
        try:
            value = parse(text)
        except AutofitError:
            continue
        assert value is None or value >= 0


@FUZZ
@given(st.one_of(st.integers(), st.floats(), st.text(alphabet="0123456789.hms ", max_size=400)))
def test_duration_parser_returns_a_positive_finite_time(value):
    import math

    try:
        seconds = parse_duration(value)
    except AutofitError:
        return
    assert seconds > 0 and math.isfinite(seconds)


config_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 5000),
    st.integers(),
    st.floats(),
    st.text(max_size=6),
    st.lists(st.integers(1, 64), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=1),
)
config_keys = st.sampled_from(
    [
        "model_type",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "n_embd",
        "n_head",
    ]
)


@FUZZ
@given(st.sampled_from(["llama", "gpt2", "gemma2"]), st.dictionaries(config_keys, config_values, max_size=4))
def test_model_config_reader(model_type, overrides):
    from autofit.specs import ModelSpec

    base = {
        "model_type": model_type,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 100,
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
    }
    try:
        spec = ModelSpec.from_hf_config({**base, **overrides}, source="config.json")
    except AutofitError as exc:
        assert "\n" not in str(exc)
        return
    assert spec.n_params > 0 and spec.num_heads % spec.num_kv_heads == 0
    assert all(type(getattr(spec, f)) is int for f in ("hidden_size", "num_layers", "num_heads", "head_dim"))

"""Parsers either return a valid object or raise autofit's own error — never anything else."""

import string

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autofit.cli.options import parse_duration, parse_size
from autofit.errors import AutofitError
from autofit.plan import Plan
from autofit.specs import parse_cluster
from autofit.studies import load_study_file

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

gpu_words = st.sampled_from(["A10", "a100-80gb", "H100", "rtx4090", "T4", "cpu", "A10x3", "x", "", "-", "80GB"])
cluster_text = st.one_of(
    st.text(alphabet=string.printable, max_size=20),
    st.builds(lambda n, sep, g: f"{n}{sep}{g}", st.integers(-3, 20), st.sampled_from(["x", "X", "*", " x ", ""]), gpu_words),
)


@FUZZ
@given(cluster_text)
def test_cluster_parser(text):
    try:
        c = parse_cluster(text)
    except AutofitError:
        return
    assert c.world_size >= 1 and c.gpu.memory_bytes > 0


plan_values = st.one_of(st.none(), st.booleans(), st.integers(-2, 70), st.text(max_size=12),
                        st.sampled_from(["full", "lora", "qlora", "bf16-mixed", "zero3", "flash2", "adamw-8bit",
                                         "optimizer+params", "nvme", "all-linear"]))
plan_keys = st.sampled_from(["method", "lora_rank", "lora_targets", "precision", "optimizer", "micro_batch",
                             "grad_accum", "checkpointing", "attention", "sharding", "offload", "offload_device",
                             "packing", "fused_loss", "bogus"])


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

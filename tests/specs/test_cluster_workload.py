import json

import pytest

from autofit.errors import SpecError
from autofit.specs import LengthDistribution, Workload, load_lengths, parse_cluster


@pytest.mark.parametrize("text,count,gpu", [("2xA10", 2, "A10"), ("A100-80GB", 1, "A100-80GB"), ("8xH100", 8, "H100-80GB"),
                                            ("1xrtx4090", 1, "RTX4090"), ("4X a10g", 4, "A10G")])
def test_parse_cluster(text, count, gpu):
    c = parse_cluster(text)
    assert c.gpus_per_node == count and c.gpu.name == gpu and c.world_size == count


@pytest.mark.parametrize("text,match", [("0xA10", "at least 1"), ("-1xA10", "at least 1"), ("2xA10x3", "malformed"),
                                        ("", "empty"), ("2xfoo", "unknown GPU")])
def test_bad_clusters(text, match):
    with pytest.raises(SpecError, match=match):
        parse_cluster(text)


def test_nodes_and_host_memory_default():
    c = parse_cluster("8xA100-80GB", nodes=2)
    assert c.world_size == 16
    assert c.host_memory_bytes == 2 * 8 * c.gpu.memory_bytes


def test_expected_max_of_a_histogram():
    d = LengthDistribution(((100, 1), (200, 1)))
    assert d.expected_max(1) == pytest.approx(150)
    # max of two draws is 200 unless both are 100 (p = 1/4)
    assert d.expected_max(2) == pytest.approx(100 * 0.25 + 200 * 0.75)


def test_workload_truncates_lengths_and_counts_real_tokens():
    w = Workload(seq_len=128, global_batch=4, lengths=LengthDistribution(((64, 1), (512, 1))))
    assert w.lengths.max == 128
    assert w.mean_tokens == pytest.approx(96)
    assert w.tokens_per_step() == pytest.approx(4 * 96)


def test_load_lengths_from_jsonl_and_histogram(tmp_path):
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps({"text": "x" * n}) for n in (40, 80, 400)) + "\n")
    d = load_lengths(str(jl))
    assert d.histogram == ((10, 1), (20, 1), (100, 1)) and "chars/4" in d.source
    h = tmp_path / "h.json"
    h.write_text(json.dumps({"128": 3, "256": 1}))
    assert load_lengths(str(h)).mean == pytest.approx((3 * 128 + 256) / 4)


def test_bad_length_files(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        load_lengths(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\n')
    with pytest.raises(SpecError, match="needs a 'text'"):
        load_lengths(str(bad))

import json

import pytest

from autofit.errors import SpecError
from autofit.specs import LengthDistribution, Workload, load_lengths, parse_cluster


@pytest.mark.parametrize(
    "text,count,gpu",
    [
        ("2xA10", 2, "A10"),
        ("A100-80GB", 1, "A100-80GB"),
        ("8xH100", 8, "H100-80GB"),
        ("1xrtx4090", 1, "RTX4090"),
        ("4X a10g", 4, "A10G"),
    ],
)
def test_parse_cluster(text, count, gpu):
    c = parse_cluster(text)
    assert c.gpus_per_node == count and c.gpu.name == gpu and c.world_size == count


@pytest.mark.parametrize(
    "text,match",
    [
        ("0xA10", "at least 1"),
        ("-1xA10", "at least 1"),
        ("2xA10x3", "malformed"),
        ("", "empty"),
        ("2xfoo", "unknown GPU"),
    ],
)
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


def test_gpu_and_node_counts_have_a_ceiling():
    from autofit.specs.cluster import MAX_GPUS_PER_NODE, MAX_NODES, ClusterSpec

    assert parse_cluster(f"{MAX_GPUS_PER_NODE}xH100").gpus_per_node == MAX_GPUS_PER_NODE
    for text in (f"{MAX_GPUS_PER_NODE + 1}xH100", "99999999999999999999xT4"):
        with pytest.raises(SpecError, match="more than any node holds"):
            parse_cluster(text)
    assert parse_cluster("8xH100", nodes=MAX_NODES).world_size == 8 * MAX_NODES
    with pytest.raises(SpecError, match="--nodes 65,537 is more than any cluster has"):
        parse_cluster("8xH100", nodes=MAX_NODES + 1)
    gpu = parse_cluster("1xT4").gpu
    with pytest.raises(SpecError, match="more than any node holds"):
        ClusterSpec(gpu=gpu, gpus_per_node=10**6)


def test_seq_len_has_a_ceiling():
    from autofit.specs.workload import MAX_SEQ_LEN

    assert Workload(seq_len=MAX_SEQ_LEN, global_batch=1).seq_len == 2**20
    with pytest.raises(SpecError, match="--seq-len 99,999,999,999 is beyond the 1,048,576 tokens"):
        Workload(seq_len=99_999_999_999, global_batch=1)


def test_cpu_budget_cannot_exceed_the_machine(monkeypatch):
    from autofit.search.request import with_cpu_budget
    from autofit.specs import gpus

    monkeypatch.setattr(gpus, "physical_memory_bytes", lambda: 8 * gpus.GiB)
    assert with_cpu_budget(parse_cluster("1xcpu"), "8GiB").gpu.memory_bytes == 8 * gpus.GiB
    assert with_cpu_budget(parse_cluster("2xcpu"), "4GiB").gpu.memory_bytes == 4 * gpus.GiB
    with pytest.raises(
        SpecError,
        match=r"--cpu-mem-budget 1TB exceeds this machine's 8.0 GiB of physical memory; "
        r"give at most 8.0GiB",
    ):
        with_cpu_budget(parse_cluster("1xcpu"), "1TB")
    with pytest.raises(SpecError, match="for each of 2 CPU ranks exceeds this machine's 8.0 GiB.*at most 4.0GiB"):
        with_cpu_budget(parse_cluster("2xcpu"), "5GiB")


def test_cpu_device_defaults_to_the_physical_memory():
    from autofit.specs.gpus import cpu_device, physical_memory_bytes

    assert cpu_device().memory_bytes == physical_memory_bytes() > 0


# -- round trips: from_dict(as_dict()) is the identity, through JSON too --------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from autofit.specs import GPUS, ClusterSpec  # noqa: E402
from autofit.specs.gpus import cpu_device  # noqa: E402


def _through_json(d: dict) -> dict:
    return json.loads(json.dumps(d))


@settings(max_examples=60, deadline=None)
@given(
    gpu=st.sampled_from(sorted(GPUS)),
    per_node=st.integers(1, 16),
    nodes=st.integers(1, 64),
    host=st.sampled_from([0, 64 * 2**30, 1536 * 2**30]),
    gbps=st.sampled_from([25.0, 50.0, 12.5]),
)
def test_cluster_round_trips(gpu, per_node, nodes, host, gbps):
    c = ClusterSpec(gpu=GPUS[gpu], gpus_per_node=per_node, nodes=nodes, host_memory_bytes=host, inter_node_gbps=gbps)
    assert ClusterSpec.from_dict(_through_json(c.as_dict())) == c
    assert "cpu_memory_bytes" not in c.as_dict()  # a catalog GPU is its name


@settings(max_examples=20, deadline=None)
@given(budget=st.integers(2**20, 2**40), ranks=st.integers(1, 4))
def test_the_cpu_target_round_trips_with_its_memory_budget(budget, ranks):
    """--gpus Nxcpu --cpu-mem-budget: the budget is the device's memory, and comes back with it."""
    c = ClusterSpec(gpu=cpu_device(budget), gpus_per_node=ranks)
    back = ClusterSpec.from_dict(_through_json(c.as_dict()))
    assert back == c and back.gpu.memory_bytes == budget


def test_a_cpu_cluster_stored_without_its_budget_gets_this_machines_memory():
    """What an older autofit stored: the name only (as `--gpus 1xcpu` without a budget)."""
    d = ClusterSpec(gpu=cpu_device(2**30)).as_dict()
    del d["cpu_memory_bytes"]
    assert ClusterSpec.from_dict(d).gpu == cpu_device()


_histograms = st.dictionaries(st.integers(1, 10_000), st.integers(1, 1000), min_size=1, max_size=8).map(
    lambda d: tuple(sorted(d.items()))
)


@settings(max_examples=60, deadline=None)
@given(hist=_histograms, source=st.text(max_size=20))
def test_length_distribution_round_trips(hist, source):
    d = LengthDistribution(hist, source)
    assert LengthDistribution.from_dict(_through_json(d.as_dict())) == d


@settings(max_examples=60, deadline=None)
@given(seq_len=st.integers(1, 8192), global_batch=st.integers(1, 512), hist=st.none() | _histograms)
def test_workload_round_trips(seq_len, global_batch, hist):
    w = Workload(
        seq_len=seq_len, global_batch=global_batch, lengths=LengthDistribution(hist, "lengths.json") if hist else None
    )
    assert Workload.from_dict(_through_json(w.as_dict())) == w


# -- custom GPUs (issue 17): --gpus 2x24GiB, --gpus 2xcard.yaml -----------------------------------
from autofit.specs.cluster import HostMemory  # noqa: E402
from autofit.specs.gpus import GiB  # noqa: E402

CARD = """\
name: lab-card
memory: 24GiB
bf16_tflops: 165.2
fp16_tflops: 165.2
fp32_tflops: 82.6
tf32_tflops: 82.6
memory_bw_gbps: 1008
compute_capability: "8.9"
"""


@pytest.mark.parametrize(
    "text,count,mem,like",
    [
        ("2x24GiB", 2, 24 * GiB, "RTX3090Ti"),  # nearest memory: 24576 MiB (RTX 3090 and 3090 Ti; the faster)
        ("80GB", 1, 80 * 10**9, "H100-80GB"),  # 74.5 GiB: nearest the H100's 79.6 GiB
        ("1x24G", 1, 24 * 10**9, "A10"),  # 22.35 GiB: nearest the A10's 22.49 GiB
        ("4 x 141 GiB", 4, 141 * GiB, "H200"),
    ],
)
def test_memory_only_custom_gpu_states_its_assumed_rates(text, count, mem, like):
    c = parse_cluster(text)
    g = c.gpu
    assert c.gpus_per_node == count and g.memory_bytes == mem and g.name.startswith("custom-")
    ref = GPUS[like]
    assert (g.bf16_tflops, g.memory_bw_gbps, g.compute_capability) == (
        ref.bf16_tflops,
        ref.memory_bw_gbps,
        ref.compute_capability,
    )
    assert f"assumed to be the {like}'s" in g.assumption and g.assumption in c.assumptions()
    assert not g.is_catalog


@pytest.mark.parametrize(
    "text,match",
    [
        ("2x24MiB", "a GPU has between 1 GiB and 1 TiB"),
        ("2x24TB", "a GPU has between 1 GiB and 1 TiB"),
        ("2x24", "unknown GPU '24'.*memory such as 24GiB"),  # a size needs its unit
        ("2x/nope/card.yaml", "GPU spec '/nope/card.yaml' not found"),
    ],
)
def test_bad_custom_gpus(text, match):
    with pytest.raises(SpecError, match=match):
        parse_cluster(text)


def test_yaml_gpu_spec(tmp_path):
    f = tmp_path / "card.yaml"
    f.write_text(CARD)
    c = parse_cluster(f"2x{f}")
    g = c.gpu
    assert (g.name, g.memory_bytes, g.bf16_tflops, g.compute_capability) == ("lab-card", 24 * GiB, 165.2, (8, 9))
    assert g.intra_node_link == "pcie4" and g.intra_node_gbps == 32 and g.host_link_gbps == 32  # the defaults
    assert g.supports_bf16 and g.supports_flash2 and not g.assumption and c.label == "2xlab-card"
    nv = tmp_path / "nv.yml"
    nv.write_text(CARD + "intra_node_link: nvlink\nintra_node_gbps: 450\nhost_link_gbps: 64\n")
    assert parse_cluster(f"8x{nv}").gpu.intra_node_gbps == 450


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda s: s + "vram: 24GiB\n", r"unknown keys vram \(known: name, memory"),
        (
            lambda s: s.replace("memory_bw_gbps: 1008\n", "").replace("name: lab-card\n", ""),
            "missing required keys name, memory_bw_gbps",
        ),
        (lambda s: s.replace("name: lab-card", "name: H100"), "name 'H100' is a catalog GPU"),
        (lambda s: s.replace("memory: 24GiB", "memory: lots"), "memory 'lots': cannot read size"),
        (lambda s: s.replace('"8.9"', "eight"), "compute_capability 'eight': write it as MAJOR.MINOR"),
        (lambda s: s.replace("fp32_tflops: 82.6", "fp32_tflops: 0"), "fp32_tflops 0: must be a positive number"),
        (lambda s: s + "intra_node_link: nvlink\n", "intra_node_gbps is required with intra_node_link nvlink"),
        (lambda s: s + "intra_node_link: infiniband\n", "intra_node_link 'infiniband' is none of nvlink, pcie3"),
        (lambda s: "- a list\n", "expected a mapping"),
        (lambda s: "name: [unclosed\n", "not valid YAML"),
    ],
)
def test_bad_yaml_gpu_specs_name_each_problem(tmp_path, edit, match):
    f = tmp_path / "card.yaml"
    f.write_text(edit(CARD))
    with pytest.raises(SpecError, match=match) as err:
        parse_cluster(f"1x{f}")
    assert "\n" not in str(err.value)  # one line


def test_every_problem_of_a_yaml_spec_in_one_error(tmp_path):
    f = tmp_path / "card.yaml"
    f.write_text("name: x\nmemory: 2MiB\nbf16_tflops: -1\nspeed: 3\n")
    with pytest.raises(SpecError) as err:
        parse_cluster(f"1x{f}")
    msg = str(err.value)
    for part in ("unknown keys speed", "missing required keys fp16_tflops", "memory '2MiB'", "bf16_tflops -1"):
        assert part in msg


def test_custom_gpus_round_trip_with_all_their_figures(tmp_path):
    """A stored study reopens with the same GPU: a custom card's figures are stored, not its name."""
    f = tmp_path / "card.yaml"
    f.write_text(CARD)
    for text in ("2x24GiB", f"2x{f}"):
        c = parse_cluster(text, nodes=2, inter_node_gbps=50.0)
        d = _through_json(c.as_dict())
        assert d["gpu_spec"]["name"] == c.gpu.name
        back = ClusterSpec.from_dict(d)
        assert back == c and back.gpu == c.gpu and back.gpu.assumption == c.gpu.assumption
    f.unlink()  # the file is gone: the stored study still opens
    assert ClusterSpec.from_dict(d).gpu.name == "lab-card"


# -- host memory: given, this node's, or assumed (and said so) -----------------------------------
def test_host_memory_origin():
    assumed = parse_cluster("2xA10")
    assert assumed.host_memory_origin is HostMemory.ASSUMED
    assert any("assumed 90 GiB" in a and "--host-mem" in a for a in assumed.assumptions())
    given = parse_cluster("2xA10", host_memory_bytes=256 * GiB)
    assert given.host_memory_origin is HostMemory.GIVEN and given.assumptions() == ()


def test_the_cpu_target_has_this_nodes_ram_as_host_memory():
    from autofit.specs.gpus import physical_memory_bytes

    c = parse_cluster("1xcpu")
    assert c.host_memory_bytes == physical_memory_bytes() and c.host_memory_origin is HostMemory.LOCAL
    assert c.assumptions() == ()


def test_a_local_gpu_gets_this_nodes_ram(monkeypatch):
    """build_cluster: a local CUDA device matching the requested GPU means this node is the target."""
    from autofit.evaluators import measured
    from autofit.search.request import build_cluster
    from autofit.specs.gpus import match_gpu, physical_memory_bytes

    local = [match_gpu("NVIDIA L40S", 46068 * 2**20)] * 2
    monkeypatch.setattr(measured, "local_gpus", lambda: local)
    c = build_cluster("4xL40S")
    assert c.host_memory_bytes == physical_memory_bytes() and c.host_memory_origin is HostMemory.LOCAL
    remote = build_cluster("4xA10")
    assert (
        remote.host_memory_origin is HostMemory.ASSUMED and remote.host_memory_bytes == 2 * 4 * GPUS["A10"].memory_bytes
    )
    assert build_cluster("4xL40S", host_mem="64GiB").host_memory_bytes == 64 * GiB


def test_stored_host_memory_stays_and_old_studies_count_it_as_given():
    c = parse_cluster("2xA10")
    d = _through_json(c.as_dict())
    assert d["host_memory_origin"] == "assumed" and ClusterSpec.from_dict(d).host_memory_origin is HostMemory.ASSUMED
    del d["host_memory_origin"]  # as an older autofit stored it
    old = ClusterSpec.from_dict(d)
    assert old.host_memory_bytes == c.host_memory_bytes and old.host_memory_origin is HostMemory.GIVEN


def test_inter_node_bandwidth_must_be_positive():
    with pytest.raises(SpecError, match="--inter-node-gbps must be positive"):
        parse_cluster("8xH100", nodes=2, inter_node_gbps=0)

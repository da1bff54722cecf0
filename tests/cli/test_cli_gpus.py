"""The GPUs and clusters of issue 17 through the CLI: custom GPUs, AMD (analytic only), the
host memory an answer assumes, and the inter-node fabric."""

import json

import pytest
from click.testing import CliRunner

from autofit.cli import cli
from tests.specs.test_cluster_workload import CARD  # one YAML card for both suites

GiB = 2**30
ANALYTIC = ("--evaluator", "analytic", "--no-calibration")


def run(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def estimate_json(*args):
    r = run("estimate", "-m", "gpt2", "--seq-len", "1024", *ANALYTIC, "--json", *args)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_memory_only_gpu_is_planned_and_its_assumptions_are_in_the_answer():
    data = estimate_json("-g", "2x24GiB")
    assert data["capacity_bytes"] == 24 * GiB
    assert data["cluster"]["gpu"] == "custom-24GiB" and data["cluster"]["gpu_spec"]["bf16_tflops"] == 80
    text = " ".join(data["assumptions"])
    assert "assumed to be the RTX3090Ti's" in text and "host memory per node assumed 96 GiB" in text
    r = run("estimate", "-m", "gpt2", "--seq-len", "1024", *ANALYTIC, "-g", "2x24GiB")
    assert r.exit_code == 0, r.output
    assert "assumed: custom-24GiB has only its memory given" in " ".join(r.output.split())
    assert "set --host-mem to the node's RAM" in " ".join(r.output.split())


def test_a_given_host_memory_is_not_called_assumed():
    data = estimate_json("-g", "1xA10", "--host-mem", "64GiB")
    assert data["cluster"]["host_memory_bytes"] == 64 * GiB and data["cluster"]["host_memory_origin"] == "given"
    assert data["assumptions"] == []


def test_yaml_gpu_spec_through_the_cli(tmp_path):
    f = tmp_path / "card.yaml"
    f.write_text(CARD)
    data = estimate_json("-g", f"2x{f}")
    assert data["capacity_bytes"] == 24 * GiB and data["cluster"]["gpu_spec"]["name"] == "lab-card"
    assert not any("lab-card" in a for a in data["assumptions"])  # its figures are given
    f.write_text(CARD + "vram: 1\n")
    r = CliRunner().invoke(cli, ["estimate", "-m", "gpt2", "-g", f"1x{f}", *ANALYTIC])
    assert r.exit_code != 0 and "unknown keys vram" in r.output and len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "custom,name", [("24GiB", "custom-24GiB"), ("2x80GB", "custom-80GB"), ("H100 NVL", "H100-NVL")]
)
def test_gpus_shows_a_custom_card(custom, name):
    r = run("gpus", "--custom", custom, "--json")
    assert r.exit_code == 0, r.output
    (g,) = json.loads(r.stdout)
    assert g["name"] == name and ("assumption" in g) == name.startswith("custom-")


def test_amd_gpus_are_analytic_only():
    r = run("estimate", "-m", "gpt2", "--seq-len", "1024", "-g", "1xMI300X", "--no-calibration", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["evaluator"] == "analytic" and data["plan"]["precision"] == "bf16-mixed"
    for evaluator in ("simulated", "measured"):
        r = CliRunner().invoke(
            cli, ["estimate", "-m", "gpt2", "--seq-len", "1024", "-g", "1xMI325X", "--evaluator", evaluator]
        )
        assert r.exit_code != 0
        assert f"the {evaluator} evaluator cannot model MI325X" in r.output and "--evaluator analytic" in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_the_inter_node_fabric_prices_the_gradient_sync():
    """--nodes 2 --inter-node-gbps: a slower fabric makes the same plan's step slower (timing.py)."""
    common = ("-m", "gpt2", "-g", "8xA100-80GB", "--nodes", "2", "--global-batch", "16", "--host-mem", "1TiB")
    slow = estimate_json(*common, "--inter-node-gbps", "5")
    fast = estimate_json(*common, "--inter-node-gbps", "200")
    assert slow["cluster"]["inter_node_gbps"] == 5 and fast["cluster"]["inter_node_gbps"] == 200
    assert slow["throughput"]["comm_s"] > fast["throughput"]["comm_s"] > 0
    one_node = ("-m", "gpt2", "-g", "8xA100-80GB", "--global-batch", "16", "--host-mem", "1TiB")
    assert estimate_json(*one_node, "--inter-node-gbps", "5")["throughput"] == estimate_json(*one_node)["throughput"]
    r = CliRunner().invoke(cli, ["estimate", *common, "--inter-node-gbps", "0"])
    assert r.exit_code != 0 and "--inter-node-gbps" in r.output


def test_no_fit_says_how_much_host_ram_would_fit(tmp_path):
    """Full fine-tuning of a 7B model on one A10 fits only by offloading to host RAM: the advice names it."""
    r = run(
        "search", "-m", "mistral-7b", "-g", "1xA10", "--methods", "full", "--evaluator", "analytic",
        "--trials", "8", "--host-mem", "32GiB", "--db", f"sqlite:///{tmp_path}/s.db", "--out", str(tmp_path / "out"),
        "--no-report", "--json",
    )  # fmt: skip
    assert r.exit_code == 3, r.output
    data = json.loads(r.stdout)
    (line,) = [a for a in data["advice"] if "host RAM" in a]
    assert line.startswith("with ≥ 111 GiB of host RAM per node (--host-mem 111GiB; the node has 32 GiB, given)")
    assert "offload(optimizer+params→cpu)" in line
    assert data["cluster"]["host_memory_bytes"] == 32 * GiB and data["assumptions"] == []


def test_amd_estimates_carry_the_gpu_runs_margin():
    """An analytic estimate for a ROCm card is no surer than for a CUDA one: the same 95% margin."""
    amd = estimate_json("-g", "1xMI300X")
    nvidia = estimate_json("-g", "1xH100")
    assert amd["extra"]["fit_margin"]["fraction"] == nvidia["extra"]["fit_margin"]["fraction"] > 0


def test_a_study_file_sets_the_fabric(tmp_path):
    study = tmp_path / "s.yaml"
    study.write_text("model: gpt2\ngpus: 8xH100\nnodes: 2\ninter_node_gbps: 50\nseq_len: 1024\nhost_mem: 1TiB\n")
    r = run(
        "search", "--config", str(study), "--evaluator", "analytic", "--trials", "4", "--no-report",
        "--db", f"sqlite:///{tmp_path}/s.db", "--out", str(tmp_path / "out"), "--json",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["cluster"]["inter_node_gbps"] == 50 and data["cluster"]["nodes"] == 2

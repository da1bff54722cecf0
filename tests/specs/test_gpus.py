import pytest

from autofit.errors import SpecError
from autofit.specs import GPUS, resolve_gpu

REQUIRED = [
    "A10",
    "A10G",
    "L4",
    "T4",
    "V100-16GB",
    "V100-32GB",
    "A100-40GB",
    "A100-80GB",
    "H100-80GB",
    "H100-PCIE",
    "H200",
    "L40S",
    "RTX3090",
    "RTX4090",
    "A6000",
    # issue 17
    "B200",
    "GB200",
    "H100-NVL",
    "H20",
    "L40",
    "A40",
    "A5000",
    "RTX6000-Ada",
    "RTX5090",
    "RTX3090Ti",
    "MI300X",
    "MI325X",
]


def test_catalog_has_the_required_gpus():
    assert set(REQUIRED) <= set(GPUS)


@pytest.mark.parametrize("name", sorted(GPUS))
def test_every_entry_is_complete_and_consistent(name):
    g = GPUS[name]
    assert g.memory_bytes > 10 * 2**30
    assert g.fp16_tflops > g.fp32_tflops > 0
    assert g.memory_bw_gbps > 100 and g.intra_node_gbps > 0 and g.host_link_gbps > 0
    assert g.source
    assert g.supports_bf16 == (g.bf16_tflops > 0)
    assert g.supports_flash2 == (g.kind == "rocm" or g.compute_capability >= (8, 0))
    assert g.kind in ("cuda", "rocm") and g.analytic_only == (g.kind == "rocm")
    assert g.is_catalog and not g.assumption
    assert g.source.startswith("http") or "https://" in g.source  # every figure carries its source


def test_capacities_are_what_the_board_reports():
    assert GPUS["A10"].memory_bytes == 23028 * 2**20  # ECC keeps 1/16 of 24 GiB
    assert GPUS["H100-80GB"].memory_bytes == 81559 * 2**20


@pytest.mark.parametrize(
    "text,name",
    [
        ("a100-80gb", "A100-80GB"),
        ("A100", "A100-80GB"),
        ("h100", "H100-80GB"),
        ("rtx4090", "RTX4090"),
        ("4090", "RTX4090"),
        ("a10g", "A10G"),
        ("H100 NVL", "H100-NVL"),
        ("h100-nvl", "H100-NVL"),
        ("RTX 6000 Ada", "RTX6000-Ada"),
        ("rtx 6000 ada generation", "RTX6000-Ada"),
        ("RTX 5090", "RTX5090"),
        ("5090", "RTX5090"),
        ("rtx-a5000", "A5000"),
        ("RTX A5000", "A5000"),
        ("3090 Ti", "RTX3090Ti"),
        ("b200", "B200"),
        ("GB200", "GB200"),
        ("h20", "H20"),
        ("L40", "L40"),
        ("a40", "A40"),
        ("Instinct MI300X", "MI300X"),
        ("mi325x", "MI325X"),
    ],
)
def test_aliases(text, name):
    assert resolve_gpu(text).name == name


def test_unknown_gpu_names_close_matches():
    with pytest.raises(SpecError, match="close:.*A100"):
        resolve_gpu("A1000")


def test_cpu_device():
    cpu = resolve_gpu("cpu")
    assert cpu.kind == "cpu" and cpu.memory_bytes > 0 and not cpu.supports_flash2


def test_new_cards_datasheet_figures():
    """A few figures read off the datasheets (dense, no sparsity; memory as the driver reports)."""
    mib = 2**20
    assert GPUS["H100-NVL"].memory_bytes == 95830 * mib and GPUS["H100-NVL"].bf16_tflops == 835.5
    assert GPUS["RTX5090"].memory_bytes == 32607 * mib and GPUS["RTX5090"].compute_capability == (12, 0)
    assert GPUS["B200"].bf16_tflops == 2250 and GPUS["B200"].intra_node_gbps == 900
    assert GPUS["L40"].bf16_tflops == pytest.approx(GPUS["L40S"].bf16_tflops / 2, rel=0.01)
    assert GPUS["MI300X"].memory_bytes == 205822885888  # rocm-smi's VRAM total
    assert GPUS["GB200"].host_link_gbps > GPUS["B200"].host_link_gbps  # NVLink-C2C, not PCIe


@pytest.mark.parametrize(
    "device,mem_gib,name",
    [
        ("NVIDIA H100 NVL", 93.6, "H100-NVL"),
        ("NVIDIA H100 80GB HBM3", 79.6, "H100-80GB"),
        ("NVIDIA H100 PCIe", 79.6, "H100-PCIE"),
        ("NVIDIA L40S", 45, "L40S"),
        ("NVIDIA L40", 45, "L40"),
        ("NVIDIA RTX 6000 Ada Generation", 48, "RTX6000-Ada"),
        ("NVIDIA RTX A6000", 48, "A6000"),
        ("NVIDIA RTX A5000", 24, "A5000"),
        ("NVIDIA GeForce RTX 5090", 31.8, "RTX5090"),
        ("NVIDIA GeForce RTX 3090 Ti", 24, "RTX3090Ti"),
        ("NVIDIA GeForce RTX 3090", 24, "RTX3090"),
        ("NVIDIA B200", 178.4, "B200"),
        ("NVIDIA GB200", 185, "GB200"),
        ("NVIDIA H20", 95.6, "H20"),
        ("NVIDIA H200", 140.4, "H200"),
        ("NVIDIA A40", 45, "A40"),
        ("NVIDIA A10", 22.5, "A10"),
        ("NVIDIA A100-SXM4-40GB", 40, "A100-40GB"),
        ("AMD Instinct MI300X", 191.7, "MI300X"),
        ("AMD Instinct MI325X", 255.6, "MI325X"),
    ],
)
def test_match_gpu_from_device_names(device, mem_gib, name):
    from autofit.specs.gpus import match_gpu

    assert match_gpu(device, int(mem_gib * 2**30)).name == name


def test_unknown_gpu_names_the_custom_forms():
    with pytest.raises(SpecError, match="memory such as 24GiB.*YAML"):
        resolve_gpu("B300")


def test_rocm_cards_are_analytic_only_with_bf16_and_flash2():
    mi = GPUS["MI300X"]
    assert mi.analytic_only and mi.supports_bf16 and mi.supports_flash2
    assert not GPUS["H100-NVL"].analytic_only


def test_gpu_spec_round_trips_through_a_dict():
    from autofit.specs.gpus import GPUSpec

    for g in GPUS.values():
        assert GPUSpec.from_dict(g.as_dict()) == g

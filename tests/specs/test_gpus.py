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
    assert g.supports_flash2 == (g.compute_capability >= (8, 0))


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

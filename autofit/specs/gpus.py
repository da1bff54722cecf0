"""GPU catalog: memory, dense peak rates, bandwidths and links, from vendor datasheets.

Every figure is the *dense* (no 2:4 sparsity) peak the vendor states; tensor-core rates
are with FP32 accumulate where the datasheet distinguishes (GeForce cards halve it).
``intra_node_gbps`` is the per-GPU unidirectional bandwidth to its peers (NVLink where
the card has it in its usual server form, else its PCIe link); ``host_link_gbps`` the
unidirectional PCIe bandwidth to host memory (offload traffic). Both in GB/s (1e9).
Capabilities follow from ``compute_capability``: bf16 from 8.0, FlashAttention-2 from 8.0.

Imports without torch.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass

from autofit.errors import SpecError
from autofit.specs.units import GiB

GB = 10**9

_PCIE_GBPS = {3: 16.0, 4: 32.0, 5: 64.0}  # x16, one direction, theoretical


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_bytes: int
    bf16_tflops: float  # 0 where the GPU has no bf16 support
    fp16_tflops: float
    tf32_tflops: float  # 0 where the GPU has no TF32 tensor cores
    fp32_tflops: float
    memory_bw_gbps: float
    intra_node_gbps: float
    intra_node_link: str  # "nvlink" or "pcie4" ...
    host_link_gbps: float
    compute_capability: tuple[int, int]
    source: str
    kind: str = "cuda"  # "cuda", or "cpu" for the local-CPU target of measured runs

    @property
    def supports_bf16(self) -> bool:
        return self.kind == "cpu" or self.compute_capability >= (8, 0)

    @property
    def supports_flash2(self) -> bool:
        return self.kind == "cuda" and self.compute_capability >= (8, 0)

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GiB

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for matmuls in ``dtype`` (bf16, fp16, tf32, fp32)."""
        return {
            "bf16": self.bf16_tflops,
            "fp16": self.fp16_tflops,
            "tf32": self.tf32_tflops or self.fp32_tflops,
            "fp32": self.fp32_tflops,
        }[dtype] * 1e12


def _gpu(name, mem_mib, bf16, fp16, tf32, fp32, bw, cc, source, *, nvlink=0.0, pcie=4):
    return GPUSpec(
        name=name,
        memory_bytes=mem_mib * 2**20,
        bf16_tflops=bf16,
        fp16_tflops=fp16,
        tf32_tflops=tf32,
        fp32_tflops=fp32,
        memory_bw_gbps=bw,
        intra_node_gbps=nvlink if nvlink else _PCIE_GBPS[pcie],
        intra_node_link="nvlink" if nvlink else f"pcie{pcie}",
        host_link_gbps=_PCIE_GBPS[pcie],
        compute_capability=cc,
        source=source,
    )


# Memory is the total that nvidia-smi and torch.cuda.mem_get_info report, in MiB: the
# datasheet size less what the board keeps. Data-center GDDR6 parts (A10, A10G, L4, T4,
# L40S) run with ECC on, which reserves 1/16 of the memory (24 GiB -> 23028 MiB); HBM
# parts lose a few hundred MiB (H100: 81559 MiB of 80 GiB). This is the capacity a plan
# must fit in; the CUDA context and NCCL buffers are counted in the plan's overhead.
_GPUS = [
    _gpu(
        "A10",
        23028,
        125,
        125,
        62.5,
        31.2,
        600,
        (8, 6),
        pcie=4,
        source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/datasheet-new/nvidia-a10-datasheet.pdf",
    ),
    _gpu(
        "A10G",
        23028,
        70,
        70,
        35,
        35,
        600,
        (8, 6),
        pcie=4,
        source="AWS does not publish A10G rates; figures from https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/",
    ),
    _gpu(
        "L4",
        23034,
        121,
        121,
        60,
        30.3,
        300,
        (8, 9),
        pcie=4,
        source="https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet",
    ),
    _gpu(
        "T4",
        15360,
        0,
        65,
        0,
        8.1,
        320,
        (7, 5),
        pcie=3,
        source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf",
    ),
    _gpu(
        "V100-16GB",
        16160,
        0,
        125,
        0,
        15.7,
        900,
        (7, 0),
        nvlink=150,
        pcie=3,
        source="https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf (SXM2; NVLink 300 GB/s bidirectional)",
    ),
    _gpu(
        "V100-32GB",
        32510,
        0,
        125,
        0,
        15.7,
        900,
        (7, 0),
        nvlink=150,
        pcie=3,
        source="https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf (SXM2; NVLink 300 GB/s bidirectional)",
    ),
    _gpu(
        "A100-40GB",
        40960,
        312,
        312,
        156,
        19.5,
        1555,
        (8, 0),
        nvlink=300,
        pcie=4,
        source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (SXM; NVLink 600 GB/s bidirectional)",
    ),
    _gpu(
        "A100-80GB",
        81920,
        312,
        312,
        156,
        19.5,
        2039,
        (8, 0),
        nvlink=300,
        pcie=4,
        source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (SXM; NVLink 600 GB/s bidirectional)",
    ),
    _gpu(
        "H100-80GB",
        81559,
        989,
        989,
        494.5,
        67,
        3350,
        (9, 0),
        nvlink=450,
        pcie=5,
        source="https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet (H100 SXM; NVLink 900 GB/s bidirectional)",
    ),
    _gpu(
        "H100-PCIE",
        81559,
        756,
        756,
        378,
        51,
        2000,
        (9, 0),
        pcie=5,
        source="https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet (H100 PCIe)",
    ),
    _gpu(
        "H200",
        143771,
        989,
        989,
        494.5,
        67,
        4800,
        (9, 0),
        nvlink=450,
        pcie=5,
        source="https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446 (H200 SXM; NVLink 900 GB/s bidirectional)",
    ),
    _gpu(
        "L40S",
        46068,
        362,
        362,
        183,
        91.6,
        864,
        (8, 9),
        pcie=4,
        source="https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413",
    ),
    _gpu(
        "RTX3090",
        24576,
        71,
        71,
        35.6,
        35.6,
        936,
        (8, 6),
        pcie=4,
        source="https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf (FP16/BF16 with FP32 accumulate)",
    ),
    _gpu(
        "RTX4090",
        24564,
        165.2,
        165.2,
        82.6,
        82.6,
        1008,
        (8, 9),
        pcie=4,
        source="https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf (FP16/BF16 with FP32 accumulate)",
    ),
    _gpu(
        "A6000",
        49140,
        154.8,
        154.8,
        77.4,
        38.7,
        768,
        (8, 6),
        pcie=4,
        source="https://www.nvidia.com/content/dam/en-zz/Solutions/design-visualization/quadro-product-literature/proviz-print-nvidia-rtx-a6000-datasheet-us-nvidia-1454980-r9-web%20(1).pdf",
    ),
]

GPUS: dict[str, GPUSpec] = {g.name: g for g in _GPUS}

# Names people also type. Keys are normalized by _norm().
_ALIASES = {
    "a100": "A100-80GB",
    "a10080g": "A100-80GB",
    "a10040g": "A100-40GB",
    "h100": "H100-80GB",
    "h100sxm": "H100-80GB",
    "h10080g": "H100-80GB",
    "h100pcie": "H100-PCIE",
    "v100": "V100-32GB",
    "v10016g": "V100-16GB",
    "v10032g": "V100-32GB",
    "h200sxm": "H200",
    "3090": "RTX3090",
    "4090": "RTX4090",
    "rtxa6000": "A6000",
}


def _norm(s: str) -> str:
    return "".join(ch for ch in s.lower() if ch.isalnum())


_INDEX = {_norm(k): k for k in GPUS}
_INDEX.update({_norm(k): v for k, v in _ALIASES.items()})


def physical_memory_bytes() -> int:
    """This machine's RAM, as the kernel reports it."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_device(memory_bytes: int | None = None) -> GPUSpec:
    """The local CPU as a training device (measured runs on this machine, tests).

    Memory is the budget a run may use (default: this machine's RAM); rates are nominal
    figures for a few AVX-512 cores and only order plans, they are never reported as GPU
    figures.
    """
    if memory_bytes is None:
        memory_bytes = physical_memory_bytes()
    cores = os.cpu_count() or 1
    per_core = 2.5e9 * 32 / 1e12  # TFLOP/s: 2.5 GHz × 2 FMA × 16 fp32 lanes
    return GPUSpec(
        name="CPU",
        memory_bytes=int(memory_bytes),
        bf16_tflops=cores * per_core,
        fp16_tflops=cores * per_core / 4,
        tf32_tflops=0,
        fp32_tflops=cores * per_core,
        memory_bw_gbps=20.0,
        intra_node_gbps=10.0,
        intra_node_link="shm",
        host_link_gbps=20.0,
        compute_capability=(0, 0),
        source="this machine",
        kind="cpu",
    )


def match_gpu(device_name: str, total_memory: int) -> GPUSpec | None:
    """The catalog entry of a CUDA device, from ``torch.cuda.get_device_name`` and its memory.

    Device names carry more than the model (``NVIDIA A100-SXM4-80GB``, ``NVIDIA H100 80GB
    HBM3``): the longest catalog model name contained in the device name wins (``A10G``
    over ``A10``, ``H100-PCIE`` over ``H100``), and memory decides between sizes of one
    model (A100 40 GB / 80 GB). None when nothing matches.
    """
    dev = _norm(device_name)

    def model(g: GPUSpec) -> str:
        return _norm(g.name.rsplit("-", 1)[0] if g.name.endswith("GB") else g.name)

    hits = [g for g in GPUS.values() if model(g) in dev]
    if not hits:
        return None
    longest = max(len(model(g)) for g in hits)
    hits = [g for g in hits if len(model(g)) == longest]
    return min(hits, key=lambda g: abs(g.memory_bytes - total_memory))


def resolve_gpu(name: str) -> GPUSpec:
    """Look up a GPU by name, case- and punctuation-insensitively (``a100-80gb``, ``rtx4090``).

    ``cpu`` is the local CPU (see :func:`cpu_device`).
    """
    key = _norm(name)
    if key == "cpu":
        return cpu_device()
    if key in _INDEX:
        return GPUS[_INDEX[key]]
    close = difflib.get_close_matches(name.upper(), list(GPUS), n=3, cutoff=0.4)
    hint = f" (close: {', '.join(close)})" if close else ""
    raise SpecError(f"unknown GPU {name!r}{hint}; see `autofit gpus` for the catalog")

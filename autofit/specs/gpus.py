"""GPU catalog: memory, dense peak rates, bandwidths and links, from vendor datasheets.

Every figure is the *dense* (no 2:4 sparsity) peak the vendor states; tensor-core rates
are with FP32 accumulate where the datasheet distinguishes (GeForce cards halve it).
``intra_node_gbps`` is the per-GPU unidirectional bandwidth to its peers (NVLink where
the card has it in its usual server form, else its PCIe link); ``host_link_gbps`` the
unidirectional PCIe bandwidth to host memory (offload traffic). Both in GB/s (1e9).
Capabilities follow from ``compute_capability``: bf16 from 8.0, FlashAttention-2 from 8.0
(CUDA only).

AMD Instinct cards (``kind="rocm"``) are analytic-only: the simulated evaluator traces the
kernels CUDA PyTorch picks by compute capability, and nothing here says which kernels ROCm
PyTorch (hipBLASLt, CK, AOTriton) runs, so the simulated and measured evaluators refuse them
(``autofit.evaluators.resolve_evaluator``) and ``auto`` answers with the analytic one.

Imports without torch.
"""

from __future__ import annotations

import dataclasses
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
    kind: str = "cuda"  # "cuda"; "rocm" (AMD, analytic-only); "cpu" for the local-CPU target of measured runs
    assumption: str = ""  # a custom GPU's figures that were assumed, not given (shown with every answer)

    @property
    def supports_bf16(self) -> bool:
        return self.kind == "cpu" or self.compute_capability >= (8, 0)

    @property
    def supports_flash2(self) -> bool:
        # ROCm: flash-attn's composable_kernel backend runs on MI200/MI300 (Dao-AILab/flash-attention
        # README, "AMD ROCm Support"); the catalog's AMD cards are MI300-class (gfx942).
        return self.kind == "rocm" or (self.kind == "cuda" and self.compute_capability >= (8, 0))

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

    @property
    def analytic_only(self) -> bool:
        """Only the analytic evaluator models this GPU (see the module docstring)."""
        return self.kind == "rocm"

    @property
    def is_catalog(self) -> bool:
        """This exact entry is in the catalog (a custom GPU is stored with all its figures)."""
        return GPUS.get(self.name) == self

    def as_dict(self) -> dict:
        """Every field, JSON-safe; :meth:`from_dict` reads it back."""
        d = dataclasses.asdict(self)
        d["compute_capability"] = list(self.compute_capability)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> GPUSpec:
        d = dict(d)
        d["compute_capability"] = tuple(d["compute_capability"])
        return cls(**d)


def _gpu(name, mem_mib, bf16, fp16, tf32, fp32, bw, cc, source, *, nvlink=0.0, link="", pcie=4, host=0.0, kind="cuda"):
    """A catalog entry; ``link`` names a non-NVLink fabric (``xgmi``) given in ``nvlink``'s GB/s,
    ``host`` a host link other than PCIe (NVLink-C2C)."""
    return GPUSpec(
        name=name,
        memory_bytes=mem_mib * 2**20,
        bf16_tflops=bf16,
        fp16_tflops=fp16,
        tf32_tflops=tf32,
        fp32_tflops=fp32,
        memory_bw_gbps=bw,
        intra_node_gbps=nvlink if nvlink else _PCIE_GBPS[pcie],
        intra_node_link=(link or "nvlink") if nvlink else f"pcie{pcie}",
        host_link_gbps=host or _PCIE_GBPS[pcie],
        compute_capability=cc,
        source=source,
        kind=kind,
    )


# Cards added for issue 17. Memory, where nvidia-smi's (or rocm-smi's) total is published,
# is that figure; where it is not, one of these rules, named at the entry:
#   HBM rule: the datasheet's "GB" taken as GiB times 0.9956, the share nvidia-smi reports
#     on H100 (81559 of 81920 MiB), H100 NVL (95830 of 96256) and H200 (143771 of 144384);
#   GDDR workstation rule: the board's GiB less 12 MiB, as the A6000 (49140) and RTX 4090
#     (24564) report with ECC off, their default;
#   ECC rule: the data-center GDDR6 boards (ECC on) report what the L40S does, 46068 MiB of 48 GB;
#   ROCm rule: the datasheet's GiB times 196288/196608, MI300X's share (rocm-smi).
# Rates are dense; where a datasheet gives only the 2:4-sparse figure it is halved (named).
_BLACKWELL_HGX = (
    "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200, 8 GPUs: per GPU = 1/8; tensor figures sparse, halved)"
)
_GB200_NVL72 = "https://www.nvidia.com/en-us/data-center/gb200-nvl72/ (GB200 NVL72, 72 GPUs: per GPU = 1/72; tensor figures sparse, halved)"
_H100_SHEET = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_AMD = "https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/"
_GPUS_2025 = [
    _gpu(
        "B200",
        182630,  # the CUDA driver's 178.35 GiB total (pytorch/ao#4002's device query)
        2250,
        2250,
        1125,
        75,
        8000,  # datasheet; the driver's 7680-bit bus gives 7672 GB/s (pytorch/ao#4002)
        (10, 0),
        nvlink=900,
        pcie=5,
        source=_BLACKWELL_HGX + "; NVLink 5 1.8 TB/s bidirectional per GPU",
    ),
    _gpu(
        "GB200",
        189625,  # HBM rule: 13.4 TB / 72 = 186 GB per GPU
        2500,
        2500,
        1250,
        80,
        8000,
        (10, 0),
        nvlink=900,
        pcie=5,
        host=225,  # NVLink-C2C: 900 GB/s bidirectional per superchip, shared by its two GPUs
        source=_GB200_NVL72 + "; NVLink 5 1.8 TB/s bidirectional per GPU; NVLink-C2C to Grace",
    ),
    _gpu(
        "H100-NVL",
        95830,  # nvidia-smi (NVIDIA/gpu-admin-tools#4)
        835.5,
        835.5,
        417.5,
        60,
        3900,
        (9, 0),
        nvlink=300,
        pcie=5,
        source=_H100_SHEET + " (H100 NVL: tensor figures sparse, halved; NVLink bridge 600 GB/s bidirectional)",
    ),
    _gpu(
        "H20",
        97871,  # HBM rule: 96 GB
        148,
        148,
        74,
        44,
        4000,
        (9, 0),
        nvlink=450,
        pcie=5,
        source="NVIDIA publishes no H20 datasheet (sunkx109/GPUs-Specs#2); the dense figures as reported at "
        "https://zangshuxian.com/new/674733024499207168 (FP16 148, TF32 74, FP32 44 TFLOPS; 4.0 TB/s; 96 GB HBM3); "
        "NVLink 900 GB/s bidirectional as for H100 SXM",
    ),
    _gpu(
        "L40",
        46068,  # ECC rule
        181.05,
        181.05,
        90.5,
        90.5,
        864,
        (8, 9),
        pcie=4,
        source="https://www.nvidia.com/en-us/data-center/l40/ (its datasheet table: tensor figures dense | sparse)",
    ),
    _gpu(
        "A40",
        46068,  # ECC rule
        74.8,
        74.8,
        37.4,
        37.4,
        696,
        (8, 6),
        pcie=4,
        source="https://images.nvidia.com/content/Solutions/data-center/a40/nvidia-a40-datasheet.pdf "
        "(tensor figures sparse, halved; an NVLink bridge joins pairs only, so PCIe is the ring's link)",
    ),
    _gpu(
        "A5000",
        24564,  # GDDR workstation rule
        111.1,
        111.1,
        55.55,
        27.8,
        768,
        (8, 6),
        pcie=4,
        source="https://www.nvidia.com/content/dam/en-zz/Solutions/gtcs21/rtx-a5000/nvidia-rtx-a5000-datasheet.pdf "
        "(tensor 222.2 TFLOPS sparse FP16, halved; TF32 half of that, as on GA102 A40/A6000)",
    ),
    _gpu(
        "RTX6000-Ada",
        49140,  # GDDR workstation rule
        364.2,
        364.2,
        182.1,
        91.1,
        960,
        (8, 9),
        pcie=4,
        source="https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf "
        "(RTX 6000 Ada column) and https://www.nvidia.com/en-us/design-visualization/rtx-6000/",
    ),
    _gpu(
        "RTX5090",
        32607,  # nvidia-smi (noonghunna/club-3090#617)
        209.5,
        209.5,
        104.8,
        104.8,
        1792,
        (12, 0),
        pcie=5,
        source="https://images.nvidia.com/aem-dam/Solutions/geforce/blackwell/nvidia-rtx-blackwell-gpu-architecture.pdf "
        "(FP16/BF16 with FP32 accumulate)",
    ),
    _gpu(
        "RTX3090Ti",
        24576,  # as the RTX 3090 reports (same GA102 board memory, 24 GB GDDR6X, no ECC)
        80,
        80,
        40,
        40,
        1008,
        (8, 6),
        pcie=4,
        source="https://www.nvidia.com/en-us/geforce/graphics-cards/30-series/rtx-3090-3090ti/ (40 shader TFLOPS, "
        "21 Gbps x 384-bit); tensor FP16/BF16 with FP32 accumulate = 2x FP32 and TF32 = FP32 as the GA102 whitepaper "
        "gives for the RTX 3090",
    ),
    _gpu(
        "MI300X",
        196288,  # rocm-smi's VRAM total, 205822885888 bytes
        1307.4,
        1307.4,
        653.7,
        163.4,
        5300,
        (9, 4),  # gfx942, as torch.cuda.get_device_capability reports it under ROCm
        nvlink=448,
        link="xgmi",  # 7 Infinity Fabric links x 64 GB/s one way
        pcie=5,
        kind="rocm",
        source=_AMD + "amd-instinct-mi300x-data-sheet.pdf",
    ),
    _gpu(
        "MI325X",
        261717,  # ROCm rule: 256 GB
        1307.4,
        1307.4,
        653.7,
        163.4,
        6000,
        (9, 4),
        nvlink=448,
        link="xgmi",
        pcie=5,
        kind="rocm",
        source=_AMD + "amd-instinct-mi325x-data-sheet.pdf",
    ),
]

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
    *_GPUS_2025,
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
    "b200sxm": "B200",
    "hgxb200": "B200",
    "gb200nvl72": "GB200",
    "h100nvl94gb": "H100-NVL",
    "l40gpu": "L40",
    "rtxa5000": "A5000",
    "rtx6000adageneration": "RTX6000-Ada",
    "6000ada": "RTX6000-Ada",
    "5090": "RTX5090",
    "geforcertx5090": "RTX5090",
    "3090ti": "RTX3090Ti",
    "geforcertx3090ti": "RTX3090Ti",
    "instinctmi300x": "MI300X",
    "instinctmi325x": "MI325X",
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
    close = difflib.get_close_matches(name.upper(), list(GPUS), n=4, cutoff=0.4)
    hint = f" (close: {', '.join(close)})" if close else ""
    raise SpecError(
        f"unknown GPU {name!r}{hint}; give a catalog name (`autofit gpus`), a memory such as 24GiB, "
        "or a YAML spec's path (docs/DESIGN.md, custom GPUs)"
    )

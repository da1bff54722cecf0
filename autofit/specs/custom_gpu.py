"""A GPU that is not in the catalog: ``--gpus 2x24GiB`` (memory only) or ``--gpus 2xcard.yaml``.

A memory-only card borrows every other figure from the catalog's CUDA card of the nearest
memory (the same memory class: 24 GiB takes an RTX 3090 Ti's rates, 80 GB an H100's), and says
so in :attr:`GPUSpec.assumption`, which every answer prints. A YAML spec gives its own figures::

    name: my-card            # required; not a catalog name
    memory: 24GiB            # required; what nvidia-smi reports as total (256GiB, 80GB, bytes)
    bf16_tflops: 165         # required: dense peak rates, TFLOP/s (0 where the card lacks bf16)
    fp16_tflops: 165
    fp32_tflops: 82.6
    tf32_tflops: 82.6        # optional; 0 (the default): no TF32 tensor cores, fp32 rate used
    memory_bw_gbps: 1008     # required, GB/s
    compute_capability: 8.9  # required ("8.9" or [8, 9]); bf16 and FlashAttention-2 from 8.0
    intra_node_link: pcie4   # optional: nvlink, pcie3, pcie4, pcie5 (default pcie4)
    intra_node_gbps: 32      # GB/s one way to peers; required for nvlink, else the PCIe rate
    host_link_gbps: 32       # optional, GB/s one way to host memory; default the PCIe rate
    source: my lab's sheet   # optional

Unknown keys are refused, and every problem of a file is named in one line.
"""

from __future__ import annotations

import re
from pathlib import Path

from autofit.errors import SpecError
from autofit.specs.gpus import _INDEX, _PCIE_GBPS, GPUS, GPUSpec, _norm
from autofit.specs.units import GiB, parse_size

# Sizes a card can have: a typo such as 24MiB or 24TB would plan for a card nobody has.
# 1 GiB is below any GPU sold for training; 1 TiB is four times the largest (MI325X, 256 GB).
MIN_MEMORY, MAX_MEMORY = GiB, 1024 * GiB

_SIZE_RE = re.compile(r"^\s*\d+(?:\.\d+)?\s*[kmgt]i?b?\s*$", re.I)  # a unit is required: "24" is no size
_REQUIRED = ("name", "memory", "bf16_tflops", "fp16_tflops", "fp32_tflops", "memory_bw_gbps", "compute_capability")
_OPTIONAL = ("tf32_tflops", "intra_node_link", "intra_node_gbps", "host_link_gbps", "source")
_RATES = ("bf16_tflops", "fp16_tflops", "fp32_tflops")
_LINKS = ("nvlink", *(f"pcie{g}" for g in _PCIE_GBPS))


def is_size(text: str) -> bool:
    return bool(_SIZE_RE.match(text or ""))


def is_spec_path(text: str) -> bool:
    return text.strip().lower().endswith((".yaml", ".yml"))


def memory_only(text: str) -> GPUSpec:
    """``24GiB``: the catalog CUDA card of the nearest memory, with this memory, named ``custom-24GiB``."""
    size = parse_size(text)
    _check_memory(size, f"--gpus {text.strip()!r}")
    like = min(
        (g for g in GPUS.values() if g.kind == "cuda"),
        key=lambda g: (abs(g.memory_bytes - size), -g.bf16_tflops),  # a tie: the faster card
    )
    spelled = re.sub(r"\s+", "", text)
    return GPUSpec(
        **{
            **like.as_dict(),
            "name": f"custom-{spelled}",
            "memory_bytes": size,
            "compute_capability": like.compute_capability,
            "source": f"memory as given ({spelled}); every other figure is the catalog's {like.name}",
            "assumption": (
                f"custom-{spelled} has only its memory given: its rates, bandwidth and links are assumed to be the "
                f"{like.name}'s (the catalog card of the nearest memory); give a YAML spec (--gpus Nxcard.yaml) "
                "for its own figures"
            ),
        }
    )


def load_gpu_spec(path: str) -> GPUSpec:
    """A GPU from a YAML spec (module docstring), every problem named in one SpecError."""
    import yaml

    p = Path(path.strip()).expanduser()
    if not p.is_file():
        raise SpecError(f"GPU spec {path!r} not found; give the path of a YAML file (see docs/DESIGN.md, custom GPUs)")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise SpecError(f"GPU spec {p}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise SpecError(f"GPU spec {p}: expected a mapping of fields (name, memory, bf16_tflops, ...)")
    return gpu_from_fields(data, where=f"GPU spec {p}")


def gpu_from_fields(data: dict, where: str = "GPU spec") -> GPUSpec:
    problems: list[str] = []
    unknown = sorted(set(data) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        problems.append(f"unknown keys {', '.join(unknown)} (known: {', '.join(_REQUIRED + _OPTIONAL)})")
    missing = [k for k in _REQUIRED if data.get(k) is None]
    if missing:
        problems.append(f"missing required keys {', '.join(missing)}")
    name = str(data.get("name") or "").strip()
    if name and (_norm(name) in _INDEX or _norm(name) == "cpu"):
        problems.append(f"name {name!r} is a catalog GPU; give your card another name, or use --gpus Nx{name}")
    memory = _field(problems, "memory", data.get("memory"), _memory_bytes)
    rates = {k: _field(problems, k, data.get(k), _rate if k == "bf16_tflops" else _positive_rate) for k in _RATES}
    tf32 = _field(problems, "tf32_tflops", data.get("tf32_tflops", 0), _rate)
    bw = _field(problems, "memory_bw_gbps", data.get("memory_bw_gbps"), _positive)
    cc = _field(problems, "compute_capability", data.get("compute_capability"), _capability)
    link = str(data.get("intra_node_link") or "pcie4").strip().lower()
    if link not in _LINKS:
        problems.append(f"intra_node_link {link!r} is none of {', '.join(_LINKS)}")
        link = "pcie4"
    pcie = _PCIE_GBPS.get(int(link[4:])) if link.startswith("pcie") else None
    intra = data.get("intra_node_gbps", pcie)
    if intra is None:
        problems.append("intra_node_gbps is required with intra_node_link nvlink (GB/s one way, per GPU)")
    intra = _field(problems, "intra_node_gbps", intra, _positive) if intra is not None else None
    host = _field(problems, "host_link_gbps", data.get("host_link_gbps", pcie or _PCIE_GBPS[4]), _positive)
    problems = [p for p in problems if p]
    if problems:
        raise SpecError(f"{where}: " + "; ".join(problems))
    return GPUSpec(
        name=name,
        memory_bytes=memory,
        tf32_tflops=tf32,
        memory_bw_gbps=bw,
        intra_node_gbps=intra,
        intra_node_link=link,
        host_link_gbps=host,
        compute_capability=cc,
        source=str(data.get("source") or "custom GPU spec"),
        **rates,
    )


def _field(problems: list[str], key: str, value, check):
    """``check(value)``, or None with the problem recorded (a missing value is reported once, above)."""
    if value is None:
        return None
    try:
        return check(value)
    except (SpecError, TypeError, ValueError) as exc:
        problems.append(f"{key} {value!r}: {exc}")
        return None


def _memory_bytes(value) -> int:
    size = int(value) if isinstance(value, int) and not isinstance(value, bool) else parse_size(str(value))
    _check_memory(size, "memory")
    return size


def _check_memory(size: int, what: str) -> None:
    if not MIN_MEMORY <= size <= MAX_MEMORY:
        raise SpecError(f"{what} is {size / GiB:.3g} GiB; a GPU has between 1 GiB and 1 TiB (write it like 24GiB)")


def _rate(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError("must be a number of TFLOP/s, 0 or more")
    return float(value)


def _positive_rate(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError("must be a positive number of TFLOP/s")
    return float(value)


def _positive(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError("must be a positive number (GB/s)")
    return float(value)


def _capability(value) -> tuple[int, int]:
    parts = str(value).split(".") if isinstance(value, (str, float, int)) else list(value)
    if len(parts) != 2 or not all(str(p).strip().isdigit() for p in parts):
        raise ValueError('write it as MAJOR.MINOR, e.g. "8.9" or [8, 9]')
    return int(parts[0]), int(parts[1])

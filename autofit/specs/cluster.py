"""ClusterSpec: which GPUs, how many per node, how many nodes, how much host memory."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum

from autofit.errors import SpecError
from autofit.specs import custom_gpu
from autofit.specs.gpus import GPUSpec, cpu_device, physical_memory_bytes, resolve_gpu
from autofit.specs.units import GiB

# Default inter-node fabric: a node's network bandwidth, all its NICs together, GB/s one
# direction. One 200 Gb/s InfiniBand or RoCE NIC shared by the node's GPUs is typical of
# cloud training instances; rail-optimized DGX nodes carry one NIC per GPU (8 x 200 Gb/s =
# 200 GB/s for A100, 8 x 400 Gb/s = 400 GB/s for H100). NCCL runs one ring per channel,
# each crossing between nodes through its own NIC, so a collective over several nodes
# reaches about this bus bandwidth (nccl-tests' busbw), capped by the links inside a node.
DEFAULT_INTER_NODE_GBPS = 25.0

# The largest GPU counts a request can mean. Per node: 72, the GB200 NVL72 rack, the
# largest NVLink domain sold, which a user may well describe as one node (HGX/DGX hosts
# carry 8). Nodes: 65,536, beyond the largest training clusters built (~200k GPUs, some
# 25k 8-GPU hosts). A count past these is a typo; taken at its word it sizes a global
# batch of that many sequences and plans nothing useful.
MAX_GPUS_PER_NODE = 72
MAX_NODES = 65_536

# COUNTxGPU: GPU is a catalog name, a memory (24GiB) or a YAML spec's path (custom_gpu).
_CLUSTER_RE = re.compile(r"^\s*(?:(?P<count>[+-]?\d+)\s*[xX*]\s*)?(?P<gpu>\S.*?)\s*$")


class HostMemory(str, Enum):
    """Where a cluster's host memory figure comes from (printed with every answer where assumed)."""

    GIVEN = "given"  # --host-mem, a study file, or a stored study
    LOCAL = "local"  # this node's RAM: the target GPUs are this machine's (or the CPU target)
    ASSUMED = "assumed"  # the default rule of ClusterSpec.__post_init__

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ClusterSpec:
    gpu: GPUSpec
    gpus_per_node: int = 1
    nodes: int = 1
    host_memory_bytes: int = 0  # per node; 0 means the default below
    inter_node_gbps: float = DEFAULT_INTER_NODE_GBPS  # the node's network, GB/s one way (above)
    host_memory_origin: HostMemory | None = field(default=None, compare=False)  # None: given if set, else assumed

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise SpecError(f"GPU count must be at least 1, got {self.gpus_per_node}")
        if self.gpus_per_node > MAX_GPUS_PER_NODE:
            raise SpecError(
                f"{self.gpus_per_node:,} GPUs per node is more than any node holds (at most {MAX_GPUS_PER_NODE}, "
                "a GB200 NVL72); give the GPUs of one node in --gpus and the node count in --nodes"
            )
        if self.nodes < 1:
            raise SpecError(f"--nodes must be at least 1, got {self.nodes}")
        if self.nodes > MAX_NODES:
            raise SpecError(f"--nodes {self.nodes:,} is more than any cluster has; give at most {MAX_NODES:,}")
        if self.host_memory_bytes < 0:
            raise SpecError("--host-mem must be positive")
        if not self.inter_node_gbps > 0:
            raise SpecError(f"--inter-node-gbps must be positive, got {self.inter_node_gbps}")
        origin = HostMemory(self.host_memory_origin) if self.host_memory_origin else None
        if self.host_memory_bytes == 0 and self.gpu.kind == "cpu":  # the target is this machine
            object.__setattr__(self, "host_memory_bytes", physical_memory_bytes())
            origin = HostMemory.LOCAL
        elif self.host_memory_bytes == 0:
            # Cloud GPU instances carry roughly twice their GPU memory as host RAM
            # (g5.12xlarge: 4xA10G 96 GiB / 192 GiB; p4d: 8xA100-40GB 320 GiB / 1152 GiB).
            object.__setattr__(self, "host_memory_bytes", max(32 * GiB, 2 * self.gpus_per_node * self.gpu.memory_bytes))
            origin = HostMemory.ASSUMED
        object.__setattr__(self, "host_memory_origin", origin or HostMemory.GIVEN)

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def assumptions(self) -> tuple[str, ...]:
        """What this cluster's figures assume rather than know; every answer prints them."""
        out = []
        if self.host_memory_origin is HostMemory.ASSUMED:
            out.append(
                f"host memory per node assumed {self.host_memory_bytes / GiB:.0f} GiB (twice the node's GPU memory, "
                "at least 32 GiB); set --host-mem to the node's RAM"
            )
        if self.gpu.assumption:
            out.append(self.gpu.assumption)
        return tuple(out)

    @property
    def label(self) -> str:
        base = f"{self.gpus_per_node}x{self.gpu.name}"
        return base if self.nodes == 1 else f"{self.nodes}x({base})"

    def as_dict(self) -> dict:
        """What rebuilds this cluster (:meth:`from_dict`): catalog GPUs by name; the local CPU
        target also by the memory budget of a rank (``--cpu-mem-budget``), which is the request's;
        a custom GPU by all its figures (``gpu_spec``), since no catalog can rebuild it."""
        d = {
            "gpu": self.gpu.name,
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.nodes,
            "host_memory_bytes": self.host_memory_bytes,
            "host_memory_origin": str(self.host_memory_origin),
            "inter_node_gbps": self.inter_node_gbps,
        }
        if self.gpu.kind == "cpu":
            d["cpu_memory_bytes"] = self.gpu.memory_bytes
        elif not self.gpu.is_catalog:
            d["gpu_spec"] = self.gpu.as_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ClusterSpec:
        """The inverse of :meth:`as_dict`. A CPU target stored without its memory (by an older
        autofit) gets this machine's RAM, as ``--gpus 1xcpu`` without ``--cpu-mem-budget`` does.
        A stored host memory stays; stored without its origin (older autofit), it counts as given."""
        if d.get("gpu_spec"):
            gpu = GPUSpec.from_dict(d["gpu_spec"])
        else:
            gpu = resolve_gpu(d["gpu"])
        if gpu.kind == "cpu" and d.get("cpu_memory_bytes") is not None:
            gpu = cpu_device(int(d["cpu_memory_bytes"]))
        origin = d.get("host_memory_origin")
        return cls(
            gpu=gpu,
            gpus_per_node=int(d.get("gpus_per_node", 1)),
            nodes=int(d.get("nodes", 1)),
            host_memory_bytes=int(d.get("host_memory_bytes") or 0),
            inter_node_gbps=float(d.get("inter_node_gbps", DEFAULT_INTER_NODE_GBPS)),
            host_memory_origin=HostMemory(origin) if origin else None,
        )


def _is_gpu(name: str) -> bool:
    try:
        resolve_gpu(name)
    except SpecError:
        return False
    return True


def parse_gpu(text: str) -> GPUSpec:
    """One GPU of ``--gpus``: a catalog name, a memory (``24GiB``: custom_gpu.memory_only) or a
    YAML spec's path (custom_gpu.load_gpu_spec)."""
    if custom_gpu.is_spec_path(text):
        return custom_gpu.load_gpu_spec(text)
    if custom_gpu.is_size(text):  # no catalog name or alias is a size
        return custom_gpu.memory_only(text)
    return resolve_gpu(text)


def parse_cluster(
    text: str,
    *,
    nodes: int = 1,
    host_memory_bytes: int = 0,
    inter_node_gbps: float = DEFAULT_INTER_NODE_GBPS,
    host_memory_origin: HostMemory | None = None,
) -> ClusterSpec:
    """Parse ``2xA10``, ``A100-80GB``, ``8xH100``, ``1xrtx4090``, ``2x24GiB``, ``2xcard.yaml`` (GPUs per node)."""
    if not isinstance(text, str) or not text.strip():
        raise SpecError("--gpus is empty; write it as COUNTxGPU, e.g. 2xA10 (see `autofit gpus`)")
    m = _CLUSTER_RE.match(text)
    malformed = SpecError(f"malformed --gpus {text!r}; write it as COUNTxGPU, e.g. 2xA10 or 8xH100")
    if not m:
        raise malformed
    count = int(m.group("count")) if m.group("count") is not None else 1
    if count < 1:
        raise SpecError(f"--gpus {text!r}: the GPU count must be at least 1")
    try:
        gpu = parse_gpu(m.group("gpu"))
    except SpecError:
        tail = re.match(r"^(.+?)\s*[xX*]\s*\d+$", m.group("gpu"))
        if tail and _is_gpu(tail.group(1)):  # "2xA10x3": a known GPU followed by a second count
            raise malformed from None
        raise
    return ClusterSpec(
        gpu=gpu,
        gpus_per_node=count,
        nodes=nodes,
        host_memory_bytes=host_memory_bytes,
        inter_node_gbps=inter_node_gbps,
        host_memory_origin=host_memory_origin,
    )

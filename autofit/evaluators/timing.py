"""The time of a training step: what the step does (``StepWork``) at what rates (``TimeParams``).

Both estimators describe one rank's step as *work*, in units that do not depend on the
GPU's speed: GEMMs (FLOPs, bytes, smallest dimension), attention FLOPs by kernel, bytes
that memory-bound kernels move, how many kernels are issued, the collectives and the
host traffic. The analytic evaluator derives it in closed form, the simulated one from
the ops of its traced step. :func:`step_time` prices work on a cluster with one set of
rates, so the two fidelities differ only in how they count.

The rates (``TimeParams``) are data: ``time_model.json`` beside this module, fitted on
published, measured runs by ``benchmarks/published_runs.py --throughput --fit`` with
their provenance (what was fitted on which rows, what is a prior because no published
run constrains it). The model, per phase (forward; backward with its recompute; the
optimizer step):

- GEMMs at ``peak × gemm_efficiency[generation] × d / (d + gemm_half_dim)``, ``d`` the
  GEMM's smallest dimension (tokens of a micro-batch, a model's width, a LoRA rank), and
  never faster than their bytes at the memory bandwidth;
- attention at its kernel's fraction of the dense peak (``attention_efficiency``: flash,
  efficient, math, eager; ``kernel@generation`` where a generation differs, as FlashAttention-2
  on Hopper, which reaches a smaller share of its peak than on Ampere);
- memory-bound kernels at ``memory_efficiency`` of the bandwidth;
- the device waits ``kernel_gap_s`` between kernels, and cannot run ahead of the host,
  which needs ``host_op_s`` to issue each one (Python, the dispatcher, the launch): a
  phase takes ``max(device time, host time)``. This is what dominates tiny micro-batches;
- collectives at ``link_efficiency`` of the slowest link they cross (``ClusterSpec``'s
  node's fabric between nodes), each call paying ``collective_latency_s``; up to
  ``comm_overlap`` of the phase they overlap (DDP buckets and ZeRO/FSDP reduce-scatter
  behind backward, FSDP's prefetched all-gathers behind forward and backward) hides them;
- offload: PCIe transfers at the host link, the CPU optimizer at ``cpu_adam_params_per_s``;
- a fixed ``step_overhead_s`` per optimizer step (zero_grad, clipping, the trainer's loop).

Imports without torch.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from importlib.resources import files
from typing import Any

from autofit.results import Throughput
from autofit.specs import ClusterSpec

GENERATIONS = ("volta", "turing", "ampere", "ada", "hopper", "blackwell")
ATTENTION_KERNELS = ("flash", "efficient", "math", "eager")


def generation(capability: tuple[int, int]) -> str:
    """The GPU generation of a CUDA compute capability (sm70 Volta ... sm100/sm120 Blackwell)."""
    major, minor = capability
    if major <= 7:
        return "turing" if (major, minor) >= (7, 5) else "volta"
    if major == 8:
        return "ada" if minor >= 9 else "ampere"
    if major == 9:
        return "hopper"
    return "blackwell"


@dataclass(frozen=True)
class TimeParams:
    """The rates :func:`step_time` prices work at (see the module docstring)."""

    gemm_efficiency: Mapping[str, float]  # generation -> fraction of the dense peak a large GEMM reaches
    gemm_half_dim: float  # smallest GEMM dimension at which a GEMM reaches half of that
    attention_efficiency: Mapping[str, float]  # kernel (or kernel@generation) -> fraction of the dense peak
    memory_efficiency: float  # fraction of the memory bandwidth memory-bound kernels reach
    host_op_s: float  # host time to issue one kernel
    kernel_gap_s: float  # device time between two kernels
    step_overhead_s: float  # per optimizer step
    link_efficiency: float  # bus bandwidth NCCL reaches of a link's peak
    comm_overlap: float  # at most this share of the overlapping phase hides a collective
    collective_latency_s: float  # per collective call and ring hop (log2 of the ranks)
    cpu_adam_params_per_s: float  # one node's CPU optimizer (DeepSpeedCPUAdam)
    nvme_gbps: float  # one node's NVMe, read or write
    provenance: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TimeParams:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def as_dict(self) -> dict[str, Any]:
        return {f.name: (dict(v) if isinstance(v := getattr(self, f.name), Mapping) else v) for f in fields(self)}

    def with_values(self, **values: Any) -> TimeParams:
        return replace(self, **values)


@functools.cache
def default_params() -> TimeParams:
    """The fitted rates of ``time_model.json`` (this package)."""
    return TimeParams.from_dict(json.loads(files("autofit.evaluators").joinpath("time_model.json").read_text()))


def time_error(evaluator: str) -> float:
    """The relative error within which two of this estimator's tokens/s are a tie
    (``TrialResult.extra["time_error"]``, which ``results.ranked`` reads): the median error of
    the predicted ratio of two published runs of one model and GPU type, under rates fitted
    without the runs' source (``time_model.json``'s provenance)."""
    err = default_params().provenance.get("error", {})
    return float(err.get(evaluator, err.get("analytic", 0.15)))


# -- work ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PhaseWork:
    """What one phase of one rank does. ``gemms``: ``(flops, bytes, smallest dim, count)``."""

    gemms: tuple[tuple[float, float, float, float], ...] = ()
    attention: float = 0.0  # attention FLOPs
    memory_bytes: float = 0.0  # bytes memory-bound kernels read and write
    kernels: float = 0.0  # kernels issued

    @property
    def gemm_flops(self) -> float:
        return sum(f * n for f, _, _, n in self.gemms)


@dataclass(frozen=True)
class Collective:
    kind: str  # all-reduce | all-gather | reduce-scatter | send (to the next rank of a ring)
    nbytes: float  # payload per call
    calls: float = 1.0  # calls per micro-batch or step
    per: str = "micro"  # "micro" (every micro-batch) or "step" (once per optimizer step)
    hidden_by: tuple[str, ...] = ()  # phases whose compute it overlaps
    group: int = 0  # ranks it runs over (0: every rank); a group within a node takes the node's links


@dataclass(frozen=True)
class Transfers:
    """What a rank's engine communicates and moves to and from the host in one step
    (``costs.transfer_work``)."""

    collectives: tuple[Collective, ...] = ()
    host_bytes_step: float = 0.0  # host link traffic per step (offloaded gradients and parameters)
    host_bytes_micro: float = 0.0  # host link traffic per micro-batch (parameters streamed in)
    cpu_optimizer_params: float = 0.0  # parameters the node's CPU steps per step
    nvme_bytes: float = 0.0  # NVMe traffic per step, per node


@dataclass(frozen=True)
class StepWork:
    """One rank's optimizer step: ``micro_batches`` × (forward + backward), then the optimizer."""

    dtype: str  # compute dtype: bf16, fp16, fp32 (tf32 matmuls where allowed are not assumed)
    attention_kernel: str
    forward: PhaseWork
    backward: PhaseWork  # with the checkpointing recompute
    optimizer: PhaseWork  # empty where the CPU steps the states
    micro_batches: int
    transfers: Transfers = Transfers()
    model_flops: float = 0.0  # forward + backward FLOPs of the step, without recompute (MFU)


@dataclass(frozen=True)
class StepTime:
    step_s: float
    compute_s: float  # micro-batches' phases and the optimizer step
    comm_s: float  # exposed communication
    offload_s: float
    overhead_s: float  # the per-step overhead and where the host, not the GPU, bounds a phase
    parts: dict[str, float]


def _collective_seconds(c: Collective, cluster: ClusterSpec, p: TimeParams) -> float:
    n = c.group or cluster.world_size
    if n <= 1 or c.nbytes <= 0:
        return 0.0
    if c.kind == "send":
        factor = 1.0
    else:
        factor = {"all-reduce": 2.0, "all-gather": 1.0, "reduce-scatter": 1.0}[c.kind] * (n - 1) / n
    # the bus bandwidth of a ring: the GPUs' own links inside a node; across nodes the
    # node's whole fabric, which NCCL's channels share (specs.cluster.DEFAULT_INTER_NODE_GBPS)
    bw = cluster.gpu.intra_node_gbps
    if cluster.nodes > 1 and n > cluster.gpus_per_node:
        bw = min(bw, cluster.inter_node_gbps)
    per_call = factor * c.nbytes / (bw * p.link_efficiency * 1e9) + p.collective_latency_s * math.log2(n)
    return c.calls * per_call


def step_time(work: StepWork, cluster: ClusterSpec, params: TimeParams | None = None) -> StepTime:
    """Price one rank's step on ``cluster`` (see the module docstring)."""
    p = params or default_params()
    gpu = cluster.gpu
    peak = gpu.peak_flops(work.dtype)
    bw = gpu.memory_bw_gbps * 1e9 * p.memory_efficiency
    gen = generation(gpu.compute_capability) if gpu.kind == "cuda" else ""
    gen_eff = p.gemm_efficiency.get(gen, 0.6)
    attn = p.attention_efficiency
    attn_eff = attn.get(f"{work.attention_kernel}@{gen}", attn.get(work.attention_kernel, attn["math"]))

    def phase(w: PhaseWork) -> tuple[float, float]:
        """(seconds, of which the host's excess over the device)."""
        dev = 0.0
        for flops, nbytes, dim, count in w.gemms:
            dev += count * max(flops / (peak * gen_eff * dim / (dim + p.gemm_half_dim)), nbytes / bw)
        dev += w.attention / (peak * attn_eff) + w.memory_bytes / bw + w.kernels * p.kernel_gap_s
        host = w.kernels * p.host_op_s
        return max(dev, host), max(0.0, host - dev)

    fwd, fwd_host = phase(work.forward)
    bwd, bwd_host = phase(work.backward)
    opt, opt_host = phase(work.optimizer)
    phases = {"forward": fwd, "backward": bwd, "optimizer": opt}
    comm = {"micro": 0.0, "step": 0.0}
    hidden: dict[tuple[str, tuple[str, ...]], float] = {}
    tr = work.transfers
    for c in tr.collectives:
        key = (c.per, c.hidden_by)
        hidden[key] = hidden.get(key, 0.0) + _collective_seconds(c, cluster, p)
    for (per, by), seconds in hidden.items():
        cover = p.comm_overlap * sum(phases[ph] for ph in by)
        comm[per] += max(0.0, seconds - cover)
    link = gpu.host_link_gbps * p.link_efficiency * 1e9
    micro_host = tr.host_bytes_micro / link
    offload = tr.host_bytes_step / link + tr.cpu_optimizer_params / p.cpu_adam_params_per_s
    offload += tr.nvme_bytes / (p.nvme_gbps * 1e9)
    ga = work.micro_batches
    compute = ga * (fwd + bwd) + opt
    comm_s = ga * comm["micro"] + comm["step"]
    step = compute + comm_s + ga * micro_host + offload + p.step_overhead_s
    return StepTime(
        step_s=step,
        compute_s=compute,
        comm_s=comm_s,
        offload_s=offload + ga * micro_host,
        overhead_s=p.step_overhead_s + ga * (fwd_host + bwd_host) + opt_host,
        parts={
            "forward": ga * fwd,
            "backward": ga * bwd,
            "optimizer": opt,
            "comm": comm_s,
            "offload": offload + ga * micro_host,
            "step_overhead": p.step_overhead_s,
        },
    )


def throughput(
    work: StepWork, cluster: ClusterSpec, tokens_per_step: float, params: TimeParams | None = None
) -> Throughput:
    """``results.Throughput`` of one step's work: cluster-wide tokens/s, the step's parts, MFU."""
    t = step_time(work, cluster, params)
    peak = cluster.gpu.peak_flops(work.dtype)
    flops = work.micro_batches * (
        work.forward.gemm_flops + work.forward.attention + work.backward.gemm_flops + work.backward.attention
    )
    return Throughput(
        tokens_per_sec=tokens_per_step / t.step_s,
        step_time_s=t.step_s,
        compute_s=t.compute_s,
        comm_s=t.comm_s,
        offload_s=t.offload_s,
        flops_per_step=flops,
        mfu=work.model_flops / (t.step_s * peak) if peak else 0.0,
    )

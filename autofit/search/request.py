"""From what a user typed to the library's frozen objects: Target and Plan.

Shared by every command that takes a model, GPUs and a workload, so that the same words
mean the same thing in ``estimate``, ``search`` and ``best``.
"""

from __future__ import annotations

from typing import Any

from autofit.errors import PlanError, SpecError
from autofit.plan import DEFAULT_CHECKPOINT_EVERY, Plan, Precision
from autofit.specs import ClusterSpec, ModelSpec, Target, Workload, load_lengths, parse_cluster, resolve_model
from autofit.specs.units import parse_size

DEFAULT_GLOBAL_BATCH = 16
DEFAULT_LORA_RANK = 16


def build_cluster(
    gpus: str, nodes: int = 1, host_mem: str | int | None = None, inter_node_gbps: float | None = None
) -> ClusterSpec:
    """The cluster of ``--gpus``. Without ``--host-mem``, GPUs that are this machine's (a local CUDA
    device that ``match_gpu`` names the requested GPU; or the CPU target) get this node's RAM;
    others the assumed default of ``ClusterSpec``, which the answer prints."""
    from autofit.specs.cluster import DEFAULT_INTER_NODE_GBPS, HostMemory

    host = parse_size(host_mem) if isinstance(host_mem, str) else int(host_mem or 0)
    fabric = DEFAULT_INTER_NODE_GBPS if inter_node_gbps is None else float(inter_node_gbps)
    cluster = parse_cluster(gpus, nodes=nodes, host_memory_bytes=host, inter_node_gbps=fabric)
    if host == 0 and cluster.gpu.kind != "cpu" and _is_local_gpu(cluster.gpu.name):
        import dataclasses

        from autofit.specs.gpus import physical_memory_bytes

        cluster = dataclasses.replace(
            cluster, host_memory_bytes=physical_memory_bytes(), host_memory_origin=HostMemory.LOCAL
        )
    return cluster


def _is_local_gpu(name: str) -> bool:
    from autofit.evaluators.measured import local_gpus

    return any(g is not None and g.name == name for g in local_gpus())


def build_context(
    model: str,
    gpus: str,
    *,
    nodes: int = 1,
    host_mem: str | int | None = None,
    inter_node_gbps: float | None = None,
    seq_len: int = 2048,
    global_batch: int | None = None,
    lengths_path: str | None = None,
    headroom: float = 0.05,
    plan_opts: dict[str, Any] | None = None,
    cpu_mem_budget: str | int | None = None,
) -> Target:
    """The request's target. Without --global-batch, a given micro-batch × grad-accum defines it.

    ``cpu_mem_budget`` (``--gpus Nxcpu`` only): the memory of each CPU rank, the budget every
    evaluator judges by and measured runs enforce.
    """
    spec = resolve_model(model)
    cluster = build_cluster(gpus, nodes, host_mem, inter_node_gbps)
    if cpu_mem_budget is not None:
        cluster = with_cpu_budget(cluster, cpu_mem_budget)
    if global_batch is None:
        opts = plan_opts or {}
        if opts.get("micro_batch") is not None and opts.get("grad_accum") is not None:
            cp = opts.get("context_parallel") or 1
            global_batch = opts["micro_batch"] * opts["grad_accum"] * max(1, cluster.world_size // cp)
        else:
            # whole sequences per GPU
            global_batch = -(-DEFAULT_GLOBAL_BATCH // cluster.world_size) * cluster.world_size
    lengths = load_lengths(lengths_path) if lengths_path else None
    if not 0 <= headroom < 1:
        raise SpecError(f"--headroom must be in [0, 1), got {headroom}")
    workload = Workload(seq_len=seq_len, global_batch=global_batch, lengths=lengths)
    check_positions(spec, seq_len)
    return Target(spec, cluster, workload, headroom)


def check_positions(model: ModelSpec, seq_len: int) -> None:
    """Refuse a sequence the model cannot train on (``ModelSpec.position_limit``), in one line."""
    limit = model.position_limit
    if limit is None or seq_len <= limit:
        return
    if model.family.positions == "learned":
        why = f"{model.name} has {limit:,} learned positions and fails past them"
        fix = f"give --seq-len {limit} or less"
    else:
        scaled = dict(model.hf_extra).get("rope_parameters")
        why = f"{model.name} was trained on {limit:,} positions" + (
            " (with its RoPE scaling)" if scaled else " and its config sets no RoPE scaling"
        )
        fix = f"give --seq-len {limit} or less, or a local config.json whose rope_parameters scale RoPE that far"
    raise SpecError(f"--seq-len {seq_len:,} is too long: {why}; {fix}")


def with_cpu_budget(cluster: ClusterSpec, budget: str | int) -> ClusterSpec:
    """The CPU target with ``budget`` bytes per rank.

    Every rank runs on this machine, so the ranks' budgets together may not exceed its
    physical memory: a larger budget would pass plans that the kernel kills (or swaps to
    a crawl) instead of the measured run's clean OOM.
    """
    import dataclasses

    from autofit.specs.gpus import cpu_device, physical_memory_bytes
    from autofit.specs.units import GiB

    if cluster.gpu.kind != "cpu":
        raise SpecError(f"--cpu-mem-budget applies to the local CPU target (--gpus 1xcpu), not {cluster.gpu.name}")
    size = parse_size(budget) if isinstance(budget, str) else int(budget)
    if size <= 0:
        raise SpecError(f"--cpu-mem-budget must be positive, got {budget!r}")
    ram, ranks = physical_memory_bytes(), cluster.gpus_per_node  # every rank runs here
    if size * ranks > ram:
        each = f" for each of {ranks} CPU ranks" if ranks > 1 else ""
        raise SpecError(
            f"--cpu-mem-budget {budget}{each} exceeds this machine's {ram / GiB:.1f} GiB of physical memory; "
            f"give at most {ram // ranks / GiB:.1f}GiB"
        )
    return dataclasses.replace(cluster, gpu=cpu_device(size))


def default_precision(cluster: ClusterSpec) -> Precision:
    return Precision.BF16_MIXED if cluster.gpu.supports_bf16 else Precision.FP16_MIXED


def build_plan(ctx: Target, **opts: Any) -> Plan:
    """A Plan from CLI options; unset knobs get defaults that are valid for the target."""
    opts = {k: v for k, v in opts.items() if v is not None}
    opts.setdefault("precision", default_precision(ctx.cluster))
    opts.setdefault("attention", "sdpa" if "sdpa" in ctx.model.family.attn_impls else "eager")
    if str(opts.get("method", "full")) != "full":
        opts.setdefault("lora_rank", DEFAULT_LORA_RANK)
    if str(opts.get("checkpointing", "")) == "selective" and not opts.get("checkpoint_ops"):
        opts.setdefault("checkpoint_every", DEFAULT_CHECKPOINT_EVERY)
    mb = opts.get("micro_batch", 1)
    if "grad_accum" not in opts:
        cp = opts.get("context_parallel", 1)
        dp = ctx.cluster.world_size // cp if isinstance(cp, int) and cp >= 1 else ctx.cluster.world_size
        per_step = mb * max(1, dp)
        if ctx.workload.global_batch % per_step:
            ranks = f"{ctx.cluster.world_size} GPUs / context-parallel {cp}" if cp != 1 else "GPUs"
            raise PlanError(
                [
                    f"the global batch {ctx.workload.global_batch} is not divisible by micro_batch × {ranks} = "
                    f"{mb} × {max(1, dp)}; pick another --micro-batch or --global-batch"
                ]
            )
        opts["grad_accum"] = ctx.workload.global_batch // per_step
    return Plan(**opts)

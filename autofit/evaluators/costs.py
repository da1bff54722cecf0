"""Cost-model pieces shared by the analytic and simulated evaluators.

Both evaluators need the same answers to questions a single traced rank cannot answer:
how many bytes the model states take in the plan's dtypes (``state_bytes``, from
``techniques.dtype_layout``), what sharding does to them and which buckets it adds,
what the CUDA context, NCCL and the caching allocator add on top of the tensors, and
what the engine communicates and moves to the host in a step (``transfer_work``; the
rates it all runs at are ``timing``'s). Keeping them here means the two fidelities differ
only where they should: in how they get the per-rank tensors and FLOPs (closed form vs. a
traced step).

The constants are defaults for hardware we cannot see from here; calibration from
measured runs corrects the predictions per GPU type.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from autofit.evaluators.timing import Collective, Transfers
from autofit.plan import Method, Offload, OffloadDevice, Optimizer, Plan
from autofit.results import TENSOR_COMPONENTS, MemoryAnatomy
from autofit.specs import ClusterSpec, ModelSpec
from autofit.specs.units import GiB, MiB
from autofit.techniques import DTYPE_BYTES, SHORT_NAME, deepspeed_buckets, dtype_layout

# -- device-level overhead ---------------------------------------------------------------
# CUDA context + cuBLAS workspaces of a PyTorch process with lazy module loading
# (CUDA >= 11.7); nvidia-smi shows ~0.4-0.6 GiB before the first tensor on A100/H100.
CUDA_CONTEXT_BYTES = 512 * MiB
# NCCL communicators: buffers per channel and peer; grows with world size.
NCCL_BASE_BYTES = 256 * MiB
NCCL_PER_PEER_BYTES = 24 * MiB
# Host memory a training process needs beyond offloaded tensors (torch, CUDA libs, data).
HOST_PROCESS_BYTES = 3 * GiB


# cuBLAS workspaces. torch gives every (cuBLAS handle, stream) pair a workspace from the
# caching allocator and holds it for the process's life (aten/src/ATen/cuda/CublasHandlePool.cpp:
# setWorkspaceForHandle -> getNewWorkspace -> CUDACachingAllocator allocate), so it counts in
# max_memory_allocated. Size: CUBLAS_WORKSPACE_CONFIG, by default ":4096:2:16:8" (8 MiB + 128 KiB)
# and 32 MiB on sm90 (parseChosenWorkspaceSize); cuBLASLt shares it (TORCH_CUBLASLT_UNIFIED_WORKSPACE
# is on by default). Handles are per thread: the forward's and autograd's backward thread.
CUBLAS_HANDLES = 2


def cublas_workspace_bytes(capability: tuple[int, int]) -> int:
    """One cuBLAS workspace on a GPU of this compute capability, as torch sizes it by default."""
    return 4096 * 8 * 1024 if capability == (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8


def cublas_workspaces(capability: tuple[int, int]) -> tuple[int, ...]:
    """The workspaces a training process holds: one per handle (``CUBLAS_HANDLES``)."""
    return (cublas_workspace_bytes(capability),) * CUBLAS_HANDLES


def fit_margin(evaluator: str, kind: str = "cuda") -> float:
    """The share by which an estimator's device total must be raised to cover 95% of published
    GPU runs (``evidence.json``, written by ``benchmarks/published_runs.py --write-evidence``;
    docs/EVALUATORS.md). The CPU target has none: the simulator agrees with real CPU steps to
    the byte; a measurement needs none. ROCm GPUs (analytic only) take the GPU runs' margin."""
    if kind == "cpu":
        return 0.0
    return float(_evidence()["fit_margin"].get(evaluator, {}).get("margin", 0.0))


def fit_margin_extra(margin: float, memory: MemoryAnatomy, budget: int) -> dict:
    """What an estimate says of its 95% margin (``TrialResult.extra``): the bytes and whether
    the plan would still fit the budget with them."""
    if not margin:
        return {}
    extra = int(memory.device_total * margin)
    return {
        "fit_margin": {
            "fraction": margin,
            "bytes": extra,
            "cover": 0.95,
            "fits_with_margin": memory.device_total + extra <= budget,
        }
    }


@functools.cache
def _evidence() -> dict:
    """Figures derived from benchmarks, with their provenance (``autofit/evaluators/evidence.json``)."""
    import json
    from importlib.resources import files

    return json.loads(files("autofit.evaluators").joinpath("evidence.json").read_text())


def nccl_bytes(world_size: int) -> int:
    if world_size <= 1:
        return 0
    return NCCL_BASE_BYTES + NCCL_PER_PEER_BYTES * min(world_size - 1, 15)


def reserved_bytes(peak_allocated: int, kind: str = "cuda") -> int:
    """The caching allocator's pool at the peak: allocations rounded to 2 MiB segments plus fragmentation.

    The CPU target (measured runs on this machine) has no caching allocator: what is
    judged there is what the storage tracker counts.
    """
    if kind == "cpu":
        return int(peak_allocated)
    rounded = -(-peak_allocated // (2 * MiB)) * (2 * MiB)
    return int(rounded * (1 + allocator_fragmentation()))


def allocator_fragmentation() -> float:
    """(reserved - allocated) / allocated at the peak of a step, as the simulator's replays of
    traced steps through the allocator model give it (median over the published runs'
    plans; ``evidence.json``, written by ``benchmarks/published_runs.py --write-evidence``).
    The analytic evaluator has no allocation sequence to replay, so it takes this figure."""
    return float(_evidence()["allocator_fragmentation"]["value"])


def device_total(peak_reserved: int, world_size: int, kind: str = "cuda") -> int:
    """Reserved plus the CUDA context and NCCL; the CPU target has neither (gloo buffers are host memory)."""
    if kind == "cpu":
        return int(peak_reserved)
    return peak_reserved + CUDA_CONTEXT_BYTES + nccl_bytes(world_size)


def on_device(
    components: dict[str, int], cluster: ClusterSpec, host: float, kind: str = "cuda", reserved: int | None = None
) -> MemoryAnatomy:
    """The anatomy of a rank from its six tensor components at the peak: the caching
    allocator's pool (``reserved`` where a replay gave it, else :func:`reserved_bytes`) and
    the device's context on top, and ``host`` (offloaded bytes per rank) plus each process's
    own host memory, per node."""
    peak_allocated = sum(components[c] for c in TENSOR_COMPONENTS)
    peak_reserved = reserved_bytes(peak_allocated, kind) if reserved is None else max(int(reserved), peak_allocated)
    total = device_total(peak_reserved, cluster.world_size, kind)
    return MemoryAnatomy(
        **{c: components[c] for c in TENSOR_COMPONENTS},
        overhead=total - peak_allocated,
        peak_allocated=peak_allocated,
        peak_reserved=peak_reserved,
        device_total=total,
        host_bytes=int((host + HOST_PROCESS_BYTES) * cluster.gpus_per_node),
    )


def compute_dtype(plan: Plan) -> str:
    """The plan's compute dtype (``techniques.dtype_layout``) as GPU peak tables and the sdpa
    rule name it: ``fp32``, ``bf16`` or ``fp16``."""
    return SHORT_NAME[dtype_layout(plan).compute]


def cuda_sdpa_kernel(
    capability: tuple[int, int],
    dtype: str,
    head_dim: int,
    masked: bool,
    gqa: bool,
    requires_grad: bool = True,
    value_dim: int | None = None,
) -> str:
    """The sdpa backend torch 2.13 picks on a CUDA GPU: ``flash``, ``efficient`` or ``math``.

    Priority flash, efficient, math (``sdp_utils.cpp``). Flash: fp16/bf16, no mask,
    head_dim <= 256 (<= 192 with gradients on sm86/sm89), sm80+, grouped KV heads native.
    Efficient: masks and fp32, no grouped KV heads. ``dtype`` is "bf16", "fp16" or "fp32";
    ``gqa``: fewer KV heads than query heads passed as they are (transformers does so only
    without a mask; with one it repeats them first). ``value_dim``: the values' head size where
    it is not the queries' (DeepSeek's multi-head latent attention): flash needs them equal
    (``check_head_dim_size_flash``), efficient does not.
    """
    half = dtype in ("bf16", "fp16")
    dtype_ok = dtype != "bf16" or capability >= (8, 0)
    same = value_dim is None or value_dim == head_dim
    if half and dtype_ok and not masked and same and capability >= (8, 0) and head_dim <= 256:
        if not (requires_grad and head_dim > 192 and capability in ((8, 6), (8, 9))):
            return "flash"
    if not gqa and dtype_ok and capability >= (5, 0):
        return "efficient"
    return "math"


def sdpa_capability_class(capability: tuple[int, int]) -> tuple[int, int]:
    """The capability standing for every one :func:`cuda_sdpa_kernel` cannot tell from
    ``capability`` (it reads only ``>= (5, 0)``, ``>= (8, 0)`` and sm86/sm89): a block's census,
    whose only CUDA kernel choice is sdpa's, is the same on all of them, and is kept once for
    them (``traced``; ``tests/evaluators/test_simulated.py`` checks the classes on every catalog GPU)."""
    if capability in ((8, 6), (8, 9)):
        return (8, 6)
    if capability >= (8, 0):
        return (8, 0)
    return (5, 0) if capability >= (5, 0) else (0, 0)


# -- model states under sharding ---------------------------------------------------------
@dataclass(frozen=True)
class StateBytes:
    """Model states of one rank *before* sharding, as the engine lays them out.

    ``weights``: parameters as stored (quantized, 16-bit or fp32). ``gradients``: grads
    of trainable parameters. ``master``: fp32 master copy (DeepSpeed mixed precision).
    ``states``: optimizer moments. ``trainable_weights``: the part of ``weights`` that
    is trainable (what ZeRO-1/2 gather after the step).
    """

    weights: float
    gradients: float
    master: float
    states: float
    trainable_weights: float
    grad_elem_bytes: int  # bytes per gradient element as communicated
    param_elem_bytes: int  # bytes per weight element as gathered (ZeRO-3/FSDP)


@dataclass(frozen=True)
class ShardedStates:
    weights: float
    gradients: float
    optimizer: float
    comm_buffers: float  # persistent communication buckets (DDP buckets, ZeRO-2 ipg)
    gather_peak: float  # transient gathered params/grads of ~2 layers (ZeRO-3, FSDP)
    step_temporary: float  # what the optimizer step allocates and frees
    host: float  # bytes this rank keeps in host memory (offload)
    grad_accum_present: float  # gradient bytes alive between micro-batches (grad_accum > 1)


# bitsandbytes NF4 with double quantization (the QLoRA default we export): 4-bit codes,
# an 8-bit absmax per 64 weights, an fp32 absmax per 256 of those.
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)

# LLM.int8's outlier columns (inputs with a value >= llm_int8_threshold) depend on the data;
# the simulator and the analytic model take this share of a Linear's input columns
# (evaluators/int8.py says why)
INT8_OUTLIER_FRACTION = 0.01


def int8_outlier_columns(cols: int) -> int:
    """Input columns of an LLM.int8 Linear taken to hold an outlier (at least one)."""
    return max(1, round(cols * INT8_OUTLIER_FRACTION))


def quantized_layer_bytes(model: ModelSpec, plan: Plan) -> float:
    """One block's bitsandbytes-quantized Linear weights, in bytes: NF4 for QLoRA; for
    lora-8bit an int8 weight and one fp32 absmax per output row (``Int8Params._quantize``,
    ``int8_vectorwise_quant``; bitsandbytes nn/modules.py). 0 for an unquantized plan."""
    if plan.method is Method.QLORA:
        return sum(i * o for _, i, o, _ in model.linears()) * NF4_BYTES_PER_PARAM
    if plan.method is Method.LORA_8BIT:
        return float(sum(i * o + 4 * o for _, i, o, _ in model.linears()))
    return 0.0


def quantized_bytes(model: ModelSpec, plan: Plan) -> float:
    """Every block's quantized Linear weights (:func:`quantized_layer_bytes`), each kind of a hybrid stack's own."""
    return sum(n * quantized_layer_bytes(k, plan) for n, k in model.layer_kinds())


def block_weight_bytes(model: ModelSpec, plan: Plan, elem_bytes: int) -> float:
    """One block's weights as ZeRO-3 and FSDP gather them, in ``elem_bytes`` (the compute dtype;
    quantized Linears stay packed); a hybrid stack's largest block's."""

    def one(k: ModelSpec) -> float:
        weights = k.layer_params() * elem_bytes
        if plan.quantized:
            weights += quantized_layer_bytes(k, plan) - sum(i * o for _, i, o, _ in k.linears()) * elem_bytes
        return weights

    return max(one(k) for _, k in model.layer_kinds())


# bitsandbytes 8-bit optimizers keep 32-bit state for tensors under this many elements,
# and one fp32 absmax per block of this many elements for each 8-bit state.
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCK = 256


@functools.lru_cache(maxsize=4096)
def state_bytes(model: ModelSpec, plan: Plan) -> StateBytes:
    """Model states of one rank before sharding, in the dtypes of ``techniques.dtype_layout``.

    Both evaluators count model states this way: the analytic one for everything, the
    simulated one for the engine-held states a single traced process does not show.
    """
    n = model.n_params
    lay = dtype_layout(plan)
    p_b = DTYPE_BYTES[lay.trainable]
    if plan.is_peft:
        n_t = model.lora_params(plan.lora_rank or 0, plan.lora_targets)
        base_b = lay.base_bytes
        if plan.quantized:
            n_lin = model.linear_params()
            weights = quantized_bytes(model, plan) + (n - n_lin) * base_b
        else:
            weights = n * base_b
        weights += n_t * p_b
        trainable_w = n_t * p_b
    else:
        n_t = n
        weights = n * p_b
        trainable_w = weights
    grad_b = DTYPE_BYTES[lay.grads]
    master = n_t * DTYPE_BYTES[lay.master] if lay.master else 0
    states = _optimizer_state_bytes(model, plan, n_t, DTYPE_BYTES[lay.moments])
    return StateBytes(
        weights=weights,
        gradients=n_t * grad_b,
        master=master,
        states=states,
        trainable_weights=trainable_w,
        grad_elem_bytes=grad_b,
        param_elem_bytes=p_b,
    )


def _optimizer_state_bytes(model: ModelSpec, plan: Plan, n_trainable: int, moment_bytes: int) -> float:
    opt = plan.optimizer
    if opt is Optimizer.SGD:
        return 0.0  # plain SGD (momentum 0) keeps no state
    if opt is Optimizer.ADAMW:
        return 2 * moment_bytes * n_trainable
    if opt in (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT):
        # two 8-bit moments + an fp32 absmax each per 256-element block (bitsandbytes 0.45+);
        # small tensors stay 32-bit
        small = _small_trainable(model, plan)
        return (2 + 8 / BNB_BLOCK) * (n_trainable - small) + 8 * small
    # Adafactor: factored second moment, rows + cols per matrix, full for vectors
    if plan.engine == "deepspeed":
        # ZeRO hands the inner optimizer one flat 1-D partition (stage_1_and_2.py
        # single_partition_of_fp32_groups, stage3.py fp32_partitioned_groups_flat): a vector,
        # whose second moment Adafactor keeps whole (torch/optim/_adafactor.py, transformers'
        # Adafactor._get_options: factored only for 2-D and up)
        return moment_bytes * n_trainable
    if plan.is_peft:
        r = plan.lora_rank or 0
        return moment_bytes * sum(
            n * 2 * (r + (i + o) / 2)  # A: r×in -> r+in, B: out×r -> out+r
            for n, k in model.layer_kinds()
            for _, i, o, part in k.linears()
            if plan.lora_targets.covers(part)
        )
    matrices = model.matrix_shapes()
    in_matrices = sum(cnt * rows * cols for cnt, rows, cols in matrices)
    factored = sum(cnt * (rows + cols) for cnt, rows, cols in matrices)
    return moment_bytes * (factored + (n_trainable - in_matrices))


def _small_trainable(model: ModelSpec, plan: Plan) -> int:
    """Trainable elements in tensors smaller than bitsandbytes' 8-bit threshold (the vectors)."""
    if plan.is_peft:
        return 0
    return model.n_params - sum(cnt * r * c for cnt, r, c in model.matrix_shapes())


def shard_states(
    plan: Plan,
    model: ModelSpec,
    cluster: ClusterSpec,
    sb: StateBytes,
    layer_weight_bytes: float,
    layer_trainable: float,
    step_temporary: float,
) -> ShardedStates:
    """Divide model states the way the plan's engine divides them, and add its buffers."""
    dp = cluster.world_size
    stage = plan.zero_stage
    ga_grads = plan.grad_accum > 1
    buckets = deepspeed_buckets(model)
    offload_opt = plan.offload is not Offload.NONE
    offload_params = plan.offload is Offload.OPTIMIZER_PARAMS
    nvme = plan.offload_device is OffloadDevice.NVME

    w, g, opt = sb.weights, sb.gradients, sb.master + sb.states
    comm = gather = 0.0
    host = 0.0
    step_tmp = step_temporary
    g_accum = g if ga_grads else 0.0

    if plan.engine == "torch":
        if dp > 1:
            comm = g  # DDP keeps a flat bucket copy of every gradient
    elif plan.engine == "deepspeed":
        opt /= dp
        comm = 2 * buckets["reduce_bucket_size"] * sb.grad_elem_bytes  # double-buffered ipg bucket
        step_tmp = zero_step_bytes(plan, model, sb, dp)
        if stage >= 2:
            g /= dp
            g_accum = g if ga_grads else 0.0
        if stage == 3:
            w /= dp
            gather = zero3_gathered_bytes(plan, model, layer_weight_bytes)
            # the flat gradient partition is allocated once, at setup (stage3.py
            # grad_partitions_flat_buffer), so it is there through every forward
            g_accum = g
        if offload_opt:
            host += opt + 4 * (sb.trainable_weights / sb.param_elem_bytes) / dp  # + fp32 grads on the CPU
            opt = 0.0
            step_tmp = 0.0
        if offload_params:
            host += w
            w = 0.0
    elif plan.engine == "fsdp":
        w /= dp
        g /= dp
        opt /= dp
        g_accum = g if ga_grads else 0.0
        # FSDP2 all-gathers the current and the prefetched next block in the compute
        # dtype and reduce-scatters one block's gradients in fp32.
        gather = 2 * layer_weight_bytes + 4 * layer_trainable
        if offload_opt:  # FSDP offloads params, grads and optimizer together
            host += w + g + opt
            w = g = opt = g_accum = 0.0
    if nvme and host:
        # ZeRO-Infinity keeps states on NVMe; the host holds pinned staging buffers.
        host = min(host, max(1 * GiB, 4 * layer_weight_bytes))
    return ShardedStates(
        weights=w,
        gradients=g,
        optimizer=opt,
        comm_buffers=comm,
        gather_peak=gather,
        step_temporary=step_tmp,
        host=host,
        grad_accum_present=g_accum,
    )


def zero3_gathered_bytes(plan: Plan, model: ModelSpec, layer_weight_bytes: float) -> float:
    """Whole (gathered) parameters ZeRO-3 holds on a rank through forward and backward.

    DeepSpeed does not release a module's gathered parameters after its forward when they
    will be used again within ``stage3_max_reuse_distance`` elements of the trace, nor those
    its prefetcher has already passed in the trace (it scans ahead while fewer than
    ``stage3_max_live_parameters`` elements are gathered): ``partitioned_param_coordinator.py``
    ``__params_to_release`` and ``fetch_sub_module``. Measured on 2 CPU ranks (8-layer
    Mistral, 6.2 M parameters): the elements still gathered at the end of forward follow
    ``max(max_live, reuse / 2)`` plus about one module (``docs/FIELD-NOTES.md``). With both
    at 10⁹, a model under about 10⁹ parameters stays gathered whole, as if unsharded.
    Never less than the block being computed and the next one, plus the prefetch bucket.
    The embeddings, norms and head (never quantized) are counted among the kept first.
    """
    b = deepspeed_buckets(model)
    c = DTYPE_BYTES[dtype_layout(plan).compute]
    kept = max(b["stage3_max_live_parameters"], b["stage3_max_reuse_distance"] / 2) + model.largest_tensor()
    kept = min(model.n_params, kept)
    dense = model.n_params - model.linear_params()
    per_linear = quantized_bytes(model, plan) / model.linear_params() if plan.quantized else c
    held = min(kept, dense) * c + max(0.0, kept - dense) * per_linear
    return max(held, 2 * layer_weight_bytes + b["stage3_prefetch_bucket_size"] * c)


def held_grads(plan: Plan, model: ModelSpec, sb: StateBytes) -> float:
    """Whole (unsharded) gradients a sharding engine holds beside a block's backward, on top
    of the sharded ones.

    ZeRO-2/3 copy a gradient into their reduce bucket only when it fits there; a larger one
    stays whole until the next bucket is reduced (``stage3.py`` ``__add_grad_to_ipg_bucket``,
    ``stage_1_and_2.py`` ``reduce_independent_p_g_buckets_and_remove_grads``): the block's two
    largest weight tensors (an MoE block's expert tensors hold every expert) are whole at once.
    FSDP2 reduce-scatters a block's gradients in its post-backward, so the block's whole
    gradients (in the compute dtype) build up beside the previous block's reduce-scatter
    input, which it frees only then (``_fsdp_param_group.py`` ``post_backward``,
    ``reduce_scatter_max_input_buffers`` 1): measured on 2 CPU ranks, tiny Mixtral's peak
    moved by one block's 16-bit gradients from run to run.
    """
    if plan.engine == "fsdp":
        c = DTYPE_BYTES[dtype_layout(plan).compute]
        return sb.trainable_weights / sb.param_elem_bytes / max(1, model.num_layers) * c
    if plan.method is not Method.FULL or plan.engine != "deepspeed" or plan.zero_stage < 2:
        return 0.0
    return sum(sorted(model.block_tensors(), reverse=True)[:2]) * sb.grad_elem_bytes


def zero_step_bytes(plan: Plan, model: ModelSpec, sb: StateBytes, dp: int) -> float:
    """What ZeRO's optimizer step allocates beyond the states, on one rank (no offload).

    DeepSpeed steps the rank's partition of each parameter group (ZeRO-1/2,
    ``stage_1_and_2.py`` ``step``) or of each sub-group of at most ``sub_group_size``
    elements (ZeRO-3, ``stage3.py`` ``_prepare_fp32_grad_for_sub_group``) the same way: the
    16-bit gradient partition is flattened into a new tensor (``_flatten_dense_tensors``,
    a ``cat``) and converted to an fp32 copy, both alive as the copy is made; the fp32 copy
    then lives through the inner optimizer's step, beside its temporaries.
    The exported torch AdamW is the fused one (``export.deepspeed``), which allocates none;
    torch's default foreach AdamW would add a 4-byte sqrt per element (``torch/optim/adam.py``
    ``_multi_tensor_adam``), its CPU loop 8. Adafactor steps the flat partition as a vector:
    its squared gradient and the variance's clone, 4 bytes each (``torch/optim/_adafactor.py``
    ``_single_tensor_adafactor``). bitsandbytes' 8-bit step and SGD allocate nothing that size.
    """
    elems = sb.trainable_weights / sb.param_elem_bytes / dp
    if plan.zero_stage == 3:
        # sub-groups take whole parameters until they reach sub_group_size (_create_fp16_sub_groups)
        elems = min(elems, deepspeed_buckets(model)["sub_group_size"] + model.largest_tensor() / dp)
    inner = 8 * elems if plan.optimizer is Optimizer.ADAFACTOR else 0.0
    # ZeRO-1/2 free the partition's 16-bit gradients before the inner step
    # (free_grad_in_param_list); ZeRO-3 keeps its flat gradient buffer
    freed = sb.grad_elem_bytes * elems if plan.zero_stage < 3 else 0.0
    return max((sb.grad_elem_bytes + 4) * elems, 4 * elems + inner - freed)


# -- time --------------------------------------------------------------------------------
def transfer_work(
    plan: Plan, model: ModelSpec, cluster: ClusterSpec, sb: StateBytes, offloaded: float = 0.0
) -> Transfers:
    """The collectives and host traffic of one rank's step, as each engine issues them.

    DDP all-reduces gradient buckets during backward (torch/csrc/distributed/c10d/reducer.cpp,
    25 MiB buckets, ``bucket_cap_mb``) once per step (``no_sync`` on the other micro-batches).
    ZeRO-1 all-reduces at the boundary; ZeRO-2/3 reduce-scatter in ``reduce_bucket_size``
    buckets during every backward (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py);
    ZeRO-1/2 all-gather the updated parameters after the step; ZeRO-3 and FSDP gather each
    block's parameters for forward and again for backward, prefetching the next block
    (FSDP2 ``reshard_after_forward``), and FSDP reduce-scatters each block's gradients in
    fp32 (FSDP2's default reduce dtype for fp32 parameters). An activation offload moves
    ``offloaded`` bytes to the host in each micro-batch's forward and back in its backward,
    on the compute stream (``evaluators.offload``): exposed, not overlapped.
    """
    n_train = sb.trainable_weights / sb.param_elem_bytes
    grad_payload = n_train * sb.grad_elem_bytes
    L = max(1, model.num_layers)
    bucket = deepspeed_buckets(model)["reduce_bucket_size"] * sb.grad_elem_bytes
    out: list[Collective] = []
    bwd = ("backward",)
    if plan.engine == "torch":
        calls = max(1.0, grad_payload / (25 * MiB))
        out.append(Collective("all-reduce", grad_payload / calls, calls, "step", bwd))
    elif plan.engine == "deepspeed":
        stage = plan.zero_stage
        calls = max(1.0, grad_payload / bucket)
        if stage == 1:
            out.append(Collective("all-reduce", grad_payload / calls, calls, "step", bwd))
        else:
            out.append(Collective("reduce-scatter", grad_payload / calls, calls, "micro", bwd))
        if stage in (1, 2):
            out.append(Collective("all-gather", sb.trainable_weights, 1, "step"))
        if stage == 3:
            out.append(Collective("all-gather", sb.weights / L, 2 * L, "micro", ("forward", "backward")))
    elif plan.engine == "fsdp":
        out.append(Collective("reduce-scatter", n_train * 4 / L, L, "micro", bwd))
        out.append(Collective("all-gather", sb.weights / L, 2 * L, "micro", ("forward", "backward")))
    host_step = cpu = nvme = 0.0
    host_micro = 2 * offloaded
    if plan.offload is not Offload.NONE:
        shard = n_train / cluster.world_size
        # gradients down, updated 16-bit parameters up, once per step; the node's CPU steps
        # the shards of its ranks
        host_step = shard * (sb.grad_elem_bytes + sb.param_elem_bytes)
        cpu = shard * cluster.gpus_per_node
        if plan.offload_device is OffloadDevice.NVME:
            nvme = cluster.gpus_per_node * shard * 12 * 2  # read and write the fp32 states
        if plan.offload is Offload.OPTIMIZER_PARAMS:
            # parameters stream from the host for forward and backward of every micro-batch
            host_micro += 2 * sb.weights / cluster.world_size
    return Transfers(tuple(out), host_step, host_micro, cpu, nvme)


def optimizer_step_bytes(plan: Plan, sb: StateBytes) -> float:
    """Memory traffic of the optimizer step on the GPU (it is bandwidth-bound)."""
    if plan.offload is not Offload.NONE:
        return 0.0
    n = sb.trainable_weights / sb.param_elem_bytes
    traffic = {
        Optimizer.ADAMW: 2 * (sb.states + sb.master) + 2 * sb.trainable_weights + sb.gradients,
        Optimizer.ADAMW_8BIT: 2 * sb.states + 2 * sb.trainable_weights + sb.gradients,
        Optimizer.PAGED_ADAMW_8BIT: 2 * sb.states + 2 * sb.trainable_weights + sb.gradients,
        Optimizer.ADAFACTOR: 3 * sb.trainable_weights + sb.gradients + 4 * n,
        Optimizer.SGD: 2 * sb.trainable_weights + sb.gradients,
    }[plan.optimizer]
    return traffic


def next_pow2(x: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1.0, x))))

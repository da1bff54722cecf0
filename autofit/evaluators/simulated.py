"""The simulated evaluator: the real training step of the real architecture under fake tensors.

The model is built on ``meta`` by ``runtime.build_model``, swapped to fake CPU tensors
and stepped twice by ``runtime.StepRunner`` under ``FakeTensorMode``, with the target's
CUDA kernels substituted (:class:`CudaKernels`); a ``memtrack.StorageTracker`` gives the
anatomy at the peak, and a roofline over the traced ops the time. Nothing is allocated
and no GPU is needed. Imports torch and transformers lazily (inside functions), and
from autofit only what lies below the evaluators (results, plan, specs) and its siblings
base, costs, timing, allocator, unroll, runtime and memtrack. The step is traced on three
periods of decoder layers and unrolled to all of them (``unroll``). Design and decisions:
docs/EVALUATORS.md.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

from autofit.errors import AutofitError
from autofit.evaluators import context, costs, moe, timing, unroll
from autofit.evaluators.allocator import AllocatorConfig, Replay, replay
from autofit.evaluators.base import Evaluator, StepCallback
from autofit.evaluators.unroll import Depth
from autofit.plan import Attention, Checkpointing, Method, Offload, Plan
from autofit.results import TENSOR_COMPONENTS, MemoryAnatomy, Throughput, TrialResult, judge
from autofit.specs import ModelSpec, Target, Workload
from autofit.specs.gpus import GPUSpec
from autofit.techniques import checkpointed_layers, model_notes

FLASH2_IMPL = "autofit_fa2"  # a name with "flash" in it is taken for a hub kernel
CACHE_SIZE = 64


# -- what a trace depends on -------------------------------------------------------------
@dataclass(frozen=True)
class TraceDevice:
    """What decides the kernels a trace runs: the device kind and its compute capability."""

    kind: str  # "cpu" or "cuda"
    capability: tuple[int, int] = (0, 0)

    @classmethod
    def of(cls, gpu: GPUSpec) -> TraceDevice:
        if gpu.analytic_only:  # the trace follows CUDA PyTorch's kernel choice, not ROCm's
            raise AutofitError(f"the simulated evaluator cannot model {gpu.name} (ROCm); use --evaluator analytic")
        return cls("cpu") if gpu.kind == "cpu" else cls("cuda", tuple(gpu.compute_capability))


@dataclass(frozen=True)
class TraceKey:
    model: str  # ModelSpec.fingerprint
    seq_len: int
    lengths: tuple[tuple[int, int], ...] | None
    method: str
    lora_rank: int | None
    lora_targets: str
    lora_dropout: float
    precision: str
    optimizer: str
    micro_batch: int
    micro_batches: int  # min(grad_accum, 2): a second micro-batch runs with gradients present
    checkpointing: str
    checkpoint_every: int | None
    attention: str
    packing: bool
    fused_loss: bool
    offload_activations: bool
    optimizer_in_backward: bool
    fused_kernels: bool
    torch_compile: bool
    sharded_layout: bool  # DeepSpeed/FSDP2 compute on 16-bit parameters (runtime.layout)
    target: TraceDevice

    @classmethod
    def of(cls, plan: Plan, model: ModelSpec, workload: Workload, target: TraceDevice) -> TraceKey:
        return cls(
            model=model.fingerprint,
            seq_len=workload.seq_len,
            lengths=workload.lengths.histogram if workload.lengths else None,
            method=plan.method.value,
            lora_rank=plan.lora_rank,
            lora_targets=plan.lora_targets.value,
            lora_dropout=plan.lora_dropout,
            precision=plan.precision.value,
            optimizer=plan.optimizer.value,
            micro_batch=plan.micro_batch,
            micro_batches=min(plan.grad_accum, 2),
            checkpointing=plan.checkpointing.value,
            checkpoint_every=plan.checkpoint_every,
            attention=plan.attention.value,
            packing=plan.packing,
            fused_loss=plan.fused_loss,
            offload_activations=plan.offload_activations,
            optimizer_in_backward=plan.optimizer_in_backward,
            fused_kernels=plan.fused_kernels,
            torch_compile=plan.torch_compile,
            sharded_layout=plan.engine != "torch",
            target=target,
        )


# -- CUDA kernels on fake CPU tensors ----------------------------------------------------
def cuda_sdpa_kernel(
    capability: tuple[int, int],
    dtype,
    head_dim: int,
    masked: bool,
    gqa: bool,
    requires_grad: bool,
    value_dim: int | None = None,
) -> str:
    """``costs.cuda_sdpa_kernel`` for a torch dtype (the analytic evaluator shares the rule)."""
    return costs.cuda_sdpa_kernel(capability, _dtype_class(dtype), head_dim, masked, gqa, requires_grad, value_dim)


# CUDA autocast's fp32 policies for ops CPU autocast does not list (autocast_mode.cpp)
_FP32_CAST = frozenset(
    {
        "pow",
        "__pow__",
        "__rpow__",
        "rsqrt",
        "exp",
        "log",
        "log10",
        "log2",
        "log1p",
        "expm1",
        "reciprocal",
        "softplus",
        "acos",
        "asin",
        "cosh",
        "sinh",
        "tan",
        "erfinv",
        "layer_norm",
        "group_norm",
        "norm",
        "cosine_similarity",
        "logsumexp",
        "dist",
        "cdist",
        "renorm",
    }
)
_FP32_DTYPE = frozenset({"softmax", "log_softmax", "cumsum", "cumprod", "sum", "prod"})


def _upcast(x):
    """16-bit tensors (also inside lists and tuples) cast to fp32."""
    import torch

    if isinstance(x, torch.Tensor) and x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
    if isinstance(x, (list, tuple)):
        return type(x)(_upcast(y) for y in x)
    return x


def _cuda_autocast(name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments CUDA autocast's fp32 policy (``_FP32_CAST``/``_FP32_DTYPE``) gives op ``name``."""
    import torch

    if name in _FP32_CAST:
        return _upcast(args), {k: _upcast(v) for k, v in kwargs.items()}
    if (
        kwargs.get("dtype") is None
        and args
        and isinstance(args[0], torch.Tensor)
        and args[0].dtype in (torch.float16, torch.bfloat16)
        and len(args) <= 2
    ):
        return args, {**kwargs, "dtype": torch.float32}
    return args, kwargs


def _cuda_dropout(func, input, p=0.5, training=True, inplace=False):
    """CUDA's fused ``native_dropout``, which keeps a bool mask (the CPU keeps it in the input dtype)."""
    import torch
    import torch.nn.functional as F

    if training and 0 < p < 1 and not inplace:
        return torch.native_dropout(input, p, True)[0]
    return func(input, p, training, inplace) if func is F.dropout else func(input, p, training)


def _cuda_sdpa(
    capability: tuple[int, int], q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """sdpa as torch runs it on a CUDA GPU of ``capability``: the kernel ``cuda_sdpa_kernel`` picks
    (the order and constraints of ``sdp_utils.cpp``), called as the aten op itself so that what it
    saves for backward (out, logsumexp, rng state) is traced."""
    import torch
    import torch.nn.functional as F

    aten = torch.ops.aten
    if torch.is_autocast_enabled("cpu"):  # sdpa is on autocast's 16-bit list: cast first
        low = torch.get_autocast_dtype("cpu")
        q, k, v = (t.to(low) if t.dtype is torch.float32 else t for t in (q, k, v))
        if attn_mask is not None and attn_mask.dtype is torch.float32:
            attn_mask = attn_mask.to(low)
    gqa = enable_gqa and k.shape[-3] != q.shape[-3]
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    kernel = cuda_sdpa_kernel(capability, q.dtype, q.shape[-1], attn_mask is not None, gqa, grad, v.shape[-1])
    if kernel == "flash":
        return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    if kernel == "efficient":
        bias = attn_mask
        if bias is not None and bias.dtype is torch.bool:  # convert_boolean_attn_mask
            bias = torch.zeros_like(bias, dtype=q.dtype).masked_fill_(bias.logical_not(), float("-inf"))
        if bias is not None:
            bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        return aten._scaled_dot_product_efficient_attention(q, k, v, bias, grad, dropout_p, is_causal, scale=scale)[0]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )


def _make_cuda_kernels():
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class CudaKernels(TorchFunctionMode):
        """Run, on fake CPU tensors, the kernels a CUDA GPU of ``capability`` would run.

        sdpa (``_cuda_sdpa``), dropout (``_cuda_dropout``) and CUDA autocast's fp32 ops
        (``_cuda_autocast``); why these: docs/EVALUATORS.md.
        """

        def __init__(self, capability: tuple[int, int]) -> None:
            super().__init__()
            self.capability = capability

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                return _cuda_sdpa(self.capability, *args, **kwargs)
            if func is F.dropout or func is torch.dropout:
                return _cuda_dropout(func, *args, **kwargs)
            name = getattr(func, "__name__", "")
            if (name in _FP32_CAST or name in _FP32_DTYPE) and torch.is_autocast_enabled("cpu"):
                args, kwargs = _cuda_autocast(name, args, kwargs)
            return func(*args, **kwargs)

    return CudaKernels


@functools.lru_cache(maxsize=1)
def cuda_kernels_mode():
    return _make_cuda_kernels()


# -- flash2 ------------------------------------------------------------------------------
def flash2_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    sliding_window=None,
    softcap=None,
    is_causal=None,
    **kwargs,
):
    """FlashAttention-2 as transformers' flash path runs it, through aten's FA2 kernel.

    q/k/v arrive as [batch, heads, seq, dim]; returns [batch, seq, heads, dim] like
    transformers' ``flash_attention_forward``. Sliding window and soft-cap change no
    tensor (FA2 applies them inside the kernel) and are not emulated.
    """
    import torch

    aten = torch.ops.aten
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    lengths = getattr(attention_mask, "_autofit_lengths", None) if attention_mask is not None else None
    if lengths is None:
        out = aten._scaled_dot_product_flash_attention(query, key, value, dropout, causal, False, scale=scaling)[0]
        return out.transpose(1, 2), None
    b, h, s, d = query.shape
    n = sum(lengths)
    idx = torch.empty(n, dtype=torch.long, device=query.device)  # the real tokens' positions (values unused)

    def unpad(x):  # transformers' _index_first_axis: contiguous [b, s, h, d], then a gather
        return x.transpose(1, 2).contiguous().reshape(b * s, x.shape[1], d)[idx]

    q, k, v = (unpad(x).transpose(0, 1).unsqueeze(0) for x in (query, key, value))
    out = aten._scaled_dot_product_flash_attention(q, k, v, dropout, causal, False, scale=scaling)[0]
    out = out.squeeze(0).transpose(0, 1)  # [n, h, d]
    padded = out.new_zeros(b * s, h, d)
    padded[idx] = out
    return padded.view(b, s, h, d), None


def _flash2_mask(
    batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None, **kwargs
):
    """The 2D padding mask, passed through unsliced (the simulator drops all-ones masks)."""
    return attention_mask


@functools.lru_cache(maxsize=1)
def register_flash2() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(FLASH2_IMPL, flash2_attention)
    AttentionMaskInterface.register(FLASH2_IMPL, _flash2_mask)
    return FLASH2_IMPL


# -- the trace ---------------------------------------------------------------------------
def memory_bound(op: str, flops: float, dim: float) -> bool:
    """Whether an op's row (:class:`OpCosts`) is priced by the bytes it moves: neither attention
    (priced by its FLOPs) nor a GEMM (a smallest dimension: ``gemm_dim``)."""
    return "attention" not in op and not (flops and dim)


@dataclass
class OpCosts:
    """The steady-state step's ops per phase, as ``(op, flops, bytes, dtype, dim)`` rows;
    ``dim`` is a GEMM's smallest dimension (0 for other ops). Beside each row, the decoder
    layer it ran in (``tags``) and, for an op outside the layers, its bytes by the layer that
    made each tensor (``per_layer``), which is what :meth:`unrolled` repeats."""

    rows: dict[str, list[tuple[str, float, float, str, float]]] = field(default_factory=dict)
    tags: dict[str, list[int | None]] = field(default_factory=dict)
    per_layer: dict[str, list[dict[int, float] | None]] = field(default_factory=dict)

    def add(
        self,
        phase: str,
        op: str,
        flops: float,
        nbytes: float,
        dtype: str,
        dim: float = 0.0,
        tag: int | None = None,
        per_layer: dict[int, float] | None = None,
    ) -> None:
        self.rows.setdefault(phase, []).append((op, flops, nbytes, dtype, dim))
        self.tags.setdefault(phase, []).append(tag)
        self.per_layer.setdefault(phase, []).append(per_layer)

    def unrolled(self, depth: Depth) -> OpCosts:
        """The ops of the ``depth.total``-layer step: the template block's ops repeated, and an
        op over all layers' tensors reading each further copy's bytes too."""
        out = OpCosts()
        for phase, rows in self.rows.items():
            for row, tag, per in zip(rows, self.tags[phase], self.per_layer[phase]):
                if depth.block(tag) == 1:
                    for _ in range(depth.copies):
                        out.add(phase, *row, tag=tag)
                    continue
                extra = sum(b for layer, b in (per or {}).items() if depth.block(layer) == 1)
                op, flops, nbytes, dtype, dim = row
                out.add(phase, op, flops, nbytes + (depth.copies - 1) * extra, dtype, dim, tag=tag)
        return out

    def flops(self, phase: str | None = None) -> float:
        phases = [phase] if phase else list(self.rows)
        return sum(r[1] for p in phases for r in self.rows.get(p, ()))

    def work(self, phase: str, micro_batches: int = 1) -> timing.PhaseWork:
        """One micro-batch's share of a phase as ``timing.PhaseWork``: GEMMs with their
        shapes (identical ones counted together), attention FLOPs, every other op's bytes
        as memory-bound traffic, and every op as one kernel."""
        gemms: dict[tuple[float, float, float], int] = {}
        attention = memory = 0.0
        rows = self.rows.get(phase, ())
        for op, flops, nbytes, _, dim in rows:
            if memory_bound(op, flops, dim):
                memory += nbytes
            elif "attention" in op:
                attention += flops
            else:
                gemms[(flops, nbytes, dim)] = gemms.get((flops, nbytes, dim), 0) + 1
        n = micro_batches
        return timing.PhaseWork(
            gemms=tuple((f, b, d, c / n) for (f, b, d), c in gemms.items()),
            attention=attention / n,
            memory_bytes=memory / n,
            kernels=len(rows) / n,
        )

    def attention_kernel(self) -> str:
        """The attention kernel the traced step ran (``timing.ATTENTION_KERNELS``)."""
        ops = {r[0] for rows in self.rows.values() for r in rows}
        if any("flash_attention" in op for op in ops):
            return "flash"
        if any("efficient_attention" in op for op in ops):
            return "efficient"
        return "math"


@dataclass
class Trace:
    """What one traced step leaves behind: the storage log, the phases, the op costs."""

    key: TraceKey
    log: list[tuple[int, int]]
    kinds: dict[int, str]  # storage key -> component
    marks: list[tuple[int, str, int]]  # (event index, phase, step) when a phase starts
    peak: int
    peak_components: dict[str, int]
    peak_phase: str
    ops: OpCosts
    n_params: int
    n_trainable: int
    grad_bytes: int  # every trainable parameter's gradient, as traced (allocator blocks)
    tokens: int  # tokens of one micro-batch as traced (padded)
    micro_batches: int
    seconds: float  # wall time of the trace
    timings: dict[str, Any] = field(default_factory=dict)
    tags: list[int | None] = field(default_factory=list)  # each event's decoder layer (unroll)
    offloaded: float = 0.0  # activation bytes one micro-batch copies to the host (offload_activations)
    replays: dict[tuple, Replay] = field(default_factory=dict)  # allocator replays (simulated.reserved)


def _dtype_class(dtype) -> str:
    import torch

    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


@functools.cache
def _written_args(func) -> tuple[int, ...]:
    """Positions of the arguments an op writes in place that it does not also return."""
    if func._schema.returns:
        return ()
    return tuple(i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


def _is_causal(func, args, kwargs) -> bool:
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bool(bound.get("is_causal", False))


class _OpCounter:
    """FLOPs (``torch.utils.flop_counter``'s formulas) and bytes read and written of one aten op."""

    def __init__(self) -> None:
        import torch
        from torch.utils._pytree import tree_leaves
        from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

        aten = torch.ops.aten
        self._tensor, self._tree_leaves = torch.Tensor, tree_leaves
        self._registry = flop_registry
        self._sdpa_fwd, self._sdpa_bwd = sdpa_flop_count, sdpa_backward_flop_count
        self._conv_bwd = aten.convolution_backward
        self.attention_ops = {
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_flash_attention_backward.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_efficient_attention_backward.default,
        }
        self.cpu_flash = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
        self.cpu_flash_bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
        # ops that move no data (views, detach, uninitialized allocations)
        self.free = {
            aten._unsafe_view.default,
            aten.detach.default,
            aten.lift_fresh.default,
            aten.empty.memory_format,
            aten.empty_strided.default,
            aten.new_empty.default,
            aten.new_empty_strided.default,
            aten.empty_like.default,
        }
        # bitsandbytes' LLM.int8 Python wrappers (evaluators/int8.py): their ops are the kernels
        try:
            import bitsandbytes  # noqa: F401 - registers torch.ops.bitsandbytes

            bnb = torch.ops.bitsandbytes
            self.free |= {bnb.int8_scaled_mm.default, bnb.int8_mixed_scaled_mm.default}
        except (ImportError, AttributeError):
            pass

    def counted(self, func) -> bool:
        """An op that costs time (prim.device & co. query metadata)."""
        return func not in self.free and not func.is_view and func.namespace != "prim"

    def nbytes(self, func, args, kwargs, out) -> tuple[int, Any]:
        """Bytes the op reads and writes, and the first floating dtype among its tensors (or None)."""
        nbytes = 0
        dtype = None
        # what an op reads and writes; arguments it mutates in place are written too
        for t in self._tree_leaves((args, kwargs, out, [args[i] for i in _written_args(func) if i < len(args)])):
            if isinstance(t, self._tensor):
                nbytes += t.numel() * t.element_size()
                if dtype is None and t.is_floating_point():
                    dtype = t.dtype
        return nbytes, dtype

    def bytes_by(self, func, args, kwargs, out, layer_of) -> dict[int, float]:
        """The op's bytes (as :meth:`nbytes` counts them) of the tensors each layer made."""
        by: dict[int, float] = {}
        for t in self._tree_leaves((args, kwargs, out, [args[i] for i in _written_args(func) if i < len(args)])):
            if isinstance(t, self._tensor):
                layer = layer_of(t)
                if layer is not None:
                    by[layer] = by.get(layer, 0.0) + t.numel() * t.element_size()
        return by

    def flops(self, func, args, kwargs, out, attn_flop_scale: float) -> float:
        """FLOPs of the op; attention scaled by ``attn_flop_scale`` (flash2 varlen) and halved when causal."""
        flops = 0.0
        packet = func._overloadpacket
        if packet in self._registry:
            flops = self._registry[packet](*args, **kwargs, out_val=out)
            if func in self.attention_ops:
                flops *= attn_flop_scale * (0.5 if _is_causal(func, args, kwargs) else 1.0)
            if packet is self._conv_bwd:
                flops += self._grouped_weight_grad(args, out)
        elif self.cpu_flash is not None and packet in (self.cpu_flash, self.cpu_flash_bwd):
            backward = packet is self.cpu_flash_bwd
            q, k, v = args[1:4] if backward else args[:3]
            flops = (
                self._sdpa_bwd(args[0].shape, q.shape, k.shape, v.shape)
                if backward
                else self._sdpa_fwd(q.shape, k.shape, v.shape)
            )
            flops *= attn_flop_scale * (0.5 if _is_causal(func, args, kwargs) else 1.0)
        elif packet.__name__ == "gemm_4bit":  # bitsandbytes' fused 4-bit matmul, left whole
            a = args[0]
            flops = 2.0 * a.numel() * args[2][0]
        elif packet.__name__ == "int8_linear_matmul":  # LLM.int8's GEMM: A (tokens × in) · B (out × in)ᵀ
            flops = 2.0 * args[0].numel() * args[1].shape[0]
        elif packet.__name__ == "_grouped_mm":  # an MoE block's experts (evaluators/moe.py)
            flops = moe.grouped_mm_flops(args, out)
        return flops

    def _grouped_weight_grad(self, args, out) -> float:
        """What torch's formula counts wrong in a grouped convolution's weight gradient (the causal
        depthwise conv1d of every Mamba, delta-rule and short-convolution mixer): it takes it as an
        ungrouped convolution of the input with the output gradient (``flop_counter.conv_backward_flop``,
        which "skips groups"), ``groups`` times too many; it costs what the forward does."""
        from torch.utils.flop_counter import conv_flop_count

        grad_out, x, w, transposed, groups, mask = args[0], args[1], args[2], args[7], args[9], args[10]
        if groups == 1 or transposed or not mask[1]:
            return 0.0

        def t(shape):
            return [shape[1], shape[0], *shape[2:]]

        wrong = conv_flop_count(t(x.shape), t(grad_out.shape), t(out[1].shape), transposed=False)
        return float(conv_flop_count(x.shape, w.shape, grad_out.shape, transposed=False) - wrong)

    def gemm_dim(self, func, args) -> float:
        """The smallest of a GEMM's m, k, n (0 for an op that is not one)."""
        name = func._overloadpacket.__name__
        if name in ("mm", "bmm"):
            a, b = args[0], args[1]
        elif name in ("addmm", "baddbmm"):
            a, b = args[1], args[2]
        elif name == "gemm_4bit":
            a = args[0]
            return float(min(a.numel() // a.shape[-1], a.shape[-1], args[2][0]))
        elif name == "int8_linear_matmul":
            a = args[0]
            return float(min(a.numel() // a.shape[-1], a.shape[-1], args[1].shape[0]))
        elif name == "_grouped_mm":
            return moe.grouped_mm_dim(args)
        else:
            return 0.0
        return float(min(a.shape[-2], a.shape[-1], b.shape[-1]))


def _make_tracer():
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    from autofit.evaluators.memtrack import StorageTracker

    scalar_read = torch.ops.aten._local_scalar_dense.default
    counter = _OpCounter()

    class Tracer(unroll.LayerTags, StorageTracker):
        """The storage tracker plus phase marks and per-op FLOPs/bytes of the last step, each
        event, mark and op tagged with the decoder layer it belongs to (``unroll.LayerTags``)."""

        def __init__(self, last_step: int, attn_flop_scale: float, decompositions=None) -> None:
            super().__init__(decompositions=decompositions)
            self.marks: list[tuple[int, str, int]] = []
            self.ops = OpCosts()
            self.last_step = last_step
            self.attn_flop_scale = attn_flop_scale
            self.fusing = 0  # inside a compiled block's graph (evaluators.compiled)

        @contextlib.contextmanager
        def in_phase(self, phase, step=None):
            outer = (self.phase, self.step)
            with super().in_phase(phase, step):
                self.marks.append((len(self.log), phase, self.step))
                self.mark_tags.append(self.layer)
                try:
                    yield
                finally:
                    self.leave_phase(phase)
                    self.marks.append((len(self.log), outer[0], outer[1]))
                    self.mark_tags.append(self.layer)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is scalar_read and isinstance(args[0], FakeTensor):
                # a value read back (Adafactor's parameter RMS) decides no tensor's size;
                # a fake tensor has none, so the trace reads 1
                return True if args[0].dtype is torch.bool else (1.0 if args[0].is_floating_point() else 1)
            with self.op_context(args):
                out = super().__torch_dispatch__(func, types, args, kwargs)
                # an offload's copy to the host is host-link traffic (costs.transfer_work), not a kernel
                if self._costed() and counter.counted(func):
                    self._cost(func, args, kwargs or {}, out)
            return out

        def _costed(self) -> bool:
            return self.step == self.last_step and self.phase != "setup" and not self.host

        @contextlib.contextmanager
        def compiled_region(self, kernels):
            """Around one run of a compiled block's graph: its library kernels (GEMMs, attention)
            are priced as they run, the rest as the fused kernels inductor makes of them."""
            self.fusing += 1
            try:
                yield
            finally:
                self.fusing -= 1
                if self._costed() and kernels.count:
                    phase = "backward" if self.phase == "recompute" else self.phase
                    for _ in range(kernels.count):
                        self.ops.add(phase, "fused", 0.0, kernels.nbytes / kernels.count, "fp32", tag=self.here())

        def _cost(self, func, args, kwargs, out) -> None:
            flops = counter.flops(func, args, kwargs, out, self.attn_flop_scale)
            if self.fusing and not flops:
                return  # in one of the fused kernels compiled_region adds
            nbytes, dtype = counter.nbytes(func, args, kwargs, out)
            dim = counter.gemm_dim(func, args) if flops else 0.0
            phase = "backward" if self.phase == "recompute" else self.phase
            tag = self.here()
            per_layer = None
            if tag is None:  # an op over many layers' tensors (a fused optimizer): their bytes by layer
                per_layer = counter.bytes_by(func, args, kwargs, out, self.layer_of) or None
            name = func._overloadpacket.__name__
            self.ops.add(phase, name, float(flops), float(nbytes), _dtype_class(dtype), dim, tag, per_layer)

    return Tracer


@functools.lru_cache(maxsize=1)
def tracer_class():
    return _make_tracer()


@contextlib.contextmanager
def _value_decisions():
    """Decisions transformers takes from tensor *values*, which fake tensors do not have.

    ``find_packed_sequence_indices`` looks at position_ids to detect packed rows; it would
    always answer "packed" under fake tensors and materialize a 4D mask the real run never
    builds. Packing is only valid with flash2, whose stand-in handles packed rows itself,
    so the trace answers "not packed" as the real run does for every other kernel.
    """
    import transformers.masking_utils as mu

    orig = mu.find_packed_sequence_indices
    mu.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = orig


def _lengths(batch: dict) -> list[int]:
    """Real tokens per sequence of a synthetic micro-batch (before it is made fake)."""

    if "attention_mask" in batch:
        return [int(n) for n in batch["attention_mask"].sum(-1).tolist()]
    if "position_ids" in batch and "attention_mask" not in batch:
        pos = batch["position_ids"][0]
        starts = (pos == 0).nonzero().flatten().tolist() + [pos.numel()]
        return [b - a for a, b in zip(starts, starts[1:])]
    return [batch["input_ids"].shape[1]] * batch["input_ids"].shape[0]


def _fake_batch(batch: dict, mode, flash2: bool) -> tuple[dict, list[int] | None]:
    """A synthetic micro-batch as fake tensors.

    An all-ones attention mask is dropped: transformers skips it on real tensors (it reads
    the values) and would build a 4D mask from a fake one. flash2's mask is kept in bool
    with the row lengths attached, which its stand-in needs to unpad.
    """

    lengths = _lengths(batch)
    batch = dict(batch)
    mask = batch.get("attention_mask")
    if mask is not None and bool((mask == 1).all()):
        del batch["attention_mask"]
    elif mask is not None and flash2:
        batch["attention_mask"] = mask.bool()
    fake = {k: mode.from_tensor(v) for k, v in batch.items()}
    concatenated = None
    if "attention_mask" in fake and flash2:
        fake["attention_mask"]._autofit_lengths = lengths
        concatenated = lengths
    elif "position_ids" in fake:  # packed
        concatenated = lengths
    return fake, concatenated


def _attn_flop_scale(rows: list[list[int] | None]) -> float:
    """Share of a concatenated row's attention FLOPs the varlen kernel computes (flash2).

    ``rows``: per micro-batch, the lengths the flash2 stand-in concatenated into one row
    (packed, or unpadded), or None where it ran dense.
    """
    scales = [sum(x * x for x in ls) / sum(ls) ** 2 if ls else 1.0 for ls in rows]
    return sum(scales) / len(scales) if scales else 1.0


ALL_LAYERS_ENV = "AUTOFIT_TRACE_ALL_LAYERS"  # set to 1: trace every layer (no unroll), to compare


def trace_depth(model: ModelSpec, plan: Plan | None = None) -> Depth | None:
    """How ``model`` is traced: 3 periods of its layers unrolled to all (None: every layer).
    The period is that of each layer's type (``layer_types``: sliding or full attention) and kind
    (``ModelSpec.stack``: a hybrid stack's dense and MoE layers); layers before the repeating
    ones (DeepSeek-V3's first dense layers) are traced once, as a head. Selective checkpointing
    repeats every ``checkpoint_every`` layers: the period covers it (with a head, every layer is
    traced)."""
    if os.environ.get(ALL_LAYERS_ENV, "") not in ("", "0"):
        return None
    selective = plan is not None and plan.checkpointing is Checkpointing.SELECTIVE
    every = (plan.checkpoint_every or 1) if selective else 1
    types = getattr(model.to_hf_config(), "layer_types", None) or (None,) * model.num_layers
    return unroll.depth_for(model.num_layers, list(zip(types, model.stack)), every)


def run_trace(model: ModelSpec, plan: Plan, workload: Workload, target: TraceDevice, unrolled: bool = True) -> Trace:
    """Build the model on meta, swap in fake tensors and run two steps under the tracker.

    ``unrolled`` (where :func:`trace_depth` allows): the model is built with 3 periods of
    layers and the step's events and ops are unrolled to all of them
    (:mod:`autofit.evaluators.unroll`); where they do not repeat as the unroll needs, every
    layer is traced instead.
    """
    depth = trace_depth(model, plan) if unrolled else None
    if depth is not None:
        try:
            return _run_trace(model, plan, workload, target, depth)
        except unroll.UnrollError as exc:
            full = _run_trace(model, plan, workload, target, None)
            full.timings["unroll_failed"] = str(exc)
            return full
    return _run_trace(model, plan, workload, target, None)


def _run_trace(model: ModelSpec, plan: Plan, workload: Workload, target: TraceDevice, depth: Depth | None) -> Trace:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autofit.evaluators import runtime as rt

    t0 = time.perf_counter()
    built = unroll.traced_spec(model, depth) if depth else model
    flash2 = plan.attention is Attention.FLASH2
    attn_impl = register_flash2() if flash2 else None
    net = rt.build_model(built, plan, device="meta", attn_impl=attn_impl)
    t_build = time.perf_counter()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    rt.to_fake(net, mode)
    opt = rt.make_optimizer(plan, net)
    micro = min(plan.grad_accum, 2)
    traced = plan.replace(grad_accum=micro)
    fakes, scale = _fake_steps(built, traced, workload, mode, flash2)
    tokens = int(fakes[1][0]["input_ids"].numel())
    # bitsandbytes' gemm_4bit dequantizes the whole weight above 1536 rows on CUDA, always on the CPU
    decompositions = {**rt.bnb_decompositions(target.kind), **moe.fake_decompositions()}
    tr = tracer_class()(last_step=1, attn_flop_scale=scale, decompositions=decompositions)
    kernels = (lambda: cuda_kernels_mode()(target.capability)) if target.kind == "cuda" else None
    layers = unroll.decoder_layers(net, model.family.decoder_layer)
    context = unroll.LayerContext(layers, tr)
    # a CUDA target's LLM.int8 layers run MatMul8bitLt, not the CPU's MatMul8bitFp (evaluators/int8.py)
    int8_path = rt.int8.cuda_matmul(target.kind == "cuda" and plan.method is Method.LORA_8BIT)
    with _value_decisions(), mode, tr, int8_path:
        _track_weights(tr, net, layers)
        # fake *CPU* tensors even for a CUDA target: on a CPU build of torch the first autograd op on a
        # fake CUDA tensor aborts the process (FakeTensorMode's _ensureCUDADeviceGuardSet patches only
        # CUDA builds), so the target's kernels come from CudaKernels instead (docs/EVALUATORS.md)
        runner = rt.StepRunner(built, traced, net, opt, device="cpu", tracker=tr, kernels=kernels)
        step_s = []
        for step in range(len(fakes)):
            t = time.perf_counter()
            batches = fakes.pop(0)  # dropped after its step, as a training loop drops it
            for b in batches:
                tr.track(b.values())
            runner.step(batches, step=step)
            del batches
            step_s.append(time.perf_counter() - t)
    runner.close()
    context.remove()
    # the step's events, before the model's own end frees them
    log, tags, marks, mark_tags = list(tr.log), list(tr.tags), list(tr.marks), list(tr.mark_tags)
    kinds = {k: tr.classify(k) for k in tr.recs}
    n_params, n_trainable, grad_bytes = _param_counts(list(net.parameters()))
    ops = tr.ops
    timings: dict[str, Any] = {"build_s": t_build - t0, "step_s": step_s, "layers_traced": len(layers)}
    if depth is not None:
        if len(layers) != depth.traced:
            raise unroll.UnrollError(f"found {len(layers)} {model.family.decoder_layer} layers, built {depth.traced}")
        t = time.perf_counter()
        u = unroll.unroll(depth, log, tags, tr.owners, kinds, marks, mark_tags)
        log, kinds, marks, tags, ops = u.log, u.kinds, u.marks, u.tags, ops.unrolled(depth)
        template = [p for i in depth.template for p in layers[i].parameters()]
        more = [(depth.copies - 1) * n for n in _param_counts(template)]
        n_params, n_trainable, grad_bytes = n_params + more[0], n_trainable + more[1], grad_bytes + more[2]
        timings["unroll_s"] = time.perf_counter() - t
    peak, components, peak_phase = log_peak(log, kinds, marks)
    offloaded = _offloaded(tr.host_allocs, depth) / micro
    return Trace(
        key=TraceKey.of(plan, model, workload, target),
        log=log,
        kinds=kinds,
        marks=marks,
        peak=peak,
        peak_components=components,
        peak_phase=peak_phase,
        ops=ops,
        n_params=n_params,
        n_trainable=n_trainable,
        grad_bytes=grad_bytes,
        tokens=tokens,
        micro_batches=micro,
        seconds=time.perf_counter() - t0,
        timings=timings,
        tags=tags,
        offloaded=offloaded,
    )


def _offloaded(allocs: list[tuple[int, int, Any]], depth: Depth | None) -> float:
    """Host bytes the last traced step's activation offload copied, over all layers: the
    template block's copies repeated as the unroll repeats its events."""
    total = 0.0
    for step, nbytes, tag in allocs:
        if step == 1:
            total += nbytes * (depth.copies if depth is not None and depth.block(tag) == 1 else 1)
    return total


def _track_weights(tr, net, layers: list) -> None:
    """Register the model's tensors as weights, each tagged with the layer holding it."""
    from autofit.evaluators import runtime as rt

    owner: dict[int, int] = {}
    for i, layer in enumerate(layers):
        for t in rt.state_tensors(layer):
            owner.setdefault(id(t), i)
    for t in rt.state_tensors(net):
        tr.layer = owner.get(id(t))
        tr.track([t], "weights")
    tr.layer = None


def _fake_steps(model: ModelSpec, plan: Plan, workload: Workload, mode, flash2: bool) -> tuple[list, float]:
    """Two steps' synthetic micro-batches as fake tensors, and flash2's attention FLOP scale."""
    from autofit.evaluators import runtime as rt

    fakes, rows = [], []
    for step in range(2):
        fs = []
        for b in rt.batches_for(model, plan, workload, step=step):
            f, ls = _fake_batch(b, mode, flash2)
            fs.append(f)
            rows.append(ls)
        fakes.append(fs)
    return fakes, (_attn_flop_scale(rows[plan.grad_accum :]) if flash2 else 1.0)


def _param_counts(params: list) -> tuple[int, int, int]:
    """Parameters, trainable parameters, and their gradients' bytes in allocator blocks."""
    from autofit.evaluators.memtrack import round_block

    trainable = [p for p in params if p.requires_grad]
    return (
        sum(p.numel() for p in params),
        sum(p.numel() for p in trainable),
        sum(round_block(p.numel() * p.element_size()) for p in trainable),
    )


def log_peak(
    log: list[tuple[int, int]], kinds: dict[int, str], marks: list[tuple[int, str, int]]
) -> tuple[int, dict[str, int], str]:
    """The log's peak: its first highest moment, the live bytes by component then, and the
    phase it fell in (what ``StorageTracker.snapshot`` reports while tracing)."""
    live = peak = 0
    at = -1
    for ev, (_, delta) in enumerate(log):
        live += delta
        if live > peak:
            peak, at = live, ev
    comps = dict.fromkeys(TENSOR_COMPONENTS, 0)
    alive: dict[int, int] = {}
    for key, delta in log[: at + 1]:
        if delta > 0:
            alive[key] = delta
        else:
            alive.pop(key, None)
    for key, nbytes in alive.items():
        comps[kinds[key]] += nbytes
    phase = next((ph for i, ph, _ in reversed(marks) if i <= at), "setup")
    return peak, comps, phase


class TraceCache:
    """Traces by :class:`TraceKey`, least recently used out first."""

    def __init__(self, size: int = CACHE_SIZE) -> None:
        self.size = size
        self._d: OrderedDict[TraceKey, Trace] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, model: ModelSpec, plan: Plan, workload: Workload, target: TraceDevice) -> Trace:
        key = TraceKey.of(plan, model, workload, target)
        if key in self._d:
            self.hits += 1
            self._d.move_to_end(key)
            return self._d[key]
        self.misses += 1
        tr = run_trace(model, plan, workload, target)
        self._d[key] = tr
        if len(self._d) > self.size:
            self._d.popitem(last=False)
        return tr


# -- from a trace to a rank's anatomy ----------------------------------------------------
@dataclass(frozen=True)
class RankMemory:
    components: dict[str, int]
    phase: str
    event: int


def steady_window(trace: Trace) -> tuple[int, int]:
    """Event range of the last traced step (states exist from its first event on)."""
    start = next((i for i, ph, st in trace.marks if st == 1 and ph == "forward"), 0)
    return start, len(trace.log) - 1


def rank_memory(trace: Trace, plan: Plan, ctx: Target) -> RankMemory:
    """Per-rank components at the moment that peaks once states are sharded as the engine shards them.

    Weights, gradients and optimizer states are replaced by ``costs.shard_states`` of the
    engine's state layout (``costs.state_bytes``; the trace's own module states where
    the module *is* the layout: plain torch), gradients alive at an event scale with the
    share the engine keeps, and the engine's buckets join ``temporary``.
    """
    model, cluster = ctx.model, ctx.cluster
    world = cluster.world_size
    sharded = plan.engine != "torch"
    if not sharded and world == 1:
        return RankMemory(dict(trace.peak_components), trace.peak_phase, -1)

    sb = costs.state_bytes(model, plan)
    L = model.num_layers
    c = 4 if costs.compute_dtype(plan) == "fp32" else 2
    layer_weights = costs.block_weight_bytes(model, plan, c)
    layer_trainable = (sb.trainable_weights / sb.param_elem_bytes) / L
    st = costs.shard_states(plan, model, cluster, sb, layer_weights, layer_trainable, 0.0)
    # the share of the traced gradient bytes alive at an event, in the engine's sharded bytes,
    # and the whole ones ZeRO or FSDP hold beside a block's backward (costs.held_grads)
    grad_share = st.gradients / trace.grad_bytes if trace.grad_bytes else 0.0
    held = costs.held_grads(plan, model, sb)
    # the traced step's optimizer temporaries are the module optimizer's; an engine's own
    # step adds what shard_states says
    start, end = steady_window(trace)
    marks = sorted((i, ph) for i, ph, st_ in trace.marks)
    live: dict[int, int] = {}
    comp = dict.fromkeys(TENSOR_COMPONENTS, 0)
    best, best_event, best_phase = None, -1, ""
    mi, phase = 0, "setup"
    for ev, (key, delta) in enumerate(trace.log):
        while mi < len(marks) and marks[mi][0] <= ev:
            if marks[mi][1] != "setup":  # between two phases: still the last one's moment
                phase = marks[mi][1]
            mi += 1
        kind = trace.kinds[key]
        if delta > 0:
            live[key] = delta
            comp[kind] += delta
        elif key in live:
            comp[kind] -= live.pop(key)
        if ev < start:
            continue
        weights = st.weights if sharded else comp["weights"]
        if phase == "optimizer" and sharded:
            cand = {
                "weights": weights,
                "gradients": st.gradients,
                "optimizer": st.optimizer,
                "activations": 0,
                "temporary": st.comm_buffers + st.step_temporary,
                "logits": 0,
            }
        else:
            cand = {
                "weights": weights,
                # (ZeRO-3's flat partition is there from setup: grad_accum_present)
                "gradients": max(comp["gradients"] * grad_share, st.grad_accum_present)
                + (held if phase == "backward" else 0)
                if sharded
                else comp["gradients"],
                "optimizer": st.optimizer if sharded else comp["optimizer"],
                "activations": comp["activations"],
                "temporary": comp["temporary"] + st.comm_buffers + st.gather_peak,
                "logits": comp["logits"],
            }
        total = sum(cand.values())
        if best is None or total > sum(best.values()):
            best, best_event, best_phase = cand, ev, phase
    return RankMemory({k: int(v) for k, v in (best or {}).items()}, best_phase, best_event)


def anatomy(trace: Trace, plan: Plan, ctx: Target, alloc: AllocatorConfig | None = None) -> tuple[MemoryAnatomy, str]:
    """The rank's anatomy: the traced components at the peak, and on a CUDA target the cuBLAS
    workspaces and the caching allocator's pool replayed from the trace (:func:`reserved`)."""
    rm = rank_memory(trace, plan, ctx)
    comp = {k: rm.components.get(k, 0) for k in TENSOR_COMPONENTS}
    # the ring attention's buffers, which the traced local step has not (evaluators.context)
    comp["temporary"] += int(context.ring_transient(ctx.model, plan, trace.tokens))
    host = trace.offloaded  # pinned copies of one micro-batch's activations
    if plan.offload is not Offload.NONE:
        sb = costs.state_bytes(ctx.model, plan)
        st = costs.shard_states(plan, ctx.model, ctx.cluster, sb, 0.0, 0.0, 0.0)
        host += st.host
    if ctx.cluster.gpu.kind != "cuda":
        # judged as on a CUDA device whatever the target (the CPU target too): what the
        # simulator has always done; the analytic evaluator passes the target's kind
        return costs.on_device(comp, ctx.cluster, host, "cuda"), rm.phase
    workspaces = costs.cublas_workspaces(ctx.cluster.gpu.compute_capability)
    comp["temporary"] += sum(workspaces)  # counted by max_memory_allocated (costs.cublas_workspace_bytes)
    allocated = sum(comp.values())
    pool = reserved(trace, workspaces, allocated, ctx, alloc or AllocatorConfig())
    return costs.on_device(comp, ctx.cluster, host, "cuda", reserved=pool), rm.phase


def reserved(trace: Trace, workspaces: tuple[int, ...], allocated: int, ctx: Target, config: AllocatorConfig) -> int:
    """``max_memory_reserved`` of the rank: the trace's allocations and frees replayed through
    the model of PyTorch's caching allocator (``allocator.replay``), the workspaces first.

    A plain rank is the traced process: its replay is its pool. A sharded rank holds other
    state sizes than the traced module, so it keeps the replay's gap between reserved and
    allocated (the cache that activations and temporaries leave) over its own allocated
    bytes. When the unconstrained pool would not fit the budget, the log is replayed again
    under it, as the allocator frees its cache and retries before it raises (malloc's
    ``release_cached_blocks`` fallback): a plan that fits only that way fits.
    """
    rep = _replay(trace, workspaces, config, None)
    pool = allocated + max(0, rep.peak_reserved - rep.peak_allocated)
    room = ctx.budget_bytes - costs.device_total(0, ctx.cluster.world_size)
    if pool > room >= allocated and rep.peak_allocated == allocated:
        tight = _replay(trace, workspaces, config, room)
        if tight.oom is None:
            pool = tight.peak_reserved
    return pool


def _replay(trace: Trace, workspaces: tuple[int, ...], config: AllocatorConfig, capacity: int | None) -> Replay:
    key = (workspaces, config, capacity)
    cached = trace.replays.get(key)
    if cached is None:
        log = itertools.chain(((-1 - i, w) for i, w in enumerate(workspaces)), trace.log)
        cached = trace.replays[key] = replay(log, config, capacity)
    return cached


def step_work(trace: Trace, plan: Plan, ctx: Target) -> timing.StepWork:
    """The traced step's ops as ``timing.StepWork``, with the engine's collectives and host
    traffic (``costs.transfer_work``), which one traced process does not issue."""
    cluster, model = ctx.cluster, ctx.model
    n = trace.micro_batches
    optimizer = trace.ops.work("optimizer")
    if plan.offload is not Offload.NONE:
        optimizer = timing.PhaseWork()  # the CPU steps the states (transfer_work's host terms)
    elif plan.engine != "torch":  # every rank steps its shard
        dp = cluster.world_size
        optimizer = timing.PhaseWork(
            gemms=optimizer.gemms, memory_bytes=optimizer.memory_bytes / dp, kernels=optimizer.kernels
        )
    forward, backward = trace.ops.work("forward", n), trace.ops.work("backward", n)
    flops_micro = (trace.ops.flops("forward") + trace.ops.flops("backward")) / n
    cp = plan.context_parallel
    if cp > 1:  # the local step's queries met s/cp keys; a rank's meet all s (evaluators.context)
        flops_micro += (cp - 1) * (forward.attention + backward.attention)
        forward = replace(forward, attention=forward.attention * cp)
        backward = replace(backward, attention=backward.attention * cp)
    transfers = costs.transfer_work(plan, model, cluster, costs.state_bytes(model, plan), trace.offloaded)
    recomputed = sum(checkpointed_layers(plan, model.num_layers)) / model.num_layers
    return timing.StepWork(
        dtype=costs.compute_dtype(plan),
        attention_kernel=trace.ops.attention_kernel(),
        forward=forward,
        backward=backward,
        optimizer=optimizer,
        micro_batches=plan.grad_accum,
        transfers=context.with_ring(transfers, model, plan, trace.tokens, recomputed),
        model_flops=plan.grad_accum * flops_micro,
    )


def throughput(trace: Trace, plan: Plan, ctx: Target) -> Throughput:
    """The traced step's work (:func:`step_work`) priced by ``timing.step_time``."""
    return timing.throughput(step_work(trace, plan, ctx), ctx.cluster, ctx.workload.tokens_per_step())


# -- the evaluator -------------------------------------------------------------------------
_SHARED_CACHE = TraceCache()


class SimulatedEvaluator(Evaluator):
    """Memory from a traced real step under fake tensors; time from a roofline over its ops."""

    name = "simulated"

    def __init__(self, cache: TraceCache | None = None) -> None:
        self.cache = cache if cache is not None else _SHARED_CACHE

    def evaluate(self, plan: Plan, ctx: Target, on_step: StepCallback | None = None) -> TrialResult:
        t0 = time.perf_counter()
        target = TraceDevice.of(ctx.cluster.gpu)
        alloc = AllocatorConfig.from_env()  # PYTORCH_CUDA_ALLOC_CONF: a bad value is the user's error, raised
        hits = self.cache.hits
        try:
            # a context-parallel rank: the step on its rows of s/cp tokens (evaluators.context)
            local = context.local_workload(plan, ctx.workload)
            trace = self.cache.get(ctx.model, plan.replace(context_parallel=1), local, target)
            mem, phase = anatomy(trace, plan, ctx, alloc)
            tput = throughput(trace, plan, ctx)
        except Exception as exc:  # noqa: BLE001 - a plan that cannot be traced is a failed trial
            return self.failed(plan, ctx, _last_line(exc), t0)
        margin = costs.fit_margin(self.name, ctx.cluster.gpu.kind)
        status, reason = judge(mem, ctx)
        return TrialResult(
            plan=plan,
            status=status,
            evaluator=self.name,
            memory=mem,
            throughput=tput,
            capacity_bytes=ctx.capacity_bytes,
            reason=reason,
            duration_s=time.perf_counter() - t0,
            extra={
                "peak_phase": phase,
                "time_error": timing.time_error(self.name),
                "trace_s": round(trace.seconds, 3),
                "trace_reused": self.cache.hits > hits,
                "timings": {k: _rounded(v) for k, v in trace.timings.items()},
                "target_kernels": f"{target.kind}"
                + (f" sm{target.capability[0]}{target.capability[1]}" if target.kind == "cuda" else ""),
                **costs.fit_margin_extra(margin, mem, ctx.budget_bytes),
                **model_notes(ctx.model, plan),
                **context.note(plan, ctx.workload),
                **({"allocator_conf": alloc.describe()} if ctx.cluster.gpu.kind == "cuda" else {}),
            },
        )


def _rounded(v: Any) -> Any:
    if isinstance(v, float):
        return round(v, 2)
    if isinstance(v, list):
        return [_rounded(x) for x in v]
    return v


def _last_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[-1].strip() if text else ""
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__

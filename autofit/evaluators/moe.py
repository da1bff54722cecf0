"""Mixture-of-experts blocks under fake tensors: the routing assumption and the grouped GEMM.

transformers 5 runs a sparse MoE block's experts with ``grouped_mm_experts_forward``
(``transformers/integrations/moe.py``, the default ``experts_implementation``): the router's
top-k picks ``k`` experts per token, the ``tokens × k`` (token, expert) pairs are sorted by
expert, and two ``torch._grouped_mm`` calls (gate/up, then down) run every expert's rows in
one kernel, the groups delimited by the cumulative rows per expert (``offs``). Every tensor
it makes has ``tokens × k`` rows whatever the router chose (transformers drops no token:
there is no capacity limit), so memory does not depend on the routing, and the trace sees
the real step's tensors. What the routing decides is how the ``tokens × k`` rows split over
the experts, which fake tensors cannot know (``offs`` has no values).

The routing assumption (``specs.models.ROUTING``): balanced top-k, capacity factor 1. Each expert gets
``tokens × k / experts`` rows, which is what the grouped GEMMs are priced at (their FLOPs do
not depend on the split; the per-expert GEMM's size, and so its efficiency, does). An
unbalanced router makes some groups larger and others smaller: the same FLOPs in GEMMs of
mixed sizes, and, on a GPU that runs the groups one after another, time bounded by
neither. Results state it (``TrialResult.extra["routing"]``, ``ModelSpec.routing_assumption``).

``torch._grouped_mm``'s meta function (``torch/_meta_registrations.py``,
``_meta_grouped_mm_common``) accepts bf16 only, the fast CUTLASS path's dtype. The CUDA op
itself runs other dtypes through ``_grouped_mm_fallback`` (a loop of ``mm`` into slices of
one output, aten/src/ATen/native/cuda/GroupedBlas.cpp), and the CPU op runs every dtype. A
trace of an fp32 or fp16 expert GEMM (fp32 master weights under autocast, which does not
cover the op: transformers casts the input to the weight's dtype) therefore allocates the
op's output here, with the shape the meta function gives bf16 operands.
"""

from __future__ import annotations

from typing import Any


def _result_shape(a: Any, b: Any, offs: Any) -> tuple[int, ...]:
    """``_grouped_mm``'s output shape (``_meta_grouped_mm_common``'s ``out_size``) for the two uses
    transformers makes of it (:func:`fake_decompositions` takes no other)."""
    if b.dim() == 2:  # the weight gradient: (K, rows) · (rows, N) per group
        return (offs.shape[0], a.shape[0], b.shape[1])
    return (a.shape[0], b.shape[-1])  # the forward and the input gradient: (rows, K) · (E, K, N)


def _grouped_mm_any_dtype(a, b, offs=None, bias=None, out_dtype=None):
    import torch

    return torch.empty(_result_shape(a, b, offs), dtype=out_dtype or a.dtype, device=a.device)


def fake_decompositions() -> dict:
    """Ops a tracker runs in place of their fake kernels (``memtrack.StorageTracker``): the grouped
    GEMM in a dtype its meta function refuses, in the shapes transformers calls it with (a 2-D
    input, offsets given); any other call meets the meta function as it is."""
    import torch

    def when(a, b, offs=None, *args, **kwargs) -> bool:
        ours = a.dim() == 2 and b.dim() in (2, 3) and offs is not None
        return ours and not (a.dtype is torch.bfloat16 and b.dtype is torch.bfloat16)

    return {torch.ops.aten._grouped_mm.default: (when, _grouped_mm_any_dtype)}


def grouped_mm_flops(args: tuple, out: Any) -> float:
    """2·M·K·N over all groups: every one of the ``tokens × k`` rows meets one expert's matrix."""
    a, b = args[0], args[1]
    if a.dim() == 2 and b.dim() == 2:  # the weight gradient: (K, rows) · (rows, N)
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    rows = a.numel() // a.shape[-1]
    return 2.0 * rows * a.shape[-1] * out.shape[-1]


def grouped_mm_dim(args: tuple) -> float:
    """The smallest of one group's m, k, n under the balanced routing (``specs.models.ROUTING``)."""
    a, b, offs = args[0], args[1], args[2] if len(args) > 2 else None
    groups = max(offs.shape[0] if offs is not None else b.shape[0], 1)
    if a.dim() == 2 and b.dim() == 2:
        return float(min(a.shape[0], a.shape[1] / groups, b.shape[1]))
    return float(min(a.shape[0] / groups, a.shape[-1], b.shape[-1]))

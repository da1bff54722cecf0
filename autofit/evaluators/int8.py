"""bitsandbytes' LLM.int8 matmul as it runs on a CUDA GPU, for the simulator's fake CPU tensors.

A ``lora-8bit`` plan's frozen Linears are bitsandbytes ``Linear8bitLt`` layers (int8 weight,
one fp32 absmax per output row). Which autograd Function their forward runs depends on the
device (``bitsandbytes.autograd._functions.matmul``): in training on the CPU it is
``MatMul8bitFp`` (dequantize the weight, plain linear, save the input), which the CPU
measured runs and the CPU simulation run as they are; on CUDA it is ``MatMul8bitLt``. The
simulator traces a CUDA target on fake *CPU* tensors (docs/EVALUATORS.md), so
:func:`cuda_matmul` routes ``bnb.matmul`` to ``MatMul8bitLt`` for a lora-8bit step, and
:func:`cuda_decompositions` gives the tracker the Python each of its ops runs on CUDA in
place of their fake kernels, so their temporaries are seen:

- ``int8_vectorwise_quant`` (``backends/cuda/ops.py``): the input (cast to fp16 by
  ``MatMul8bitLt``) quantized row-wise to int8 with an fp32 absmax per row; with a
  threshold, ``A.abs() >= threshold`` (an fp16 and a bool temporary) finds the outlier
  columns, zeroed in the int8 copy.
- ``int8_mixed_scaled_mm`` and ``int8_scaled_mm`` (``backends/default/ops.py``, which CUDA
  uses): the outlier columns of the input kept in 16-bit (``subA``, saved for backward) and
  the weight's columns dequantized beside them; the int8 GEMM into an **int32** output
  (``int8_linear_matmul``), dequantized to **fp16** (``int8_mm_dequant``: the CUDA kernel
  writes fp16 only, then casts to the input's dtype), plus the outlier product.

The backward (``MatMul8bitLt.backward``, frozen weight) dequantizes the whole weight to
the input's dtype for ``grad_A``: plain aten ops the tracker sees anyway.

Routing assumption: which columns hold an outlier depends on the data, which fake tensors
do not have. The simulator takes ``costs.INT8_OUTLIER_FRACTION`` of the input columns. LLM.int8
(Dettmers et al. 2022, section 4.1) finds the systematic outliers of 6.7B-13B models in
about 6 of 4,096 feature dimensions (0.15%); 1% is several times that, and they cost only
``subA`` and the outlier GEMM (tokens × 1% of the columns).

Imports torch at module level.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from autofit.evaluators.costs import int8_outlier_columns


@contextlib.contextmanager
def cuda_matmul(enabled: bool = True) -> Iterator[None]:
    """``bnb.matmul`` as on a CUDA device in training: ``MatMul8bitLt`` (the CPU takes
    ``MatMul8bitFp``). ``Linear8bitLt.forward`` looks ``bnb.matmul`` up at each call.
    ``enabled=False``: nothing changes (a trace that is not lora-8bit on CUDA).

    And peft's ``lora.bnb.Linear8bitLt`` asks ``torch.is_autocast_enabled()``, which without
    a device means CUDA: under CUDA autocast it leaves the adapters' input as it is, else it
    casts it to the adapters' fp32. The trace's CPU autocast stands in for CUDA's, so that
    question is answered by the CPU's state here."""
    if not enabled:
        yield
        return
    import bitsandbytes as bnb
    from bitsandbytes.autograd._functions import MatMul8bitLt, MatmulLtState

    def matmul(A, B, out=None, state=None, threshold=0.0, bias=None):
        state = state or MatmulLtState()
        if threshold > 0.0:
            state.threshold = threshold
        return MatMul8bitLt.apply(A, B, out, bias, state)

    autocast_enabled = torch.is_autocast_enabled

    def is_autocast_enabled(device_type=None):
        return autocast_enabled("cpu" if device_type in (None, "cuda") else device_type)

    original = bnb.matmul
    bnb.matmul, torch.is_autocast_enabled = matmul, is_autocast_enabled
    try:
        yield
    finally:
        bnb.matmul, torch.is_autocast_enabled = original, autocast_enabled


def _vectorwise_quant(A: torch.Tensor, threshold: float = 0.0):
    # backends/cuda/ops.py, int8_vectorwise_quant (the kernel writes out_row and row_stats)
    rows = A.numel() // A.shape[-1]
    row_stats = torch.empty(rows, device=A.device, dtype=torch.float32)
    out_row = torch.empty(A.shape, device=A.device, dtype=torch.int8)
    outlier_cols = None
    if threshold > 0.0:
        # the outlier mask and its column reduction (argwhere reads data: the count is assumed)
        outliers = A.abs() >= threshold
        outliers.any(dim=0)
        del outliers
        outlier_cols = torch.empty(int8_outlier_columns(A.shape[-1]), device=A.device, dtype=torch.int64)
        if rows > 1:
            out_row[:, outlier_cols] = 0
    return out_row, row_stats, outlier_cols


def _mm_dequant(A, row_stats, col_stats, dtype=None, bias=None):
    # backends/cuda/ops.py, int8_mm_dequant: fp16 out, bias added where not fp16, then cast
    out = torch.empty_like(A, dtype=torch.float16)
    if bias is not None and bias.dtype != torch.float16:
        out.add_(bias)
    return out.to(dtype or torch.float16)


def _scaled_mm(A, B, row_stats, col_stats, bias=None, dtype=None):
    # backends/default/ops.py, int8_scaled_mm
    out_i32 = torch.ops.bitsandbytes.int8_linear_matmul.default(A, B)
    return torch.ops.bitsandbytes.int8_mm_dequant.default(
        out_i32, row_stats, col_stats, dtype=dtype or torch.float16, bias=bias
    )


def _mixed_scaled_mm(A, CA, CB, SCA, SCB, outlier_cols=None, bias=None):
    # backends/default/ops.py, int8_mixed_scaled_mm
    subB = None
    if outlier_cols is not None and outlier_cols.numel():
        subA = A[:, outlier_cols].contiguous()
        subB = (
            torch.ops.bitsandbytes.int8_vectorwise_dequant.default(CB[:, outlier_cols].contiguous(), SCB)
            .to(A.dtype)
            .t()
        )
    else:
        subA = torch.empty(0, device=A.device, dtype=A.dtype)
    output = torch.ops.bitsandbytes.int8_scaled_mm.default(CA, CB, SCA, SCB, bias=bias, dtype=A.dtype)
    if subB is not None:
        output = output.addmm(subA, subB)
    return output, subA


def cuda_decompositions() -> dict:
    """``{op: (when, impl)}`` for ``StorageTracker``: LLM.int8's ops as CUDA runs them."""
    ops = torch.ops.bitsandbytes

    def always(*args, **kwargs) -> bool:
        return True

    return {
        ops.int8_vectorwise_quant.default: (always, _vectorwise_quant),
        ops.int8_mm_dequant.default: (always, _mm_dequant),
        ops.int8_scaled_mm.default: (always, _scaled_mm),
        ops.int8_mixed_scaled_mm.default: (always, _mixed_scaled_mm),
    }

"""Liger's fused RMSNorm, SwiGLU and RoPE, as autofit runs them where Liger's Triton kernels
cannot run: on the CPU and on the simulator's fake tensors.

Liger (``liger_kernel.ops``) wraps each Triton kernel in an ``autograd.Function``; what the
memory model needs is what that Function saves for backward and what each kernel reads,
writes and allocates. Each stand-in here is the same ``autograd.Function`` around one
``torch.library`` custom op per Triton kernel, so the simulator's tracer sees one kernel
moving the bytes the Triton kernel moves, and the tracker sees the tensors it allocates:

- RMSNorm (``LigerRMSNormFunction``, ``ops/rms_norm.py``, casting mode "llama"): the forward
  writes ``Y`` (the input's dtype) and one fp32 ``RSTD`` per row, and saves the input ``X``,
  the weight and ``RSTD``; the backward writes ``dX`` into ``dY`` (``in_place=True``, the
  default of ``_patch_rms_norm_module``) and ``dW`` through an fp32 partial buffer that it
  sums (``_dW.sum(dim=0)``; one row here, one per SM on a GPU).
- SwiGLU (``LigerSiLUMulFunction``, ``ops/swiglu.py``): ``c = silu(a) * b`` saving ``a`` and
  ``b`` only (silu is recomputed in backward), whose gradients the backward kernel writes
  into ``a`` and ``b`` themselves.
- RoPE (``LigerRopeFunction``, ``ops/rope.py``): q and k are rotated in place (transposed
  back to their physical (batch, seq, heads, dim) layout, contiguous after transformers'
  projection), saving ``cos`` and ``sin``; the backward rotates the gradients in place
  the other way.

:func:`apply` patches a model the way ``_apply_liger_kernel_to_instance`` does (the
Trainer's ``use_liger_kernel``): the forward of every decoder layer's two norms, of the
final norm and of every MLP. RoPE is the modeling module's ``apply_rotary_pos_emb``, which
Liger replaces process-wide; :func:`rope` replaces it only inside (``StepRunner`` enters it
for a whole step, so a checkpoint's recompute rotates as its forward did), because the
simulator traces plans with and without it in one process. Qwen3's per-head q/k norms
stay transformers' own (Liger's instance patch leaves them).

Imports torch at module level; nothing from autofit.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator

import torch
from torch import Tensor


# -- the kernels ---------------------------------------------------------------------------
@torch.library.custom_op("autofit::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd(x: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    return ((xf * rstd[:, None]).to(x.dtype) * w).to(x.dtype), rstd


@_rms_norm_fwd.register_fake
def _(x, w, eps):
    return torch.empty_like(x), x.new_empty(x.shape[0], dtype=torch.float32)


@torch.library.custom_op("autofit::rms_norm_bwd_", mutates_args=("dy", "dw"))
def _rms_norm_bwd_(dy: Tensor, dw: Tensor, x: Tensor, w: Tensor, rstd: Tensor) -> None:
    xhat = x.float() * rstd[:, None]
    g = dy.float() * w.float()
    dw.copy_((dy.float() * xhat).sum(0, keepdim=True))
    dy.copy_(rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True)))


@_rms_norm_bwd_.register_fake
def _(dy, dw, x, w, rstd):
    return None


@torch.library.custom_op("autofit::swiglu_fwd", mutates_args=())
def _swiglu_fwd(a: Tensor, b: Tensor) -> Tensor:
    af = a.float()
    return (af * torch.sigmoid(af)).to(b.dtype) * b


@_swiglu_fwd.register_fake
def _(a, b):
    return torch.empty_like(a)


@torch.library.custom_op("autofit::swiglu_bwd_", mutates_args=("a", "b"))
def _swiglu_bwd_(dc: Tensor, a: Tensor, b: Tensor) -> None:
    af, bf, dcf = a.float(), b.float(), dc.float()
    sig = torch.sigmoid(af)
    silu = af * sig
    a.copy_(dcf * (silu * (1 - sig) + sig) * bf)
    b.copy_(dcf * silu)


@_swiglu_bwd_.register_fake
def _(dc, a, b):
    return None


@torch.library.custom_op("autofit::rope_", mutates_args=("q", "k"))
def _rope_(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> None:
    # q, k: (batch, seq, heads, dim); cos, sin: (batch or 1, seq, dim)
    c, s = cos[:, :, None, :].float(), sin[:, :, None, :].float()
    if backward:
        s = -s
    for t in (q, k):
        tf = t.float()
        half = t.shape[-1] // 2
        rotated = torch.cat((-tf[..., half:], tf[..., :half]), dim=-1)
        t.copy_(tf * c + rotated * s)


@_rope_.register_fake
def _(q, k, cos, sin, backward):
    return None


# -- the autograd Functions (Liger's, around the kernels above) ------------------------------
class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, eps: float) -> Tensor:
        shape = x.shape
        x2 = x.contiguous().view(-1, shape[-1])
        y, rstd = _rms_norm_fwd(x2, w, eps)
        ctx.save_for_backward(x2, w, rstd)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x2, w, rstd = ctx.saved_tensors
        shape = dy.shape
        dy2 = dy.contiguous().view(-1, shape[-1])
        dw = torch.empty((1, w.shape[0]), dtype=torch.float32, device=w.device)
        _rms_norm_bwd_(dy2, dw, x2, w, rstd)
        return dy2.view(shape), dw.sum(0).to(w.dtype), None


class SiLUMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor) -> Tensor:
        a, b = a.contiguous(), b.contiguous()
        ctx.save_for_backward(a, b)
        return _swiglu_fwd(a, b)

    @staticmethod
    def backward(ctx, dc: Tensor):
        a, b = ctx.saved_tensors
        _swiglu_bwd_(dc.contiguous(), a, b)
        return a, b


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        _rope_(q, k, cos, sin, False)
        ctx.save_for_backward(cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2)

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor):
        cos, sin = ctx.saved_tensors
        dq, dk = dq.transpose(1, 2).contiguous(), dk.transpose(1, 2).contiguous()
        _rope_(dq, dk, cos, sin, True)
        return dq.transpose(1, 2), dk.transpose(1, 2), None, None


# -- patching a model ------------------------------------------------------------------------
def _norm_forward(self, hidden_states: Tensor) -> Tensor:
    return RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x: Tensor) -> Tensor:
    return self.down_proj(SiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))


def rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids=None, unsqueeze_dim: int = 1):
    """Liger's ``liger_rotary_pos_emb``: transformers' ``apply_rotary_pos_emb`` signature."""
    return RopeFunction.apply(q, k, cos, sin)


def _layers(model: torch.nn.Module) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """The decoder body (``model.model`` of a ``*ForCausalLM``) and its layers, through peft."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = getattr(base, base.base_model_prefix, base)
    return body, list(body.layers)


def apply(model: torch.nn.Module) -> None:
    """Patch the norms and MLPs of ``model`` (a llama-like causal LM) in place."""
    body, layers = _layers(model)
    norms = [body.norm] + [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    for norm in norms:
        norm.forward = types.MethodType(_norm_forward, norm)
    for layer in layers:
        layer.mlp.forward = types.MethodType(_mlp_forward, layer.mlp)


@contextlib.contextmanager
def rope(model: torch.nn.Module) -> Iterator[None]:
    """Liger's RoPE in place of the modeling module's ``apply_rotary_pos_emb`` while inside."""
    _, layers = _layers(model)
    module = sys.modules[type(layers[0].self_attn).__module__]
    original = module.apply_rotary_pos_emb
    module.apply_rotary_pos_emb = rotary_pos_emb
    try:
        yield
    finally:
        module.apply_rotary_pos_emb = original

"""torch's ring attention on CPU ranks: what lets the measured child run context parallelism here.

Under ``context_parallel`` (what accelerate's ``maybe_context_parallel`` enters) torch wraps each
``F.scaled_dot_product_attention`` call's query, key and value as DTensors sharded along the
sequence, and DTensor's dispatcher sends the SDPA kernel to a ring handler
(``torch/distributed/tensor/experimental/_context_parallel/_attention.py``: ``custom_ops``,
``_sdpa_handler``). torch 2.13 registers handlers for the CUDA flash, efficient and cuDNN kernels
only; on the CPU the kernel is ``aten._scaled_dot_product_flash_attention_for_cpu``, which DTensor
has no sharding strategy for (docs/FIELD-NOTES.md, 2026-12-05).

:func:`register` adds a handler for that kernel and its backward to torch's table, before
``context_parallel`` copies the table into the dispatcher. It does what torch's CUDA handlers do:
the local shards go through the same ring functions (``_templated_ring_attention`` and its
backward, with the rotater and load balancing ``context_parallel`` set up), the CPU kernel
standing for the CUDA one, and the results come back sharded as their inputs were. Only the kernel
differs from what a GPU rank runs: the ring's buffers and exchanges are torch's own.

Imports torch at module level; nothing from autofit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_global_tensor_info
from torch.distributed.tensor.experimental._context_parallel import _attention

_aten = torch.ops.aten
FORWARD = _aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_SEQ_DIM = 2  # (batch, heads, sequence, head dim), as torch's CUDA handlers hard-code it


_within: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
calls = {"forward": 0, "backward": 0}  # ring calls in this process, for the record


def register(within: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
    """Add the CPU kernel's ring handlers to torch's context-parallel table (idempotent). The table
    is read when ``context_parallel`` is entered, so this must come before. ``within``: a context
    each ring call runs in (the measured child's storage tracker, ``StorageTracker.again``: a
    dispatch mode does not see what DTensor's handlers allocate beneath it)."""
    global _within
    _within = within or contextlib.nullcontext
    _attention.custom_ops[FORWARD] = _handler
    _attention.custom_ops[BACKWARD] = _handler


def _named(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict:
    """The op's arguments by their schema names."""
    names = [a.name for a in op._schema.arguments]
    return {**dict(zip(names, args)), **kwargs}


def _sharded(local: torch.Tensor, like: DTensorSpec) -> DTensor:
    """``local``, a shard along the sequence on ``like``'s mesh, as a DTensor."""
    placements = (Shard(_SEQ_DIM),)
    shape, stride = compute_global_tensor_info(local, like.mesh, placements)
    meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    return DTensor(local, DTensorSpec(like.mesh, placements, tensor_meta=meta), requires_grad=local.requires_grad)


def _handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object:
    info = DTensor._op_dispatcher.unwrap_to_op_info(op, args, kwargs)
    spec = next(a._spec for a in args if isinstance(a, DTensor))
    if any(p != Shard(_SEQ_DIM) for p in spec.placements) or spec.mesh.ndim != 1:
        raise NotImplementedError(f"ring attention on the CPU takes a 1-D mesh sharded on dim {_SEQ_DIM}: {spec}")
    group = spec.mesh.get_group()
    named = _named(op, info.local_args, info.local_kwargs)
    is_causal = named.pop("is_causal", False)
    calls["forward" if op is FORWARD else "backward"] += 1
    with _within():
        if op is FORWARD:
            q, k, v = (named.pop(n) for n in ("query", "key", "value"))
            local = _attention._templated_ring_attention(group, _SEQ_DIM, op, q, k, v, is_causal=is_causal, **named)
        else:
            grad_out = named.pop("grad_out")
            q, k, v, out, lse = (named.pop(n) for n in ("query", "key", "value", "out", "logsumexp"))
            local = _attention._templated_ring_attention_backward(
                group, _SEQ_DIM, op, grad_out, "grad_out", q, k, v, out, lse, is_causal=is_causal, **named
            )
    return tuple(_sharded(t, spec) for t in local)

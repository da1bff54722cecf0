"""Run by test_context.py under torchrun: autofit's CPU ring handler (evaluators/ring.py) inside
torch's own ``context_parallel``, against attention over the whole sequence on one rank.

Every rank computes the whole-sequence SDPA (causal, grouped keys as transformers passes them) and
its gradients; then, with the query, keys, values and output gradient sharded by
``context_parallel`` (round-robin load balancing, accelerate's all-gather rotation), the same call
runs through the ring. Rank 0 prints one JSON line: per dtype, the largest absolute difference of
the output and of each gradient, gathered back into sequence order.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import context_parallel_unshard, set_rotate_method

from autofit.evaluators import ring


def _errors(mesh, dtype: torch.dtype) -> list[float]:
    g = torch.Generator().manual_seed(0)  # the same rows on every rank
    heads, kv_heads, tokens, width = 4, 2, 64, 16
    q, go = (torch.randn(2, heads, tokens, width, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(2, kv_heads, tokens, width, generator=g, dtype=dtype) for _ in range(2))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*whole, is_causal=True, enable_gqa=True)
    out.backward(go)
    buffers = [q.clone(), k.clone(), v.clone(), go.clone()]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * 4, no_restore_buffers=set(buffers)):
        leaves = [t.requires_grad_() for t in buffers[:3]]
        local = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        local.backward(buffers[3])
    mine = [local.detach()] + [t.grad for t in leaves]
    gathered = context_parallel_unshard(mesh, mine, [2] * 4)
    expected = [out.detach()] + [t.grad for t in whole]
    return [float((a.float() - b.float()).abs().max()) for a, b in zip(gathered, expected, strict=True)]


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    set_rotate_method("allgather")  # accelerate's default cp_comm_strategy
    ring.register()
    result = {name: _errors(mesh, getattr(torch, name)) for name in ("float32", "bfloat16")}
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
    dist.barrier()
    os._exit(0)  # gloo's threads can abort the interpreter's exit (ring_probe.py)


if __name__ == "__main__":
    main()

"""Run by test_context.py under torchrun: torch's own ring attention on CPU ranks (gloo).

torch's context-parallel dispatcher has no handler for the CPU SDPA kernel, but its ring
functions take the kernel as an argument: here they run with
``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, and a
:class:`StorageTracker` measures the bytes each call holds beyond the same kernel on the
rank's local chunk alone. Rank 0 prints one JSON line: per dtype, every rank's
(forward, backward) excess and the element counts.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental._context_parallel._attention import (
    _templated_ring_attention,
    _templated_ring_attention_backward,
)

from autofit.evaluators.memtrack import StorageTracker

FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _peak(fn):
    tracker = StorageTracker()
    with tracker:
        out = fn()
    live = peak = 0
    for _, delta in tracker.log:
        live += delta
        peak = max(peak, live)
    return peak, out


def _excess(dtype: torch.dtype, tokens: int) -> tuple[int, int]:
    g = torch.Generator().manual_seed(dist.get_rank())
    q, k, v = (torch.randn(1, 4, tokens, 32, generator=g, dtype=dtype) for _ in range(3))
    group = dist.group.WORLD
    local_f, (out_l, lse_l) = _peak(lambda: FWD(q, k, v, is_causal=True))
    ring_f, (out, lse) = _peak(lambda: _templated_ring_attention(group, 2, FWD, q, k, v, is_causal=True))
    grad = torch.randn_like(out)
    local_b, _ = _peak(lambda: BWD(grad, q, k, v, out_l, lse_l, 0.0, True))
    ring_b, _ = _peak(
        lambda: _templated_ring_attention_backward(
            group, 2, BWD, grad, "grad_out", q, k, v, out, lse, is_causal=True, dropout_p=0.0
        )
    )
    return ring_f - local_f, ring_b - local_b


def main() -> None:
    dist.init_process_group("gloo")
    tokens, heads, repeats = 256, 4, 3
    result = {}
    for name in ("bfloat16", "float32"):
        # a buffer's life ends when the collective reading it completes: the worst of a few runs
        runs = [_excess(getattr(torch, name), tokens) for _ in range(repeats)]
        mine = (max(f for f, _ in runs), max(b for _, b in runs))
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        result[name] = {"excess": every, "elements": heads * tokens * 32, "rows": heads * tokens}
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
    dist.barrier()
    # gloo's threads can abort the interpreter's exit ("terminate called without an active
    # exception") after destroy_process_group: the result is out, leave at once
    os._exit(0)


if __name__ == "__main__":
    main()

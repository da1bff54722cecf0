"""The DeepSpeed autotuner's memory rule, shared by the benchmarks that play its fast mode."""

from __future__ import annotations


def instantiation_bytes(n_params: int, stage: int, ranks: int, fp16: bool = False) -> float:
    """DeepSpeed's ``get_instantiation_memory_required_per_gpu``: parameters, gradients and
    Adam states per GPU at a ZeRO stage (fp32 copies unless fp16 is on, which keeps 16-bit
    parameters and gradients and a 16-byte optimizer state)."""
    params, grads, optim = n_params * (2 if fp16 else 4), n_params * (2 if fp16 else 4), n_params * (16 if fp16 else 8)
    if stage >= 1:
        optim /= ranks
    if stage >= 2:
        grads /= ranks
    if stage >= 3:
        params /= ranks
    return params + grads + optim

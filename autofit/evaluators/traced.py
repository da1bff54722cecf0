"""The analytic evaluator's block for a model its formulas do not describe, from one traced block.

A model type no family describes is read from its modules (``specs/derive.py``). Where its
block is one the analytic formulas know, the analytic evaluator itemizes it as any family's;
where it is not (``ModelSpec.analytic_gap``: an unknown norm or activation, norms after the
branches, scaled residuals), the block's saves come from here: a one-layer copy of the model
is built on ``meta`` with the plan applied, swapped to fake tensors, and run forward once at
two sequence lengths under ``saved_tensors_hooks``, counting each distinct storage the first
block saves for backward (parameters and buffers left out), as the simulator traces a step. Two
lengths give the two terms of the analytic block: bytes per token, and bytes per token per
attended position (eager attention's s² scores). The transients around the block, which a
forward census cannot see, are taken at the sizes of a llama block of the same widths.

A trace costs well under a second at any model size (fake tensors hold no memory) and is
cached per plan's block-relevant fields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

from autofit.plan import Attention, Checkpointing, Method, Plan
from autofit.specs import ModelSpec, Workload
from autofit.techniques import dtype_layout

# the two sequence lengths of the census (multiples of every kernel's block size)
LENGTHS = (256, 512)


def block_terms(model: ModelSpec, plan: Plan, cpu: bool, capability: tuple[int, int]) -> tuple[float, float]:
    """``(bytes per token, bytes per token per attended position)`` the first block saves."""
    key = plan.replace(
        micro_batch=1,
        grad_accum=1,
        checkpointing=Checkpointing.NONE,
        checkpoint_every=None,
        checkpoint_ops=False,
        offload_activations=False,
        fused_loss=False,
    )
    return _terms(model, key, cpu, capability)


@functools.lru_cache(maxsize=512)
def _terms(model: ModelSpec, plan: Plan, cpu: bool, capability: tuple[int, int]) -> tuple[float, float]:
    one = _one_layer(model)
    s1, s2 = LENGTHS
    b1, b2 = (_saved(one, plan, s, cpu, capability) for s in LENGTHS)
    quad = max(0.0, (b2 / s2 - b1 / s1) / (s2 - s1))
    return max(0.0, b1 / s1 - quad * s1), quad


# the plans on which a derived block's formulas are checked against its trace (on the CPU's kernels)
REFERENCE = (Plan(precision="bf16-true", micro_batch=1), Plan(precision="32-true", micro_batch=1, attention="eager"))


@functools.lru_cache(maxsize=64)
def formulas_miss(model: ModelSpec) -> str:
    """Why the analytic formulas do not describe a derived model's block ("" where they do).

    ``ModelSpec.analytic_gap`` says what the block's modules show; what they cannot show (a
    causal mask built for every batch, a multiplier on the residual) shows in what the block
    saves: the formulas' bytes for one sequence (the block and the RoPE tables it saves) must be
    within 2% of one traced block's on each reference plan.
    """
    from autofit.evaluators.analytic import _formula_block

    if model.analytic_gap:
        return model.analytic_gap
    s = LENGTHS[0]
    for plan in REFERENCE:
        tok, quad = block_terms(model, plan, True, (8, 0))
        traced = s * (tok + quad * s)
        blk = _formula_block(model, plan, False, True, (8, 0))
        rope = 2 * s * model.rotary_dim * dtype_layout(plan).base_bytes  # as analytic._activations counts it
        itemized = s * (blk.tok + blk.quad * s) + rope
        if abs(itemized / traced - 1) > 0.02:
            return (
                f"its block saves {traced / s:,.0f} bytes a token where the formulas give {itemized / s:,.0f} "
                f"({plan.summary()})"
            )
    return ""


def _one_layer(model: ModelSpec) -> ModelSpec:
    """The model with its first layer only (per-layer lists cut to match, as ``unroll.traced_spec``)."""
    extra = tuple((k, v[:1] if k == "layer_types" and isinstance(v, tuple) else v) for k, v in model.hf_extra)
    return dataclasses.replace(model, num_layers=1, n_params=0, hf_extra=extra)


def _saved(model: ModelSpec, plan: Plan, seq: int, cpu: bool, capability: tuple[int, int]) -> float:
    """Bytes of the distinct storages the first block saves for backward in one fake forward."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autofit.evaluators import moe, simulated, unroll
    from autofit.evaluators import runtime as rt

    flash2 = plan.attention is Attention.FLASH2
    net = rt.build_model(model, plan, device="meta", attn_impl=simulated.register_flash2() if flash2 else None)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    rt.to_fake(net, mode)
    batch = rt.batches_for(model, plan, Workload(seq_len=seq, global_batch=1))[0]
    fake_batch, _ = simulated._fake_batch(batch, mode, flash2)
    block = unroll.decoder_layers(net, model.family.decoder_layer)[0]
    own = {_key(t) for t in rt.state_tensors(net)}
    inside, seen = [False], {}

    def pack(t):
        if inside[0] and _key(t) not in own:
            seen[_key(t)] = t.untyped_storage().nbytes()
        return t

    hooks = [
        block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)),
        block.register_forward_hook(lambda *_: inside.__setitem__(0, False)),
    ]
    kind = "cpu" if cpu else "cuda"
    decompositions = {**rt.bnb_decompositions(kind), **moe.fake_decompositions()}
    tracer = simulated.tracer_class()(last_step=0, attn_flop_scale=1.0, decompositions=decompositions)
    autocast = rt.layout(plan).autocast_dtype
    with contextlib.ExitStack() as stack:
        stack.enter_context(simulated._value_decisions())
        stack.enter_context(mode)
        stack.enter_context(tracer)
        stack.enter_context(rt.int8.cuda_matmul(not cpu and plan.method is Method.LORA_8BIT))
        if autocast is not None:
            stack.enter_context(torch.autocast("cpu", dtype=autocast))
        if not cpu:
            stack.enter_context(simulated.cuda_kernels_mode()(capability))
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        net(**fake_batch, use_cache=False)
    for h in hooks:
        h.remove()
    return float(sum(seen.values()))


def _key(t) -> int:
    """One key per storage, fake or real (a view shares its base's)."""
    return t.untyped_storage()._cdata

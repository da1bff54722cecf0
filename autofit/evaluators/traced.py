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
    return _terms(model, _census_plan(plan), cpu, capability)


def _census_plan(plan: Plan) -> Plan:
    """The plan's fields that change what one block saves (the cache key)."""
    return plan.replace(
        micro_batch=1,
        grad_accum=1,
        checkpointing=Checkpointing.NONE,
        checkpoint_every=None,
        checkpoint_ops=False,
        offload_activations=False,
        fused_loss=False,
    )


@functools.lru_cache(maxsize=512)
def _terms(model: ModelSpec, plan: Plan, cpu: bool, capability: tuple[int, int]) -> tuple[float, float]:
    one = _one_layer(model)
    return _per_token(*(_census(one, plan, s, cpu, capability).saved for s in LENGTHS))


def _per_token(b1: float, b2: float) -> tuple[float, float]:
    """``(per token, per token per attended position)`` of two census values at ``LENGTHS``."""
    s1, s2 = LENGTHS
    quad = max(0.0, (b2 / s2 - b1 / s1) / (s2 - s1))
    return max(0.0, b1 / s1 - quad * s1), quad


@dataclasses.dataclass(frozen=True)
class CompiledWork:
    """A compiled block's kernels per micro-batch, forward and backward: how many it issues
    (fused kernels and library kernels), and the bytes its fused kernels move as
    ``(per token, per token per attended position)`` (``compiled.fused_kernels``); and the most its
    backward graph holds above what it started with, as ``(constant, per token, per token per
    attended position)`` (the constant: the weight gradients it makes)."""

    fwd_kernels: int
    bwd_kernels: int
    fwd_bytes: tuple[float, float]
    bwd_bytes: tuple[float, float]
    bwd_transient: tuple[float, float, float]

    def bytes(self, tokens: float, keys: float) -> tuple[float, float]:
        return tuple(tokens * (tok + quad * keys) for tok, quad in (self.fwd_bytes, self.bwd_bytes))


def compiled_work(model: ModelSpec, plan: Plan, cpu: bool, capability: tuple[int, int]) -> CompiledWork:
    """What the analytic time model needs of a ``torch_compile`` plan's block, from its partitioned
    graphs (the stand-in of ``evaluators.compiled`` on one traced block, as :func:`block_terms`)."""
    return _compiled_work(model, _census_plan(plan), cpu, capability)


@functools.lru_cache(maxsize=256)
def _compiled_work(model: ModelSpec, plan: Plan, cpu: bool, capability: tuple[int, int]) -> CompiledWork:
    from autofit.evaluators import compiled

    one = _one_layer(model)
    runs = [_census(one, plan, s, cpu, capability, backward=True) for s in (*LENGTHS, THIRD)]
    kernels = [[compiled.fused_kernels(g) for g in (r.graphs["forward"][-1], r.graphs["backward"][-1])] for r in runs]
    externs = [compiled.extern_kernels(runs[0].graphs[k][-1]) for k in ("forward", "backward")]
    return CompiledWork(
        fwd_kernels=kernels[0][0].count + externs[0],
        bwd_kernels=kernels[0][1].count + externs[1],
        fwd_bytes=_per_token(kernels[0][0].nbytes, kernels[1][0].nbytes),
        bwd_bytes=_per_token(kernels[0][1].nbytes, kernels[1][1].nbytes),
        bwd_transient=_beside_constant([r.bwd_peak for r in runs]),
    )


# a third census length, where a constant must be told apart from the per-token terms
THIRD = 768


def _beside_constant(values: list[float]) -> tuple[float, float, float]:
    """``(c, t, q)`` of ``c + t·s + q·s²`` through the values at ``LENGTHS`` and ``THIRD``."""
    s1, s2, s3 = (*LENGTHS, THIRD)
    b1, b2, b3 = values
    d21, d32 = (b2 - b1) / (s2 - s1), (b3 - b2) / (s3 - s2)
    q = max(0.0, (d32 - d21) / (s3 - s1))
    t = max(0.0, d21 - q * (s1 + s2))
    return max(0.0, b1 - t * s1 - q * s1 * s1), t, q


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


@dataclasses.dataclass
class _Census:
    saved: float  # bytes of the distinct storages the first block saves for backward
    graphs: dict  # a compiled block's partitioned graphs (``CompiledBlocks.graphs``)
    bwd_peak: float = 0.0  # the most a compiled block's backward graph held above its start


def _census(
    model: ModelSpec, plan: Plan, seq: int, cpu: bool, capability: tuple[int, int], backward: bool = False
) -> _Census:
    """What the first block saves for backward in one fake forward; for a ``torch_compile`` plan
    its partitioned graphs, and with ``backward`` the step's backward run, the most its backward
    graph holds above what it started with (the tracker's log over that graph's run)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autofit.evaluators import compiled, moe, simulated, unroll
    from autofit.evaluators import runtime as rt

    flash2 = plan.attention is Attention.FLASH2
    net = rt.build_model(model, plan, device="meta", attn_impl=simulated.register_flash2() if flash2 else None)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    rt.to_fake(net, mode)
    batch = rt.batches_for(model, plan, Workload(seq_len=seq, global_batch=1))[0]
    fake_batch, _ = simulated._fake_batch(batch, mode, flash2)
    block = unroll.decoder_layers(net, model.family.decoder_layer)[0]
    windows: list[tuple[int, int]] = []  # the tracker's log over each backward graph's run

    @contextlib.contextmanager
    def region(kind, _kernels):
        start = len(tracer.log)
        yield
        if kind == "backward":
            windows.append((start, len(tracer.log)))

    stand_in = compiled.CompiledBlocks([block], region) if plan.torch_compile else None
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
        out = net(**fake_batch, use_cache=False)
        if backward:
            out.logits.float().sum().backward()
    for h in hooks:
        h.remove()
    return _Census(
        saved=float(sum(seen.values())),
        graphs=stand_in.graphs if stand_in is not None else {},
        bwd_peak=max((_rise(tracer.log[a:b]) for a, b in windows), default=0.0),
    )


def _rise(events: list[tuple[int, int]]) -> float:
    """The most a run of (key, ±bytes) events holds above its start."""
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return float(peak)


def _key(t) -> int:
    """One key per storage, fake or real (a view shares its base's)."""
    return t.untyped_storage()._cdata

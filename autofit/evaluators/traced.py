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
cached per plan's block-relevant fields, in the process and on disk (``census_cache``).

A ``torch_compile`` plan's block is censused once more, with ``evaluators.compiled``'s stand-in
(one AOTAutograd compile, about a second), forward and backward at one prime length
(``PRIME``), where a tensor's size tells its terms apart: what torch.compile changes in the
saves, its partitioned graphs' kernels and fused bytes, and its backward graph's rise
(:class:`CompiledWork`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

from autofit.errors import CensusError
from autofit.evaluators import census_cache
from autofit.plan import Attention, Checkpointing, Method, Offload, OffloadDevice, Optimizer, Plan, Sharding
from autofit.specs import ModelSpec, Workload
from autofit.techniques import dtype_layout

# the two sequence lengths of the census (multiples of every kernel's block size)
LENGTHS = (256, 512)


def _by_kernels(census):
    """``census`` keyed by the kernels it runs, not the GPU: the CPU's, or the class of CUDA
    capabilities that pick the same sdpa kernel (``costs.sdpa_capability_class``; sdpa is the one
    kernel choice ``simulated.CudaKernels`` makes by capability). A search that screens other
    GPUs (``what_it_would_take``) or a later GPU of the same class censuses nothing again."""

    @functools.wraps(census)
    def keyed(model: ModelSpec, plan: Plan, cpu: bool, capability: tuple[int, int]):
        from autofit.evaluators.costs import sdpa_capability_class

        return census(model, plan, cpu, (0, 0) if cpu else sdpa_capability_class(capability))

    keyed.cache_clear = census.cache_clear  # the process's cache (functools.lru_cache) below
    return keyed


def block_terms(model: ModelSpec, plan: Plan, cpu: bool, capability: tuple[int, int]) -> tuple[float, float]:
    """``(bytes per token, bytes per token per attended position)`` the first block saves (a mixer's
    from its :func:`mixer_work` census, which runs forward and backward anyway)."""
    if model.mixer:
        tok, quad = mixer_work(model, plan.replace(torch_compile=False), cpu, capability).saved
    else:
        tok, quad = _terms(model, _census_plan(plan.replace(torch_compile=False)), cpu, capability)
    if plan.torch_compile:
        dtok, dquad = compile_delta(model, plan, cpu, capability)
        tok, quad = max(0.0, tok + dtok), max(0.0, quad + dquad)
    return tok, quad


def compile_delta(model: ModelSpec, plan: Plan, cpu: bool, capability: tuple[int, int]) -> tuple[float, float]:
    """What torch.compile changes in the block's saves, ``(per token, per token per attended
    position)``: the compiled census's less the eager one's (:func:`compiled_work`, :func:`eager_saved`)."""
    _, tok, quad = compiled_work(model, plan, cpu, capability).saved
    _, eager_tok, eager_quad = eager_saved(model, plan, cpu, capability)
    return tok - eager_tok, quad - eager_quad


def _census_plan(plan: Plan) -> Plan:
    """The plan with only the fields that change one block's census (the cache key): its method,
    precision and attention, and the engine's layout (``runtime.layout``: plain torch, DeepSpeed's
    16-bit module, FSDP2's fp32 shards)."""
    # every ZeRO stage computes on DeepSpeed's 16-bit module (QLoRA's storage differs at stage 3)
    sharding = plan.sharding
    if plan.engine == "deepspeed" and plan.method is not Method.QLORA:
        sharding = Sharding.ZERO2
    return plan.replace(
        micro_batch=1,
        grad_accum=1,
        checkpointing=Checkpointing.NONE,
        checkpoint_every=None,
        checkpoint_ops=False,
        offload_activations=False,
        fused_loss=False,
        optimizer=Optimizer.ADAMW,
        sharding=sharding,
        offload=Offload.NONE,
        offload_device=OffloadDevice.CPU,
        optimizer_in_backward=False,
        context_parallel=1,
    )


@_by_kernels
@functools.lru_cache(maxsize=512)
@census_cache.on_disk(list, tuple)
def _terms(model: ModelSpec, plan: Plan, cpu: bool, capability: tuple[int, int]) -> tuple[float, float]:
    one = _one_layer(model)
    return _per_token(*(float(sum(_census(one, plan, s, cpu, capability).storages)) for s in LENGTHS))


def _per_token(b1: float, b2: float, lengths: tuple[int, int] = LENGTHS) -> tuple[float, float]:
    """``(per token, per token per attended position)`` of two census values at ``lengths``."""
    s1, s2 = lengths
    quad = max(0.0, (b2 / s2 - b1 / s1) / (s2 - s1))
    return max(0.0, b1 / s1 - quad * s1), quad


# the length of a compiled block's census, a prime: whether a tensor's size holds it twice, once or
# not at all tells its terms apart (per token per attended position, per token, per micro-batch)
PRIME = 251

Terms = tuple[float, float, float]  # (per micro-batch, per token, per token per attended position)


def _split(nbytes: int) -> Terms:
    """One tensor's bytes at the census length ``PRIME`` (micro-batch 1) as its :data:`Terms`."""
    if nbytes % (PRIME * PRIME) == 0:
        return (0.0, 0.0, nbytes / PRIME**2)
    if nbytes % PRIME == 0:
        return (0.0, nbytes / PRIME, 0.0)
    return (float(nbytes), 0.0, 0.0)


def _sum(terms) -> Terms:
    c = t = q = 0.0
    for a, b, d in terms:
        c, t, q = c + a, t + b, q + d
    return (c, t, q)


def _at(terms: Terms, tokens: float, keys: float) -> float:
    c, t, q = terms
    return c + tokens * (t + q * keys)


@dataclasses.dataclass(frozen=True)
class CompiledWork:
    """A ``torch_compile`` plan's block from its partitioned graphs (the stand-in of
    ``evaluators.compiled`` on one traced block), as :data:`Terms`: what its forward saves for
    backward; the kernels it issues each way (fused kernels and library kernels) and the bytes its
    fused kernels move (``compiled.fused_kernels``; the constant is the weights' reads and casts);
    and what its backward graph holds above what it started with, after each of its nodes (a
    static walk of the graph: each op's outputs made, each storage freed after its last use)."""

    saved: Terms
    fwd_kernels: int
    bwd_kernels: int
    fwd_bytes: Terms
    bwd_bytes: Terms
    bwd_rise: tuple[Terms, ...]

    def bytes(self, tokens: float, keys: float) -> tuple[float, float]:
        """Forward and backward bytes of the fused kernels for a micro-batch of ``tokens``."""
        return _at(self.fwd_bytes, tokens, keys), _at(self.bwd_bytes, tokens, keys)


def compiled_work(model: ModelSpec, plan: Plan, cpu: bool, capability: tuple[int, int]) -> CompiledWork:
    """What the analytic evaluator needs of a ``torch_compile`` plan's block: one census at
    ``PRIME`` tokens, forward and backward (one AOTAutograd compile of the block, ~1 s at any
    size). FlashAttention-2 is censused as sdpa: the attention kernel is a library call either
    way, and what compile changes is around it (:func:`_compiled_key`)."""
    return _compiled_work(model, _compiled_key(plan), cpu, capability)


def _compiled_key(plan: Plan) -> Plan:
    key = _census_plan(plan).replace(torch_compile=True)
    return key.replace(attention=Attention.SDPA, packing=False) if key.attention is Attention.FLASH2 else key


def _from_json(cls):
    """The decoder of a dataclass from its JSON form (lists back to tuples), for ``census_cache``."""

    def tup(x):
        return tuple(tup(v) for v in x) if isinstance(x, list) else x

    return lambda data: cls(**{k: tup(v) for k, v in data.items()})


@_by_kernels
@functools.lru_cache(maxsize=256)
@census_cache.on_disk(dataclasses.asdict, _from_json(CompiledWork))
def _compiled_work(model: ModelSpec, plan: Plan, cpu: bool, capability: tuple[int, int]) -> CompiledWork:
    from autofit.evaluators import compiled

    run = _census(_one_layer(model), plan, PRIME, cpu, capability, backward=True)
    fwd, bwd = run.graphs["forward"][-1], run.graphs["backward"][-1]
    fk, bk = (compiled.kernel_moves(g) for g in (fwd, bwd))
    return CompiledWork(
        saved=_sum(_split(n) for n in run.storages),
        fwd_kernels=len(fk) + compiled.extern_kernels(fwd),
        bwd_kernels=len(bk) + compiled.extern_kernels(bwd),
        fwd_bytes=_sum(_node_terms(v) for values in fk for v in values),
        bwd_bytes=_sum(_node_terms(v) for values in bk for v in values),
        bwd_rise=_rise(bwd),
    )


def eager_saved(model: ModelSpec, plan: Plan, cpu: bool, capability: tuple[int, int]) -> Terms:
    """What the block saves without torch.compile, as :data:`Terms` from one census at ``PRIME``
    (what :class:`CompiledWork`'s ``saved`` is compared with)."""
    return _eager_saved(model, _compiled_key(plan).replace(torch_compile=False), cpu, capability)


@_by_kernels
@functools.lru_cache(maxsize=256)
@census_cache.on_disk(list, tuple)
def _eager_saved(model: ModelSpec, plan: Plan, cpu: bool, capability: tuple[int, int]) -> Terms:
    return _sum(_split(n) for n in _census(_one_layer(model), plan, PRIME, cpu, capability).storages)


@dataclasses.dataclass(frozen=True)
class MixerWork:
    """What one block holds beyond its saves while it runs, what it moves and the kernels it
    issues, measured on its trace where no formula gives them (a token mixer that is not softmax
    attention: ``ModelSpec.mixer``): bytes per token and per token per attended position, forward
    and backward (:class:`_Transients`); kernels per micro-batch and per token of a sequence, each
    way (a Mamba mixer's torch path loops over the sequence, a launch or more a token)."""

    fwd_tok: float
    fwd_quad: float
    bwd_tok: float
    bwd_quad: float
    fwd_kernels: tuple[float, float]
    bwd_kernels: tuple[float, float]
    # the FLOPs of the mixer's own products (a chunked scan's), per token and per token per
    # attended position, each way (``_Transients.measure``)
    fwd_flops: tuple[float, float]
    bwd_flops: tuple[float, float]
    # what the block saves, as :func:`block_terms` gives it (the same census: one trace, not two)
    saved: tuple[float, float]
    # the bytes its memory-bound ops read and write (``simulated.memory_bound``), per token and per
    # token per attended position, each way: what the block's elementwise traffic is
    fwd_bytes: tuple[float, float]
    bwd_bytes: tuple[float, float]

    def kernels(self, seq: float) -> tuple[float, float]:
        """Forward and backward kernels of one block for a micro-batch of sequences of ``seq`` tokens."""
        return tuple(a + b * seq for a, b in (self.fwd_kernels, self.bwd_kernels))


def mixer_work(model: ModelSpec, plan: Plan, cpu: bool, capability: tuple[int, int]) -> MixerWork:
    """A mixer block's :class:`MixerWork` from one census at each of :func:`mixer_lengths`, forward
    and backward."""
    return _mixer_work(model, _census_plan(plan.replace(torch_compile=False)), cpu, capability)


def mixer_lengths(model: ModelSpec) -> tuple[int, int, int]:
    """The three census lengths of a mixer block: 2, 3 and 4 of its scan's chunks (128 tokens where
    its config names none). A chunked scan of one chunk skips the state passed between chunks
    (Falcon-H1's, of 256 tokens, saved 20% less a token at 256 tokens than at 512 and 768), so a
    length of one chunk would fit a line through two regimes. Three lengths fit the three terms of
    a census value: per micro-batch, per token and per token per attended position."""
    cfg = _one_layer(model).to_hf_config()
    chunk = max([128] + [v for k in ("chunk_size", "mamba_chunk_size") if isinstance(v := getattr(cfg, k, None), int)])
    return (2 * chunk, 3 * chunk, 4 * chunk)


@_by_kernels
@functools.lru_cache(maxsize=256)
@census_cache.on_disk(dataclasses.asdict, _from_json(MixerWork))
def _mixer_work(model: ModelSpec, plan: Plan, cpu: bool, capability: tuple[int, int]) -> MixerWork:
    one, lengths = _one_layer(model), mixer_lengths(model)
    runs = [_census(one, plan, s, cpu, capability, transients=True) for s in lengths]
    fwd, bwd, kf, kb, ff, fb, bf, bb = zip(*(run.transients for run in runs))
    saved = [float(sum(run.storages)) for run in runs]

    def terms(values) -> tuple[float, float]:
        # a sum over ops or tensors: what does not grow with the tokens is the weights' (a
        # dequantized weight, autocast's copies), which the analytic evaluator counts for every
        # Linear: left out
        _, tok, quad = _fit(lengths, values)
        return max(0.0, tok), max(0.0, quad)

    def saves(values) -> tuple[float, float]:
        # what the block saves whatever the length (``-exp(A_log)``, a scan's initial state) is
        # a save as real as the rest: taken per token at the shortest length, which overstates it
        # at longer ones (never under from there)
        once, tok, quad = _fit(lengths, values)
        return max(0.0, tok + max(0.0, once) / lengths[0]), max(0.0, quad)

    def most(values) -> tuple[float, float]:
        # the most held at a moment, which one tensor (a dequantized weight) may decide at the
        # shortest length and the tokens' at the others (Falcon-H1's QLoRA backward): the longer two
        return _per_token(*values[1:], lengths=lengths[1:])

    def kernels(values) -> tuple[float, float]:
        once, tok, _ = _fit(lengths, values)
        return once, tok

    return MixerWork(
        *most(fwd), *most(bwd), kernels(kf), kernels(kb), terms(ff), terms(fb), saves(saved), terms(bf), terms(bb)
    )


def _fit(lengths: tuple[int, int, int], values) -> Terms:
    """The :data:`Terms` ``(c, t, q)`` of ``c + t·s + q·s²`` through three census values at ``lengths``."""
    (s1, s2, s3), (v1, v2, v3) = lengths, values
    d1, d2 = (v2 - v1) / (s2 - s1), (v3 - v2) / (s3 - s2)
    q = (d2 - d1) / (s3 - s1)
    t = d1 - q * (s1 + s2)
    return (v1 - t * s1 - q * s1 * s1, t, q)


def _node_terms(node) -> Terms:
    import torch
    from torch.utils._pytree import tree_leaves

    val = node.meta.get("val")
    return _sum(_split(t.numel() * t.element_size()) for t in tree_leaves(val) if isinstance(t, torch.Tensor))


def _rise(gm) -> tuple[Terms, ...]:
    """What a graph holds above its start after each node, run op by op: an op's outputs are made
    (a view or a tuple element shares its source's storage), and freed after the last node reading
    them or any alias of them (FX's generated code drops each value after its last use). Its inputs
    (a backward's saved tensors, which AOTAutograd's context holds until the graph returns) and its
    outputs stay."""
    import operator

    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    index = {n: i for i, n in enumerate(nodes)}
    last = {n: index[n] for n in nodes}
    for n in nodes:
        for m in n.all_input_nodes:
            last[m] = max(last[m], index[n])
    outputs = set(next(n for n in gm.graph.nodes if n.op == "output").all_input_nodes)
    owner, death = {}, {}
    for n in nodes:
        aliased = (
            n.op == "call_function"
            and (n.target is operator.getitem or getattr(n.target, "is_view", False))
            and n.all_input_nodes
        )
        owner[n] = owner[n.all_input_nodes[0]] if aliased else n
        o = owner[n]
        death[o] = len(nodes) if n in outputs or o in outputs else max(death.get(o, 0), last[n])
    dying: dict[int, list] = {}
    for o, i in death.items():
        dying.setdefault(i, []).append(o)
    live, out = (0.0, 0.0, 0.0), []
    for i, n in enumerate(nodes):
        if n.op == "call_function" and owner[n] is n:
            live = _sum((live, _node_terms(n)))
        out.append(live)
        for o in dying.get(i, ()):
            if o.op == "placeholder":
                continue
            c, t, q = _node_terms(o)
            live = _sum((live, (-c, -t, -q)))
    return tuple(out)


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
    """The model cut after the first layer of the kind ``model`` describes: its first layer only,
    or for a kind of a hybrid stack (``ModelSpec.layer_kinds``) the layers up to its first one
    (``unroll.cut``); a whole hybrid stack (a compiled plan's census) is its most common kind's,
    which its own fields describe. The census counts its last layer's saves."""
    from autofit.evaluators import unroll

    if model.hybrid:
        model = max(model.layer_kinds(), key=lambda kind: kind[0])[1]
    return unroll.cut(model, model.first_layer + 1)


@dataclasses.dataclass
class _Census:
    storages: list[int]  # the bytes of each distinct storage the first block saves for backward
    graphs: dict  # a compiled block's partitioned graphs (``CompiledBlocks.graphs``)
    transients: tuple[float, ...] = ()  # forward and backward bytes and kernels (:class:`_Transients`)


# the ops whose FLOPs the analytic evaluator counts from a block's shapes: Linears (and their
# adapters) run as mm/addmm, or bitsandbytes' 4-bit and int8 GEMMs; the experts as one grouped
# GEMM; attention by its kernel's name
SHAPED = ("mm", "addmm", "_grouped_mm", "gemm_4bit", "int8_linear_matmul")


class _Transients:
    """The block's own moments in a census trace, from the tracker's log (``memtrack``): between
    the block's forward hooks, the most it holds above its start, its saves and autocast's weight
    copies left out (the analytic evaluator counts those as activations and weights); between the
    gradient arriving at its output and the one leaving its input, the most it holds above the
    start plus the arriving gradient, with the saves it frees as it goes and the parameters'
    gradients left out (counted as gradients). So the moment of a block's backward is all its
    saves plus this, as the analytic evaluator adds them. The block's input is made to need a
    gradient where it does not (the first block of a LoRA model), as every later block's does."""

    def __init__(self, block, tracer) -> None:
        self.tracer, self.saved, self.marks, self.incoming = tracer, set(), {}, 0
        self.ops: dict[str, int] = {}  # the tracer's op rows at each mark: the kernels between
        self.hooks = [
            block.register_forward_pre_hook(self._enter, with_kwargs=True),
            block.register_forward_hook(self._leave),
        ]

    def _mark(self, name: str) -> None:
        self.marks[name] = len(self.tracer.log)
        self.ops[name] = len(self.tracer.ops.rows.get(name.removesuffix("-end"), ()))

    def _enter(self, module, args, kwargs):
        self._mark("forward")
        x = args[0] if args else kwargs["hidden_states"]
        if not x.requires_grad:
            x = x.detach().requires_grad_()
        x.register_hook(lambda g: self._mark("backward-end"))
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    def _leave(self, module, args, out) -> None:
        self._mark("forward-end")
        (out[0] if isinstance(out, tuple) else out).register_hook(self._arrives)

    def _arrives(self, grad) -> None:
        from autofit.evaluators.memtrack import round_block

        self._mark("backward")
        self.incoming = round_block(grad.untyped_storage().nbytes())

    def save(self, t) -> None:
        key = self.tracer._key_of(t, create=False)
        if key is not None:
            self.saved.add(key)

    def measure(self, net) -> tuple[float, ...]:
        """Forward and backward bytes (above), the kernels the block issued each way, the FLOPs
        of its products that are neither a Linear's nor attention's nor the experts' (which the
        analytic evaluator counts from the block's shapes: a chunked scan's), and the bytes its
        memory-bound ops moved, each way (as the simulator prices them)."""
        from autofit.evaluators.simulated import memory_bound

        for h in self.hooks:
            h.remove()
        weights = self.tracer.weight_keys
        grads = {self.tracer._key_of(p.grad, create=False) for p in net.parameters() if p.grad is not None}
        fwd = self._rise(self.marks["forward"], self.marks["forward-end"], weights | self.saved)
        bwd = self._rise(self.marks["backward"], self.marks["backward-end"], weights | grads)
        rows = {p: self.tracer.ops.rows.get(p, [])[self.ops[p] : self.ops[f"{p}-end"]] for p in ("forward", "backward")}
        flops = {p: sum(r[1] for r in rows[p] if r[0] not in SHAPED and "attention" not in r[0]) for p in rows}
        moved = {p: sum(r[2] for r in rows[p] if memory_bound(r[0], r[1], r[4])) for p in rows}
        return (
            float(fwd),
            float(self.incoming + bwd),
            float(len(rows["forward"])),
            float(len(rows["backward"])),
            flops["forward"],
            flops["backward"],
            moved["forward"],
            moved["backward"],
        )

    def _rise(self, start: int, end: int, skip: set) -> int:
        live = most = 0
        for key, delta in self.tracer.log[start:end]:
            if key not in skip:
                live += delta
                most = max(most, live)
        return most


def _census(
    model: ModelSpec,
    plan: Plan,
    seq: int,
    cpu: bool,
    capability: tuple[int, int],
    backward: bool = False,
    transients: bool = False,
) -> _Census:
    """What the last block saves for backward in one fake forward; for a ``torch_compile`` plan
    its partitioned graphs (the backward's once ``backward`` runs the step's backward); with
    ``transients``, forward and backward, what the block holds beyond its saves (:class:`_Transients`).
    A model that cannot be built or run under the plan raises :class:`~autofit.errors.CensusError`."""
    try:
        return _run_census(model, plan, seq, cpu, capability, backward, transients)
    except CensusError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers, PEFT or a fake kernel refusing the plan
        line = next((x for x in reversed(str(exc).strip().splitlines()) if x.strip()), type(exc).__name__)
        raise CensusError(
            f"one {model.model_type} block cannot be traced under {plan.summary()} ({type(exc).__name__}: {line[:200]})"
        ) from exc


def _run_census(
    model: ModelSpec, plan: Plan, seq: int, cpu: bool, capability: tuple[int, int], backward: bool, transients: bool
) -> _Census:
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
    block = unroll.decoder_layers(net, model.family.decoder_layer)[-1]
    _pass_earlier_mixers(net, block)
    full = model.derived and not plan.is_peft and not plan.quantized  # (adapters and 4-bit weights count otherwise)
    if full and sum(p.numel() for p in block.parameters()) != model.layer_params():
        raise CensusError(
            f"the {model.model_type} stack cut after layer {model.first_layer} does not end in that layer"
        )
    stand_in = compiled.CompiledBlocks([block]) if plan.torch_compile else None
    own = {_key(t) for t in rt.state_tensors(net)}
    inside, seen = [False], {}

    def pack(t):
        if inside[0] and _key(t) not in own:
            seen[_key(t)] = t.untyped_storage().nbytes()
            if probe is not None:
                probe.save(t)
        return t

    hooks = [
        block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)),
        block.register_forward_hook(lambda *_: inside.__setitem__(0, False)),
    ]
    kind = "cpu" if cpu else "cuda"
    decompositions = {**rt.bnb_decompositions(kind), **moe.fake_decompositions()}
    tracer = simulated.tracer_class()(last_step=0, attn_flop_scale=1.0, decompositions=decompositions)
    probe = _Transients(block, tracer) if transients else None
    tracer.track(rt.state_tensors(net), "weights")  # and autocast's copies of them (memtrack)
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
        # (phases: the tracer prices each op in them, as the simulator's step: _Transients' kernels)
        with tracer.in_phase("forward") if transients else contextlib.nullcontext():
            out = net(**fake_batch, use_cache=False)
        if backward or transients:
            with tracer.in_phase("backward") if transients else contextlib.nullcontext():
                out.logits.float().sum().backward()
    for h in hooks:
        h.remove()
    return _Census(
        storages=list(seen.values()),
        graphs=stand_in.graphs if stand_in is not None else {},
        transients=probe.measure(net) if probe is not None else (),
    )


def _pass_earlier_mixers(net, block) -> None:
    """Make the mixers of the layers before ``block`` (``specs.derive.mixers``: Mamba, the delta rule,
    short convolutions) return their input: those layers only feed the counted block its input,
    whose shape a mixer keeps, and a Mamba mixer's torch code loops over the tokens (Jamba's
    attention layer, censused after four Mamba layers, took 27 s)."""
    import torch

    from autofit.specs.derive import mixers

    stacks = [m for m in net.modules() if isinstance(m, torch.nn.ModuleList) and any(x is block for x in m)]
    for layer in stacks[0] if stacks else ():
        if layer is block:
            return
        for name in mixers(layer):
            getattr(layer, name).forward = _pass_through


def _pass_through(*args, **kwargs):
    return args[0] if args else kwargs["hidden_states"]


def _key(t) -> int:
    """One key per storage, fake or real (a view shares its base's)."""
    return t.untyped_storage()._cdata

"""Build a model for a plan and run its training steps: one code path for every fidelity.

The simulated evaluator runs these steps under fake tensors, the measured evaluator on
real devices, and the tests on the CPU; all three go through :func:`build_model`,
:func:`make_optimizer`, :func:`synthetic_batch` and :class:`StepRunner`, so what is
simulated is what is measured. An optional :class:`StorageTracker` sees phases
(forward, backward, optimizer) and the ``logits`` region (output head + loss).

How a plan is laid out in one process (``layout``) is ``techniques.dtype_layout``, the
rule the cost models and the exporter read too; here its names become torch dtypes. The
engine's fp32 master / sharded fp32 parameters are accounted by ``costs.shard_states``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from autofit.evaluators import compiled, fused, int8, offload, unroll
from autofit.evaluators.costs import next_pow2
from autofit.evaluators.memtrack import StorageTracker
from autofit.plan import Checkpointing, Method, Optimizer, Plan
from autofit.specs import ModelSpec, Workload
from autofit.techniques import (  # noqa: F401 - ATTN_IMPL and lora_target_names are re-exported
    ATTN_IMPL,
    INT8_THRESHOLD,
    NF4_DOUBLE_QUANT,
    NF4_QUANT_TYPE,
    SAC_COUNTED_OPS,
    SAC_SAVED_OPS,
    checkpointed_layers,
    dtype_layout,
    lora_kwargs,
    lora_target_names,
)

IGNORE_INDEX = -100

# bitsandbytes announces an optional faster CPU kernel it could not load, and peft calls a
# transformers method that transformers 5 renamed: neither concerns a user of autofit.
# Where the `kernels` package is installed (transformers >= 5.25 brings it), that load goes
# through kernels' hub client (bitsandbytes/backends/cpu/ops.py: get_kernel(
# "kernels-community/quantization-bitsandbytes")), whose logger also warns, offline or
# untrusted; bitsandbytes falls back to its own kernel either way.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
logging.getLogger("kernels").setLevel(logging.ERROR)
# MatMul8bitLt logs at every call that it quantizes a bf16 input through fp16 (lora-8bit in
# bf16); that is how LLM.int8 runs, and the simulator traces it on every Linear
logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)


@dataclass(frozen=True)
class Layout:
    """The module's side of ``techniques.DtypeLayout``, as torch dtypes."""

    base_dtype: torch.dtype  # frozen base / all weights
    adapter_dtype: torch.dtype  # LoRA adapters
    autocast_dtype: torch.dtype | None


def half_dtype(plan: Plan) -> torch.dtype:
    """The plan's 16-bit dtype (QLoRA's compute and packed-storage dtype)."""
    return getattr(torch, dtype_layout(plan).half)


def layout(plan: Plan) -> Layout:
    """The plan's dtypes in one process (``techniques.dtype_layout``) as torch dtypes."""
    d = dtype_layout(plan)
    return Layout(getattr(torch, d.base), getattr(torch, d.adapter), getattr(torch, d.autocast) if d.autocast else None)


def lora_config(spec: ModelSpec, plan: Plan):
    from peft import LoraConfig

    return LoraConfig(**lora_kwargs(spec, plan))


def hf_model_class(spec: ModelSpec):
    import transformers

    if spec.family.task == "masked-lm":
        return transformers.BertForMaskedLM
    return transformers.AutoModelForCausalLM


def build_model(
    spec: ModelSpec, plan: Plan, device: str | torch.device = "cpu", seed: int = 0, attn_impl: str | None = None
) -> torch.nn.Module:
    """The exact architecture with random weights and the plan applied, on ``device``.

    ``device="meta"`` builds without memory (the simulator then swaps in fake tensors with
    :func:`to_fake`); QLoRA weights stay unquantized there and are packed by ``to_fake``.
    ``attn_impl`` overrides the plan's attention implementation by its transformers name
    (the simulator's stand-in for flash_attention_2).
    """
    torch.manual_seed(seed)
    lay = layout(plan)
    cfg = spec.to_hf_config()
    cfg._attn_implementation = attn_impl or ATTN_IMPL[plan.attention]
    cfg.use_cache = False
    cls = hf_model_class(spec)
    with torch.device(device):
        if cls.__name__ == "AutoModelForCausalLM":
            model = cls.from_config(cfg, dtype=lay.base_dtype)
        else:
            model = cls(cfg).to(lay.base_dtype)
    if plan.quantized:
        quantize_linears(model, spec, half_dtype(plan), device, bits=8 if plan.method is Method.LORA_8BIT else 4)
    return _apply_plan(model, spec, plan)


def enable_checkpointing(model: torch.nn.Module, kwargs: dict[str, Any], plan: Plan | None = None) -> None:
    """Activation checkpointing through the model's own API (renamed in transformers 5); with
    ``plan`` selective, only its layers (``techniques.checkpointed_layers``) keep it on, and
    with op-level checkpointing every layer runs under ``op_checkpoint_contexts``.

    transformers checkpoints each ``GradientCheckpointingLayer`` whose ``gradient_checkpointing``
    flag is set (``modeling_layers.py``); enabling sets every decoder layer's, so the others
    are switched off again here, in layer order.
    """
    if plan is not None and plan.checkpoint_ops:
        kwargs = {**kwargs, "context_fn": functools.partial(op_checkpoint_contexts, kwargs.get("context_fn"))}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if plan is not None and plan.checkpointing is Checkpointing.SELECTIVE:
        from transformers.modeling_layers import GradientCheckpointingLayer

        layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        for layer, on in zip(layers, checkpointed_layers(plan, len(layers)), strict=True):
            layer.gradient_checkpointing = on


@functools.cache
def _sac_ops() -> tuple[frozenset, frozenset]:
    """(the ops whose outputs op-level checkpointing saves, the ops it counts): ``techniques.SAC_*``."""
    from torch._functorch.partitioners import get_default_op_list

    def ops(names: tuple[str, ...]) -> set:
        found = set()
        for name in names:  # an op not registered here (flash_attn not installed) is left out
            namespace, op = name.split(".")
            try:
                found.add(getattr(getattr(torch.ops, namespace), op).default)
            except (AttributeError, RuntimeError):
                continue
        return found

    saved = {op.default for op in get_default_op_list().compute_intensive_ops} | ops(SAC_SAVED_OPS)
    return frozenset(saved), frozenset(ops(SAC_COUNTED_OPS))


def op_checkpoint_contexts(inner: Callable[[], tuple[Any, Any]] | None = None) -> tuple[Any, Any]:
    """The (forward, recompute) contexts of one checkpointed block under op-level selective
    checkpointing (torchtitan's ``SelectiveAC`` policy, ``techniques.SAC_SAVED_OPS``): a fresh
    mm count per call, as torchtitan makes one per checkpoint. ``inner``: another
    ``context_fn`` whose contexts are entered too (the simulator's recompute phase)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved, counted = _sac_ops()
    count = {False: 0, True: 0}  # forward, recompute

    def policy(ctx, func, *args, **kwargs):
        if func in counted:
            count[ctx.is_recompute] += 1
        if func in saved and not (func in counted and count[ctx.is_recompute] % 2 == 0):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    forward, recompute = create_selective_checkpoint_contexts(policy)
    if inner is None:
        return forward, recompute
    inner_forward, inner_recompute = inner()
    return _both(inner_forward, forward), _both(inner_recompute, recompute)


@contextlib.contextmanager
def _both(first: Any, second: Any) -> Iterator[None]:
    with first, second:
        yield


def quantize_linears(
    model: torch.nn.Module,
    spec: ModelSpec,
    compute_dtype: torch.dtype,
    device,
    quant_storage: torch.dtype | None = None,
    bits: int = 4,
) -> None:
    """Replace every block Linear (GPT-2: Conv1D) by a bitsandbytes NF4 Linear4bit (double-quantized),
    or with ``bits=8`` an LLM.int8 Linear8bitLt.

    Layer by layer, so a model is never held in 16-bit and 4-bit at once beyond one Linear.
    Modules are matched by the suffix of their qualified name, as PEFT matches
    ``target_modules`` (BERT's ``output.dense`` must not catch the MLM head's
    ``transform.dense``). GPT-2's ``Conv1D`` stores its weight transposed (in × out).
    ``quant_storage``: the packed weights' element type (a float dtype where ZeRO-3/FSDP
    shard them; default uint8).
    """
    for _name, parent, child_name, child in _quant_targets(model, spec):
        weight = (child.weight.data.t() if _is_conv1d(child) else child.weight.data).contiguous()
        if bits == 8:
            setattr(parent, child_name, _linear8bit(weight, child.bias, device))
        else:
            setattr(parent, child_name, _linear4bit(weight, child.bias, compute_dtype, device, quant_storage))


def _is_conv1d(module: torch.nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _quant_targets(model: torch.nn.Module, spec: ModelSpec):
    """``(qualified name, parent, attribute, module)`` of every Linear/Conv1D QLoRA quantizes."""
    targets = [n for n, _, _, _ in spec.linears()]
    for pname, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not (isinstance(child, torch.nn.Linear) or _is_conv1d(child)):
                continue
            name = f"{pname}.{child_name}" if pname else child_name
            if any(name == t or name.endswith("." + t) for t in targets):
                yield name, parent, child_name, child


def _linear4bit(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    compute_dtype: torch.dtype,
    device,
    quant_storage: torch.dtype | None = None,
) -> torch.nn.Module:
    """An NF4 Linear4bit quantized from ``weight`` (out × in) on ``device``.

    Weights are quantized from ``compute_dtype``, as transformers' bitsandbytes loader does
    with ``torch_dtype`` = compute dtype: the quant state's dtype decides what dequantization
    produces (16-bit, not an fp32 temporary plus a cast). On ``meta`` nothing is quantized.
    """
    import bitsandbytes as bnb

    storage = {} if quant_storage is None else {"quant_storage": quant_storage}
    out_f, in_f = weight.shape
    q = bnb.nn.Linear4bit(
        in_f,
        out_f,
        bias=bias is not None,
        compute_dtype=compute_dtype,
        quant_type=NF4_QUANT_TYPE,
        compress_statistics=NF4_DOUBLE_QUANT,
        device="meta",
        **storage,
    )
    q.weight = bnb.nn.Params4bit(
        weight.to(compute_dtype),
        requires_grad=False,
        quant_type=NF4_QUANT_TYPE,
        compress_statistics=NF4_DOUBLE_QUANT,
        **storage,
    )
    if bias is not None:
        q.bias = torch.nn.Parameter(bias.data.to(device=weight.device, dtype=compute_dtype), requires_grad=False)
    return q.to(device)


def _linear8bit(weight: torch.Tensor, bias: torch.Tensor | None, device) -> torch.nn.Module:
    """An LLM.int8 Linear8bitLt from ``weight`` (out × in) on ``device``, as transformers'
    8-bit loader builds it (``has_fp16_weights=False``: a frozen int8 weight with one fp32
    absmax per output row). ``Int8Params.to`` quantizes on the way to a real device
    (bitsandbytes nn/modules.py); on ``meta`` nothing is quantized (``to_fake`` does it)."""
    import bitsandbytes as bnb

    out_f, in_f = weight.shape
    q = bnb.nn.Linear8bitLt(
        in_f, out_f, bias=bias is not None, has_fp16_weights=False, threshold=INT8_THRESHOLD, device="meta"
    )
    q.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    if bias is not None:
        q.bias = torch.nn.Parameter(bias.data.to(device=weight.device), requires_grad=False)
    return q.to(device)


# -- QLoRA without a 16-bit model: built on meta, materialized and quantized one module at a time --
def build_quantized_model(
    spec: ModelSpec,
    plan: Plan,
    device: str | torch.device = "cpu",
    seed: int = 0,
    quant_storage: torch.dtype | None = None,
) -> torch.nn.Module:
    """A QLoRA (or lora-8bit) plan's model whose 16-bit base never exists whole (measured runs).

    ``build_model`` materializes every weight in 16-bit, then quantizes: fine for tests,
    but a 70B model would need 140 GB first. Here the architecture is built on the meta
    device (buffers real, as accelerate's ``init_empty_weights`` does); then, module by
    module in definition order, each quantization target gets a
    random 16-bit weight on ``device`` (the model's own init distribution) that is
    quantized at once and dropped, and every other module is materialized with the
    model's own ``_init_weights`` (norms, embeddings, head, rotary buffers). The peak is
    the unquantized rest (embeddings, norms, head) plus one Linear in 16-bit. The plan's
    LoRA, checkpointing and attention are then applied as ``build_model`` applies them.
    """
    torch.manual_seed(seed)
    lay = layout(plan)
    half = half_dtype(plan)
    cfg = spec.to_hf_config()
    cfg._attn_implementation = ATTN_IMPL[plan.attention]
    cfg.use_cache = False
    cls = hf_model_class(spec)
    from accelerate import init_empty_weights

    # parameters on meta; buffers (rotary frequencies, position ids) are computed for real
    with init_empty_weights(include_buffers=False):
        if cls.__name__ == "AutoModelForCausalLM":
            model = cls.from_config(cfg, dtype=lay.base_dtype)
        else:
            model = cls(cfg).to(lay.base_dtype)
    std = getattr(cfg, "initializer_range", 0.02) or 0.02
    targets = {id(m): (parent, attr) for _, parent, attr, m in _quant_targets(model, spec)}
    for module in list(model.modules()):
        if id(module) in targets:
            parent, attr = targets[id(module)]
            conv = _is_conv1d(module)
            out_f, in_f = (module.nf, module.nx) if conv else (module.out_features, module.in_features)
            weight = torch.empty(out_f, in_f, dtype=lay.base_dtype, device=device).normal_(0.0, std)
            bias = torch.zeros(out_f, dtype=lay.base_dtype, device=device) if module.bias is not None else None
            if plan.method is Method.LORA_8BIT:
                setattr(parent, attr, _linear8bit(weight, bias, device))
            else:
                setattr(parent, attr, _linear4bit(weight, bias, half, device, quant_storage))
            del weight, bias
            continue
        metas = [(n, p) for n, p in module._parameters.items() if p is not None and p.device.type == "meta"]
        for n, p in metas:
            module._parameters[n] = torch.nn.Parameter(
                torch.empty_like(p, device=device), requires_grad=p.requires_grad
            )
        if metas:
            model._init_weights(module)
    model.tie_weights()
    model.to(device)  # the buffers
    return _apply_plan(model, spec, plan)


def _apply_plan(model: torch.nn.Module, spec: ModelSpec, plan: Plan) -> torch.nn.Module:
    """LoRA adapters (in the adapter dtype), checkpointing and train mode, as build_model does."""
    lay = layout(plan)
    if spec.family.task == "causal-lm" and getattr(model, "loss_type", "") is None:
        # transformers picks the loss from the class name (PreTrainedModel.__init__); GPT-2's
        # GPT2LMHeadModel has no "ForCausalLM" in it, so every forward with labels logged
        # "`loss_type=None` was set in the config but it is unrecognized" (modeling_utils,
        # PreTrainedModel.loss_function) and then used ForCausalLM: name it, same loss, no noise
        model.loss_type = "ForCausalLM"
    if plan.method is Method.LORA_8BIT:
        # what transformers' 8-bit quantizer sets (quantizer_bnb_8bit.py), so that peft wraps
        # each Linear8bitLt in its own lora.bnb.Linear8bitLt as it does in the user's run
        model.is_loaded_in_8bit = True
    if plan.is_peft:
        from peft import get_peft_model

        for p in model.parameters():
            p.requires_grad_(False)
        with warnings.catch_warnings():
            # peft/tuners/lora/layer.py (dispatch_default) warns that fan_in_fan_out is False
            # for GPT-2's Conv1D layers and sets it True itself; the adapters are built right
            # either way, and the exported LoRA config is the user's to keep as it is
            warnings.filterwarnings(
                "ignore",
                message="fan_in_fan_out is set to False but the target module is `Conv1D`",
                category=UserWarning,
            )
            model = get_peft_model(model, lora_config(spec, plan), autocast_adapter_dtype=False)
        for _, p in model.named_parameters():
            if p.requires_grad:
                p.data = p.data.to(lay.adapter_dtype)
    if plan.checkpointing is not Checkpointing.NONE:
        enable_checkpointing(model, {"use_reentrant": False}, plan)
    model.train()
    return model


def _quant_states(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, Any]]:
    for m in model.modules():
        qs = getattr(getattr(m, "weight", None), "quant_state", None)
        if qs is not None:
            yield m, qs


def state_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor the model holds before a step: parameters, buffers and bitsandbytes'
    quant states (4-bit: absmax, codes, offset; 8-bit: the row absmax ``SCB`` on the
    parameter or, after the first forward, on the layer's ``MatmulLtState``), which are
    neither but live as long as the weight."""
    out = list(model.parameters()) + list(model.buffers())
    for _, qs in _quant_states(model):
        for st in (qs, qs.state2):
            if st is not None:
                out += [t for t in (st.absmax, st.code, st.offset) if isinstance(t, torch.Tensor)]
    seen = {id(t) for t in out}
    for m in model.modules():
        for holder in (getattr(m, "weight", None), getattr(m, "state", None)):
            scb = getattr(holder, "SCB", None) if type(holder).__name__ in ("Int8Params", "MatmulLtState") else None
            if isinstance(scb, torch.Tensor) and id(scb) not in seen:
                seen.add(id(scb))
                out.append(scb)
    return out


def to_fake(model: torch.nn.Module, mode) -> torch.nn.Module:
    """Replace every parameter and buffer of a model built on ``meta`` by a fake tensor.

    peft cannot wrap a model built under FakeTensorMode (swap_tensors refuses tensors with
    weakrefs, shared/FIELD-NOTES.md), so the model is built and wrapped on ``meta`` and its
    tensors are swapped here, keeping ties (one fake per shared tensor) and requires_grad.
    QLoRA weights are quantized by bitsandbytes' own ``quantize_4bit`` under the fake mode:
    its ops have fake kernels, so the packed weight and the double-quantized state have
    exactly bitsandbytes' shapes without a byte of real memory.
    """
    import bitsandbytes as bnb  # noqa: F401 - only needed for QLoRA, cheap when installed

    memo: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            with mode:
                memo[id(t)] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        return memo[id(t)]

    for m in model.modules():
        weight = m._parameters.get("weight")
        if weight is not None and type(weight).__name__ == "Params4bit" and not weight.bnb_quantized:
            _fake_quantize(m, fake(weight), mode)
            memo[id(weight)] = m.weight
        elif weight is not None and type(weight).__name__ == "Int8Params" and weight.dtype is not torch.int8:
            _fake_quantize_8bit(m, fake(weight), mode)
            memo[id(weight)] = m.weight
        for name, p in list(m._parameters.items()):
            if p is not None and not _is_fake(p):
                if id(p) not in memo:
                    memo[id(p)] = torch.nn.Parameter(fake(p), requires_grad=p.requires_grad)
                m._parameters[name] = memo[id(p)]
        for name, b in list(m._buffers.items()):
            if b is not None and not _is_fake(b):
                m._buffers[name] = fake(b)
        for name, v in list(vars(m).items()):  # plain tensor attributes (e.g. rotary's original_inv_freq)
            if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and v.device.type == "meta":
                setattr(m, name, fake(v))
    return model


def _fake_quantize(module: torch.nn.Module, weight: torch.Tensor, mode) -> None:
    import bitsandbytes as bnb
    from bitsandbytes.functional import create_dynamic_map, name2qmap

    # the double quantization's code is built from Python floats (.tolist()), which a
    # fake tensor cannot give: build it for real once, as bitsandbytes caches it anyway
    if "dynamic" not in name2qmap:
        name2qmap["dynamic"] = create_dynamic_map()
    src = module.weight
    with mode:
        packed, qs = bnb.functional.quantize_4bit(
            weight,
            blocksize=src.blocksize,
            compress_statistics=src.compress_statistics,
            quant_type=src.quant_type,
            quant_storage=src.quant_storage,
        )
    p = torch.nn.Parameter(packed, requires_grad=False)
    # what Params4bit carries; a fake tensor cannot be re-wrapped as Params4bit, and
    # Linear4bit.forward only reads these attributes
    for k in ("blocksize", "compress_statistics", "quant_type", "quant_storage"):
        setattr(p, k, getattr(src, k))
    p.quant_state, p.bnb_quantized, p.module = qs, True, module
    module._parameters["weight"] = p
    module.quant_state = qs


def _fake_quantize_8bit(module: torch.nn.Module, weight: torch.Tensor, mode) -> None:
    """``Int8Params._quantize`` under the fake mode: bitsandbytes' own row-wise quantization
    (fake kernels give the int8 weight and its fp32 row absmax), carried as the parameter
    Linear8bitLt.forward reads (``CB``, ``SCB``, ``has_fp16_weights``)."""
    import bitsandbytes as bnb

    with mode:
        cb, scb, _ = bnb.functional.int8_vectorwise_quant(weight.to(torch.float16))
    p = torch.nn.Parameter(cb, requires_grad=False)
    p.CB, p.SCB, p.has_fp16_weights = cb, scb, False
    module._parameters["weight"] = p


def bnb_decompositions(kind: str) -> dict:
    """bitsandbytes ops a storage tracker should see into, for a device of ``kind``.

    ``gemm_4bit`` is one op to the dispatcher, but on the CPU (always) and on CUDA for more
    than 1536 rows (bitsandbytes 0.50's ``_gemm_4bit_custom_max_m``) it runs
    ``_gemm_4bit_default_impl``: the absmax dequantized to fp32 and the whole weight
    dequantized to the compute dtype before a plain linear. Those temporaries are real
    memory; the tracker sees them when it runs that function in place of the op. On CUDA,
    LLM.int8's ops too (``int8.cuda_decompositions``: int32 and fp16 GEMM outputs, the
    quantized input, the outlier columns).
    """
    try:
        from bitsandbytes.backends.default.ops import _gemm_4bit_default_impl

        op = torch.ops.bitsandbytes.gemm_4bit.default
    except (ImportError, AttributeError):
        return {}
    max_custom_rows = 0 if kind == "cpu" else 1536

    def when(a, *args, **kwargs) -> bool:
        return a.numel() // a.shape[-1] > max_custom_rows

    out = {op: (when, _gemm_4bit_default_impl)}
    if kind == "cuda":
        out.update(int8.cuda_decompositions())
    return out


def make_optimizer(plan: Plan, model: torch.nn.Module, lr: float = 1e-5) -> Any:
    """The plan's optimizer over the trainable parameters (one per parameter, stepped in
    backward, where the plan says so: :class:`BackwardOptimizer`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if plan.optimizer_in_backward:
        return BackwardOptimizer(params, lambda one: _optimizer(plan, one, lr))
    return _optimizer(plan, params, lr)


class BackwardOptimizer(torch.optim.Optimizer):
    """The optimizer step fused into backward: one optimizer per parameter, stepped by the
    parameter's ``register_post_accumulate_grad_hook`` as soon as its gradient is
    accumulated, and the gradient freed at once, so no moment holds every gradient.

    What torchtune's ``optimizer_in_bwd`` does (``training.create_optim_in_bwd_wrapper`` and
    ``register_optim_in_bwd_hooks``), after PyTorch's tutorial "How to save memory by fusing
    the optimizer step into the backward pass". An ``Optimizer`` to whatever drives it (the
    Trainer, an LR scheduler): ``step`` and ``zero_grad`` do nothing, ``param_groups`` are
    the per-parameter optimizers' own groups (a schedule's ``group["lr"]`` reaches them) and
    ``state`` is the one dict they share. Gradients are gone by the time backward returns:
    they cannot be clipped, nor unscaled (no fp16 loss scaling).
    """

    def __init__(self, params: list[torch.nn.Parameter], make: Callable[[list], torch.optim.Optimizer]) -> None:
        super().__init__(params, {})
        self.optimizers = {p: make([p]) for p in params}
        for opt in self.optimizers.values():
            opt.state = self.state  # torch optimizers key their state by parameter
        self.param_groups = [g for opt in self.optimizers.values() for g in opt.param_groups]
        self.on_grad: Callable[[torch.Tensor], None] | None = None  # sees each gradient before its step
        self._handles = [p.register_post_accumulate_grad_hook(self._step) for p in self.optimizers]

    def _step(self, p: torch.Tensor) -> None:
        if self.on_grad is not None:
            self.on_grad(p)
        opt = self.optimizers[p]
        with _real_scalars_of(p):
            opt.step()
        opt.zero_grad(set_to_none=True)

    def step(self, closure: Any = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _optimizer(plan: Plan, params: list, lr: float) -> torch.optim.Optimizer:
    if plan.optimizer is Optimizer.ADAMW:
        try:
            return torch.optim.AdamW(params, lr=lr, fused=True)
        except (RuntimeError, ValueError):
            return torch.optim.AdamW(params, lr=lr, foreach=False)
    if plan.optimizer in (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT):
        import bitsandbytes as bnb

        cls = bnb.optim.PagedAdamW8bit if plan.optimizer is Optimizer.PAGED_ADAMW_8BIT else bnb.optim.AdamW8bit
        return cls(params, lr=lr)
    if plan.optimizer is Optimizer.ADAFACTOR:
        return torch.optim.Adafactor(params, lr=lr, foreach=False)
    return torch.optim.SGD(params, lr=lr, momentum=0.0)


# -- data ----------------------------------------------------------------------------------
def sample_lengths(workload: Workload, n: int, gen: torch.Generator, worst_case: bool) -> list[int]:
    if workload.lengths is None:
        return [workload.seq_len] * n
    hist = workload.lengths.histogram
    weights = torch.tensor([c for _, c in hist], dtype=torch.float64)
    idx = torch.multinomial(weights, n, replacement=True, generator=gen).tolist()
    lengths = [hist[i][0] for i in idx]
    if worst_case:
        lengths[0] = workload.seq_len  # a micro-batch padded to the full length
    return lengths


def synthetic_batch(
    spec: ModelSpec, plan: Plan, workload: Workload, device="cpu", seed: int = 0, worst_case: bool = True
) -> dict[str, torch.Tensor]:
    """Random token ids shaped like the workload: padded to the micro-batch's longest
    sequence, or packed padding-free into one row with restarting position ids."""
    gen = torch.Generator().manual_seed(seed)
    mb, v = plan.micro_batch, spec.vocab_size
    lengths = sample_lengths(workload, mb, gen, worst_case)
    if plan.packing:
        total = sum(lengths)
        ids = torch.randint(0, v, (1, total), generator=gen)
        pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        labels = ids.clone()
        starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
        labels[0, starts] = IGNORE_INDEX  # no prediction across a boundary
        batch = {"input_ids": ids, "labels": labels, "position_ids": pos}
    else:
        width = max(lengths) if workload.lengths is not None else workload.seq_len
        ids = torch.randint(0, v, (mb, width), generator=gen)
        mask = torch.zeros(mb, width, dtype=torch.long)
        for i, n in enumerate(lengths):
            mask[i, :n] = 1
        labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
        batch = {"input_ids": ids, "labels": labels}
        if workload.lengths is not None:
            batch["attention_mask"] = mask
    return {k: t.to(device) for k, t in batch.items()}


def context_parallel_inputs(batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """What the Trainer adds to a micro-batch under context parallelism, and the buffers
    ``maybe_context_parallel`` then shards along the sequence (``Trainer._prepare_context_parallel_inputs``,
    transformers 5.25): labels shifted before sharding (``shift_labels``: a rank's last token predicts
    the next rank's first, which its own shard does not hold; the loss takes them unshifted) and
    ``position_ids``, which the sharded rows would otherwise restart at 0. Rows are full-length
    (plan_problems), so there is no attention mask. ``batch`` gains the two keys in place."""
    labels = F.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)
    batch["shift_labels"] = labels[:, 1:].contiguous()
    ids = batch["input_ids"]
    batch["position_ids"] = torch.arange(ids.size(1), device=ids.device).expand(ids.size(0), -1).contiguous()
    return [batch[k] for k in ("input_ids", "labels", "shift_labels", "position_ids")]


def real_tokens(batch: dict[str, torch.Tensor]) -> int:
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int(batch["input_ids"].numel())


# -- loss ------------------------------------------------------------------------------------
def _chunk_loss(hidden, weight, bias, labels, softcap):
    # the chunk is cast to the head's dtype, never the head to the chunk's: an fp32 chunk
    # (a LayerNorm output under CUDA autocast) would otherwise copy the whole head per chunk
    logits = F.linear(hidden.to(weight.dtype), weight, bias).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(
    hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, softcap: float | None = None
) -> torch.Tensor:
    """Cross-entropy through the output head one chunk of tokens at a time.

    Each chunk is checkpointed, so neither forward nor backward ever holds more than one
    chunk's logits. Chunk size follows Liger's fused-linear-cross-entropy rule
    (tokens / ceil(vocab / hidden), rounded up to a power of two).
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    weight = head.weight
    bias = getattr(head, "bias", None)
    n_tok, vocab = h.shape[0], weight.shape[0]
    chunk = min(n_tok, next_pow2(n_tok / math.ceil(vocab / h.shape[1])))
    total = h.new_zeros((), dtype=torch.float32)
    for i in range(0, n_tok, chunk):
        total = total + torch.utils.checkpoint.checkpoint(
            _chunk_loss, h[i : i + chunk], weight, bias, y[i : i + chunk], softcap, use_reentrant=False
        )
    return total / (y != IGNORE_INDEX).sum().clamp(min=1)


def chunked_loss(
    base: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    masked_lm: bool = False,
    before_head: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """The loss of ``batch`` without the full logits: the model's body, then
    :func:`chunked_cross_entropy` through its output head (the stand-in for Liger's fused
    linear cross-entropy). ``base`` is the transformers model (a PEFT model's base model);
    ``before_head`` sees the last hidden state before the head reads it."""
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    body = base.base_model if hasattr(base, "base_model") else base
    hidden = body(**inputs, use_cache=False).last_hidden_state
    if masked_lm:
        hidden = base.cls.predictions.transform(hidden)
    else:
        labels = _shift(labels)
    if before_head is not None:
        before_head(hidden)
    softcap = getattr(base.config, "final_logit_softcapping", None)
    return chunked_cross_entropy(hidden, base.get_output_embeddings(), labels, softcap)


def _shift(labels: torch.Tensor) -> torch.Tensor:
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


# -- the step ----------------------------------------------------------------------------------
class StepRunner:
    """Runs forward, loss, backward and the optimizer step of a plan, micro-batch by micro-batch."""

    def __init__(
        self,
        spec: ModelSpec,
        plan: Plan,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: str | torch.device = "cpu",
        tracker: StorageTracker | None = None,
        backward: Callable[[torch.Tensor], None] | None = None,
        micro_batch_context: Callable[[int, int, dict], Any] | None = None,
        kernels: Any = None,
    ) -> None:
        """``backward`` and ``micro_batch_context`` let an engine run the same step: DeepSpeed's
        ``accelerator.backward`` (which also steps the engine at the accumulation boundary),
        DDP's ``no_sync`` on all but the last micro-batch, context parallelism's sharding of the
        batch (called as ``(index, count, batch)``, before the forward reads ``batch``).
        ``kernels``: a factory of a context manager entered around every forward computation,
        the checkpoint recompute in backward included (the simulator's stand-ins for a target
        GPU's kernels on fake CPU tensors). A ``torch_compile`` plan's blocks are compiled in place
        (``compile_regions``), or under a tracker by :mod:`autofit.evaluators.compiled`'s stand-in,
        priced by the tracker's ``compiled_region`` where it has one (the simulator's)."""
        self.spec, self.plan, self.model, self.optimizer = spec, plan, model, optimizer
        self.device = torch.device(device)
        self.tracker = tracker
        self.kernels = kernels
        self._backward = backward
        self._micro_context = micro_batch_context
        self.lay = layout(plan)
        inner = unwrap(model)
        base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
        self.base = base
        self.head = base.get_output_embeddings()
        self._hooks = []
        if tracker is not None and not plan.fused_loss:
            self._hooks.append(self.head.register_forward_pre_hook(self._enter_logits))
        self._rope = None
        if plan.fused_kernels:  # the stand-ins for Liger's kernels (evaluators.fused)
            fused.apply(inner)
            self._rope = inner
        self._compiled = None
        if plan.torch_compile:
            blocks = unroll.decoder_layers(inner, spec.family.decoder_layer)
            # dynamo compiles nothing under a TorchDispatchMode such as the tracker (FIELD-NOTES):
            # a tracked step runs the blocks as inductor partitions them, unfused
            region = getattr(tracker, "compiled_region", None)
            self._compiled = compiled.CompiledBlocks(blocks, region) if tracker is not None else compile_regions(blocks)
        if (tracker is not None or kernels is not None) and plan.checkpointing is not Checkpointing.NONE:
            # re-enable with a context for the recompute, so recomputed tensors count as
            # activations and run the same kernels as their forward
            enable_checkpointing(unwrap(model), {"use_reentrant": False, "context_fn": self._checkpoint_contexts}, plan)
        if tracker is not None and isinstance(optimizer, BackwardOptimizer):
            optimizer.on_grad = lambda p: tracker.mark([p.grad], "gradients")
        self._offload = None
        if plan.offload_activations:
            self._offload = offload.ActivationOffload(inner, self.device.type, tracker)
            self._hooks.append(self._offload.stop_at(self.head))

    # regions: the head and the loss are "logits" until the gradient reaches the head's input
    def _enter_logits(self, module, args):
        self.tracker.region = "logits"
        x = args[0]
        if x.requires_grad:
            x.register_hook(self._leave_logits)

    def _leave_logits(self, grad):
        self.tracker.region = ""
        return None

    def _checkpoint_contexts(self):
        return contextlib.nullcontext(), self._recompute()

    @contextlib.contextmanager
    def _recompute(self):
        with contextlib.ExitStack() as stack:
            if self.tracker is not None:
                stack.enter_context(self.tracker.in_phase("recompute"))
            stack.enter_context(self._kernels())
            yield

    def _kernels(self):
        return self.kernels() if self.kernels is not None else contextlib.nullcontext()

    def fused_rope(self):
        """Liger's RoPE stand-in for a whole step: forward and backward, where any checkpoint
        recompute (the model's or FSDP's) must rotate as the forward did."""
        return fused.rope(self._rope) if self._rope is not None else contextlib.nullcontext()

    def _offloading(self):
        return self._offload if self._offload is not None else contextlib.nullcontext()

    def _autocast(self):
        if self.lay.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.lay.autocast_dtype)

    def _phase(self, name: str, step: int | None = None):
        return self.tracker.in_phase(name, step) if self.tracker else contextlib.nullcontext()

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if not self.plan.fused_loss:
            out = self.model(**batch, use_cache=False)
            return out.loss
        return chunked_loss(self.base, batch, self.spec.family.task == "masked-lm", self._before_head)

    def _before_head(self, hidden: torch.Tensor) -> None:
        if self.tracker is not None:
            self._enter_logits(self.head, (hidden,))
        if self._offload is not None:  # the loss reads the head's weight itself
            self._offload.stop()

    def step(self, batches: list[dict[str, torch.Tensor]], step: int = 0) -> float:
        """One optimizer step over ``grad_accum`` micro-batches; returns the mean loss."""
        losses = []
        with self.fused_rope():
            for i, batch in enumerate(batches):
                micro = self._micro_context(i, len(batches), batch) if self._micro_context else contextlib.nullcontext()
                with micro:
                    with self._phase("forward", step), self._autocast(), self._kernels(), self._offloading():
                        loss = self.loss(batch) / len(batches)
                    if self.tracker is not None:
                        self.tracker.region = ""
                    with self._phase("backward", step):
                        if self.tracker is not None:
                            self.tracker.region = "logits"
                        if self._backward is not None:
                            self._backward(loss)
                        else:
                            loss.backward()
                        if self.tracker is not None:
                            self.tracker.region = ""
                losses.append(float(loss.detach()) if loss.device.type != "meta" and not _is_fake(loss) else 0.0)
                del loss
        if self.tracker is not None:
            self.tracker.mark([p.grad for p in self.model.parameters() if p.grad is not None], "gradients")
        with self._phase("optimizer", step), _real_scalars(self.model):
            self.optimizer.step()
            if self.tracker is not None:
                self.tracker.mark(_state_tensors(self.optimizer), "optimizer")
            self.optimizer.zero_grad(set_to_none=True)
        return sum(losses)

    def compile_blocks(self, **compile_kwargs: Any) -> bool:
        """Swap the tracked steps' stand-in (``compiled.CompiledBlocks``) for torch.compile itself
        (``compile_regions``), which compiles once no tracker is active: a measured run's untracked
        steps. False where nothing was swapped (no ``torch_compile``, or compiled already)."""
        if not isinstance(self._compiled, compiled.CompiledBlocks):
            return False
        blocks = self._compiled.blocks
        self._compiled.remove()
        if self.plan.checkpointing is not Checkpointing.NONE:
            # dynamo cannot trace a checkpoint whose context_fn is the tracker's recompute contexts
            # ("checkpoint not implemented for ... context_fn"): plain again, as a launched run has it
            enable_checkpointing(unwrap(self.model), {"use_reentrant": False}, self.plan)
        self._compiled = compile_regions(blocks, **compile_kwargs)
        return True

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        if hasattr(self._compiled, "remove"):
            self._compiled.remove()


def compile_regions(blocks: list[torch.nn.Module], **compile_kwargs: Any) -> None:
    """torch.compile of every block in place, as accelerate's regional compilation does it under
    FSDP2 and DeepSpeed (``accelerate.utils.compile_regions_fsdp2``, ``compile_regions_deepspeed``:
    ``module.compile()``), with inductor unless ``compile_kwargs`` say otherwise."""
    compile_checkpointed_blocks()
    for block in blocks:
        block.compile(**compile_kwargs)


def compile_checkpointed_blocks() -> None:
    """Let dynamo compile a checkpointed decoder block whole, as the estimators price it.

    transformers' output capturing (``utils/output_capturing.py``) sets a
    ``CompileableContextVar`` inside every decoder layer's forward. Under
    ``torch.utils.checkpoint`` (reentrant or not, every k-th layer or op-level policy alike) dynamo
    refuses that side effect inside the checkpoint's higher-order op ("HOP: Unsafe side effect",
    torch/_dynamo/side_effects.py) and runs the whole block eagerly: a compiled plan
    with checkpointing would compile nothing (docs/FIELD-NOTES.md, 2026-12-06). With
    ``skip_fwd_side_effects_in_bwd_under_checkpoint`` dynamo traces the block into the checkpoint's
    op and does not replay that side effect in the recompute, which only the capture of hidden
    states and attentions reads: a training step does not. accelerate 1.16 sets it itself on its FSDP2
    path with regional compilation, after torchtitan's per-block recipe (``Accelerator._prepare_fsdp2``),
    but not for one process, DDP or DeepSpeed. Set for the process (dynamo's config is global); the
    measured child and an exported run (``autofit.launch.PlanTrainer``) both set it."""
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP / DeepSpeed's engine (FSDP2 shards in place and needs none)."""
    while type(model).__name__ in ("DistributedDataParallel", "DeepSpeedEngine"):
        model = model.module
    return model


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                yield v


def batches_for(
    spec: ModelSpec, plan: Plan, workload: Workload, device: Any = "cpu", step: int = 0, worst_case: bool = True
) -> list[dict[str, torch.Tensor]]:
    return [
        synthetic_batch(spec, plan, workload, device, seed=1000 * step + i, worst_case=worst_case)
        for i in range(plan.grad_accum)
    ]


def _real_scalars(model: torch.nn.Module):
    """Run the optimizer step of a fake model outside the fake mode.

    Optimizers keep step counts in 0-dim tensors and some read them back (Adafactor's
    ``step.item()``), which a fake tensor cannot answer. Outside the mode those counters
    are created real, while every op on a fake parameter, gradient or state still runs
    fake (a fake tensor dispatches to its own mode).
    """
    return _real_scalars_of(next(iter(model.parameters()), None))


def _real_scalars_of(p: torch.Tensor | None):
    if p is not None and _is_fake(p):
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        return unset_fake_temporarily()
    return contextlib.nullcontext()

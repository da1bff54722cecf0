"""The block of a model type no family describes, read from the model transformers builds.

``FAMILIES`` describes the block shapes autofit was written against. Any other causal LM that
transformers implements natively is described here from its config: the model is built on the
``meta`` device (no memory), the first decoder layer of each kind is read as data (its Linear
layers with their names, shapes and biases, its norms, its parameter counts; a hybrid stack has
several kinds: ``Derived.stack``), and one forward pass on fake
tensors (``torch._subclasses.FakeTensorMode``: shapes only, no arithmetic) records the order in
which the block calls its norms, attention and MLP, and what each reads. The result is a
:class:`Derived`: the exact parameter counts and Linear layers the simulated and measured
evaluators and the exports need, and the best :class:`~autofit.specs.models.Family` the fields
can say. Where that family's formulas reproduce the block's parameters and the block is one
the analytic evaluator's formulas describe (``common``), the analytic evaluator reads it as it
reads a registered family; otherwise ``analytic`` says why not, and the analytic evaluator
takes the block's saved tensors from a trace of it (``evaluators/traced.py``), and for a
layer whose tokens are mixed by something other than softmax attention (:func:`mixers`: Mamba,
the gated delta rule, short convolutions) its transients and kernels too. A mixture of
experts is read where transformers runs its experts as grouped experts
(``use_experts_implementation``), under the registered MoE families' routing assumption
(:func:`_experts`); any other is refused.

Imports torch and transformers lazily, as ``ModelSpec.to_hf_config`` imports transformers.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from autofit.errors import SpecError

# the activations whose saves the analytic evaluator knows (``analytic._gated_mlp``,
# ``analytic._mlp_body``): gelu_pytorch_tanh is torch's one tanh-GELU op, which saves its
# input as exact GELU does (``torch/csrc/autograd/FunctionsManual.cpp`` gelu_backward)
GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
PLAIN_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh")
# where configs name the MLP's activation (Gemma's hidden_activation overrides its hidden_act)
ACTIVATION_KEYS = ("hidden_activation", "hidden_act", "activation_function", "activation")
# where configs set a dropout probability
DROPOUT_KEYS = (
    "attention_dropout",
    "hidden_dropout",
    "residual_dropout",
    "embedding_dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "dropout",
)
# config keys of a mixture of experts' expert count and of the experts each token is routed to
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "moe_k", "top_k", "num_experts_per_token")
# config keys kept out of a derived spec's ``hf_extra``: its own fields, and what does not build the model
_NOT_EXTRA = frozenset(
    (
        "model_type",
        "architectures",
        "transformers_version",
        "_name_or_path",
        "torch_dtype",
        "dtype",
        "use_cache",
        "auto_map",
        "quantization_config",
        "_attn_implementation_autoset",
    )
)


@dataclass(frozen=True)
class Block:
    """One kind of decoder layer, as its modules describe it (see the module doc)."""

    family: dict[str, Any]  # the Family fields
    linears: tuple[tuple[str, int, int, str], ...]  # (name in the block, in, out, "attention"/"mlp"/"frozen")
    layer_params: int
    analytic: str  # "" where the analytic formulas describe the block; else why not
    # a mixture of experts: the config keys and values of its expert count, experts per token and
    # expert width, and its shared expert's width (``"shared_width"``; 0: none); {} for a dense MLP
    experts: Mapping[str, int] = field(default_factory=dict)
    first_layer: int = 0  # the index of the first layer of this kind
    # a token mixer that is not softmax attention, beside it or instead of it (:func:`mixers`):
    # what it is, and its class ("" for none)
    mixer: str = ""
    attends: bool = True  # whether it has a softmax attention (Jamba's Mamba layers, Nemotron-H's MLP layers: not)
    # its mixer's Linears whose forward it never calls, reading their weights itself (Jamba's
    # dt_proj): LoRA on them would get no gradient, and bitsandbytes' codes fail there
    uncalled: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Derived:
    """What a model type's modules say of its decoder stack."""

    blocks: tuple[Block, ...]  # each kind of layer, in the order of its first layer
    stack: tuple[int, ...]  # each layer's kind (an index into ``blocks``)
    embedding_params: int  # everything before the blocks (embeddings, their norm, positions)
    head_params: int  # final norm and an untied head


def core_fields(cfg: Any, keys: Mapping[str, str] = {}) -> dict[str, Any]:  # noqa: B006 - read only
    """A config's size fields under ModelSpec's names (``attribute_map`` resolves GPT-2's ``n_embd``;
    ``keys``: a registered family's other names, falcon's ``ffn_hidden_size``)."""

    def get(name: str):
        return getattr(cfg, keys.get(name, name), None)

    heads = get("num_attention_heads")
    hidden = get("hidden_size")
    head_dim = get("head_dim") or (hidden // heads if isinstance(hidden, int) and heads else None)
    return {
        "hidden_size": hidden,
        "num_layers": get("num_hidden_layers"),
        "num_heads": heads,
        # the count the model uses where the config states it (falcon-7b's multi-query: 1), else its own field
        "num_kv_heads": getattr(cfg, "num_key_value_heads", None) or get("num_key_value_heads") or heads,
        "head_dim": head_dim,
        "intermediate_size": get("intermediate_size") or 4 * (hidden or 0),
        "vocab_size": getattr(cfg, "vocab_size", None),
        "max_position_embeddings": getattr(cfg, "max_position_embeddings", None) or 2048,
        "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
    }


def config_class(model_type: str):
    """transformers' config class of a native causal LM, or a SpecError saying why not."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING:
        raise SpecError(
            f"model type {model_type!r} is not one transformers implements; autofit reads only native "
            "transformers architectures (no remote code)"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise SpecError(
            f"model type {model_type!r} has no causal-LM class in transformers (AutoModelForCausalLM); "
            "autofit trains causal LMs (and BERT's masked LM)"
        )
    return CONFIG_MAPPING[model_type]


def extras(cfg: Any, keys: Mapping[str, str] = {}) -> dict[str, Any]:  # noqa: B006 - read only
    """The config keys beyond the size fields, as ``hf_extra`` keeps them to rebuild the model."""
    d = cfg.to_diff_dict() if hasattr(cfg, "to_diff_dict") else dict(cfg)
    # the config's own names of the size fields (GPT-2's n_embd), not of every alias (OLMoE's num_experts)
    aliased = {v for k, v in getattr(cfg, "attribute_map", {}).items() if k in _SIZE_KEYS}
    names = aliased | set(_SIZE_KEYS) | set(keys.values())
    return {k: v for k, v in d.items() if k not in _NOT_EXTRA and k not in names and not k.startswith("_")}


_SIZE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "tie_word_embeddings",
)


def derive(cfg: Any, keys: Mapping[str, str] = {}) -> Derived:  # noqa: B006 - read only
    """Read the decoder stack of the model ``cfg`` builds (a transformers config object): each kind
    of layer from its first layer; ``keys`` as for :func:`core_fields`.

    A stack of layers of several kinds (DeepSeek-V3's and GLM-4.5's dense layers before their MoE
    layers) is read kind by kind, each from a model of its own (a fake forward swaps a model's
    tensors). A kind whose tokens are mixed by something other than softmax attention (Jamba's
    Mamba layers, Qwen3-Next's gated delta rule: :func:`mixers`) is read as any other, and marked
    for the analytic evaluator to trace; a stack with no attention in any layer is refused."""
    _router_loss(cfg)
    model = _build(cfg)
    layers = _decoder_layers(model, cfg)
    _shared_weights(cfg, layers)
    stack = _stack(layers)
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    final = _final_norm(model, layers)
    head_params = sum(p.numel() for p in final.parameters()) if final is not None else 0
    if head is not None:
        head_params += sum(p.numel() for n, p in head.named_parameters() if not (tied and n == "weight"))
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    firsts = [stack.index(kind) for kind in range(max(stack) + 1)]
    if all(_child(layers[i], "attention", ("attention", "attn"))[1] is None for i in firsts):
        _attention(cfg, layers[0])  # no attention in any layer (Mamba, RWKV): not a transformer decoder
    # PEFT remaps a LoRA target by its name in every layer (a dense layer's ``mlp.gate_proj`` too):
    # where any kind routes experts, those names are frozen in every kind
    moe = any(_experts(cfg, layers[i]) for i in firsts)
    remapped = _peft_remaps(cfg.model_type) if moe else frozenset()
    blocks = []
    for kind, first in enumerate(firsts):
        if kind:
            model = _build(cfg)
            layers = _decoder_layers(model, cfg)
        blocks.append(_block(cfg, keys, model, layers[first], final is not None, first, remapped))
    emb = total - sum(blocks[k].layer_params for k in stack) - head_params
    return Derived(tuple(blocks), stack, emb, head_params)


def _block(
    cfg: Any, keys: Mapping[str, str], model, block, final_norm: bool, first: int, remapped: frozenset[str]
) -> Block:
    """One kind of layer, read from ``block`` (its first layer) in ``model``; ``remapped``: the Linear
    names PEFT does not adapt as Linears (:func:`_peft_remaps`). A kind with no attention child
    (Jamba's Mamba layers, Nemotron-H's MLP layers) takes its token mixer, if any, in attention's place."""
    experts = _experts(cfg, block)
    mixing = mixers(block)
    attn = _child(block, "attention", ("attention", "attn"))
    attends = attn[1] is not None and attn[0] not in mixing
    if attn[1] is None and mixing:
        attn = (mixing[0], getattr(block, mixing[0]))
    # the MLP child: the sparse MoE block that holds the experts (GraniteMoE's block_sparse_moe), else by name
    mlp = (experts.child, getattr(block, experts.child)) if experts else _child(block, "MLP", ("mlp", "feedforward"))
    probes = {n: _probe(m) for n, m in block.named_children() if "norm" in type(m).__name__.lower()}
    trace = _trace(model, block, attn, mlp, experts.name if experts else "")
    # a mixer's Linears it never calls, reading their weights itself (not an encoder-decoder's
    # cross-attention, which a causal LM leaves unused)
    uncalled = frozenset(n for n in trace.uncalled if any(n.startswith(m + ".") for m in mixing))
    lin = _linears(cfg, block, tuple(n for n in (attn[0], *mixing) if n), remapped, uncalled)
    fam, why = _family(cfg, keys, model, block, attn, mlp, lin, trace, final_norm, probes, experts)
    mixer = _mixer_text(block, mixing)
    if mixer:  # its saves and transients come from a trace of it (evaluators/traced.py)
        why = "; ".join(x for x in (f"it mixes tokens with {mixer}", why) if x)
    params = sum(p.numel() for p in block.parameters())
    moe = experts.config if experts else {}
    return Block(fam, tuple(x[:4] for x in lin), params, why, moe, first, mixer, attends, uncalled)


# class-name words of transformers' token mixers that are not softmax attention: Mamba and Mamba-2
# (Jamba, Falcon-H1, Nemotron-H, Bamba, Zamba), the gated delta rule (Qwen3-Next), MiniMax's
# lightning attention, LFM2's short convolution
MIXER_WORDS = ("mamba", "mixer", "deltanet", "lightning", "linearattention", "shortconv")


def mixers(block) -> tuple[str, ...]:
    """The block's direct children that mix tokens otherwise than softmax attention: by class name
    (:data:`MIXER_WORDS`), or holding a causal ``nn.Conv1d`` (every state-space, delta-rule and
    short-convolution mixer in transformers has one; no attention does)."""
    import torch

    def mixes(m) -> bool:
        name = type(m).__name__.lower()
        return any(w in name for w in MIXER_WORDS) or any(isinstance(x, torch.nn.Conv1d) for x in m.modules())

    return tuple(n for n, m in block.named_children() if mixes(m))


def _mixer_text(block, mixers: tuple[str, ...]) -> str:
    """What the block's mixers are, for the answer ("" for a block with none)."""
    if not mixers:
        return ""
    return (
        f"a token mixer that is not softmax attention ({', '.join(type(getattr(block, n)).__name__ for n in mixers)})"
    )


@contextlib.contextmanager
def _quiet():
    """transformers' config warnings, and fake_tensor's traceback of an op that fails (reported in one line)."""
    from autofit.specs.models import _quiet_logger

    with (
        _quiet_logger("transformers"),
        _quiet_logger("torch._subclasses.fake_tensor", logging.CRITICAL),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        yield


def _build(cfg: Any):
    import torch
    from transformers import AutoModelForCausalLM

    cfg.use_cache = False
    cfg._attn_implementation = "eager"
    try:
        # in bf16: the one dtype ``torch._grouped_mm``'s meta function takes (an MoE block's experts,
        # evaluators/moe.py); the dtype decides no count or call order read here
        with _quiet(), torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    except Exception as exc:  # noqa: BLE001 - a config its own class cannot build is the user's to fix
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecError(f"transformers cannot build a {cfg.model_type} model from this config: {first[:200]}") from None


def _decoder_layers(model, cfg: Any) -> list:
    """The ModuleList of ``num_hidden_layers`` blocks."""
    import torch

    n = cfg.num_hidden_layers
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n]
    if not lists:
        raise SpecError(f"found no list of {n} decoder layers in transformers' {cfg.model_type} model")
    return list(lists[0])


def _shared_weights(cfg: Any, layers: list) -> None:
    """Refuse layers that share parameters (Zamba's one attention block, called from several
    layers): autofit counts, gathers and shards each layer's own weights."""
    seen: dict[int, int] = {}
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            if seen.setdefault(id(p), i) != i:
                raise SpecError(
                    f"{cfg.model_type}'s layers {seen[id(p)]} and {i} share parameters ({type(layer).__name__}): "
                    "autofit models layers that each hold their own weights"
                )


def _stack(layers: list) -> tuple[int, ...]:
    """Each layer's kind, numbered in the order of first appearance: layers are of one kind when
    they are of one class with the same parameters (names and shapes). Layers that differ only in
    what no parameter shows (Gemma-2's sliding and global attention) are one kind; the config's
    ``layer_types`` tells them apart where the step needs it (``evaluators/unroll.py``)."""
    kinds: dict[tuple, int] = {}
    return tuple(
        kinds.setdefault((type(b).__name__, tuple((n, tuple(p.shape)) for n, p in b.named_parameters())), len(kinds))
        for b in layers
    )


def _attention(cfg: Any, block):
    """The block's attention child ``(name, module)``; refused where it has none."""
    attn = _child(block, "attention", ("attention", "attn"))
    if attn[1] is None:
        raise SpecError(
            f"{cfg.model_type}'s decoder layer {type(block).__name__} has no attention module: autofit models "
            "transformer decoders (attention and MLP blocks), and this is not one"
        )
    return attn


def _child(block, cls_word: str, names: tuple[str, ...]):
    """The block's direct child for attention or the MLP: by class name, else by attribute name
    (never a norm: GraniteMoeHybrid's Mamba layers have a ``post_attention_layernorm``)."""
    children = [(n, c) for n, c in block.named_children() if "norm" not in type(c).__name__.lower()]
    for name, child in children:
        if cls_word.lower() in type(child).__name__.lower():
            return name, child
    for name, child in children:
        if any(w in name.replace("_", "").lower() for w in names):
            return name, child
    return None, None


def _peft_remaps(model_type: str) -> frozenset[str]:
    """The Linear names PEFT does not adapt as Linears in an MoE model of this type: for the types
    transformers 5 fused the experts of, ``peft.utils.transformers_weight_conversion`` turns a target
    named (or ending in) ``gate_proj``/``up_proj``/``down_proj`` (Mixtral's ``w1``..``w3``) into LoRA on
    every routed expert's 3-D weights (``target_parameters``), whatever Linear it named (a shared
    expert's). Empty where PEFT does not (or cannot be imported)."""
    try:
        from peft.utils import transformers_weight_conversion as conv
    except ImportError:  # pragma: no cover - peft is a dependency
        return frozenset()
    base = getattr(conv, "_MODEL_TO_CONVERSION_PATTERN", {}).get(model_type)
    return frozenset(getattr(conv, "_MOE_TARGET_MODULE_MAPPING", {}).get(base, {}))


def _linears(
    cfg: Any, block, mixing: tuple[str, ...], remapped: frozenset[str], uncalled: frozenset[str] = frozenset()
) -> list[tuple[str, int, int, str, bool]]:
    """``(name, in, out, part, bias)`` of the block's Linear (and GPT-2 Conv1D) layers, in order.
    A router is none, though PhiMoE's subclasses ``nn.Linear``: it returns a tuple, which a PEFT
    wrapper breaks, and transformers' ``replace_with_bnb_linear`` leaves subclasses unquantized.
    ``part``: ``attention`` for those of the children that mix tokens (``mixing``: attention, and a
    Mamba or delta-rule mixer beside or instead of it), ``mlp``, or ``frozen`` for a Linear LoRA
    cannot target by name (``remapped``: PEFT adapts the routed experts instead, :func:`_peft_remaps`;
    what PEFT refuses to adapt in a Mamba model, :func:`_peft_refuses`), or should not: one the block
    never calls (``uncalled``, Jamba's ``dt_proj``), whose adapter would get no gradient."""
    import torch

    out = []
    for name, m in block.named_modules():
        if isinstance(m, torch.nn.Linear) and not hasattr(m, "top_k"):  # routers carry their top-k
            i, o = m.in_features, m.out_features
        elif type(m).__name__ == "Conv1D" and hasattr(m, "nf"):
            i, o = m.weight.shape
        else:
            continue
        part = "attention" if any(name == n or name.startswith(n + ".") for n in mixing) else "mlp"
        short = name.rsplit(".", 1)[-1]
        if (part == "mlp" and short in remapped) or _peft_refuses(cfg.model_type, short) or name in uncalled:
            part = "frozen"
        out.append((name, int(i), int(o), part, getattr(m, "bias", None) is not None))
    return out


@functools.lru_cache(maxsize=256)
def _peft_refuses(model_type: str, name: str) -> bool:
    """Whether PEFT refuses LoRA on a module of this name in a model of this type: it does on a Mamba
    mixer's ``out_proj`` (``peft.tuners.tuners_utils._check_lora_target_modules_mamba``, which is asked
    here rather than copied)."""
    from types import SimpleNamespace

    try:
        from peft import LoraConfig
        from peft.tuners.tuners_utils import _check_lora_target_modules_mamba as check
    except ImportError:  # pragma: no cover - another peft: nothing known refused
        return False
    try:
        check(LoraConfig(), SimpleNamespace(config=SimpleNamespace(model_type=model_type)), name)
    except ValueError:
        return True
    return False


def _router_loss(cfg: Any) -> None:
    """Refuse the load-balancing loss: it keeps every layer's router logits until the loss, which
    a block's trace cannot see (the registered MoE families refuse it too, ``config_fixed``)."""
    if getattr(cfg, "output_router_logits", False):
        raise SpecError(
            f"{cfg.model_type}: output_router_logits is true (the load-balancing loss keeps every layer's router "
            "logits); autofit models MoE training without it: set it to false"
        )


@dataclass(frozen=True)
class _Experts:
    """A block's routed experts, as transformers' ``use_experts_implementation`` runs them."""

    name: str  # the experts module in the block (``mlp.experts``)
    child: str  # the block's child that holds them (``mlp``, GraniteMoE's ``block_sparse_moe``)
    family: Mapping[str, str]  # the Family's MoE fields: the config keys of count, top-k and width
    config: Mapping[str, int]  # those keys' values, and "shared_width" (the shared expert's; 0: none)
    why: tuple[str, ...]  # what of them the block formulas do not describe


def _experts(cfg: Any, block) -> _Experts | None:
    """The block's routed experts, or None for a dense MLP. Only experts transformers runs through
    ``integrations.moe.use_experts_implementation`` (the grouped GEMM over ``tokens × k`` rows, whose
    memory does not depend on the routing: ``evaluators/moe.py``) have a routing assumption; any
    other set of experts (a loop over an ``nn.ModuleList``, JetMoE's own kernels) is refused."""
    import torch

    grouped = [(n, m) for n, m in block.named_modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed")]
    if not grouped:
        looped = [
            type(m).__name__
            for n, m in block.named_modules()
            if "expert" in f"{n.rsplit('.', 1)[-1]} {type(m).__name__}".lower()
            and (isinstance(m, torch.nn.ModuleList) or any(p.dim() == 3 for p in m.parameters(recurse=False)))
        ]
        if looped:
            raise SpecError(
                f"{cfg.model_type}'s experts ({looped[0]}) are not run by transformers' grouped experts "
                "(use_experts_implementation), whose memory does not depend on the routing: autofit has no routing "
                "assumption for them"
            )
        return None
    name, ex = grouped[0]
    if len(grouped) > 1 or not ex.has_gate:
        what = "more than one set of experts" if len(grouped) > 1 else "experts without a gate"
        raise SpecError(f"{cfg.model_type}'s block has {what}; autofit models gated experts (SiLU(gate)·up -> down)")
    count, hidden = int(ex.gate_up_proj.shape[0]), int(ex.gate_up_proj.shape[1 if ex.is_transposed else 2])
    width = int(ex.down_proj.shape[1] if ex.is_transposed else ex.down_proj.shape[2])
    # the sparse MoE block holding the experts, their router and a shared expert (``mlp``)
    parent = name.rsplit(".", 1)[0] if "." in name else None
    inside = [
        (n, m)
        for n, m in block.named_modules()
        if parent is not None and (n == parent or n.startswith(parent + ".")) and not n.startswith(name)
    ]
    d = cfg.to_dict()
    top_k = next((int(m.top_k) for _, m in inside if isinstance(getattr(m, "top_k", None), int)), None)
    top_k = top_k or next((d[k] for k in TOP_K_KEYS if isinstance(d.get(k), int)), 0)
    if not top_k:
        raise SpecError(f"{cfg.model_type}: the config sets no experts per token ({', '.join(TOP_K_KEYS)})")
    family = {
        "experts_key": _config_key(cfg, d, EXPERT_COUNT_KEYS, count, "expert count"),
        "top_k_key": _config_key(cfg, d, TOP_K_KEYS, top_k, "top-k"),
        "expert_width_key": ""
        if width == getattr(cfg, "intermediate_size", None)
        else _config_key(cfg, d, tuple(k for k in d if k.endswith("intermediate_size")), width, "expert width"),
    }
    config = {key: d[key] for key in family.values() if key}
    # the shared expert: the Linears beside the experts whose output is the hidden size
    config["shared_width"] = sum(
        m.in_features for _, m in inside if isinstance(m, torch.nn.Linear) and m.out_features == hidden
    )
    why = []
    if ex.has_bias:
        why.append("its experts have biases")
    if ex.has_post_expert_norm:
        why.append("its experts norm their outputs")
    # ``use_experts_implementation`` installs ``_default_apply_gate`` where a class has none of its own
    if getattr(type(ex)._apply_gate, "__name__", "") != "_default_apply_gate":
        why.append(f"its experts gate with {type(ex).__name__}._apply_gate, not the activation of gate times up")
    jitter = [k for k in ("router_jitter_noise", "input_jitter_noise") if getattr(cfg, k, None)]
    if jitter:
        why.append(f"its router adds noise ({jitter[0]} = {getattr(cfg, jitter[0])})")
    return _Experts(name, name.split(".", 1)[0], family, config, tuple(why))


def _config_key(cfg: Any, d: Mapping[str, Any], keys: tuple[str, ...], value: int, what: str) -> str:
    """The config key among ``keys`` that holds an MoE block's ``value``, or a SpecError."""
    for key in keys:
        if d.get(key) == value:
            return key
    raise SpecError(
        f"{cfg.model_type}'s experts have {what} {value}, which no config key autofit knows holds "
        f"({', '.join(keys) or 'none'})"
    )


def _final_norm(model, layers):
    """The norm after the last block (``model.norm``, ``ln_f``): the last parameterized module
    outside the blocks and the head, when its class is a norm."""
    inside = {id(m) for b in layers for m in b.modules()}
    head = model.get_output_embeddings()
    skip = inside | ({id(m) for m in head.modules()} if head is not None else set())
    last = None
    for m in model.modules():
        if id(m) not in skip and not list(m.children()) and any(True for _ in m.parameters(recurse=False)):
            last = m
    return last if last is not None and "norm" in type(last).__name__.lower() else None


@dataclass(frozen=True)
class _Trace:
    order: tuple[str, ...]  # the block's children (and its attention's norms) in call order
    reads_input: frozenset[str]  # those whose first argument is the block's input
    reads: Mapping[str, str]  # child -> the child whose output it reads ("" when none)
    router_fp32: bool = False  # the experts got fp32 routing weights beside 16-bit hidden states
    uncalled: frozenset[str] = frozenset()  # the block's Linears it never calls (their full names)


def _trace(model, block, attn, mlp, experts: str) -> _Trace:
    """One forward on fake tensors, recording the order in which the first block calls its
    children and the tensors they read (identity of fake tensors), and the dtype of the routing
    weights its ``experts`` module is given (the model is bf16 here)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    _fake_tensors(model, mode)
    order: list[str] = []
    inputs: dict[str, int] = {}
    outputs: dict[int, str] = {}
    block_in: list[int] = []
    watched = dict(block.named_children())
    if attn[1] is not None:
        watched.update({f"{attn[0]}.{n}": m for n, m in attn[1].named_children() if "norm" in n.lower()})

    def first(args, kwargs):
        t = args[0] if args else kwargs.get("hidden_states")
        return id(t) if isinstance(t, torch.Tensor) else 0

    def reads(name: str):
        def hook(module, args, kwargs) -> None:
            if name:
                inputs.setdefault(name, first(args, kwargs))
            else:
                block_in.append(first(args, kwargs))

        return hook

    def wrote(name: str):
        def hook(module, args, out) -> None:
            _record(name, out, order, outputs)

        return hook

    routed: list[bool] = []

    def routing(module, args, kwargs) -> None:  # experts(hidden_states, top_k_index, top_k_weights)
        weights = args[2] if len(args) > 2 else kwargs.get("top_k_weights")
        routed.append(isinstance(weights, torch.Tensor) and weights.dtype == torch.float32)

    called: set[str] = set()
    hooks = [block.register_forward_pre_hook(reads(""), with_kwargs=True)]
    for name, m in block.named_modules():
        if isinstance(m, torch.nn.Linear):
            hooks.append(m.register_forward_pre_hook(lambda *_, n=name: called.add(n)))
    if experts:
        hooks.append(_module(block, experts).register_forward_pre_hook(routing, with_kwargs=True))
    for name, m in watched.items():
        hooks.append(m.register_forward_pre_hook(reads(name), with_kwargs=True))
        hooks.append(m.register_forward_hook(wrote(name)))
    try:
        with _quiet(), mode:
            model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    except Exception as exc:  # noqa: BLE001 - a model the tracer cannot run is reported, not crashed on
        raise SpecError(
            f"cannot trace transformers' {type(model).__name__} on fake tensors ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:160] if str(exc) else ''}); autofit cannot model it"
        ) from None
    finally:
        for h in hooks:
            h.remove()
    reads = {n: outputs.get(i, "") for n, i in inputs.items()}
    first_in = frozenset(n for n, i in inputs.items() if block_in and i == block_in[0])
    linears = {n for n, m in block.named_modules() if isinstance(m, torch.nn.Linear) and not hasattr(m, "top_k")}
    return _Trace(tuple(order), first_in, reads, bool(routed and routed[0]), frozenset(linears - called))


def _record(name: str, out, order: list[str], outputs: dict[int, str]) -> None:
    if name in order:
        return
    order.append(name)
    t = out[0] if isinstance(out, tuple) else out
    outputs[id(t)] = name


def _fake_tensors(model, mode) -> None:
    """Swap the meta model's parameters and buffers for fake tensors, keeping ties (as
    ``evaluators.runtime.to_fake`` does for the simulator, without its quantization)."""
    import torch

    memo: dict[int, Any] = {}

    def fake(t):
        if id(t) not in memo:
            with mode:
                memo[id(t)] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        return memo[id(t)]

    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                key = ("p", id(p))
                if key not in memo:
                    memo[key] = torch.nn.Parameter(fake(p), requires_grad=p.requires_grad)
                m._parameters[name] = memo[key]
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = fake(b)
        for name, v in list(vars(m).items()):
            if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and v.device.type == "meta":
                setattr(m, name, fake(v))


def _family(
    cfg: Any,
    keys,
    model,
    block,
    attn,
    mlp,
    lin,
    trace: _Trace,
    final_norm: bool,
    probes: Mapping[str, bool],
    experts: _Experts | None,
) -> tuple[dict[str, Any], str]:
    """The Family fields the block's modules and call order give, and why the analytic
    formulas do not describe it ("" where they do)."""
    core = core_fields(cfg, keys)
    why: list[str] = []
    norms = [n for n in trace.order if "." not in n and "norm" in type(getattr(block, n)).__name__.lower()]
    shape, norm_position, parallel = _block_order(trace, norms, attn[0], mlp[0], why)
    norm = _norm_kind([getattr(block, n) for n in norms], core["hidden_size"], why)
    fp32_scales = any(probes.get(n, False) for n in norms)
    heads = [n for n in trace.order if "." in n]
    qk_norm = bool(heads)
    if heads and any(sum(p.numel() for p in _module(block, n).parameters()) != core["head_dim"] for n in heads):
        why.append("it norms q and k over more than one head")
    attention, mlp_part = _projections(lin, core, why, experts is not None)
    activation = next((getattr(cfg, k) for k in ACTIVATION_KEYS if getattr(cfg, k, None)), "")
    gated = len(mlp_part["in"]) == 2 or mlp_part.get("fused_gate", False) or experts is not None
    known = GATED_ACTIVATIONS if gated else PLAIN_ACTIVATIONS
    if activation not in known:
        why.append(f"its MLP's activation {activation!r} is not one the formulas know ({', '.join(known)})")
    positions = _positions(cfg, model, core, why)
    _unmodelled(cfg, why)
    head = model.get_output_embeddings()
    emb = model.get_input_embeddings()
    rotary = _rotary_fraction(cfg)
    fam = dict(
        model_type=cfg.model_type,
        hf_config=type(cfg).__name__,
        decoder_layer=type(block).__name__,
        task="causal-lm",
        gated_mlp=gated,
        norm=norm,
        norms_per_layer=len(norms),
        final_norm=final_norm,
        qkv_bias=attention["qkv_bias"],
        out_bias=attention["out_bias"],
        mlp_bias=mlp_part["bias"],
        positions=positions,
        attn_impls=tuple(
            k
            for k, ok in (("eager", True), ("sdpa", model._supports_sdpa), ("flash2", model._supports_flash_attn))
            if ok
        ),
        dropout=False,
        attn_in=attention["in"],
        attn_out=attention["out"],
        mlp_in=mlp_part["in"],
        mlp_out=mlp_part["out"],
        activation=activation if isinstance(activation, str) else "",
        norm_position=norm_position,
        norm_scales_in_fp32=fp32_scales,
        embed_scale=hasattr(emb, "embed_scale") or "scaled" in type(emb).__name__.lower(),
        logit_softcap=bool(
            getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "attn_logit_softcapping", None)
        ),
        # config fields, not properties derived from others (FalconConfig.head_dim)
        has_head_dim_key="head_dim" in cfg.to_dict(),
        has_kv_heads_key=keys.get("num_key_value_heads", "num_key_value_heads") in cfg.to_dict(),
        parallel_residual=parallel,
        head_bias=head is not None and getattr(head, "bias", None) is not None,
        rotary_key="partial_rotary_factor" if rotary < 1 else "",
        rotary_default=rotary,
        qk_norm=qk_norm,
        **({**experts.family, "router_fp32": trace.router_fp32} if experts else {}),
    )
    why.extend(experts.why if experts else ())
    if not shape:
        fam["norm_position"] = "pre"
    return fam, "; ".join(why)


def _unmodelled(cfg: Any, why: list[str]) -> None:
    """Config values the formulas do not model: a dropout probability, a multiplier on a tensor."""
    for key in DROPOUT_KEYS:
        p = getattr(cfg, key, None)
        if isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0:
            why.append(f"it trains with dropout ({key} = {p})")
    scaled = [
        k
        for k, v in vars(cfg).items()
        if (k.endswith("_multiplier") or k in ("logits_scaling", "logit_scale"))
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
        and v != 1
    ]
    if scaled:
        why.append(f"it scales its tensors by {', '.join(sorted(scaled))}")


def _module(block, dotted: str):
    m = block
    for part in dotted.split("."):
        m = getattr(m, part)
    return m


def _block_order(trace: _Trace, norms: list[str], attn: str | None, mlp: str | None, why: list[str]):
    """``(recognized, norm_position, parallel_residual)`` from the block's call order: pre-norm
    (llama, GPT-2), parallel off one norm (phi) or two (gpt_neox), or sandwich (Gemma-2)."""
    if attn is None or mlp is None:
        why.append("its block has no attention or no MLP child the formulas can find")
        return False, "pre", False
    kinds = {attn: "A", mlp: "M", **{n: "N" for n in norms}}
    seq = "".join(kinds[n] for n in trace.order if n in kinds)
    reads_attn = trace.reads.get(mlp, "")
    if seq == "NANM" and norms[1] in trace.reads_input:  # gpt_neox: each branch its own norm of the input
        return True, "pre", True
    if seq == "NANM" and trace.reads.get(attn) == norms[0] and reads_attn == norms[1]:
        return True, "pre", False
    if seq == "NAM" and trace.reads.get(attn) == norms[0] and reads_attn == norms[0]:
        return True, "pre", True
    if seq == "NANNMN" and trace.reads.get(attn) == norms[0] and reads_attn == norms[2]:
        return True, "sandwich", False
    order = ", ".join({"A": "attention", "M": "MLP", "N": "norm"}[c] for c in seq)
    why.append(f"its block runs {order} in an order the formulas do not describe")
    return False, "pre", False


def _norm_kind(norms: list, hidden: int, why: list[str]) -> str:
    """``rmsnorm`` or ``layernorm``: a LayerNorm with weight and bias, or an RMSNorm with one weight."""
    import torch

    kinds = {type(n).__name__ for n in norms}
    if len(kinds) != 1:
        why.append(f"its norms are of {len(kinds)} kinds ({', '.join(sorted(kinds)) or 'none'})")
        return "rmsnorm"
    n = norms[0]
    params = dict(n.named_parameters())
    if isinstance(n, torch.nn.LayerNorm):
        if set(params) != {"weight", "bias"} or params["weight"].numel() != hidden:
            why.append("its LayerNorm has no weight and bias of the hidden size")
        return "layernorm"
    if "rms" not in type(n).__name__.lower() or set(params) != {"weight"} or params["weight"].numel() != hidden:
        why.append(f"its norm {type(n).__name__} is neither a LayerNorm nor an RMSNorm with one weight")
    return "rmsnorm"


def _probe(norm) -> bool:
    """Whether an RMSNorm scales by ``1 + weight`` (Gemma, in fp32), probed on a real copy of the
    meta module: with a zero weight llama's returns zeros and Gemma's the normed input."""
    import copy

    import torch

    weight = getattr(norm, "weight", None)
    if isinstance(norm, torch.nn.LayerNorm) or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return False
    try:
        probe = copy.deepcopy(norm).to_empty(device="cpu")
        with torch.no_grad():
            probe.weight.zero_()
            out = probe(torch.randn(2, weight.numel()))
    except Exception:  # noqa: BLE001 - a norm that cannot run alone is not Gemma's
        return False
    return bool(out.abs().sum() > 0)


def _projections(lin, core: dict[str, Any], why: list[str], moe: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The attention's q/k/v (or fused qkv) and output projections and the MLP's, by shape (an
    MoE block's Linears are its shared expert's, which the block formulas do not name: none)."""
    h, qd, kd, inter = core["hidden_size"], core["num_heads"] * core["head_dim"], None, core["intermediate_size"]
    kd = core["num_kv_heads"] * core["head_dim"]
    att = _output_last([x for x in lin if x[3] == "attention"], qd, h)
    # (a dense block's MLP Linears beside MoE blocks are frozen where PEFT remaps their names: still its MLP)
    mlp = _output_last([x for x in lin if x[3] in ("mlp", "frozen")], inter, h)
    shapes = [(x[1], x[2]) for x in att]
    attention: dict[str, Any] = {"in": tuple(n for n, *_ in att[:-1]), "out": att[-1][0] if att else ""}
    if shapes not in ([(h, qd), (h, kd), (h, kd), (qd, h)], [(h, qd + 2 * kd), (qd, h)]):
        why.append(f"its attention projections {shapes} are not q, k, v and out (or fused qkv and out)")
    if moe:
        attention["qkv_bias"], attention["out_bias"] = _biases(att, why, "attention")
        return attention, {"in": (), "out": "", "bias": False}
    mshapes = [(x[1], x[2]) for x in mlp]
    mlp_part: dict[str, Any] = {"in": tuple(n for n, *_ in mlp[:-1]), "out": mlp[-1][0] if mlp else ""}
    if mshapes == [(h, 2 * inter), (inter, h)]:
        mlp_part["fused_gate"] = True
    elif mshapes not in ([(h, inter), (h, inter), (inter, h)], [(h, inter), (inter, h)]):
        why.append(f"its MLP projections {mshapes} are not gate, up and down (or fc1 and fc2)")
    attention["qkv_bias"], attention["out_bias"] = _biases(att, why, "attention")
    mlp_part["bias"] = all(_biases(mlp, why, "MLP"))
    return attention, mlp_part


def _output_last(layers: list, width: int, hidden: int) -> list:
    """The layers with the output projection (``width -> hidden``) last, as the formulas list them
    (Phi-3 registers ``o_proj`` before ``qkv_proj``)."""
    outs = [i for i, x in enumerate(layers) if (x[1], x[2]) == (width, hidden)]
    if not outs:
        return layers
    k = outs[-1]
    return layers[:k] + layers[k + 1 :] + [layers[k]]


def _biases(layers, why: list[str], what: str) -> tuple[bool, bool]:
    """Whether the input projections and the output projection have biases (each all or none)."""
    flags = [x[4] for x in layers]
    if not flags:
        return False, False
    ins, out = flags[:-1], flags[-1]
    if len(set(ins)) > 1:
        why.append(f"only some of its {what} input projections have biases")
    return bool(ins and ins[0]), out


def _positions(cfg: Any, model, core: dict[str, Any], why: list[str]) -> str:
    """``rope`` (a rotary module and a rope config), ``learned`` (a table of positions), else why not."""
    import torch

    names = {type(m).__name__.lower() for m in model.modules()}
    if any("rotary" in n for n in names) and (
        getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_theta", None)
    ):
        return "rope"
    emb = model.get_input_embeddings()
    tables = [
        m
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding) and m is not emb and m.num_embeddings >= core["max_position_embeddings"]
    ]
    if tables:
        if tables[0].num_embeddings != core["max_position_embeddings"]:
            why.append(f"its position table has {tables[0].num_embeddings:,} rows, not max_position_embeddings")
        return "learned"
    why.append("it has neither rotary nor learned positions")
    return "rope"


def _rotary_fraction(cfg: Any) -> float:
    frac = getattr(cfg, "partial_rotary_factor", None)
    rope = getattr(cfg, "rope_parameters", None)
    if frac is None and isinstance(rope, Mapping):
        frac = rope.get("partial_rotary_factor")
    return float(frac) if isinstance(frac, (int, float)) and 0 < frac <= 1 else 1.0

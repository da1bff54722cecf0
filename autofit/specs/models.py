"""Model specs: the architecture of what is trained, as data.

A :class:`ModelSpec` holds the handful of config fields that decide memory and time
(hidden size, layers, heads, KV heads, head dim, intermediate size, vocab, tied
embeddings, max positions). The *family* (the transformers ``model_type``) decides the
shape of the block: gated (SwiGLU/GeGLU) or plain MLP, RMSNorm or LayerNorm, how many
norms a layer has and where, biases (the output head's included), rotary (whole or
partial), learned or ALiBi positions, attention and MLP in sequence or in parallel off
the block input, an embedding norm. A few config fields that change the block per model
(a partial rotary fraction, a dropout probability) ride in ``hf_extra`` under the
config's own names, read through the family (``rotary_key``, ``dropout_keys``).
Families and named models are plain dicts, like LitGPT's ``config.py``; ``ModelSpec``
derives the parameter count from the fields and the registry states it, so a typo in
either shows up in the tests.

Imports without torch; ``to_hf_config`` imports transformers lazily.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from autofit.errors import SpecError


@dataclass(frozen=True)
class Family:
    """Everything that differs between transformers ``model_type``s, as fields.

    Every place that treats families differently reads a field here (LitGPT's habit: each
    difference is part of the config), so a new family is one entry in ``FAMILIES``.
    """

    model_type: str
    hf_config: str  # class name in transformers
    decoder_layer: str  # transformers' block class: what FSDP wraps and checkpoints as one unit
    task: str  # "causal-lm" or "masked-lm" (decides the head and the loss)
    gated_mlp: bool  # SwiGLU/GeGLU: gate, up, down; else fc1, fc2
    norm: str  # "rmsnorm" or "layernorm"
    norms_per_layer: int
    final_norm: bool
    qkv_bias: bool
    out_bias: bool
    mlp_bias: bool
    positions: str  # "rope", "learned" or "alibi" (a per-head bias on the scores: no table, no rotation)
    attn_impls: tuple[str, ...]  # attention kernels transformers implements for it
    dropout: bool  # default config trains with dropout > 0 (saves masks)
    # one block's Linear layers as transformers names them (what PEFT and bitsandbytes
    # match): the q/k/v projections (one name when fused), the attention output, the
    # MLP's input projections (gate and up, fused or not; or a plain MLP's first), its output
    attn_in: tuple[str, ...]
    attn_out: str
    mlp_in: tuple[str, ...]
    mlp_out: str
    # transformers' activation name: "silu", "gelu_pytorch_tanh", "gelu_new" (GPT-2's
    # NewGELU, written in Python ops that each save a tensor), "gelu" (exact: saves its input),
    # "bloom_gelu" (BLOOM's own tanh-GELU autograd Function: saves its input, its backward
    # is Python ops)
    activation: str
    # where the norms sit: "pre" (before attention and MLP), "post" (BERT: after each
    # residual add) or "sandwich" (Gemma-2: before and after both)
    norm_position: str = "pre"
    norm_scales_in_fp32: bool = False  # RMSNorm applies (1 + weight) in fp32 and saves that input (Gemma)
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden) (gemma)
    embed_norm: bool = False  # a LayerNorm on the embeddings (BERT)
    token_types: int = 0  # token-type embeddings (BERT: 2)
    logit_softcap: bool = False  # tanh soft-capping of attention scores and final logits (gemma2)
    liger: bool = False  # Liger has a fused linear-cross-entropy patch for it (liger_kernel.transformers)
    # config field names where the family does not use the llama names
    keys: Mapping[str, str] = field(default_factory=dict)
    has_head_dim_key: bool = True  # config accepts an explicit head_dim
    has_kv_heads_key: bool = True  # config has num_key_value_heads (grouped-query attention)
    tied_by_default: bool = False  # the config class ties the embeddings when the file does not say
    # attention and MLP both read the block input and their outputs join the residual in
    # one add (phi, gpt_neox's use_parallel_residual); with one norm per layer they read
    # the same normed tensor (phi), with two each has its own norm of the input (gpt_neox)
    parallel_residual: bool = False
    head_bias: bool = False  # the output head has a bias (phi)
    # partial rotary: the config key of the rotated fraction of head_dim and the config
    # class's default for it; a model that differs states it in hf_extra under that key
    rotary_key: str = ""
    rotary_default: float = 1.0
    # dropout probabilities the config sets per model (the family default is 0): config
    # key -> the dropouts it drives ("residual", "embedding"); a model training with one
    # states it in hf_extra (phi-2's resid_pdrop). ``dropout`` above is GPT-2/BERT's all-on
    # default (attention dropout included, which no key here sets)
    dropout_keys: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    mlp_ratio: int = 0  # the MLP width is this × hidden and no config field (bloom: 4); 0: intermediate_size
    # config fields that choose the block this family's fields describe: key -> (the value
    # to_hf_config sets, the values a config may have: None where leaving it out gives that
    # block); from_hf_config refuses another block (falcon-7b's one-norm multi-query block,
    # a sequential gpt_neox)
    config_fixed: Mapping[str, tuple[Any, tuple[Any, ...]]] = field(default_factory=dict)
    # the model builds its 4D causal mask even for unpadded batches (falcon, ready to add
    # ALiBi to it): sdpa gets a mask, saves it, and repeats grouped KV heads
    mask_always: bool = False
    # an RMSNorm over each head of q and of k before RoPE, one weight of head_dim each (Qwen3:
    # ``Qwen3Attention.forward`` in transformers' modeling_qwen3.py)
    qk_norm: bool = False
    # a sparse mixture-of-experts MLP in every block (transformers' ``*SparseMoeBlock``): the
    # config keys of the expert count and of the experts each token is routed to, and of the
    # expert width ("": intermediate_size). "" for a dense MLP. The experts are 3-D parameters
    # (``MixtralExperts.gate_up_proj``: experts x 2·width x hidden, ``down_proj``: experts x
    # hidden x width) run by ``integrations.moe.grouped_mm_experts_forward``, and the router a
    # plain parameter (``MixtralTopKRouter.weight``: experts x hidden): none of them is an
    # ``nn.Linear``, so LoRA, bitsandbytes and autocast leave them as they are.
    experts_key: str = ""
    top_k_key: str = ""
    expert_width_key: str = ""
    # an always-on shared expert beside the routed ones (Qwen2-MoE's ``shared_expert``, a gated
    # MLP of nn.Linear layers named by mlp_in/mlp_out, scaled by the sigmoid of
    # ``shared_expert_gate``, a hidden -> 1 Linear): the config key of its width ("": none)
    shared_expert_key: str = ""
    # the router's top-k weights stay fp32 (``MixtralTopKRouter``: softmax in fp32, no cast back),
    # so the experts' weighted output and its gradients are fp32; else they are cast to the router
    # logits' dtype (Qwen2/3-MoE, OLMoE)
    router_fp32: bool = False

    def config_key(self, name: str) -> str:
        """The config field under its llama ``name``, as this family's config names it ("": none)."""
        return self.keys.get(name, name)

    @property
    def fused_kernels(self) -> bool:
        """Liger's RMSNorm, SwiGLU and RoPE kernels fit the block (``evaluators.fused``): llama's
        pre-norm RMSNorm block (weights applied as they are), separate gate and up projections
        with SiLU, and full rotary embeddings, in a family Liger patches."""
        return (
            self.liger
            and self.norm == "rmsnorm"
            and self.norm_position == "pre"
            and not self.norm_scales_in_fp32
            and self.gated_mlp
            and self.activation == "silu"
            and self.mlp_in == ("gate_proj", "up_proj")
            and self.positions == "rope"
            and not self.rotary_key
        )

    @property
    def fused_qkv(self) -> bool:
        """One qkv projection (phi3, gpt2)."""
        return len(self.attn_in) == 1

    @property
    def moe(self) -> bool:
        """Every block's MLP is a routed mixture of experts."""
        return bool(self.experts_key)

    @property
    def moe_keys(self) -> tuple[str, ...]:
        """The config keys an MoE model states in ``hf_extra``: experts, experts per token, width."""
        keys = (self.experts_key, self.top_k_key, self.expert_width_key, self.shared_expert_key)
        return tuple(k for k in keys if k)


_LLAMA_LIKE = dict(
    task="causal-lm",
    gated_mlp=True,
    norm="rmsnorm",
    norms_per_layer=2,
    final_norm=True,
    qkv_bias=False,
    out_bias=False,
    mlp_bias=False,
    positions="rope",
    attn_impls=("eager", "sdpa", "flash2"),
    dropout=False,
    attn_in=("q_proj", "k_proj", "v_proj"),
    attn_out="o_proj",
    mlp_in=("gate_proj", "up_proj"),
    mlp_out="down_proj",
    activation="silu",
    liger=True,
)

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in [
        Family("llama", "LlamaConfig", "LlamaDecoderLayer", **_LLAMA_LIKE),
        Family("mistral", "MistralConfig", "MistralDecoderLayer", **_LLAMA_LIKE),
        Family(
            "qwen2", "Qwen2Config", "Qwen2DecoderLayer", **{**_LLAMA_LIKE, "qkv_bias": True}, has_head_dim_key=False
        ),
        # Qwen3 (dense; modeling_qwen3.py): llama's block without biases, with per-head q/k RMSNorm
        Family("qwen3", "Qwen3Config", "Qwen3DecoderLayer", **_LLAMA_LIKE, qk_norm=True),
        # Mixtral (modeling_mixtral.py): mistral's attention, and a MixtralSparseMoeBlock for the
        # MLP: a top-k router over num_local_experts SwiGLU experts as wide as intermediate_size.
        # Router jitter and the load-balancing loss (output_router_logits) are refused: they add
        # tensors the estimators do not model.
        Family(
            "mixtral",
            "MixtralConfig",
            "MixtralDecoderLayer",
            **{**_LLAMA_LIKE, "mlp_in": (), "mlp_out": "", "liger": False},
            experts_key="num_local_experts",
            top_k_key="num_experts_per_tok",
            router_fp32=True,
            config_fixed={
                "router_jitter_noise": (0.0, (None, 0, 0.0)),
                "output_router_logits": (False, (None, False)),
            },
        ),
        # Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B; modeling_qwen2_moe.py): Qwen2's attention (q/k/v
        # biases) and Qwen2MoeSparseMoeBlock in every layer: num_experts routed experts of
        # moe_intermediate_size, and a shared expert of shared_expert_intermediate_size whose output
        # is scaled by sigmoid(shared_expert_gate(x)) and added to theirs
        Family(
            "qwen2_moe",
            "Qwen2MoeConfig",
            "Qwen2MoeDecoderLayer",
            **{**_LLAMA_LIKE, "qkv_bias": True, "liger": False},
            has_head_dim_key=False,
            experts_key="num_experts",
            top_k_key="num_experts_per_tok",
            expert_width_key="moe_intermediate_size",
            shared_expert_key="shared_expert_intermediate_size",
            config_fixed={
                "decoder_sparse_step": (1, (None, 1)),
                "mlp_only_layers": ([], (None, [])),
                "output_router_logits": (False, (None, False)),
                "use_sliding_window": (False, (None, False)),
            },
        ),
        # Qwen3-MoE (modeling_qwen3_moe.py): Qwen3's attention (q/k norms) and Qwen3MoeSparseMoeBlock
        # in every layer (decoder_sparse_step 1, no mlp_only_layers): num_experts experts of
        # moe_intermediate_size, top-k weights renormalized (norm_topk_prob)
        Family(
            "qwen3_moe",
            "Qwen3MoeConfig",
            "Qwen3MoeDecoderLayer",
            **{**_LLAMA_LIKE, "mlp_in": (), "mlp_out": "", "liger": False},
            qk_norm=True,
            experts_key="num_local_experts",  # config.json's num_experts (Qwen3MoeConfig.attribute_map)
            top_k_key="num_experts_per_tok",
            expert_width_key="moe_intermediate_size",
            config_fixed={
                "decoder_sparse_step": (1, (None, 1)),
                "mlp_only_layers": ([], (None, [])),
                "output_router_logits": (False, (None, False)),
            },
        ),
        Family(
            "gemma2",
            "Gemma2Config",
            "Gemma2DecoderLayer",
            # transformers implements no sdpa path for Gemma-2 (soft-capped attention)
            **{
                **_LLAMA_LIKE,
                "norms_per_layer": 4,
                "attn_impls": ("eager", "flash2"),
                "activation": "gelu_pytorch_tanh",
            },
            norm_position="sandwich",
            norm_scales_in_fp32=True,
            embed_scale=True,
            logit_softcap=True,
        ),
        Family(
            "phi3",
            "Phi3Config",
            "Phi3DecoderLayer",
            **{**_LLAMA_LIKE, "attn_in": ("qkv_proj",), "mlp_in": ("gate_up_proj",)},
            has_head_dim_key=False,
        ),
        # Gemma 1: llama's block with GeGLU, (1 + w) RMSNorm in fp32 and the sqrt(hidden)
        # embedding scale (modeling_gemma.py); tied, as GemmaConfig ties by default
        Family(
            "gemma",
            "GemmaConfig",
            "GemmaDecoderLayer",
            **{**_LLAMA_LIKE, "activation": "gelu_pytorch_tanh"},
            norm_scales_in_fp32=True,
            embed_scale=True,
            tied_by_default=True,
        ),
        # Phi-1.5/Phi-2 (modeling_phi.py): one LayerNorm feeds attention and MLP in parallel,
        # q/k/v and dense with biases, rotary on the first partial_rotary_factor of head_dim
        # (PhiConfig's default 0.5), fc1 -> gelu_new -> fc2, untied head with a bias
        Family(
            "phi",
            "PhiConfig",
            "PhiDecoderLayer",
            task="causal-lm",
            gated_mlp=False,
            norm="layernorm",
            norms_per_layer=1,
            final_norm=True,
            qkv_bias=True,
            out_bias=True,
            mlp_bias=True,
            positions="rope",
            attn_impls=("eager", "sdpa", "flash2"),
            dropout=False,
            attn_in=("q_proj", "k_proj", "v_proj"),
            attn_out="self_attn.dense",
            mlp_in=("fc1",),
            mlp_out="fc2",
            activation="gelu_new",
            has_head_dim_key=False,
            parallel_residual=True,
            head_bias=True,
            rotary_key="partial_rotary_factor",
            rotary_default=0.5,
            dropout_keys={"resid_pdrop": ("residual",), "embd_pdrop": ("embedding",)},
        ),
        # GPT-NeoX (Pythia, StableLM-alpha; modeling_gpt_neox.py): use_parallel_residual (the
        # config default; a sequential config is refused by from_hf_config), a LayerNorm each
        # for attention and MLP, fused query_key_value with bias, rotary on rotary_pct of
        # head_dim (default 0.25), exact GELU, untied embed_out without bias
        Family(
            "gpt_neox",
            "GPTNeoXConfig",
            "GPTNeoXLayer",
            task="causal-lm",
            gated_mlp=False,
            norm="layernorm",
            norms_per_layer=2,
            final_norm=True,
            qkv_bias=True,
            out_bias=True,
            mlp_bias=True,
            positions="rope",
            attn_impls=("eager", "sdpa", "flash2"),
            dropout=False,
            attn_in=("query_key_value",),
            attn_out="attention.dense",
            mlp_in=("dense_h_to_4h",),
            mlp_out="dense_4h_to_h",
            activation="gelu",
            has_head_dim_key=False,
            has_kv_heads_key=False,
            parallel_residual=True,
            rotary_key="rotary_pct",
            rotary_default=0.25,
            dropout_keys={"hidden_dropout": ("residual", "embedding")},
            config_fixed={"use_parallel_residual": (True, (True, None))},
        ),
        # Falcon's new decoder architecture (falcon-40b/180b; modeling_falcon.py): attention
        # and MLP in parallel off two LayerNorms of the block input (ln_attn, ln_mlp), fused
        # query_key_value grouped by KV head, no biases, full rotary, GELU MLP, tied. The
        # first architecture (falcon-7b: one norm, multi-query) is another block: refused.
        Family(
            "falcon",
            "FalconConfig",
            "FalconDecoderLayer",
            task="causal-lm",
            gated_mlp=False,
            norm="layernorm",
            norms_per_layer=2,
            final_norm=True,
            qkv_bias=False,
            out_bias=False,
            mlp_bias=False,
            positions="rope",
            attn_impls=("eager", "sdpa", "flash2"),
            dropout=False,
            attn_in=("query_key_value",),
            attn_out="self_attention.dense",
            mlp_in=("dense_h_to_4h",),
            mlp_out="dense_4h_to_h",
            activation="gelu",
            keys={"num_key_value_heads": "num_kv_heads", "intermediate_size": "ffn_hidden_size"},
            has_head_dim_key=False,
            tied_by_default=True,
            parallel_residual=True,
            mask_always=True,
            config_fixed={
                "new_decoder_architecture": (True, (True,)),
                "parallel_attn": (True, (True, None)),
                "num_ln_in_parallel_attn": (2, (2, None)),
                "alibi": (False, (False, None)),
                "bias": (False, (False, None)),
            },
        ),
        # BLOOM (modeling_bloom.py): ALiBi, a LayerNorm on the embeddings, fused
        # query_key_value with bias, its own attention (baddbmm + fp32 softmax: no sdpa or
        # flash path in transformers), its own tanh-GELU autograd Function, an MLP 4 x hidden
        # wide (no config field), tied
        Family(
            "bloom",
            "BloomConfig",
            "BloomBlock",
            task="causal-lm",
            gated_mlp=False,
            norm="layernorm",
            norms_per_layer=2,
            final_norm=True,
            qkv_bias=True,
            out_bias=True,
            mlp_bias=True,
            positions="alibi",
            attn_impls=("eager",),
            dropout=False,
            attn_in=("query_key_value",),
            attn_out="self_attention.dense",
            mlp_in=("dense_h_to_4h",),
            mlp_out="dense_4h_to_h",
            activation="bloom_gelu",
            embed_norm=True,
            keys={
                "num_hidden_layers": "n_layer",
                "num_attention_heads": "n_head",
                "intermediate_size": "",
                "max_position_embeddings": "seq_length",
            },
            has_head_dim_key=False,
            has_kv_heads_key=False,
            tied_by_default=True,
            dropout_keys={"hidden_dropout": ("residual",)},
            mlp_ratio=4,
        ),
        Family(
            "gpt2",
            "GPT2Config",
            "GPT2Block",
            task="causal-lm",
            gated_mlp=False,
            norm="layernorm",
            norms_per_layer=2,
            final_norm=True,
            qkv_bias=True,
            out_bias=True,
            mlp_bias=True,
            positions="learned",
            attn_impls=("eager", "sdpa", "flash2"),
            dropout=True,
            attn_in=("c_attn",),
            attn_out="attn.c_proj",
            mlp_in=("c_fc",),
            mlp_out="mlp.c_proj",
            activation="gelu_new",
            keys={
                "hidden_size": "n_embd",
                "num_hidden_layers": "n_layer",
                "num_attention_heads": "n_head",
                "intermediate_size": "n_inner",
                "max_position_embeddings": "n_positions",
            },
            has_head_dim_key=False,
            has_kv_heads_key=False,
            tied_by_default=True,
        ),
        Family(
            "bert",
            "BertConfig",
            "BertLayer",
            task="masked-lm",
            gated_mlp=False,
            norm="layernorm",
            norms_per_layer=2,
            final_norm=False,
            qkv_bias=True,
            out_bias=True,
            mlp_bias=True,
            positions="learned",
            attn_impls=("eager", "sdpa"),
            dropout=True,
            attn_in=("query", "key", "value"),
            attn_out="attention.output.dense",
            mlp_in=("intermediate.dense",),
            mlp_out="output.dense",
            activation="gelu",
            norm_position="post",
            embed_norm=True,
            token_types=2,
            has_head_dim_key=False,
            has_kv_heads_key=False,
            tied_by_default=True,
        ),
    ]
}


class _Targets(Protocol):
    """What ``lora_params`` needs of ``plan.LoraTargets`` (specs sits below plan)."""

    def covers(self, part: str) -> bool: ...


# The routing assumption of the MoE estimates (evaluators/moe.py): transformers drops no token,
# so memory does not depend on it; the experts' GEMM sizes, and so their time, do.
ROUTING = "balanced top-k, capacity factor 1: tokens x k / experts rows per expert, none dropped"

# Upper bounds of the size fields, several times the largest published config of each
# (Llama-3.1-405B: hidden 16,384, 126 layers, 128 heads, intermediate 53,248; Gemma: a
# 256,000 vocabulary; Llama-4 Scout: 10M positions). A number beyond them is a typo, and
# taken at its word it makes the estimators build or size a model that never finishes.
MAX_FIELD = {
    "hidden_size": 2**17,
    "num_layers": 2**10,
    "num_heads": 2**12,
    "num_kv_heads": 2**12,
    "head_dim": 2**12,
    "intermediate_size": 2**20,
    "vocab_size": 2**22,
    "max_position_embeddings": 2**25,
}
# transformers' names of the fields where ModelSpec's differ
_HF_NAME = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
}


@dataclass(frozen=True)
class ModelSpec:
    """The architecture fields that decide training memory and time."""

    name: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    n_params: int = 0  # stated; 0 means "derive it"
    source: str = ""  # hub id or path the fields came from
    # further transformers config kwargs that matter to build the exact model
    hf_extra: tuple[tuple[str, Any], ...] = ()
    # a model type no family describes, as its modules describe it (``specs/derive.py``): the
    # Family fields, and the block's Linear layers and parameter counts as transformers builds them
    derived: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        problems = []
        if not self.derived and (not isinstance(self.model_type, str) or self.model_type not in FAMILIES):
            problems.append(
                f"model type {self.model_type!r} is not supported (supported: {', '.join(sorted(FAMILIES))})"
            )
        for name, most in MAX_FIELD.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                problems.append(f"{name} must be a positive integer, got {value!r}")
            elif value > most:
                problems.append(f"{name} {value:,} is beyond the {most:,} any real model has")
        if not isinstance(self.tie_word_embeddings, bool):
            problems.append(f"tie_word_embeddings must be true or false, got {self.tie_word_embeddings!r}")
        if not problems and self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if not problems:
            problems += self._family_problems()
        if problems:
            raise SpecError(f"model {self.name!r}: " + "; ".join(problems))
        derived = self.derived_param_count()
        if self.n_params == 0:
            object.__setattr__(self, "n_params", derived)
        elif self.n_params != derived:
            raise SpecError(
                f"model {self.name!r}: stated parameter count {self.n_params:,} differs from "
                f"the {derived:,} its fields give"
            )

    def _family_problems(self) -> list[str]:
        """What the family's own rules refuse: an MLP width it fixes, a rotary fraction out of range."""
        f, out = self.family, []
        if f.mlp_ratio and self.intermediate_size != f.mlp_ratio * self.hidden_size:
            out.append(
                f"{self.model_type} MLPs are {f.mlp_ratio} x hidden_size wide: intermediate_size must be "
                f"{f.mlp_ratio * self.hidden_size:,}, got {self.intermediate_size:,}"
            )
        try:
            extra = dict(self.hf_extra)
        except (TypeError, ValueError):
            return [*out, f"hf_extra must be (key, value) pairs, got {self.hf_extra!r}"]
        frac = extra.get(f.rotary_key) if f.rotary_key else None
        if frac is not None and not (_is_number(frac) and 0 < frac <= 1):
            out.append(f"{f.rotary_key} must be a fraction in (0, 1], got {frac!r}")
        for key in f.dropout_keys:
            p = extra.get(key)
            if p is not None and not (_is_number(p) and 0 <= p < 1):
                out.append(f"{key} must be a probability in [0, 1), got {p!r}")
        return out + _moe_problems(f, extra)

    @property
    def family(self) -> Family:
        if self.derived:
            return _derived_family(self.derived)
        return FAMILIES[self.model_type]

    @property
    def analytic_gap(self) -> str:
        """Why the analytic evaluator's block formulas do not describe this model ("" where they
        do): a derived block its formulas cannot reproduce (``specs/derive.py``)."""
        return str(dict(self.derived).get("analytic", "")) if self.derived else ""

    @property
    def mixer(self) -> str:
        """A derived block's token mixer that is not softmax attention, beside or instead of it (a
        Mamba, gated-delta-rule or short-convolution mixer: ``specs/derive.py``), "" for none. The
        analytic evaluator traces such a block, its transients too (``evaluators/traced.py``)."""
        return str(self._counted("mixer") or "")

    @property
    def attends(self) -> bool:
        """Whether a block of this kind has softmax attention (Jamba's Mamba layers and Nemotron-H's
        MLP layers do not: ``specs/derive.py``)."""
        return self._counted("attends") is not False

    @property
    def uncalled_linears(self) -> tuple[str, ...]:
        """Linears of its blocks whose forward the block never calls, reading their weights itself
        (Jamba's ``mamba.dt_proj``: ``specs/derive.py``): no LoRA target names them, and bitsandbytes'
        8- or 4-bit codes cannot stand in for their weights."""
        return tuple(sorted({n for _, k in self.layer_kinds() for n in k._counted("uncalled") or ()}))

    @property
    def attending_layers(self) -> int:
        """How many of its layers have softmax attention (all but a hybrid stack's other kinds)."""
        return sum(n for n, k in self.layer_kinds() if k.attends)

    @property
    def derivation(self) -> str:
        """What an answer on a model type no family describes says of it ("" for a registered family)."""
        if not self.derived:
            return ""
        frozen = [n for n, _, _, part in self.linears() if part == "frozen"]
        unadapted = (
            f"; LoRA leaves {', '.join(frozen)} unadapted: PEFT turns a target of that name into LoRA on every "
            "routed expert's weights (peft.utils.transformers_weight_conversion)"
            if frozen
            else ""
        )
        head = f"{self.model_type} is no registered family: its {self.family.decoder_layer}"
        if not self.hybrid:
            return f"{head} block was read from the model transformers builds ({self._block_text()}){unadapted}"
        kinds = "; ".join(
            f"{n} layer{'s' if n > 1 else ''} from layer {k.first_layer} ({k._block_text()})"
            for n, k in self.layer_kinds()
        )
        n = len(self.layer_kinds())
        return f"{head} layers are of {n} kinds, each read from the model transformers builds: {kinds}{unadapted}"

    def _block_text(self) -> str:
        """A derived block's shape, and how the analytic evaluator reads it."""
        f = self.family
        what = "its saves, transients and kernels" if self.mixer else "its saves"
        how = (
            f"the analytic evaluator traces one block for {what}, since {self.analytic_gap}"
            if self.analytic_gap
            else "the analytic evaluator itemizes it as a block of that shape where one traced block confirms "
            "its formulas, and traces it where not"
        )
        mlp = f"{'gated' if f.gated_mlp else 'plain'} {f.activation or '?'} MLP"
        if f.moe:
            ws = self.shared_expert_width
            mlp = (
                f"{self.num_experts} routed {f.activation or '?'} experts {self.expert_width} wide, "
                f"{self.experts_per_token} per token" + (f", a shared expert {ws} wide" if ws else "")
            )
        return f"{f.norm}, {mlp}, {f.positions} positions; {how}"

    def _counted(self, key: str):
        """A derived spec's count or layer list as transformers built it (None: use the formulas)."""
        return dict(self.derived).get(key) if self.derived else None

    # -- the decoder stack ------------------------------------------------------------
    @property
    def hybrid(self) -> bool:
        """Whether the decoder layers are of several kinds (``specs/derive.py``: DeepSeek-V3's dense
        layers before its MoE layers); the spec's own block fields then describe the kind most
        layers are, and :meth:`layer_kinds` each kind."""
        return bool(self._counted("stack"))

    def layer_kinds(self) -> tuple[tuple[int, ModelSpec], ...]:
        """The decoder stack as ``(layers, spec)`` per kind of layer, where ``spec`` describes a block
        of that kind (its block fields, Linears and counts; ``first_layer``: where the kind first
        appears). One entry, the spec itself, unless :attr:`hybrid`. A kind's spec describes a block,
        not a model to build: the analytic evaluator traces one by cutting the stack after
        ``first_layer`` (``evaluators/traced.py``)."""
        return _layer_kinds(self) if self.hybrid else ((self.num_layers, self),)

    @property
    def has_experts(self) -> bool:
        """Whether any of its layers routes experts (a hybrid stack's MoE kind, or every layer)."""
        return any(k.family.moe for _, k in self.layer_kinds())

    @property
    def stack(self) -> tuple[int, ...]:
        """Each decoder layer's kind, an index into :meth:`layer_kinds` (all 0 unless :attr:`hybrid`)."""
        return tuple(self._counted("stack") or (0,) * self.num_layers)

    @property
    def first_layer(self) -> int:
        """The index of the first layer of the kind this spec describes (0 unless it is one of
        :meth:`layer_kinds`)."""
        return int(self._counted("first_layer") or 0)

    @property
    def rotary_fraction(self) -> float:
        """The fraction of head_dim RoPE rotates: 1 for llama, partial for phi and gpt_neox, 0 without RoPE."""
        f = self.family
        if f.positions != "rope":
            return 0.0
        if not f.rotary_key:
            return 1.0
        return float(dict(self.hf_extra).get(f.rotary_key, f.rotary_default))

    @property
    def rotary_dim(self) -> int:
        """Rotated dims per head, as transformers rounds them (``int(head_dim * fraction)``)."""
        return int(self.head_dim * self.rotary_fraction)

    @property
    def position_limit(self) -> int | None:
        """The longest sequence the model can be trained on; None where nothing limits it (ALiBi).

        Learned positions (GPT-2, BERT) index a table of ``max_position_embeddings`` rows: a
        longer sequence crashes. RoPE runs past its positions but was not trained there,
        unless the config scales it (``rope_parameters``: linear, dynamic, yarn, llama3 ...):
        then ``original_max_position_embeddings × factor`` or ``max_position_embeddings ×
        factor`` where the config gives no original (transformers' ``modeling_rope_utils``).
        """
        positions, limit = self.family.positions, self.max_position_embeddings
        if positions == "alibi":
            return None
        rope = dict(dict(self.hf_extra).get("rope_parameters") or ())
        if positions != "rope" or not _is_number(rope.get("factor")):
            return limit
        scaled = rope.get("original_max_position_embeddings") or limit
        return max(limit, int(scaled * rope["factor"]))

    @property
    def dropouts(self) -> frozenset[str]:
        """Where the model trains with dropout: ``attention``, ``residual``, ``embedding``."""
        f = self.family
        if f.dropout:
            return frozenset(("attention", "residual", "embedding"))
        extra = dict(self.hf_extra)
        return frozenset(kind for key, kinds in f.dropout_keys.items() if extra.get(key) for kind in kinds)

    # -- mixture of experts ------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        """Routed experts per block (0: a dense MLP)."""
        return int(dict(self.hf_extra)[self.family.experts_key]) if self.family.moe else 0

    @property
    def experts_per_token(self) -> int:
        """Experts each token is routed to (top-k; 0: a dense MLP)."""
        return int(dict(self.hf_extra)[self.family.top_k_key]) if self.family.moe else 0

    @property
    def routing_assumption(self) -> str:
        """What the estimators assume of an MoE model's router, which fake tensors cannot
        follow ("" for a dense model; evaluators/moe.py says why this one)."""
        moe = next((k for _, k in self.layer_kinds() if k.family.moe), None)
        if moe is None:
            return ""
        return (
            f"MoE routing: each token to {moe.experts_per_token} of {moe.num_experts} experts, spread evenly "
            f"({ROUTING})"
        )

    @property
    def context_parallel_refusal(self) -> str:
        """Why torch's context parallelism cannot train this model as accelerate launches it ("" where
        it can; builds its transformers config once).

        accelerate drops every attention layer's mask for ``is_causal`` (``big_modeling.
        _attach_context_parallel_hooks``) and refuses a model whose ``supports_context_parallel`` is
        false. transformers 5.25 (``PreTrainedModel.supports_context_parallel``) allows only full causal
        attention: every entry of the text config's ``layer_types`` "full_attention", or, where a config
        has none, no ``sliding_window`` (Mistral's configs before v0.3 set one for every layer). A mixer
        that carries a state along the sequence (Mamba, the gated delta rule, a short convolution) never
        has it exchanged between the ranks, whatever the config says: refused as well."""
        return _context_parallel_refusal(self)

    @property
    def mixer_assumption(self) -> str:
        """What the estimators assume of its token mixers that are not softmax attention ("" for a
        model with none): their torch code, as transformers runs it without kernels."""
        mixers = sorted({k.mixer.split("(", 1)[-1].rstrip(")") for _, k in self.layer_kinds() if k.mixer})
        if not mixers:
            return ""
        return (
            f"its mixers ({', '.join(mixers)}) are estimated as their torch code runs, which is what transformers "
            "runs without mamba-ssm, causal-conv1d or flash-linear-attention installed; with them (or the Hub's "
            "kernels) it runs their fused kernels instead, which hold less and run faster "
            "(transformers.integrations.hub_kernels.use_kernel_func_from_hub_with_fallback): the measured evaluator "
            "runs what is installed"
        )

    @property
    def shared_expert_width(self) -> int:
        """The shared expert's MLP width (Qwen2-MoE; 0: none)."""
        if self.derived:  # read from the block's Linears beside its experts (DeepSeek's n_shared_experts wide)
            return int(self._counted("shared_width") or 0)
        key = self.family.shared_expert_key
        return int(dict(self.hf_extra)[key]) if key else 0

    @property
    def expert_width(self) -> int:
        """One expert's MLP width (Mixtral: intermediate_size; Qwen3-MoE: moe_intermediate_size)."""
        key = self.family.expert_width_key
        return int(dict(self.hf_extra)[key]) if key else self.intermediate_size

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    # -- parameter counts -------------------------------------------------------------
    def embedding_params(self) -> int:
        if self._counted("params"):
            return self._counted("params")[0]
        f, h = self.family, self.hidden_size
        n = self.vocab_size * h
        if f.positions == "learned":
            n += self.max_position_embeddings * h
        n += f.token_types * h + (2 * h if f.embed_norm else 0)  # BERT's token types; BERT/BLOOM embedding norm
        return n

    def layer_params(self) -> int:
        """Parameters of one transformer block (of a hybrid stack's largest block)."""
        if self.hybrid:
            return max(k.layer_params() for _, k in self.layer_kinds())
        if self._counted("params"):
            return self._counted("params")[1]
        f, h, i = self.family, self.hidden_size, self.intermediate_size
        n = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if f.qkv_bias:
            n += self.q_dim + 2 * self.kv_dim
        if f.out_bias:
            n += h
        if f.moe:  # the router, and each expert's gate_up_proj and down_proj (the shared expert: linears())
            n += self.num_experts * (h + 3 * h * self.expert_width)
            n += sum(i * o for _, i, o, part in self.linears() if part == "mlp")
        else:
            n += (3 if f.gated_mlp else 2) * h * i
        if f.mlp_bias:
            n += (2 * i + h) if f.gated_mlp else (i + h)
        n += f.norms_per_layer * (h if f.norm == "rmsnorm" else 2 * h)
        if f.qk_norm:
            n += 2 * self.head_dim
        return n

    def head_params(self) -> int:
        """Final norm + output head (zero extra weights when tied)."""
        if self._counted("params"):
            return self._counted("params")[2]
        f, h = self.family, self.hidden_size
        n = (h if f.norm == "rmsnorm" else 2 * h) if f.final_norm else 0
        if f.task == "masked-lm":
            n += h * h + h + 2 * h + self.vocab_size  # transform dense + LayerNorm + decoder bias
        if not self.tie_word_embeddings:
            n += self.vocab_size * h
        if f.head_bias:
            n += self.vocab_size
        return n

    def derived_param_count(self) -> int:
        layers = sum(n * k.layer_params() for n, k in self.layer_kinds())
        return self.embedding_params() + layers + self.head_params()

    def linears(self) -> list[tuple[str, int, int, str]]:
        """One block's Linear layers as ``(name, in, out, part)``, named as transformers names them.

        ``part`` is ``attention`` or ``mlp``: what LoRA's ``attention`` targets select; a derived
        MoE block's shared-expert Linears that PEFT would turn into LoRA on the routed experts are
        ``frozen``: no target selects them (``specs/derive.py``).
        Fused projections (phi3 ``qkv_proj``/``gate_up_proj``, gpt2 ``c_attn``) are one
        Linear, as PEFT and bitsandbytes see them. A derived spec lists its block's own; a hybrid
        stack's are every kind's, each name once (what LoRA targets name; for counts, :meth:`layer_kinds`).
        """
        return list(self._linears)

    @functools.cached_property  # a frozen spec's: an analytic estimate asks 8 times
    def _linears(self) -> tuple[tuple[str, int, int, str], ...]:
        return tuple(self._linears_of_block())

    def _linears_of_block(self) -> list[tuple[str, int, int, str]]:
        if self.hybrid:
            named: dict[str, tuple[str, int, int, str]] = {}
            for _, k in self.layer_kinds():  # a name in two kinds: its larger Linear
                for lin in k.linears():
                    if lin[0] not in named or lin[1] * lin[2] > named[lin[0]][1] * named[lin[0]][2]:
                        named[lin[0]] = lin
            return list(named.values())
        if self._counted("linears"):
            return list(self._counted("linears"))
        f, h, i = self.family, self.hidden_size, self.intermediate_size
        if f.fused_qkv:
            qkv = [(f.attn_in[0], h, self.q_dim + 2 * self.kv_dim)]
        else:
            qkv = list(zip(f.attn_in, (h,) * 3, (self.q_dim, self.kv_dim, self.kv_dim)))
        if len(f.mlp_in) == 1:
            mlp_in = [(f.mlp_in[0], h, 2 * i if f.gated_mlp else i)]
        else:
            mlp_in = [(n, h, i) for n in f.mlp_in]
        attention = qkv + [(f.attn_out, self.q_dim, h)]
        mlp = mlp_in + [(f.mlp_out, i, h)]
        if f.moe:  # routed experts and router are no Linear; a shared expert and its gate are
            ws = self.shared_expert_width
            mlp = [(n, h, ws) for n in f.mlp_in] + [(f.mlp_out, ws, h), ("shared_expert_gate", h, 1)] if ws else []
        return [(n, a, b, "attention") for n, a, b in attention] + [(n, a, b, "mlp") for n, a, b in mlp]

    def linear_params(self) -> int:
        """Weights of the blocks' Linear layers (what LoRA targets and 4-bit quantizes)."""
        return sum(n * sum(i * o for _, i, o, _ in k.linears()) for n, k in self.layer_kinds())

    def lora_params(self, rank: int, targets: _Targets | None = None) -> int:
        """Trainable parameters LoRA adds: ``rank × (in + out)`` per targeted Linear.

        ``targets``: a ``plan.LoraTargets`` (which says what it covers); None: every Linear LoRA can target.
        """
        return sum(
            n * rank * (i + o)
            for n, k in self.layer_kinds()
            for _, i, o, part in k.linears()
            if (part != "frozen" if targets is None else targets.covers(part))
        )

    def matrix_shapes(self) -> list[tuple[int, int, int]]:
        """``(count, rows, cols)`` of every 2-D parameter (Linear weights and embeddings)."""
        shapes = []
        for n, k in self.layer_kinds():
            shapes += [(n, o, i) for _, i, o, _ in k.linears()]
            if k.family.moe:  # each expert's two matrices (what Adafactor factors), and the router
                e, w, h = n * k.num_experts, k.expert_width, k.hidden_size
                shapes += [(e, 2 * w, h), (e, h, w), (n, k.num_experts, h)]
        shapes.append((1, self.vocab_size, self.hidden_size))
        if self.family.positions == "learned":
            shapes.append((1, self.max_position_embeddings, self.hidden_size))
        if not self.tie_word_embeddings:
            shapes.append((1, self.vocab_size, self.hidden_size))
        if self.family.task == "masked-lm":
            shapes.append((1, self.hidden_size, self.hidden_size))
        return shapes

    def block_tensors(self) -> list[int]:
        """Elements of each weight tensor of one block, in parameter order: its Linears, then an
        MoE block's router and its experts' gate_up_proj and down_proj (each holds every expert); of
        a hybrid stack, its largest block's."""
        if self.hybrid:
            return max((k for _, k in self.layer_kinds()), key=ModelSpec.layer_params).block_tensors()
        sizes = [i * o for _, i, o, _ in self.linears()]
        if self.family.moe:
            e, w, h = self.num_experts, self.expert_width, self.hidden_size
            sizes += [e * h, e * 2 * w * h, e * h * w]
        return sizes

    def largest_tensor(self) -> int:
        """Elements of the largest parameter tensor (an MoE block's gate_up_proj holds every expert's)."""
        blocks = (x for _, k in self.layer_kinds() for x in k.block_tensors())
        return max(max(rows * cols for _, rows, cols in self.matrix_shapes()), *blocks)

    # -- identity ---------------------------------------------------------------------
    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["hf_extra"] = dict(self.hf_extra)
        if self.derived:
            d["derived"] = dict(self.derived)
        else:  # left out at its default, so registered specs keep their fingerprints
            d.pop("derived")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        """The inverse of :meth:`as_dict`, also after a JSON round trip (lists back to tuples)."""
        kw = dict(d)
        kw["hf_extra"] = tuple((k, _tuples(v)) for k, v in (kw.get("hf_extra") or {}).items())
        kw["derived"] = tuple((k, _tuples(v)) for k, v in (kw.get("derived") or {}).items())
        return cls(**kw)

    @property
    def fingerprint(self) -> str:
        """Stable hash of what decides memory and time (the name is left out)."""
        d = self.as_dict()
        d.pop("name")
        d.pop("source")
        blob = json.dumps(d, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def variant(self, **overrides: Any) -> ModelSpec:
        """A resized copy (e.g. a 2-layer model for CPU tests); the count is re-derived.

        Where the family fixes the MLP width (``Family.mlp_ratio``: bloom), the copy's
        intermediate size follows its hidden size, whatever ``overrides`` says.
        """
        name = overrides.pop("name", None)
        if name is None:
            name = self.name + "-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
        if self.derived:  # its counts come from the built model: build the resized one
            return _derived_variant(self, name, overrides)
        if "num_heads" in overrides and "num_kv_heads" not in overrides:
            overrides["num_kv_heads"] = min(self.num_kv_heads, overrides["num_heads"])
        model_type = overrides.get("model_type", self.model_type)
        family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
        ratio = family.mlp_ratio if family else 0  # an unknown type is refused by __post_init__
        if ratio:
            overrides["intermediate_size"] = ratio * overrides.get("hidden_size", self.hidden_size)
        return dataclasses.replace(self, name=name, n_params=0, **overrides)

    # -- transformers -----------------------------------------------------------------
    def hf_config_kwargs(self) -> dict[str, Any]:
        f = self.family
        kw: dict[str, Any] = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if f.has_kv_heads_key:
            kw["num_key_value_heads"] = self.num_kv_heads
        if f.has_head_dim_key:
            kw["head_dim"] = self.head_dim
        kw = {f.config_key(k): v for k, v in kw.items() if f.config_key(k)}  # bloom has no MLP width field
        kw.update({k: value for k, (value, _) in f.config_fixed.items()})
        if self.derived:  # every kept config key, objects and lists as the config class takes them
            mappings = set(dict(self.derived).get("mappings", ()))
            kw.update({k: _thawed(v) if k in mappings else _lists(v) for k, v in self.hf_extra})
        else:
            kw.update({k: dict(v) if k == "rope_parameters" else v for k, v in self.hf_extra})
        return kw

    def to_hf_config(self):
        """The transformers config of this architecture (imports transformers)."""
        import transformers

        if self.derived:
            return _derived_config(self)
        cls = getattr(transformers, self.family.hf_config)
        cfg = cls(**self.hf_config_kwargs())
        inner = self.family.keys.get("intermediate_size")
        if inner:  # GPT-2's n_inner: null would mean 4·hidden
            setattr(cfg, inner, self.intermediate_size)
        _drop_ids_past_vocab(cfg, self.vocab_size)
        return cfg

    @classmethod
    def from_hf_config(cls, cfg: Any, name: str | None = None, source: str = "") -> ModelSpec:
        """Read the fields from a transformers config object (or its ``to_dict()``).

        A config is user input: every field is type-checked here, naming the file and the
        field, before any arithmetic on it (a string, list, fraction, infinity or zero would
        otherwise crash or silently become another model).
        """
        d = cfg if isinstance(cfg, Mapping) else cfg.to_dict()
        where = f"model config {source or name or 'given'!r}"
        if isinstance(d.get("model_type"), str) and d["model_type"] not in FAMILIES:
            return _derived_spec(cfg, name, source, where)
        f = _config_family(d, where)
        off = [k for k, (_, accepted) in f.config_fixed.items() if d.get(k) not in accepted]
        if off and (not f.moe or set(off) <= STACK_KEYS):
            # another block of a registered type (falcon-7b's multi-query one-norm block, a
            # sequential gpt_neox), or a stack of dense and MoE layers (Qwen2-MoE's mlp_only_layers):
            # read from transformers' model as an unregistered type is
            return _derived_spec(cfg, name, source, where)
        missing = [
            f.keys.get(k, k)
            for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
            if d.get(f.keys.get(k, k)) is None
        ]
        if missing:
            raise SpecError(f"config of {name or source or f.model_type!r} lacks the fields {', '.join(missing)}")

        def size(k: str, default: int | None = None) -> int:
            return _config_size(d, f, where, k, default)

        h, heads = size("hidden_size"), size("num_attention_heads")
        layers, vocab = size("num_hidden_layers"), size("vocab_size")
        inter = size("intermediate_size", (f.mlp_ratio or 4) * h)  # gpt2: n_inner null means 4*h; bloom has none
        kv_heads = size("num_key_value_heads", heads)
        if d.get("head_dim") is None and h < heads:
            raise SpecError(
                f"{where}: {f.keys.get('num_attention_heads', 'num_attention_heads')!r} ({heads}) exceeds "
                f"{f.keys.get('hidden_size', 'hidden_size')!r} ({h}); fix it in the config or give head_dim"
            )
        return cls(
            name=name or source or f.model_type,
            model_type=f.model_type,
            hidden_size=h,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=size("head_dim", h // heads),
            intermediate_size=inter,
            vocab_size=vocab,
            max_position_embeddings=size("max_position_embeddings", 2048),
            tie_word_embeddings=_config_tie(d, f, where),
            source=source,
            hf_extra=_config_extra(d, f, where),
        )


# config keys that make some layers of a registered MoE family dense (a hybrid stack, ``ModelSpec.hybrid``)
STACK_KEYS = frozenset(("decoder_sparse_step", "mlp_only_layers"))

# the size limits under transformers' field names
_HF_MAX_FIELD = {_HF_NAME.get(k, k): v for k, v in MAX_FIELD.items()}


def _config_family(d: Mapping[str, Any], where: str) -> Family:
    """The family a config's ``model_type`` names, or a SpecError saying what to fix."""
    model_type = d.get("model_type")
    if model_type is None:
        raise SpecError(
            f"{where} lacks 'model_type' (the transformers model type, e.g. \"llama\"); add it to the config"
        )
    if not isinstance(model_type, str):
        raise SpecError(
            f"{where}: 'model_type' must be a string such as \"llama\", got {_shown(model_type)} "
            f"({_json_type(model_type)}); fix it in the config"
        )
    if model_type not in FAMILIES:
        raise SpecError(
            f"{where}: model type {model_type!r} is not supported (supported: {', '.join(sorted(FAMILIES))})"
        )
    return FAMILIES[model_type]


def _config_size(d: Mapping[str, Any], f: Family, where: str, k: str, default: int | None = None) -> int:
    """A positive integer field under its llama name ``k``; null (or absent) takes ``default`` where there is one."""
    key = f.keys.get(k, k)
    value = d.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 4096.0 is 4096
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            got = repr(value)
        else:
            got = f"{_shown(value)} ({_json_type(value)})"
        fix = (
            "write it without quotes in the config"
            if isinstance(value, str) and value.strip().isdigit()
            else "fix it in the config"
        )
        raise SpecError(f"{where}: {key!r} must be a positive integer, got {got}; {fix}")
    if value > _HF_MAX_FIELD[k]:
        raise SpecError(
            f"{where}: {key!r} is {value:,}, beyond the {_HF_MAX_FIELD[k]:,} any real model has; fix it in the config"
        )
    return value


def _config_extra(d: Mapping[str, Any], f: Family, where: str) -> tuple[tuple[str, Any], ...]:
    """The family's per-model block fields (``rotary_key``, ``dropout_keys``) where the config
    sets them off the family default, under the config's own names (``hf_extra``); a config
    of another block than the family's (``config_fixed``) is refused."""
    for key, (value, accepted) in f.config_fixed.items():
        got = d.get(key)
        if got not in accepted:
            stated = "not set (the config class's default)" if got is None else _shown(got)
            raise SpecError(
                f"{where}: {key!r} is {stated}; autofit models {f.model_type} blocks with {key} {_shown(value)} only"
            )
    extra: list[tuple[str, Any]] = []
    if f.rotary_key:
        frac = d.get(f.rotary_key)
        rope = d.get("rope_parameters") or d.get("rope_scaling")
        if frac is None and isinstance(rope, Mapping):  # transformers 5 keeps it among the rope parameters
            frac = rope.get("partial_rotary_factor")
        if frac is not None and not (_is_number(frac) and 0 < frac <= 1):
            raise SpecError(
                f"{where}: {f.rotary_key!r} must be a fraction in (0, 1], got {_shown(frac)}; fix it in the config"
            )
        if frac is not None and frac != f.rotary_default:
            extra.append((f.rotary_key, frac))
    for key in f.dropout_keys:
        p = d.get(key)
        if p is not None and not (_is_number(p) and 0 <= p < 1):
            raise SpecError(f"{where}: {key!r} must be a probability in [0, 1), got {_shown(p)}; fix it in the config")
        if p:
            extra.append((key, p))
    return tuple(extra) + _config_moe(d, f, where) + _config_rope_scaling(d, f, where)


def _config_moe(d: Mapping[str, Any], f: Family, where: str) -> tuple[tuple[str, Any], ...]:
    """An MoE config's expert count, experts per token and expert width, which the routing
    needs: a config that leaves one out (the config class would fill in a default that may
    not be the model's) or states nonsense is refused in one line."""
    out = []
    for key in f.moe_keys:
        # transformers 5 names the expert count num_local_experts in every MoE config; Qwen's files say num_experts
        value = d.get(key, d.get("num_experts") if key == "num_local_experts" else None)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            stated = "missing" if value is None else f"{_shown(value)} ({_json_type(value)})"
            raise SpecError(
                f"{where}: {key!r} is {stated}; a {f.model_type} mixture-of-experts config must state it as a "
                "positive integer (autofit routes each token to the top-k of the experts, spread evenly)"
            )
        out.append((key, value))
    if f.moe and d.get("norm_topk_prob") is not None:
        out.append(("norm_topk_prob", bool(d["norm_topk_prob"])))
    problems = _moe_problems(f, dict(out))
    if problems:
        raise SpecError(f"{where}: {problems[0]}; fix it in the config")
    return tuple(out)


def _moe_problems(f: Family, extra: Mapping[str, Any]) -> list[str]:
    """What an MoE spec's routing fields must satisfy (nothing for a dense family)."""
    if not f.moe:
        return []
    missing = [k for k in f.moe_keys if not (isinstance(extra.get(k), int) and extra[k] > 0)]
    if missing:
        return [f"{f.model_type} needs {', '.join(missing)} (positive integers) in hf_extra"]
    if extra[f.top_k_key] > extra[f.experts_key]:
        return [
            f"{f.top_k_key} ({extra[f.top_k_key]}) exceeds {f.experts_key} ({extra[f.experts_key]}): "
            "a token cannot be routed to more experts than there are"
        ]
    if extra[f.experts_key] > 2**12:
        return [f"{f.experts_key} {extra[f.experts_key]:,} is beyond the {2**12:,} any real model has"]
    return []


def _config_rope_scaling(d: Mapping[str, Any], f: Family, where: str) -> tuple[tuple[str, Any], ...]:
    """RoPE scaling where the config sets one (``rope_parameters``, or transformers 4's
    ``rope_scaling``, with a ``rope_type`` other than "default"), as ``rope_parameters``: it
    decides how long a sequence the model trains on (``ModelSpec.position_limit``)."""
    rope = d.get("rope_parameters") or d.get("rope_scaling")
    if f.positions != "rope" or not isinstance(rope, Mapping):
        return ()
    kind = rope.get("rope_type", rope.get("type"))
    if kind in (None, "default"):
        return ()
    factor = rope.get("factor")
    if not (_is_number(factor) and factor >= 1):
        raise SpecError(
            f"{where}: RoPE scaling {kind!r} needs a 'factor' of at least 1, got {_shown(factor)}; fix it in the config"
        )
    # as sorted pairs (a spec is hashable); the family's rotary_key holds a partial rotary factor
    kept = {**{k: _tuples(v) for k, v in rope.items() if k not in ("partial_rotary_factor", "type")}, "rope_type": kind}
    return (("rope_parameters", tuple(sorted(kept.items()))),)


# -- model types no family describes (specs/derive.py) -------------------------------------
def _derived_spec(cfg: Any, name: str | None, source: str, where: str) -> ModelSpec:
    """A spec of a model type no family describes, from the model transformers builds of it."""
    from autofit.specs import derive

    d = cfg if isinstance(cfg, Mapping) else cfg.to_dict()
    model_type = d["model_type"]
    # where a registered type's config names a size field otherwise (falcon's ffn_hidden_size)
    keys = {k: v for k, v in FAMILIES[model_type].keys.items() if v} if model_type in FAMILIES else {}
    try:
        cls = derive.config_class(model_type)
        if isinstance(cfg, Mapping):
            with _quiet_logger("transformers"):
                cfg = cls.from_dict(dict(cfg))
        core = derive.core_fields(cfg, keys)
        missing = [k for k in ("hidden_size", "num_layers", "num_heads", "vocab_size") if core[k] is None]
        if missing:
            raise SpecError(
                f"a {model_type} config has no {', '.join(missing)}: autofit models transformer decoders "
                "(attention and MLP blocks), and this is not one"
            )
        built = derive.derive(cfg, keys)
    except SpecError as exc:
        raise SpecError(f"{where}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - a config its own class refuses is the user's to fix
        raise SpecError(f"{where}: transformers cannot read it as a {model_type} config ({_first_line(exc)})") from None
    experts = {k: v for b in built.blocks for k, v in b.experts.items() if k != "shared_width"}
    extra = {**derive.extras(cfg, keys), **experts}
    mappings = tuple(sorted(k for k, v in extra.items() if isinstance(v, Mapping)))
    formula = ModelSpec(
        name=name or source or model_type,
        model_type=model_type,
        **core,
        source=source,
        hf_extra=tuple(sorted((k, _frozen(v)) for k, v in extra.items())),
        derived=_block_derived(built.blocks[0], keys, mappings),
    )
    kinds = tuple(_kind_derived(formula, b, built, keys, mappings) for b in built.blocks)
    if len(kinds) == 1:
        return dataclasses.replace(formula, n_params=0, derived=kinds[0][:-1])  # its first layer is layer 0
    # a stack of several kinds: the spec's own fields describe the kind most of its layers are
    # (``ModelSpec.layer_kinds`` gives each)
    main = max(range(len(kinds)), key=lambda k: (built.stack.count(k), built.blocks[k].layer_params))
    stack = (("stack", built.stack), ("kinds", kinds))
    return dataclasses.replace(formula, n_params=0, derived=kinds[main][:-1] + stack)


def _block_derived(block: Any, keys: Mapping[str, str], mappings: tuple[str, ...]) -> tuple[tuple[str, Any], ...]:
    """A block's Family fields as a derived spec keeps them (the routed experts' fields are in
    ``hf_extra``, under the family's keys; the shared expert's width here)."""
    family = tuple(sorted((k, _tuples(v)) for k, v in {**block.family, "keys": _frozen(keys)}.items()))
    shared = (("shared_width", block.experts["shared_width"]),) if block.experts else ()
    return (("family", family), ("mappings", mappings)) + shared


def _kind_derived(
    formula: ModelSpec, block: Any, built: Any, keys: Mapping[str, str], mappings: tuple[str, ...]
) -> tuple[tuple[str, Any], ...]:
    """The derived fields of one kind of layer: its family, counts, analytic gap, and first layer."""
    own = _block_derived(block, keys, mappings)
    params = (built.embedding_params, block.layer_params, built.head_params)
    counts = (("linears", block.linears), ("params", params))
    gap = block.analytic or _formula_gap(dataclasses.replace(formula, n_params=0, derived=own), params, block.linears)
    # (kept out where there is none, and where it attends: the other specs' fingerprints stay)
    mixer = (("mixer", block.mixer),) if block.mixer else ()
    mixer += (("attends", False),) if not block.attends else ()
    mixer += (("uncalled", tuple(sorted(block.uncalled))),) if block.uncalled else ()
    return own + counts + (("analytic", gap),) + mixer + (("first_layer", block.first_layer),)


def _formula_gap(formula: ModelSpec, want: tuple[int, int, int], linears: tuple) -> str:
    """Where the family's formulas miss the built block: its parameters or its Linear layers ("" if nowhere)."""
    try:
        got = (formula.embedding_params(), formula.layer_params(), formula.head_params())
        shapes = [(i, o) for _, i, o, _ in formula.linears()]
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        return f"the block formulas cannot read it ({_first_line(exc)})"
    for what, a, b in zip(("embedding", "block", "head"), got, want):
        if a != b:
            return f"its {what} has {b:,} parameters where the block formulas give {a:,}"
    if shapes != [(i, o) for _, i, o, _ in linears]:
        return "its Linear layers are not the ones the block formulas list"
    return ""


@functools.lru_cache(maxsize=256)
def _layer_kinds(spec: ModelSpec) -> tuple[tuple[int, ModelSpec], ...]:
    stack = spec.stack
    return tuple(
        (stack.count(k), dataclasses.replace(spec, num_layers=stack.count(k), n_params=0, derived=d))
        for k, d in enumerate(spec._counted("kinds"))
    )


@functools.lru_cache(maxsize=256)
def _derived_family(derived: tuple[tuple[str, Any], ...]) -> Family:
    fields = dict(dict(derived)["family"])
    return Family(**{**fields, "keys": dict(fields.get("keys", ()))})


def _derived_config(spec: ModelSpec):
    """The transformers config of a derived spec: its config class, its kept keys and its sizes."""
    from autofit.specs import derive

    with _quiet_logger("transformers"):
        cfg = derive.config_class(spec.model_type)(**spec.hf_config_kwargs())
    _drop_ids_past_vocab(cfg, spec.vocab_size)
    return cfg


def _derived_variant(spec: ModelSpec, name: str, overrides: dict[str, Any]) -> ModelSpec:
    """A resized derived spec, re-read from the model its config builds. Per-layer lists of the
    old depth (``layer_types``) are left for the config class to fill in for the new one."""
    if "num_heads" in overrides and "num_kv_heads" not in overrides:
        overrides["num_kv_heads"] = min(spec.num_kv_heads, overrides["num_heads"])
    if not spec.family.has_head_dim_key and "head_dim" not in overrides:
        heads = overrides.get("num_heads", spec.num_heads)
        overrides["head_dim"] = overrides.get("hidden_size", spec.hidden_size) // heads
    extra = spec.hf_extra
    if overrides.get("num_layers", spec.num_layers) != spec.num_layers:
        extra = tuple((k, v) for k, v in extra if not (isinstance(v, tuple) and len(v) == spec.num_layers))
    read = tuple((k, v) for k, v in spec.derived if k in ("family", "mappings"))  # not the old counts
    resized = dataclasses.replace(spec, n_params=0, hf_extra=extra, derived=read, **overrides)
    return ModelSpec.from_hf_config(_derived_config(resized), name=name, source=spec.source)


def _drop_ids_past_vocab(cfg: Any, vocab: int) -> None:
    for attr in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int) and value >= vocab:  # a resized vocab (tiny variants)
            setattr(cfg, attr, None)


def _frozen(value: Any) -> Any:
    """A config value as a spec keeps it (hashable): lists as tuples, objects as sorted pairs."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def _thawed(value: Any) -> Any:
    """The inverse of :func:`_frozen` for a value that was a JSON object."""
    return {k: _thawed(v) if _is_pairs(v) else _lists(v) for k, v in value}


def _is_pairs(value: Any) -> bool:
    return (
        isinstance(value, tuple)
        and bool(value)
        and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in value)
    )


def _lists(value: Any) -> Any:
    return [_lists(v) for v in value] if isinstance(value, tuple) else value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # not NaN


def _config_tie(d: Mapping[str, Any], f: Family, where: str) -> bool:
    """``tie_word_embeddings``, or the config class's default when the file does not say."""
    tie = d.get("tie_word_embeddings")
    if tie is None:
        tie = f.tied_by_default
    if not isinstance(tie, bool):
        raise SpecError(
            f"{where}: 'tie_word_embeddings' must be true or false, got {_shown(tie)} ({_json_type(tie)}); "
            "fix it in the config"
        )
    return tie


def _json_type(value: Any) -> str:
    """The JSON name of a value's type, as the user wrote it in config.json."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (int, float)):
        return "a number"
    return type(value).__name__


def _shown(value: Any) -> str:
    """A config value as JSON writes it (``true``, ``"4096"``), cut short: one line, whatever the file holds."""
    try:
        text = json.dumps(value, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --------------------------------------------------------------------------------------
# The registry. Fields are copied from each model's config.json on the Hugging Face hub
# (``source``); n_params is the count of the transformers model built from them
# (AutoModelForCausalLM / BertForMaskedLM), checked by tests/specs/test_models.py.
# --------------------------------------------------------------------------------------
_REGISTRY: list[dict[str, Any]] = [
    dict(
        name="mistral-7b",
        source="mistralai/Mistral-7B-v0.1",
        model_type="mistral",
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=32000,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        n_params=7_241_732_096,
        hf_extra=(("sliding_window", 4096),),
    ),
    dict(
        name="llama-2-7b",
        source="meta-llama/Llama-2-7b-hf",
        model_type="llama",
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        head_dim=128,
        intermediate_size=11008,
        vocab_size=32000,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        n_params=6_738_415_616,
    ),
    dict(
        name="llama-2-13b",
        source="meta-llama/Llama-2-13b-hf",
        model_type="llama",
        hidden_size=5120,
        num_layers=40,
        num_heads=40,
        num_kv_heads=40,
        head_dim=128,
        intermediate_size=13824,
        vocab_size=32000,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        n_params=13_015_864_320,
    ),
    dict(
        name="llama-3-8b",
        source="meta-llama/Meta-Llama-3-8B",
        model_type="llama",
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        n_params=8_030_261_248,
    ),
    dict(
        name="llama-3-70b",
        source="meta-llama/Meta-Llama-3-70B",
        model_type="llama",
        hidden_size=8192,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=128256,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        n_params=70_553_706_496,
    ),
    dict(
        name="llama-3.2-1b",
        source="meta-llama/Llama-3.2-1B",
        model_type="llama",
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=128256,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        n_params=1_235_814_400,
    ),
    dict(
        name="llama-3.2-3b",
        source="meta-llama/Llama-3.2-3B",
        model_type="llama",
        hidden_size=3072,
        num_layers=28,
        num_heads=24,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=8192,
        vocab_size=128256,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        n_params=3_212_749_824,
    ),
    dict(
        name="qwen2.5-0.5b",
        source="Qwen/Qwen2.5-0.5B",
        model_type="qwen2",
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=4864,
        vocab_size=151936,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        n_params=494_032_768,
    ),
    dict(
        name="qwen2.5-7b",
        source="Qwen/Qwen2.5-7B",
        model_type="qwen2",
        hidden_size=3584,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=18944,
        vocab_size=152064,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        n_params=7_615_616_512,
    ),
    dict(
        name="qwen2.5-72b",
        source="Qwen/Qwen2.5-72B",
        model_type="qwen2",
        hidden_size=8192,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=29568,
        vocab_size=152064,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        n_params=72_706_203_648,
    ),
    dict(
        name="qwen3-0.6b",
        source="Qwen/Qwen3-0.6B",
        model_type="qwen3",
        hidden_size=1024,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        n_params=596_049_920,
    ),
    dict(
        name="qwen3-1.7b",
        source="Qwen/Qwen3-1.7B",
        model_type="qwen3",
        hidden_size=2048,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=6144,
        vocab_size=151936,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        n_params=1_720_574_976,
    ),
    dict(
        name="qwen3-4b",
        source="Qwen/Qwen3-4B",
        model_type="qwen3",
        hidden_size=2560,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=9728,
        vocab_size=151936,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        n_params=4_022_468_096,
    ),
    dict(
        name="qwen3-8b",
        source="Qwen/Qwen3-8B",
        model_type="qwen3",
        hidden_size=4096,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        n_params=8_190_735_360,
    ),
    dict(
        name="qwen3-14b",
        source="Qwen/Qwen3-14B",
        model_type="qwen3",
        hidden_size=5120,
        num_layers=40,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=17408,
        vocab_size=151936,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        n_params=14_768_307_200,
    ),
    dict(
        name="qwen3-32b",
        source="Qwen/Qwen3-32B",
        model_type="qwen3",
        hidden_size=5120,
        num_layers=64,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=25600,
        vocab_size=151936,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        n_params=32_762_123_264,
    ),
    dict(
        name="gemma-2-9b",
        source="google/gemma-2-9b",
        model_type="gemma2",
        hidden_size=3584,
        num_layers=42,
        num_heads=16,
        num_kv_heads=8,
        head_dim=256,
        intermediate_size=14336,
        vocab_size=256000,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        n_params=9_241_705_984,
        hf_extra=(("query_pre_attn_scalar", 256),),
    ),
    dict(
        name="phi-3-mini",
        source="microsoft/Phi-3-mini-4k-instruct",
        model_type="phi3",
        hidden_size=3072,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        head_dim=96,
        intermediate_size=8192,
        vocab_size=32064,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        n_params=3_821_079_552,
    ),
    # Llama 2/3.1 sizes and Yi (model_type llama): meta-llama/Llama-2-70b-hf,
    # meta-llama/Llama-3.1-{8B,70B,405B} and 01-ai/Yi-{6B,34B} config.json. Llama 3.1's
    # rope_scaling ("llama3", factor 8) and Yi's rope_theta change neither memory nor
    # parameters and are left out (hf_extra must stay hashable: no dicts).
    dict(
        name="llama-2-70b",
        source="meta-llama/Llama-2-70b-hf",
        model_type="llama",
        hidden_size=8192,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=32000,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        n_params=68_976_648_192,
    ),
    dict(
        name="llama-3.1-8b",
        source="meta-llama/Llama-3.1-8B",
        model_type="llama",
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        n_params=8_030_261_248,
    ),
    dict(
        name="llama-3.1-70b",
        source="meta-llama/Llama-3.1-70B",
        model_type="llama",
        hidden_size=8192,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=128256,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        n_params=70_553_706_496,
    ),
    dict(
        name="llama-3.1-405b",
        source="meta-llama/Llama-3.1-405B",
        model_type="llama",
        hidden_size=16384,
        num_layers=126,
        num_heads=128,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=53248,
        vocab_size=128256,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        n_params=405_853_388_800,
    ),
    dict(
        name="yi-6b",
        source="01-ai/Yi-6B",
        model_type="llama",
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=11008,
        vocab_size=64000,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        n_params=6_061_035_520,
    ),
    dict(
        name="yi-34b",
        source="01-ai/Yi-34B",
        model_type="llama",
        hidden_size=7168,
        num_layers=60,
        num_heads=56,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=20480,
        vocab_size=64000,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        n_params=34_388_917_248,
    ),
    # Gemma 1: google/gemma-{2b,7b} config.json (2b: multi-query, one KV head)
    dict(
        name="gemma-2b",
        source="google/gemma-2b",
        model_type="gemma",
        hidden_size=2048,
        num_layers=18,
        num_heads=8,
        num_kv_heads=1,
        head_dim=256,
        intermediate_size=16384,
        vocab_size=256000,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        n_params=2_506_172_416,
    ),
    dict(
        name="gemma-7b",
        source="google/gemma-7b",
        model_type="gemma",
        hidden_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=16,
        head_dim=256,
        intermediate_size=24576,
        vocab_size=256000,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        n_params=8_537_680_896,
    ),
    # Phi: microsoft/phi-1_5 config.json (partial_rotary_factor 0.5, PhiConfig's default;
    # resid_pdrop 0.0) and microsoft/phi-2 config.json (partial_rotary_factor 0.4,
    # resid_pdrop 0.1: it trains with residual dropout)
    dict(
        name="phi-1_5",
        source="microsoft/phi-1_5",
        model_type="phi",
        hidden_size=2048,
        num_layers=24,
        num_heads=32,
        num_kv_heads=32,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=51200,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        n_params=1_418_270_720,
    ),
    dict(
        name="phi-2",
        source="microsoft/phi-2",
        model_type="phi",
        hidden_size=2560,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        head_dim=80,
        intermediate_size=10240,
        vocab_size=51200,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        n_params=2_779_683_840,
        hf_extra=(("partial_rotary_factor", 0.4), ("resid_pdrop", 0.1)),
    ),
    # StableLM-Base-Alpha (gpt_neox): stabilityai/stablelm-base-alpha-{3b,7b} config.json as
    # LitGPT's config.py transcribes it (its entries link those files: 16 layers, 32 heads x
    # 4096 / 48 x 6144, MLP 4 x hidden, vocab 50254 padded to 50688 / 50432, block 4096,
    # rotary 0.25, parallel residual, biases, untied); the 3b vocab and the gpt_neox keys
    # also as the same-shape stablelm-tuned-alpha-3b config reads (MLC-LLM's table)
    dict(
        name="stablelm-base-alpha-3b",
        source="stabilityai/stablelm-base-alpha-3b",
        model_type="gpt_neox",
        hidden_size=4096,
        num_layers=16,
        num_heads=32,
        num_kv_heads=32,
        head_dim=128,
        intermediate_size=16384,
        vocab_size=50688,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        n_params=3_637_321_728,
    ),
    dict(
        name="stablelm-base-alpha-7b",
        source="stabilityai/stablelm-base-alpha-7b",
        model_type="gpt_neox",
        hidden_size=6144,
        num_layers=16,
        num_heads=48,
        num_kv_heads=48,
        head_dim=128,
        intermediate_size=24576,
        vocab_size=50432,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        n_params=7_868_755_968,
    ),
    # BLOOM: bigscience/bloom-7b1 config.json (bigscience/bloomz-7b1 has the same shape):
    # n_layer 30, n_head 32, hidden 4096, vocab 250880, seq_length 2048, tied
    dict(
        name="bloom-7b1",
        source="bigscience/bloom-7b1",
        model_type="bloom",
        hidden_size=4096,
        num_layers=30,
        num_heads=32,
        num_kv_heads=32,
        head_dim=128,
        intermediate_size=16384,
        vocab_size=250880,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        n_params=7_069_016_064,
    ),
    # Falcon-40B: tiiuae/falcon-40b config.json (new_decoder_architecture, 60 layers, 128
    # heads, 8 KV heads, hidden 8192, vocab 65024; MLP 4 x hidden, as llama.cpp's loader
    # reads it: n_ff 32768). The file does not state tie_word_embeddings: FalconConfig's
    # default (tied) applies, as it does when transformers loads it.
    dict(
        name="falcon-40b",
        source="tiiuae/falcon-40b",
        model_type="falcon",
        hidden_size=8192,
        num_layers=60,
        num_heads=128,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=32768,
        vocab_size=65024,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        n_params=41_303_293_952,
    ),
    dict(
        name="gpt2",
        source="openai-community/gpt2",
        model_type="gpt2",
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=12,
        head_dim=64,
        intermediate_size=3072,
        vocab_size=50257,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        n_params=124_439_808,
    ),
    dict(
        name="gpt2-xl",
        source="openai-community/gpt2-xl",
        model_type="gpt2",
        hidden_size=1600,
        num_layers=48,
        num_heads=25,
        num_kv_heads=25,
        head_dim=64,
        intermediate_size=6400,
        vocab_size=50257,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        n_params=1_557_611_200,
    ),
    dict(
        name="bert-large-uncased",
        source="google-bert/bert-large-uncased",
        model_type="bert",
        hidden_size=1024,
        num_layers=24,
        num_heads=16,
        num_kv_heads=16,
        head_dim=64,
        intermediate_size=4096,
        vocab_size=30522,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        n_params=335_174_458,
    ),
    # mixture-of-experts models: the routing fields ride in hf_extra under the config's names
    dict(
        name="mixtral-8x7b",
        source="mistralai/Mixtral-8x7B-v0.1",
        model_type="mixtral",
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=32000,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        n_params=46_702_792_704,
        hf_extra=(("num_local_experts", 8), ("num_experts_per_tok", 2)),
    ),
    dict(
        name="mixtral-8x22b",
        source="mistralai/Mixtral-8x22B-v0.1",
        model_type="mixtral",
        hidden_size=6144,
        num_layers=56,
        num_heads=48,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=16384,
        vocab_size=32768,
        max_position_embeddings=65536,
        tie_word_embeddings=False,
        n_params=140_630_071_296,
        hf_extra=(("num_local_experts", 8), ("num_experts_per_tok", 2)),
    ),
    dict(
        name="qwen1.5-moe-a2.7b",
        source="Qwen/Qwen1.5-MoE-A2.7B",
        model_type="qwen2_moe",
        hidden_size=2048,
        num_layers=24,
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
        intermediate_size=5632,
        vocab_size=151936,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        n_params=14_315_784_192,
        hf_extra=(
            ("num_experts", 60),
            ("num_experts_per_tok", 4),
            ("moe_intermediate_size", 1408),
            ("shared_expert_intermediate_size", 5632),
            ("norm_topk_prob", False),
        ),
    ),
    dict(
        name="qwen2-57b-a14b",
        source="Qwen/Qwen2-57B-A14B",
        model_type="qwen2_moe",
        hidden_size=3584,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=18944,
        vocab_size=151936,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        n_params=57_408_658_944,
        hf_extra=(
            ("num_experts", 64),
            ("num_experts_per_tok", 8),
            ("moe_intermediate_size", 2560),
            ("shared_expert_intermediate_size", 20480),
            ("norm_topk_prob", False),
        ),
    ),
    dict(
        name="qwen3-30b-a3b",
        source="Qwen/Qwen3-30B-A3B",
        model_type="qwen3_moe",
        hidden_size=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=6144,
        vocab_size=151936,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        n_params=30_532_122_624,
        hf_extra=(
            ("num_local_experts", 128),
            ("num_experts_per_tok", 8),
            ("moe_intermediate_size", 768),
            ("norm_topk_prob", True),
        ),
    ),
    dict(
        name="qwen3-235b-a22b",
        source="Qwen/Qwen3-235B-A22B",
        model_type="qwen3_moe",
        hidden_size=4096,
        num_layers=94,
        num_heads=64,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        n_params=235_093_634_560,
        hf_extra=(
            ("num_local_experts", 128),
            ("num_experts_per_tok", 8),
            ("moe_intermediate_size", 1536),
            ("norm_topk_prob", True),
        ),
    ),
]

MODELS: dict[str, ModelSpec] = {d["name"]: ModelSpec(**d) for d in _REGISTRY}


def resolve_model(ref: str) -> ModelSpec:
    """A registered name, a local directory / config.json, or a hub id.

    Hub ids are read with ``transformers.AutoConfig`` and ``trust_remote_code=False``:
    autofit never runs code from a model repository.
    """
    if not isinstance(ref, str) or not ref.strip():
        raise SpecError("--model is empty; give a registered name (see `autofit models`), a config.json or a hub id")
    key = ref.strip()
    if key.lower() in MODELS:
        return MODELS[key.lower()]
    if os.path.exists(key):
        path = os.path.join(key, "config.json") if os.path.isdir(key) else key
        if not os.path.isfile(path):
            raise SpecError(f"{key!r} is a directory without a config.json")
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except UnicodeDecodeError as exc:
            raise SpecError(
                f"model config {path!r} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
                "pass the model's config.json"
            ) from None
        except RecursionError:
            raise SpecError(
                f"model config {path!r} is nested too deeply to be a model config; pass the model's config.json"
            ) from None
        except (OSError, json.JSONDecodeError) as exc:
            raise SpecError(f"cannot read model config {path!r}: {exc}") from None
        if not isinstance(data, dict):
            raise SpecError(f"model config {path!r} is not a JSON object")
        return ModelSpec.from_hf_config(
            data,
            name=os.path.basename(os.path.dirname(os.path.abspath(path))) if os.path.isdir(key) else key,
            source=path,
        )
    if "/" in key and not key.startswith((".", "/")):
        return _from_hub(key)
    close = difflib.get_close_matches(key.lower(), list(MODELS), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise SpecError(
        f"unknown model {ref!r}: {hint}use a registered name (`autofit models`), "
        "a local config.json or directory, or a hub id like org/name"
    )


def _from_hub(hub_id: str) -> ModelSpec:
    """The architecture of a hub id, from its config.json (see :func:`_hub_config_file`)."""
    path = _hub_config_file(hub_id)
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(os.path.dirname(path), trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - a config transformers cannot read is the user's to fix
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecError(
            f"cannot read the config of hub id {hub_id!r} ({first[:160]}); "
            "pass a local config.json or a registered name (`autofit models`)"
        ) from None
    return ModelSpec.from_hf_config(cfg, name=hub_id, source=hub_id)


def _hub_config_file(hub_id: str) -> str:
    """The local path of a hub id's config.json: from the cache, or fetched with one request.

    ``hf_hub_download`` alone retries a failed connection five times with backoff and logs
    each try (23 s and a dozen lines when huggingface.co does not resolve). So: the cache
    answers in offline mode (``HF_HUB_OFFLINE``); otherwise one metadata request, without
    retries and within ``HF_HUB_ETAG_TIMEOUT``, says whether the hub is reachable before
    anything is downloaded; when it is not, a cached config still serves, as in transformers.
    """
    import huggingface_hub as hf
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    head = f"cannot fetch the config of hub id {hub_id!r}"
    local = "pass a local config.json or directory, or a registered name (`autofit models`)"

    def unreachable(why: str) -> SpecError:
        return SpecError(
            f"{head}: it is not a registered model, not a local path, and the hub is unreachable ({why}); {local}"
        )

    with _quiet_logger("huggingface_hub"):
        try:
            cached = hf.try_to_load_from_cache(hub_id, "config.json")
        except HFValidationError:
            raise SpecError(
                f"unknown model {hub_id!r}: not a registered model, not a local path, and not a valid "
                f"hub id (org/name); {local}"
            ) from None
        cached = cached if isinstance(cached, str) else None
        if hf.is_offline_mode():
            if cached:
                return cached
            raise unreachable("offline mode: HF_HUB_OFFLINE is set, and the config is not cached")
        try:
            hf.get_hf_file_metadata(hf.hf_hub_url(hub_id, "config.json"))  # one request, no retries
        except HfHubHTTPError as exc:  # the hub answered: the id, the file or the access is wrong
            if cached:
                return cached
            if isinstance(exc, GatedRepoError):
                why = "a gated repository: accept its terms on huggingface.co and log in with `hf auth login`"
            elif isinstance(exc, RepositoryNotFoundError):
                why = "no such model on the hub, or a private one: check the id, or log in with `hf auth login`"
            elif isinstance(exc, (RemoteEntryNotFoundError, RevisionNotFoundError)):
                why = "the repository has no config.json"
            else:
                status = getattr(getattr(exc, "response", None), "status_code", "?")
                why = f"the hub answered HTTP {status}"
            raise SpecError(f"{head}: {why}; or {local}") from None
        except Exception as exc:  # noqa: BLE001 - DNS, refused connection, timeout, proxy: out of reach
            if cached:
                return cached
            raise unreachable(_first_line(exc)) from None
        try:
            return hf.hf_hub_download(hub_id, "config.json")
        except Exception as exc:  # noqa: BLE001 - the connection dropped between the two requests
            raise unreachable(_first_line(exc)) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0][:160]) if text else type(exc).__name__


@contextlib.contextmanager
def _quiet_logger(name: str, below: int = logging.ERROR):
    """Hold a library's warnings (records under ``below``) back while autofit reports the outcome in
    one line of its own."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(below)
    try:
        yield
    finally:
        logger.setLevel(level)


def _tuples(value: Any) -> Any:
    """JSON turns the tuples of ``ModelSpec.hf_extra`` into lists; turn them back."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


@functools.lru_cache(maxsize=64)
def _context_parallel_refusal(spec: ModelSpec) -> str:
    mixers = sorted({k.mixer for _, k in spec.layer_kinds() if k.mixer})
    if mixers:
        return f"its {', '.join(mixers)} layers carry a state along the sequence, which no rank passes on"
    cfg = spec.to_hf_config()
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        other = sorted(set(layer_types) - {"full_attention"})
        return f"its {', '.join(other)} layers are not full causal attention" if other else ""
    window = getattr(cfg, "sliding_window", None)
    return f"every layer attends through a sliding window of {window} tokens" if window is not None else ""

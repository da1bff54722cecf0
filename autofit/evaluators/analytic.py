"""The analytic evaluator: closed-form memory anatomy and roofline time, in microseconds.

Activations are itemized tensor by tensor from what autograd saves in the real
transformers blocks (checked against a storage tracker on real CPU steps in
tests/evaluators/test_analytic.py): RMSNorm's fp32 upcast and rstd, every projection's
input (once per distinct tensor, or once per projection under autocast, which recasts
activations on every use), RoPE'd q/k, the attention kernel's saved q/k/v/out/logsumexp
(or eager's fp32 softmax and 16-bit probabilities, s² per head), the gated MLP's gate,
activation, up and product, and LayerNorm/dropout for GPT-2 and BERT. Frozen weights
save nothing of their input; LoRA adapters save their input and the rank-wide middle.

Three attention halves are modelled, chosen by the family's fields
(``specs.models.Family``): the RoPE block of llama and its relatives (RMSNorm or
LayerNorm; partial rotary concatenates q and k, so the kernel's output is copied for the
output projection), the learned-position block of GPT-2 and BERT (LayerNorm, dropout;
BERT's norms after the residual adds) and BLOOM's ALiBi block (its own eager attention
over copied q/k/v). The MLP half is gated (SwiGLU/GeGLU; Gemma-2's sandwich norms) or
plain (fc, GELU, fc), in sequence after attention or in parallel off the block input
(phi: the attention's own norm; gpt_neox: a second norm of the same input).

The peak is the largest of several moments of a steady-state step (loss backward, the
last block's backward, the end of backward, the optimizer step, ...), and the breakdown
is the one *at* that moment.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, fields, replace

from autofit.errors import CensusError
from autofit.evaluators import context, costs, timing
from autofit.evaluators.base import Evaluator, StepCallback
from autofit.plan import Attention, Method, Offload, Optimizer, Plan, Precision
from autofit.results import MemoryAnatomy, Throughput, TrialResult, judge
from autofit.specs import ModelSpec, Target, Workload
from autofit.techniques import all_checkpointed, checkpointed_layers, dtype_layout, model_notes


@dataclass(frozen=True)
class _Block:
    tok: float  # bytes per token one block saves for backward
    quad: float  # bytes per token per attended position (eager's s² terms)
    bwd_tok: float  # transient bytes per token while a block's MLP runs backward
    fwd_quad: float  # transient s² bytes per token while eager attention runs forward
    first_norm: float  # bytes per token the block's first norm saves
    mlp_tok: float  # bytes per token the MLP half saves (freed before attention's backward)
    attn_freed: float  # bytes per token of attention's output side freed before its softmax backward
    probs_quad: float  # s² bytes per token of 16-bit probabilities freed before the softmax backward
    attn_bwd_quad: float  # transient s² bytes per token in attention's backward
    mlp_fwd_tok: float = 0.0  # transient bytes per token while the MLP runs forward (or is recomputed)
    held_tok: float = 0.0  # of ``tok``, what no checkpointing or offload frees (``_Saves.held``)
    # of ``mlp_fwd_tok``, what a checkpoint's recompute never makes: torch.utils.checkpoint stops
    # recomputing once the block's last saved tensor is packed (``_StopRecomputationError``)
    recompute_cut: float = 0.0
    # what op-level checkpointing's policy saves of a checkpointed block beside its input, per
    # token and per token per attended position (``sac_saves``; 0 under any other checkpointing)
    sac_tok: float = 0.0
    sac_quad: float = 0.0
    # a compiled block's backward graph: what it holds above its start after each node, as
    # (per micro-batch, per token, per token per attended position) (``traced.CompiledWork``)
    bwd_rise: tuple[tuple[float, float, float], ...] = ()
    # a hybrid stack's kinds of block: the layers of each, and its own block (``_stack_block``)
    kinds: tuple[tuple[tuple[int, ...], _Block], ...] = ()
    # ``mlp_fwd_tok`` and ``bwd_tok`` per token per attended position: a traced mixer's transients,
    # measured on its trace (``traced.mixer_work``); 0 for the formulas' blocks
    mlp_fwd_quad: float = 0.0
    bwd_quad: float = 0.0

    def layers(self, num_layers: int) -> list[_Block]:
        """Each layer's block, in order."""
        out: list[_Block] = [self] * num_layers
        for idx, blk in self.kinds:
            for i in idx:
                out[i] = blk
        return out


def sdpa_kernel(model: ModelSpec, plan: Plan, masked: bool, cpu: bool, capability: tuple[int, int]) -> str:
    """The kernel sdpa runs: ``flash`` (or the CPU's flash), ``efficient`` or ``math``.

    The CPU runs its flash kernel (grouped KV heads and masks included) unless there is
    dropout, then math; CUDA GPUs choose by ``costs.cuda_sdpa_kernel``. transformers passes
    grouped KV heads as they are only without a mask (it repeats them otherwise).
    """
    if cpu:
        return "math" if "attention" in model.dropouts else "flash"
    gqa = model.kv_dim < model.q_dim and not masked
    return costs.cuda_sdpa_kernel(capability, costs.compute_dtype(plan), model.head_dim, masked, gqa)


# -- activations -------------------------------------------------------------------------
class _Saves:
    """What one block saves for backward, per token, op by op (``saved``: bytes by tensor).

    The keys name tensors so that one saved by two ops counts once; ``ln1.``-keys are the
    first norm's (a PEFT run's block 0 does not save them).
    """

    def __init__(self, model: ModelSpec, plan: Plan, cpu: bool) -> None:
        lay = dtype_layout(plan)
        self.f, self.plan, self.cpu = model.family, plan, cpu
        self.drop = model.dropouts
        self.r, self.c = lay.base_bytes, lay.compute_bytes  # residual stream, matmul dtype
        self.h = model.hidden_size
        self.autocast = lay.autocasts
        self.cuda_autocast = lay.autocasts and not cpu  # CUDA autocast runs softmax, pow, layer_norm in fp32
        self.full = plan.method is Method.FULL
        self.lora = (
            {n for n, _, _, part in model.linears() if plan.lora_targets.covers(part)} if plan.is_peft else set()
        )
        self.rank = plan.lora_rank or 0
        # PEFT casts an adapter's input to the adapter dtype (fp32 under autocast), and
        # autocast casts it back for the matmul: every adapter then saves its own copy. Its
        # bitsandbytes wrapper (lora.bnb.Linear8bitLt) skips the cast where
        # torch.is_autocast_enabled() says so, which without a device asks CUDA: not on the CPU
        self.int8 = plan.method is Method.LORA_8BIT
        self.adapter_recast = lay.autocasts and plan.is_peft and (cpu or not self.int8)
        # what LLM.int8's MatMul8bitLt keeps on its ctx (``ctx.tensors``: the input and, on
        # CUDA, its outlier columns), outside the saved-tensor hooks: checkpointing does not
        # free it and activation offload does not move it (keys as in ``saved``)
        self.held: dict[str, float] = {}
        # dropout's mask: bool on CUDA, the input dtype on the CPU
        # (the residual dropouts drop a projection's output, in the compute dtype)
        self.mask_bytes = self.c if cpu else 1
        self.mlp_bytes = self.c  # a plain MLP's activation dtype (``_mlp_body``)
        self.saved: dict[str, float] = {}
        self.quad = 0.0

    def total(self) -> float:
        return sum(self.saved.values())

    def lin(self, name: str, src: str, src_bytes: int, width: int) -> None:
        """A Linear saves its input when its weight or a LoRA adapter needs it (an LLM.int8
        Linear keeps it anyway: ``_int8_input``)."""
        if self.int8:
            self._int8_input(name, src, src_bytes, width)
        if not (self.full or name in self.lora):
            return
        if (self.autocast and src_bytes != self.c) or (self.adapter_recast and name in self.lora):
            self.saved[name + ".cast"] = width * self.c  # autocast recasts the activation per use
        else:
            self.saved[src] = width * src_bytes
        if name in self.lora:
            self.saved[name + ".lora_mid"] = self.rank * self.c
            if self.plan.lora_dropout:
                self._lora_dropout(name, src, width)

    def _int8_input(self, name: str, src: str, src_bytes: int, width: int) -> None:
        """``MatMul8bitLt`` keeps its input whenever it needs a gradient (bitsandbytes
        autograd/_functions.py: ``ctx.tensors = (CAt, subA, A)``), though a frozen weight's
        backward reads neither; on CUDA also ``subA``, the outlier columns in the input's dtype
        (``costs.int8_outlier_columns``). The CPU's ``MatMul8bitFp`` keeps the input (``ctx.A``)."""
        # (block 0's first norm output needs no gradient there: its outlier columns are keyed
        # with that norm; the output itself is what the adapters save anyway)
        prefix = "ln1." if src in ("n1", "ln1.out") else ""
        held = {src: width * src_bytes}
        if not self.cpu:
            held[prefix + name + ".int8_outliers"] = costs.int8_outlier_columns(width) * src_bytes
        self.held.update(held)
        self.saved.update(held)

    def _lora_dropout(self, name: str, src: str, width: int) -> None:
        """peft ``lora.Linear.forward``: ``lora_B(lora_A(dropout(x)))`` with one ``nn.Dropout`` per
        adapted Linear: each keeps its mask (bool on CUDA, the input's dtype on the CPU) and,
        where the adapter computes in the activations' dtype, its own dropped copy for lora_A.
        Under autocast the adapter's input is already a copy of its own (``.cast``), now dropped.
        The mask is kept only where the input needs a gradient: block 0's first norm output
        does not under PEFT, so the masks of its readers are keyed with the norm (``first_norm``)."""
        in_bytes = 4 if self.adapter_recast else self.c  # the adapter's dtype: fp32 under autocast
        prefix = "ln1." if src in ("n1", "ln1.out") else ""  # an input that is the first norm's output
        self.saved[prefix + name + ".lora_mask"] = width * (in_bytes if self.cpu else 1)
        if not self.adapter_recast:
            self.saved[name + ".lora_drop"] = width * self.c

    def norm(self, name: str, src_bytes: int, src: str = "") -> int:
        """The family's norm of an input of ``src_bytes`` per element; returns its output's.

        ``src``: the key of a LayerNorm input another norm saves too (gpt_neox's two norms
        of the block input), counted once unless CUDA autocast upcasts it per norm.
        """
        return self._rms(name, src_bytes) if self.f.norm == "rmsnorm" else self._layernorm(name, src_bytes, src)

    def _rms(self, name: str, src_bytes: int) -> int:
        if self.plan.fused_kernels:  # Liger's RMSNorm saves its input and one fp32 rstd a row
            self.saved[name + ".x"] = src_bytes * self.h
            self.saved[name + ".rstd"] = 4
            return src_bytes
        self.saved[name + ".x32"] = 4 * self.h  # fp32 upcast of the input (the input itself if fp32)
        self.saved[name + ".rstd"] = 4
        if self.full:  # the weight's grad needs the normalized input
            self.saved[name + ".z"] = (4 if self.f.norm_scales_in_fp32 else src_bytes) * self.h
        return src_bytes

    def _layernorm(self, name: str, src_bytes: int, src: str = "") -> int:
        in_bytes = 4 if self.cuda_autocast else src_bytes  # CUDA autocast runs layer_norm in fp32
        key = src if src and in_bytes == src_bytes else name + ".in"
        self.saved[key] = in_bytes * self.h
        # mean and rstd: fp32 on CUDA, the input's dtype on the CPU
        self.saved[name + ".stats"] = 2 * in_bytes if self.cpu else 8
        return in_bytes

    def head_rms(self, name: str, width: int, heads: int) -> None:
        """Qwen3's RMSNorm of each head of a projection's output (``width`` = heads × head_dim,
        in the compute dtype): as ``_rms``, with one rstd per head (``Qwen3RMSNorm.forward``)."""
        self.saved[name + ".x32"] = 4 * width
        self.saved[name + ".rstd"] = 4 * heads
        if self.full:
            self.saved[name + ".z"] = self.c * width

    def dropout_mask(self, name: str) -> None:
        if "residual" in self.drop:
            self.saved[name + ".mask"] = self.h * self.mask_bytes


def _rope_attention(s: _Saves, model: ModelSpec, masked: bool, kernel: str) -> int:
    """The llama-like attention half: norm, q/k/v, RoPE'd q and k, the kernel's saves, o_proj;
    returns the bytes per element of the norm's output (a parallel MLP reads it too).

    sdpa and flash2 save q, k, v, out and the logsumexp; eager saves the softmax in fp32
    and the probabilities in the compute dtype, s² per head, and copies of q, k, v (not
    the fused projection); torch's math kernel (sdpa's fallback) computes in fp32.
    Partial rotary (phi, gpt_neox) concatenates the rotated and passed parts, so q is
    contiguous per head, the flash kernels' output follows it, and transformers copies it
    back to (tokens, heads·dim) for the output projection (the efficient kernel writes
    that layout itself). That input (``o_in``) is saved by the projection, where its
    weight or adapter needs it (``_Saves.lin``), not by the kernel.
    """
    f, plan, saved, c, h = s.f, s.plan, s.saved, s.c, s.h
    a, qd, kd = model.num_heads, model.q_dim, model.kv_dim
    gqa_repeat = kd < qd and (plan.attention is Attention.EAGER or (masked and plan.attention is Attention.SDPA))
    k_bytes = (qd if gqa_repeat else kd) * c
    ln1 = s.norm("ln1", s.r)
    for n in f.attn_in:
        s.lin(n, "n1", ln1, h)
    if f.qk_norm:
        s.head_rms("q_norm", qd, a)
        s.head_rms("k_norm", kd, model.num_kv_heads)
    if f.fused_qkv and gqa_repeat:  # repeated k and v are copies: the fused output is not kept
        saved["q_rot"], saved["k_rep"], saved["v_rep"] = qd * c, qd * c, qd * c
    elif f.fused_qkv:
        saved["qkv"] = (qd + 2 * kd) * c  # v is a view of the fused output
        saved["q_rot"], saved["k_rot"] = qd * c, kd * c
    else:
        saved["q_rot"] = qd * c
        saved["k_rot"] = k_bytes
        saved["v"] = k_bytes
    if plan.attention is Attention.EAGER:
        # softmax(dtype=fp32) saves its output; .to(compute) makes the probs the
        # matmul with v saves (no copy when computing in fp32)
        s.quad += a * (4 + (c if c != 4 else 0)) + (a * c if f.logit_softcap else 0)
        if f.fused_qkv and not gqa_repeat:  # the matmul copies v out of the fused output
            saved.pop("qkv")
            saved["v"] = kd * c
        attn_out = "o_in"
    elif kernel == "math":
        # torch's math kernel computes in fp32 (it upcasts 16-bit): the scaled q and
        # the (repeated) k and v it multiplies, and the fp32 softmax, are saved
        for k_ in ("qkv", "q_rot", "k_rot", "v", "k_rep", "v_rep"):
            saved.pop(k_, None)
        keep_fused = f.fused_qkv and c == 4  # v stays a view of the fused output
        if keep_fused:
            saved["qkv"] = (qd + 2 * kd) * c
        saved["math.q"], saved["math.k"] = qd * 4, qd * 4
        if not keep_fused:
            saved["math.v"] = qd * 4
        s.quad += a * 4
        attn_out = "o_in"
    else:
        saved["out"], saved["lse"] = qd * c, 4 * a
        attn_out = "out"
        if masked and plan.attention is Attention.SDPA:  # the additive mask the kernel saves
            s.quad += c
        if f.rotary_key and kernel != "efficient":  # partial rotary: the output is copied
            attn_out = "o_in"
    s.lin(f.attn_out, attn_out, c, qd)
    s.dropout_mask("attn.resid")
    return ln1


def _alibi_attention(s: _Saves, model: ModelSpec) -> None:
    """BLOOM's attention half: its own eager attention over the fused projection.

    q, k and v are reshaped out of the fused output into contiguous per-head copies that
    baddbmm (with the ALiBi bias, which it does not save) and bmm save, cast to the compute
    dtype under autocast; the softmax is saved in fp32 and the probabilities in the compute
    dtype (s² per head); the heads are merged into a copy for the output projection.
    """
    f, saved, c, h = s.f, s.saved, s.c, s.h
    a, qd, kd = model.num_heads, model.q_dim, model.kv_dim
    ln1 = s.norm("ln1", s.r)
    for n in f.attn_in:
        s.lin(n, "ln1.out", ln1, h)
    saved["q"], saved["k"], saved["v"] = qd * c, kd * c, kd * c
    s.quad += a * (4 + (c if c != 4 else 0))
    s.lin(f.attn_out, "o_in", c, qd)
    s.dropout_mask("attn.resid")


def _learned_position_attention(s: _Saves, model: ModelSpec, masked: bool) -> None:
    """The GPT-2/BERT attention half: (pre-)norm, q/k/v, the kernel's saves, output, dropout.

    On the CPU, sdpa with dropout runs the math kernel, which saves what eager saves and
    computes half precision in fp32.
    """
    f, plan, saved, c, h = s.f, s.plan, s.saved, s.c, s.h
    a, qd, kd = model.num_heads, model.q_dim, model.kv_dim
    cpu_sdpa = s.cpu and plan.attention is Attention.SDPA
    eager_like = plan.attention is Attention.EAGER or cpu_sdpa
    if f.norm_position == "pre":  # GPT-2
        ln1 = s.norm("ln1", s.r)
        for n in f.attn_in:
            s.lin(n, "ln1.out", ln1, h)
    else:  # BERT: the projections read the block input; the norm follows the residual add
        for n in f.attn_in:
            s.lin(n, "x", s.r, h)
    md = 4 if cpu_sdpa else c
    if eager_like or not f.fused_qkv:
        # matmul on the strided per-head views saves contiguous copies of q, k, v
        saved["q"], saved["k"], saved["v"] = qd * md, kd * md, kd * md
    else:
        saved["qkv"] = (qd + 2 * kd) * c  # q, k, v are views of one output
    if eager_like:
        # softmax output (fp32 under CUDA autocast), dropout mask and dropped probs
        soft = 4 if s.cuda_autocast and plan.attention is Attention.EAGER else md
        s.quad += a * (soft + (md if s.cpu else 1) + md)
        saved["o_in"] = qd * c
        attn_out = "o_in"
    else:
        saved["out"], saved["lse"] = qd * c, 4 * a
        attn_out = "out"
        if masked and plan.attention is Attention.SDPA:  # the bool mask made additive, saved by the kernel
            s.quad += c
    s.lin(f.attn_out, attn_out, c, qd)
    s.dropout_mask("attn.resid")


def _gated_mlp(s: _Saves, model: ModelSpec) -> tuple[str, str, str]:
    """The gated MLP half (and Gemma-2's post-attention norm); returns the names
    (down projection, its input, the norm's output) the MLP's forward transients need."""
    f, saved, c, h = s.f, s.saved, s.c, s.h
    inter = model.intermediate_size
    if f.norm_position == "sandwich":  # the attention output is normed before its residual add
        s.norm("post_attn", c)
        n2, n2_bytes = "pre_ff.out", s.norm("pre_ff", s.r)
    else:
        n2, n2_bytes = "n2", s.norm("ln2", s.r)
    for n in f.mlp_in:
        s.lin(n, n2, n2_bytes, h)
    saved["gate"], saved["up"] = inter * c, inter * c
    if not s.plan.fused_kernels:  # Liger's SwiGLU recomputes silu(gate) in backward
        saved["act"] = inter * c
    s.lin(f.mlp_out, "prod", c, inter)
    if f.norm_position == "sandwich":
        s.norm("post_ff", c)
    return f.mlp_out, "prod", n2


def _moe_mlp(s: _Saves, model: ModelSpec) -> tuple[str, str, str]:
    """A sparse MoE block (``MixtralSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``, Qwen2-MoE's) after the second
    norm, as transformers' ``grouped_mm_experts_forward`` saves it for each of the ``k`` rows a
    token is routed to (``evaluators/moe.py``). The experts run in the weights' dtype (the input
    is cast to it: fp32 master weights under autocast make them fp32): the gate/up output (its
    halves are what SiLU and the product save), SiLU's output, and the down projection's output,
    which the routing weights' product saves for their gradient; with trainable experts also the
    gathered input and the product (the grouped GEMMs' inputs, for the weight gradients). The
    router: its input (a trainable router only), the fp32 softmax, the top-k indices and
    weights; the expert order (``perm``, ``perm // k``, the inverse permutation), int64."""
    saved, c, h = s.saved, s.c, s.h
    k, e, w, ce = model.experts_per_token, model.num_experts, model.expert_width, s.r
    n2, n2_bytes = "n2", s.norm("ln2", s.r)
    if model.shared_expert_width:
        _shared_expert(s, model, n2, n2_bytes)
    if s.full:  # the router's weight gradient reads its input (autocast's 16-bit copy under autocast)
        if s.autocast and n2_bytes != c:
            saved["router.cast"] = h * c
        else:
            saved[n2] = h * n2_bytes
    saved["router.probs"] = 4 * e
    saved["router.topk"] = k * (8 + 4) + 4  # indices, the top weights and their sum (norm_topk)
    saved["experts.order"] = 3 * 8 * k + 4 * k  # perm, perm // k, the inverse; the sorted weights
    saved["gate_up"] = 2 * w * k * ce
    saved["act"] = w * k * ce
    saved["experts.out"] = h * k * ce
    if s.full:
        saved["experts.in"] = h * k * ce
        saved["prod"] = w * k * ce
    return "experts.down", "prod", n2


def _shared_expert(s: _Saves, model: ModelSpec, n2: str, n2_bytes: int) -> None:
    """Qwen2-MoE's shared expert (``Qwen2MoeSparseMoeBlock``): a gated MLP of Linears on the normed
    input, scaled by ``sigmoid(shared_expert_gate(x))``, whose product saves the sigmoid and the
    MLP's output."""
    f, saved, c, h = s.f, s.saved, s.c, s.h
    ws = model.shared_expert_width
    for n in (*f.mlp_in, "shared_expert_gate"):
        s.lin(n, n2, n2_bytes, h)
    saved["shared.gate"], saved["shared.up"], saved["shared.act"] = ws * c, ws * c, ws * c
    s.lin(f.mlp_out, "shared.prod", c, ws)
    saved["shared.sigmoid"], saved["shared.out"] = c, h * c


def _moe_transients(s: _Saves, model: ModelSpec, norm_out: str) -> tuple[float, float, float]:
    """Bytes per token an MoE block holds beyond its saves while its experts run backward and
    forward (``grouped_mm_experts_forward``'s locals live until it returns). Forward, at the
    inverse permutation of the weighted output: the residual, the norm's output where nothing
    saves it, the gathered input where the grouped GEMM does not save it (or saves its cast),
    the weighted output before and after the permutation (fp32 where the routing weights are),
    and the int64 sorted ids, inverse permutation and its arange. Backward, the larger of two
    moments (a real CPU step's live set, Mixtral's block at hidden/width 256/2048, 256/256,
    512/128 and 1024/256 in bf16 and fp32): as the routing weights' product runs backward, three
    tensors of ``k × hidden`` per token in the weighted output's dtype (the un-permuted gradient,
    its product with the weights, and the one for the weights' own gradient) and the gradient's
    cast to the experts' dtype where it differs; as SiLU(gate)·up runs backward, the down GEMM's
    input gradient and the gradients of SiLU's output and of up, ``k × width`` each (the down
    output's gradients are gone by then).
    A recompute stops at the permutation's save of its index, before the permuted copy (the
    third figure: what it never makes)."""
    h, c, r = s.h, s.c, s.r
    k, w, ce = model.experts_per_token, model.expert_width, r  # the experts compute in the weights' dtype
    # the weighted output's dtype: the experts' promoted with the routing weights' (fp32 where the
    # router keeps them so, ``Family.router_fp32``; else the router logits', the compute dtype)
    p = max(ce, 4 if model.family.router_fp32 else c)
    gathered = 0.0 if "experts.in" in s.saved and ce == c else k * h * c
    fwd = h * r + (0.0 if norm_out in s.saved else h * c) + gathered + 2 * k * h * p + 3 * 8 * k
    bwd = k * max(h * (3 * p + (ce if p != ce else 0)), 3 * w * ce)
    return bwd, fwd, k * h * p


def _plain_mlp(s: _Saves, model: ModelSpec) -> tuple[str, str, str]:
    """The GPT-2/BERT/BLOOM MLP half after attention (with BERT's post-attention norm,
    which feeds it); returns the names as ``_gated_mlp`` does."""
    if s.f.norm_position == "pre":  # GPT-2
        src, src_bytes = "ln2.out", s.norm("ln2", s.r)
    else:  # BERT
        src, src_bytes = "x1", s.norm("ln_attn", s.r)
    names = _mlp_body(s, model, src, src_bytes)
    if s.f.norm_position == "post":
        s.norm("ln_out", s.r)
    return names


def _parallel_mlp(s: _Saves, model: ModelSpec, ln1_bytes: int) -> tuple[str, str, str]:
    """The MLP half of a parallel block, which reads the block input as attention does:
    through attention's own norm (phi: one norm per layer; its output is saved once) or a
    second norm of the same input (gpt_neox: the input is saved once, the stats twice)."""
    if s.f.norms_per_layer == 1:
        return _mlp_body(s, model, "n1", ln1_bytes)
    return _mlp_body(s, model, "ln1.mlp.out", s.norm("ln1.mlp", s.r, src="ln1.in"))


def _mlp_body(s: _Saves, model: ModelSpec, src: str, src_bytes: int) -> tuple[str, str, str]:
    """fc -> GELU -> fc from the normed input ``src`` and the residual dropout; returns the
    names as ``_gated_mlp`` does."""
    f, saved, c, h = s.f, s.saved, s.c, s.h
    inter = model.intermediate_size
    for n in f.mlp_in:
        s.lin(n, src, src_bytes, h)
    # bitsandbytes' 4-bit Linear returns its input's dtype: after a LayerNorm CUDA autocast
    # ran in fp32, a QLoRA MLP's activation runs in fp32 too
    fc = s.mlp_bytes = src_bytes if s.plan.method is Method.QLORA else c
    if f.activation == "gelu_new":
        if s.cuda_autocast:
            # CUDA autocast runs pow in fp32: pow saves its fp32 input, tanh and 1+tanh
            # are fp32, 0.5x stays 16-bit, and the fp32 product is recast for c_proj
            saved["gelu.x32"], saved["gelu.tanh"], saved["gelu.onep"] = (inter * 4,) * 3
            saved["gelu.half"] = inter * fc
            s.lin(f.mlp_out, "gelu.out", 4, inter)
        else:
            # NewGELU is written in Python ops: x, tanh(...), 0.5x and 1+tanh are saved
            saved["fc"], saved["gelu.tanh"], saved["gelu.half"], saved["gelu.onep"] = (inter * fc,) * 4
            s.lin(f.mlp_out, "gelu.out", fc, inter)
    else:
        saved["fc"] = inter * fc  # exact GELU (and BLOOM's GELU Function) saves its input
        s.lin(f.mlp_out, "gelu.out", fc, inter)
    s.dropout_mask("mlp.resid")
    return f.mlp_out, "gelu.out", src


# inter-wide tensors a plain MLP's activation holds at the height of its backward, net of
# the down projection's input (freed by then): exact GELU its gradient in and out;
# gelu_new one more (a chain of Python ops); BLOOM's GELU Function recomputes tanh and its
# derivative in Python ops (measured on the CPU)
# (gelu_pytorch_tanh is torch's one tanh-GELU op: as exact GELU, it saves only its input)
_PLAIN_MLP_BACKWARD = {"gelu": 1, "gelu_pytorch_tanh": 1, "gelu_new": 2, "bloom_gelu": 6}


@functools.lru_cache(maxsize=4096)
def block_activations(
    model: ModelSpec, plan: Plan, masked: bool, cpu: bool = False, capability: tuple[int, int] = (8, 0)
) -> _Block:
    """What one transformer block saves for backward, per token. See the module doc.

    ``cpu``: the CPU's kernels, which differ where it matters: dropout keeps its mask in
    the input dtype (CUDA: bool), sdpa with dropout runs the math kernel, which saves
    what eager saves, and autocast leaves layer_norm, pow and softmax in 16-bit (CUDA
    autocast runs them in fp32). ``capability``: the CUDA GPU's, which decides the sdpa
    kernel (``sdpa_kernel``).
    """
    if model.hybrid:
        return _stack_block(model, plan, masked, cpu, capability)
    if model.derived:  # read from transformers' model: its formulas, where one traced block confirms them
        from autofit.evaluators import traced

        if traced.formulas_miss(model):
            blk = _traced_block(model, plan, masked, cpu, capability)
            # op-level checkpointing's policy walks the formulas (``sac_saves``): on a traced block
            # (plan_problems refuses it where the modules already say why), what it keeps is bounded
            # by everything the block saves
            return replace(blk, sac_tok=blk.tok, sac_quad=blk.quad) if plan.checkpoint_ops else blk
    blk = _formula_block(model, plan, masked, cpu, capability)
    if plan.torch_compile:
        blk = _compiled_block(blk, model, plan, cpu, capability)
    if plan.checkpoint_ops:
        kernel = sdpa_kernel(model, plan, masked, cpu, capability) if plan.attention is Attention.SDPA else ""
        tok, quad, _, _ = sac_saves(model, plan, cpu, _sac_kernel(model, plan, kernel))
        blk = replace(blk, sac_tok=tok, sac_quad=quad)
    return blk


def _stack_block(model: ModelSpec, plan: Plan, masked: bool, cpu: bool, capability: tuple[int, int]) -> _Block:
    """A hybrid stack's blocks (``ModelSpec.layer_kinds``), each kind's as any model's, in one
    ``_Block`` whose fields are every kind's worst for one block: the most it saves or holds as a
    transient, the least it frees early; ``kinds`` keeps each kind's own for what the stack saves
    layer by layer (``_activations``)."""
    stack = model.stack
    blocks = [block_activations(k, plan, masked, cpu, capability) for _, k in model.layer_kinds()]
    kinds = tuple((tuple(i for i, x in enumerate(stack) if x == j), b) for j, b in enumerate(blocks))
    freed = ("first_norm", "mlp_tok", "attn_freed", "probs_quad", "recompute_cut")
    worst = {
        f.name: (min if f.name in freed else max)(getattr(b, f.name) for b in blocks)
        for f in fields(_Block)
        if f.name not in ("bwd_rise", "kinds")
    }
    return _Block(**worst, bwd_rise=tuple(r for b in blocks for r in b.bwd_rise), kinds=kinds)


def _formula_block(model: ModelSpec, plan: Plan, masked: bool, cpu: bool, capability: tuple[int, int]) -> _Block:
    """The block itemized by the formulas, from the family's fields."""
    f = model.family
    s = _Saves(model, plan, cpu)
    rope = f.positions == "rope"
    kernel = sdpa_kernel(model, plan, masked, cpu, capability) if plan.attention is Attention.SDPA else ""
    ln1 = s.r
    if rope:
        ln1 = _rope_attention(s, model, masked, kernel)
    elif f.positions == "alibi":
        _alibi_attention(s, model)
    else:
        _learned_position_attention(s, model, masked)
    before_mlp = s.total()
    if f.moe:
        down, prod, norm_out = _moe_mlp(s, model)
    elif f.gated_mlp:
        down, prod, norm_out = _gated_mlp(s, model)
    elif f.parallel_residual:
        down, prod, norm_out = _parallel_mlp(s, model, ln1)
    else:
        down, prod, norm_out = _plain_mlp(s, model)
    blk = _block_summary(s, model, kernel == "math" and rope, before_mlp, down, prod, norm_out)
    return blk


def _compiled_block(blk: _Block, model: ModelSpec, plan: Plan, cpu: bool, capability: tuple[int, int]) -> _Block:
    """The formulas' block under torch.compile: its saves moved by what the partitioner keeps less
    (or more) than eager on one traced block (``traced.compile_delta``: evaluators/compiled.py),
    and its backward graph's rise beside eager's transients."""
    from autofit.evaluators import traced

    dtok, dquad = traced.compile_delta(model, plan, cpu, capability)
    return replace(
        blk,
        tok=max(0.0, blk.tok + dtok),
        quad=max(0.0, blk.quad + dquad),
        bwd_rise=traced.compiled_work(model, plan, cpu, capability).bwd_rise,
    )


def _block_note(model: ModelSpec) -> dict[str, str]:
    """How the analytic evaluator read a derived model's block (``TrialResult.extra["block"]``): each
    kind's, for a hybrid stack."""
    if not model.derived:
        return {}
    from autofit.evaluators import traced

    def how(kind: ModelSpec) -> str:
        why = traced.formulas_miss(kind)
        return (
            f"one block traced for its saves: {why}"
            if why
            else "itemized by the formulas, which one traced block confirms"
        )

    read = f"{model.model_type} ({model.family.decoder_layer}, read from transformers)"
    if not model.hybrid:
        return {"block": f"{read}: {how(model)}"}
    kinds = "; ".join(f"{n} from layer {k.first_layer}: {how(k)}" for n, k in model.layer_kinds())
    return {"block": f"{read}, layers of {len(model.layer_kinds())} kinds: {kinds}"}


def _traced_block(model: ModelSpec, plan: Plan, masked: bool, cpu: bool, capability: tuple[int, int]) -> _Block:
    """A block from one traced block's saves (``traced.block_terms``); the transients a forward
    census cannot see measured on its trace where it has a mixer no formula sizes
    (``traced.mixer_work``), else at an MoE block's sizes where it routes experts, else at a llama
    block's sizes of the same widths (``_block_summary``): the
    gated MLP's gradients, its forward's residual, norm output, projection output and product,
    eager attention's fp32 scores and softmax gradients. Nothing is counted as freed early."""
    from autofit.evaluators import traced

    tok, quad = traced.block_terms(model, plan, cpu, capability)
    lay = dtype_layout(plan)
    r, c, h, inter, a = lay.base_bytes, lay.compute_bytes, model.hidden_size, model.intermediate_size, model.num_heads
    eager = plan.attention is Attention.EAGER
    blk = _Block(
        tok=tok,
        quad=quad,
        bwd_tok=2 * inter * c + 8 * h,
        fwd_quad=a * (c + (4 if c != 4 else 0)) if eager else 0.0,
        first_norm=0.0,
        mlp_tok=0.0,
        attn_freed=0.0,
        probs_quad=0.0,
        attn_bwd_quad=a * (8 + (0.5 if c != 4 else 0)) if eager else 0.0,
        mlp_fwd_tok=h * r + 2 * h * c + inter * c,
    )
    if model.mixer:  # no formula sizes a Mamba or delta-rule mixer's transients: measured on its trace
        work = traced.mixer_work(model, plan, cpu, capability)
        return replace(
            blk,
            bwd_tok=work.bwd_tok,
            bwd_quad=work.bwd_quad,
            mlp_fwd_tok=work.fwd_tok,
            mlp_fwd_quad=work.fwd_quad,
            fwd_quad=0.0,
            attn_bwd_quad=0.0,
        )
    if model.family.moe:  # the experts' transients (``_moe_transients``), at the routed experts' sizes
        moe = _formula_block(model, plan, masked, cpu, capability)
        blk = replace(blk, bwd_tok=moe.bwd_tok, mlp_fwd_tok=moe.mlp_fwd_tok)
    return blk


def _block_summary(
    s: _Saves, model: ModelSpec, math: bool, before_mlp: float, down: str, prod: str, norm_out: str
) -> _Block:
    """The block's saves and the transients around them (measured on the CPU)."""
    f, plan, saved, r, c, h = s.f, s.plan, s.saved, s.r, s.c, s.h
    inter, a = model.intermediate_size, model.num_heads
    # the MLP's gradients while it runs backward: a gated MLP's gate and up gradients; a
    # plain MLP's activation backward (``_PLAIN_MLP_BACKWARD``)
    # (Liger's SwiGLU writes the gate and up gradients over its saved inputs: none)
    gated_grads = 0 if plan.fused_kernels else 2 * inter * c
    bwd_tok = gated_grads + 8 * h if f.gated_mlp else _PLAIN_MLP_BACKWARD[f.activation] * inter * s.mlp_bytes + h * c
    # while the MLP's down projection runs forward: the residual kept for the block's last
    # add (a parallel block keeps attention's output instead: its residual is the block
    # input), the norm's output and the product when nothing saves them, the projection's
    # output, and PEFT's fp32 copy of its input under autocast (not modelled for post-norm)
    mlp_fwd_tok = cut = 0.0
    if f.moe:
        bwd_tok, mlp_fwd_tok, cut = _moe_transients(s, model, norm_out)
    elif f.norm_position != "post":
        mlp_fwd_tok = (
            h * (c if f.parallel_residual else r)
            + (0.0 if norm_out in saved else h * c)
            + h * c
            + (0.0 if prod in saved else inter * c)
            + (inter * 4 if s.adapter_recast and down in s.lora else 0.0)
            # ... and, with LoRA dropout, the dropped fp32 copy beside it (peft's dropout output)
            + (inter * 4 if s.adapter_recast and down in s.lora and plan.lora_dropout else 0.0)
        )
    eager = plan.attention is Attention.EAGER
    # softmax backward holds the fp32 gradient in and out (+ part of a 16-bit cast),
    # once the MLP's saved tensors of the block are already freed (measured on the CPU)
    attn_bwd_quad = a * (8 + (0.5 if c != 4 else 0)) if eager else (a * 8 if math else 0.0)
    # the scores before softmax (BLOOM's baddbmm output stays referenced beside the masked
    # scores), and softmax(dtype=fp32)'s upcast of a 16-bit input
    scores = 2 if f.positions == "alibi" else 1
    fwd_quad = a * (scores * c + (4 if c != 4 else 0)) if eager else (a * 4 if math else 0.0)
    first_norm = sum(v for k, v in saved.items() if k.startswith("ln1."))
    total = s.total()
    held_tok = sum(s.held.values())
    probs_quad = a * c if eager and c != 4 and f.positions != "learned" else 0.0
    attn_freed = saved.get("o_in", 0.0) + saved.get(f.attn_out + ".cast", 0.0)
    return _Block(
        total,
        s.quad,
        bwd_tok,
        fwd_quad,
        first_norm,
        total - before_mlp,
        attn_freed,
        probs_quad,
        attn_bwd_quad,
        mlp_fwd_tok,
        held_tok,
        cut,
    )


def _sac_kernel(model: ModelSpec, plan: Plan, sdpa: str) -> str:
    """The attention a block runs, as op-level checkpointing sees it: ``eager`` (its matmuls),
    ``alibi`` (BLOOM's baddbmm and bmm), ``math`` (sdpa's math kernel, decomposed into matmuls in
    fp32), or ``kernel`` (one op whose output and logsumexp are saved: sdpa's flash or efficient
    kernel, FlashAttention-2)."""
    if model.family.positions == "alibi":
        return "alibi"
    if plan.attention is Attention.EAGER:
        return "eager"
    return "math" if sdpa == "math" else "kernel"


@functools.lru_cache(maxsize=1024)
def sac_saves(
    model: ModelSpec, plan: Plan, cpu: bool, attention: str
) -> tuple[float, float, tuple[bool, ...], tuple[bool, ...]]:
    """What op-level selective checkpointing (``techniques.SAC_SAVED_OPS``, torchtitan's policy)
    saves of one block's forward: (bytes per token, bytes per token per attended position, for
    each Linear of ``model.linears()`` whether it is recomputed, the same for each LoRA adapter's
    two GEMMs in ``_gemms`` order).

    A bias-free Linear is an ``mm`` (counted: every second one is recomputed), a Linear with a bias
    an ``addmm`` (GPT-2's Conv1D, which has biases, too: always saved), each LoRA adapter two bias-free ``mm``
    after its base Linear's (peft ``lora.Linear.forward``). Quantized base weights run as one
    bitsandbytes op that the policy does not save (``gemm_4bit``; on CUDA LLM.int8's int8 GEMM;
    the CPU's ``MatMul8bitFp`` dequantizes into a plain ``mm``). Attention (``_sac_kernel``): a
    kernel op saves its output and fp32 logsumexp; eager saves both matmuls' outputs (the
    scores, s² per head); the math kernel the same in fp32; BLOOM's ``baddbmm`` is not on the
    list, its second matmul is.
    """
    f, c = model.family, dtype_layout(plan).compute_bytes
    a, qd = model.num_heads, model.q_dim
    r = plan.lora_rank or 0
    bias = {"attention": f.qkv_bias, "out": f.out_bias, "mlp": f.mlp_bias}
    mm_base = plan.method in (Method.FULL, Method.LORA) or (plan.method is Method.LORA_8BIT and cpu)
    count, tok, quad = 0, 0.0, 0.0
    base, adapters = [], []

    def matmul(width: int, counted: bool) -> bool:  # whether it is recomputed
        nonlocal count, tok
        count += counted
        if counted and count % 2 == 0:
            return True
        tok += width * c
        return False

    for name, _, o, part in model.linears():
        if name == f.attn_out:  # the attention between the projections and their output
            md = 4 if attention == "math" else c
            quad += {"eager": a * c, "math": a * 4}.get(attention, 0)
            tok += qd * md + (4 * a if attention == "kernel" else 0)
        has_bias = bias["out" if name == f.attn_out else part]
        base.append(matmul(o, not has_bias) if mm_base else True)
        if plan.is_peft and plan.lora_targets.covers(part):
            adapters += [matmul(r, True), matmul(o, True)]
    return tok, quad, tuple(base), tuple(adapters)


@functools.lru_cache(maxsize=4096)
def _head_activations(model: ModelSpec, plan: Plan, cpu: bool = False) -> float:
    """Bytes per token saved outside the blocks: embeddings, final norm, the head's input.

    ``cpu``: CPU autocast leaves layer_norm in the input's dtype and keeps its statistics
    in it (CUDA: an fp32 upcast and fp32 statistics).
    """
    f, lay = model.family, dtype_layout(plan)
    r, c, h = lay.base_bytes, lay.compute_bytes, model.hidden_size
    autocast = lay.autocasts
    full = plan.method is Method.FULL
    ln_in = 4 if autocast and not cpu else r  # a LayerNorm's saved input, and its output
    ln_stats = 2 * ln_in if cpu else 8
    n = 0.0
    if "embedding" in model.dropouts:
        n += h  # embedding dropout mask
    if f.embed_norm and full:  # embedding LayerNorm input (frozen embeddings and norm save nothing)
        n += ln_in * h + ln_stats
    if f.task == "masked-lm":
        if full:  # MLM transform: dense input, GELU input, LayerNorm input
            n += r * h + c * h + (4 if autocast else c) * h + 8
        head_in = c
    elif f.norm == "rmsnorm" and plan.fused_kernels:  # Liger's: the input and its rstd
        n += r * h + 4
        head_in = r
    elif f.norm == "rmsnorm":
        n += 4 * h + 4 + ((4 if f.norm_scales_in_fp32 else r) * h if full else 0)
        head_in = r
    else:
        n += ln_in * h + ln_stats
        head_in = ln_in
    if full and not (autocast and head_in != c):  # the head's weight grad needs its input
        n += head_in * h  # (under autocast the head's cast copy is made in the logits region)
    return n


def logits_bytes(model: ModelSpec, plan: Plan, tokens: int) -> tuple[float, float]:
    """(forward transient, loss-backward) peak bytes of logits and loss intermediates.

    transformers' loss upcasts the logits to fp32 and log_softmax saves its fp32 output;
    the 16-bit logits die with the model output before backward, and in the loss
    backward the nll and log_softmax gradients (fp32) exist beside the saved output:
    12 bytes per logit. A fused/chunked loss holds one chunk of tokens at a time
    (Liger's chunk rule: ~hidden/vocab of the tokens) and recomputes it in backward.
    """
    lay = dtype_layout(plan)
    c = lay.compute_bytes
    v = model.vocab_size
    up = 4 if c != 4 else 0  # the fp32 upcast is a no-op in fp32
    cap = c if model.family.logit_softcap else 0  # gemma2's tanh soft-cap output
    # full fine-tuning under autocast: the head casts its fp32 input to 16-bit and keeps it
    head_cast = (
        c * model.hidden_size * tokens if (lay.autocasts and lay.base_bytes != c and plan.method is Method.FULL) else 0
    )
    if plan.fused_loss:
        chunk = min(tokens, costs.next_pow2(tokens / -(-v // model.hidden_size)))
        # + the head's weight gradient (full fine-tuning), whole on every rank until the loss backward
        # ends: autograd sums each chunk's into its input buffer out of place
        # (torch/csrc/autograd/input_buffer.cpp, accumulate), so the running sum, the chunk's and
        # their sum are alive at once; one where a single chunk covers the tokens
        copies = 3 if chunk < tokens else 1
        grad_w = v * model.hidden_size * (4 if c == 4 or lay.autocasts else c) if plan.method is Method.FULL else 0
        return (c + up + 4) * v * chunk + head_cast, (c + up + 12) * v * chunk + head_cast + copies * grad_w
    if model.family.task == "masked-lm" and not lay.autocasts:
        # BERT's MLM loss takes the logits as they are: log_softmax saves them in the compute
        # dtype, and its backward holds the nll and log_softmax gradients in it too
        return 2 * c * v * tokens, 3 * c * v * tokens
    return (c + up + 4 + cap) * v * tokens + head_cast, (12 + cap) * v * tokens + head_cast


def adafactor_step_bytes(model: ModelSpec, plan: Plan, elem_bytes: int) -> float:
    """What torch's Adafactor step allocates at its worst: each matrix's variance estimate
    (full size, in the gradient's dtype) is made while the previous one is still referenced,
    so two consecutive matrices (parameter order) are alive at once."""
    L = model.num_layers
    if plan.is_peft:
        r = plan.lora_rank or 0
        layer = [x for _, i, o, part in model.linears() if plan.lora_targets.covers(part) for x in (r * i, o * r)]
        sizes = layer * min(L, 2)
    else:
        emb = [model.vocab_size * model.hidden_size]
        if model.family.positions == "learned":
            emb.append(model.max_position_embeddings * model.hidden_size)
        # 0: a norm's vector between two matrices (GPT-2/BERT's first LayerNorm, the final norm)
        sep = [0] if model.family.norm == "layernorm" else []
        layer = model.block_tensors()  # an MoE block's router and whole expert tensors after its Linears
        sizes = emb + sep + layer * min(L, 2)
        if not model.tie_word_embeddings:
            sizes += [0, model.vocab_size * model.hidden_size]
    pairs = [a + b for a, b in zip(sizes, sizes[1:])] or sizes
    return float(max(pairs) * elem_bytes)


# -- the evaluator ------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimate:
    memory: MemoryAnatomy
    throughput: Throughput
    peak_phase: str


def _tokens(plan: Plan, workload: Workload) -> tuple[int, int, float, float]:
    """(memory tokens, attended length, expected computed tokens, keys per token) per micro-batch."""
    mb, s = plan.micro_batch, workload.seq_len
    if plan.context_parallel > 1:  # rows of s/cp tokens whose queries meet all s keys (evaluators.context)
        local = context.local_workload(plan, workload).seq_len
        return mb * local, local, mb * local, float(s)
    if plan.packing:
        t_mem = workload.packed_tokens_peak(mb)
        t_time = mb * workload.mean_tokens
        d = workload.lengths
        e_l2 = (sum(n * n * k for n, k in d.histogram) / d.total) if d else s * s
        keys = e_l2 / (2 * workload.mean_tokens)
        return t_mem, s, t_time, keys
    row = workload.padded_len(mb)
    return mb * s, s, mb * row, row


@dataclass(frozen=True)
class _Activations:
    """One micro-batch's activation bytes on one rank, and the transients around them."""

    block: float  # one block's saved tensors (a hybrid stack's largest)
    blocks: float  # every block's saved tensors, as none were checkpointed
    saved: float  # everything saved for backward: blocks (or their inputs), head, RoPE tables
    head: float  # saved outside the blocks
    rope: float  # RoPE's cos and sin
    recompute: float  # one block's activations while checkpointing recomputes it
    # the saves of the unchecked blocks after the last checkpointed one (selective), freed
    # before its recompute; 0 where the last block is checkpointed (full) or none is
    trailing: float
    offloaded: float  # what an activation offload keeps in host memory (plan.offload_activations)
    logits_fwd: float
    logits_bwd: float
    mask: float  # the attention mask
    fwd_temp: float  # transients of a block's forward
    mlp_fwd: float  # ... of its MLP's forward (or recompute)
    bwd_temp: float  # ... of its MLP's backward
    attn_bwd_temp: float  # ... of its softmax backward


def _activations(
    model: ModelSpec, plan: Plan, ctx: Target, blk: _Block, masked: bool, t_mem: int, s: int
) -> _Activations:
    lay = dtype_layout(plan)
    L, c = model.num_layers, lay.compute_bytes
    block_bytes = t_mem * (blk.tok + s * blk.quad)
    # RoPE's cos and sin, [1, positions, rotary dims] each, shared by all blocks
    rope = 2 * (t_mem if plan.packing else s) * model.rotary_dim * lay.base_bytes
    head = t_mem * _head_activations(model, plan, ctx.cluster.gpu.kind == "cpu")
    flags = checkpointed_layers(plan, L)
    n_ckpt = sum(flags)
    # op-level checkpointing's saved outputs: its recompute takes them back instead of computing
    # them (they are among the block's saves then), and its forward makes them
    sac = t_mem * (blk.sac_tok + s * blk.sac_quad)
    cpu = ctx.cluster.gpu.kind == "cpu"
    inputs = _checkpoint_inputs(model, plan, cpu, flags) * t_mem
    layers = blk.layers(L)  # each layer's own block (a hybrid stack's kinds differ)

    def saves(b: _Block) -> float:
        return t_mem * (b.tok + s * b.quad)

    def kept(b: _Block) -> float:
        """What a checkpointed block keeps beside its input (what LLM.int8 holds, and what
        op-level checkpointing saves); the others keep their saves."""
        return t_mem * (b.sac_tok + s * b.sac_quad + b.held_tok)

    saved_blocks = inputs + sum(kept(b) if f else saves(b) for b, f in zip(layers, flags))
    if plan.is_peft and not flags[0]:  # the frozen embedding's output needs no grad: block 0's first norm saves nothing
        saved_blocks -= t_mem * layers[0].first_norm
    # one block's activations while it runs backward
    recompute = max(saves(b) - t_mem * (b.sac_tok + s * b.sac_quad) for b in layers) if n_ckpt else 0.0
    last = max(i for i, f in enumerate(flags) if f) if n_ckpt else L - 1
    trailing = sum(saves(b) for b in layers[last + 1 :])
    offloaded = 0.0
    if plan.offload_activations:
        # every block's saves go to the host (evaluators.offload) and come back node by node
        # in backward (the backward moments' transients); the head's stay: not offloaded
        everyone = sum(t_mem * b.held_tok for b in layers)
        offloaded, saved_blocks = saved_blocks - everyone, everyone
    logits_fwd, logits_bwd = logits_bytes(model, plan, t_mem)
    mask = (t_mem * s * (c if plan.attention is Attention.EAGER else 1)) if masked else 0.0
    bwd_temp = t_mem * (blk.bwd_tok + s * blk.bwd_quad)
    if blk.bwd_rise:  # a compiled block's backward runs as one graph
        bwd_temp = max(bwd_temp, max(c + t_mem * (t + s * q) for c, t, q in blk.bwd_rise))
    attn_bwd_temp = t_mem * s * blk.attn_bwd_quad
    fwd_temp = t_mem * s * blk.fwd_quad
    if flags[-1]:
        # a checkpointed forward saves nothing: what the attention half would save is transient
        fwd_temp += block_bytes - sac - t_mem * blk.mlp_tok
    if plan.quantized:  # one Linear dequantized to the compute dtype at a time
        dequant = max(i * o for _, i, o, _ in model.linears()) * c
        bwd_temp += dequant  # MatMul4Bit's and MatMul8bitLt's backwards always dequantize
        attn_bwd_temp += dequant
        # forward: bitsandbytes' fused kernel up to 1536 rows on CUDA; beyond, and always
        # on the CPU, dequantize + linear (runtime.bnb_decompositions); LLM.int8 dequantizes
        # on the CPU only (MatMul8bitFp), and on CUDA quantizes the input (``_int8_forward``)
        if cpu or (plan.method is Method.QLORA and t_mem > 1536):
            fwd_temp += dequant
        elif plan.method is Method.LORA_8BIT:
            fwd_temp += t_mem * _int8_forward(model, plan, c)
    return _Activations(
        block=block_bytes,
        blocks=sum(saves(b) for b in layers),
        saved=saved_blocks + head + rope,
        head=head,
        rope=rope,
        recompute=recompute,
        trailing=trailing,
        offloaded=offloaded,
        logits_fwd=logits_fwd,
        logits_bwd=logits_bwd,
        mask=mask,
        fwd_temp=fwd_temp,
        mlp_fwd=t_mem * (blk.mlp_fwd_tok + s * blk.mlp_fwd_quad),
        bwd_temp=bwd_temp,
        attn_bwd_temp=attn_bwd_temp,
    )


def _residual_bytes(model: ModelSpec, plan: Plan, cpu: bool) -> int:
    """Bytes per element of the residual stream after the first block.

    bitsandbytes' 4-bit Linear returns its input's dtype (``Linear4bit.forward`` casts the
    product back to ``inp_dtype``), and CUDA autocast runs layer_norm in fp32 (its fp32 op list;
    the CPU's keeps it 16-bit): a LayerNorm block's QLoRA MLP then runs in fp32, and its fp32
    output promotes the residual add, so every later block's input is fp32. An RMSNorm casts
    back to the weight's dtype itself (``LlamaRMSNorm.forward``).
    """
    lay = dtype_layout(plan)
    if plan.method is Method.QLORA and lay.autocasts and not cpu and model.family.norm == "layernorm":
        return 4
    return lay.base_bytes


def _checkpoint_inputs(model: ModelSpec, plan: Plan, cpu: bool, flags: list[bool]) -> float:
    """Bytes per token the checkpointed blocks keep as their inputs: block 0's is the embedding
    output, the others the residual stream."""
    h, n_ckpt = model.hidden_size, sum(flags)
    inputs = h * (n_ckpt * _residual_bytes(model, plan, cpu) - flags[0] * _widened(model, plan, cpu))
    if plan.is_peft and n_ckpt and _multiplied_embeddings(model):
        # checkpointing makes the frozen embedding's output a leaf that needs a gradient
        # (``PreTrainedModel.enable_input_require_grads``); multiplied into block 0's input, it is
        # held by its AccumulateGrad node until backward, beside the product
        inputs += h * dtype_layout(plan).base_bytes
    return inputs


@functools.lru_cache(maxsize=256)
def _multiplied_embeddings(model: ModelSpec) -> bool:
    """Whether the model multiplies its embedding's output outside the embedding module, by its
    config's ``embedding_multiplier`` (Granite's, Falcon-H1's, HyperCLOVA X's ``model.forward``)."""
    return getattr(model.to_hf_config(), "embedding_multiplier", None) is not None


def _widened(model: ModelSpec, plan: Plan, cpu: bool) -> int:
    """How many more bytes per element the residual stream has than block 0's input (the embedding's output)."""
    return _residual_bytes(model, plan, cpu) - dtype_layout(plan).base_bytes


def _int8_forward(model: ModelSpec, plan: Plan, c: int) -> float:
    """Bytes per token an LLM.int8 Linear holds at once in its CUDA forward, the largest of
    the block's (evaluators/int8.py, from bitsandbytes' CUDA ops): while quantizing, the
    input's fp16 copy (none when it is fp16 already), the int8 copy, ``abs`` and the
    outlier mask; then the int8 input, the GEMM's int32 output, its fp16 dequantization and
    the cast to the input's dtype."""
    fp16 = plan.precision is Precision.FP16_MIXED
    cast = 0 if fp16 else 2
    return max(max(i * (cast + 1 + 2 + 1), i + o * (4 + 2 + (0 if fp16 else c))) for _, i, o, _ in model.linears())


@dataclass(frozen=True)
class _States:
    """Model states of one rank as the engine shards them, and what a step adds to them."""

    sb: costs.StateBytes  # before sharding
    st: costs.ShardedStates
    layer_trainable: float  # trainable elements of one block
    autocast_copies: float  # autocast's 16-bit weight copies alive through backward
    # ... and in forward, where autocast's cache holds every block's (checkpointed or not) until it exits
    forward_copies: float
    first_block_copies: float  # ... of them still alive at the first block's backward
    early_grads: float  # the output head's gradient (first micro-batch), sharded
    block_tail_grads: float  # the last block's MLP and output-projection gradients, sharded
    held_grads: float  # whole gradients ZeRO or FSDP hold beside a block's backward (costs.held_grads)
    tied_grad: float  # the head's gradient meeting the tied embedding's


def _model_states(model: ModelSpec, plan: Plan, ctx: Target) -> _States:
    lay = dtype_layout(plan)
    L, c = model.num_layers, lay.compute_bytes
    ckpt = all_checkpointed(plan)
    # blocks whose matmuls keep autocast's copies: the unchecked ones and the one recomputed
    n_ckpt = sum(checkpointed_layers(plan, L))
    kept = L - n_ckpt + (1 if n_ckpt else 0)
    sb = costs.state_bytes(model, plan)
    # one block's weights as ZeRO-3/FSDP gather them: in the compute dtype (NF4 stays packed)
    layer_weights = costs.block_weight_bytes(model, plan, c)
    layer_trainable = (sb.trainable_weights / sb.param_elem_bytes) / L
    step_tmp = 0.0
    if plan.optimizer is Optimizer.ADAFACTOR:
        step_tmp = adafactor_step_bytes(model, plan, sb.param_elem_bytes)
    st = costs.shard_states(plan, model, ctx.cluster, sb, layer_weights, layer_trainable, step_tmp)
    # autocast caches a 16-bit copy of every fp32 weight a matmul uses, and the matmuls
    # save them for backward
    autocast_copies = forward_copies = 0.0
    if lay.autocasts and plan.method is Method.FULL:
        head_copy = model.vocab_size * model.hidden_size
        # (full checkpointing: only the recomputed block's copies live on)
        autocast_copies = 2 * (model.linear_params() * kept / L + head_copy)
        forward_copies = 2 * (model.linear_params() + head_copy)
    elif lay.autocasts:  # the fp32 LoRA adapters
        autocast_copies = 2 * sb.trainable_weights / sb.param_elem_bytes * kept / L
        forward_copies = 2 * sb.trainable_weights / sb.param_elem_bytes
    # gradients alive while the last block runs backward: the accumulated ones, or (first
    # micro-batch) the output head's, sharded where the engine shards gradients
    head_grads = model.vocab_size * model.hidden_size * sb.grad_elem_bytes if plan.method is Method.FULL else 0
    early_grads = head_grads * st.gradients / max(sb.gradients, 1)
    block_tail_grads = 0.0
    if plan.method is Method.FULL:
        tail = max(_tail_params(k) for _, k in model.layer_kinds())
        block_tail_grads = tail * sb.grad_elem_bytes * st.gradients / max(sb.gradients, 1)
    held_grads = costs.held_grads(plan, model, sb)
    return _States(
        sb=sb,
        st=st,
        layer_trainable=layer_trainable,
        autocast_copies=autocast_copies,
        forward_copies=forward_copies,
        # by the first block's backward the other blocks' copies are freed with their saved tensors
        first_block_copies=autocast_copies if ckpt else autocast_copies / kept,
        early_grads=early_grads,
        block_tail_grads=block_tail_grads,
        held_grads=held_grads,
        tied_grad=early_grads if model.tie_word_embeddings else 0.0,
    )


def _tail_params(model: ModelSpec) -> int:
    """The weights whose gradients a block's backward makes before its attention's softmax: the
    MLP's and the attention output's (post-norm blocks, BERT: the MLP's only), an MoE block's
    routed experts' gate_up_proj and down_proj (all experts each)."""
    f = model.family
    tail = sum(
        i * o
        for n, i, o, part in model.linears()
        if part != "attention" or (n == f.attn_out and f.norm_position != "post")
    )
    if f.moe:
        tail += 3 * model.num_experts * model.expert_width * model.hidden_size
    return tail


def _moments(
    model: ModelSpec, plan: Plan, act: _Activations, ms: _States, blk: _Block, t_mem: int, s: int
) -> dict[str, dict[str, float]]:
    """The anatomy at each moment of a steady-state step that can be its peak, in step order."""
    st = ms.st
    states = {"weights": st.weights + ms.autocast_copies, "optimizer": st.optimizer}
    persistent_tmp = st.comm_buffers + st.gather_peak + act.mask
    # the head's saves are freed by then; the last block is recomputed when it is checkpointed
    in_blocks = act.saved - act.head + (act.recompute if not act.trailing else 0.0)
    bwd_states = states
    if plan.offload_activations:  # autocast's copies leave with its cache; those saved are offloaded
        bwd_states = {**states, "weights": st.weights + ms.first_block_copies}
    moments = {
        **_forward_moments(act, ms, blk, t_mem, {**states, "weights": st.weights + ms.forward_copies}, persistent_tmp),
        **_backward_moments(model, plan, act, ms, blk, t_mem, s, bwd_states, persistent_tmp, in_blocks),
        **_step_end_moments(ms, persistent_tmp),
    }
    if act.recompute:
        recomputed = act.saved - act.head - act.trailing + act.recompute
        moments.update(_recompute_moments(model, plan, act, blk, t_mem, moments, persistent_tmp, recomputed))
    if plan.optimizer_in_backward:  # each gradient is freed by its own step (runtime.BackwardOptimizer)
        largest = _largest_grad(model, plan, ms.sb)
        for m in moments.values():
            m["gradients"] = min(m["gradients"], largest)
    # a block's whole gradients before the engine reduces them (an optimizer in backward
    # steps only the reduced ones): on top of the sharded ones, in the blocks' backward
    for name in ("block-backward", "attention-backward", "first-block-backward", "first-block-attention-backward"):
        moments[name]["gradients"] += ms.held_grads
    return moments


def _largest_grad(model: ModelSpec, plan: Plan, sb: costs.StateBytes) -> float:
    """The largest gradient one trainable parameter has: the most an optimizer in backward
    holds at once (the next one is made only after the last one's step)."""
    linears = model.linears()
    if plan.method is Method.FULL:
        n = max(model.vocab_size * model.hidden_size, max(i * o for _, i, o, _ in linears))
    else:  # an adapter's A or B
        n = (plan.lora_rank or 0) * max(max(i, o) for _, i, o, _ in linears)
    return n * sb.grad_elem_bytes


def _forward_moments(act, ms, blk, t_mem, states, persistent_tmp) -> dict[str, dict[str, float]]:
    st = ms.st
    in_forward = act.saved - act.head
    mlp_half = 0.0 if act.recompute and not act.trailing else t_mem * blk.mlp_tok  # the last block checkpointed
    fwd_acts, fwd_tmp = max((in_forward - mlp_half, act.fwd_temp), (in_forward, act.mlp_fwd), key=lambda m: m[0] + m[1])
    return {
        "forward": {
            **states,
            "gradients": st.grad_accum_present,
            "activations": act.saved,
            "logits": act.logits_fwd,
            "temporary": persistent_tmp,
        },
        # the last block's forward, before the logits: its attention (eager's scores, before
        # its MLP saved anything; checkpointing saves no block) or its MLP's transients
        "block-forward": {
            **states,
            "gradients": st.grad_accum_present,
            "activations": fwd_acts,
            "logits": 0.0,
            "temporary": persistent_tmp + fwd_tmp,
        },
    }


def _backward_moments(
    model, plan, act, ms, blk, t_mem, s, states, persistent_tmp, in_blocks
) -> dict[str, dict[str, float]]:
    st, sb = ms.st, ms.sb
    ckpt = all_checkpointed(plan)
    # what a block's attention backward no longer holds: its MLP, o_proj input and 16-bit probs
    freed = t_mem * (blk.mlp_tok + blk.attn_freed) + t_mem * s * blk.probs_quad
    first_grads = st.gradients - ms.layer_trainable * sb.grad_elem_bytes * st.gradients / max(sb.gradients, 1)
    first = (t_mem * dtype_layout(plan).base_bytes * model.hidden_size if ckpt else 0) + act.block + act.rope
    if plan.offload_activations and not ckpt:
        # an offloaded block's saves come back node by node and leave with it (evaluators.offload)
        freed, first = 0.0, act.rope
    return {
        "loss-backward": {
            **states,
            # (a chunked loss's head gradient is in its logits until the loss backward ends)
            "gradients": st.grad_accum_present,
            "activations": act.saved,
            "logits": act.logits_bwd,
            "temporary": persistent_tmp,
        },
        "block-backward": {
            **states,
            "gradients": max(st.grad_accum_present, ms.early_grads),
            "activations": in_blocks,
            "logits": 0.0,
            "temporary": persistent_tmp + act.bwd_temp,
        },
        # mid-softmax-backward of the last block: the MLP's and o_proj's weight gradients exist
        "attention-backward": {
            **states,
            "gradients": max(st.grad_accum_present, ms.early_grads + ms.block_tail_grads),
            "activations": in_blocks - freed,
            "logits": 0.0,
            "temporary": persistent_tmp + act.attn_bwd_temp,
        },
        "first-block-backward": {
            **states,
            "weights": st.weights + ms.first_block_copies,
            "gradients": max(st.grad_accum_present, first_grads),
            "activations": first,
            "logits": 0.0,
            "temporary": persistent_tmp + act.bwd_temp,
        },
        # ... and mid-softmax-backward of the first block, every other gradient made
        "first-block-attention-backward": {
            **states,
            "weights": st.weights + ms.first_block_copies,
            "gradients": max(st.grad_accum_present, first_grads + ms.block_tail_grads),
            "activations": first - freed,
            "logits": 0.0,
            "temporary": persistent_tmp + act.attn_bwd_temp,
        },
    }


def _step_end_moments(ms, persistent_tmp) -> dict[str, dict[str, float]]:
    st = ms.st
    return {
        # the end of backward: every gradient; with tied embeddings the head's and the
        # embedding's gradients meet in the shared weight's .grad, added out of place, all
        # three alive at once
        # (the head's one was made in the loss's backward: a storage tracker calls it logits)
        "backward-end": {
            "weights": st.weights,
            "optimizer": st.optimizer,
            "gradients": st.gradients,
            "activations": 0.0,
            "logits": ms.tied_grad,
            "temporary": persistent_tmp + ms.tied_grad,
        },
        "optimizer-step": {
            "weights": st.weights,
            "optimizer": st.optimizer,
            "gradients": st.gradients,
            "activations": 0.0,
            "logits": 0.0,
            "temporary": st.comm_buffers + st.step_temporary,
        },
    }


def _recompute_moments(model, plan, act, blk, t_mem, moments, persistent_tmp, in_blocks) -> dict[str, dict[str, float]]:
    """A block being recomputed in backward, in the middle of its MLP: what it saves so far
    plus the MLP's forward transients (counted as activations: they are recomputed); the last
    checkpointed block's (``in_blocks``: what is saved then), and with full checkpointing the first's."""
    mlp_fwd = act.mlp_fwd - t_mem * blk.recompute_cut
    incoming = 2 * t_mem * model.hidden_size * dtype_layout(plan).compute_bytes  # the gradient arriving
    last = {
        "block-recompute": {
            **moments["block-backward"],
            "activations": in_blocks + mlp_fwd,
            "temporary": persistent_tmp + incoming,
        }
    }
    if not all_checkpointed(plan):  # selective every k-th: block 0 is not checkpointed
        return last
    return {
        **last,
        "first-block-recompute": {
            **moments["first-block-backward"],
            "activations": moments["first-block-backward"]["activations"] + mlp_fwd,
            "temporary": persistent_tmp + incoming,
        },
    }


def _anatomy(
    moments: dict[str, dict[str, float]], ctx: Target, st: costs.ShardedStates, offloaded: float = 0.0
) -> tuple[MemoryAnatomy, str]:
    """The anatomy at the peak moment (the first of equals), with the allocator and device on top."""
    cluster = ctx.cluster
    phase = max(moments, key=lambda k: sum(moments[k].values()))
    comp = {k: int(v) for k, v in moments[phase].items()}
    if cluster.gpu.kind == "cuda":  # allocated for the process's life (costs.cublas_workspace_bytes)
        comp["temporary"] += sum(costs.cublas_workspaces(cluster.gpu.compute_capability))
    return costs.on_device(comp, cluster, st.host + offloaded, cluster.gpu.kind), phase


def estimate(plan: Plan, ctx: Target) -> Estimate:
    """The analytic anatomy and throughput of a valid plan."""
    model, cluster, workload = ctx.model, ctx.cluster, ctx.workload
    blk, act, t_mem, s, t_time, keys = _micro_batch(plan, ctx)
    ms = _model_states(model, plan, ctx)
    offloaded = _offloaded(plan, act, ms)
    moments = _moments(model, plan, act, ms, blk, t_mem, s)
    ring = context.ring_transient(model, plan, t_mem)  # at every moment, as the simulator adds it at its peak
    for m in moments.values():
        m["temporary"] += ring
    memory, phase = _anatomy(moments, ctx, ms.st, offloaded)
    throughput = timing.throughput(
        step_work(plan, ctx, ms.sb, t_time, keys, act.blocks / ctx.model.num_layers, offloaded * t_time / t_mem),
        cluster,
        workload.tokens_per_step(),
    )
    return Estimate(memory, throughput, phase)


def _offloaded(plan: Plan, act: _Activations, ms: _States) -> float:
    """Bytes an activation offload copies to the host per micro-batch: the blocks' saves and
    the autocast copies of the weights their matmuls saved (not the recomputed block's)."""
    if not plan.offload_activations:
        return 0.0
    return act.offloaded + ms.autocast_copies - ms.first_block_copies


def work(plan: Plan, ctx: Target) -> timing.StepWork:
    """The step's work alone (what ``benchmarks/published_runs.py`` prices under other rates)."""
    _, act, t_mem, _, t_time, keys = _micro_batch(plan, ctx)
    offloaded = _offloaded(plan, act, _model_states(ctx.model, plan, ctx)) * t_time / t_mem
    return step_work(
        plan, ctx, costs.state_bytes(ctx.model, plan), t_time, keys, act.blocks / ctx.model.num_layers, offloaded
    )


def _masked(model: ModelSpec, plan: Plan, workload: Workload) -> bool:
    """Whether a 4D mask reaches the attention kernel: padded batches, or a model that always builds it."""
    return not plan.packing and (workload.lengths is not None or model.family.mask_always)


def _micro_batch(plan: Plan, ctx: Target):
    """One micro-batch: the block's itemized saves, the activations, and the tokens
    (``_tokens``: for memory, attended length, computed, keys per token)."""
    model, cluster = ctx.model, ctx.cluster
    masked = _masked(model, plan, ctx.workload)
    t_mem, s, t_time, keys = _tokens(plan, ctx.workload)
    blk = block_activations(model, plan, masked, cluster.gpu.kind == "cpu", cluster.gpu.compute_capability)
    act = _activations(model, plan, ctx, blk, masked, t_mem, s)
    return blk, act, t_mem, s, t_time, keys


# Kernels one block issues, as counted in the simulator's traced steps of Llama-3.2-1B
# (bf16, sdpa, micro-batch 1; ``benchmarks/published_runs.py`` prints the count of every
# traced row): forward ~40, backward ~73 (weight gradients included), +10 forward / +16
# backward under autocast (the casts), +4 forward and +4 backward per LoRA-adapted Linear.
KERNELS_FWD, KERNELS_BWD = 40, 73
KERNELS_AUTOCAST_FWD, KERNELS_AUTOCAST_BWD = 10, 16
KERNELS_PER_ADAPTER = 4
KERNELS_HEAD = 10  # head, loss and its backward, each way
# Kernels Liger's fused RMSNorm, SwiGLU and RoPE save a block, counted the same way (bf16,
# sdpa: 40 -> 15 forward, 73 -> 29 backward; under autocast 50 -> 27 and 89 -> 41)
KERNELS_FUSED_FWD, KERNELS_FUSED_BWD = 24, 44
# ... and what an MoE block (grouped_mm_experts_forward) issues beyond a dense one, counted the
# same way on tiny Mixtral against Mistral (bf16): the router's softmax, top-k and
# renormalization, the sort, gathers, histogram and offsets, the inverse permutation and the
# weighted sum (38 -> 57 forward, 71 -> 95 backward)
KERNELS_MOE_FWD, KERNELS_MOE_BWD = 19, 24


def step_work(
    plan: Plan,
    ctx: Target,
    sb: costs.StateBytes,
    tokens: float,
    keys: float,
    block_bytes: float,
    offloaded: float = 0.0,
):
    """One rank's step as ``timing.StepWork``: every GEMM of the blocks, the head and the
    adapters with its shape; attention FLOPs by kernel; the elementwise, logits,
    dequantization and autocast-cast traffic; the kernels issued; the engine's collectives
    and host traffic (``offloaded``: activation bytes a micro-batch moves to the host)."""
    model, cluster, workload = ctx.model, ctx.cluster, ctx.workload
    lay = dtype_layout(plan)
    L = model.num_layers
    cb = lay.compute_bytes
    T = tokens
    rc = sum(checkpointed_layers(plan, L)) / L  # the share of blocks recomputed in backward
    full = plan.method is Method.FULL
    block, head, adapters = _gemms(model, plan, T, cb)
    n_adapted = sum(g[3] for g in adapters) / 2 / L  # adapted Linears a block (a hybrid stack's mean)
    causal = model.family.task == "causal-lm"
    attended = keys / 2 if causal and plan.attention is not Attention.EAGER and not plan.packing else keys
    attn_fwd = 4 * T * attended * model.q_dim * model.attending_layers
    attn_bwd = attn_fwd * (2.5 if plan.attention is not Attention.EAGER else 2.0)
    mixers = _mixers(plan, ctx, T, keys)
    attn_fwd, attn_bwd = attn_fwd + mixers.flops[0], attn_bwd + mixers.flops[1]  # as attention: batched products
    recomputed, attn_recompute = _recomputed(plan, ctx, (*block, *adapters), rc, attn_fwd)

    logits = 0 if plan.fused_loss else (cb + 16) * model.vocab_size * T
    q_fwd, q_bwd, q_k_fwd, q_k_bwd = _quantized_work(model, plan, T, cluster.gpu.kind == "cpu")
    fwd_bytes, bwd_bytes, casts = _block_traffic(plan, ctx, T, keys, block_bytes, mixers)
    k_fwd, k_bwd = mixers.mean_kernels(L, *_block_kernels(model, plan, n_adapted, q_k_fwd, q_k_bwd))
    if plan.torch_compile:  # the compiled block's fused kernels and library calls (traced.compiled_work)
        work = _compiled(plan, ctx)
        k_fwd, k_bwd = work.fwd_kernels, work.bwd_kernels
    forward = timing.PhaseWork(
        gemms=(*block, *head, *adapters),
        attention=attn_fwd,
        memory_bytes=fwd_bytes + logits / 2 + q_fwd + casts,
        kernels=L * k_fwd + KERNELS_HEAD,
    )
    weight_grads = (*block, *head) if full else ()
    backward = timing.PhaseWork(
        gemms=(*block, *head, *weight_grads, *adapters, *adapters, *recomputed),
        attention=attn_bwd + attn_recompute,
        memory_bytes=bwd_bytes + fwd_bytes * rc + logits / 2 + q_bwd + (q_fwd + casts) * rc,
        kernels=L * (k_bwd + k_fwd * rc) + KERNELS_HEAD,
    )
    dp = cluster.world_size
    sharded = plan.zero_stage >= 1 or plan.engine == "fsdp"
    opt_bytes = costs.optimizer_step_bytes(plan, sb) / (dp if sharded else 1)
    tensors = _trainable_tensors(model, plan, n_adapted)
    optimizer = timing.PhaseWork(
        memory_bytes=opt_bytes,
        kernels=0 if plan.offload is not Offload.NONE else _optimizer_kernels(plan, tensors),
    )
    model_flops = forward.gemm_flops + attn_fwd + backward.gemm_flops + attn_bwd
    model_flops -= sum(f * n for f, _, _, n in recomputed) + attn_recompute
    return timing.StepWork(
        dtype=costs.compute_dtype(plan),
        attention_kernel=attention_kernel(model, plan, workload, cluster),
        forward=forward,
        backward=backward,
        optimizer=optimizer,
        micro_batches=plan.grad_accum,
        transfers=context.with_ring(costs.transfer_work(plan, model, cluster, sb, offloaded), model, plan, T, rc),
        model_flops=plan.grad_accum * model_flops,
    )


def _block_traffic(plan: Plan, ctx: Target, tokens: float, keys: float, block_bytes: float, mixers: _Mixers):
    """The blocks' memory-bound bytes forward and backward (a recompute repeats the forward's), and
    autocast's weight casts, per micro-batch of ``tokens``.

    Eager: activations written in forward and read in backward, their gradients written and read
    (eager's s² tensors are in ``block_bytes``); Liger's kernels read and write each norm, SwiGLU
    and RoPE tensor once where eager chains of ops each read and write it (``fused_traffic``).
    A mixer's block moves what its trace moved (``mixers.moved``): a Mamba scan's torch code
    writes and reads far more than the block saves (Falcon-H1: 4× forward). Autocast reads each
    fp32 weight and writes its 16-bit copy per forward (and recompute), and backward casts the
    16-bit weight gradients back to fp32. Compiled: what the block's fused kernels move
    (``traced.compiled_work``), the blocks' casts among them."""
    model, L = ctx.model, ctx.model.num_layers
    head_params = model.vocab_size * model.hidden_size
    autocast_full = dtype_layout(plan).autocasts and plan.method is Method.FULL
    if plan.torch_compile:
        fwd, bwd = _compiled(plan, ctx).bytes(tokens, keys)
        return L * fwd, L * bwd, head_params * 6 if autocast_full else 0.0
    elementwise = block_bytes * L - mixers.saved
    fused_fwd = fused_traffic(model, tokens) if plan.fused_kernels else 0.0
    casts = (model.linear_params() + head_params) * 6 if autocast_full else 0.0
    fwd = max(0.0, 1.5 * elementwise - fused_fwd) + mixers.moved[0]
    return fwd, max(0.0, 2.5 * elementwise - 2.5 * fused_fwd) + mixers.moved[1], casts


def _compiled(plan: Plan, ctx: Target):
    """The compiled block's census (``traced.compiled_work``) on the target's kernels."""
    from autofit.evaluators import traced

    gpu = ctx.cluster.gpu
    return traced.compiled_work(ctx.model, plan, gpu.kind == "cpu", gpu.compute_capability)


def _recomputed(plan: Plan, ctx: Target, gemms: tuple[Gemm, ...], rc: float, attn_fwd: float):
    """What a backward's recompute runs again: every GEMM (the blocks' and the adapters') and the
    attention of the checkpointed share ``rc`` of the blocks, or under op-level checkpointing the
    GEMMs its policy does not save (``sac_saves``) and no attention but BLOOM's scores."""
    if not plan.checkpoint_ops:
        return (tuple((f, b, d, n * rc) for f, b, d, n in gemms) if rc else ()), attn_fwd * rc
    model, cluster = ctx.model, ctx.cluster
    cpu = cluster.gpu.kind == "cpu"
    kernel = sdpa_kernel(model, plan, _masked(model, plan, ctx.workload), cpu, cluster.gpu.compute_capability)
    attention = _sac_kernel(model, plan, kernel if plan.attention is Attention.SDPA else "")
    _, _, again, again_adapters = sac_saves(model, plan, cpu, attention)
    recomputed = tuple(g for g, on in zip(gemms, (*again, *again_adapters), strict=True) if on)
    return recomputed, attn_fwd / 2 if attention == "alibi" else 0.0


def _block_kernels(model: ModelSpec, plan: Plan, n_adapted: float, q_fwd: float, q_bwd: float) -> tuple[float, float]:
    """Kernels one block issues forward and backward (the ``KERNELS_*`` counts; ``q_*``: the
    quantized weights', ``_quantized_work``)."""
    autocasts = dtype_layout(plan).autocasts
    k_fwd = KERNELS_FWD + q_fwd + (KERNELS_AUTOCAST_FWD if autocasts else 0) + KERNELS_PER_ADAPTER * n_adapted
    k_bwd = KERNELS_BWD + q_bwd + (KERNELS_AUTOCAST_BWD if autocasts else 0) + KERNELS_PER_ADAPTER * n_adapted
    if plan.fused_kernels:
        k_fwd, k_bwd = k_fwd - KERNELS_FUSED_FWD, k_bwd - KERNELS_FUSED_BWD
    moe = sum(n for n, k in model.layer_kinds() if k.family.moe) / model.num_layers  # the share of MoE blocks
    return k_fwd + moe * KERNELS_MOE_FWD, k_bwd + moe * KERNELS_MOE_BWD


@dataclass(frozen=True)
class _Mixers:
    """The layers whose kinds mix tokens with a mixer no formula describes (``ModelSpec.mixer``), as
    their traces measured them (``traced.mixer_work``), over all such layers for one micro-batch:
    their own products' FLOPs, the bytes their memory-bound ops move and the bytes they save, each
    forward and backward; the kernels they issue (a Mamba mixer's torch path launches some per
    token)."""

    layers: int = 0
    flops: tuple[float, float] = (0.0, 0.0)
    moved: tuple[float, float] = (0.0, 0.0)
    saved: float = 0.0
    kernels: tuple[float, float] = (0.0, 0.0)

    def mean_kernels(self, num_layers: int, k_fwd: float, k_bwd: float) -> tuple[float, float]:
        """A block's mean kernels each way: the mixers' own, and ``k_fwd``/``k_bwd`` for each other layer."""
        rest = num_layers - self.layers
        return (self.kernels[0] + rest * k_fwd) / num_layers, (self.kernels[1] + rest * k_bwd) / num_layers


def _mixers(plan: Plan, ctx: Target, tokens: float, keys: float) -> _Mixers:
    """:class:`_Mixers` of the model for a micro-batch of ``tokens`` tokens meeting ``keys`` keys each."""
    model, gpu = ctx.model, ctx.cluster.gpu
    kinds = [(n, _mixer_work(k, plan, gpu)) for n, k in model.layer_kinds() if k.mixer]
    if not kinds:
        return _Mixers()
    seq = ctx.workload.seq_len // max(1, plan.context_parallel)

    def over(terms: str) -> float:  # a MixerWork field over all the mixers' layers
        return sum(n * tokens * (getattr(w, terms)[0] + keys * getattr(w, terms)[1]) for n, w in kinds)

    fused = (KERNELS_FUSED_FWD, KERNELS_FUSED_BWD) if plan.fused_kernels else (0, 0)
    kernels = [sum(n * (w.kernels(seq)[i] - fused[i]) for n, w in kinds) for i in (0, 1)]
    return _Mixers(
        layers=sum(n for n, _ in kinds),
        flops=(over("fwd_flops"), over("bwd_flops")),
        moved=(over("fwd_bytes"), over("bwd_bytes")),
        saved=over("saved"),
        kernels=(kernels[0], kernels[1]),
    )


def _mixer_work(kind: ModelSpec, plan: Plan, gpu):
    """``traced.mixer_work`` of one kind of layer on ``gpu``'s kernels."""
    from autofit.evaluators import traced

    return traced.mixer_work(kind, plan, gpu.kind == "cpu", gpu.compute_capability)


def _quantized_work(model: ModelSpec, plan: Plan, tokens: float, cpu: bool) -> tuple[float, float, float, float]:
    """The quantized base weights' forward and backward bytes over all blocks, and their
    kernels per block each way (a recompute repeats the forward's).

    QLoRA: every Linear's NF4 weight dequantized to 16-bit each way (its kernels are in the
    base counts). LLM.int8 (lora-8bit), counted per element from the ops of evaluators/int8.py
    (bitsandbytes' CUDA path), for a 16-bit input: the fp16 cast (4 bytes read and written),
    ``abs`` (4), the outlier mask (3), its column reduction (1), zeroing the outlier columns
    (2), the row-wise quantization (3) and the outlier gather (2) on the input side; the int8
    GEMM's int32 output (4), its dequantization to fp16 (6) and the cast back (4) on the
    output side; an fp16 input skips both casts. Each forward also reads the int8 weight's
    outlier columns out of the whole weight (1 byte a parameter); each backward dequantizes
    the weight (``CB.to(dtype)`` and the scale product: 1 + 3 bytes of the input's dtype a
    parameter). The CPU's ``MatMul8bitFp`` dequantizes the same way in both. Kernels: 11 a
    Linear in forward (8 in fp16), 3 in backward, as the trace counts them.
    """
    if plan.method is Method.QLORA:
        dequant = model.linear_params() * (costs.NF4_BYTES_PER_PARAM + 2)
        return dequant, dequant, 0, 0
    if plan.method is not Method.LORA_8BIT:
        return 0.0, 0.0, 0, 0
    c = dtype_layout(plan).compute_bytes
    lins = [(n, lin, k.mixer) for n, k in model.layer_kinds() for lin in k.linears()]  # (layers, Linear, mixer)
    per_block = sum(n for n, _, _ in lins) / model.num_layers  # Linears a block (a hybrid stack's mean)
    weights = model.linear_params()
    dequant = weights * (1 + 3 * c)
    if cpu:
        return dequant, dequant, 3 * per_block, 3 * per_block
    cast = 0 if plan.precision is Precision.FP16_MIXED else 2 + c
    # (a mixer's block moves what its trace moved, its inputs' quantization among it: ``_mixers``)
    per_token = sum(n * (i * (15 + cast) + o * (10 + cast)) for n, (_, i, o, _), mixer in lins if not mixer)
    forward = tokens * per_token + weights
    return forward, dequant, (8 if cast == 0 else 11) * per_block, 3 * per_block


def fused_traffic(model: ModelSpec, tokens: float) -> float:
    """Forward bytes Liger's RMSNorm, SwiGLU and RoPE kernels do not move, over all blocks.

    Per element, the eager ops read and write: an RMSNorm's upcast, square, mean, scaling,
    downcast and weight product ~36 bytes against the fused kernel's 4 (two norms a block);
    SiLU and its product with up 10 against 6; RoPE's products with cos and sin, the
    rotated half and the sum ~24 against 4 (q and k). That is 215 KB a token a block for
    Llama-3.2-1B, against the 209 KB its traced step (bf16) saves, whose backward saves ~2.5×
    the forward's (``step_work``).
    """
    per_token = 32 * 2 * model.hidden_size + 4 * model.intermediate_size + 20 * (model.q_dim + model.kv_dim)
    return per_token * tokens * model.num_layers


Gemm = tuple[float, float, float, float]  # timing.PhaseWork's (flops, bytes, smallest dim, count)


def _gemms(model: ModelSpec, plan: Plan, tokens: float, elem_bytes: int) -> tuple[list[Gemm], list[Gemm], list[Gemm]]:
    """The forward GEMMs of a micro-batch of ``tokens``: the blocks' Linears, the head, and
    each LoRA adapter's two (down to the rank and back up)."""
    T = tokens

    def gemm(i: float, o: float, count: float) -> Gemm:
        return (2 * T * i * o, (T * i + i * o + T * o) * elem_bytes, min(T, i, o), count)

    block: list[Gemm] = []
    adapters: list[Gemm] = []
    r = plan.lora_rank or 0
    for L, kind in model.layer_kinds():  # each kind of a hybrid stack, its layers
        block += [gemm(i, o, L) for _, i, o, _ in kind.linears()] + _expert_gemms(kind, L, T, elem_bytes)
        if plan.is_peft:
            for _, i, o, part in kind.linears():
                if plan.lora_targets.covers(part):
                    adapters += [gemm(i, r, L), gemm(r, o, L)]
    head = [gemm(model.hidden_size, model.vocab_size, 1)]
    if model.family.task == "masked-lm":
        head.append(gemm(model.hidden_size, model.hidden_size, 1))
    return block, head, adapters


def _expert_gemms(model: ModelSpec, L: int, tokens: float, elem_bytes: int) -> list[Gemm]:
    """``L`` MoE blocks' forward GEMMs over ``tokens``: the router's, and each expert's gate/up and
    down projection of its share of the ``tokens × k`` routed rows, under the balanced routing
    (``evaluators/moe.py``) as the simulator prices ``torch._grouped_mm``."""
    if not model.family.moe:
        return []
    h, e, w = model.hidden_size, model.num_experts, model.expert_width
    m = tokens * model.experts_per_token / e  # rows per expert

    def gemm(rows: float, i: float, o: float, count: float) -> Gemm:
        return (2 * rows * i * o, (rows * i + i * o + rows * o) * elem_bytes, min(rows, i, o), count)

    return [gemm(tokens, h, e, L), gemm(m, h, 2 * w, L * e), gemm(m, w, h, L * e)]


def attention_kernel(model: ModelSpec, plan: Plan, workload: Workload, cluster) -> str:
    """The attention kernel a plan runs, by ``timing.ATTENTION_KERNELS`` name."""
    if plan.attention is Attention.EAGER:
        return "eager"
    if plan.attention is Attention.FLASH2:
        return "flash"
    gpu = cluster.gpu
    return sdpa_kernel(model, plan, _masked(model, plan, workload), gpu.kind == "cpu", gpu.compute_capability)


def _trainable_tensors(model: ModelSpec, plan: Plan, n_adapted: float) -> int:
    if plan.is_peft:
        return round(2 * n_adapted * model.num_layers)
    # each block's Linears, two norms, and an MoE block's router and its two expert tensors
    return sum(L * (len(k.linears()) + 2 + (3 if k.family.moe else 0)) for L, k in model.layer_kinds()) + 2


def _optimizer_kernels(plan: Plan, tensors: int) -> float:
    """Kernels of the optimizer step: torch's fused AdamW steps every tensor in a few
    multi-tensor launches (6 in the traced steps); bitsandbytes' 8-bit optimizers launch one
    kernel per tensor; Adafactor (``foreach=False``) and SGD about ten small ops per tensor. A
    step in backward runs one optimizer per tensor: fused AdamW's launches for each."""
    if plan.optimizer is Optimizer.ADAMW:
        return 6 * tensors if plan.optimizer_in_backward else 6
    if plan.optimizer in (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT):
        return tensors
    return 10 * tensors


class AnalyticEvaluator(Evaluator):
    """Closed-form anatomy and roofline time. Assumes a valid plan (see plan_problems)."""

    name = "analytic"

    def evaluate(self, plan: Plan, ctx: Target, on_step: StepCallback | None = None) -> TrialResult:
        t0 = time.perf_counter()
        try:
            est = estimate(plan, ctx)
        except CensusError as exc:  # a derived block PEFT or a fake kernel refuses under this plan
            return self.failed(plan, ctx, str(exc), t0)
        margin = costs.fit_margin(self.name, ctx.cluster.gpu.kind)
        status, reason = judge(est.memory, ctx)
        return TrialResult(
            plan=plan,
            status=status,
            evaluator=self.name,
            memory=est.memory,
            throughput=est.throughput,
            capacity_bytes=ctx.capacity_bytes,
            reason=reason,
            duration_s=time.perf_counter() - t0,
            extra={
                "peak_phase": est.peak_phase,
                "time_error": timing.time_error(self.name),
                **costs.fit_margin_extra(margin, est.memory, ctx.budget_bytes),
                **model_notes(ctx.model, plan),
                **_block_note(ctx.model),
                **context.note(plan, ctx.workload),
            },
        )

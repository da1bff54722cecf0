"""The analytic evaluator: closed-form memory anatomy and roofline time, in microseconds.

Activations are itemized tensor by tensor from what autograd saves in the real
transformers blocks (checked against a storage tracker on real CPU steps in
tests/evaluators/test_analytic.py): RMSNorm's fp32 upcast and rstd, every projection's
input (once per distinct tensor, or once per projection under autocast, which recasts
activations on every use), RoPE'd q/k, the attention kernel's saved q/k/v/out/logsumexp
(or eager's fp32 softmax and 16-bit probabilities, s² per head), the gated MLP's gate,
activation, up and product, and LayerNorm/dropout for GPT-2 and BERT. Frozen weights
save nothing of their input; LoRA adapters save their input and the rank-wide middle.

The peak is the largest of four moments of a steady-state step (loss backward, the last
block's backward, the end of backward, the optimizer step), and the breakdown is the
one *at* that moment.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

from autofit.evaluators import costs
from autofit.specs import Target
from autofit.evaluators.base import Evaluator, StepCallback
from autofit.results import MemoryAnatomy, Throughput, TrialResult, judge
from autofit.plan import (
    Attention,
    Checkpointing,
    LoraTargets,
    Method,
    Optimizer,
    Plan,
    Precision,
)
from autofit.specs import ModelSpec, Workload

# bitsandbytes NF4 with double quantization (the QLoRA default we export): 4-bit codes,
# an 8-bit absmax per 64 weights, an fp32 absmax per 256 of those.
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
# bitsandbytes 8-bit optimizers keep 32-bit state for tensors under this many elements,
# and one fp32 absmax per block of this many elements for each 8-bit state.
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCK = 256


@dataclass(frozen=True)
class _Regime:
    resid: int  # bytes per element of the residual stream
    compute: int  # bytes per element of matmul inputs/outputs
    autocast: bool  # torch.autocast on (activations recast per use)


def regime(plan: Plan) -> _Regime:
    """Element sizes of the run. Mixed precision on plain torch keeps fp32 weights under
    autocast (full fine-tuning) or 16-bit base weights (LoRA/QLoRA); DeepSpeed and FSDP2
    compute on 16-bit parameters directly."""
    if plan.precision is Precision.FP32:
        return _Regime(4, 4, False)
    if plan.precision is Precision.BF16_TRUE:
        return _Regime(2, 2, False)
    if plan.engine == "torch":
        return _Regime(4 if plan.method is Method.FULL else 2, 2, True)
    return _Regime(2, 2, False)


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


def sdpa_kernel(model: ModelSpec, plan: Plan, masked: bool, cpu: bool, capability: tuple[int, int]) -> str:
    """The kernel sdpa runs: ``flash`` (or the CPU's flash), ``efficient`` or ``math``.

    The CPU runs its flash kernel (grouped KV heads and masks included) unless there is
    dropout, then math; CUDA GPUs choose by ``costs.cuda_sdpa_kernel``. transformers passes
    grouped KV heads as they are only without a mask (it repeats them otherwise).
    """
    if cpu:
        return "math" if model.family.dropout else "flash"
    gqa = model.kv_dim < model.q_dim and not masked
    return costs.cuda_sdpa_kernel(capability, costs.compute_dtype(plan), model.head_dim, masked, gqa)


@functools.lru_cache(maxsize=4096)
def block_activations(model: ModelSpec, plan: Plan, masked: bool, cpu: bool = False,
                      capability: tuple[int, int] = (8, 0)) -> _Block:
    """What one transformer block saves for backward, per token. See the module doc.

    ``cpu``: the CPU's kernels, which differ where it matters: dropout keeps its mask in
    the input dtype (CUDA: bool), sdpa with dropout runs the math kernel, which saves
    what eager saves, and autocast leaves layer_norm, pow and softmax in 16-bit (CUDA
    autocast runs them in fp32). ``capability``: the CUDA GPU's, which decides the sdpa
    kernel (``sdpa_kernel``).
    """
    f = model.family
    rg = regime(plan)
    r, c = rg.resid, rg.compute
    h, inter, a = model.hidden_size, model.intermediate_size, model.num_heads
    qd, kd = model.q_dim, model.kv_dim
    full = plan.method is Method.FULL
    lora = (
        {n for n, _, _, part in model.linears() if plan.lora_targets is LoraTargets.ALL_LINEAR or part == "attention"}
        if plan.is_peft
        else set()
    )
    rank = plan.lora_rank or 0
    saved: dict[str, float] = {}
    quad = 0.0

    # PEFT casts an adapter's input to the adapter dtype (fp32 under autocast), and
    # autocast casts it back for the matmul: every adapter then saves its own copy
    adapter_recast = rg.autocast and plan.is_peft

    def lin(name: str, src: str, src_bytes: int, width: int) -> None:
        """A Linear saves its input when its weight or a LoRA adapter needs it."""
        if not (full or name in lora):
            return
        if (rg.autocast and src_bytes != c) or (adapter_recast and name in lora):
            saved[name + ".cast"] = width * c  # autocast recasts the activation per use
        else:
            saved[src] = width * src_bytes
        if name in lora:
            saved[name + ".lora_mid"] = rank * c

    def rms(name: str, src_bytes: int) -> int:
        saved[name + ".x32"] = 4 * h  # fp32 upcast of the input (the input itself if fp32)
        saved[name + ".rstd"] = 4
        if full:  # the weight's grad needs the normalized input
            saved[name + ".z"] = (4 if f.model_type == "gemma2" else src_bytes) * h
        return src_bytes

    def layernorm(name: str, src_bytes: int) -> int:
        in_bytes = 4 if rg.autocast and not cpu else src_bytes  # CUDA autocast runs layer_norm in fp32
        saved[name + ".in"] = in_bytes * h
        saved[name + ".stats"] = 8
        return in_bytes

    mask_bytes = (4 if rg.autocast and plan.method is Method.FULL else c) if cpu else 1

    def dropout_mask(name: str) -> None:
        if f.dropout:
            saved[name + ".mask"] = h * mask_bytes

    # attention kernel: sdpa and flash2 save q, k, v, out and the logsumexp; eager saves
    # the softmax in fp32 and the probabilities in the compute dtype, s² per head.
    gqa_repeat = kd < qd and (plan.attention is Attention.EAGER or (masked and plan.attention is Attention.SDPA))
    k_bytes = (qd if gqa_repeat else kd) * c
    kernel = sdpa_kernel(model, plan, masked, cpu, capability) if plan.attention is Attention.SDPA else ""
    # CUDA autocast runs softmax without a dtype in fp32
    cuda_autocast = rg.autocast and not cpu

    if f.model_type in ("gpt2", "bert"):
        # sdpa with dropout runs the math kernel on the CPU: it saves what eager saves
        eager_like = plan.attention is Attention.EAGER or (cpu and plan.attention is Attention.SDPA)
        if f.model_type == "gpt2":
            ln1 = layernorm("ln1", r)
            lin("c_attn", "ln1.out", ln1, h)
        else:
            for n in ("query", "key", "value"):
                lin(n, "x", r, h)
        # the CPU's math kernel computes half precision in fp32
        md = 4 if (cpu and plan.attention is Attention.SDPA) else c
        if eager_like or f.model_type == "bert":
            # matmul on the strided per-head views saves contiguous copies of q, k, v
            saved["q"], saved["k"], saved["v"] = qd * md, kd * md, kd * md
        else:
            saved["qkv"] = (qd + 2 * kd) * c  # q, k, v are views of one output
        if eager_like:
            # softmax output (fp32 under CUDA autocast), dropout mask and dropped probs
            soft = 4 if cuda_autocast and plan.attention is Attention.EAGER else md
            quad += a * (soft + (md if cpu else 1) + md)
            saved["o_in"] = qd * c
            attn_out = "o_in"
        else:
            saved["out"], saved["lse"] = qd * c, 4 * a
            attn_out = "out"
            if masked and plan.attention is Attention.SDPA:  # the bool mask made additive, saved by the kernel
                quad += c
        o_name = "attn.c_proj" if f.model_type == "gpt2" else "attention.output.dense"
        lin(o_name, attn_out, c, qd)
        dropout_mask("attn.resid")
        before_mlp = sum(saved.values())
        if f.model_type == "gpt2":
            ln2 = layernorm("ln2", r)
            lin("c_fc", "ln2.out", ln2, h)
            if cuda_autocast:
                # CUDA autocast runs pow in fp32: pow saves its fp32 input, tanh and 1+tanh
                # are fp32, 0.5x stays 16-bit, and the fp32 product is recast for c_proj
                saved["gelu.x32"], saved["gelu.tanh"], saved["gelu.onep"] = (inter * 4,) * 3
                saved["gelu.half"] = inter * c
                lin("mlp.c_proj", "gelu.out", 4, inter)
            else:
                # NewGELU is written in Python ops: x, tanh(...), 0.5x and 1+tanh are saved
                saved["fc"], saved["gelu.tanh"], saved["gelu.half"], saved["gelu.onep"] = (inter * c,) * 4
                lin("mlp.c_proj", "gelu.out", c, inter)
                if "mlp.c_proj" in lora or full:
                    saved["gelu.out"] = inter * c
        else:
            x1 = layernorm("ln_attn", r)
            lin("intermediate.dense", "x1", x1, h)
            saved["fc"] = inter * c  # exact GELU saves its input
            lin("output.dense", "gelu.out", c, inter)
            layernorm("ln_out", r)
        dropout_mask("mlp.resid")
    else:
        ln1 = rms("ln1", r)
        for n, _, _, part in model.linears():
            if part == "attention" and n != "o_proj":
                lin(n, "n1", ln1, h)
        if f.fused_qkv:
            saved["qkv"] = (qd + 2 * kd) * c  # v is a view of the fused output
            saved["q_rot"], saved["k_rot"] = qd * c, kd * c
            if gqa_repeat:
                saved["k_rep"] = saved["v_rep"] = qd * c
        else:
            saved["q_rot"] = qd * c
            saved["k_rot"] = k_bytes
            saved["v"] = k_bytes
        if plan.attention is Attention.EAGER:
            # softmax(dtype=fp32) saves its output; .to(compute) makes the probs the
            # matmul with v saves (no copy when computing in fp32)
            quad += a * (4 + (c if c != 4 else 0)) + (a * c if f.logit_softcap else 0)
            saved["o_in"] = qd * c
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
            quad += a * 4
            saved["o_in"] = qd * c
            attn_out = "o_in"
        else:
            saved["out"], saved["lse"] = qd * c, 4 * a
            attn_out = "out"
            if masked and plan.attention is Attention.SDPA:  # the additive mask the kernel saves
                quad += c
        lin("o_proj", attn_out, c, qd)
        before_mlp = sum(saved.values())
        if f.model_type == "gemma2":
            rms("post_attn", c)
            rms("pre_ff", r)
            n2, n2_bytes = "pre_ff.out", r
        else:
            n2, n2_bytes = "n2", rms("ln2", r)
        for n, _, _, part in model.linears():
            if part == "mlp" and n != "down_proj":
                lin(n, n2, n2_bytes, h)
        saved["gate"], saved["act"], saved["up"] = inter * c, inter * c, inter * c
        lin("down_proj", "prod", c, inter)
        if f.model_type == "gemma2":
            rms("post_ff", c)
    bwd_tok = 2 * inter * c + 8 * h  # the MLP's gradients while it runs backward
    # while the MLP's down projection runs forward (measured on the CPU): the residual kept
    # for the block's last add, the norm's output and the product when nothing saves them,
    # the projection's output, and PEFT's fp32 copy of its input under autocast
    down, prod, norm_out = (("mlp.c_proj", "gelu.out", "ln2.out") if f.model_type == "gpt2"
                            else ("down_proj", "prod", "pre_ff.out" if f.model_type == "gemma2" else "n2"))
    mlp_fwd_tok = 0.0
    if f.model_type != "bert":
        mlp_fwd_tok = (h * r + (0.0 if norm_out in saved else h * c) + h * c
                       + (0.0 if prod in saved else inter * c)
                       + (inter * 4 if adapter_recast and down in lora else 0.0))
    eager = plan.attention is Attention.EAGER
    math = kernel == "math" and f.model_type not in ("gpt2", "bert")
    # softmax backward holds the fp32 gradient in and out (+ part of a 16-bit cast),
    # once the MLP's saved tensors of the block are already freed (measured on the CPU)
    attn_bwd_quad = a * (8 + (0.5 if c != 4 else 0)) if eager else (a * 8 if math else 0.0)
    fwd_quad = a * c if eager else (a * 4 if math else 0.0)  # the scores before softmax
    first_norm = sum(v for k, v in saved.items() if k.startswith("ln1."))
    total = sum(saved.values())
    probs_quad = a * c if eager and c != 4 and f.model_type not in ("gpt2", "bert") else 0.0
    attn_freed = saved.get("o_in", 0.0)
    return _Block(total, quad, bwd_tok, fwd_quad, first_norm, total - before_mlp, attn_freed, probs_quad,
                  attn_bwd_quad, mlp_fwd_tok)


@functools.lru_cache(maxsize=4096)
def _head_activations(model: ModelSpec, plan: Plan) -> float:
    """Bytes per token saved outside the blocks: embeddings, final norm, the head's input."""
    f, rg = model.family, regime(plan)
    r, c, h = rg.resid, rg.compute, model.hidden_size
    full = plan.method is Method.FULL
    n = 0.0
    if f.dropout:
        n += h  # embedding dropout mask
    if f.model_type == "bert":
        n += (4 if rg.autocast else r) * h + 8  # embedding LayerNorm input
        if full:  # MLM transform: dense input, GELU input, LayerNorm input
            n += r * h + c * h + (4 if rg.autocast else c) * h + 8
        head_in = c
    elif f.norm == "rmsnorm":
        n += 4 * h + 4 + (r * h if full else 0)
        head_in = r
    else:
        n += (4 if rg.autocast else r) * h + 8
        head_in = 4 if rg.autocast else r
    if full and not (rg.autocast and head_in != c):  # the head's weight grad needs its input
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
    c = regime(plan).compute
    v = model.vocab_size
    up = 4 if c != 4 else 0  # the fp32 upcast is a no-op in fp32
    cap = c if model.family.logit_softcap else 0  # gemma2's tanh soft-cap output
    rg = regime(plan)
    # full fine-tuning under autocast: the head casts its fp32 input to 16-bit and keeps it
    head_cast = c * model.hidden_size * tokens if (rg.autocast and rg.resid != c and plan.method is Method.FULL) else 0
    if plan.fused_loss:
        chunk = min(tokens, costs.next_pow2(tokens / -(-v // model.hidden_size)))
        # + one chunk's head-weight gradient before it is added into .grad
        grad_w = v * model.hidden_size * (4 if c == 4 or rg.autocast else c) if plan.method is Method.FULL else 0
        return (c + up + 4) * v * chunk + head_cast, (c + up + 12) * v * chunk + head_cast + grad_w
    if model.family.task == "masked-lm" and not rg.autocast:
        # BERT's MLM loss takes the logits as they are: log_softmax saves them in the compute
        # dtype, and its backward holds the nll and log_softmax gradients in it too
        return 2 * c * v * tokens, 3 * c * v * tokens
    return (c + up + 4 + cap) * v * tokens + head_cast, (12 + cap) * v * tokens + head_cast


# -- model states ------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def state_bytes(model: ModelSpec, plan: Plan) -> costs.StateBytes:
    """Model states of one rank before sharding, laid out the way the plan's engine does."""
    n = model.n_params
    n_lin = model.linear_params()
    mixed = plan.precision in (Precision.BF16_MIXED, Precision.FP16_MIXED)
    fp32 = plan.precision is Precision.FP32
    engine = plan.engine
    half_params = not fp32 and not (engine in ("torch", "fsdp") and mixed)  # deepspeed or bf16-true

    if plan.is_peft:
        n_t = model.lora_params(plan.lora_rank or 0, plan.lora_targets.value)
        base_b = 4 if fp32 else 2
        adapter_b = 4 if (fp32 or (mixed and engine != "deepspeed")) else 2
        if plan.method is Method.QLORA:
            weights = n_lin * NF4_BYTES_PER_PARAM + (n - n_lin) * base_b
        else:
            weights = n * base_b
        weights += n_t * adapter_b
        trainable_w, p_b = n_t * adapter_b, adapter_b
    else:
        n_t = n
        p_b = 2 if half_params else 4
        weights = n * p_b
        trainable_w = weights
    grad_b = p_b
    master = 4 * n_t if (engine == "deepspeed" and p_b == 2) else 0
    st_b = 4 if (engine == "deepspeed" or p_b == 4) else 2  # moment dtype
    states = _optimizer_state_bytes(model, plan, n_t, st_b)
    return costs.StateBytes(
        weights=weights,
        gradients=n_t * grad_b,
        master=master,
        states=states,
        trainable_weights=trainable_w,
        grad_elem_bytes=grad_b,
        param_elem_bytes=p_b,
    )


def _optimizer_state_bytes(model: ModelSpec, plan: Plan, n_trainable: int, moment_bytes: int) -> float:
    opt = plan.optimizer
    if opt is Optimizer.SGD:
        return 0.0  # plain SGD (momentum 0) keeps no state
    if opt is Optimizer.ADAMW:
        return 2 * moment_bytes * n_trainable
    if opt in (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT):
        # two 8-bit moments + an fp32 absmax each per 256-element block (bitsandbytes 0.45+);
        # small tensors stay 32-bit
        small = _small_trainable(model, plan)
        return (2 + 8 / BNB_BLOCK) * (n_trainable - small) + 8 * small
    # Adafactor: factored second moment, rows + cols per matrix, full for vectors
    if plan.is_peft:
        r = plan.lora_rank or 0
        return moment_bytes * sum(
            model.num_layers * 2 * (r + (i + o) / 2)  # A: r×in -> r+in, B: out×r -> out+r
            for _, i, o, part in model.linears()
            if plan.lora_targets is LoraTargets.ALL_LINEAR or part == "attention"
        )
    matrices = model.matrix_shapes()
    in_matrices = sum(cnt * rows * cols for cnt, rows, cols in matrices)
    factored = sum(cnt * (rows + cols) for cnt, rows, cols in matrices)
    return moment_bytes * (factored + (n_trainable - in_matrices))


def adafactor_step_bytes(model: ModelSpec, plan: Plan, elem_bytes: int) -> float:
    """What torch's Adafactor step allocates at its worst: each matrix's variance estimate
    (full size, in the gradient's dtype) is made while the previous one is still referenced,
    so two consecutive matrices (parameter order) are alive at once."""
    L = model.num_layers
    if plan.is_peft:
        r = plan.lora_rank or 0
        layer = [x for _, i, o, part in model.linears()
                 if plan.lora_targets is LoraTargets.ALL_LINEAR or part == "attention" for x in (r * i, o * r)]
        sizes = layer * min(L, 2)
    else:
        emb = [model.vocab_size * model.hidden_size]
        if model.family.positions == "learned":
            emb.append(model.max_position_embeddings * model.hidden_size)
        # 0: a norm's vector between two matrices (GPT-2/BERT's first LayerNorm, the final norm)
        sep = [0] if model.family.norm == "layernorm" else []
        sizes = emb + sep + [i * o for _, i, o, _ in model.linears()] * min(L, 2)
        if not model.tie_word_embeddings:
            sizes += [0, model.vocab_size * model.hidden_size]
    pairs = [a + b for a, b in zip(sizes, sizes[1:])] or sizes
    return float(max(pairs) * elem_bytes)


def _small_trainable(model: ModelSpec, plan: Plan) -> int:
    """Trainable elements in tensors smaller than bitsandbytes' 8-bit threshold."""
    if plan.is_peft:
        return 0
    return model.n_params - sum(cnt * r * c for cnt, r, c in model.matrix_shapes())


# -- the evaluator ------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimate:
    memory: MemoryAnatomy
    throughput: Throughput
    peak_phase: str


def _tokens(plan: Plan, workload: Workload) -> tuple[int, int, float, float]:
    """(memory tokens, attended length, expected computed tokens, keys per token) per micro-batch."""
    mb, s = plan.micro_batch, workload.seq_len
    if plan.packing:
        t_mem = workload.packed_tokens_peak(mb)
        t_time = mb * workload.mean_tokens
        d = workload.lengths
        e_l2 = (sum(n * n * k for n, k in d.histogram) / d.total) if d else s * s
        keys = e_l2 / (2 * workload.mean_tokens)
        return t_mem, s, t_time, keys
    row = workload.padded_len(mb)
    return mb * s, s, mb * row, row


def estimate(plan: Plan, ctx: Target) -> Estimate:
    """The analytic anatomy and throughput of a valid plan."""
    model, cluster, workload = ctx.model, ctx.cluster, ctx.workload
    rg = regime(plan)
    masked = workload.lengths is not None and not plan.packing
    t_mem, s, t_time, keys = _tokens(plan, workload)
    blk = block_activations(model, plan, masked, cluster.gpu.kind == "cpu", cluster.gpu.compute_capability)
    L = model.num_layers
    c = rg.compute

    # -- activations and their transients
    block_bytes = t_mem * (blk.tok + s * blk.quad)
    # RoPE's cos and sin, [1, positions, head_dim] each, shared by all blocks
    rope = 2 * (t_mem if plan.packing else s) * model.head_dim * rg.resid if model.family.positions == "rope" else 0
    head = t_mem * _head_activations(model, plan)
    if plan.checkpointing is Checkpointing.FULL:
        saved_blocks = L * t_mem * rg.resid * model.hidden_size  # each block's input
        recompute = block_bytes  # one block's activations while it runs backward
    else:
        saved_blocks = L * block_bytes
        if plan.is_peft:  # the frozen embedding's output needs no grad: block 0's first norm saves nothing
            saved_blocks -= t_mem * blk.first_norm
        recompute = 0.0
    activations = saved_blocks + head + rope
    logits_fwd, logits_bwd = logits_bytes(model, plan, t_mem)
    mask = (t_mem * s * (c if plan.attention is Attention.EAGER else 1)) if masked else 0.0
    bwd_temp = t_mem * blk.bwd_tok
    attn_bwd_temp = t_mem * s * blk.attn_bwd_quad
    fwd_temp = t_mem * s * blk.fwd_quad
    if plan.method is Method.QLORA:  # one Linear dequantized to the compute dtype at a time
        dequant = max(i * o for _, i, o, _ in model.linears()) * c
        bwd_temp += dequant  # MatMul4Bit's backward always dequantizes
        attn_bwd_temp += dequant
        # forward: bitsandbytes' fused kernel up to 1536 rows on CUDA; beyond, and always
        # on the CPU, dequantize + linear (runtime.bnb_decompositions)
        if cluster.gpu.kind == "cpu" or t_mem > 1536:
            fwd_temp += dequant

    # -- model states
    sb = state_bytes(model, plan)
    # one block's weights as ZeRO-3/FSDP gather them: in the compute dtype (NF4 stays packed)
    layer_weights = model.layer_params() * c
    if plan.method is Method.QLORA:
        layer_linear = model.linear_params() / L
        layer_weights += layer_linear * (NF4_BYTES_PER_PARAM - c)
    layer_trainable = (sb.trainable_weights / sb.param_elem_bytes) / L
    step_tmp = 0.0
    if plan.optimizer is Optimizer.ADAFACTOR:
        step_tmp = adafactor_step_bytes(model, plan, sb.param_elem_bytes)
    st = costs.shard_states(plan, model, cluster, sb, layer_weights, layer_trainable, step_tmp)
    # autocast caches a 16-bit copy of every fp32 weight a matmul uses, and the matmuls
    # save them for backward
    autocast_copies = 0.0
    if rg.autocast and plan.method is Method.FULL:
        head_copy = model.vocab_size * model.hidden_size
        if plan.checkpointing is Checkpointing.FULL:  # only the recomputed block's copies live on
            autocast_copies = 2 * (model.linear_params() / L + head_copy)
        else:
            autocast_copies = 2 * (model.linear_params() + head_copy)
    elif rg.autocast:  # the fp32 LoRA adapters
        autocast_copies = 2 * sb.trainable_weights / sb.param_elem_bytes
        if plan.checkpointing is Checkpointing.FULL:
            autocast_copies /= L
    # by the first block's backward the other blocks' copies are freed with their saved tensors
    first_block_copies = autocast_copies if plan.checkpointing is Checkpointing.FULL else autocast_copies / L
    # gradients alive while the last block runs backward: the accumulated ones, or (first
    # micro-batch) the output head's, sharded where the engine shards gradients
    head_grads = model.vocab_size * model.hidden_size * sb.grad_elem_bytes if plan.method is Method.FULL else 0
    early_grads = head_grads * st.gradients / max(sb.gradients, 1)
    block_tail_grads = 0.0
    if plan.method is Method.FULL:
        tail = sum(i * o for n, i, o, part in model.linears() if part == "mlp" or n in ("o_proj", "attn.c_proj"))
        block_tail_grads = tail * sb.grad_elem_bytes * st.gradients / max(sb.gradients, 1)

    tied_grad = early_grads if model.tie_word_embeddings else 0.0
    states = {"weights": st.weights + autocast_copies, "optimizer": st.optimizer}
    persistent_tmp = st.comm_buffers + st.gather_peak + mask
    moments = {
        "forward": {
            **states,
            "gradients": st.grad_accum_present,
            "activations": activations,
            "logits": logits_fwd,
            "temporary": persistent_tmp,
        },
        # the last block's forward (eager's scores, the MLP's transients): before the logits
        "block-forward": {
            **states,
            "gradients": st.grad_accum_present,
            "activations": activations - head,
            "logits": 0.0,
            "temporary": persistent_tmp + max(fwd_temp, t_mem * blk.mlp_fwd_tok),
        },
        "loss-backward": {
            **states,
            # a chunked loss computes the head's weight gradient inside the loss backward
            "gradients": max(st.grad_accum_present, early_grads if plan.fused_loss else 0.0),
            "activations": activations,
            "logits": logits_bwd,
            "temporary": persistent_tmp,
        },
        "block-backward": {
            **states,
            "gradients": max(st.grad_accum_present, early_grads),
            "activations": activations - head + recompute,
            "logits": 0.0,
            "temporary": persistent_tmp + bwd_temp,
        },
        # mid-softmax-backward of the last block: its MLP, o_proj input and 16-bit probs
        # are freed, the MLP's and o_proj's weight gradients exist
        "attention-backward": {
            **states,
            "gradients": max(st.grad_accum_present, early_grads + block_tail_grads),
            "activations": activations - head + recompute - t_mem * (blk.mlp_tok + blk.attn_freed)
            - t_mem * s * blk.probs_quad,
            "logits": 0.0,
            "temporary": persistent_tmp + attn_bwd_temp,
        },
        "first-block-backward": {
            **states,
            "weights": st.weights + first_block_copies,
            "gradients": max(st.grad_accum_present, st.gradients - layer_trainable * sb.grad_elem_bytes
                             * st.gradients / max(sb.gradients, 1)),
            "activations": (t_mem * rg.resid * model.hidden_size if plan.checkpointing is Checkpointing.FULL else 0)
            + block_bytes + rope,
            "logits": 0.0,
            "temporary": persistent_tmp + bwd_temp,
        },
        # the end of backward: every gradient; with tied embeddings the head's and the
        # embedding's gradients meet in the shared weight's .grad, added out of place, all
        # three alive at once
        # (the head's one was made in the loss's backward: a storage tracker calls it logits)
        "backward-end": {
            "weights": st.weights,
            "optimizer": st.optimizer,
            "gradients": st.gradients,
            "activations": 0.0,
            "logits": tied_grad,
            "temporary": persistent_tmp + tied_grad,
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
    if plan.checkpointing is Checkpointing.FULL:
        # a block being recomputed in backward, in the middle of its MLP: what it saves so
        # far plus the MLP's forward transients (counted as activations: they are recomputed)
        mlp_fwd = t_mem * blk.mlp_fwd_tok
        incoming = 2 * t_mem * model.hidden_size * c  # the gradient arriving at the block
        moments["block-recompute"] = {
            **moments["block-backward"],
            "activations": activations - head + recompute + mlp_fwd,
            "temporary": persistent_tmp + incoming,
        }
        moments["first-block-recompute"] = {
            **moments["first-block-backward"],
            "activations": moments["first-block-backward"]["activations"] + mlp_fwd,
            "temporary": persistent_tmp + incoming,
        }
    phase = max(moments, key=lambda k: sum(moments[k].values()))
    comp = {k: int(v) for k, v in moments[phase].items()}
    peak_allocated = sum(comp.values())
    peak_reserved = costs.reserved_bytes(peak_allocated, cluster.gpu.kind)
    total = costs.device_total(peak_reserved, cluster.world_size, cluster.gpu.kind)
    host = (st.host + costs.HOST_PROCESS_BYTES) * cluster.gpus_per_node
    memory = MemoryAnatomy(
        weights=comp["weights"],
        gradients=comp["gradients"],
        optimizer=comp["optimizer"],
        activations=comp["activations"],
        temporary=comp["temporary"],
        logits=comp["logits"],
        overhead=total - peak_allocated,
        peak_allocated=peak_allocated,
        peak_reserved=peak_reserved,
        device_total=total,
        host_bytes=int(host),
    )
    return Estimate(memory, _throughput(plan, ctx, sb, blk, t_time, keys, block_bytes), phase)


def _throughput(plan: Plan, ctx: Target, sb: costs.StateBytes, blk: _Block, tokens: float,
                keys: float, block_bytes: float) -> Throughput:
    model, cluster, workload = ctx.model, ctx.cluster, ctx.workload
    gpu = cluster.gpu
    L = model.num_layers
    head_params = model.vocab_size * model.hidden_size + (model.hidden_size**2 if model.family.task == "masked-lm" else 0)
    block_mm = model.linear_params()
    causal = model.family.task == "causal-lm"
    attended = keys / 2 if causal and plan.attention is not Attention.EAGER and not plan.packing else keys
    attn_fwd = 4 * tokens * attended * model.q_dim * L
    fwd = 2 * tokens * (block_mm + head_params) + attn_fwd
    trainable = plan.method is Method.FULL
    bwd_mm = 2 * tokens * (block_mm + head_params) * (2 if trainable else 1)
    bwd = bwd_mm + attn_fwd * (2.5 if plan.attention is not Attention.EAGER else 2.0)
    if plan.is_peft:
        n_t = sb.trainable_weights / sb.param_elem_bytes
        fwd += 2 * tokens * n_t
        bwd += 4 * tokens * n_t
    recompute = (2 * tokens * block_mm + attn_fwd) if plan.checkpointing is Checkpointing.FULL else 0.0
    flops = fwd + bwd + recompute

    peak = gpu.peak_flops(costs.compute_dtype(plan))
    eff = costs.matmul_efficiency(tokens)
    mem_bw = gpu.memory_bw_gbps * 1e9 * costs.MEMORY_EFFICIENCY
    # elementwise traffic: activations written in forward and read in backward, their
    # grads written and read; the logits path; eager's s² tensors are in block_bytes
    elementwise = 4 * block_bytes * L * (1.5 if plan.checkpointing is Checkpointing.FULL else 1.0)
    logits_traffic = 0 if plan.fused_loss else (regime(plan).compute + 16) * model.vocab_size * tokens
    dequant = 0.0
    uses = 3 if plan.checkpointing is Checkpointing.FULL else 2  # forward, backward (+ recompute)
    if plan.method is Method.QLORA:  # read 4-bit, write 16-bit, per use
        dequant = model.linear_params() * (NF4_BYTES_PER_PARAM + 2) * uses
    casts = 0.0
    if regime(plan).autocast and plan.method is Method.FULL:
        # autocast reads each fp32 weight and writes its 16-bit copy per forward (and
        # recompute); backward casts the 16-bit weight gradients back to fp32
        casts = (block_mm + head_params) * (4 + 2) * uses
    micro_s = flops / (peak * eff) + (elementwise + logits_traffic + dequant + casts) / mem_bw
    backward_s = (bwd + recompute) / (peak * eff)
    comm = costs.comm_time(plan, model, cluster, sb, backward_s)
    opt_s = costs.optimizer_step_bytes(plan, sb) / mem_bw
    if plan.zero_stage >= 1 or plan.engine == "fsdp":
        opt_s /= cluster.world_size  # every rank steps only its shard of the states
    ga = plan.grad_accum
    step = ga * (micro_s + comm.per_micro_batch) + opt_s + comm.per_step + comm.offload
    compute_s = ga * micro_s + opt_s
    model_flops = ga * (fwd + bwd)
    return Throughput(
        tokens_per_sec=workload.tokens_per_step() / step,
        step_time_s=step,
        compute_s=compute_s,
        comm_s=ga * comm.per_micro_batch + comm.per_step,
        offload_s=comm.offload,
        flops_per_step=ga * flops,
        mfu=model_flops / (step * peak),
    )


class AnalyticEvaluator(Evaluator):
    """Closed-form anatomy and roofline time. Assumes a valid plan (see plan_problems)."""

    name = "analytic"

    def evaluate(self, plan: Plan, ctx: Target, on_step: StepCallback | None = None) -> TrialResult:
        t0 = time.perf_counter()
        est = estimate(plan, ctx)
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
            extra={"peak_phase": est.peak_phase},
        )

"""Context parallelism: one rank's share of sequences split over ``cp`` ranks.

What runs is torch's context parallelism as accelerate 1.16 and the Trainer launch it
(``ParallelismConfig(cp_size=N)`` over FSDP2; ``Accelerator.maybe_context_parallel``;
``Trainer._prepare_context_parallel_inputs`` shards ``input_ids``, ``labels``,
``shift_labels`` and ``position_ids``). torch's load balancer
(``torch/distributed/tensor/experimental/_context_parallel``) cuts every sequence into
``2·cp`` chunks and gives rank ``r`` chunks ``r`` and ``2cp-1-r``, so every rank holds
``s/cp`` tokens of each row and its queries meet the same share of the causal keys.
Everything outside attention runs on those tokens as the model runs on rows of ``s/cp``
tokens: projections, MLP, norms, the logits and the loss. A rank is therefore evaluated as
the same model's step on rows of ``s/cp`` tokens (:func:`local_workload`: what the
simulator traces and the analytic formulas itemize), and three things are added:

- **attention FLOPs × cp**: each local query attends over the whole row's keys (causal: half
  of them), against ``s/cp`` of them in the local step;
- **the ring's buffers** beside one attention call (:func:`ring_transient`), read from
  ``_templated_ring_attention`` and ``_templated_ring_attention_backward`` (torch 2.13) with
  accelerate's default ``cp_comm_strategy="allgather"`` (``_AllGatherRotater``) and torch's
  defaults ``convert_to_f32=True``, ``enable_load_balance=True``:

  - forward: the keys and values concatenated (``torch.cat([key.flatten(),
    value.flatten()])``), their all-gather over the group (``cp`` times that), and the
    ``_SDPAMerger``'s fp32 merge of each chunk's output (the running output, the chunk's
    output and its fp32 copy, ``out - block_out`` and its product with the LSE weight);
  - backward: fp32 accumulators for the query, key and value gradients, the gathered keys
    and values again, the kernel's gradients of two chunks (the last chunk's are held until
    the next call returns), the fp32 key/value gradients sent to the next rank and received
    from the previous one (its ``_AllToAllRotater``), and ``_partial_update``'s copy of them;

  the larger of the two is added to the rank's temporaries at its peak: an upper bound, as
  they live only inside an attention call;
- **the exchanges on the link** (:func:`ring_collectives`): per layer and micro-batch one
  all-gather of keys and values in forward, in the recompute of a checkpointed block, and in
  backward, and ``cp`` sends of the fp32 key/value gradients in backward; counted exposed
  (the all-gather overlaps only the first, local chunk's kernel).

The key width is the model's key/value heads: with no attention mask (context parallelism
has none) transformers' ``sdpa_attention_forward`` passes grouped keys unrepeated
(``use_gqa_in_sdpa``).

Why not traced: the ring exchanges keys and values with the group's other ranks, and the
simulator traces one rank with no process group (torch 2.13 also registers its handlers for
the CUDA SDPA kernels only; the measured child runs it on CPU ranks through
``evaluators/ring.py``). The simulator traces the local step and adds these terms from the
same functions as the analytic evaluator; the answer says so (:func:`note`).
"""

from __future__ import annotations

import dataclasses

from autofit.evaluators import costs, timing
from autofit.plan import Plan
from autofit.specs import ModelSpec, Workload


def local_workload(plan: Plan, workload: Workload) -> Workload:
    """The rows one rank runs: ``s/cp`` tokens each (plan_problems: full-length rows only)."""
    if plan.context_parallel == 1:
        return workload
    return dataclasses.replace(workload, seq_len=workload.seq_len // plan.context_parallel)


def _widths(model: ModelSpec, plan: Plan, tokens: float) -> tuple[float, float, float, int]:
    """(query elements, key elements, logsumexp rows, element bytes) of one attention call on
    ``tokens`` local tokens."""
    cb = 4 if costs.compute_dtype(plan) == "fp32" else 2
    return tokens * model.q_dim, tokens * model.kv_dim, tokens * model.num_heads, cb


def ring_transient(model: ModelSpec, plan: Plan, tokens: float) -> float:
    """The ring's own bytes beside one attention call of a micro-batch with ``tokens`` local tokens."""
    if plan.context_parallel == 1:
        return 0.0
    return max(ring_bytes(*_widths(model, plan, tokens), plan.context_parallel))


def ring_bytes(q: float, k: float, rows: float, cb: int, cp: int) -> tuple[float, float]:
    """(forward, backward) bytes the ring holds beyond one local kernel call, for ``q`` query and
    ``k`` key elements and ``rows`` logsumexp rows per rank, in ``cb``-byte elements.

    Each buffer is counted alive until the loop's next step has made its successor: how long a
    buffer lives depends on when the collective that reads it completes, so the excess varies
    from run to run by whole buffers, and more on a loaded machine. An upper bound, checked
    against torch's own functions run on 2 and 4 CPU ranks (tests/evaluators/test_context.py):
    0-33% over the worst rank's excess in three runs (bf16, fp32), equal to the worst seen under
    load (4 ranks, bf16, another test suite running beside it)."""
    lse = 2 * rows * 4  # two chunks' fp32 logsumexp
    # forward: the concatenated and the gathered keys and values; the merge's fp32 output, the
    # chunk's fp32 copy, its difference and the weighted difference (four fp32 query-sized buffers
    # in fp32 too, where the copy is none: seen on 4 ranks); two chunks' kernel outputs
    forward = 2 * k * cb * (cp + 1) + q * (16 + 2 * cb) + lse
    # backward: fp32 dq, dk, dv; the gathered and concatenated keys and values; two chunks' kernel
    # gradients and a partial step's half-query one; the fp32 dk, dv of two steps sent and received
    # (a send's buffer lives until it completes) and _partial_update's copy of them (a torch.cat)
    backward = 4 * q + 8 * k + 2 * k * cb * (cp + 1) + 2 * (q + 2 * k) * cb + q * cb / 2 + 32 * k + lse
    return forward, backward


def ring_collectives(model: ModelSpec, plan: Plan, tokens: float, recomputed: float) -> tuple[timing.Collective, ...]:
    """The ring's exchanges per micro-batch of ``tokens`` local tokens; ``recomputed``: the share of
    blocks a checkpointed backward runs forward again."""
    cp = plan.context_parallel
    if cp == 1:
        return ()
    _, k, _, cb = _widths(model, plan, tokens)
    L = model.num_layers
    gathered = cp * 2 * k * cb
    return (
        timing.Collective("all-gather", gathered, L * (2 + recomputed), "micro", (), group=cp),
        timing.Collective("send", 2 * k * 4, L * cp, "micro", (), group=cp),
    )


def with_ring(transfers: timing.Transfers, model: ModelSpec, plan: Plan, tokens: float, recomputed: float):
    """``transfers`` with the ring's exchanges added."""
    ring = ring_collectives(model, plan, tokens, recomputed)
    return dataclasses.replace(transfers, collectives=transfers.collectives + ring) if ring else transfers


def note(plan: Plan, workload: Workload) -> dict[str, str]:
    """What the answer states about a context-parallel plan (``TrialResult.extra``)."""
    cp = plan.context_parallel
    if cp == 1:
        return {}
    return {
        "context_parallel": (
            f"each rank runs {workload.seq_len // cp} of every row's {workload.seq_len} tokens (torch's ring "
            f"attention over {cp} ranks, round-robin load balance); the ring's buffers and exchanges are "
            "counted from torch 2.13's code, not traced"
        )
    }

"""Real results to store: the analytic evaluator on registry models (microseconds each)."""

from __future__ import annotations

from autofit.evaluators.analytic import AnalyticEvaluator
from autofit.plan import Plan
from autofit.results import Status, TrialResult
from autofit.specs import LengthDistribution, Target, Workload, parse_cluster, resolve_model

ALLOWED = {"methods": ["lora", "full", "qlora"], "optimizers": ["adamw"], "precisions": ["bf16-mixed"]}


def gpt2_ctx(seq_len: int = 1024, global_batch: int = 32) -> Target:
    return Target(resolve_model("gpt2"), parse_cluster("1xA10"), Workload(seq_len=seq_len, global_batch=global_batch))


def llama_ctx() -> Target:
    """A 2-GPU target with a length distribution, so every JSON field has content."""
    lengths = LengthDistribution(((200, 30), (900, 50), (2048, 20)), "lengths.json")
    return Target(
        resolve_model("llama-3.2-1b"), parse_cluster("2xA10"), Workload(seq_len=2048, global_batch=16, lengths=lengths)
    )


def gpt2_results(ctx: Target) -> list[TrialResult]:
    """[fast fit, slow fit, OOM (faster than both), screened without an anatomy]."""
    ev = AnalyticEvaluator()
    gb = ctx.workload.global_batch
    fast = ev.evaluate(Plan(micro_batch=4, grad_accum=gb // 4), ctx)
    slow = ev.evaluate(Plan(micro_batch=1, grad_accum=gb, checkpointing="full"), ctx)
    oom = ev.evaluate(Plan(micro_batch=gb, grad_accum=1), ctx)
    screened = TrialResult(
        plan=Plan(method="lora", lora_rank=16, micro_batch=2, grad_accum=gb // 2),
        status=Status.SCREENED,
        evaluator="analytic",
        reason="predicted not to fit before launch",
        duration_s=0.25,
        extra={"note": "no anatomy", "scores": [1.5, 2]},
    )
    assert (fast.status, slow.status, oom.status) == (Status.FITS, Status.FITS, Status.OOM)
    assert oom.tokens_per_sec > fast.tokens_per_sec > slow.tokens_per_sec
    return [fast, slow, oom, screened]


def llama_results(ctx: Target) -> list[TrialResult]:
    ev = AnalyticEvaluator()
    plans = [
        Plan(method="lora", lora_rank=16, micro_batch=1, grad_accum=8, checkpointing="full"),
        Plan(micro_batch=1, grad_accum=8, checkpointing="full", sharding="zero3"),
    ]
    return [ev.evaluate(p, ctx) for p in plans]

"""Tables and JSON for people and scripts. Formatting only: no computation happens here."""

from __future__ import annotations

import json
from typing import Any, Iterable

from rich.console import Console
from rich.table import Table

from autofit.evaluators.base import COMPONENTS, EvalContext, TrialResult
from autofit.specs import GPUSpec, ModelSpec

GiB = 2**30


def gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f}"


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def dumps(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=False, default=str)


def anatomy_table(result: TrialResult, title: str | None = None) -> Table:
    m = result.memory
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("component")
    table.add_column("GiB", justify="right")
    table.add_column("share of total", justify="right")
    for comp in COMPONENTS:
        value = getattr(m, comp)
        share = value / m.device_total if m.device_total else 0.0
        table.add_row(comp, gib(value), f"{share:5.1%}")
    table.add_section()
    table.add_row("peak_allocated", gib(m.peak_allocated), "")
    table.add_row("peak_reserved", gib(m.peak_reserved), "")
    table.add_row("[bold]device_total[/bold]", f"[bold]{gib(m.device_total)}[/bold]", "")
    return table


def print_estimate(console: Console, result: TrialResult, ctx: EvalContext) -> None:
    console.print(
        f"[bold]{ctx.model.name}[/bold] ({human_count(ctx.model.n_params)} params) on "
        f"[bold]{ctx.cluster.label}[/bold] · seq {ctx.workload.seq_len} · global batch {ctx.workload.global_batch}"
    )
    console.print(f"plan: {result.plan.summary()}   [dim](plan {result.plan.plan_id}, {result.evaluator})[/dim]")
    console.print(anatomy_table(result))
    m = result.memory
    budget = ctx.budget_bytes
    margin = budget - m.device_total
    if result.fits:
        console.print(
            f"[green]fits[/green]: {gib(m.device_total)} of {gib(ctx.capacity_bytes)} GiB per GPU "
            f"({gib(margin)} GiB to spare under the {ctx.headroom:.0%} headroom)"
        )
    else:
        console.print(f"[red]does not fit[/red]: {result.reason}")
    console.print(f"bottleneck: {m.bottleneck}")
    if m.host_bytes:
        console.print(f"host memory per node: {gib(m.host_bytes)} GiB of {gib(ctx.cluster.host_memory_bytes)} GiB")
    if result.throughput:
        t = result.throughput
        console.print(
            f"throughput: {t.tokens_per_sec:,.0f} tokens/s · {t.step_time_s:.3f} s/step · MFU {t.mfu:.0%} "
            f"(compute {t.compute_s:.3f} s, comm {t.comm_s:.3f} s, offload {t.offload_s:.3f} s)"
        )


def gpus_table(gpus: Iterable[GPUSpec]) -> Table:
    table = Table(show_header=True, header_style="bold")
    for col in ("GPU", "memory GiB", "bf16 TFLOP/s", "fp16", "tf32", "fp32", "HBM GB/s", "link", "link GB/s", "cc"):
        table.add_column(col, justify="left" if col in ("GPU", "link") else "right")
    for g in gpus:
        table.add_row(
            g.name, f"{g.memory_gib:.1f}", f"{g.bf16_tflops:g}" if g.bf16_tflops else "-", f"{g.fp16_tflops:g}",
            f"{g.tf32_tflops:g}" if g.tf32_tflops else "-", f"{g.fp32_tflops:g}", f"{g.memory_bw_gbps:g}",
            g.intra_node_link, f"{g.intra_node_gbps:g}", f"{g.compute_capability[0]}.{g.compute_capability[1]}",
        )
    return table


def gpu_dict(g: GPUSpec) -> dict[str, Any]:
    return {
        "name": g.name, "memory_bytes": g.memory_bytes, "bf16_tflops": g.bf16_tflops,
        "fp16_tflops": g.fp16_tflops, "tf32_tflops": g.tf32_tflops, "fp32_tflops": g.fp32_tflops,
        "memory_bw_gbps": g.memory_bw_gbps, "intra_node_link": g.intra_node_link,
        "intra_node_gbps": g.intra_node_gbps, "host_link_gbps": g.host_link_gbps,
        "compute_capability": list(g.compute_capability), "supports_bf16": g.supports_bf16,
        "supports_flash2": g.supports_flash2, "source": g.source,
    }


def models_table(models: Iterable[ModelSpec]) -> Table:
    table = Table(show_header=True, header_style="bold")
    for col in ("model", "type", "params", "hidden", "layers", "heads", "kv", "head_dim", "inter", "vocab", "tied", "max pos"):
        table.add_column(col, justify="left" if col in ("model", "type") else "right")
    for m in models:
        table.add_row(
            m.name, m.model_type, human_count(m.n_params), str(m.hidden_size), str(m.num_layers),
            str(m.num_heads), str(m.num_kv_heads), str(m.head_dim), str(m.intermediate_size),
            str(m.vocab_size), "yes" if m.tie_word_embeddings else "no", str(m.max_position_embeddings),
        )
    return table


# -- search ---------------------------------------------------------------------------------
def result_line(r: TrialResult) -> str:
    mem = f"{gib(r.memory.device_total)} GiB" if r.memory else "-"
    tps = f"{r.tokens_per_sec:,.0f} tok/s" if r.throughput and r.tokens_per_sec else ""
    why = f" — {r.reason}" if r.reason and not r.fits else ""
    return f"{r.status.value:7s} {mem:>11s} {tps:>14s}  {r.plan.summary()}{why}"


class SearchProgress:
    """Plain progress lines on stderr (one per finished trial, plus the best so far)."""

    def __init__(self, console: Console, request) -> None:
        self.console = console
        self.request = request
        self.best: TrialResult | None = None

    def __call__(self, event: str, data: dict[str, Any]) -> None:
        c = self.console
        if event == "screening":
            space = data["space"]
            c.print(f"screening the space of {self.request.ctx.model.name} on {self.request.ctx.cluster.label} "
                    f"with the analytic model …")
        elif event == "screened":
            c.print(f"  {data['n']} plans, {data['fits']} predicted to fit; evaluating with "
                    f"[bold]{self.request.backend}[/bold], budget {self.request.trials} trials")
        elif event == "trial-done":
            r: TrialResult = data["result"]
            if r.fits and (self.best is None or r.tokens_per_sec > self.best.tokens_per_sec):
                self.best = r
            c.print(f"  #{data['number']:<3d} {result_line(r)}", highlight=False)


def outcome_dict(outcome, exported: list) -> dict[str, Any]:
    return {
        "study": outcome.study.name,
        "from_store": outcome.from_store,
        "interrupted": outcome.interrupted,
        "elapsed_s": outcome.elapsed_s,
        "counts": outcome.counts(),
        "best": outcome.best.as_dict() if outcome.best else None,
        "best_per_method": {k: v.as_dict() for k, v in outcome.best_per_method.items()},
        "closest": outcome.closest.as_dict() if outcome.closest else None,
        "advice": list(outcome.advice),
        "exported": [str(p) for p in exported],
    }


def print_outcome(console: Console, outcome, request, exported: list, db_url: str) -> None:
    ctx = request.ctx
    counts = ", ".join(f"{n} {s}" for s, n in sorted(outcome.counts().items()))
    source = "answered from the store" if outcome.from_store else f"{outcome.elapsed_s:.1f} s"
    console.print(f"\nstudy [bold]{outcome.study.name}[/bold] ({source}; {counts}) · {request.backend} · db {db_url}")
    if outcome.interrupted:
        console.print("[yellow]interrupted[/yellow]: finished trials are stored; continue with --resume")
    if outcome.best is None:
        console.print(f"[red]no plan fits[/red] {ctx.model.name} on {ctx.cluster.label} at seq {ctx.workload.seq_len}.")
        for line in outcome.advice:
            console.print(f"  · {line}")
        return
    best = outcome.best
    console.print(f"\n[bold green]winner[/bold green]: {best.plan.summary()}")
    console.print(anatomy_table(best))
    t = best.throughput
    console.print(f"{t.tokens_per_sec:,.0f} tokens/s · {t.step_time_s:.2f} s/step · "
                  f"{gib(best.memory.device_total)} of {gib(ctx.capacity_bytes)} GiB · {best.memory.bottleneck}")
    table = Table(title="best plan per method", show_header=True, header_style="bold")
    for col in ("method", "plan", "GiB", "tokens/s", "vs winner"):
        table.add_column(col, justify="right" if col in ("GiB", "tokens/s", "vs winner") else "left")
    for method, r in outcome.best_per_method.items():
        table.add_row(method, r.plan.summary(), gib(r.memory.device_total), f"{r.tokens_per_sec:,.0f}",
                      f"{r.tokens_per_sec / best.tokens_per_sec:.0%}")
    for method in ("full", "lora", "qlora"):
        if method not in outcome.best_per_method and method in [m.value for m in request.allowed.methods]:
            table.add_row(method, "[dim]nothing of this method fits[/dim]", "", "", "")
    console.print(table)
    if exported:
        console.print(f"configs for the winner: {', '.join(str(p) for p in exported)}")


# -- history -------------------------------------------------------------------------------
def history_table(summaries) -> Table:
    table = Table(show_header=True, header_style="bold")
    for col in ("id", "study", "model", "gpus", "seq", "batch", "backend", "status", "trials", "best plan", "tokens/s"):
        table.add_column(col, justify="right" if col in ("id", "seq", "batch", "trials", "tokens/s") else "left")
    for s in summaries:
        st = s.study
        table.add_row(
            str(st.id), st.name, st.model_name, st.cluster_label, str(st.seq_len), str(st.global_batch), st.backend,
            str(st.status), str(s.n_trials), s.best_plan.summary() if s.best_plan else "[dim]none fits[/dim]",
            f"{s.best_tokens_per_sec:,.0f}" if s.best_tokens_per_sec else "",
        )
    return table


def study_header(st) -> str:
    return (f"study [bold]{st.name}[/bold] (id {st.id}) · {st.model_name} on {st.cluster_label} · "
            f"seq {st.seq_len} · global batch {st.global_batch} · {st.backend} · {st.status} · "
            f"created {st.created_at:%Y-%m-%d %H:%M}")


def trials_table(trials) -> Table:
    table = Table(show_header=True, header_style="bold")
    for col in ("#", "status", "evaluator", "plan", "peak_alloc GiB", "device GiB", "tokens/s", "bottleneck", "reason"):
        table.add_column(col, justify="right" if "GiB" in col or col in ("#", "tokens/s") else "left")
    for t in trials:
        r = t.result()
        m = r.memory
        table.add_row(
            str(t.number), r.status.value, r.evaluator, r.plan.summary(),
            gib(m.peak_allocated) if m else "", gib(m.device_total) if m else "",
            f"{r.tokens_per_sec:,.0f}" if r.tokens_per_sec else "", m.bottleneck if m else "",
            (r.reason[:60] + "…") if len(r.reason) > 60 else r.reason,
        )
    return table

"""``autofit estimate``: the memory anatomy and throughput of one plan."""

from __future__ import annotations

import click
from rich.console import Console

from autofit import report
from autofit.cli.options import handle_errors, json_option, plan_options, target_options
from autofit.evaluators import evaluate
from autofit.request import build_context, build_plan


@click.command()
@target_options
@plan_options
@click.option("--backend", type=click.Choice(["auto", "analytic", "simulated", "measured"]), default="auto", show_default=True)
@json_option
@handle_errors
def estimate(model, gpus, nodes, host_mem, seq_len, global_batch, lengths_path, headroom, backend, as_json, **plan_opts):
    """Estimate the per-GPU memory anatomy and tokens/s of one training plan."""
    ctx = build_context(model, gpus, nodes=nodes, host_mem=host_mem, seq_len=seq_len, global_batch=global_batch,
                        lengths_path=lengths_path, headroom=headroom, plan_opts=plan_opts)
    plan = build_plan(ctx, **plan_opts)
    result = evaluate(plan, ctx, backend)
    console = Console(stderr=as_json)
    for warning in ctx_warnings(ctx):
        console.print(f"[yellow]warning[/yellow]: {warning}")
    if as_json:
        click.echo(report.dumps(result.as_dict()))
    else:
        report.print_estimate(console, result, ctx)


def ctx_warnings(ctx):
    from autofit.plan import workload_warnings

    return workload_warnings(ctx.model, ctx.workload)

"""``autofit estimate``: the memory anatomy and throughput of one plan."""

from __future__ import annotations

import sys

import click

from autofit.cli.options import (
    db_option,
    evaluator_option,
    evaluator_options,
    handle_errors,
    json_option,
    measured_options,
    plan_options,
    target_options,
)
from autofit.evaluators import evaluate
from autofit.report import console
from autofit.search.request import build_context, build_plan


@click.command()
@target_options
@plan_options
@evaluator_option
@measured_options
@click.option(
    "--calibration/--no-calibration",
    "calibrate",
    default=True,
    show_default=True,
    help="Correct the estimate by what was measured on this GPU type (from the database).",
)
@db_option
@json_option
@handle_errors
def estimate(
    model,
    gpus,
    nodes,
    inter_node_gbps,
    host_mem,
    seq_len,
    global_batch,
    lengths_path,
    headroom,
    evaluator,
    as_json,
    cpu_mem_budget,
    steps,
    warmup_steps,
    trial_timeout,
    work_dir,
    calibrate,
    db_url,
    **plan_opts,
):
    """Estimate the per-GPU memory anatomy and tokens/s of one training plan."""
    ctx = build_context(
        model,
        gpus,
        nodes=nodes,
        host_mem=host_mem,
        inter_node_gbps=inter_node_gbps,
        seq_len=seq_len,
        global_batch=global_batch,
        lengths_path=lengths_path,
        headroom=headroom,
        plan_opts=plan_opts,
        cpu_mem_budget=cpu_mem_budget,
    )
    plan = build_plan(ctx, **plan_opts)
    measured = evaluator_options(
        dict(steps=steps, warmup_steps=warmup_steps, trial_timeout=trial_timeout, work_dir=work_dir)
    )
    result = evaluate(plan, ctx, evaluator, **measured)
    if calibrate and result.evaluator != "measured":
        from autofit.search.calibration import for_context

        cal = for_context(ctx, result.evaluator, db_url)
        if cal is not None:
            result = cal.apply(result, ctx)
    term = console.terminal(stderr=as_json)
    for warning in ctx_warnings(ctx):
        term.print(f"[yellow]warning[/yellow]: {warning}")
    if as_json:
        click.echo(console.dumps({**result.as_dict(), **console.cluster_dict(ctx.cluster, ctx.model)}))
    elif result.memory is None:  # a measured run that failed, timed out or could not run here
        term.print(f"[red]{result.status.value}[/red]: {result.reason}")
    else:
        console.print_estimate(term, result, ctx)
    if result.memory is None:
        sys.exit(1)


def ctx_warnings(ctx):
    from autofit.plan import workload_warnings

    return workload_warnings(ctx.model, ctx.workload)

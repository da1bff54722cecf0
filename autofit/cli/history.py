"""``autofit history``, ``show``, ``best``, ``export``: past studies, read from the store."""

from __future__ import annotations

import sys

import click

from autofit.cli.options import db_option, handle_errors, json_option
from autofit.report import console


@click.command()
@click.option("--model", "-m", default=None, help="Only studies of this model (name or fingerprint).")
@click.option("--gpus", "-g", default=None, help="Only studies on this GPU type (e.g. A10).")
@db_option
@json_option
@handle_errors
def history(model, gpus, db_url, as_json):
    """List past studies with their best plan and throughput."""
    from autofit.specs import resolve_gpu
    from autofit.store import Store

    gpu = resolve_gpu(gpus.split("x")[-1]).name if gpus else None
    rows = Store(db_url).list_studies(model=model, gpu=gpu)
    if as_json:
        click.echo(console.dumps([s.as_dict() for s in rows]))
        return
    console.terminal().print(console.history_table(rows))


@click.command()
@click.argument("study")
@db_option
@json_option
@handle_errors
def show(study, db_url, as_json):
    """Every trial of STUDY (name or id): status, memory, tokens/s, bottleneck; then the answer."""
    from autofit.report.analysis import standing as standing_of
    from autofit.store import Store

    store = Store(db_url)
    rec = store.get_study(study)
    trials = store.trials(rec.id)
    ctx = rec.context()
    standing = standing_of([t.result() for t in trials], ctx)
    if as_json:
        data = {"study": rec.as_dict(), "trials": [t.as_dict() for t in trials], "standing": standing.as_dict()}
        click.echo(console.dumps({**data, **console.cluster_dict(ctx.cluster, ctx.model)}))
        return
    term = console.terminal()
    term.print(console.study_header(rec))
    console.print_assumptions(term, ctx.cluster, ctx.model)
    term.print(console.trials_table(trials, standing.best))
    console.print_answer(term, standing, rec.allowed.get("methods") or [])
    term.print(f"\nreport with plots: autofit report {rec.name}", highlight=False, soft_wrap=True)


@click.command()
@click.option("--model", "-m", required=True, help="Model name, config path or hub id.")
@click.option("--gpus", "-g", required=True, help="GPUs per node as COUNTxGPU.")
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--seq-len", type=click.IntRange(min=1), default=None, help="Only plans for this sequence length.")
@click.option("--global-batch", type=click.IntRange(min=1), default=None, help="Only plans for this global batch.")
@db_option
@json_option
@handle_errors
def best(model, gpus, nodes, seq_len, global_batch, db_url, as_json):
    """The answer among stored plans that fit this request, across studies (the simplest within the
    time error of the fastest), without running anything."""
    from autofit.search.request import build_cluster
    from autofit.specs import resolve_model
    from autofit.store import Store

    spec = resolve_model(model)
    cluster = build_cluster(gpus, nodes)
    store = Store(db_url)
    rec = store.best_trial(spec.fingerprint, cluster.label, seq_len=seq_len, global_batch=global_batch)
    if rec is None:
        click.echo(
            f"no stored plan fits {spec.name} on {cluster.label}"
            + (f" at seq {seq_len}" if seq_len else "")
            + "; run `autofit search` first",
            err=True,
        )
        sys.exit(1)
    result = store.trial_result(rec)
    judged = store.get_study(rec.study_id).context()  # what the stored answer assumed
    judged_on = judged.cluster
    if as_json:
        data = {**result.as_dict(), "study_id": rec.study_id, "trial": rec.number}
        click.echo(console.dumps({**data, **console.cluster_dict(judged_on, judged.model)}))
        return
    term = console.terminal()
    term.print(
        f"[bold]{result.plan.summary()}[/bold]  {result.tokens_per_sec:,.0f} tokens/s "
        f"({result.evaluator}, study {rec.study_id}, trial {rec.number})"
    )
    term.print(console.anatomy_table(result))
    console.print_assumptions(term, judged_on, judged.model)


@click.command(name="export")
@click.argument("study")
@click.option("--trial", "trial_number", type=int, default=None, help="Trial number (default: the study's winner).")
@click.option(
    "--out",
    default=None,
    metavar="DIR",
    help="Directory for ds_config.json, accelerate_config.yaml, trainer_args.json [default: autofit-out/STUDY].",
)
@db_option
@json_option
@handle_errors
def export_cmd(study, trial_number, out, db_url, as_json):
    """Write the config files of a stored plan (the winner, or --trial N)."""
    from autofit.export import export_plan
    from autofit.results import winner
    from autofit.store import Store

    store = Store(db_url)
    rec = store.get_study(study)
    trials = store.trials(rec.id)
    if trial_number is None:  # the answer `autofit show` gives: one rule (autofit.results.ranked)
        results = [t.result() for t in trials]
        best = winner(results)
        if best is None:
            raise click.ClickException(f"study {rec.name} has no plan that fits; pick one with --trial N")
        chosen = next(t for t, r in zip(trials, results) if r is best)
    else:
        matches = [t for t in trials if t.number == trial_number]
        if not matches:
            raise click.ClickException(f"study {rec.name} has no trial {trial_number}; see `autofit show {rec.name}`")
        chosen = matches[-1]
    ctx = rec.context()
    from autofit.store.store import study_dir

    result = store.trial_result(chosen)
    # what the plan was judged by goes into plan.json, for train.py to compare with what it gets
    paths = export_plan(result.plan, ctx, out or study_dir(rec), expected=result)
    if as_json:
        click.echo(console.dumps({"study": rec.name, "trial": chosen.number, "files": [str(p) for p in paths]}))
    else:
        click.echo("\n".join(str(p) for p in paths))

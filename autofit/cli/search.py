"""``autofit search``: the main job."""

from __future__ import annotations

import contextlib
import os
import shlex
import sys

import click
from click.core import ParameterSource
from rich.console import Console

from autofit.cli.options import (
    ParallelType,
    db_option,
    evaluator_option,
    evaluator_options,
    handle_errors,
    json_option,
    measured_options,
    parse_duration,
    target_options,
)
from autofit.errors import AutofitError, SpecError
from autofit.report import analysis, console


@click.command()
@target_options(required=False)
@click.option(
    "--methods",
    default=None,
    help="Methods the search may use (quality-affecting): full,lora,lora-8bit,qlora [default: full,lora,qlora].",
)
@click.option(
    "--optimizers",
    default=None,
    help="Optimizers it may use (quality-affecting): adamw,adamw-8bit,paged-adamw-8bit,adafactor,sgd, or the "
    "Trainer's names (adamw_torch, adamw_bnb_8bit, ...) [default: adamw].",
)
@click.option(
    "--precisions",
    default=None,
    help="Precisions it may use (quality-affecting): bf16-mixed,fp16-mixed,bf16-true,32-true, or accelerate's "
    "bf16,fp16,no [default: the GPU's mixed precision].",
)
@click.option("--lora-ranks", default=None, help="LoRA ranks it may use [default: 16].")
@click.option(
    "--lora-dropout",
    type=click.FloatRange(0.0, 1.0, max_open=True),
    default=None,
    help="Dropout on LoRA adapters' inputs, your training choice (peft's default: 0.0).",
)
@evaluator_option
@click.option("--trials", type=click.IntRange(min=1), default=None, help="Trial budget [default: by evaluator].")
@click.option("--timeout", default=None, help="Time budget, e.g. 90s, 10m, 1h.")
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=0, show_default=True)
@click.option("--name", default=None, help="Name of the study (default: generated).")
@click.option("--resume", is_flag=True, help="Continue the interrupted study of this request (or --name).")
@click.option("--fresh", is_flag=True, help="Search again even if an identical finished study is stored.")
@click.option(
    "--out",
    default=None,
    metavar="DIR",
    help="Directory for the winner's config files (and --report) [default: autofit-out/STUDY; '' for none].",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="A study file (YAML); options on the command line override it.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="0: only create the study for `autofit worker`s on other nodes (then --wait follows it).",
)
@click.option("--wait", is_flag=True, help="With --workers 0: follow the study until the workers finish it.")
@click.option(
    "--parallel",
    type=ParallelType(),
    default="auto",
    show_default=True,
    help="Run K local workers at once, each on its own GPU subset (CUDA_VISIBLE_DEVICES). "
    "auto: one per 8 simulated trials, within the cores and memory (analytic and measured: 1).",
)
@click.option(
    "--report/--no-report",
    "write_report",
    default=True,
    show_default=True,
    help="Write report.html and its plots into --out at the end (not with --json).",
)
@click.option(
    "--calibration/--no-calibration",
    "calibrate",
    default=True,
    show_default=True,
    help="Correct predictions by what was measured on this GPU type before.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress output.")
@measured_options
@db_option
@json_option
@click.pass_context
@handle_errors
def search(cctx: click.Context, **opts):
    """Search for the fastest training plan that fits, store every trial, export the winner."""
    from autofit.evaluators import resolve_evaluator
    from autofit.search.loop import DEFAULT_TRIALS, SearchRequest, run_search
    from autofit.search.request import build_context
    from autofit.search.space import Allowed
    from autofit.store import Store

    opts = _merge_study_file(cctx, opts)
    if not opts.get("model") or not opts.get("gpus"):
        raise SpecError("--model and --gpus are required (or a --config study file that sets them)")
    ctx = build_context(
        opts["model"],
        opts["gpus"],
        nodes=opts["nodes"],
        host_mem=opts["host_mem"],
        inter_node_gbps=opts["inter_node_gbps"],
        seq_len=opts["seq_len"],
        global_batch=opts["global_batch"],
        lengths_path=opts["lengths_path"],
        headroom=opts["headroom"],
        cpu_mem_budget=opts["cpu_mem_budget"],
    )
    allowed = Allowed.parse(
        opts["methods"], opts["optimizers"], opts["precisions"], opts["lora_ranks"], opts["lora_dropout"]
    )
    evaluator = resolve_evaluator(opts["evaluator"], ctx)
    request = SearchRequest(
        ctx=ctx,
        allowed=allowed,
        evaluator=evaluator,
        trials=opts["trials"] or DEFAULT_TRIALS[evaluator],
        timeout_s=parse_duration(opts["timeout"]),
        seed=opts["seed"],
        evaluator_options=evaluator_options(opts) if evaluator == "measured" else {},
        calibrate=opts["calibrate"],
    )
    if opts["parallel"] == "auto":
        from autofit.search.workers import auto_parallel

        opts["parallel"] = auto_parallel(request)
    store = Store(opts["db_url"])
    as_json, quiet = opts["as_json"], opts["quiet"] or opts["as_json"]
    term = console.terminal(stderr=True, quiet=quiet)
    progress = console.SearchProgress(term, request) if not quiet else None
    with progress if progress is not None else contextlib.nullcontext():  # closes the live display on Ctrl-C
        if opts["parallel"] > 1 or opts["workers"] == 0:
            outcome = _distributed(request, store, opts, progress)
        else:
            outcome = run_search(
                request, store, fresh=opts["fresh"], resume=opts["resume"], study_name=opts["name"], progress=progress
            )
    if opts["name"] and outcome.from_store and outcome.study.name != opts["name"]:
        click.echo(
            f"note: study {outcome.study.name} already answers this identical request, so no study named "
            f"{opts['name']!r} was created; add --fresh to search again under that name",
            err=True,
        )
    standing = analysis.standing(outcome.results, ctx)
    if opts["out"] is None:  # one rule for every command that writes a study's files
        from autofit.store.store import study_dir

        opts = {**opts, "out": str(study_dir(outcome.study))}
    exported = []
    if standing.best is not None and opts["out"]:
        from autofit.export import export_plan

        exported = export_plan(standing.best.plan, ctx, opts["out"], expected=standing.best)
    if as_json:
        click.echo(console.dumps(console.outcome_dict(outcome, exported, standing)))
    else:
        out = console.terminal()
        console.print_outcome(out, outcome, standing, request, exported, store.masked_url)
        _report(out, store, outcome.study.name, opts)
    if outcome.interrupted:
        sys.exit(130)
    if standing.best is None:
        sys.exit(3)


def _distributed(request, store, opts, progress):
    """--workers 0 (workers elsewhere evaluate; --wait follows) or --parallel K (K local workers)."""
    from autofit.search.loop import follow, interrupted_marks, prepare_search, stored_outcome
    from autofit.search.workers import spawn_local_workers

    rec, finished = prepare_search(
        request, store, fresh=opts["fresh"], resume=opts["resume"], study_name=opts["name"], progress=progress
    )
    if finished:
        return stored_outcome(request, store, rec)
    if opts["parallel"] > 1:
        # a Ctrl-C stops the local workers first, then marks the study (workers elsewhere: not with --wait)
        with (
            interrupted_marks(store, rec),
            spawn_local_workers(rec.name, store.url, opts["parallel"], request) as alive,
        ):
            return follow(store, rec.name, progress=progress, alive=alive)
    if not opts["wait"]:
        name = shlex.quote(rec.name)  # pasted into a shell: a name is never code
        click.echo(
            f"study {rec.name} created; on each node start:\n"
            f"  autofit worker {name} --db {shlex.quote(store.masked_url)}\n"
            f"then follow it with: autofit search ... --workers 0 --wait (or autofit show {name})",
            err=True,
        )
        if opts["as_json"]:
            click.echo(console.dumps({"study": rec.name, "status": "running"}))
        sys.exit(0)
    return follow(store, rec.name, progress=progress)


def _report(term: Console, store, study: str, opts: dict) -> None:
    """Write the study's report into --out, or say which command writes it."""
    db = f" --db {shlex.quote(store.masked_url)}" if opts.get("db_url") else ""  # never the password
    command = f"autofit report {shlex.quote(study)} --out {shlex.quote(opts['out'] or 'DIR')}{db}"
    if opts["write_report"] and opts["out"]:
        from autofit.report.html import write_report

        try:
            files = write_report(store, study, opts["out"])
        except AutofitError as exc:
            term.print(f"[yellow]the report was not written[/yellow]: {exc}; retry with: {command}", highlight=False)
            return
        for note in files.notes:
            term.print(f"[yellow]note[/yellow]: {note}", highlight=False)
        term.print(
            f"report: [bold]{files.html}[/bold]  (plots beside it; rebuild with `{command}`)",
            highlight=False,
            soft_wrap=True,
        )
    else:
        term.print(f"report: {command}", highlight=False, soft_wrap=True)


def _merge_study_file(cctx: click.Context, opts: dict) -> dict:
    """Study-file values, overridden by options the user typed (not by defaults)."""
    path = opts.pop("config_path")
    if not path:
        return opts
    from autofit.search.studies import load_study_file

    params = {p.name: p for p in cctx.command.params}
    for key, value in load_study_file(path).items():
        name = _STUDY_KEY_OPTIONS.get(key, key)
        if cctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
            continue
        param = params[name]
        if key == "lengths" and value:  # a path in the file is relative to the file
            value = os.path.join(os.path.dirname(os.path.abspath(path)), value)
        elif not isinstance(param.type, (click.types.StringParamType, click.Path)):
            try:  # the option's own type: the same ranges and choices as on the command line
                value = param.type.convert(value, param, cctx)
            except click.BadParameter as exc:
                raise SpecError(f"study file {path!r}: {key!r}: {exc.message}") from None
        opts[name] = value
    return opts


# a study file's keys are the options' names, but for these
_STUDY_KEY_OPTIONS = {"lengths": "lengths_path", "db": "db_url", "backend": "evaluator"}

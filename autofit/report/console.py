"""Tables and JSON for people and scripts. Formatting only: no computation happens here."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from autofit.results import COMPONENTS, TrialResult, fit_margin_of, ranked
from autofit.specs import GPUSpec, ModelSpec, Target
from autofit.specs.units import GiB

PIPE_WIDTH = 160  # columns for tables written to a pipe or file (rich's default is 80)


def terminal(stderr: bool = False, quiet: bool = False) -> Console:
    """A console for our output: the terminal's width on a terminal, else wide enough for the tables."""
    import sys

    stream = sys.stderr if stderr else sys.stdout
    tty = hasattr(stream, "isatty") and stream.isatty()
    return Console(stderr=stderr, quiet=quiet, width=None if tty else PIPE_WIDTH)


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


def print_estimate(console: Console, result: TrialResult, ctx: Target) -> None:
    console.print(
        f"[bold]{ctx.model.name}[/bold] ({human_count(ctx.model.n_params)} params) on "
        f"[bold]{ctx.cluster.label}[/bold] · seq {ctx.workload.seq_len} · global batch {ctx.workload.global_batch}"
    )
    console.print(f"plan: {result.plan.summary()}   [dim](plan {result.plan.plan_id}, {result.evaluator})[/dim]")
    console.print(anatomy_table(result))
    m = result.memory
    budget = ctx.budget_bytes
    spare = budget - m.device_total
    if result.fits:
        console.print(
            f"[green]fits[/green]: {gib(m.device_total)} of {gib(ctx.capacity_bytes)} GiB per GPU "
            f"({gib(spare)} GiB to spare under the {ctx.headroom:.0%} headroom){margin_text(result)}"
        )
    else:
        console.print(f"[red]does not fit[/red]: {result.reason}")
    console.print(f"bottleneck: {m.bottleneck}")
    for label, key in (("note", "note"), ("assumed", "context_parallel")):
        if result.extra and result.extra.get(key):
            console.print(f"[yellow]{label}[/yellow]: {result.extra[key]}", highlight=False)
    cal = result.extra.get("calibration") if result.extra else None
    if cal:
        raw = result.extra["raw"]
        raw_tps = (raw.get("throughput") or {}).get("tokens_per_sec", 0.0)
        console.print(
            f"calibrated by {cal['n_pairs']} measured plans on {cal['gpu']}: raw {result.evaluator} figures were "
            f"{gib(raw['memory']['device_total'])} GiB and {raw_tps:,.0f} tokens/s "
            f"(factors: " + ", ".join(f"{k} ×{v:.3f}" for k, v in sorted(cal["factors"].items())) + ")"
        )
    if m.host_bytes:
        console.print(f"host memory per node: {gib(m.host_bytes)} GiB of {gib(ctx.cluster.host_memory_bytes)} GiB")
    print_assumptions(console, ctx.cluster, ctx.model)
    if result.throughput:
        t = result.throughput
        console.print(
            f"throughput: {t.tokens_per_sec:,.0f} tokens/s · {t.step_time_s:.3f} s/step · MFU {t.mfu:.0%} "
            f"(compute {t.compute_s:.3f} s, comm {t.comm_s:.3f} s, offload {t.offload_s:.3f} s)"
        )


def assumptions(cluster, model=None) -> list[str]:
    """What an answer's figures assume rather than know: the cluster's (host memory, a custom
    GPU's rates) and the model's (an MoE router's spread, a block read from transformers)."""
    own = [model.routing_assumption, model.mixer_assumption, model.derivation] if model is not None else []
    return [*cluster.assumptions(), *(line for line in own if line)]


def print_assumptions(console: Console, cluster, model=None) -> None:
    """What the answer assumes (:func:`assumptions`): every answer says it."""
    for line in assumptions(cluster, model):
        console.print(f"[yellow]assumed[/yellow]: {line}", highlight=False)


def cluster_dict(cluster, model=None) -> dict[str, Any]:
    """The cluster of an answer, for ``--json``: its stored form and what the answer assumes."""
    return {"cluster": cluster.as_dict(), "assumptions": assumptions(cluster, model)}


def gpus_table(gpus: Iterable[GPUSpec]) -> Table:
    table = Table(show_header=True, header_style="bold")
    for col in ("GPU", "memory GiB", "bf16 TFLOP/s", "fp16", "tf32", "fp32", "HBM GB/s", "link", "link GB/s", "cc"):
        table.add_column(col, justify="left" if col in ("GPU", "link") else "right")
    for g in gpus:
        table.add_row(
            g.name + (" [dim](ROCm: analytic only)[/dim]" if g.analytic_only else ""),
            f"{g.memory_gib:.1f}",
            f"{g.bf16_tflops:g}" if g.bf16_tflops else "-",
            f"{g.fp16_tflops:g}",
            f"{g.tf32_tflops:g}" if g.tf32_tflops else "-",
            f"{g.fp32_tflops:g}",
            f"{g.memory_bw_gbps:g}",
            g.intra_node_link,
            f"{g.intra_node_gbps:g}",
            f"{g.compute_capability[0]}.{g.compute_capability[1]}",
        )
    return table


def gpu_dict(g: GPUSpec) -> dict[str, Any]:
    return {
        "name": g.name,
        "memory_bytes": g.memory_bytes,
        "bf16_tflops": g.bf16_tflops,
        "fp16_tflops": g.fp16_tflops,
        "tf32_tflops": g.tf32_tflops,
        "fp32_tflops": g.fp32_tflops,
        "memory_bw_gbps": g.memory_bw_gbps,
        "intra_node_link": g.intra_node_link,
        "intra_node_gbps": g.intra_node_gbps,
        "host_link_gbps": g.host_link_gbps,
        "compute_capability": list(g.compute_capability),
        "supports_bf16": g.supports_bf16,
        "supports_flash2": g.supports_flash2,
        "kind": g.kind,
        "analytic_only": g.analytic_only,
        "source": g.source,
        **({"assumption": g.assumption} if g.assumption else {}),
    }


def models_table(models: Iterable[ModelSpec]) -> Table:
    table = Table(show_header=True, header_style="bold")
    for col in (
        "model",
        "type",
        "params",
        "hidden",
        "layers",
        "heads",
        "kv",
        "head_dim",
        "inter",
        "vocab",
        "tied",
        "max pos",
        "experts",
    ):
        table.add_column(col, justify="left" if col in ("model", "type") else "right")
    for m in models:
        table.add_row(
            m.name,
            m.model_type,
            human_count(m.n_params),
            str(m.hidden_size),
            str(m.num_layers),
            str(m.num_heads),
            str(m.num_kv_heads),
            str(m.head_dim),
            str(m.intermediate_size),
            str(m.vocab_size),
            "yes" if m.tie_word_embeddings else "no",
            str(m.max_position_embeddings),
            _experts_cell(m),
        )
    return table


def _experts_cell(m) -> str:
    """An MoE model's routed experts (count × width, top-k) and shared expert's width; "" for a dense one."""
    if not m.family.moe:
        return ""
    cell = f"{m.num_experts}×{m.expert_width} top-{m.experts_per_token}"
    return cell + (f" +shared {m.shared_expert_width}" if m.shared_expert_width else "")


# -- search ---------------------------------------------------------------------------------
STATUS_STYLE = {
    "fits": "green",
    "oom": "red",
    "screened": "yellow",
    "pruned": "yellow",
    "failed": "magenta",
    "timeout": "magenta",
}


def status_text(status: str) -> Text:
    return Text(status, style=STATUS_STYLE.get(status, ""))


def memory_of_capacity(r: TrialResult) -> str:
    """``1.85/22.50 GiB``: the plan's device_total against the GPU's capacity."""
    if r.memory is None:
        return "-"
    if not r.capacity_bytes:
        return f"{gib(r.memory.device_total)} GiB"
    return f"{gib(r.memory.device_total)}/{gib(r.capacity_bytes)} GiB"


def tokens(r: TrialResult) -> str:
    return f"{r.tokens_per_sec:,.0f} tok/s" if r.throughput and r.tokens_per_sec else "-"


def why(r: TrialResult) -> str:
    """Why a plan does not count: the evaluator's one-line reason (empty for a plan that fits)."""
    return "" if r.fits else (r.reason or r.status.value)


def trial_line(number: int, r: TrialResult) -> Text:
    """One finished trial: number, status, memory against capacity, tokens/s, plan, and why it lost."""
    line = Text(f"#{number:<4d}")
    line.append_text(status_text(f"{r.status.value:7s}"))
    line.append(f" {memory_of_capacity(r):>17s} {tokens(r):>16s}  {r.plan.summary()}")
    if why(r):
        line.append(f"  — {why(r)}", style="dim")
    return line


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class SearchProgress:
    """The progress of ``run_search`` on a console (stderr).

    On a terminal: a live display (rich ``Live``) at the bottom — trial count against the
    budget, elapsed time, the plan being evaluated, the best so far and the tally — with one
    permanent line per finished trial printed above it. Elsewhere (a pipe, a log file, CI):
    plain lines only, never cursor movement. Use it as a context manager around the search
    so the live display is closed, and the cursor restored, however the search ends (Ctrl-C
    included).
    """

    def __init__(self, console: Console, request, *, live: bool | None = None) -> None:
        self.console = console
        self.request = request
        self.live = console.is_terminal and not console.is_dumb_terminal if live is None else live
        self._t0 = time.monotonic()
        self._live: Live | None = None
        self.study = ""
        self.budget = request.trials
        self.done = 0  # plans evaluated so far (previous runs of a resumed study included; not duplicates)
        self.current: tuple[int, Any] | None = None  # (number, plan) being evaluated
        self.phase = "starting"
        self.best: TrialResult | None = None  # the answer so far (``autofit.results.ranked``)
        self.best_number: int | None = None
        self.tally: dict[str, int] = {}
        self._results: list[TrialResult] = []  # every result seen, in order (the answer's input)
        self._numbers: dict[str, int] = {}  # plan id -> its latest trial number

    # -- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> SearchProgress:
        self._t0 = time.monotonic()
        if self.live:  # stray prints to stdout/stderr land above the panel, not through it
            self._live = Live(console=self.console, get_renderable=self.panel, refresh_per_second=4, transient=True)
            self._live.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._live is not None:
            live, self._live = self._live, None
            live.stop()  # also shows the cursor again

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    # -- what the live display shows --------------------------------------------------------------
    def panel(self) -> Table:
        grid = Table.grid(padding=(0, 1))
        grid.add_column(no_wrap=True)
        grid.add_column(no_wrap=True, overflow="ellipsis")
        shown = min(self.done + (self.phase == "trial"), self.budget)  # the one being evaluated counts
        count = Text(f"trial {shown}/{self.budget}", style="bold")
        count.append(f" · {_clock(self.elapsed)} elapsed · {self.request.evaluator}", style="")
        grid.add_row(ProgressBar(total=max(self.budget, 1), completed=shown, width=30), count)
        if self.current is not None and self.phase == "trial":
            number, plan = self.current
            grid.add_row(Text("evaluating", style="cyan"), Text(f"#{number} {plan.summary()}"))
        else:
            grid.add_row(Text(self.phase, style="cyan"), Text(""))
        grid.add_row(Text("best so far", style="bold green"), self._best_text())
        grid.add_row(Text("tally"), Text(self._tally_text() or "-"))
        return grid

    def _best_text(self) -> Text:
        if self.best is None:
            return Text("nothing fits yet", style="dim")
        b = self.best
        where = f"#{self.best_number} " if self.best_number is not None else ""
        return Text(f"{where}{b.tokens_per_sec:,.0f} tokens/s · {memory_of_capacity(b)} · {b.plan.summary()}")

    def _tally_text(self) -> str:
        return " · ".join(f"{n} {s}" for s, n in sorted(self.tally.items()))

    def _print(self, renderable: Any) -> None:
        # one permanent line; on a pipe never wrapped, so each trial stays one line in a log
        self.console.print(
            renderable,
            highlight=False,
            soft_wrap=not self.live,
            no_wrap=self.live,
            overflow="ellipsis" if self.live else None,
        )

    def _remeasure(self, data: dict[str, Any]) -> None:
        self.phase = "trial"
        self.current = (data["number"], data["plan"])
        self._print(
            Text(
                f"measuring again (within the noise of the best; {data['tokens_per_sec']:,.0f} tokens/s the "
                f"first time): {data['plan'].summary()}",
                style="dim",
            )
        )

    # -- the search's events ------------------------------------------------------------------------
    def __call__(self, event: str, data: dict[str, Any]) -> None:
        ctx = self.request.ctx
        if event == "start":
            self.study, self.budget, self.done = data["study"], data["budget"], data["done"]
            if data.get("best") is not None:
                self.best = data["best"]
                self._results.append(data["best"])
            resumed = f", resuming after {data['done']} trials" if data["done"] else ""
            self._print(
                Text(
                    f"study {self.study}: {ctx.model.name} on {ctx.cluster.label}, seq "
                    f"{ctx.workload.seq_len}, global batch {ctx.workload.global_batch} · "
                    f"{self.request.evaluator}, budget {self.budget} trials{resumed}"
                )
            )
        elif event == "warm-start":
            dropped = f" ({data['dropped']} more predicted not to fit this workload)" if data.get("dropped") else ""
            self._print(
                Text(
                    f"warm start: the best {data['n']} stored plan(s) of this model on "
                    f"{ctx.cluster.gpu.name} go first{dropped}"
                )
            )
        elif event == "screening":
            self.phase = "screening"
            self._print(Text("screening the whole space with the analytic model …"))
        elif event == "screened":
            self.phase = "searching"
            self._print(
                Text(
                    f"  {data['n']:,} plans, {data['fits']:,} predicted to fit; evaluating the most "
                    f"promising with {self.request.evaluator}"
                )
            )
        elif event == "trial-start":
            self.phase = "trial"
            self.current = (data["number"], data["plan"])
        elif event == "requeued":
            numbers = ", ".join(f"#{n}" for n in data["numbers"])
            self._print(
                Text(
                    f"cut short without a result (Ctrl-C, a dead worker, a lost connection): {numbers}; queued again",
                    style="yellow",
                )
            )
        elif event == "remeasure":
            self._remeasure(data)
        elif event == "exhausted":
            self._print(
                Text(f"every plan of the space is evaluated ({data['n']}); stopping before the budget", style="yellow")
            )
        elif event in ("trial-done", "trial-duplicate"):
            self.phase = "searching"
            r: TrialResult = data["result"]
            number = data["number"]
            if event == "trial-duplicate":
                self._print(Text(f"#{number:<4d}(proposed again: {r.plan.summary()}; already evaluated)", style="dim"))
                return
            self.done += 1
            self.tally[r.status.value] = self.tally.get(r.status.value, 0) + 1
            line = Text(
                "" if self.live else f"[{min(self.done, self.budget):>3d}/{self.budget} {_clock(self.elapsed):>5s}] "
            )
            line.append_text(trial_line(number, r))
            self._print(line)
            self._results.append(r)
            self._numbers[r.plan.plan_id] = number
            answer = ranked(self._results)
            best = answer[0] if answer else None
            if best is not None and best is not self.best:
                self.best, self.best_number = best, self._numbers.get(best.plan.plan_id)
                if not self.live:
                    self._print(
                        Text(
                            f"      best so far: {best.tokens_per_sec:,.0f} tokens/s · "
                            f"{memory_of_capacity(best)} · {best.plan.summary()}",
                            style="green",
                        )
                    )


def outcome_dict(outcome, exported: list, standing=None) -> dict[str, Any]:
    data = {
        "study": outcome.study.name,
        "from_store": outcome.from_store,
        "interrupted": outcome.interrupted,
        "ending": outcome.ending,
        "elapsed_s": outcome.elapsed_s,
        "counts": outcome.counts(),
        "best": outcome.best.as_dict() if outcome.best else None,
        "tiebreak": outcome.tiebreak.as_dict() if outcome.tiebreak else None,
        "best_per_method": {k: v.as_dict() for k, v in outcome.best_per_method.items()},
        "closest": outcome.closest.as_dict() if outcome.closest else None,
        "advice": list(outcome.advice),
        "exported": [str(p) for p in exported],
    }
    if standing is not None:
        data.update(cluster_dict(standing.ctx.cluster, standing.ctx.model))
        data["runners_up"] = [r.as_dict() for r in standing.runners_up()]
        data["losses"] = [loss.as_dict() for loss in standing.losses]
    return data


def winner_line(best: TrialResult, ctx: Target) -> str:
    t, m = best.throughput, best.memory
    return (
        f"{t.tokens_per_sec:,.0f} tokens/s · {t.step_time_s:.2f} s/step · MFU {t.mfu:.0%} · "
        f"{gib(m.device_total)} of {gib(ctx.capacity_bytes)} GiB per GPU (budget {gib(ctx.budget_bytes)})"
        f"{margin_text(best)} · {m.bottleneck}"
    )


def tiebreak_lines(tb) -> list[str]:
    """Why the winner (a ``autofit.results.Tiebreak``) is the plan it is: the simplest within
    the time error of the fastest, and what the fastest would add for its gain."""
    pct = f"{tb.error * 100:.3g}%"
    evaluators = sorted({tb.answer.evaluator, tb.fastest.evaluator})
    source = f"the {'/'.join(evaluators)} time error"
    if not tb.simpler:
        others = len(tb.ties) - 1
        if not others:
            return [f"the fastest plan; no other plan is within ±{pct} of it ({source})"]
        return [f"the fastest plan, and the simplest of the {len(tb.ties)} within ±{pct} of it ({source})"]
    how = "measured" if tb.fastest.evaluator == "measured" else "predicted"
    return [
        f"the simplest plan within {pct} of the fastest ({source}; {len(tb.ties)} plans are within it)",
        f"the fastest, {tb.fastest.plan.summary()}, is {how} {tb.gain:.1%} faster "
        f"({tb.fastest.tokens_per_sec:,.0f} tokens/s) with {'; '.join(tb.changes)}: within the error",
    ]


def margin_text(result: TrialResult) -> str:
    """What the estimator's 95% margin on published GPU runs says of a fitting plan ("" without one)."""
    fm = fit_margin_of(result)
    if not fm or not result.fits:
        return ""
    verdict = "still fits" if fm["fits_with_margin"] else "would not fit with it"
    return f"; 95% margin {gib(fm['bytes'])} GiB: {verdict}"


def methods_table(standing, allowed_methods: Iterable[str]) -> Table:
    best = standing.best
    table = Table(title="best plan per method", show_header=True, header_style="bold", title_justify="left")
    for col in ("method", "plan", "device GiB", "tokens/s", "vs winner", "bottleneck"):
        table.add_column(col, justify="right" if col in ("device GiB", "tokens/s", "vs winner") else "left")
    for method, r in standing.best_per_method.items():
        table.add_row(
            method,
            r.plan.summary(),
            gib(r.memory.device_total),
            f"{r.tokens_per_sec:,.0f}",
            f"{standing.speed_vs_best(r):.0%}" if best else "",
            r.memory.bottleneck,
        )
    for method in allowed_methods:
        if method not in standing.best_per_method:
            table.add_row(method, "[dim]nothing of this method fits[/dim]", "", "", "", "")
    return table


def runners_up_table(standing, k: int = 3) -> Table:
    table = Table(title="runners-up", show_header=True, header_style="bold", title_justify="left")
    for col in ("rank", "plan", "device GiB", "tokens/s", "vs winner", "bottleneck"):
        table.add_column(col, justify="right" if col in ("rank", "device GiB", "tokens/s", "vs winner") else "left")
    for i, r in enumerate(standing.runners_up(k), start=2):
        table.add_row(
            f"#{i}",
            r.plan.summary(),
            gib(r.memory.device_total),
            f"{r.tokens_per_sec:,.0f}",
            f"{standing.speed_vs_best(r):.1%}",
            r.memory.bottleneck,
        )
    return table


def loss_text(loss, standing) -> tuple[str, str]:
    """(most common reason, the plan closest to winning) of one Loss, for tables."""
    reason = f"{loss.reason} ({loss.reason_count} of {loss.count})"
    if loss.nearest is None:
        return reason, ""
    r = loss.nearest
    if loss.status == "fits":
        ratio = standing.speed_vs_best(r)
        return reason, f"{r.plan.summary()} at {ratio:.1%} of the winner's tokens/s" if ratio else r.plan.summary()
    return reason, f"{r.plan.summary()}, {gib(loss.over_bytes)} GiB over the budget"


def losses_table(standing) -> Table:
    table = Table(title="why the others lost", show_header=True, header_style="bold", title_justify="left")
    for col in ("status", "plans", "most common reason", "closest to winning"):
        table.add_column(col, justify="right" if col == "plans" else "left")
    for loss in standing.losses:
        reason, nearest = loss_text(loss, standing)
        table.add_row(status_text(loss.status), str(loss.count), reason, nearest)
    return table


def print_answer(console: Console, standing, allowed_methods: Iterable[str], advice: Iterable[str] = ()) -> None:
    """The winner, the best of each method, the runners-up and why the others lost."""
    ctx = standing.ctx
    best = standing.best
    if best is None:
        console.print(f"[red]no plan fits[/red] {ctx.model.name} on {ctx.cluster.label} at seq {ctx.workload.seq_len}.")
        for line in advice:
            console.print(f"  · {line}")
        if standing.losses:
            console.print(losses_table(standing))
        return
    console.print(
        f"\n[bold green]winner[/bold green]: [bold]{best.plan.summary()}[/bold]   "
        f"[dim](plan {best.plan.plan_id}, {best.evaluator})[/dim]"
    )
    console.print(f"  {winner_line(best, ctx)}", highlight=False)
    if best.extra and best.extra.get("context_parallel"):
        console.print(f"  [yellow]assumed[/yellow]: {best.extra['context_parallel']}", highlight=False)
    if standing.tiebreak is not None:
        for line in tiebreak_lines(standing.tiebreak):
            console.print(f"  [dim]{line}[/dim]", highlight=False)
    console.print(anatomy_table(best, title="memory anatomy of the winner, per GPU"))
    console.print(methods_table(standing, allowed_methods))
    if standing.runners_up():
        console.print(runners_up_table(standing))
    if standing.losses:
        console.print(losses_table(standing))


def print_outcome(console: Console, outcome, standing, request, exported: list, db_url: str) -> None:
    counts = ", ".join(f"{n} {s}" for s, n in sorted(outcome.counts().items()))
    source = "answered from the store" if outcome.from_store else f"{outcome.elapsed_s:.1f} s"
    console.print(f"\nstudy [bold]{outcome.study.name}[/bold] ({source}; {counts}) · {request.evaluator} · db {db_url}")
    if outcome.interrupted:
        console.print("[yellow]interrupted[/yellow]: finished trials are stored; continue with --resume")
    elif outcome.exhausted:
        console.print(
            f"[yellow]the space is exhausted[/yellow]: all {len({r.plan.plan_id for r in outcome.results})} "
            f"plans of the space were evaluated, fewer than the budget of {request.trials}"
        )
    print_assumptions(console, request.ctx.cluster, request.ctx.model)
    print_answer(console, standing, [m.value for m in request.allowed.methods], outcome.advice)
    if exported:
        console.print(f"configs for the winner: {', '.join(str(p) for p in exported)}")


# -- history -------------------------------------------------------------------------------
def history_table(summaries) -> Table:
    table = Table(show_header=True, header_style="bold")
    for col in (
        "id",
        "study",
        "model",
        "gpus",
        "seq",
        "batch",
        "evaluator",
        "status",
        "trials",
        "best plan",
        "tokens/s",
    ):
        table.add_column(col, justify="right" if col in ("id", "seq", "batch", "trials", "tokens/s") else "left")
    for s in summaries:
        st = s.study
        table.add_row(
            str(st.id),
            st.name,
            st.model_name,
            st.cluster_label,
            str(st.seq_len),
            str(st.global_batch),
            st.evaluator,
            str(st.status),
            str(s.n_trials),
            s.best_plan.summary() if s.best_plan else "[dim]none fits[/dim]",
            f"{s.best_tokens_per_sec:,.0f}" if s.best_tokens_per_sec else "",
        )
    return table


def study_header(st) -> str:
    return (
        f"study [bold]{st.name}[/bold] (id {st.id}) · {st.model_name} on {st.cluster_label} · "
        f"seq {st.seq_len} · global batch {st.global_batch} · {st.evaluator} · {st.status} · "
        f"created {st.created_at:%Y-%m-%d %H:%M}"
    )


def trials_table(trials, best: TrialResult | None = None) -> Table:
    """Every evaluation of a study; the winner's row is marked ★."""
    table = Table(show_header=True, header_style="bold")
    for col in (
        "#",
        "status",
        "evaluator",
        "plan",
        "device GiB",
        "of capacity",
        "peak_alloc GiB",
        "tokens/s",
        "s/step",
        "bottleneck",
        "why it lost",
    ):
        table.add_column(
            col,
            justify="right"
            if col in ("#", "device GiB", "of capacity", "peak_alloc GiB", "tokens/s", "s/step")
            else "left",
        )
    for t in trials:
        r = t.result()
        m = r.memory
        winner = best is not None and r.plan.plan_id == best.plan.plan_id and r.evaluator == best.evaluator
        reason = why(r)
        table.add_row(
            f"★{t.number}" if winner else str(t.number),
            status_text(r.status.value),
            r.evaluator,
            r.plan.summary(),
            gib(m.device_total) if m else "",
            f"{m.device_total / r.capacity_bytes:.0%}" if m and r.capacity_bytes else "",
            gib(m.peak_allocated) if m else "",
            f"{r.tokens_per_sec:,.0f}" if r.tokens_per_sec else "",
            f"{r.throughput.step_time_s:.2f}" if r.throughput else "",
            m.bottleneck if m else "",
            (reason[:70] + "…") if len(reason) > 70 else reason,
            style="bold" if winner else None,
        )
    return table

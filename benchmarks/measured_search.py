"""autofit's measured search against a DeepSpeed-autotuner-style grid, both measuring for real on this CPU.

    python benchmarks/measured_search.py [--quick] [--gpus 2xcpu] [--cpu-mem-budget 120MiB] [--trials 12]
        [--out benchmarks/results/DATE-CPU-measured-search.md]

The target is this machine's CPU as ``--gpus 2xcpu`` (two ranks, gloo): DDP, DeepSpeed
ZeRO-1/2/3 and FSDP really run, launched by ``accelerate launch`` from the exported files.
Each rank has a memory budget (``--cpu-mem-budget``, enforced by the storage tracker: a run
stops with OOM at the first allocation over it), small enough that several plans do not fit.
The model is a small Mistral-shaped config (random weights, written to a temporary
directory; default 4 layers, hidden 256, GQA 8/2 heads, vocab 4000: 4.9 M parameters),
sequence 256, global batch 16. Every trial on both sides is a real child-process run of
the measured evaluator (2 warm-up steps where memory is tracked, then 3 timed steps).

Both sides keep the same training semantics: full fine-tuning, bf16-mixed, AdamW, and the
global batch (micro-batch × grad-accum × 2 ranks = 16).

* **autofit**: ``autofit.search.loop.run_search`` with backend ``measured`` (analytic screen,
  enqueued candidates, TPE, pre-run pruning of plans predicted > 5% over the budget, the
  median pruner on per-step throughput), ``--trials`` (default 12), methods limited to
  ``full`` (``--methods``) so that it answers the same question as the grid. It may vary
  sharding (none/zero1/zero2/zero3/fsdp), micro-batch, checkpointing, attention
  (sdpa/eager) and fused loss.
* **grid**: the DeepSpeed autotuner's *fast* mode, re-implemented over the measured
  evaluator. Everything but ZeRO stage and micro-batch is fixed to a base plan (full,
  bf16-mixed, adamw, no checkpointing, sdpa, no fused loss). The rules, from DeepSpeed
  0.19.8's ``deepspeed/autotuning/autotuner.py`` (installed here) and
  https://www.deepspeed.ai/tutorials/autotuning/ ("the DeepSpeed Autotuner tunes ZeRO
  stages, micro-batch size per GPU, and ZeRO configurations"; ``"fast": true`` is the
  default, ``AUTOTUNING_FAST_DEFAULT = True``, and in fast mode ``tune_space`` returns after
  the micro-batch sizes of each stage, "Tuning micro batch size only"):

  1. a model-info profile run with ``DEFAULT_MIN_MEM_CONFIG`` (ZeRO-3, micro-batch 1); here
     its measured activation memory (peak minus weights, gradients and optimizer states) is
     the autotuner's ``activation_mem`` (counted as a grid trial);
  2. stages 0, 1, 2, 3 in order; a stage is skipped when
     ``get_instantiation_memory_required_per_gpu(stage) + activation_mem`` (params 4N +
     gradients 4N + Adam 8N bytes, fp16 off — DeepSpeed reads only the ``fp16`` flag —
     divided by the ranks from stage 1 / 2 / 3 on) exceeds the per-rank memory, or when its
     ``calculated_max_micro_batch_size = (memory − instantiation) // activation_mem`` is below
     the max micro-batch of the best stage so far (``tune_space``: "No need to tune Zero
     stage");
  3. within a stage, micro-batch sizes from a list (here the divisors of the per-rank batch,
     ``train_micro_batch_size_per_gpu: [1, 2, 4, 8]``, grad-accum making up the global batch)
     in increasing order; stop at the first run that fails or runs out of memory, and stop
     when throughput does not improve on the stage's best by more than 5%
     (``METRIC_PERCENT_DIFF_CONST = 0.05``: ``if metric_val > prev_best_metric_val * (1 +
     METRIC_PERCENT_DIFF_CONST) ... else: break``).

  Differences from DeepSpeed's own autotuner, said plainly: autofit has no "ZeRO stage 0
  under the DeepSpeed engine"; stage 0 is plain DDP (``sharding none``), which is what
  stage 0 means for memory. DeepSpeed keeps gradient accumulation fixed and lets the
  global batch grow with the micro-batch; here the global batch is fixed for both sides.
  With a user-given micro-batch list DeepSpeed runs the whole list; the 5% early stop is
  from its auto-detected micro-batch search (``run_tuning_micro_batch_sizes``,
  ``get_min_max_micro_batch_size``), applied to the list here as the brief asks.

On ``1xcpu`` (world size 1) autofit's validation (``plan_problems``) refuses every ZeRO/FSDP
plan without offload ("divides nothing"), and the space offers no offload on the CPU target
(the device is the host), so a grid there can vary only the micro-batch; that is why the
default target is ``2xcpu``.

At the end each side's best plan is measured once more, back to back, so the ratio is
checked against the shared cores' noise. ``--quick`` (2–3 minutes on idle cores; each run
is ~20 s of launcher start-up): 2 autofit trials, the grid's profile run and stage 0 only,
sequence 128, no re-measurement, nothing written — a smoke run, not a result. The full run
(12 + about 12 runs + 4 re-measurements) takes 15–25 minutes on 2 shared cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _deepspeed import instantiation_bytes
from _machine import machine, uptime, versions

from autofit.evaluators.measured import MeasuredEvaluator
from autofit.plan import Plan, Sharding
from autofit.results import Status, TrialResult
from autofit.search.loop import SearchRequest, run_search
from autofit.search.request import build_context
from autofit.search.space import Allowed
from autofit.specs import Target

MiB = 2**20
ENV = {"OMP_NUM_THREADS": "1"}  # two ranks on two cores: one thread each (as tests/evaluators do)
METRIC_PERCENT_DIFF_CONST = 0.05  # deepspeed/autotuning/constants.py
STAGES = {0: Sharding.NONE, 1: Sharding.ZERO1, 2: Sharding.ZERO2, 3: Sharding.ZERO3}


@dataclass
class Row:
    """One trial of either side, in the order it finished."""

    n: int
    t_s: float  # seconds since that side started, when the trial finished
    result: TrialResult | None  # None: skipped by a rule, nothing ran
    note: str = ""

    @property
    def launched(self) -> bool:
        r = self.result
        return r is not None and r.evaluator == "measured" and r.extra.get("launched", True)

    @property
    def ok(self) -> bool:
        return self.result is not None and self.result.status is Status.FITS and self.result.tokens_per_sec > 0


@dataclass
class Side:
    name: str
    rows: list[Row]
    wall_s: float

    @property
    def best(self) -> Row | None:
        ok = [r for r in self.rows if r.ok]
        return max(ok, key=lambda r: r.result.tokens_per_sec) if ok else None

    def count(self, *statuses: str) -> int:
        return sum(1 for r in self.rows if r.result is not None and r.result.status.value in statuses)


def write_model(root: Path, layers: int, hidden: int, vocab: int) -> Path:
    from transformers import MistralConfig

    d = root / f"mistral-l{layers}-h{hidden}-v{vocab}"
    MistralConfig(
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75),
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=hidden // 8,
        vocab_size=vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ).save_pretrained(d)
    return d


# -- autofit ------------------------------------------------------------------------------------
def run_autofit(ctx: Target, args, db: str) -> Side:
    from autofit.store import Store

    options = {"timeout_s": args.trial_timeout, "cpu_mem_budget": ctx.capacity_bytes, "env": ENV}
    request = SearchRequest(
        ctx=ctx,
        allowed=Allowed.parse(methods=args.methods),
        evaluator="measured",
        trials=args.trials,
        seed=args.seed,
        evaluator_options=options,
    )
    rows: list[Row] = []
    t0 = time.perf_counter()

    def progress(event: str, data: dict) -> None:
        if event in ("trial-done", "trial-duplicate"):
            r: TrialResult = data["result"]
            note = "duplicate: already measured, not stored again" if event == "trial-duplicate" else ""
            rows.append(Row(data["number"], time.perf_counter() - t0, r, note))
            print(
                f"  autofit #{data['number']:<2} {time.perf_counter() - t0:6.0f} s  {_line(r)}"
                + (f"  [{note}]" if note else ""),
                flush=True,
            )

    with Store(db) as store:
        out = run_search(request, store, fresh=True, progress=progress, warm=False)
    wall = time.perf_counter() - t0
    print(f"  autofit study {out.study.name}: {len(out.results)} stored trials in {wall:.0f} s", flush=True)
    return Side("autofit", rows, wall)


# -- the DeepSpeed-autotuner-style grid -------------------------------------------------------
def base_plan(mb: int, per_rank: int, stage: int) -> Plan:
    return Plan(
        method="full",
        precision="bf16-mixed",
        optimizer="adamw",
        micro_batch=mb,
        grad_accum=per_rank // mb,
        checkpointing="none",
        attention="sdpa",
        sharding=STAGES[stage],
    )


def run_grid(ctx: Target, args) -> Side:
    ev = MeasuredEvaluator(timeout_s=args.trial_timeout, cpu_mem_budget=ctx.capacity_bytes, env=ENV)
    ranks = ctx.cluster.world_size
    per_rank = ctx.workload.global_batch // ranks
    mbs_list = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
    budget = ctx.capacity_bytes
    rows: list[Row] = []
    t0 = time.perf_counter()

    def measure(plan: Plan, note: str) -> TrialResult:
        r = ev.evaluate(plan, ctx)
        rows.append(Row(len(rows), time.perf_counter() - t0, r, note))
        print(f"  grid    #{len(rows) - 1:<2} {time.perf_counter() - t0:6.0f} s  {_line(r)}  [{note}]", flush=True)
        return r

    def skip(note: str) -> None:
        rows.append(Row(len(rows), time.perf_counter() - t0, None, note))
        print(f"  grid     -  {note}", flush=True)

    # 1. the model-info profile run (DEFAULT_MIN_MEM_CONFIG: ZeRO-3, micro-batch 1)
    prof = measure(base_plan(1, per_rank, 3), "profile run: ZeRO-3, mb1")
    if prof.memory is None or prof.status is not Status.FITS:
        skip("the profile run did not fit: DeepSpeed's autotuner stops here ('No tuning is performed')")
        return Side("grid", rows, time.perf_counter() - t0)
    m = prof.memory
    activation_mem = max(1, m.peak_allocated - m.weights - m.gradients - m.optimizer)
    n = ctx.model.n_params
    print(
        f"  grid: {n / 1e6:.2f} M parameters, activation_mem (mb1, measured) {activation_mem / MiB:.1f} MiB, "
        f"budget {budget / MiB:.0f} MiB per rank",
        flush=True,
    )

    best_mbs = prev_max_mbs = 0
    for stage in args.stages:
        inst = instantiation_bytes(n, stage, ranks)
        need = inst + activation_mem
        if need >= budget:
            skip(
                f"stage {stage}: model states {inst / MiB:.1f} MiB + activations {activation_mem / MiB:.1f} MiB "
                f">= {budget / MiB:.0f} MiB: not runnable, skipped"
            )
            continue
        calc_max = int(budget - inst) // activation_mem
        if calc_max < prev_max_mbs:
            skip(
                f"stage {stage}: calculated max micro-batch {calc_max} < {prev_max_mbs} of the best stage so far: "
                "'No need to tune', skipped"
            )
            continue
        stage_best_val, stage_best_mbs, stage_max_mbs = 0.0, 0, 0
        for mb in mbs_list[: args.max_mbs_per_stage]:
            plan = base_plan(mb, per_rank, stage)
            if stage == 3 and mb == 1:  # the profile run was this very plan: DeepSpeed reuses its record
                r = prof
            else:
                r = measure(plan, f"stage {stage}, mb{mb}")
            if r.status is not Status.FITS or not r.tokens_per_sec:
                break  # OOM or failure: larger micro-batches will not run either
            stage_max_mbs = mb
            if r.tokens_per_sec > stage_best_val * (1 + METRIC_PERCENT_DIFF_CONST):
                stage_best_val, stage_best_mbs = r.tokens_per_sec, mb
            else:
                break  # improved by less than 5%: stop this stage
        if stage_best_mbs > best_mbs:  # autotuner.tune(): `if next_mbs > mbs`
            best_mbs, prev_max_mbs = stage_best_mbs, stage_max_mbs
    return Side("grid", rows, time.perf_counter() - t0)


# -- reporting ----------------------------------------------------------------------------------
def _line(r: TrialResult) -> str:
    mem = f"{r.memory.device_total / MiB:6.1f} MiB" if r.memory else "     - MiB"
    tps = f"{r.tokens_per_sec:7,.0f} tok/s" if r.status is Status.FITS else "      - tok/s"
    reason = f"  ({r.reason[:110]})" if r.reason and r.status is not Status.FITS else ""
    return f"{r.status.value:8s} {mem} {tps}  {r.plan.summary()}{reason}"


def side_summary(s: Side) -> dict:
    b = s.best
    trials = [r for r in s.rows if r.result is not None]
    return {
        "wall_s": s.wall_s,
        "trials": len(trials),
        "launched": sum(r.launched for r in trials),
        "to_best": (trials.index(b) + 1) if b else None,
        "time_to_best_s": b.t_s if b else None,
        "best_plan": b.result.plan.summary() if b else None,
        "best_tps": b.result.tokens_per_sec if b else 0.0,
        "best_mem": b.result.memory.device_total if b else 0,
        "oom": s.count("oom"),
        "failed": s.count("failed", "timeout"),
        "screened": s.count("screened"),
        "pruned": s.count("pruned"),
        "skipped": sum(1 for r in s.rows if r.result is None),
    }


def trial_table(s: Side) -> list[str]:
    out = ["| # | t (s) | status | MiB/rank | tokens/s | plan | note / reason |", "|---|---:|---|---:|---:|---|---|"]
    best = s.best
    i = 0
    for row in s.rows:
        r = row.result
        if r is None:
            out.append(f"| – | {row.t_s:.0f} | skipped | – | – | – | {row.note} |")
            continue
        i += 1
        mark = " ★" if row is best else ""
        mem = f"{r.memory.device_total / MiB:.1f}" if r.memory else "–"
        tps = f"{r.tokens_per_sec:,.0f}" if r.status is Status.FITS else "–"
        why = "; ".join(x for x in (row.note, r.reason if r.status is not Status.FITS else "") if x)
        if r.evaluator == "analytic":
            why = "not run (analytic pre-screen); " + why
        out.append(
            f"| {i}{mark} | {row.t_s:.0f} | {r.status.value} | {mem} | {tps} | {r.plan.summary()} | "
            f"{why.replace('|', '/')[:220]} |"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 2-3 minute smoke run (2 autofit trials, grid stage 0)")
    ap.add_argument("--gpus", default="2xcpu")
    ap.add_argument("--cpu-mem-budget", default="120MiB", help="memory of each CPU rank")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4000)
    ap.add_argument("--seq-len", type=int, default=None, help="default 256 (--quick: 128)")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--trials", type=int, default=None, help="autofit's trial budget (default 12; --quick: 2)")
    ap.add_argument("--methods", default="full", help="methods autofit may use (the grid is full fine-tuning)")
    ap.add_argument("--stages", default=None, help="grid ZeRO stages (default 0,1,2,3; --quick: 0)")
    ap.add_argument("--max-mbs-per-stage", type=int, default=99)
    ap.add_argument("--trial-timeout", type=float, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--db", default=None, help="default: a SQLite file in a temporary directory")
    ap.add_argument("--no-recheck", action="store_true", help="skip re-measuring both best plans at the end")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.seq_len = args.seq_len or (128 if args.quick else 256)
    args.trials = args.trials or (2 if args.quick else 12)
    args.stages = [int(s) for s in (args.stages or ("0" if args.quick else "0,1,2,3")).split(",")]
    recheck = not (args.quick or args.no_recheck)

    tmp = Path(tempfile.mkdtemp(prefix="autofit-measured-search-"))
    model_dir = write_model(tmp, args.layers, args.hidden, args.vocab)
    ctx = build_context(
        str(model_dir),
        args.gpus,
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        cpu_mem_budget=args.cpu_mem_budget,
    )
    db = args.db or f"sqlite:///{tmp / 'search.db'}"
    load_before = uptime()
    print(
        f"{ctx.model.n_params / 1e6:.2f} M parameters; {args.gpus}, {args.cpu_mem_budget} per rank "
        f"(fit budget {ctx.budget_bytes / MiB:.0f} MiB with headroom); seq {args.seq_len}, global batch "
        f"{args.global_batch}; load: {load_before}",
        flush=True,
    )

    t_all = time.perf_counter()
    print("autofit (run_search, backend measured):", flush=True)
    af = run_autofit(ctx, args, db)
    print("grid (DeepSpeed autotuner fast mode: ZeRO stage x micro-batch):", flush=True)
    grid = run_grid(ctx, args)

    rechecks: list[tuple[str, str, float]] = []
    if recheck and af.best and grid.best:
        print("re-measuring both best plans back to back:", flush=True)
        ev = MeasuredEvaluator(timeout_s=args.trial_timeout, cpu_mem_budget=ctx.capacity_bytes, env=ENV)
        for side in (af, grid, af, grid) if af.best.result.plan != grid.best.result.plan else (af,):
            r = ev.evaluate(side.best.result.plan, ctx)
            rechecks.append((side.name, r.plan.summary(), r.tokens_per_sec if r.status is Status.FITS else 0.0))
            print(f"  {side.name:8s} {_line(r)}", flush=True)
    total = time.perf_counter() - t_all
    load_after = uptime()

    sa, sg = side_summary(af), side_summary(grid)
    ratio = sa["best_tps"] / sg["best_tps"] if sg["best_tps"] else float("nan")
    today = datetime.date.today().isoformat()
    cmd = "python benchmarks/measured_search.py " + " ".join(sys.argv[1:])

    def fmt(s: dict, key: str) -> str:
        v = s[key]
        if v is None:
            return "–"
        if key == "wall_s" or key == "time_to_best_s":
            return f"{v:.0f} s"
        if key == "best_tps":
            return f"{v:,.0f}"
        if key == "best_mem":
            return f"{v / MiB:.1f} MiB"
        return str(v)

    summary = [
        "| | autofit | grid (DeepSpeed fast mode) |",
        "|---|---|---|",
        *(
            f"| {label} | {fmt(sa, k)} | {fmt(sg, k)} |"
            for label, k in (
                ("wall time", "wall_s"),
                ("trials (stored results)", "trials"),
                ("runs launched", "launched"),
                ("trials to reach its best", "to_best"),
                ("time to its best", "time_to_best_s"),
                ("best plan", "best_plan"),
                ("best measured tokens/s", "best_tps"),
                ("its memory per rank", "best_mem"),
                ("OOM trials", "oom"),
                ("failed / timeout trials", "failed"),
                ("screened trials", "screened"),
                ("pruned trials", "pruned"),
                ("stages skipped by rule", "skipped"),
            )
        ),
    ]
    lines = [
        f"# Measured search on this CPU: autofit vs a DeepSpeed-autotuner-style grid — {today}",
        "",
        f"Machine: {machine()}. The cores are shared with other sessions: every timing is from 2 shared "
        "cores and carries their noise.",
        f"Load (uptime) before: `{load_before}`; after: `{load_after}`.",
        f"Versions: {versions('torch', 'transformers', 'accelerate', 'deepspeed', 'optuna', 'peft')}.",
        f"Command: `{cmd}` ({total:.0f} s in all).",
        "",
        f"Target `{args.gpus}` (2 ranks, gloo; DeepSpeed and FSDP on the CPU), `--cpu-mem-budget "
        f"{args.cpu_mem_budget}` per rank (fit budget {ctx.budget_bytes / MiB:.0f} MiB after the 5% headroom). "
        f"Model: Mistral-shaped, {args.layers} layers, hidden {args.hidden}, 8/2 heads, vocab {args.vocab} "
        f"({ctx.model.n_params / 1e6:.2f} M parameters, random weights); sequence {args.seq_len}, global batch "
        f"{args.global_batch}. Each run: 2 warm-up steps (memory tracked) + 3 timed steps in a child process "
        "(`accelerate launch` from the exported files), `OMP_NUM_THREADS=1` per rank. Both sides: full "
        "fine-tuning, bf16-mixed, AdamW. autofit: `run_search` backend measured, "
        f"{args.trials} trials, methods `{args.methods}`. Grid: ZeRO stages {args.stages} × micro-batch, fast-mode "
        "rules (see the script's docstring).",
        "",
        f"**autofit best / grid best = {ratio:.3f}** ({sa['best_tps']:,.0f} vs {sg['best_tps']:,.0f} tokens/s, "
        "as measured during each search).",
        "",
        *summary,
        "",
    ]
    if rechecks:
        by = {}
        for name, plan, tps in rechecks:
            by.setdefault(name, (plan, []))[1].append(tps)
        lines += ["Both best plans measured again at the end, alternating (tokens/s):", ""]
        for name, (plan, vals) in by.items():
            lines.append(f"- {name}: {plan}: " + ", ".join(f"{v:,.0f}" for v in vals))
        if len(by) == 2:
            a = sum(by["autofit"][1]) / len(by["autofit"][1])
            g = sum(by["grid"][1]) / len(by["grid"][1])
            lines.append(f"- ratio of the re-measured means: {a / g:.3f}" if g else "- grid best did not run again")
        lines.append("")
    lines += ["## autofit trials", "", *trial_table(af), "", "## grid trials", "", *trial_table(grid), ""]
    text = "\n".join(lines)
    print("\n" + text)
    out = (
        Path(args.out)
        if args.out
        else (None if args.quick else Path(f"benchmarks/results/{today}-CPU-measured-search.md"))
    )
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"written to {out}")
    (tmp / "summary.json").write_text(json.dumps({"autofit": sa, "grid": sg, "ratio": ratio}, indent=1))


if __name__ == "__main__":
    main()

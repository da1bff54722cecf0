"""Warm start: trials-to-best with and without the plans of a past study (issue 6).

    python benchmarks/warm_start.py            # 5 seeds, budget 20, writes results/<date>-warm-start.md
    python benchmarks/warm_start.py --quick    # 2 seeds, budget 10, prints only

For each request (the five of ``search_efficiency.py``, analytic backend; plus gpt2-xl on
1xT4 at global batch 2 with its evaluator replaced by the stored simulated results when
``results/oracle/simulated-gpt2-xl-1xT4-seq1024-gb2.jsonl`` is complete):

1. a *prior* study of the same model on the same GPUs, on a different workload (half the
   sequence length: 1024 instead of 2048, 512 for gpt2-xl whose positions end at 1,024; same
   global batch; or twice the global batch, same sequence length — two variants), runs with ``search.run_search`` (analytic
   backend, 10 trials, its own seed) in a temporary SQLite store;
2. the *target* study (the request's own workload) then runs in that store twice, in two
   copies of it: with warm start (``run_search(..., warm=True)``, the default: past winners
   of the same model fingerprint and GPU type are mapped into the new space by
   ``search.warm_start`` and enqueued before the screened candidates) and without
   (``warm=False``: only the screened candidates are enqueued). Everything else — the
   screen, the sampler seed, the budget — is the same.

Reported per request, median over seeds: *trials-to-best* (the first trial whose plan
reaches the study's own final best) and *trials-to-98%* (the first trial reaching 98% of the
oracle optimum, from ``search_efficiency``'s oracles), and the best reached. Note that
``prepare_search`` enqueues past winners first and then the screened candidates, ``max(k,
len(warm))`` distinct plans with ``k = min(6, trials // 2)``; a past winner the screen predicts
not to fit the new workload is left out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import search_efficiency as se  # noqa: E402

from autofit.search import loop as search  # noqa: E402

PRIORS = ("half the sequence", "global batch x2")  # the prior study's workload, beside the target's


def prior_request(req: se.Request, prior: str) -> se.Request:
    if prior == "half the sequence":
        return se.Request(
            req.model, req.gpus, seq_len=req.seq_len // 2, global_batch=req.global_batch, allowed=req.allowed
        )
    return se.Request(req.model, req.gpus, seq_len=req.seq_len, global_batch=2 * req.global_batch, allowed=req.allowed)


PRIOR_TRIALS = 10


def run_pair(oracle: se.Oracle, budget: int, seed: int, prior: str = PRIORS[0]) -> dict[str, Any]:
    """Prior study, then the target with and without warm start (separate stores holding the same prior)."""
    req = oracle.request
    prior_req = prior_request(req, prior)
    out: dict[str, Any] = {}
    for warm in (True, False):
        with se.temp_store() as store:
            prior = search.run_search(
                search.SearchRequest(
                    ctx=prior_req.ctx(),
                    allowed=prior_req.allowed,
                    evaluator="analytic",
                    trials=PRIOR_TRIALS,
                    seed=1000 + seed,
                ),
                store,
                fresh=True,
            )
            enq: list[int] = []
            if warm:
                sreq = search.SearchRequest(ctx=req.ctx(), allowed=req.allowed, trials=budget)
                space = search.SearchSpace(sreq.ctx, sreq.allowed)
                enq.append(len(search.warm_start(sreq, store, space)))
            run = se.autofit_run(oracle, budget, seed, store=store, warm=warm)
            best = max((r.tokens_per_sec for r in run.results if r is not None and r.fits), default=0.0)
            first_best = next(
                (
                    i
                    for i, r in enumerate(run.results, 1)
                    if r is not None and r.fits and r.tokens_per_sec >= best - 1e-9
                ),
                None,
            )
            out["warm" if warm else "cold"] = {
                "trials_to_best": first_best,
                "trials_to_98": run.first_reaching(oracle, se.GOAL_FRACTION),
                "best_fraction": run.best_fraction(oracle),
                "first_fraction": oracle.fraction(run.results[0]) if run.results else 0.0,
                "first_status": run.results[0].status.value if run.results else None,
                "first_plan": run.results[0].plan.summary() if run.results else None,
                "oom": run.oom(),
                "pruned": run.count(se.PRUNED),
                "duplicates": run.count(se.DUPLICATE),
                "warm_plans": enq[0] if enq else 0,
                "prior_best": prior.best.plan.summary() if prior.best else None,
            }
    return out


def med(xs: list[int | None], cap: int) -> str:
    """Median where 'not reached' counts as budget + 1 (shown as >budget)."""
    vals = [x if x is not None else cap + 1 for x in xs]
    m = statistics.median(vals)
    return f">{cap}" if m > cap else f"{m:g}"


def render(doc: dict) -> str:
    budget = doc["budget"]
    lines = se.header(doc, "Warm start", "warm_start.py")
    lines += [
        f"{len(doc['seeds'])} seeds, budget {budget} trials per target study. Prior study: same model and GPUs "
        f"on another workload — half the sequence length, or twice the global batch at the same "
        f"sequence length (analytic backend, {PRIOR_TRIALS} trials, its own seed), in the "
        "same temporary SQLite store as the target study. *warm*: `run_search(warm=True)` (the default); "
        "*cold*: `warm=False`; everything else equal (screen, sampler seed, budget). Trial numbers are 1-based; "
        f"medians over seeds, per-seed values in brackets; '>{budget}' / '–' = not reached within the budget.",
        "",
        "| request | prior workload | oracle | warm plans enqueued | trials-to-best warm | cold | trials-to-98% warm | cold | "
        "best reached warm | cold | trial 1 warm | cold | OOM warm | cold |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in doc["results"]:
        p = res["pairs"]

        def col(k: str, f: str, p=p) -> str:
            xs = [q[k][f] for q in p]
            return f"{med(xs, budget)} [{', '.join(str(x) if x else '–' for x in xs)}]"

        def frac(k: str, f: str, p=p) -> str:
            return f"{statistics.median([q[k][f] for q in p]):.1%}"

        def num(k: str, f: str, p=p) -> str:
            return f"{statistics.median([q[k][f] for q in p]):g}"

        lines.append(
            f"| {res['request']} | {res['prior']} | {res['oracle']} | {num('warm', 'warm_plans')} | "
            f"{col('warm', 'trials_to_best')} | {col('cold', 'trials_to_best')} | "
            f"{col('warm', 'trials_to_98')} | {col('cold', 'trials_to_98')} | "
            f"{frac('warm', 'best_fraction')} | {frac('cold', 'best_fraction')} | "
            f"{frac('warm', 'first_fraction')} | {frac('cold', 'first_fraction')} | "
            f"{num('warm', 'oom')} | {num('cold', 'oom')} |"
        )
    lines += ["", "Past winners mapped into the target space (prior best → first warm trial's result), seed 0:", ""]
    for res in doc["results"]:
        w = res["pairs"][0]["warm"]
        lines.append(
            f"- {res['request']} [{res['oracle']}, prior {res['prior']}]: prior best {w['prior_best']}; the warm plan at the target "
            f"workload reached {w['first_fraction']:.1%} of the optimum"
            + (f" ({w['first_status']})" if w.get("first_status") else "")
            + "."
        )
    if doc.get("findings"):
        lines += ["", "## Findings (read from the figures below)", "", doc["findings"]]
    lines += ["", NOTES]
    for note in doc.get("notes", []):
        lines += [f"Note: {note}", ""]
    return "\n".join(lines)


NOTES = """Notes on reading this:

- With the analytic backend the screen already enqueues the analytic optimum of the target
  workload, and the evaluator *is* the analytic model, so the cold study finds its best at
  trial 1 by construction and warm start cannot shorten it; it could only move the screened
  pick later (past winners run first). Any difference in the analytic rows is that.
- The simulated-replay row (gpt2-xl, 1xT4, global batch 2; its evaluator replaced by the stored
  simulated results of `search_efficiency.py`'s oracle table) is the one where the screen and
  the evaluator disagree; its prior study is analytic (at half the sequence length), as a user's
  quick earlier search would be.
- The past winner is mapped into the new space by `search.warm_start`: same techniques, the
  micro-batch whose tokens are nearest the old micro-batch's (from half the sequence length to
  the whole the micro-batch halves where it can), and left out when the screen predicts it not to fit.
  Before autofit 4729c85/d8a4f42 it kept the old micro-batch: a seq-1024 winner at the memory
  edge did not fit at 2048 and cost one trial on every request (trials-to-best 2 warm vs 1
  cold under the analytic oracle, 6 vs 5 on the simulated row; run at autofit 664ea9d).
- What this benchmark cannot show: warm start pays where the screen is wrong for the GPU type
  and past *measured* winners know better (measured studies); here every study is analytic or
  replays the simulator, whose first five screened picks already hold the optimum.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 seeds, budget 10; prints only (unless --out)")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--budget", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--part", choices=("all", "analytic", "simulated"), default="all")
    ap.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="write one report (--out) from the raw JSON of runs made with --part",
    )
    ap.add_argument(
        "--findings",
        default=None,
        metavar="MD",
        help="with --merge: a reader's summary of these figures, printed under the summary table",
    )
    args = ap.parse_args()
    if args.merge:
        doc = se.merged(args.merge, args.findings)
        print(render(doc))
        se.write(doc, args.out or str(se.RESULTS / f"{se.DATE}-warm-start.md"), render)
        return
    t0 = time.perf_counter()
    v = se.versions()  # the library as loaded now (other sessions may commit while this runs)
    seeds = list(range(args.seeds if args.seeds else (2 if args.quick else 5)))
    budget = args.budget or (10 if args.quick else 20)
    oracles = [se.analytic_oracle(r) for r in se.REQUESTS] if args.part in ("all", "analytic") else []
    notes = []
    if args.part in ("all", "simulated"):
        table_ = se.read_table(se.oracle_path(se.SIM_REQUEST))
        if len(table_) >= se.SIM_REQUEST.space().size():
            oracles.append(se.simulated_oracle(se.SIM_REQUEST))
        else:
            notes.append(f"simulated oracle table incomplete ({len(table_)} plans): simulated-replay variant skipped")
            print(notes[-1])
    results = []
    for oracle in oracles:
        t = time.perf_counter()
        for prior in PRIORS:
            pairs = [run_pair(oracle, budget, s, prior) for s in seeds]
            res = {
                "request": oracle.request.label,
                "prior": prior,
                "oracle": oracle.kind,
                "pairs": pairs,
                "seconds": time.perf_counter() - t,
            }
            results.append(res)
            print(
                f"{oracle.request.label} [{oracle.kind}, prior {prior}]: "
                + "; ".join(
                    f"{k}: to-best {med([p[k]['trials_to_best'] for p in pairs], budget)}, to-98% "
                    f"{med([p[k]['trials_to_98'] for p in pairs], budget)}"
                    for k in ("warm", "cold")
                ),
                flush=True,
            )
    wall = time.perf_counter() - t0
    doc = {
        "versions": v,
        "machine": se.machine(),
        "runs": [{"argv": sys.argv[1:], "wall_s": wall, "autofit": v["autofit"], "load": os.getloadavg()}],
        "seeds": seeds,
        "budget": budget,
        "results": results,
        "notes": notes,
    }
    print()
    print(render(doc))
    suffix = "" if args.part == "all" else f"-{args.part}"
    out = args.out or (None if args.quick else str(se.RESULTS / f"{se.DATE}-warm-start{suffix}.md"))
    if out:
        se.write(doc, out, render)


if __name__ == "__main__":
    main()

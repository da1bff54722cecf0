"""Simulated vs real CPU steps: the accuracy grid of tests/evaluators/test_simulated.py, as numbers.

    python benchmarks/simulated_vs_real_cpu.py [--quick] [--out benchmarks/results/FILE.md]

For each family and plan of the test grid (3-layer variants, seq 256) plus the padded
workloads: the real peak (two real CPU steps under the storage tracker), the simulated
peak (the same steps traced under fake tensors for the ``1xcpu`` target), the peak error
and the worst component error. A component is compared relative to itself, or, below 1%
of the peak, in points of the peak (the tests' rule). A summary table gives the median and
worst error of the peak and of each component over all cases. ``--quick``: one family.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test grid lives in tests/

from _errors import component_errors, summary_table

from autofit.evaluators.simulated import Target, run_trace
from autofit.specs import Workload
from tests.conftest import tiny
from tests.evaluators.test_simulated import FAST, GRID_PLANS, LENGTHS, measure

MiB = 2**20


def cases(quick: bool = False):
    if quick:
        for plan in GRID_PLANS:
            yield "mistral-7b", plan, 256, None, 3
        return
    for family in ("mistral-7b", "llama-3-8b", "qwen2.5-7b", "gpt2"):
        for plan in GRID_PLANS:
            yield family, plan, 256, None, 3
    for family in ("llama-3-8b", "gpt2"):
        for mb, ga in ((1, 2), (3, 1)):
            from autofit.plan import Plan

            yield family, Plan(precision="bf16-mixed", micro_batch=mb, grad_accum=ga), 128, LENGTHS, 2
    for family, plan in FAST:
        yield family, plan, 128, None, 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--quick", action="store_true", help="one family (12 cases) instead of 72")
    args = ap.parse_args()
    import bitsandbytes
    import peft
    import torch
    import transformers

    lines = [
        f"Machine: 2-core CPU VM, no GPU; Python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, peft {peft.__version__}, bitsandbytes {bitsandbytes.__version__}.",
        "",
        "| model | plan | workload | real peak MiB | sim peak MiB | peak error | worst component (error) | real s / sim s |",
        "|---|---|---|---:|---:|---:|---|---:|",
    ]
    peaks, comps, pairs = [], [], []
    for family, plan, seq, lengths, layers in cases(args.quick):
        spec = tiny(family, layers=layers)
        wl = Workload(seq_len=seq, global_batch=plan.micro_batch * plan.grad_accum, lengths=lengths)
        t0 = time.perf_counter()
        real = measure(spec, plan, wl)
        t1 = time.perf_counter()
        tr = run_trace(spec, plan, wl, Target("cpu"))
        t2 = time.perf_counter()
        pe = (tr.peak - real.peak) / real.peak
        errs = component_errors(real.components, tr.peak_components, real.peak)
        cn = max(errs, key=errs.get) if any(errs.values()) else ""
        ce = errs.get(cn, 0.0)
        pairs.append((real.components, tr.peak_components, real.peak, tr.peak))
        peaks.append(abs(pe))
        comps.append(ce)
        wdesc = f"L{layers} seq {seq}" + (" padded" if lengths else "")
        worst = f"{cn} ({ce * 100:.3f}%)" if cn else "exact"
        lines.append(
            f"| {family} | {plan.summary()} | {wdesc} | {real.peak / MiB:.2f} | {tr.peak / MiB:.2f} | "
            f"{pe * 100:+.3f}% | {worst} | {t1 - t0:.1f} / {t2 - t1:.1f} |"
        )
        print(lines[-1], flush=True)
    peaks.sort()
    comps.sort()
    lines += [
        "",
        f"{len(peaks)} cases. |peak error|: median {peaks[len(peaks) // 2] * 100:.3f}%, worst {peaks[-1] * 100:.3f}% "
        f"(bound 2%). Worst component error per case: median {comps[len(comps) // 2] * 100:.3f}%, "
        f"worst {comps[-1] * 100:.3f}% (bound 5%).",
        "",
        *summary_table(pairs, "simulated vs real CPU"),
    ]
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

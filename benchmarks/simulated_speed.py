"""How long one simulated plan takes (goal: Mistral-7B at seq 4096 in <= 15 s, <= 4 GiB RSS on
2 cores; Llama-3-70B in <= 60 s), and torch's own MemTracker on the same fake step.

    python benchmarks/simulated_speed.py --model mistral-7b --seq 4096 [--plan qlora|full|lora] [--memtracker]

Each figure is one fresh trace (an empty trace cache) in this process; imports are timed
apart. ``--memtracker`` runs the same fake step once more under
``torch.distributed._tools.mem_tracker.MemTracker`` instead of our tracker, for the
issue's question whether torch's tracker is fast enough to use.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import time

T0 = time.perf_counter()
import torch  # noqa: E402
import transformers  # noqa: E402,F401

from autofit.evaluators.simulated import SimulatedEvaluator, TraceCache  # noqa: E402
from autofit.plan import Plan  # noqa: E402
from autofit.specs import (  # noqa: E402
    Target,  # noqa: E402
    Workload,
    parse_cluster,
    resolve_model,
)

IMPORT_S = time.perf_counter() - T0

PLANS = {
    "qlora": dict(
        method="qlora", lora_rank=16, precision="bf16-mixed", checkpointing="full", attention="flash2", fused_loss=True
    ),
    "lora": dict(method="lora", lora_rank=16, precision="bf16-mixed", checkpointing="full", attention="sdpa"),
    "full": dict(precision="bf16-mixed", attention="sdpa", checkpointing="full"),
    "zero3": dict(precision="bf16-mixed", attention="flash2", checkpointing="full", sharding="zero3"),
}


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _states(opt):
    for st in opt.state.values():
        yield from (v for v in st.values() if isinstance(v, torch.Tensor))


def tracker_step(model_spec, plan, workload, which: str) -> float:
    """Seconds of the second of two fake training steps under ``which`` tracker: "none",
    "ours" (memtrack.StorageTracker) or "torch" (torch's MemTracker, module-level
    categorized tracking)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autofit.evaluators import runtime as rt
    from autofit.evaluators.memtrack import StorageTracker

    net = rt.build_model(model_spec, plan, device="meta")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    rt.to_fake(net, mode)
    opt = rt.make_optimizer(plan, net)
    batches = [
        [{k: mode.from_tensor(v) for k, v in b.items()} for b in rt.batches_for(model_spec, plan, workload, step=s)]
        for s in range(2)
    ]
    runner = rt.StepRunner(model_spec, plan, net, opt)
    with mode:
        runner.step(batches[0], step=0)  # untracked: optimizer states created, as a tracker finds them
    runner.close()
    if which == "torch":
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(net, opt)
    elif which == "ours":
        tracker = StorageTracker()
        runner = rt.StepRunner(model_spec, plan, net, opt, tracker=tracker)
    else:
        tracker = contextlib.nullcontext()
    with mode, tracker:
        if which == "ours":
            tracker.track(rt.state_tensors(net) + list(_states(opt)), "weights")
        t = time.perf_counter()
        runner.step(batches[1], step=1)
        dt = time.perf_counter() - t
    if which == "torch":
        peak = max(tracker.get_tracker_snapshot("peak")[torch.device("cpu")].values())
    elif which == "ours":
        peak = tracker.snapshot().peak
    else:
        peak = 0
    print(
        f"  tracker {which:5s}: second step {dt:6.1f} s" + (f", peak {peak / 2**30:.2f} GiB" if peak else ""),
        flush=True,
    )
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mistral-7b")
    ap.add_argument("--gpus", default="1xA100-80GB")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mb", type=int, default=1)
    ap.add_argument("--plan", default="qlora", choices=sorted(PLANS))
    ap.add_argument("--memtracker", action="store_true")
    args = ap.parse_args()
    spec = resolve_model(args.model)
    cluster = parse_cluster(args.gpus)
    plan = Plan(micro_batch=args.mb, **PLANS[args.plan])
    wl = Workload(seq_len=args.seq, global_batch=args.mb * cluster.world_size)
    ctx = Target(spec, cluster, wl)
    t = time.perf_counter()
    r = SimulatedEvaluator(TraceCache()).evaluate(plan, ctx)
    wall = time.perf_counter() - t
    print(f"{args.model} seq {args.seq} on {args.gpus}, {plan.summary()}: {r.status} {r.reason}")
    if r.memory:
        print(f"  peak_allocated {r.memory.peak_allocated / 2**30:.2f} GiB, {r.tokens_per_sec:,.0f} tokens/s")
    print(f"  imports {IMPORT_S:.1f} s; evaluate {wall:.1f} s wall; max RSS {rss_gib():.2f} GiB")
    if r.extra.get("timings"):
        print(f"  {r.extra['timings']}")
    if args.memtracker:
        for which in ("none", "ours", "torch"):
            tracker_step(spec, plan, wl, which)
        print(f"  max RSS {rss_gib():.2f} GiB")


if __name__ == "__main__":
    main()

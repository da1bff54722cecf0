"""autofit's memory and throughput estimates against published, measured training runs.

    python benchmarks/published_runs.py [--evaluators analytic,simulated] [--jobs 2]
                                        [--rows 1,2,339] [--out benchmarks/results/FILE]
    python benchmarks/published_runs.py --throughput [--fit [--write-params]]
                                        [--evaluators analytic,simulated --rows ...]

``--throughput`` compares tokens/s (or samples/s, in the row's unit) on every throughput
row instead (``_throughput.py`` says how each source's rows are read): the median |error|,
the share within ×0.67–×1.5 and the pairwise order of rows of one model and GPU type, for
the analytic evaluator on every row and the simulated one on ``--rows``. ``--fit`` fits the
time model's rates on every row and again leaving each source out; ``--write-params``
stores the fit in ``autofit/evaluators/time_model.json`` (docs/EVALUATORS.md, "The time
model").

Every memory row of ``../shared/reference-runs/published_runs.csv`` (397 runs from 10
public projects; ``SOURCES.md`` says where each comes from) is mapped to an autofit
target and plan, estimated by each evaluator, and compared on the metric the row reports:
``A`` (``max_memory_allocated``) with ``peak_allocated``, ``R`` (``max_memory_reserved``)
with ``peak_reserved``, ``N`` (nvidia-smi) with ``device_total``. A row whose source does
not say (``?``) is compared on what its source's code printed, where we could read it
(``SOURCE_SETUP``), else on ``peak_reserved``, and is named so in the output.

What each source ran (LoRA targets and dropout, its own model code or transformers,
chunked losses, offloading) is in ``SOURCE_SETUP`` and in ``_special``, read from the
source's training script at the commit ``SOURCES.md`` gives. A row autofit cannot express
stays out with the reason, and is listed.

Printed per source and overall, per evaluator: the rows compared, the median |error|
(``predicted / measured - 1``), the share of rows under-predicted by more than 5%, and the
95% margin (the smallest ``m`` with ``predicted × (1 + m) >= measured`` on 95% of rows).
OOM rows (a lower bound: the run did not fit) are checked for being predicted not to fit.
``--write-evidence`` stores the margins and the allocator replays' fragmentation in
``autofit/evaluators/evidence.json`` (see docs/EVALUATORS.md).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import _throughput as speed  # noqa: E402 - beside this file

from autofit.specs import MODELS, ModelSpec  # noqa: E402 - after the path above

CSV = ROOT.parent / "shared" / "reference-runs" / "published_runs.csv"
GiB = 2**30
UNDER = 0.05  # "under-predicted" means predicted < measured × (1 - UNDER)
COVER = 0.95  # the margin covers this share of rows

# The metric column: which of autofit's totals the row's figure is.
METRIC_TOTAL = {"A": "peak_allocated", "R": "peak_reserved", "N": "device_total"}


@dataclass(frozen=True)
class SourceSetup:
    """What a source's training code ran, beyond the CSV's columns (read in its script at the
    commit SOURCES.md names; the evidence is in the comments)."""

    metric: str = ""  # what a "?" row is: A, R or N; "" = unknown (compared on reserved)
    metric_note: str = ""
    lora_targets: str = "attention"  # autofit's closest LoRA target set
    lora_note: str = ""
    lora_dropout: float = 0.0
    model_code: str = "transformers"  # or the source's own model code
    fused_loss: bool = False  # a loss that never holds the full logits
    unit: float = 1.0  # measured_gib × unit = GiB (a table in GB the CSV did not convert)


SOURCE_SETUP: dict[str, SourceSetup] = {
    # finetune/lora.py @8641822: r=8, alpha 16, dropout 0.05 on the q and v slices of the fused qkv;
    # lm_head chunked (128) + chunked cross-entropy on bf16 logits; max_memory_allocated / 1e9 (converted)
    "litgpt-resource-tables": SourceSetup(
        lora_targets="attention",
        lora_note="LitGPT LoRA on q and v (autofit: attention = q,k,v,o)",
        lora_dropout=0.05,
        model_code="litgpt",
        fused_loss=True,
    ),
    "litgpt-finetune_lora-md": SourceSetup(
        lora_targets="attention", lora_note="LitGPT LoRA on q and v", lora_dropout=0.05, model_code="litgpt"
    ),
    # training.get_memory_stats @30b8519e8 resets the peak every step; the 3.2 table is active_bytes
    # (close to allocated); the 3.1 table does not say which of active/allocated/reserved it shows
    "torchtune-readme": SourceSetup(
        metric="A", metric_note="reset every step; the table does not name the statistic", model_code="torchtune"
    ),
    # llama2 LoRA builder default lora_dropout 0.05 (models/llama2/_model_builders.py @ff594c231)
    "torchtune-docs": SourceSetup(lora_dropout=0.05, model_code="torchtune"),
    # TorchTracemalloc prints max_memory_allocated; the table's "GB" is 1e9 bytes (README log line)
    "peft-readme": SourceSetup(
        metric="A", metric_note="TorchTracemalloc: max_memory_allocated", lora_dropout=0.1, unit=1e9 / 2**30
    ),
    # examples/sft: all-linear, r=8, dropout 0.1; figures read off nvidia-smi-style screenshots
    "peft-docs-accelerate": SourceSetup(
        metric="N", metric_note="read off a device-usage screenshot", lora_targets="all-linear", lora_dropout=0.1
    ),
    # swift 1.6 (97e4d198b): r=8, alpha 32, dropout 0.05 on the qkv projection(s) ("DEFAULT");
    # max_memory_reserved per device over the whole process
    "ms-swift-benchmark": SourceSetup(
        lora_targets="attention", lora_note="swift DEFAULT targets: the qkv projection(s)", lora_dropout=0.05
    ),
}

# Published model names -> a registered model, or a config dict autofit builds it from.
# Qwen-1, ChatGLM3 and Baichuan2 are remote code on the hub; each is expressed by the
# transformers-native family whose block holds the same tensors (say so in the output).
MODEL_NAMES = {
    "phi-1_5": "phi-1_5",
    "stablelm-base-alpha-3b": "stablelm-base-alpha-3b",
    "llama-2-7b": "llama-2-7b",
    "llama-2-13b": "llama-2-13b",
    "llama-2-70b": "llama-2-70b",
    "llama-3.1-8b": "llama-3.1-8b",
    "llama-3.1-70b": "llama-3.1-70b",
    "llama-3.1-405b": "llama-3.1-405b",
    "llama-3.2-3b": "llama-3.2-3b",
    "yi-6b-chat": "yi-6b",
    "yi-34b-chat": "yi-34b",
    "openbuddy-zephyr-7b-chat": "mistral-7b",
    "bloomz-7b1": "bloom-7b1",
    "falcon-40b": "falcon-40b",
}


def _qwen1(name: str, hidden: int, layers: int, heads: int, ff: int, vocab: int) -> dict[str, Any]:
    """Qwen-1 (remote code ``QWenLMHeadModel``): a llama block with a qkv bias and an MLP of
    ``ff/2`` (config ``intermediate_size`` is w1+w2), RMSNorm, rope: transformers' qwen2 block."""
    return dict(
        name=name,
        model_type="qwen2",
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=ff // 2,
        vocab_size=vocab,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )


REMOTE_CODE_MODELS: dict[str, tuple[dict[str, Any] | ModelSpec, str]] = {
    "qwen-1_8b-chat": (_qwen1("qwen-1_8b-chat", 2048, 24, 16, 11008, 151936), "Qwen-1 as a qwen2 block"),
    "qwen-7b-chat": (_qwen1("qwen-7b-chat", 4096, 32, 32, 22016, 151936), "Qwen-1 as a qwen2 block"),
    "qwen-14b-chat": (_qwen1("qwen-14b-chat", 5120, 40, 40, 27392, 152064), "Qwen-1 as a qwen2 block"),
    "qwen-72b-chat": (_qwen1("qwen-72b-chat", 8192, 80, 64, 49152, 152064), "Qwen-1 as a qwen2 block"),
    "chatglm3-6b": (
        dict(
            name="chatglm3-6b",
            model_type="qwen2",  # qkv bias, 2 KV groups, SwiGLU, RMSNorm, rope (on half of each head)
            hidden_size=4096,
            num_layers=28,
            num_heads=32,
            num_kv_heads=2,
            head_dim=128,
            intermediate_size=13696,
            vocab_size=65024,
            max_position_embeddings=8192,
            tie_word_embeddings=False,
        ),
        "ChatGLM3 as a qwen2 block (GQA 2 groups, qkv bias)",
    ),
    # W_pack: a fused qkv without bias, SwiGLU, RMSNorm, rope, a NormHead: Llama-2-7B's tensors, another vocabulary
    "baichuan2-7b-chat": (
        MODELS["llama-2-7b"].variant(name="baichuan2-7b-chat", vocab_size=125696),
        "Baichuan2-7B as a llama block",
    ),
}

# Rows autofit cannot express, by model: the reason.
OUT_MODELS = {
    "t0-3b": "encoder-decoder (T5): autofit models decoder-only and BERT-style encoders",
    "mt0-xxl": "encoder-decoder (mT5): autofit models decoder-only and BERT-style encoders",
    "baichuan2-13b-chat": "ALiBi attention in a llama block (remote code): no transformers family has it",
}

GPU_NAMES = {
    "A100-40GB": "A100-40GB",
    "A100-80GB": "A100-80GB",
    "H100-80GB": "H100-80GB",
    "RTX4090-24GB": "RTX4090",
    "RTXA6000-48GB": "A6000",
}
# GPUs a source does not name: memory depends on the GPU only through its kernels (sm80+).
ASSUMED_GPUS = {
    "(unstated)": ("A100-80GB", "GPU not stated: A100-80GB assumed (same kernels as any sm80+)"),
    "24GB(unstated model)": ("RTX4090", "a 24 GB GPU, model not stated: RTX 4090 assumed"),
    "(unstated, >35GB)": ("A100-80GB", "a GPU over 35 GB, model not stated: A100-80GB assumed"),
}

OPTIMIZERS = {
    "torch.AdamW": "adamw",
    "torch.AdamW(fused)": "adamw",
    "torch.AdamW (HF adamw_torch)": "adamw",
    "AdamW (HF default)": "adamw",
    # bitsandbytes' 32-bit paged AdamW keeps fp32 states on the GPU unless memory runs out
    "bnb.PagedAdamW(32-bit)": "adamw",
    "bitsandbytes.PagedAdamW8bit": "paged-adamw-8bit",
    "8-bit AdamW (bnb PagedAdamW8bit per config default)": "paged-adamw-8bit",
}


@dataclass
class Case:
    """One memory row, as autofit sees it."""

    id: int
    source: str
    model: str
    metric: str  # A, R or N (what is compared)
    measured: float  # bytes; 0 for an OOM row
    oom: bool
    request: dict[str, Any]  # build_context/Plan arguments
    notes: list[str] = field(default_factory=list)
    out: str = ""  # why autofit cannot express it ("" = it can)
    predicted: dict[str, dict[str, Any]] = field(default_factory=dict)  # evaluator -> totals/status


def _special(row: dict[str, str]) -> str:
    """Why a row ran something autofit has no plan for, or ""."""
    notes, source = row["notes"], row["source"]
    if source == "torchtune-readme" and "PagedAdamW8bit" in row["optimizer"]:
        return (
            "bitsandbytes paged 8-bit states (cudaMallocManaged, outside torch's memory counters, which the "
            "row's metric reads): autofit counts them on the device"
        )
    if source == "ms-swift-benchmark" and row["gpus"].startswith("2x"):
        return "ms-swift splits the model over 2 GPUs with device_map (naive model parallelism): not a plan autofit has"
    if source == "ms-swift-benchmark" and "(gptq)" in notes:
        return "LoRA on a GPTQ-quantized base (fp16 AMP, dequantized weights saved): autofit has no GPTQ"
    if source == "litgpt-resource-tables" and row["sharding"] == "fsdp":
        return (
            "Lightning FSDP1 with use_orig_params=True under no_sync keeps full-size gradients of the frozen "
            "weights (blocks mix frozen and LoRA parameters): autofit's FSDP is FSDP2, which gives them none"
        )
    return ""


def _model(row: dict[str, str]) -> tuple[Any, str]:
    """The ModelSpec of a row's model, and a note, or (None, reason)."""
    name = row["model"]
    if name in OUT_MODELS:
        return None, OUT_MODELS[name]
    if name in REMOTE_CODE_MODELS:
        d, note = REMOTE_CODE_MODELS[name]
        return (d if isinstance(d, ModelSpec) else ModelSpec(**d)), note
    reg = MODEL_NAMES.get(name)
    if reg is None:
        return None, f"model {name!r} is not mapped to an autofit architecture"
    if reg not in MODELS:
        return None, f"model {name!r} ({reg}) is not registered in autofit"
    return MODELS[reg], ("" if reg == name else f"as {reg}")


def _gpus(text: str) -> tuple[str, str]:
    count, _, gpu = text.partition("x")
    if gpu in GPU_NAMES:
        return f"{count}x{GPU_NAMES[gpu]}", ""
    name, note = ASSUMED_GPUS[gpu]
    return f"{count}x{name}", note


def _metric(row: dict[str, str], setup: SourceSetup) -> tuple[str, str]:
    m = row["metric"]
    if m in METRIC_TOTAL:
        return m, ""
    if setup.metric:
        return setup.metric, f"metric '?' read as {setup.metric} ({setup.metric_note})"
    return "R", "metric not stated: compared on reserved"


def to_case(row: dict[str, str]) -> Case | None:
    """The case of a memory row (None for a throughput-only row)."""
    oom = not row["measured_gib"] and "OOM" in row["notes"]
    if not row["measured_gib"] and not oom:
        return None
    setup = SOURCE_SETUP.get(row["source"], SourceSetup())
    metric, metric_note = _metric(row, setup)
    case = Case(
        id=int(row["id"]),
        source=row["source"],
        model=row["model"],
        metric=metric,
        measured=float(row["measured_gib"] or 0) * setup.unit * GiB,
        oom=oom,
        request={},
    )
    if metric_note:
        case.notes.append(metric_note)
    if "SUSPECT" in row["notes"]:
        case.out = "marked SUSPECT in SOURCES.md"
        return case
    case.out = _special(row)
    if case.out:
        return case
    spec, note = _model(row)
    if spec is None:
        case.out = note
        return case
    if note:
        case.notes.append(note)
    gpus, gpu_note = _gpus(row["gpus"])
    if gpu_note:
        case.notes.append(gpu_note)
    case.request = _request(row, spec, gpus, setup, case.notes)
    return case


def _request(row: dict[str, str], spec: Any, gpus: str, setup: SourceSetup, notes: list[str]) -> dict[str, Any]:
    method = row["method"]
    plan: dict[str, Any] = dict(
        method=method,
        precision=row["precision"],
        optimizer=OPTIMIZERS[row["optimizer"]],
        micro_batch=int(row["micro_batch"]),
        grad_accum=int(row["grad_accum"] or 1),
        checkpointing=row["checkpointing"] or "none",
        attention=row["attention"] or "sdpa",
        sharding=row["sharding"] or "none",
        offload=row["offload"] or "none",
        fused_loss=setup.fused_loss or "chunked_CE=True" in row["notes"],
    )
    # the keys only where set: earlier runs' requests match
    if "activation_offloading=True" in row["notes"]:
        plan["offload_activations"] = True
    if "optimizer_in_bwd=True" in row["notes"]:
        plan["optimizer_in_backward"] = True
    if method in ("lora", "qlora"):
        plan["lora_rank"] = int(row["lora_rank"])
        targets = setup.lora_targets
        if "q,k,v,output_proj + MLP" in row["notes"] or "all layers" in row["notes"]:
            targets = "all-linear"
        plan["lora_targets"] = targets
        plan["lora_dropout"] = setup.lora_dropout
        if setup.lora_note:
            notes.append(setup.lora_note)
    if not row["attention"]:
        notes.append("attention not stated: sdpa")
    if setup.model_code != "transformers":
        notes.append(f"{setup.model_code}'s own model code, estimated as the transformers model")
    seq = int(row["seq_len"] or 0) or 64  # peft README seq2seq rows: short inputs
    return dict(spec=spec, gpus=gpus, seq_len=seq, plan=plan)


# -- estimating --------------------------------------------------------------------------
def estimate(case: Case, evaluator: str) -> dict[str, Any]:
    """The totals of ``evaluator`` for a case (run in a worker process)."""
    from autofit.errors import AutofitError
    from autofit.evaluators import evaluate
    from autofit.plan import Plan
    from autofit.search.request import build_cluster
    from autofit.specs import Target, Workload

    r = case.request
    t0 = time.perf_counter()
    try:
        plan = Plan(**r["plan"])
        cluster = build_cluster(r["gpus"])
        batch = plan.micro_batch * plan.grad_accum * cluster.world_size
        target = Target(r["spec"], cluster, Workload(seq_len=r["seq_len"], global_batch=batch), 0.0)
        result = evaluate(plan, target, evaluator)
    except AutofitError as e:
        return {"error": str(e).splitlines()[0]}
    if result.memory is None:
        return {"error": f"{result.status.value}: {result.reason}"}
    mem = result.memory.as_dict()
    return {
        **{k: mem[k] for k in ("peak_allocated", "peak_reserved", "device_total")},
        "components": {k: mem[k] for k in ("weights", "gradients", "optimizer", "activations", "temporary", "logits")},
        "capacity": result.capacity_bytes,
        "fits": result.fits,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def reuse(cases: list[Case], path: str) -> None:
    """Take the estimates of an earlier run's JSON for the rows it expressed the same way."""
    earlier = {r["id"]: r for r in json.loads(Path(path).read_text())["rows"]}
    for c in cases:
        old = earlier.get(c.id)
        if old and not c.out and old["request"] == json.loads(json.dumps(_jsonable(c.request))):
            c.predicted.update(old["predicted"])


def _run(args: tuple[Case, str]) -> tuple[int, str, dict[str, Any]]:
    case, evaluator = args
    return case.id, evaluator, estimate(case, evaluator)


def run_all(cases: list[Case], evaluators: list[str], jobs: int) -> None:
    todo = [(c, e) for e in evaluators for c in cases if not c.out and e not in c.predicted]
    by_id = {c.id: c for c in cases}
    done = 0
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            for cid, ev, pred in pool.map(_run, todo):
                by_id[cid].predicted[ev] = pred
                done += 1
                print(f"  [{done}/{len(todo)}] row {cid} {ev}", file=sys.stderr, flush=True)
    else:
        for item in todo:
            cid, ev, pred = _run(item)
            by_id[cid].predicted[ev] = pred
            done += 1
            print(f"  [{done}/{len(todo)}] row {cid} {ev}", file=sys.stderr, flush=True)


# -- the figures -------------------------------------------------------------------------
def error(case: Case, evaluator: str) -> float | None:
    """predicted / measured - 1 on the row's metric, or None (OOM row, failed estimate)."""
    p = case.predicted.get(evaluator, {})
    if case.oom or "error" in p or not p:
        return None
    return p[METRIC_TOTAL[case.metric]] / case.measured - 1


def margin(errors: list[float], cover: float = COVER) -> float:
    """The smallest m >= 0 with predicted × (1 + m) >= measured on ``cover`` of the rows."""
    needs = sorted(max(0.0, 1 / (1 + e) - 1) for e in errors)
    if not needs:
        return 0.0
    k = min(len(needs) - 1, max(0, int(-(-cover * len(needs) // 1)) - 1))
    return needs[k]


def figures(errors: list[float]) -> dict[str, Any]:
    if not errors:
        return {"rows": 0}
    return {
        "rows": len(errors),
        "median_abs_error": statistics.median(abs(e) for e in errors),
        "median_error": statistics.median(errors),
        "under_5pct": sum(e < -UNDER for e in errors) / len(errors),
        "margin_95": margin(errors),
    }


def report(cases: list[Case], evaluators: list[str]) -> tuple[list[str], dict[str, Any]]:
    lines, summary = [], {}
    sources = sorted({c.source for c in cases})
    lines += ["| source | evaluator | rows | median abs error | median error | under by >5% | 95% margin |"]
    lines += ["|---|---|---:|---:|---:|---:|---:|"]
    for ev in evaluators:
        for src in [*sources, "all"]:
            errs = [e for c in cases if src in ("all", c.source) and (e := error(c, ev)) is not None]
            f = figures(errs)
            summary[f"{ev}/{src}"] = f
            if f["rows"]:
                lines.append(
                    f"| {src} | {ev} | {f['rows']} | {f['median_abs_error']:.1%} | {f['median_error']:+.1%} "
                    f"| {f['under_5pct']:.0%} | {f['margin_95']:.1%} |"
                )
    lines += ["", "OOM rows (the run did not fit; autofit should say so):", ""]
    for c in (c for c in cases if c.oom and not c.out):
        said = ", ".join(f"{ev}: {'fits' if c.predicted[ev].get('fits') else 'does not fit'}" for ev in c.predicted)
        lines.append(f"- row {c.id} {c.model} {c.request['plan']['method']} on {c.request['gpus']}: {said}")
    return lines, summary


def row_table(cases: list[Case], evaluators: list[str]) -> list[str]:
    head = "| row | source | model | plan | metric | measured GiB | " + " | ".join(f"{e} GiB (err)" for e in evaluators)
    lines = [head + " | notes |", "|" + "---|" * (7 + len(evaluators))]
    for c in cases:
        if c.out:
            continue
        p = c.request["plan"]
        desc = f"{p['method']} mb{p['micro_batch']} s{c.request['seq_len']} {p['checkpointing']} {p['sharding']}"
        cells = []
        for ev in evaluators:
            pr = c.predicted.get(ev, {})
            if "error" in pr:
                cells.append(f"error: {pr['error'][:60]}")
            elif pr:
                e = error(c, ev)
                cells.append(f"{pr[METRIC_TOTAL[c.metric]] / GiB:.2f} ({e:+.0%})" if e is not None else "oom row")
            else:
                cells.append("–")
        measured = "OOM" if c.oom else f"{c.measured / GiB:.2f}"
        lines.append(
            f"| {c.id} | {c.source} | {c.model} | {desc} | {c.metric} | {measured} | "
            + " | ".join(cells)
            + f" | {'; '.join(c.notes)} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--evaluators", default="analytic,simulated")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--rows", default="", help="comma-separated row ids (default: every memory or throughput row)")
    ap.add_argument("--out", default="", help="write the markdown report here (and FILE.json beside it)")
    ap.add_argument(
        "--reuse",
        action="append",
        default=[],
        help="a FILE.json of an earlier run: its estimates are taken as they are (repeatable)",
    )
    ap.add_argument(
        "--write-evidence",
        action="store_true",
        help="store the 95%% fit margins and the allocator fragmentation in autofit/evaluators/evidence.json",
    )
    ap.add_argument(
        "--throughput",
        action="store_true",
        help="compare tokens/s instead of memory (every throughput row; analytic, and simulated on --rows)",
    )
    ap.add_argument(
        "--fit", action="store_true", help="with --throughput: fit the time model's rates, and leave one source out"
    )
    ap.add_argument(
        "--write-params",
        action="store_true",
        help="with --fit: store the fitted rates in autofit/evaluators/time_model.json",
    )
    args = ap.parse_args()
    evaluators = [e for e in args.evaluators.split(",") if e]
    rows = list(csv.DictReader(open(CSV, encoding="utf-8")))
    if args.throughput:
        speed_main(args, rows, evaluators)
        return
    wanted = {int(x) for x in args.rows.split(",") if x}
    cases = [c for r in rows if (c := to_case(r)) is not None and (not wanted or c.id in wanted)]
    for path in args.reuse:
        reuse(cases, path)
    t0 = time.perf_counter()
    run_all(cases, evaluators, args.jobs)
    took = time.perf_counter() - t0
    lines, summary = report(cases, evaluators)
    out_rows = [c for c in cases if c.out]
    text = [
        f"# Published runs vs autofit ({time.strftime('%Y-%m-%d')})",
        "",
        f"`python benchmarks/published_runs.py --evaluators {','.join(evaluators)}`: {len(cases)} memory rows, "
        f"{len(cases) - len(out_rows)} expressed, {len(out_rows)} out; {took:.0f} s on {os.cpu_count()} cores.",
        *(f"Estimates taken as they were from an earlier run: {p}." for p in args.reuse),
        "error = predicted / measured - 1 on the row's metric (A allocated, R reserved, N nvidia-smi).",
        "",
        *lines,
        *_out_and_every_row(out_rows, row_table(cases, evaluators)),
    ]
    _write(text, args.out, summary, [{**dataclasses.asdict(c), "request": _jsonable(c.request)} for c in cases])
    if args.write_evidence:
        write_evidence(cases, summary, evaluators)


# -- throughput ----------------------------------------------------------------------------
def _speed_simulated(case) -> tuple[int, Any]:
    """The simulated evaluator's work for a throughput case: its traced step's ops with the
    engine's collectives (run in a worker process; priced in the parent under any rates)."""
    from autofit.evaluators import simulated

    try:
        plan, target = speed.build(case, GPU_NAMES)
        trace = simulated.run_trace(target.model, plan, target.workload, simulated.TraceDevice.of(target.cluster.gpu))
        return case.id, simulated.step_work(trace, plan, target)
    except Exception as e:  # noqa: BLE001 - a row that cannot be traced is reported as such
        return case.id, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def speed_main(args, rows: list[dict[str, str]], evaluators: list[str]) -> None:
    """Predicted tokens/s against every throughput row; with --fit, the rates fitted on all
    rows and leaving each source out (``benchmarks/_throughput.py``)."""
    from autofit.evaluators import analytic
    from autofit.evaluators.timing import default_params

    wanted = {int(x) for x in args.rows.split(",") if x}
    cases = [c for r in rows if (c := speed.to_speed_case(r, _model, OPTIMIZERS, SOURCE_SETUP)) is not None]
    live = [c for c in cases if not c.out]
    clusters = {}
    for c in live:
        plan, target = speed.build(c, GPU_NAMES)
        c.work = analytic.work(plan, target)
        if c.kernel:
            c.work = dataclasses.replace(c.work, attention_kernel=c.kernel)
        clusters[c.id] = target.cluster
    params = default_params()
    by_id = {c.id: c for c in live}
    for cid, pred in speed.predict(live, params, clusters).items():
        by_id[cid].predicted["analytic"] = pred
    sim_cases = [c for c in live if c.id in wanted] if "simulated" in evaluators else []
    sim_work: dict[int, Any] = {}
    t0 = time.perf_counter()
    if sim_cases:
        with ProcessPoolExecutor(args.jobs) as pool:
            for i, (cid, work) in enumerate(pool.map(_speed_simulated, sim_cases), 1):
                case = by_id[cid]
                if isinstance(work, str):
                    case.notes.append(f"simulated: {work}")
                else:
                    if case.kernel:
                        work = dataclasses.replace(work, attention_kernel=case.kernel)
                    sim_work[cid] = work
                print(f"  [{i}/{len(sim_cases)}] row {cid} simulated", file=sys.stderr, flush=True)
        sim_cases = [c for c in sim_cases if c.id in sim_work]
        for cid, pred in speed.predict(sim_cases, params, clusters, sim_work).items():
            by_id[cid].predicted["simulated"] = pred
    took = time.perf_counter() - t0
    sources = sorted({c.source for c in live})
    summary: dict[str, Any] = {}
    lines = [
        "| source | evaluator | rows | median abs error | median error | within ×0.67–×1.5 | pairs | order right "
        "| ratio error, same seq |"
    ]
    lines += ["|---|---|---:|---:|---:|---:|---:|---:|---:|"]

    def _pct(x) -> str:
        return f"{x:.0%}" if x is not None else "–"

    def add(label: str, ev: str, sub: list, predicted: dict[int, float] | None = None) -> None:
        f = speed.speed_figures(sub, ev, predicted)
        summary[f"{ev}/{label}"] = f
        if f["rows"]:
            lines.append(
                f"| {label} | {ev} | {f['rows']} | {f['median_abs_error']:.1%} | {f['median_error']:+.1%} "
                f"| {f['within']:.0%} | {f['pairs']} | {_pct(f['pairwise'])} | {_pct(f['pair_ratio_error'])} |"
            )

    for ev in ["analytic", *(["simulated"] if sim_cases else [])]:
        pool_ = live if ev == "analytic" else sim_cases
        for src in [*sources, "all"]:
            add(src, ev, [c for c in pool_ if src in ("all", c.source)])
    fit_lines: list[str] = []
    if args.fit:
        fitted, names, fval = speed.fit(live, speed.priors(), clusters, GPU_NAMES)
        all_fit = speed.predict(live, fitted, clusters)
        loso: dict[int, float] = {}
        for src in sources:
            train = [c for c in live if c.source != src]
            held = [c for c in live if c.source == src]
            p_src, _, _ = speed.fit(train, speed.priors(), clusters, GPU_NAMES)
            loso.update(speed.predict(held, p_src, clusters))
            print(f"  left out {src}", file=sys.stderr, flush=True)
        for src in [*sources, "all"]:
            sub = [c for c in live if src in ("all", c.source)]
            add(src, "analytic, fitted", sub, all_fit)
            f = speed.speed_figures(sub, "x", loso)
            summary[f"loso/{src}"] = f
            lines.append(
                f"| {src} | analytic, fitted without {'its source' if src != 'all' else 'each row’s source'} "
                f"| {f['rows']} | {f['median_abs_error']:.1%} | {f['median_error']:+.1%} | {f['within']:.0%} "
                f"| {f['pairs']} | {_pct(f['pairwise'])} | {_pct(f['pair_ratio_error'])} |"
            )
        for c in live:
            c.predicted["fitted"] = all_fit[c.id]
            c.predicted["loso"] = loso[c.id]
        if sim_cases:  # the simulator's work under the rates fitted on the analytic work
            sim_fit = speed.predict(sim_cases, fitted, clusters, sim_work)
            for c in sim_cases:
                c.predicted["simulated, fitted"] = sim_fit[c.id]
            add("all", "simulated, fitted", sim_cases, sim_fit)
            add("all", "analytic, fitted (same rows)", sim_cases, all_fit)
        fit_lines = ["", "## Fitted rates", "", "| rate | prior | fitted |", "|---|---:|---:|"]
        fit_lines += [f"| {n} | {speed._get(speed.priors(), n):.4g} | {speed._get(fitted, n):.4g} |" for n in names]
        fit_lines += ["", f"Loss (mean over sources of the mean |log(pred/measured)|): {fval:.4f}."]
        if args.write_params:
            write_params(fitted, names, summary, len(live))
    out_rows = [c for c in cases if c.out]
    text = [
        f"# Published runs vs autofit: throughput ({time.strftime('%Y-%m-%d')})",
        "",
        f"`python benchmarks/published_runs.py {_command_line()}`: "
        f"{len(cases)} throughput rows, {len(live)} expressed, {len(out_rows)} out"
        + (f"; simulated on {len(sim_cases)} rows in {took:.0f} s on {os.cpu_count()} cores" if sim_cases else "")
        + ".",
        "error = predicted / measured - 1 in the row's unit (tokens/s per GPU, or samples/s). Order: for every two",
        "rows of the same model, GPU type and unit whose measured figures differ by more than 2%, is the faster",
        "predicted faster? 'analytic' and 'simulated' price their work at time_model.json as it stood when the",
        "run started; 'fitted' at the rates this run fitted from the priors (on every row, or without the row's",
        "source); the simulated rows are those of --rows.",
        "",
        *lines,
        *fit_lines,
        *_out_and_every_row(out_rows, speed_row_table(live)),
    ]
    dump = [
        {
            "id": c.id,
            "source": c.source,
            "model": c.model,
            "gpus": c.gpus,
            "unit": c.unit,
            "measured": c.measured,
            "predicted": c.predicted,
            "notes": c.notes,
            "out": c.out,
            "request": {**c.request, "spec": c.request["spec"].name} if c.request else {},
        }
        for c in cases
    ]
    _write(text, args.out, summary, dump)


def _command_line() -> str:
    """This run's arguments, a --rows list shortened."""
    args = sys.argv[1:]
    return " ".join("<ids>" if i and args[i - 1] == "--rows" else a for i, a in enumerate(args))


def _out_and_every_row(out_rows: list, table: list[str]) -> list[str]:
    """The report's tail: the rows autofit cannot express, with why, then every row."""
    return [
        "",
        "## Rows autofit cannot express",
        "",
        *[f"- row {c.id} ({c.source}, {c.model}): {c.out}" for c in out_rows],
        "",
        "## Every row",
        "",
        *table,
    ]


def _write(text: list[str], out: str, summary: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Print the report; with ``out``, write it there and its figures and rows beside it (FILE.json)."""
    print("\n".join(text))
    if out:
        Path(out).write_text("\n".join(text) + "\n")
        Path(out).with_suffix(".json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


def speed_row_table(cases) -> list[str]:
    evs = ["analytic", "simulated", "fitted", "simulated, fitted", "loso"]
    shown = [e for e in evs if any(e in c.predicted for c in cases)]
    lines = ["| row | source | model | GPUs | plan | measured | " + " | ".join(shown) + " | notes |"]
    lines.append("|" + "---|" * (7 + len(shown)))
    for c in cases:
        p = c.request["plan"]
        desc = f"{p['method']} mb{p['micro_batch']}×ga{p['grad_accum']} s{c.request['seq_len']} {p['checkpointing']} {p['sharding']} {p['attention']}"
        cells = [
            f"{c.predicted[e]:.4g} ({c.predicted[e] / c.measured - 1:+.0%})" if e in c.predicted else "–" for e in shown
        ]
        lines.append(
            f"| {c.id} | {c.source} | {c.model} | {c.gpus} | {desc} | {c.measured:g} {c.unit} | "
            + " | ".join(cells)
            + f" | {'; '.join(c.notes)} |"
        )
    return lines


def _rounded(d: dict[str, Any]) -> dict[str, Any]:
    """Floats to 4 significant digits (a fit is not more precise than that)."""
    return {
        k: (_rounded(v) if isinstance(v, dict) else float(f"{v:.4g}") if isinstance(v, float) else v)
        for k, v in d.items()
    }


def write_params(fitted, names: list[str], summary: dict[str, Any], rows: int) -> None:
    """Store the fitted rates and their provenance in ``autofit/evaluators/time_model.json``."""
    path = ROOT / "autofit" / "evaluators" / "time_model.json"
    data = _rounded(fitted.as_dict())
    loso, fit_all = summary["loso/all"], summary["analytic, fitted/all"]
    data["provenance"] = {
        "source": "benchmarks/published_runs.py --throughput --fit --write-params over "
        "../shared/reference-runs/published_runs.csv",
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
        "fitted": names,
        "priors": "every other rate: no published row constrains it (docs/EVALUATORS.md, 'The time model')",
        "fitted_on_all": _rounded(
            {k: fit_all[k] for k in ("median_abs_error", "within", "pairwise", "pair_ratio_error")}
        ),
        "leave_one_source_out": _rounded(
            {k: loso[k] for k in ("median_abs_error", "within", "pairwise", "pair_ratio_error")}
        ),
        # two plans whose predictions are closer than this are a tie (timing.time_error): the
        # median error of the predicted ratio of two rows of one model, GPU type and sequence
        # length, under rates fitted without their source
        "error": {"analytic": round(loso["pair_ratio_error"], 4), "simulated": round(loso["pair_ratio_error"], 4)},
    }
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)


def _jsonable(request: dict[str, Any]) -> dict[str, Any]:
    if not request:
        return {}
    return {**request, "spec": request["spec"].name}


def write_evidence(cases: list[Case], summary: dict[str, Any], evaluators: list[str]) -> None:
    """Store the fit margins and the allocator's fragmentation in ``autofit/evaluators/evidence.json``.

    ``fit_margin[evaluator]``: the 95% margin over every compared row. ``allocator_fragmentation``:
    the median (reserved - allocated) / allocated of the simulator's allocator replays over the
    expressed rows (what the analytic evaluator, which has no allocation sequence, takes).
    """
    path = ROOT / "autofit" / "evaluators" / "evidence.json"
    data = json.loads(path.read_text())
    today = time.strftime("%Y-%m-%d")
    source = "benchmarks/published_runs.py --write-evidence over ../shared/reference-runs/published_runs.csv"
    for ev in evaluators:
        f = summary[f"{ev}/all"]
        data["fit_margin"][ev] = {
            "margin": round(f["margin_95"], 4),
            "cover": COVER,
            "rows": f["rows"],
            "median_abs_error": round(f["median_abs_error"], 4),
            "under_5pct": round(f["under_5pct"], 4),
            "source": source,
            "date": today,
        }
    if "simulated" in evaluators:
        gaps = [
            p["peak_reserved"] / p["peak_allocated"] - 1
            for c in cases
            if (p := c.predicted.get("simulated")) and "error" not in p and p.get("peak_allocated")
        ]
        data["allocator_fragmentation"] = {
            "value": round(statistics.median(gaps), 4),
            "rows": len(gaps),
            "p90": round(sorted(gaps)[int(0.9 * (len(gaps) - 1))], 4),
            "source": source + " (simulated allocator replays)",
            "date": today,
        }
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()

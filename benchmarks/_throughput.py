"""Throughput rows of the published runs: predicted tokens/s against measured, the fit of
the time model's rates, and leave-one-source-out (``published_runs.py --throughput``).

Every row with a throughput becomes a :class:`SpeedCase`: a target, a plan, and what the
row's unit counts (tokens/s per GPU, samples/s per GPU or in total). The analytic
evaluator's :func:`autofit.evaluators.analytic.work` gives each case's work once; pricing it
under other rates (``timing.step_time``) takes microseconds, so the rates are fitted over
every row at once (scipy's Powell on log-rates, minimizing the mean |log(pred/measured)|),
and again leaving each source out to show what the fit does on runs it has not seen.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

from autofit.specs import LengthDistribution, ModelSpec

# -- what each source's throughput is ------------------------------------------------------
LOW, HIGH = 0.67, 1.5  # "within ×0.67–×1.5"
TIE = 0.02  # two measured rows closer than this are not ordered


def _gpt2_like(name: str, d: int, layers: int, heads: int, vocab: int, positions: int) -> ModelSpec:
    """A GPT-style block (learned positions, LayerNorm, GELU MLP 4×, tied head) as autofit's
    gpt2 family: MPT's and the FlashAttention repo's GPT-3 shapes. The parameter count matches
    llm-foundry's NumParams to the parameter (MPT-7b at 2048: 6,658,859,008)."""
    return ModelSpec(
        name=name,
        model_type="gpt2",
        hidden_size=d,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=d // heads,
        intermediate_size=4 * d,
        vocab_size=vocab,
        max_position_embeddings=positions,
        tie_word_embeddings=True,
    )


# d_model, n_layers, n_heads (the notes of each row; scripts/train/yamls/pretrain/mpt-*.yaml)
MPT = {
    "MPT-125m": (768, 12, 12),
    "MPT-350m": (1024, 24, 16),
    "MPT-760m": (1536, 24, 12),
    "MPT-1b": (2048, 24, 16),
    "MPT-3b": (2560, 32, 20),
    "MPT-7b": (4096, 32, 32),
    "MPT-13b": (5120, 40, 40),
    "MPT-30b": (7168, 48, 56),
    "MPT-70b": (8192, 80, 64),
}
# flash-attention training/configs/experiment/pile/gpt3*-flash.yaml (2.7B: head dim 128)
GPT3 = {
    "gpt3-125m": (768, 12, 12),
    "gpt3-355m": (1024, 24, 16),
    "gpt3-760m": (1536, 24, 16),
    "gpt3-1.3b": (2048, 24, 16),
    "gpt3-2.7b": (2560, 32, 20),
}

# A node's fabric, GB/s one way, where a row spans nodes of 8 GPUs: the DGX reference
# designs, one 200 Gb/s HDR NIC per A100 and one 400 Gb/s NDR NIC per H100
# (specs.cluster.DEFAULT_INTER_NODE_GBPS says why the node's total is what a ring reaches).
FABRIC_GBPS = {"A100-40GB": 200.0, "A100-80GB": 200.0, "H100-80GB": 400.0}
GPUS_PER_NODE = 8

# Sequence lengths of the datasets behind samples/s rows, as log-normal distributions of
# the tokens a sample has. ms-swift's table states the dataset's mean, spread and range in
# Qwen tokens (cls-fudan-news-zh: 3234 ± 2547, 91..19548) and drops samples over
# max_length; LitGPT's Alpaca has a median of about 110 tokens and its longest sample is
# the row's seq_len (1044 phi, 1304 Llama tokens) among 52,002 samples.
SWIFT_LENGTHS = (3234.0, 2547.0, 91, 19548)
ALPACA_MEDIAN, ALPACA_SAMPLES = 110.0, 52_002


def lognormal_lengths(mu: float, sigma: float, lo: int, hi: int, n: int = 4000) -> list[int]:
    """``n`` quantiles of a log-normal length distribution clipped to ``lo..hi``."""
    z = NormalDist()
    return [min(hi, max(lo, round(math.exp(mu + sigma * z.inv_cdf((i + 0.5) / n))))) for i in range(n)]


def swift_lengths(max_length: int) -> LengthDistribution:
    mean, sd, lo, hi = SWIFT_LENGTHS
    s2 = math.log(1 + (sd / mean) ** 2)
    lengths = lognormal_lengths(math.log(mean) - s2 / 2, math.sqrt(s2), lo, hi)
    kept = [n for n in lengths if n <= max_length]  # truncation_strategy='delete'
    return LengthDistribution.from_lengths(kept, "ms-swift cls-fudan-news-zh (log-normal of its stated mean and sd)")


def alpaca_lengths(longest: int) -> LengthDistribution:
    z_max = NormalDist().inv_cdf(1 - 1 / ALPACA_SAMPLES)
    sigma = math.log(longest / ALPACA_MEDIAN) / z_max
    lengths = lognormal_lengths(math.log(ALPACA_MEDIAN), sigma, 1, longest)
    return LengthDistribution.from_lengths(lengths, "Alpaca (log-normal: median 110 tokens, longest = seq_len)")


@dataclass
class SpeedCase:
    """One throughput row, as autofit sees it."""

    id: int
    source: str
    model: str
    gpus: str
    measured: float  # in the row's unit
    unit: str  # tokens/s/GPU | samples/s/GPU | samples/s
    request: dict[str, Any]
    tokens_per_sample: float = 0.0  # the row length a sample occupies (samples/s rows)
    kernel: str = ""  # an attention kernel autofit's plans do not run (its rate is the benchmark's)
    seq: int = 0  # the published sequence length (rows of one workload share it)
    notes: list[str] = field(default_factory=list)
    out: str = ""
    work: Any = None  # timing.StepWork (analytic)
    predicted: dict[str, float] = field(default_factory=dict)  # evaluator -> in the row's unit

    @property
    def key(self) -> tuple[str, str]:
        """Rows the pairwise order compares: same model, same GPU type."""
        return self.model, self.gpus.partition("x")[2]


def speed_out(row: dict[str, str]) -> str:
    """Why a throughput row ran something autofit has no time model for, or ""."""
    notes, source = row["notes"], row["source"]
    if source == "nemo-performance-summary":
        return "FP8 (TransformerEngine) with Megatron tensor/pipeline/context parallelism: no autofit plan"
    m = _re_search(r"sequence parallel size (\d+)", notes)
    if m and int(m) > 1:
        return f"XTuner sequence parallelism over {m} GPUs: no autofit plan"
    if "compile=True" in notes or "torch.compile on" in notes:
        return "torch.compile of the model: autofit prices eager kernels (compiled blocks are issue 17's)"
    if "optimizer_in_bwd=True" in notes or "activation_offloading=True" in notes:
        return "torchtune optimizer-in-backward / activation offloading: no autofit plan"
    if source == "torchtune-readme" and "packed=False" in notes:
        return "unpacked batches of a dataset whose lengths the source does not give"
    if source == "ms-swift-benchmark" and row["gpus"].startswith("2x"):
        return "ms-swift's device_map split over 2 GPUs (naive model parallelism): not a plan autofit has"
    if source == "ms-swift-benchmark" and "(gptq)" in notes:
        return "LoRA on a GPTQ-quantized base: autofit has no GPTQ kernels"
    return ""


def _re_search(pattern: str, text: str) -> str | None:
    import re

    m = re.search(pattern, text)
    return m.group(1) if m else None


def to_speed_case(row: dict[str, str], model_of, optimizers: dict[str, str], setups: dict) -> SpeedCase | None:
    """The case of a throughput row (None for a memory-only row). ``model_of``: the memory
    benchmark's row -> (ModelSpec, note); ``optimizers`` and ``setups`` its tables."""
    if not row["throughput"].strip():
        return None
    unit = row["throughput_unit"]
    unit = "tokens/s/GPU" if unit.startswith("tokens/s/GPU") else unit.replace(" (derived)", "").replace(" (total)", "")
    count, _, gpu = row["gpus"].partition("x")
    case = SpeedCase(
        id=int(row["id"]),
        source=row["source"],
        model=row["model"],
        gpus=row["gpus"],
        measured=float(row["throughput"]),
        unit=unit,
        request={},
        seq=int(row["seq_len"] or 0),
    )
    case.out = speed_out(row)
    if case.out:
        return case
    seq = int(row["seq_len"])
    name = row["model"]
    if name in MPT or name in GPT3:
        d, layers, heads = MPT.get(name) or GPT3[name]
        vocab = 50368 if name in MPT else 50257
        spec = _gpt2_like(name, d, layers, heads, vocab, seq)
        case.notes.append("as a gpt2-family block of its shape")
    else:
        spec, note = model_of(row)
        if spec is None:
            case.out = note
            return case
        if note:
            case.notes.append(note)
    setup = setups.get(row["source"])
    mb, ga = int(row["micro_batch"]), int(row["grad_accum"] or 1)
    world = int(count)
    sharding = row["sharding"] or ""
    attention = row["attention"] or ""
    method = row["method"]
    fused_loss = False
    if row["source"] == "llm-foundry-benchmarks":
        attention = "flash2"
        case.kernel = "triton"
        case.notes.append("llm-foundry's Triton FlashAttention, a kernel of its own (rate 'triton')")
        if sharding == "zero2":
            case.notes.append("FSDP SHARD_GRAD_OP as ZeRO-2")
    elif row["source"] == "flash-attention-training":
        attention, fused_loss = "flash2", True
        sharding = "zero1" if sharding == "zero1" else "none"
        case.notes.append("FlashAttention v1 with fused MLP/LN/CE priced as flash with a fused loss")
    elif row["source"] == "xtuner-speed-benchmark":
        sharding = "zero3"
        case.notes.append("ZeRO stage not stated: ZeRO-3")
    elif row["source"] == "litgpt-resource-tables":
        fused_loss = True  # chunked head + loss
    if sharding == "ddp":
        sharding = "none"
    plan: dict[str, Any] = dict(
        method=method,
        precision=row["precision"] or "bf16-mixed",
        optimizer=optimizers.get(row["optimizer"], "adamw"),
        micro_batch=mb,
        grad_accum=ga,
        checkpointing=row["checkpointing"] or "none",
        attention=attention or "sdpa",
        sharding=sharding or "none",
        offload=row["offload"] or "none",
        fused_loss=fused_loss,
    )
    if not row["precision"]:
        case.notes.append("precision not stated: bf16-mixed")
    if method in ("lora", "qlora"):
        plan["lora_rank"] = int(row["lora_rank"] or 8)
        plan["lora_targets"] = getattr(setup, "lora_targets", "attention")
        plan["lora_dropout"] = getattr(setup, "lora_dropout", 0.0)
    # the tokens a step computes: samples/s rows padded to the longest of a micro-batch
    row_len = float(seq)
    if row["source"] == "ms-swift-benchmark":
        dist = swift_lengths(seq)
        row_len = dist.expected_max(mb)
        case.notes.append(f"samples of ≤{seq} Qwen tokens kept (mean {dist.mean:.0f}); a micro-batch row {row_len:.0f}")
    elif row["source"] == "litgpt-resource-tables":
        dist = alpaca_lengths(seq)
        row_len = dist.expected_max(mb)
        case.notes.append(f"Alpaca samples (mean {dist.mean:.0f} tokens); a micro-batch row {row_len:.0f}")
    case.tokens_per_sample = row_len
    nodes = 1
    if world > GPUS_PER_NODE:
        nodes, world = world // GPUS_PER_NODE, GPUS_PER_NODE
        case.notes.append(f"{nodes} nodes of 8 with {FABRIC_GBPS.get(gpu, 25.0):g} GB/s of fabric each")
    case.request = dict(
        spec=spec,
        gpu=gpu,
        gpus_per_node=world,
        nodes=nodes,
        seq_len=max(1, round(row_len)),
        plan=plan,
    )
    return case


def build(case: SpeedCase, gpu_names: dict[str, str]):
    """(plan, target) of a case."""
    from autofit.plan import Plan
    from autofit.specs import ClusterSpec, Target, Workload, resolve_gpu

    r = case.request
    plan = Plan(**r["plan"])
    gpu = resolve_gpu(gpu_names.get(r["gpu"], r["gpu"]))
    cluster = ClusterSpec(
        gpu=gpu,
        gpus_per_node=r["gpus_per_node"],
        nodes=r["nodes"],
        inter_node_gbps=FABRIC_GBPS.get(r["gpu"], 25.0),
    )
    batch = plan.micro_batch * plan.grad_accum * cluster.world_size
    return plan, Target(r["spec"], cluster, Workload(seq_len=r["seq_len"], global_batch=batch), 0.0)


def in_unit(case: SpeedCase, tokens_per_sec: float, world: int) -> float:
    """A cluster's predicted tokens/s in the row's unit."""
    if case.unit == "tokens/s/GPU":
        return tokens_per_sec / world
    samples = tokens_per_sec / case.tokens_per_sample
    return samples / world if case.unit.endswith("/GPU") else samples


# -- figures -------------------------------------------------------------------------------
def ratio(case: SpeedCase, evaluator: str) -> float | None:
    p = case.predicted.get(evaluator)
    return p / case.measured if p else None


def speed_figures(cases: list[SpeedCase], evaluator: str, predicted: dict[int, float] | None = None) -> dict[str, Any]:
    """Median |pred/measured - 1|, the share within ×0.67–×1.5, the median error, the
    pairwise order (rows of the same model and GPU type whose measured figures differ by
    more than ``TIE``: is the faster one predicted faster?) and the median error of the
    predicted ratio of two such rows of one sequence length."""
    preds = {c.id: (predicted or {}).get(c.id) or c.predicted.get(evaluator) for c in cases}
    rs = [preds[c.id] / c.measured for c in cases if preds[c.id]]
    if not rs:
        return {"rows": 0}
    right = total = 0
    ratio_errors = []
    groups: dict[tuple[str, str], list[SpeedCase]] = {}
    for c in cases:
        if preds[c.id]:
            groups.setdefault(c.key + (c.unit,), []).append(c)
    for group in groups.values():
        for i, a in enumerate(group):
            for b in group[i + 1 :]:
                if abs(a.measured / b.measured - 1) <= TIE:
                    continue
                total += 1
                right += (a.measured > b.measured) == (preds[a.id] > preds[b.id])
                if a.seq == b.seq:  # one workload, other techniques: what a search compares
                    ratio_errors.append(abs((preds[a.id] / preds[b.id]) / (a.measured / b.measured) - 1))
    return {
        "rows": len(rs),
        "median_abs_error": statistics.median(abs(r - 1) for r in rs),
        "median_error": statistics.median(r - 1 for r in rs),
        "within": sum(LOW <= r <= HIGH for r in rs) / len(rs),
        "pairs": total,
        "pairwise": right / total if total else None,
        # how far the predicted ratio of two such rows of one sequence length is off: what
        # decides a ranking of plans for one workload
        "pair_ratio_error": statistics.median(ratio_errors) if ratio_errors else None,
    }


# -- fitting -------------------------------------------------------------------------------
# The rates fitted, with the range a physical GPU, link or host can have (a fit that ends
# on a bound says the data pull beyond what the mechanism can mean). The rest keep
# time_model.json's priors. A generation's GEMM efficiency and an attention kernel's
# share are fitted only where rows run them.
FREE = {
    "gemm_efficiency.ampere": (0.4, 0.9),
    "gemm_efficiency.hopper": (0.3, 0.9),
    "gemm_half_dim": (32.0, 1024.0),
    "attention_efficiency.flash": (0.2, 0.8),
    "attention_efficiency.flash@hopper": (0.1, 0.8),
    "attention_efficiency.triton": (0.1, 0.8),
    "attention_efficiency.triton@hopper": (0.1, 0.8),
    "attention_efficiency.efficient": (0.1, 0.7),
    "attention_efficiency.eager": (0.05, 0.6),
    "memory_efficiency": (0.5, 0.9),
    "host_op_s": (3e-6, 5e-5),
    "step_overhead_s": (1e-3, 0.5),
    "comm_overlap": (0.2, 1.0),
    "link_efficiency": (0.4, 0.95),
    "collective_latency_s": (5e-6, 2e-4),
}


# Where every fit starts, and what a rate no published row constrains keeps: datasheet-level
# figures (a large bf16 GEMM reaches ~70% of the dense peak on A100 and less of H100's;
# FlashAttention-2 ~50% forward+backward on A100, ~35% on H100 (Dao 2023); HBM streaming
# ~75%; NCCL ~70% of a link; ~15 µs of host time per eager op), never an earlier fit's result.
PRIORS = {
    "gemm_efficiency": {"volta": 0.6, "turing": 0.6, "ampere": 0.72, "ada": 0.72, "hopper": 0.65, "blackwell": 0.65},
    "gemm_half_dim": 160.0,
    "attention_efficiency": {
        "flash": 0.5,
        "flash@hopper": 0.35,
        "triton": 0.5,
        "triton@hopper": 0.35,
        "efficient": 0.35,
        "math": 0.25,
        "eager": 0.25,
    },
    "memory_efficiency": 0.75,
    "host_op_s": 1.5e-5,
    "kernel_gap_s": 1.5e-6,
    "step_overhead_s": 0.01,
    "link_efficiency": 0.7,
    "comm_overlap": 0.6,
    "collective_latency_s": 2e-5,
    "cpu_adam_params_per_s": 2e9,
    "nvme_gbps": 3.0,
}


def priors():
    from autofit.evaluators.timing import TimeParams

    return TimeParams.from_dict(PRIORS)


def _set(params, name: str, value: float):
    head, _, key = name.partition(".")
    if key:
        return params.with_values(**{head: {**getattr(params, head), key: value}})
    return params.with_values(**{head: value})


def _get(params, name: str) -> float:
    head, _, key = name.partition(".")
    return getattr(params, head)[key] if key else getattr(params, head)


def _constrained(cases: list[SpeedCase], gpu_names: dict[str, str]) -> list[str]:
    """The free rates some case exercises: a GPU generation's GEMMs, an attention kernel
    (on a generation, for a ``kernel@generation`` rate)."""
    from autofit.evaluators.timing import generation
    from autofit.specs import resolve_gpu

    ran = {
        (
            c.work.attention_kernel,
            generation(resolve_gpu(gpu_names.get(c.request["gpu"], c.request["gpu"])).compute_capability),
        )
        for c in cases
    }
    out = []
    for name in FREE:
        head, _, key = name.partition(".")
        if head == "gemm_efficiency" and key not in {g for _, g in ran}:
            continue
        kernel, _, gen = key.partition("@")
        if head == "attention_efficiency" and not any(k == kernel and (not gen or g == gen) for k, g in ran):
            continue
        out.append(name)
    return out


def predict(
    cases: list[SpeedCase], params, clusters: dict[int, Any], works: dict[int, Any] | None = None
) -> dict[int, float]:
    """Each case's prediction in its unit under ``params`` (its analytic work, or ``works``')."""
    from autofit.evaluators.timing import step_time

    out = {}
    for c in cases:
        cl = clusters[c.id]
        t = step_time((works or {}).get(c.id, c.work), cl, params)
        tokens = (
            c.request["plan"]["micro_batch"] * c.request["plan"]["grad_accum"] * cl.world_size * c.request["seq_len"]
        )
        out[c.id] = in_unit(c, tokens / t.step_s, cl.world_size)
    return out


def loss(cases: list[SpeedCase], params, clusters) -> float:
    """What the fit minimizes: per source, the mean |log(pred/measured)| plus the mean
    |log(pred_a/pred_b) - log(measured_a/measured_b)| over its pairs of rows of one model and
    GPU type (the ratios a ranking reads), averaged over the sources, so that llm-foundry's
    200 rows do not decide every rate."""
    preds = predict(cases, params, clusters)
    level: dict[str, list[float]] = {}
    groups: dict[tuple, list[SpeedCase]] = {}
    for c in cases:
        level.setdefault(c.source, []).append(abs(math.log(preds[c.id] / c.measured)))
        groups.setdefault((c.source, *c.key, c.unit), []).append(c)
    pairs: dict[str, list[float]] = {}
    for (source, *_), group in groups.items():
        for i, a in enumerate(group):
            for b in group[i + 1 :]:
                d = math.log(preds[a.id] / preds[b.id]) - math.log(a.measured / b.measured)
                pairs.setdefault(source, []).append(abs(d))
    return statistics.fmean(
        statistics.fmean(v) + (statistics.fmean(pairs[src]) if src in pairs else 0.0) for src, v in level.items()
    )


def fit(cases: list[SpeedCase], start, clusters, gpu_names: dict[str, str]):
    """The free rates minimizing :func:`loss` over ``cases`` (scipy Powell in log space)."""
    try:
        from scipy.optimize import minimize
    except ImportError as e:  # pragma: no cover - the bench extra
        raise SystemExit("--fit needs scipy: pip install -e '.[bench]'") from e
    names = _constrained(cases, gpu_names)
    lo = [math.log(FREE[n][0]) for n in names]
    hi = [math.log(FREE[n][1]) for n in names]

    def params_of(x):
        p = start
        for n, v, a, b in zip(names, x, lo, hi):
            p = _set(p, n, math.exp(min(b, max(a, v))))
        return p

    x0 = [min(b, max(a, math.log(max(_get(start, n), 1e-9)))) for n, a, b in zip(names, lo, hi)]
    res = minimize(
        lambda x: loss(cases, params_of(x), clusters),
        x0,
        method="Powell",
        bounds=list(zip(lo, hi)),
        options={"maxiter": 20, "xtol": 1e-3, "ftol": 1e-5},
    )
    return params_of(res.x), names, float(res.fun)

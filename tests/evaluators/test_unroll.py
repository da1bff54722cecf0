"""The unrolled trace is the full trace: event by event, for every family and a grid of plans.

``run_trace`` traces 3 periods of decoder layers and unrolls the step to all of them
(autofit.evaluators.unroll). Here each case is traced both ways and compared:

- the storage log: the same sizes in the same order, each free freeing the storage made by
  the same allocation, each storage of the same component;
- the phase marks, the op rows (as multisets), the peak and its components, the
  parameter counts, and the rank's anatomy on a CUDA target (allocator replay included).

One reordering is allowed (``unroll.canonical``): frees that follow one another with no
allocation between are one moment, compared as a set. Full-size models:
benchmarks/unroll_check.py.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from autofit.evaluators import simulated, unroll
from autofit.evaluators.simulated import TraceDevice, anatomy, run_trace
from autofit.evaluators.unroll import canonical
from autofit.plan import Plan
from autofit.specs import MODELS, LengthDistribution, Target, Workload
from autofit.specs.cluster import parse_cluster
from tests.conftest import tiny

FULL = dict(precision="bf16-mixed", attention="sdpa", checkpointing="full", micro_batch=1, grad_accum=2)
EAGER_8BIT = dict(precision="bf16-mixed", attention="eager", optimizer="adamw-8bit", micro_batch=2, grad_accum=1)
LORA = dict(method="lora", lora_rank=8, precision="bf16-mixed", attention="eager", micro_batch=1, grad_accum=2)
QLORA = dict(
    method="qlora",
    lora_rank=16,
    precision="bf16-mixed",
    checkpointing="full",
    attention="flash2",
    fused_loss=True,
    micro_batch=1,
    grad_accum=2,
)
ZERO3 = dict(
    precision="fp16-mixed", attention="eager", sharding="zero3", optimizer="adafactor", micro_batch=1, grad_accum=4
)
PACKED = dict(precision="bf16-true", attention="flash2", packing=True, micro_batch=2, grad_accum=1)
OFFLOAD = dict(precision="bf16-mixed", attention="sdpa", offload_activations=True, micro_batch=1, grad_accum=2)
IN_BWD = dict(precision="bf16-true", attention="sdpa", checkpointing="full", optimizer_in_backward=True, micro_batch=2)
FUSED = dict(
    precision="bf16-mixed", attention="sdpa", fused_kernels=True, checkpointing="full", micro_batch=1, grad_accum=2
)
# every second block checkpointed: the unroll's period covers the pattern (8 layers: 3 periods of 2 and one more)
SELECTIVE = dict(precision="bf16-true", attention="sdpa", checkpointing="selective", checkpoint_every=2, micro_batch=2)
PLANS = {
    "full": FULL,
    "eager-8bit": EAGER_8BIT,
    "lora": LORA,
    "qlora": QLORA,
    "zero3": ZERO3,
    "packed": PACKED,
    "offload": OFFLOAD,
    "in-bwd": IN_BWD,
    "fused": FUSED,
    "selective": SELECTIVE,
}

# one model per family of the registry; gemma-2's layers alternate (period 2)
FAMILIES = [
    "mistral-7b",
    "llama-3.2-1b",
    "qwen2.5-0.5b",
    "qwen3-8b",
    "gemma-2-9b",
    "phi-3-mini",
    "gemma-2b",
    "phi-2",
    "stablelm-base-alpha-3b",
    "bloom-7b1",
    "falcon-40b",
    "gpt2",
    "bert-large-uncased",
]
# the default suite: every family once and every plan at least once
FAST = [
    ("mistral-7b", "qlora"),
    ("llama-3.2-1b", "full"),
    ("qwen2.5-0.5b", "zero3"),
    ("qwen3-8b", "qlora"),
    ("gemma-2-9b", "lora"),
    ("phi-3-mini", "eager-8bit"),
    ("gemma-2b", "full"),
    ("phi-2", "lora"),
    ("stablelm-base-alpha-3b", "zero3"),
    ("bloom-7b1", "eager-8bit"),
    ("falcon-40b", "lora"),
    ("gpt2", "full"),
    ("bert-large-uncased", "lora"),
    ("llama-3.2-1b", "packed"),
    ("mistral-7b", "offload"),
    ("gpt2", "offload"),
    ("llama-3.2-1b", "in-bwd"),
    ("qwen3-8b", "fused"),
    ("llama-3.2-1b", "selective"),
    ("gemma-2-9b", "selective"),
]
# every family and plan, but fused kernels only where they fit the block (Family.fused_kernels)
SLOW = [
    (f, p) for f in FAMILIES for p in PLANS if (f, p) not in FAST and (p != "fused" or MODELS[f].family.fused_kernels)
]
LENGTHS = LengthDistribution(((24, 3), (70, 5), (128, 2)))


def kinds_in_order(trace):
    return [trace.kinds[k] for k, d in trace.log if d > 0]


def assert_same(unrolled, full):
    assert full.timings["layers_traced"] > unrolled.timings["layers_traced"], "the case did not unroll"
    assert "unroll_failed" not in unrolled.timings, unrolled.timings["unroll_failed"]
    assert canonical(unrolled.log) == canonical(full.log)
    assert kinds_in_order(unrolled) == kinds_in_order(full)
    assert unrolled.marks == full.marks
    for phase in full.ops.rows:
        assert Counter(unrolled.ops.rows[phase]) == Counter(full.ops.rows[phase]), phase
    assert (unrolled.peak, unrolled.peak_components, unrolled.peak_phase) == (
        full.peak,
        full.peak_components,
        full.peak_phase,
    )
    assert unrolled.offloaded == full.offloaded
    assert (unrolled.n_params, unrolled.n_trainable, unrolled.grad_bytes) == (
        full.n_params,
        full.n_trainable,
        full.grad_bytes,
    )


def case(family: str, plan_name: str):
    """The fewest layers that unroll: one more period than the 3 traced (4 layers; 8 where the
    period is 2: gemma-2's alternating attention, checkpointing every second block), so the
    template block is copied twice."""
    period = 2 if family == "gemma-2-9b" or plan_name == "selective" else 1
    spec = tiny(family, layers=4 * period)
    kw = dict(PLANS[plan_name])
    if kw["attention"] not in spec.family.attn_impls:
        kw["attention"] = "eager"
    plan = Plan(**kw)
    workload = Workload(
        seq_len=128, global_batch=plan.micro_batch * plan.grad_accum, lengths=LENGTHS if plan.packing else None
    )
    return spec, plan, workload


def check(family: str, plan_name: str) -> None:
    spec, plan, workload = case(family, plan_name)
    target = TraceDevice("cuda", (8, 0))
    unrolled = run_trace(spec, plan, workload, target)
    full = run_trace(spec, plan, workload, target, unrolled=False)
    assert_same(unrolled, full)
    cluster = parse_cluster("1xA100-80GB")
    ctx = Target(spec, cluster, workload)
    assert anatomy(unrolled, plan, ctx) == anatomy(full, plan, ctx)


@pytest.mark.parametrize("family,plan_name", FAST, ids=[f"{f}-{p}" for f, p in FAST])
def test_unrolled_trace_is_the_full_trace(family, plan_name):
    check(family, plan_name)


@pytest.mark.slow
@pytest.mark.parametrize("family,plan_name", SLOW, ids=[f"{f}-{p}" for f, p in SLOW])
def test_unrolled_trace_is_the_full_trace_every_family_and_plan(family, plan_name):
    check(family, plan_name)


def test_an_unrolled_trace_agrees_with_a_real_cpu_step():
    """The real-CPU agreement of test_simulated, on a model deep enough to be unrolled."""
    from tests.evaluators.test_simulated import assert_matches, measure

    spec = tiny("llama-2-7b", layers=4)
    plan = Plan(precision="bf16-mixed", checkpointing="full", micro_batch=1, grad_accum=2)
    workload = Workload(seq_len=128, global_batch=2)
    trace = run_trace(spec, plan, workload, TraceDevice("cpu"))
    assert trace.timings["layers_traced"] == 3
    assert_matches(measure(spec, plan, workload), trace)


def test_where_the_events_do_not_repeat_every_layer_is_traced(monkeypatch):
    spec, plan, workload = case("llama-3.2-1b", "full")

    def refuse(*args, **kwargs):
        raise unroll.UnrollError("a free reaches a layer the model does not have")

    monkeypatch.setattr(unroll, "unroll", refuse)
    trace = run_trace(spec, plan, workload, TraceDevice("cpu"))
    assert trace.timings["layers_traced"] == 4
    assert trace.timings["unroll_failed"] == "a free reaches a layer the model does not have"


def test_shallow_models_and_layer_periods():
    assert unroll.layer_period(None) == 1
    assert unroll.layer_period(["full"] * 6) == 1
    assert unroll.layer_period(["sliding", "full"] * 3) == 2
    assert unroll.layer_period(["a", "a", "b"]) == 3
    assert unroll.depth_for(3, None) is None  # nothing to unroll
    assert unroll.depth_for(4, None) == unroll.Depth(4, 1)
    assert unroll.depth_for(42, ["sliding", "full"] * 21) == unroll.Depth(42, 2)
    assert unroll.depth_for(5, ["sliding", "full"] * 2 + ["sliding"]) is None  # not whole periods
    d = unroll.Depth(42, 2)
    assert (d.traced, d.copies) == (6, 19)
    assert [d.full_layer(i, 0) for i in range(6)] == [0, 1, 2, 3, 40, 41]
    assert d.full_layer(3, 18) == 39


def test_unroll_of_a_hand_made_log():
    """Three alike layers, each making one storage and freeing the previous layer's, and a
    head that frees the last one: five layers make five, each freed by the next layer."""
    depth = unroll.Depth(5, 1)
    log = [(0, 10), (1, 10), (0, -10), (2, 10), (1, -10), (2, -10)]
    tags = [0, 1, 1, 2, 2, None]
    owners = {0: 0, 1: 1, 2: 2}
    kinds = dict.fromkeys(owners, "activations")
    marks = [(0, "forward", 0), (6, "setup", 0)]
    out = unroll.unroll(depth, log, tags, owners, kinds, marks, [None, None])
    assert canonical(out.log) == [
        ("+", 10),
        ("+", 10),
        ("-", -10, 0),
        ("+", 10),
        ("-", -10, 1),
        ("+", 10),
        ("-", -10, 2),
        ("+", 10),
        ("-", -10, 3),
        ("-", -10, 4),
    ]
    assert out.tags == [0, 1, 1, 2, 2, 3, 3, 4, 4, None]
    assert out.marks == [(0, "forward", 0), (10, "setup", 0)]
    # a layer unlike the one it stands for has no counterpart to free
    with pytest.raises(unroll.UnrollError):
        unroll.unroll(
            depth, [(0, 10), (1, 11), (0, -10), (2, 11), (1, -11), (2, -11)], tags, owners, kinds, marks, [None, None]
        )


def test_a_free_of_nothing_alive_is_refused():
    depth = unroll.Depth(5, 1)
    log = [(0, 10), (1, 11), (1, -11), (1, -11)]
    with pytest.raises(unroll.UnrollError):
        unroll.unroll(depth, log, [0, 1, 1, 1], {0: 0, 1: 1}, {0: "temporary", 1: "temporary"}, [], [])


def test_the_evaluator_says_how_many_layers_it_traced():
    spec, plan, workload = case("llama-3.2-1b", "full")
    ctx = Target(spec, parse_cluster("1xA100-80GB"), workload)
    result = simulated.SimulatedEvaluator(simulated.TraceCache()).evaluate(plan, ctx)
    assert result.extra["timings"]["layers_traced"] == 3


@pytest.mark.parametrize(
    "model_type,depth",
    [
        ("qwen2_moe", unroll.Depth(8, 2)),
        ("glm4_moe", unroll.Depth(5, 1, head=1)),
        ("deepseek_v3", unroll.Depth(5, 1, 1)),
    ],
)
@pytest.mark.parametrize("plan_name", ["lora-ckpt", "full-bf16"])
def test_a_hybrid_stack_unrolls_by_the_period_of_its_kinds(model_type, depth, plan_name):
    """Qwen2-MoE with every other layer dense (decoder_sparse_step 2) repeats every 2 layers: 6 are
    traced and unrolled to 8. GLM-4.5 and DeepSeek-V3 with a first dense layer repeat after it: that
    layer is a head before the first block, 4 are traced and unrolled to 5. Each the fewest layers
    that unroll; event for event the full trace."""
    from tests.evaluators.test_derived import tiny_hybrid

    spec = tiny_hybrid(model_type, layers=depth.total)
    assert simulated.trace_depth(spec) == depth
    plan = {
        "lora-ckpt": Plan(method="lora", lora_rank=8, precision="bf16-mixed", micro_batch=2, checkpointing="full"),
        "full-bf16": Plan(precision="bf16-true", micro_batch=2),
    }[plan_name]
    workload = Workload(seq_len=128, global_batch=2)
    target = TraceDevice("cuda", (8, 0))
    assert_same(run_trace(spec, plan, workload, target), run_trace(spec, plan, workload, target, unrolled=False))


def test_a_head_before_the_periods():
    """The fewest layers traced: a head of dense layers, then three periods; none where the step adds
    a per-layer pattern of its own (selective checkpointing) or the rest does not repeat."""
    assert unroll.depth_for(61, [0] * 3 + [1] * 58) == unroll.Depth(61, 1, head=3)
    assert unroll.depth_for(61, [0] * 3 + [1] * 58, every=2) is None
    assert unroll.depth_for(9, [0, 1, 2, 1, 2, 1, 2, 1, 2]) == unroll.Depth(9, 2, head=1)
    assert unroll.depth_for(6, [0, 1, 1, 1, 1, 1]) == unroll.Depth(6, 1, head=1)
    assert unroll.depth_for(4, [0, 1, 1, 1]) is None  # 1 + 3 periods is every layer
    assert unroll.depth_for(6, [0, 1, 2, 3, 1, 2]) is None  # no repeating rest
    d = unroll.Depth(61, 1, head=3)
    assert (d.traced, d.copies, list(d.template)) == (6, 56, [4])
    assert [d.full_layer(i, 0 if i == 4 else None) for i in range(6)] == [0, 1, 2, 3, 4, 60]
    assert d.traced_layer(3) == (3, None) and d.traced_layer(30) == (4, 26) and d.traced_layer(60) == (5, None)


def test_a_pattern_that_repeats_after_an_offset_unrolls_with_a_head():
    """Gemma-3 1B's 26 layers: its 5:1 sliding:full pattern repeats over the last 24, so 2 layers are
    a head and 20 are traced (before heads, all 26 were). Traced both ways at the fewest layers with
    a head: a 2:1 pattern over 13 layers repeats over the last 12, so 1 layer is a head and 10 are
    traced; event for event the full trace."""
    from tests.evaluators.test_derived import tiny_derived

    assert simulated.trace_depth(tiny_derived("gemma3_text", layers=26)) == unroll.Depth(26, 6, head=2)
    base = tiny_derived("gemma3_text")
    pattern = tuple("full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(13))
    extra = tuple((k, v) for k, v in base.hf_extra if k != "layer_types") + (("layer_types", pattern),)
    spec = dataclasses.replace(base, hf_extra=extra).variant(num_layers=13, name="tiny-gemma3_text-2to1")
    assert spec.to_hf_config().layer_types == list(pattern)
    assert simulated.trace_depth(spec) == unroll.Depth(13, 3, head=1)
    plan = Plan(precision="bf16-true", micro_batch=1, checkpointing="full")
    workload = Workload(seq_len=128, global_batch=1)
    target = TraceDevice("cuda", (8, 0))
    assert_same(run_trace(spec, plan, workload, target), run_trace(spec, plan, workload, target, unrolled=False))

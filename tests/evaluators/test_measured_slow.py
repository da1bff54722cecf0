"""Measured trials that take long on 2 cores: two-rank runs launched from the exported files,
hangs (a timeout to wait out), and a measured search that meets a crash, a hang and an OOM.

Two ranks on the CPU: DDP and DeepSpeed ZeRO-2/3 are set up by ``accelerate launch`` from
the exported YAML (and ds_config.json); FSDP is set up by the child over the launcher's gloo
group from the same YAML's fsdp_config (accelerate does not select FSDP on the CPU). Each
test asserts the world size and that the engine really ran (class, stage, sharding).
"""

from __future__ import annotations

import os
import time

import pytest

from autofit.evaluators.analytic import estimate
from autofit.evaluators.measured import MeasuredEvaluator, alive
from autofit.evaluators.simulated import SimulatedEvaluator
from autofit.export import export_files
from autofit.plan import Plan
from autofit.results import Status
from autofit.search.request import with_cpu_budget
from autofit.specs import Target, Workload, parse_cluster
from tests.conftest import tiny

pytestmark = pytest.mark.slow

MiB = 2**20
ENV = {"OMP_NUM_THREADS": "1"}
# the two warm-up steps hold the peak (the optimizer's states exist from step 0's end); one timed
# step gives tokens/s: more would only lengthen each run
TWO_RANK_RUN = dict(warmup_steps=2, timed_steps=1, timeout_s=400, env=ENV)
TWO_RANKS = pytest.mark.ranks("two CPU ranks, a core each")


def ctx_for(gpus: str, budget: str = "1GiB", headroom: float = 0.05, **workload) -> Target:
    wl = {"seq_len": 64, "global_batch": 8, **workload}
    return Target(tiny("mistral-7b"), with_cpu_budget(parse_cluster(gpus), budget), Workload(**wl), headroom)


def session_members(sid: int) -> list[int]:
    """Live (non-zombie) processes whose session id is ``sid``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            out.append(int(entry))
    return out


TWO_RANK = {
    "ddp": Plan(precision="bf16-mixed", micro_batch=2, grad_accum=2),
    # with fused kernels: FSDP's own checkpoint recompute must rotate as the forward did
    "fsdp": Plan(
        precision="bf16-mixed", micro_batch=2, grad_accum=2, sharding="fsdp", checkpointing="full", fused_kernels=True
    ),
    "zero2": Plan(precision="bf16-mixed", micro_batch=2, grad_accum=2, sharding="zero2"),
    "zero3": Plan(precision="bf16-mixed", micro_batch=2, grad_accum=2, sharding="zero3"),
}


@pytest.mark.parametrize("name", list(TWO_RANK))
@TWO_RANKS
@pytest.mark.usefixtures("deepspeed_jit_ops")
def test_two_ranks_launched_from_the_exported_files(name, tmp_path):
    ctx = ctx_for("2xcpu")
    plan = TWO_RANK[name]
    t0 = time.perf_counter()
    r = MeasuredEvaluator(**TWO_RANK_RUN, work_dir=tmp_path).evaluate(plan, ctx)
    wall = time.perf_counter() - t0
    assert r.status is Status.FITS, (r.reason, r.extra.get("stderr_tail"))
    e = r.extra
    assert e["launch"].startswith("python -m accelerate.commands.launch --config_file accelerate_config.yaml")
    # the files that ran are the export of this plan, byte for byte
    trial = tmp_path / os.path.basename(e["trial_dir"])
    for fname, text in export_files(plan, ctx).items():
        assert (trial / fname).read_text() == text
    ranks = e["ranks"]
    assert [x["rank"] for x in ranks] == [0, 1] and len({x["pid"] for x in ranks}) == 2
    assert all(x["status"] == "completed" for x in ranks)
    eng = e["engine"]
    assert eng["world_size"] == 2
    assert e["tokens_per_step"] == 8 * 64  # both ranks' real tokens
    n = tiny("mistral-7b").n_params
    m = r.memory
    if name == "ddp":
        assert eng["distributed_type"] == "MULTI_CPU" and eng["model_class"] == "DistributedDataParallel"
        assert eng["num_processes"] == 2
        assert m.weights >= 4 * n  # fp32 weights under autocast, whole on each rank
    elif name == "fsdp":
        assert eng["distributed_type"] == "FSDP" and eng["fsdp_applied_by"].startswith("autofit")
        assert eng["fsdp_param_type"] == "DTensor" and eng["fsdp_placements"] in (["S(0)"], ["Shard(dim=0)"])
        assert eng["fsdp_local_numel"] * 2 == eng["fsdp_global_numel"]
        assert eng["fsdp_modules"] >= 1 + tiny("mistral-7b").num_layers  # each decoder layer and the root
        # checkpointing is FSDP's (fsdp_activation_checkpointing), not the model's
        assert eng["checkpoint_wrappers"] == tiny("mistral-7b").num_layers and not eng["checkpointing"]
        # fp32 sharded parameters (accelerate upcasts for mixed precision): half of 4 bytes × N per rank
        assert m.weights == pytest.approx(4 * n / 2, rel=0.02)
    else:
        stage = int(name[-1])
        assert eng["distributed_type"] == "DEEPSPEED" and eng["model_class"] == "DeepSpeedEngine"
        assert (eng["zero_stage"], eng["train_batch_size"], eng["micro_batch"], eng["grad_accum"]) == (stage, 8, 2, 2)
        assert eng["bf16"] and eng["inner_optimizer"] == "AdamW"  # ds_config's optimizer section (torch_adam)
        # bf16 module weights: whole on each rank under ZeRO-2, halved under ZeRO-3
        assert m.weights == pytest.approx(2 * n / (2 if stage == 3 else 1), rel=0.02)
        # fp32 master + two moments, partitioned over the 2 ranks
        assert m.optimizer == pytest.approx(12 * n / 2, rel=0.02)
    gap = estimate(plan, ctx).memory.peak_allocated / m.peak_allocated - 1
    print(f"{name}: measured {m.peak_allocated / MiB:.2f} MiB, analytic {gap:+.1%}, {wall:.1f} s")
    # FSDP2's peak moves by one block's 16-bit gradients from run to run (costs.held_grads):
    # the estimate covers the larger
    assert -0.03 <= gap <= 0.12, f"{name}: analytic {gap:+.1%} against the measured peak"


# what DeepSpeed ZeRO holds beyond its partitions (docs/EVALUATORS.md), each against a real run
ZERO_BEYOND = {
    # the flat gradient partition from setup, with no accumulation to hold it
    "zero3-ga1": ("mistral-7b", Plan(precision="bf16-mixed", micro_batch=2, grad_accum=1, sharding="zero3")),
    # Adafactor on the flat partition: whole second moment, squared gradient and clone
    "zero2-adafactor": (
        "mistral-7b",
        Plan(precision="bf16-mixed", micro_batch=2, grad_accum=2, sharding="zero2", optimizer="adafactor"),
    ),
    # the experts' whole gradients beside the block's backward
    "zero3-mixtral": ("mixtral-8x7b", Plan(precision="bf16-mixed", micro_batch=2, grad_accum=2, sharding="zero3")),
}


@pytest.mark.parametrize("name", list(ZERO_BEYOND))
@TWO_RANKS
@pytest.mark.usefixtures("deepspeed_jit_ops")
def test_zero_estimates_cover_the_measured_peak(name, tmp_path):
    from autofit.evaluators.simulated import SimulatedEvaluator

    model, plan = ZERO_BEYOND[name]
    wl = Workload(seq_len=64, global_batch=8 if plan.grad_accum == 2 else 4)
    ctx = Target(tiny(model), with_cpu_budget(parse_cluster("2xcpu"), "1GiB"), wl, 0.05)
    r = MeasuredEvaluator(**TWO_RANK_RUN, work_dir=tmp_path).evaluate(plan, ctx)
    assert r.status is Status.FITS, (r.reason, r.extra.get("stderr_tail"))
    assert r.extra["engine"]["zero_stage"] == plan.zero_stage and r.extra["engine"]["world_size"] == 2
    measured = r.memory.peak_allocated
    for est in (estimate(plan, ctx).memory, SimulatedEvaluator().evaluate(plan, ctx).memory):
        gap = est.peak_allocated / measured - 1
        assert -0.01 <= gap <= 0.10, f"{name}: {gap:+.1%} against the measured {measured / MiB:.2f} MiB"


@TWO_RANKS
@pytest.mark.usefixtures("deepspeed_jit_ops")
def test_lora_8bit_trains_under_zero2_on_two_ranks(tmp_path):
    """LLM.int8 base weights under DeepSpeed ZeRO-2 (ZeRO-3 and FSDP are refused): every block
    Linear is bitsandbytes' Linear8bitLt on each rank, and the analytic peak is within its ±4%."""
    ctx = ctx_for("2xcpu")
    plan = Plan(method="lora-8bit", lora_rank=8, precision="bf16-mixed", micro_batch=2, grad_accum=2, sharding="zero2")
    r = MeasuredEvaluator(**TWO_RANK_RUN, work_dir=tmp_path).evaluate(plan, ctx)
    assert r.status is Status.FITS, (r.reason, r.extra.get("stderr_tail"))
    eng = r.extra["engine"]
    spec = tiny("mistral-7b")
    assert eng["distributed_type"] == "DEEPSPEED" and eng["zero_stage"] == 2 and eng["world_size"] == 2
    assert eng["linear8bit"] == spec.num_layers * len(spec.linears())
    assert eng["trainable_params"] == spec.lora_params(8)
    gap = estimate(plan, ctx).memory.peak_allocated / r.memory.peak_allocated - 1
    assert -0.02 <= gap <= 0.12, gap


@pytest.mark.alone("its 12 s trial timeout must fall after step 0: load delays the child's start past it")
def test_a_hanging_child_times_out_and_leaves_no_process():
    # the hang ignores SIGTERM: the parent must escalate to SIGKILL
    ev = MeasuredEvaluator(timeout_s=12, env={**ENV, "AUTOFIT_TEST_TRIAL_FAULT": "hang@1"})
    t0 = time.perf_counter()
    r = ev.evaluate(
        Plan(method="lora", lora_rank=8, precision="bf16-mixed", micro_batch=2, grad_accum=2),
        ctx_for("1xcpu", global_batch=4),
    )
    assert r.status is Status.TIMEOUT and "no result within 12 s (stopped after step 0)" in r.reason
    assert time.perf_counter() - t0 < 12 + 2 * 3 + 5
    rank = r.extra["ranks"][0]
    assert rank["status"] == "running" and "engine" in r.extra  # past setup: the hang timed out, not the start
    assert not alive(rank["pid"]) and not session_members(rank["pid"])


@TWO_RANKS
def test_a_hanging_two_rank_launch_leaves_no_process():
    """torchrun starts each worker in a session of its own: killing the launcher's group is not enough."""
    ev = MeasuredEvaluator(timeout_s=25, env={**ENV, "AUTOFIT_TEST_TRIAL_FAULT": "hang@1"})
    r = ev.evaluate(TWO_RANK["ddp"], ctx_for("2xcpu"))
    assert r.status is Status.TIMEOUT and r.extra["last_step"]["step"] == 0
    pids = [x["pid"] for x in r.extra["ranks"]]
    assert len(pids) == 2
    # each worker led its own session (torchrun's start_new_session): none of them is left
    assert not any(alive(p) for p in pids)
    assert not any(session_members(p) for p in pids)


def test_the_search_goes_on_after_a_crash_a_hang_and_an_oom(tmp_path):
    """A measured search whose first three (enqueued) plans crash, hang and run out of memory."""
    from autofit.search.loop import SearchRequest, candidates, run_search, screen
    from autofit.search.space import Allowed, SearchSpace
    from autofit.store import Store

    # 4 sequences of 64 tokens a step: the first three (full, lora, qlora at mb4) still need
    # budgets far enough apart, and a later plan runs its three steps in a few seconds
    ctx = ctx_for("1xcpu", budget="1GiB", global_batch=4)
    allowed = Allowed()
    space = SearchSpace(ctx, allowed)
    first = [space.suggest(_Replay(p)) for p in candidates(screen(space), 3)]
    # the enforced budget (the evaluator's) sits below what the largest of the three needs and
    # above the other two, which crash and hang
    peak = {p.plan_id: estimate(p, ctx).memory.peak_allocated for p in first}
    big = max(first, key=lambda p: peak[p.plan_id])
    crash_plan, hang_plan = (p for p in first if p is not big)
    budget = int(0.8 * peak[big.plan_id])
    assert budget > max(peak[crash_plan.plan_id], peak[hang_plan.plan_id])
    faults = f"crash@0:{crash_plan.plan_id};hang@1:{hang_plan.plan_id}"
    request = SearchRequest(
        ctx=ctx,
        allowed=allowed,
        evaluator="measured",
        trials=6,  # the search enqueues trials // 2 of the screen's picks: the three faults
        evaluator_options={
            "warmup_steps": 2,
            "timed_steps": 1,
            "timeout_s": 15,
            "cpu_mem_budget": budget,
            "env": {**ENV, "AUTOFIT_TEST_TRIAL_FAULT": faults},
        },
    )
    with Store(f"sqlite:///{tmp_path / 'a.db'}") as store:
        out = run_search(request, store)
        rows = [store.trial_result(t) for t in store.trials(out.study.id)]
    assert [r.plan.plan_id for r in rows[:3]] == [p.plan_id for p in first]
    by_plan = {r.plan.plan_id: r for r in rows[:3]}
    crash, hang, oom = (by_plan[p.plan_id] for p in (crash_plan, hang_plan, big))
    assert crash.status is Status.FAILED and "injected crash at step 0" in crash.reason
    assert hang.status is Status.TIMEOUT and not alive(hang.extra["ranks"][0]["pid"])
    assert oom.status is Status.OOM and oom.extra["budget_hit"]["budget"] == budget
    assert oom.extra["budget_hit"]["step"] == 0
    later = rows[3:]
    assert later, "the search stopped after the faults"
    assert all(r.evaluator in ("measured", "analytic") for r in rows)
    assert out.study.status.value == "finished" and not out.interrupted
    print({r.plan.summary(): r.status.value for r in rows})


class _Replay:
    """Answers ``suggest_categorical`` from enqueued params (what Optuna does for an enqueued trial)."""

    def __init__(self, params):
        self.params = params

    def suggest_categorical(self, name, choices):
        return self.params[name]


def test_ctrl_c_in_the_parent_takes_the_child_down():
    """The child runs in its own session (no SIGINT from the terminal reaches it): the parent kills it."""
    running = []

    def interrupt(step):
        running.append(_trial_children())
        raise KeyboardInterrupt

    ev = MeasuredEvaluator(timeout_s=120, env=ENV)
    with pytest.raises(KeyboardInterrupt):
        ev.evaluate(
            Plan(precision="bf16-mixed", micro_batch=2, grad_accum=2),
            ctx_for("1xcpu", global_batch=4),
            on_step=interrupt,
        )
    assert len(running) == 1 and len(running[0]) == 1  # the child was there at its first step
    assert not alive(running[0][0]) and not _trial_children()


def _trial_children() -> list[int]:
    """Live processes running the trial child module, started by this test process."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if b"autofit.evaluators._trial_main" in cmd and fields[0] != "Z" and int(fields[1]) == os.getpid():
            out.append(int(entry))
    return out


@TWO_RANKS
def test_an_moe_model_trains_under_fsdp2_on_two_ranks(tmp_path):
    """Mixtral's 3-D expert parameters sharded by FSDP2 on dim 0 (experts split over the ranks),
    launched from the exported files: it fits and the analytic peak covers it, by at most 12%.
    (The measured peak moves by one block's 16-bit gradients from run to run: FSDP2 frees the
    previous block's reduce-scatter input only in the next post-backward; costs.held_grads.)"""
    spec = tiny("mixtral-8x7b")
    ctx = Target(spec, with_cpu_budget(parse_cluster("2xcpu"), "1GiB"), Workload(seq_len=64, global_batch=8), 0.05)
    plan = Plan(precision="bf16-mixed", micro_batch=2, grad_accum=2, sharding="fsdp", checkpointing="full")
    r = MeasuredEvaluator(**TWO_RANK_RUN, work_dir=tmp_path).evaluate(plan, ctx)
    assert r.status is Status.FITS, (r.reason, r.extra.get("stderr_tail"))
    eng = r.extra["engine"]
    assert eng["distributed_type"] == "FSDP" and eng["fsdp_local_numel"] * 2 == eng["fsdp_global_numel"]
    assert r.memory.weights == pytest.approx(4 * spec.n_params / 2, rel=0.02)
    gap = estimate(plan, ctx).memory.peak_allocated / r.memory.peak_allocated - 1
    assert -0.02 <= gap <= 0.12, gap


@TWO_RANKS
@pytest.mark.usefixtures("deepspeed_jit_ops")
def test_op_level_checkpointing_measured_on_two_zero2_ranks(tmp_path):
    """Op-level selective checkpointing (torchtitan's SelectiveAC) through DeepSpeed ZeRO-2 in a real
    two-rank run: every block checkpointed under the policy, and both estimators cover the measured
    peak within the band the ZeRO checks use."""
    from autofit.evaluators.simulated import SimulatedEvaluator

    ctx = ctx_for("2xcpu")
    plan = Plan(precision="bf16-mixed", micro_batch=2, grad_accum=2, sharding="zero2", checkpointing="selective")
    plan = plan.replace(checkpoint_ops=True)
    r = MeasuredEvaluator(**TWO_RANK_RUN, work_dir=tmp_path).evaluate(plan, ctx)
    assert r.status is Status.FITS, (r.reason, r.extra.get("stderr_tail"))
    eng = r.extra["engine"]
    assert eng["zero_stage"] == 2 and eng["world_size"] == 2 and eng["checkpointing"]
    measured = r.memory.peak_allocated
    for est in (estimate(plan, ctx).memory, SimulatedEvaluator().evaluate(plan, ctx).memory):
        gap = est.peak_allocated / measured - 1
        print(f"op-level zero2: measured {measured / MiB:.2f} MiB, estimate {gap:+.1%}")
        assert -0.03 <= gap <= 0.12, f"{gap:+.1%} against the measured {measured / MiB:.2f} MiB"


@TWO_RANKS
def test_context_parallelism_trains_whole_rows_on_two_cpu_ranks(tmp_path):
    """Two ranks of one context-parallel group, launched from the exported files (FSDP2 over both,
    accelerate's ParallelismConfig, its maybe_context_parallel around each micro-batch, the CPU ring of
    evaluators/ring.py), train on the same rows, each on half of every row's tokens. In fp32 their
    losses, weighted by the tokens each predicts, are one process's on the whole rows, before and after
    the first update: attention reaches across the ranks. The estimates cover the measured peak of the
    same plan in bf16-mixed (in fp32 they are 10-15% under FSDP2's peak on gloo ranks with or without
    context parallelism: docs/FIELD-NOTES.md, 2026-12-06)."""
    spec = tiny("llama-3.2-1b")
    wl = Workload(seq_len=64, global_batch=4)
    ctx = Target(spec, with_cpu_budget(parse_cluster("2xcpu"), "1GiB"), wl, 0.05)
    plan = Plan(precision="32-true", micro_batch=1, grad_accum=4, sharding="fsdp", context_parallel=2)
    r = MeasuredEvaluator(**TWO_RANK_RUN, work_dir=tmp_path).evaluate(plan, ctx)
    assert r.status is Status.FITS, (r.reason, r.extra.get("stderr_tail"))
    eng = r.extra["engine"]
    assert eng["distributed_type"] == "FSDP" and eng["fsdp_local_numel"] * 2 == eng["fsdp_global_numel"]
    assert eng["context_parallel"] == {
        "cp_size": 2,
        "dp_shard_size": 1,
        "cp_comm_strategy": "allgather",
        "mesh": ["cp"],
    }
    assert r.extra["tokens_per_step"] == 4 * 64  # each row's tokens once, not once per rank
    one = Target(spec, with_cpu_budget(parse_cluster("1xcpu"), "1GiB"), wl, 0.05)
    single = MeasuredEvaluator(**TWO_RANK_RUN, work_dir=tmp_path).evaluate(
        Plan(precision="32-true", micro_batch=1, grad_accum=4), one
    )
    assert single.status is Status.FITS, single.reason
    whole = single.extra["ranks"][0]["losses"]
    # torch's load balancer gives rank 0 the first and last quarter of a row: the last token, which
    # predicts nothing (shift_labels), is rank 0's, so it averages 31 losses a row and rank 1 32
    first, second = (x["losses"] for x in r.extra["ranks"])
    for step in (0, 1):
        assert (31 * first[step] + 32 * second[step]) / 63 == pytest.approx(whole[step], rel=1e-5), step
    plan = plan.replace(precision="bf16-mixed")
    mixed = MeasuredEvaluator(**TWO_RANK_RUN, work_dir=tmp_path).evaluate(plan, ctx)
    assert mixed.status is Status.FITS, mixed.reason
    measured = mixed.memory.peak_allocated
    for name, ev in (("analytic", estimate), ("simulated", SimulatedEvaluator().evaluate)):
        gap = ev(plan, ctx).memory.peak_allocated / measured - 1
        print(f"cp2 {name}: {gap:+.1%} against {measured / MiB:.2f} MiB")
        # FSDP2's peak moves by a block's gradients from run to run, as in the two-rank tests above
        assert -0.03 <= gap <= 0.12, f"{name} {gap:+.1%}"

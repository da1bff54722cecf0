"""The measured evaluator on the CPU: real child processes, real training steps, real faults.

Each single-process trial costs a child start (imports: ~5 s on 2 cores); the trials are
run once per module and shared by the tests that read them. Multi-rank runs, hangs, the
search and the CLI are in test_measured_slow.py and tests/cli/test_measured_cli.py (slow).
"""

from __future__ import annotations

import os

import pytest

from autofit.errors import AutofitError
from autofit.evaluators import get_evaluator, resolve_evaluator
from autofit.evaluators.analytic import estimate
from autofit.evaluators.measured import MeasuredEvaluator, alive, child_env, not_measurable
from autofit.plan import Plan
from autofit.results import Status
from autofit.search.request import with_cpu_budget
from autofit.specs import LengthDistribution, Target, Workload, parse_cluster
from autofit.specs.gpus import match_gpu
from tests.conftest import tiny

MiB = 2**20
GiB = 2**30
ENV = {"OMP_NUM_THREADS": "1"}


def cpu_ctx(
    gpus: str = "1xcpu",
    budget: str = "1GiB",
    seq_len: int = 128,
    global_batch: int = 4,
    model: str = "mistral-7b",
    headroom: float = 0.05,
    lengths=None,
) -> Target:
    cluster = with_cpu_budget(parse_cluster(gpus), budget)
    workload = Workload(seq_len=seq_len, global_batch=global_batch, lengths=lengths)
    return Target(tiny(model), cluster, workload, headroom)


# a dataset of mostly short sequences: padded micro-batches carry padding that tokens/s must not count
LENGTHS = LengthDistribution(((24, 6), (128, 1)))


# -- pure parts -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "device,memory_gib,expected",
    [
        ("NVIDIA A100-SXM4-80GB", 80, "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", 40, "A100-40GB"),
        ("NVIDIA H100 80GB HBM3", 80, "H100-80GB"),
        ("NVIDIA H100 PCIe", 80, "H100-PCIE"),
        ("NVIDIA A10G", 23, "A10G"),
        ("NVIDIA A10", 23, "A10"),
        ("NVIDIA L4", 22, "L4"),
        ("NVIDIA L40S", 45, "L40S"),
        ("NVIDIA GeForce RTX 4090", 24, "RTX4090"),
        ("NVIDIA RTX A6000", 48, "A6000"),
        ("NVIDIA H200", 140, "H200"),
        ("NVIDIA B200", 178, "B200"),
        ("NVIDIA B300 SXM6 AC", 268, None),
    ],
)
def test_local_gpu_names_map_to_the_catalog(device, memory_gib, expected):
    g = match_gpu(device, memory_gib * GiB)
    assert (g.name if g else None) == expected


def test_backends_measured_and_auto():
    cpu = cpu_ctx()
    assert resolve_evaluator("measured", cpu) == "measured"
    # the CPU target is measured only when asked: auto plans with the simulator
    assert resolve_evaluator("auto", cpu) == "simulated"
    from autofit.evaluators.measured import local_gpus
    from autofit.specs import GPUS

    here = {g.name for g in local_gpus() if g is not None}
    absent = next(name for name in GPUS if name not in here)
    gpu = Target(tiny("mistral-7b"), parse_cluster(f"1x{absent}"), Workload(seq_len=128, global_batch=4))
    assert resolve_evaluator("auto", gpu) == "simulated"  # this machine has no such GPU
    with pytest.raises(AutofitError, match=f"needs 1x{absent} on this machine"):
        resolve_evaluator("measured", gpu)
    assert isinstance(get_evaluator("measured", timed_steps=1), MeasuredEvaluator)


def test_cpu_budget_sets_the_target_and_the_request_key():
    from autofit.store import request_key

    a, b = cpu_ctx(budget="64MiB"), cpu_ctx(budget="128MiB")
    assert a.capacity_bytes == 64 * MiB and a.cluster.gpu.kind == "cpu"
    assert request_key(a, evaluator="measured") != request_key(b, evaluator="measured")
    with pytest.raises(AutofitError, match="--cpu-mem-budget applies to the local CPU target"):
        with_cpu_budget(parse_cluster("1xA10"), "64MiB")


def test_the_child_imports_the_autofit_under_test():
    import autofit

    root = os.path.dirname(os.path.dirname(os.path.abspath(autofit.__file__)))
    env = child_env({"X": "1"})
    assert env["PYTHONPATH"].split(os.pathsep)[0] == root and env["X"] == "1"


def test_what_cannot_be_measured_here_fails_without_a_launch():
    ctx = cpu_ctx()
    paged = Plan(precision="bf16-mixed", micro_batch=2, grad_accum=2, optimizer="paged-adamw-8bit")
    assert "CUDA" in not_measurable(paged, ctx, "cpu")
    r = MeasuredEvaluator().evaluate(paged, ctx)
    assert r.status is Status.FAILED and r.extra["launched"] is False and "not measurable here" in r.reason
    fused_ddp = Plan(precision="bf16-mixed", micro_batch=1, grad_accum=2, fused_loss=True)
    assert "single-process" in not_measurable(fused_ddp, cpu_ctx("2xcpu"), "cpu")


def test_the_tracker_budget_raises_cuda_s_oom_at_the_crossing_allocation():
    import torch

    from autofit.evaluators import runtime as rt
    from autofit.evaluators.memtrack import StorageTracker

    spec, plan = tiny("mistral-7b"), Plan(precision="bf16-mixed", micro_batch=2)
    model = rt.build_model(spec, plan)
    opt = rt.make_optimizer(plan, model)
    budget = 24 * MiB
    tr = StorageTracker(budget=budget)
    with pytest.raises(torch.OutOfMemoryError, match="under the autofit budget"):
        with tr:
            tr.track(list(model.parameters()) + list(model.buffers()), "weights")
            runner = rt.StepRunner(spec, plan, model, opt, tracker=tr)
            runner.step(rt.batches_for(spec, plan, Workload(seq_len=256, global_batch=2)), 0)
    hit = tr.budget_hit
    assert hit["live_before"] <= budget < hit["live_before"] + hit["requested"]
    assert hit["phase"] == "forward" and hit["step"] == 0


@pytest.mark.parametrize("family", ["gpt2", "bert-large-uncased"])
def test_qlora_is_quantized_layer_by_layer_without_a_16bit_model(family):
    """Every block Linear (GPT-2: Conv1D) becomes NF4, and the build never holds the 16-bit model."""
    from autofit.evaluators import runtime as rt
    from autofit.evaluators.memtrack import StorageTracker

    spec = tiny(family, layers=4, hidden_size=512, head_dim=64, intermediate_size=2048, vocab_size=512)
    plan = Plan(method="qlora", lora_rank=8, precision="bf16-mixed")
    tr = StorageTracker(skip_meta=True)
    with tr:
        model = rt.build_quantized_model(spec, plan)
    n4 = [m for m in model.modules() if type(m).__name__ == "Linear4bit"]
    assert len(n4) == spec.num_layers * len(spec.linears())
    assert all(m.weight.dtype.is_floating_point is False for m in n4)
    assert not any(type(m).__name__ == "Conv1D" for m in model.modules())
    linear16 = 2 * spec.linear_params()
    # the rest of the model in 16-bit, one block Linear in 16-bit, the NF4 codes: far below the 16-bit Linears
    assert tr.peak < 0.5 * linear16
    # what the build holds beyond the finished model is at most one block Linear in 16-bit
    assert tr.peak - tr.live <= 2 * max(i * o for _, i, o, _ in spec.linears())
    # build_model (materialize, then quantize) quantizes the same layers, GPT-2's Conv1D included
    eager = rt.build_model(spec, plan)
    assert sum(type(m).__name__ == "Linear4bit" for m in eager.modules()) == len(n4)


# -- real single-process trials ------------------------------------------------------------------
PLANS = {
    "full": Plan(precision="bf16-mixed", micro_batch=2, grad_accum=2),
    "full-8bit-ckpt": Plan(
        precision="bf16-mixed", micro_batch=2, grad_accum=2, optimizer="adamw-8bit", checkpointing="full"
    ),
    "lora": Plan(method="lora", lora_rank=8, precision="bf16-mixed", micro_batch=2, grad_accum=2),
    "qlora-ckpt-fused": Plan(
        method="qlora",
        lora_rank=8,
        precision="bf16-mixed",
        micro_batch=2,
        grad_accum=2,
        checkpointing="full",
        fused_loss=True,
    ),
    # LLM.int8 base weights: bitsandbytes' CPU path (MatMul8bitFp), checkpointed
    "lora-8bit-ckpt": Plan(
        method="lora-8bit", lora_rank=8, precision="bf16-mixed", micro_batch=2, grad_accum=2, checkpointing="full"
    ),
}


FAULTS = {
    # a 24 MiB budget (no headroom) that step 0 of the full plan crosses
    "oom": (PLANS["full"], dict(budget="24MiB", headroom=0.0), {}),
    "crash": (PLANS["lora"], {}, {"AUTOFIT_TEST_TRIAL_FAULT": "crash@1"}),
}


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory):
    """Every single-process trial of this module, two at a time without xdist (the children mostly
    import); two warm-up steps (tracked: the peak) and one timed step each."""
    from concurrent.futures import ThreadPoolExecutor

    work = tmp_path_factory.mktemp("trials")
    jobs = {name: (plan, cpu_ctx(lengths=LENGTHS if name == "lora" else None), {}) for name, plan in PLANS.items()}
    jobs.update({name: (plan, cpu_ctx(**ctx_kw), env) for name, (plan, ctx_kw, env) in FAULTS.items()})

    def run(name):
        plan, ctx, env = jobs[name]
        ev = MeasuredEvaluator(warmup_steps=2, timed_steps=1, timeout_s=300, env={**ENV, **env}, work_dir=work)
        steps = []
        r = ev.evaluate(plan, ctx, on_step=lambda s: steps.append(s) or True)
        return r, steps, ctx

    # under pytest-xdist the workers already keep the cores busy: one trial at a time there
    with ThreadPoolExecutor(max_workers=1 if os.environ.get("PYTEST_XDIST_WORKER") else 2) as pool:
        return dict(zip(jobs, pool.map(run, jobs)))


@pytest.mark.parametrize("name", list(PLANS))
def test_a_single_process_trial_measures_memory_and_speed(single_runs, name):
    r, steps, ctx = single_runs[name]
    assert r.status is Status.FITS, (r.reason, r.extra.get("stderr_tail"))
    assert r.evaluator == "measured" and r.plan == PLANS[name]
    e = r.extra
    assert e["device"] == "cpu" and e["cpu_mem_budget"] == GiB and e["world_size"] == 1
    assert e["launch"] == "python -m autofit.evaluators._trial_main trial.json"
    m = r.memory
    assert sum(m.components.values()) == m.peak_allocated == m.peak_reserved == m.device_total > 0
    assert m.weights > 0 and m.optimizer > 0 and m.activations > 0
    assert m.host_bytes == e["rss_peak_bytes"][0] > m.peak_allocated  # the interpreter and libraries
    t = r.throughput
    assert t.tokens_per_sec == pytest.approx(e["tokens_per_step"] / t.step_time_s)
    if ctx.workload.lengths is None:  # 2 sequences of 128 tokens × 2 micro-batches per optimizer step
        assert e["tokens_per_step"] == 4 * 128
    else:  # real tokens only: sequences of 24 or 128 tokens, 4 a step, padding not counted
        assert e["tokens_per_step"] in {4 * 24 + 104 * k for k in range(5)} - {4 * 128}
    assert len(e["step_times_s"]) == 1 and e["loss_finite"]
    # one progress report per step, the peak never shrinking, the last one the trial's peak
    assert [s.step for s in steps] == [0, 1, 2]
    assert [s.peak_bytes for s in steps] == sorted(s.peak_bytes for s in steps)
    assert steps[-1].peak_bytes == m.peak_allocated


def test_the_plan_s_techniques_are_really_applied(single_runs):
    runs = single_runs
    eng = {name: runs[name][0].extra["engine"] for name in PLANS}
    assert eng["full"]["optimizer_class"] == "AdamW" and not eng["full"]["checkpointing"]
    assert eng["full-8bit-ckpt"]["optimizer_class"] == "AdamW8bit" and eng["full-8bit-ckpt"]["checkpointing"]
    assert eng["lora"]["linear4bit"] == 0 and eng["lora"]["trainable_dtypes"] == ["float32"]
    spec = tiny("mistral-7b")
    assert eng["lora"]["trainable_params"] == spec.lora_params(8)
    assert eng["qlora-ckpt-fused"]["linear4bit"] == spec.num_layers * len(spec.linears())
    assert eng["lora-8bit-ckpt"]["linear8bit"] == spec.num_layers * len(spec.linears())
    assert eng["lora-8bit-ckpt"]["linear4bit"] == eng["lora"]["linear8bit"] == 0
    assert eng["lora-8bit-ckpt"]["trainable_params"] == spec.lora_params(8)
    full, small = runs["full"][0].memory, runs["full-8bit-ckpt"][0].memory
    # checkpointing keeps only block inputs; 8-bit moments are a quarter of fp32's (plus small 32-bit tensors)
    assert small.activations < 0.6 * full.activations
    assert small.optimizer < 0.35 * full.optimizer
    assert runs["lora"][0].memory.gradients < full.gradients / 20


def test_measured_peaks_beside_the_analytic_prediction(single_runs):
    """The stored pair's gap, within the analytic estimate's validated ±4% (test_analytic.py).
    The simulator (same tracker, so it should be within 2%) will take the analytic's place here."""
    gaps = {
        name: estimate(PLANS[name], ctx).memory.peak_allocated / r.memory.peak_allocated - 1
        for name, (r, _, ctx) in single_runs.items()
        if name in PLANS
    }
    print({k: f"{v:+.2%}" for k, v in gaps.items()})
    assert all(abs(g) < 0.04 for g in gaps.values()), gaps


def test_a_measured_trial_offloads_activations_and_steps_in_backward(tmp_path):
    """The child runs both techniques through the same runtime the simulator traces: on the
    CPU target (one tracker for both) the measured peak is the simulated one."""
    from autofit.evaluators.simulated import SimulatedEvaluator

    plan = Plan(
        precision="bf16-mixed",
        micro_batch=4,
        checkpointing="full",
        offload_activations=True,
        optimizer_in_backward=True,
    )
    ctx = cpu_ctx()
    r = MeasuredEvaluator(warmup_steps=2, timed_steps=1, timeout_s=300, env=ENV, work_dir=tmp_path).evaluate(plan, ctx)
    assert r.status is Status.FITS, (r.reason, r.extra.get("stderr_tail"))
    assert r.extra["engine"]["optimizer_class"] == "BackwardOptimizer" and r.extra["engine"]["checkpointing"]
    spec = tiny("mistral-7b")
    assert r.memory.gradients <= spec.vocab_size * spec.hidden_size * 4  # one fp32 gradient at most
    sim = SimulatedEvaluator().evaluate(plan, ctx).memory
    assert sim.peak_allocated == pytest.approx(r.memory.peak_allocated, rel=0.02)


def test_a_measured_trial_runs_the_fused_kernels_the_simulator_traces(tmp_path):
    """Off CUDA the child runs ``evaluators.fused`` (Liger's saves, torch ops): with the
    checkpoint recompute under the same RoPE, the measured peak is the simulated one."""
    from autofit.evaluators.simulated import SimulatedEvaluator

    plan = Plan(precision="bf16-mixed", micro_batch=4, checkpointing="full", fused_kernels=True)
    ctx = cpu_ctx()
    r = MeasuredEvaluator(warmup_steps=2, timed_steps=1, timeout_s=300, env=ENV, work_dir=tmp_path).evaluate(plan, ctx)
    assert r.status is Status.FITS, (r.reason, r.extra.get("stderr_tail"))
    sim = SimulatedEvaluator().evaluate(plan, ctx).memory
    assert sim.peak_allocated == pytest.approx(r.memory.peak_allocated, rel=0.02)
    plain = MeasuredEvaluator(warmup_steps=2, timed_steps=1, timeout_s=300, env=ENV, work_dir=tmp_path).evaluate(
        plan.replace(fused_kernels=False), ctx
    )
    assert r.memory.activations < plain.memory.activations


def test_measured_results_are_stored_with_device_and_budget(single_runs, store):
    runs = single_runs
    study = store.create_study(cpu_ctx(), evaluator="measured")
    for r, _, _ in runs.values():
        store.record_trial(study.id, r)
    back = [store.trial_result(t) for t in store.trials(study.id)]
    assert [(b.plan, b.status) for b in back] == [(r.plan, r.status) for r, _, _ in runs.values()]
    for b, (r, _, _) in zip(back, runs.values()):
        assert b.evaluator == "measured" and b.reason == r.reason
        assert b.memory == r.memory and b.tokens_per_sec == pytest.approx(r.tokens_per_sec)
        assert b.extra["device"] == "cpu" and b.extra["cpu_mem_budget"] == r.extra["cpu_mem_budget"] > 0
        if b.status is Status.FITS:
            assert b.extra["device_name"] and b.extra["engine"]["optimizer_class"]


# -- real faults -------------------------------------------------------------------------------------
def test_a_plan_over_the_cpu_budget_is_oom_in_its_first_step(single_runs):
    r, steps, _ = single_runs["oom"]
    assert r.status is Status.OOM, (r.reason, r.extra.get("stderr_tail"))
    hit = r.extra["budget_hit"]
    assert hit["step"] == 0 and hit["budget"] == 24 * MiB and not steps  # stopped inside step 0
    assert "> the 24.0 MiB budget" in r.reason and "step 0" in r.reason
    assert r.memory.peak_allocated == hit["live_before"] + hit["requested"] > 24 * MiB
    assert "OutOfMemoryError" in r.extra["error"]
    assert r.extra["exit_status"] == 3 and r.extra["ranks"][0]["status"] == "oom"


def test_a_crashing_child_is_failed_with_its_error(single_runs):
    r, steps, _ = single_runs["crash"]
    assert r.status is Status.FAILED
    assert r.reason == "rank 0 failed: RuntimeError: injected crash at step 1 (AUTOFIT_TEST_TRIAL_FAULT)"
    assert any("injected_fault" in line for line in r.extra["traceback"])
    assert any("injected crash" in line for line in r.extra["stderr_tail"])
    assert [s.step for s in steps] == [0] and r.extra["last_step"]["step"] == 0  # step 0 ran and was reported


def test_the_pruner_stops_a_running_trial_through_the_search_objective(tmp_path):
    """``on_step`` -> ``trial.report`` -> ``should_prune``: Optuna's own pruner stops the child,
    the row is stored as pruned by the pruner and the Optuna trial ends PRUNED."""
    import optuna

    from autofit.search.loop import SearchRequest, _Objective
    from autofit.search.space import Allowed, SearchSpace
    from autofit.store import Store

    ctx = cpu_ctx()
    request = SearchRequest(
        ctx=ctx,
        allowed=Allowed.parse(methods="lora"),
        evaluator="measured",
        trials=1,
        evaluator_options={"timeout_s": 300, "env": ENV, "timed_steps": 3},
    )
    with Store(f"sqlite:///{tmp_path / 'a.db'}") as store:
        rec = store.create_study(ctx, evaluator="measured")
        objective = _Objective(request, SearchSpace(ctx, request.allowed), store, rec.id, None)
        # no throughput reaches 1e12 tokens/s: the threshold pruner stops the trial at its first report
        study = optuna.create_study(direction="maximize", pruner=optuna.pruners.ThresholdPruner(lower=1e12))
        study.enqueue_trial(
            {
                "lora_rank": 16,
                "precision": "bf16-mixed",
                "optimizer": "adamw",
                "sharding": "none",
                "micro_batch": 2,
                "checkpointing": "none",
                "attention": "sdpa",
                "fused_loss": False,
            }
        )
        study.optimize(objective, n_trials=1)
        assert study.trials[0].state is optuna.trial.TrialState.PRUNED
        row = store.trial_result(store.trials(rec.id)[0])
    assert row.status is Status.PRUNED and row.extra["pruned_by"] == "pruner"
    assert row.evaluator == "measured" and row.extra["last_step"]["step"] == 0
    assert "predicted" in row.extra and row.extra["predicted"]["evaluator"] == "analytic"
    assert not any(alive(r["pid"]) for r in row.extra["ranks"])


def test_the_work_dir_is_checked_without_creating_anything(tmp_path):
    from autofit.evaluators.measured import check_work_dir

    (tmp_path / "afile").write_text("x")
    assert check_work_dir(tmp_path) == str(tmp_path)
    assert check_work_dir(tmp_path / "new" / "deeper") == str(tmp_path / "new" / "deeper")
    assert not (tmp_path / "new").exists()  # the evaluator creates it when a trial runs
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for path, fragment in [
        (tmp_path / "afile", f"work directory {tmp_path}/afile is a file"),
        (
            tmp_path / "afile" / "sub" / "x",
            f"cannot create work directory {tmp_path}/afile/sub/x: {tmp_path}/afile is a file",
        ),
        (tmp_path / "dangling", "is a broken link"),
    ]:
        with pytest.raises(AutofitError) as err:
            check_work_dir(path)
        assert fragment in str(err.value) and "give --work-dir a directory" in str(err.value)


def test_a_work_dir_that_cannot_be_created_stops_with_one_line_not_a_traceback(tmp_path):
    """A work dir that goes bad after the options were checked (here: never checked) stops
    the run with an AutofitError rather than an OSError from mkdir."""
    (tmp_path / "afile").write_text("x")
    ev = MeasuredEvaluator(work_dir=tmp_path / "afile" / "sub", env=ENV)
    with pytest.raises(AutofitError, match=r"cannot create a trial directory in .*/afile/sub: Not a directory"):
        ev.evaluate(Plan(precision="32-true"), cpu_ctx())


TREE = """
import subprocess, sys, time
# a worker in a session of its own that ignores SIGTERM (torchrun starts its workers so)
IGNORE = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(); time.sleep(60)"
stubborn = subprocess.Popen([sys.executable, "-c", IGNORE], start_new_session=True, stdout=subprocess.PIPE)
stubborn.stdout.readline()
# an orphan: re-parented before the kill, found only through the child's group
orphan = subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True).stdout
print(stubborn.pid, orphan.strip(), flush=True)
time.sleep(60)
"""


def test_kill_tree_takes_down_the_whole_tree(monkeypatch):
    """SIGTERM to the child, its group and every process below it; SIGKILL after the grace
    to what ignored it; the child's exit status is kept for classify."""
    import signal
    import subprocess
    import sys

    from autofit.evaluators import measured

    monkeypatch.setattr(measured, "KILL_GRACE_S", 0.5)
    proc = subprocess.Popen([sys.executable, "-c", TREE], start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        stubborn, orphan = map(int, proc.stdout.readline().split())
        assert alive(stubborn) and alive(orphan)
        pids = measured.kill_tree(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert {proc.pid, stubborn} <= pids
    assert not alive(stubborn) and not alive(orphan)
    assert proc.returncode == -signal.SIGTERM

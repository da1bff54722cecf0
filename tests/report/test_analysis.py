"""What the tables and plots show, computed from real stored studies and analytic evaluations."""

import dataclasses

import pytest

from autofit.evaluators.analytic import AnalyticEvaluator
from autofit.plan import Checkpointing, Method, Offload, Plan, Sharding, complexity, plan_problems
from autofit.report import analysis
from autofit.results import Status, tied


def stored(study):
    with study.store() as store:
        rec = store.get_study(study.name)
        return rec, [t.result() for t in store.trials(rec.id)]


def test_the_winner_runners_up_and_losses_of_a_stored_study(tight_study):
    rec, results = stored(tight_study)
    ctx = rec.context()
    st = analysis.standing(results, ctx)
    fitting = [r for r in results if r.fits]
    # the winner: the simplest of the plans within the time error of the fastest
    tb = st.tiebreak
    assert tb.answer is st.best and tb.fastest.tokens_per_sec == max(r.tokens_per_sec for r in fitting)
    assert tied(tb.fastest, st.best) and st.best in tb.ties
    assert all(complexity(st.best.plan) <= complexity(r.plan) for r in tb.ties)
    assert {r.plan.plan_id for r in tb.ties} == {r.plan.plan_id for r in fitting if tied(tb.fastest, r)}
    assert st.best.plan.plan_id == tight_study.outcome.best.plan.plan_id  # the search's own answer
    speeds = [r.tokens_per_sec for r in st.ranked[1:]]  # the others, fastest first
    assert speeds == sorted(speeds, reverse=True) and len(st.ranked) == len(fitting)
    assert st.runners_up(3) == st.ranked[1:4]
    assert st.speed_vs_best(st.ranked[1]) == pytest.approx(st.ranked[1].tokens_per_sec / st.best.tokens_per_sec)
    for m, best in st.best_per_method.items():  # the same rule among each method's plans
        mine = [r for r in fitting if r.plan.method.value == m]
        fastest = max(mine, key=lambda r: r.tokens_per_sec)
        assert tied(fastest, best)
        assert all(complexity(best.plan) <= complexity(r.plan) for r in mine if tied(fastest, r))
    assert set(st.best_per_method) == {r.plan.method.value for r in fitting}

    by_status = {loss.status: loss for loss in st.losses}
    assert sum(loss.count for loss in st.losses) == len(results) - 1  # everyone but the winner
    assert by_status["fits"].count == len(fitting) - 1
    assert by_status["fits"].nearest is st.ranked[1]
    oom = [r for r in results if r.status is Status.OOM]
    assert by_status["oom"].count == len(oom) > 0
    # the nearest over the GPU budget (an offload plan can fail on host memory alone)
    nearest = min((r for r in oom if r.memory.device_total > ctx.budget_bytes), key=lambda r: r.memory.device_total)
    assert by_status["oom"].nearest.plan.plan_id == nearest.plan.plan_id
    assert by_status["oom"].over_bytes == nearest.memory.device_total - ctx.budget_bytes > 0
    classes = [analysis.reason_class(r, ctx) for r in oom]
    assert by_status["oom"].reason_count == max(classes.count(c) for c in classes)
    assert by_status["oom"].reason in classes and "over the GPU memory budget" in by_status["oom"].reason


def test_the_pareto_front_is_every_non_dominated_fitting_plan(tight_study, fitting_study):
    for study in (tight_study, fitting_study):
        rec, results = stored(study)
        st = analysis.standing(results, rec.context())
        points = {(r.memory.device_total, r.tokens_per_sec) for r in results if r.fits}
        undominated = {p for p in points if not any(q != p and q[0] <= p[0] and q[1] >= p[1] for q in points)}
        front = [(r.memory.device_total, r.tokens_per_sec) for r in st.pareto]
        assert set(front) == undominated
        assert front == sorted(front) and [y for _, y in front] == sorted(y for _, y in front)
        assert st.pareto[-1].tokens_per_sec == st.tiebreak.fastest.tokens_per_sec


def test_nothing_fits_shows_the_closest_plans(hopeless_study):
    rec, results = stored(hopeless_study)
    st = analysis.standing(results, rec.context())
    assert st.best is None and st.ranked == () and st.pareto == ()
    totals = [r.memory.device_total for r in st.closest]
    assert totals == sorted(totals) and len(st.closest) == len(results)
    groups = st.anatomy_subjects(3)
    assert [g.role for g in groups] == ["closest", "closest #2", "closest #3"]
    assert [g.plan for g in groups] == [r.plan for r in st.closest[:3]]


def test_a_measurement_overrides_its_prediction_and_is_shown_beside_it(fitting_study, tmp_path):
    study = fitting_study.copy(tmp_path / "measured.db")
    with study.store() as store:
        rec = store.get_study(study.name)
        before = analysis.standing([t.result() for t in store.trials(rec.id)], rec.context())
        winner, second = before.ranked[0], before.ranked[1]
        # the predicted winner, measured: more activation memory than predicted, still fits
        m = winner.memory
        more = dataclasses.replace(m, activations=m.activations + 2**30, device_total=m.device_total + 2**30)
        store.record_trial(rec.id, dataclasses.replace(winner, evaluator="measured", memory=more))
        # the runner-up, measured: out of memory on the GPU
        store.record_trial(
            rec.id,
            dataclasses.replace(second, evaluator="measured", status=Status.OOM, reason="CUDA out of memory in step 1"),
        )
        after = analysis.standing([t.result() for t in store.trials(rec.id)], rec.context())
    assert len(after.results) == len(before.results)  # one result per plan
    assert after.best.evaluator == "measured" and after.best.memory == more
    assert second.plan.plan_id not in {r.plan.plan_id for r in after.ranked}
    pair = after.evaluations[winner.plan.plan_id]
    assert [r.evaluator for r in pair] == ["analytic", "measured"]
    group = after.anatomy_subjects()[0]
    assert group.role == "winner" and [r.evaluator for r in group.results] == ["analytic", "measured"]
    assert [r.memory.device_total for r in group.results] == [m.device_total, m.device_total + 2**30]


def test_each_toggle_is_one_technique_evaluated_analytically(tight_study):
    rec, results = stored(tight_study)
    ctx = rec.context()
    winner = analysis.standing(results, ctx).best
    effects = analysis.technique_effects(winner.plan, ctx, rec.allowed)
    ev = AnalyticEvaluator()
    assert effects.baseline.memory == ev.evaluate(winner.plan, ctx).memory
    may_change = {
        "checkpointing": {"checkpointing", "checkpoint_every", "checkpoint_ops"},
        "fused loss": {"fused_loss"},
        "fused kernels": {"fused_kernels"},
        "attention": {"attention"},
        "sharding": {"sharding", "offload"},
        "offload": {"offload", "sharding"},
        "micro-batch": {"micro_batch", "grad_accum"},
        "method": {"method", "lora_rank"},
        "LoRA rank": {"lora_rank"},
        "optimizer": {"optimizer"},
        "precision": {"precision"},
        "packing": {"packing"},
        "activation offload": {"offload_activations"},
        "context parallelism": {"context_parallel", "grad_accum", "sharding", "offload", "attention"},
    }
    techniques = {t.technique for t in effects.toggles}
    assert {"checkpointing", "fused loss", "attention", "sharding", "offload", "micro-batch", "method"} <= techniques
    for t in effects.toggles:
        assert plan_problems(t.plan, ctx.model, ctx.cluster, ctx.workload) == []
        changed = {f.name for f in dataclasses.fields(Plan) if getattr(t.plan, f.name) != getattr(winner.plan, f.name)}
        assert changed and changed <= may_change[t.technique], t.label
        again = ev.evaluate(t.plan, ctx)
        assert t.result.memory == again.memory and t.result.throughput == again.throughput
        assert t.memory_delta == again.memory.device_total - effects.baseline.memory.device_total
        assert t.speed_ratio == pytest.approx(again.tokens_per_sec / effects.baseline.tokens_per_sec)
        world = ctx.cluster.world_size
        batch = t.plan.micro_batch * t.plan.grad_accum * t.plan.data_parallel(world)
        assert batch == winner.plan.micro_batch * winner.plan.grad_accum * winner.plan.data_parallel(world)
    ckpt = next(t for t in effects.toggles if t.technique == "checkpointing")
    if winner.plan.checkpointing is Checkpointing.NONE:  # recomputation trades speed for activation memory
        assert ckpt.result.memory.activations < effects.baseline.memory.activations and ckpt.speed_ratio < 1
    for label, problems in effects.skipped:
        assert problems and all(isinstance(p, str) and p for p in problems), label
    assert len({t.plan.plan_id for t in effects.toggles}) == len(effects.toggles)


def test_toggles_keep_to_the_quality_choices_the_user_allowed(fitting_study):
    rec, results = stored(fitting_study)
    ctx = rec.context()
    plan = analysis.standing(results, ctx).best.plan
    lora_only = analysis.technique_effects(
        plan.replace(method=Method.LORA, lora_rank=16), ctx, {"methods": ["lora"], "lora_ranks": [16]}
    )
    assert not [t for t in lora_only.toggles if t.technique == "method"]
    everything = analysis.technique_effects(
        plan.replace(method=Method.LORA, lora_rank=16),
        ctx,
        {"methods": ["full", "lora", "qlora"], "lora_ranks": [16, 64]},
    )
    methods = {t.plan.method for t in everything.toggles if t.technique == "method"}
    assert methods == {Method.FULL, Method.QLORA}
    assert {t.plan.lora_rank for t in everything.toggles if t.technique == "LoRA rank"} == {64}


def test_offload_on_one_gpu_is_toggled_with_the_sharding_it_needs(fitting_study):
    rec, _ = stored(fitting_study)
    ctx = rec.context()
    assert ctx.cluster.world_size == 1
    plain = Plan(precision="bf16-mixed", micro_batch=1, grad_accum=8)  # no sharding, no offload
    assert plan_problems(plain, ctx.model, ctx.cluster, ctx.workload) == []
    effects = analysis.technique_effects(plain, ctx, rec.allowed)
    offloads = [t for t in effects.toggles if t.technique == "offload"]
    assert offloads, effects.skipped
    for t in offloads:
        assert t.plan.offload is not Offload.NONE and t.plan.sharding is not Sharding.NONE
        assert "with sharding" in t.label
    # on one GPU a ZeRO stage without offload divides nothing: skipped, with the reason
    assert any(label.startswith("sharding none → zero1") for label, _ in effects.skipped)


def test_context_parallelism_is_toggled_with_fsdp_at_the_same_global_batch():
    """From a ZeRO-2 plan on 4 GPUs: each row over 2 GPUs, with the FSDP and sdpa it needs, twice the
    accumulation; the rank's activations halve."""
    from autofit.search.request import build_context

    ctx = build_context("llama-3.1-8b", "4xH100", seq_len=16384, global_batch=8)
    plan = Plan(method="lora", lora_rank=16, micro_batch=1, grad_accum=2, sharding="zero2", checkpointing="full")
    effects = analysis.technique_effects(plan, ctx, None)
    (cp,) = [t for t in effects.toggles if t.technique == "context parallelism"]
    assert cp.plan.context_parallel == 2 and cp.plan.sharding is Sharding.FSDP and cp.plan.grad_accum == 4
    assert "context parallel 1 → 2" in cp.label
    assert cp.result.memory.activations < 0.6 * effects.baseline.memory.activations

import optuna
import pytest

from autofit.errors import SpecError
from autofit.plan import Method, Offload, Optimizer, Precision, Sharding
from autofit.search.request import build_context
from autofit.search.space import Allowed, SearchSpace, check_space


def space(model="mistral-7b", gpus="2xA10", global_batch=16, allowed=None, **kw):
    return SearchSpace(build_context(model, gpus, global_batch=global_batch, **kw), allowed or Allowed())


def test_fixed_trial_gives_the_plan():
    s = space()
    plan = s.suggest(
        optuna.trial.FixedTrial(
            {
                "method": "qlora",
                "lora_rank": 16,
                "precision_qlora": "bf16-mixed",
                "optimizer": "adamw",
                "sharding": "zero2",
                "offload_zero2": "none",
                "micro_batch": 4,
                "checkpointing": "full",
                "checkpoint_ops": False,
                "offload_activations": True,
                "attention": "flash2",
                "fused_loss": True,
                "fused_kernels": True,
            }
        )
    )
    assert plan.method is Method.QLORA and plan.micro_batch == 4 and plan.grad_accum == 2
    assert plan.sharding is Sharding.ZERO2 and plan.fused_loss and plan.offload_activations and plan.fused_kernels


def test_op_level_checkpointing_is_searched_in_place_of_full():
    """Under full checkpointing the space asks whether to checkpoint op by op instead; never
    beside FSDP (its own checkpointing), activation offload, or an MoE block."""
    plans = list(space().enumerate())
    ops = [p for p in plans if p.checkpoint_ops]
    assert ops and all(p.checkpointing.value == "selective" and p.checkpoint_every is None for p in ops)
    assert not any(p.sharding is Sharding.FSDP or p.offload_activations for p in ops)
    assert not any(p.checkpoint_ops for p in space("mixtral-8x7b", "8xH100").enumerate())


@pytest.mark.parametrize(
    "model,gpus,seq_len",
    [
        ("mistral-7b", "2xA10", 2048),
        ("llama-3-70b", "8xH100", 2048),
        ("gpt2-xl", "1xT4", 1024),
        ("gemma-2-9b", "1xA100-80GB", 2048),
        ("bert-large-uncased", "4xV100-32GB", 512),
    ],
)
def test_every_plan_of_the_space_is_valid_and_keeps_the_global_batch(model, gpus, seq_len):
    s = space(model, gpus, seq_len=seq_len)
    plans = list(s.enumerate())
    assert len(plans) > 100
    assert check_space(s, iter(plans)) == []
    world = s.ctx.cluster.world_size
    assert all(p.micro_batch * p.grad_accum * p.data_parallel(world) == 16 for p in plans)
    assert len({p.plan_id for p in plans}) == len(plans)


def test_context_parallelism_is_searched_with_fsdp_and_sdpa_on_gpus():
    """Powers of two dividing the GPUs and splitting the row into 2N chunks; FSDP and sdpa only;
    never on a CPU target, with --lengths, or for a model with more than full causal attention."""
    plans = list(space("llama-3.1-8b", "8xH100", seq_len=8192).enumerate())
    split = [p for p in plans if p.context_parallel > 1]
    assert {p.context_parallel for p in split} == {2, 4, 8}
    assert all(p.sharding is Sharding.FSDP and p.attention.value == "sdpa" for p in split)
    assert not any(p.offload_activations for p in split)
    assert not any(p.context_parallel > 1 for p in space("mistral-7b", "8xH100", seq_len=8192).enumerate())
    assert {p.context_parallel for p in space("llama-3.1-8b", "8xH100", seq_len=8).enumerate()} == {1, 2, 4}
    assert not any(p.context_parallel > 1 for p in space("llama-3.2-1b", "2xcpu", seq_len=256).enumerate())


def test_quality_choices_come_only_from_what_is_allowed():
    plans = list(space(allowed=Allowed.parse(methods="lora")).enumerate())
    assert {p.method for p in plans} == {Method.LORA}
    assert {p.optimizer for p in plans} == {Optimizer.ADAMW}
    assert {p.precision for p in plans} == {Precision.BF16_MIXED}
    assert {p.lora_rank for p in plans} == {16}
    t4 = list(space("gpt2", "1xT4", seq_len=1024).enumerate())
    assert {p.precision for p in t4} == {Precision.FP16_MIXED}


def test_conditional_knobs():
    plans = list(space().enumerate())
    assert all((p.lora_rank is None) == (p.method is Method.FULL) for p in plans)
    assert all(
        p.offload is Offload.NONE or p.sharding in (Sharding.ZERO2, Sharding.ZERO3, Sharding.FSDP) for p in plans
    )
    assert not any(p.packing for p in plans)  # no length distribution: packing gains nothing
    single = list(space("gpt2", "1xA10", seq_len=1024).enumerate())
    assert all(p.sharding is Sharding.NONE or p.offload is not Offload.NONE for p in single)


def test_packing_is_searched_with_lengths_and_flash2(tmp_path):
    import json

    f = tmp_path / "h.json"
    f.write_text(json.dumps({"300": 5, "1500": 1}))
    plans = list(space(lengths_path=str(f)).enumerate())
    packed = [p for p in plans if p.packing]
    assert packed and all(p.attention.value == "flash2" for p in packed)


def test_bad_allowed_lists():
    with pytest.raises(SpecError, match="--methods 'full,lorra': 'lorra' is none of full, lora"):
        Allowed.parse(methods="full,lorra")
    with pytest.raises(SpecError, match="--precisions"):
        Allowed.parse(precisions=",")
    with pytest.raises(SpecError, match="--lora-ranks"):
        Allowed.parse(lora_ranks="8,x")


def test_allowed_lists_take_the_names_of_other_tools():
    a = Allowed.parse(optimizers="adamw_torch,adamw_bnb_8bit,adamw,", precisions="bf16,no")
    assert [o.value for o in a.optimizers] == ["adamw", "adamw-8bit"]  # adamw_torch and adamw: one choice
    assert [p.value for p in a.precisions] == ["bf16-mixed", "32-true"]


def test_contradictory_choices_are_refused():
    with pytest.raises(SpecError, match="qlora computes in 16-bit"):
        space(allowed=Allowed.parse(methods="qlora", precisions="32-true"))
    with pytest.raises(SpecError, match="allow fp16-mixed"):
        space("gpt2", "1xT4", seq_len=1024, allowed=Allowed.parse(precisions="bf16-mixed"))
    with pytest.raises(SpecError, match="multiple of the 2 GPUs"):
        space(global_batch=15)


# -- Allowed.from_dict: the inverse of as_dict, and what a study stored -------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from autofit.plan import LoraTargets  # noqa: E402


def _some(enum):
    return st.lists(st.sampled_from(list(enum)), min_size=1, max_size=len(enum), unique=True).map(tuple)


@settings(max_examples=60, deadline=None)
@given(
    methods=_some(Method),
    optimizers=_some(Optimizer),
    precisions=_some(Precision) | st.just(()),
    ranks=st.lists(st.integers(1, 256), min_size=1, max_size=4, unique=True).map(tuple),
    targets=st.sampled_from(list(LoraTargets)),
)
def test_allowed_round_trips(methods, optimizers, precisions, ranks, targets):
    a = Allowed(methods=methods, optimizers=optimizers, precisions=precisions, lora_ranks=ranks, lora_targets=targets)
    assert Allowed.from_dict(a.as_dict()) == a


def test_allowed_from_what_a_study_stored():
    """The store keeps allowed choices as sorted strings, and only the keys given; the rest is the default."""
    from autofit.store.store import _canonical_allowed

    a = Allowed.parse(methods="qlora,lora", lora_ranks="64,8")
    back = Allowed.from_dict(_canonical_allowed(a.as_dict()))
    assert set(back.methods) == set(a.methods) and set(back.lora_ranks) == {8, 64}
    assert Allowed.from_dict({"methods": ["full"]}) == Allowed(methods=(Method.FULL,))
    assert Allowed.from_dict({}) == Allowed()

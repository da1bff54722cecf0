"""Exports launched for real: ``accelerate launch --config_file accelerate_config.yaml train.py``
in the export folder, unchanged, on a tiny local model (weights and a tokenizer saved the way
``save_pretrained`` saves them) and a local JSONL file, with 1 and 2 processes on the CPU.

The exported train.py reads its plan from the files beside it and writes what it ran as to
``<output-dir>/autofit_result.json`` (every rank's engine facts), which the tests read. The first
DeepSpeed run on a machine JIT-builds its shm op: the ``deepspeed_jit_ops`` fixture builds it first.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from autofit.export import export_plan
from autofit.plan import Plan
from autofit.specs import Target, Workload, parse_cluster, resolve_model
from autofit.techniques import deepspeed_buckets
from tests.conftest import tiny

TEXTS = [f"the quick brown fox {i} jumps over the lazy dog number {i * 7}" for i in range(64)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accelerate() -> list[str]:
    exe = Path(sys.executable).parent / "accelerate"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "accelerate.commands.accelerate_cli"]


@pytest.fixture(scope="module")
def local_model(tmp_path_factory) -> Path:
    """A tiny Mistral with random weights and a byte-level BPE tokenizer, in one folder."""
    return _model_folder(tmp_path_factory.mktemp("model"), tiny("mistral-7b"))


@pytest.fixture(scope="module")
def local_olmo2(tmp_path_factory) -> Path:
    """A tiny OLMo-2, a model type no family describes (read by specs/derive.py), in one folder."""
    from tests.evaluators.test_derived import tiny_derived

    return _model_folder(tmp_path_factory.mktemp("olmo2"), tiny_derived("olmo2"))


def _model_folder(folder: Path, spec) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    AutoModelForCausalLM.from_config(spec.to_hf_config()).save_pretrained(folder)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        TEXTS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"], initial_alphabet=alphabet)
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(folder)
    return folder


def _launch(tmp_path: Path, model: Path, gpus: str, global_batch: int, **plan) -> tuple[Path, dict]:
    """Export the plan for ``model`` (as ``--model FOLDER`` reads it), run the exported command in
    the export folder, return the folder and autofit_result.json."""
    ctx = Target(resolve_model(str(model)), parse_cluster(gpus), Workload(seq_len=32, global_batch=global_batch))
    out = tmp_path / "export"
    export_plan(Plan(**plan), ctx, out)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    # the exported launch command; only the rendezvous port is chosen here, so that runs
    # sharing this machine do not collide on accelerate's default 29500
    cmd = [*_accelerate(), "launch", "--config_file", "accelerate_config.yaml", "--main_process_port"]
    cmd += [str(_free_port()), "train.py", "--data", str(data), "--max-steps", "3"]
    # nothing another test left in the environment; autofit as installed
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "PYTHONPATH"))}
    env.update(
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp_path / "datasets"),
        TOKENIZERS_PARALLELISM="false",
    )
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "autofit: plan" in proc.stderr  # the expected-vs-got summary
    return out, json.loads((out / "out" / "autofit_result.json").read_text())


@pytest.mark.slow
def test_one_process_applies_what_the_trainer_has_no_switch_for(tmp_path, local_model):
    plan = dict(
        precision="bf16-mixed",
        micro_batch=4,
        grad_accum=1,
        method="lora",
        lora_rank=8,
        checkpointing="selective",
        checkpoint_every=2,
        fused_loss=True,
        fused_kernels=True,
        offload_activations=True,
        optimizer_in_backward=True,
        attention="sdpa",
    )
    out, result = _launch(tmp_path, local_model, "1xA10", 4, **plan)
    (rank,) = result["ranks"]
    assert result["got"]["world_size"] == 1 and result["got"]["steps"] == 3
    assert result["got"]["tokens_per_sec"] > 0
    assert rank["engine"]["distributed_type"] == "NO"
    assert rank["engine"]["model_class"] == "PeftModelForCausalLM"
    assert rank["engine"]["optimizer_class"] == "BackwardOptimizer"
    assert rank["checkpointed_layers"] == [1]  # one block in 2, counted from 1
    assert rank["offloaded_bytes"] > 0
    assert any("chunked cross-entropy" in a for a in rank["applied"])  # no Liger on the CPU
    assert any("RMSNorm, SwiGLU and RoPE" in a for a in rank["applied"])
    # the adapters learned: LoRA's B starts at zero, so a step in backward moved it
    from safetensors.torch import load_file

    adapters = load_file(out / "out" / "adapter_model.safetensors")
    assert any(float(t.abs().sum()) > 0 for name, t in adapters.items() if "lora_B" in name)
    assert result["got_over_expected"] == {"why_not": "a CPU run: the figures autofit expected are of a GPU"}


@pytest.mark.slow
@pytest.mark.ranks("two launched CPU ranks, a core each")
@pytest.mark.usefixtures("deepspeed_jit_ops")
def test_zero2_export_launches_as_a_two_rank_deepspeed_job(tmp_path, local_model):
    plan = dict(precision="bf16-mixed", micro_batch=2, grad_accum=2, sharding="zero2", attention="sdpa")
    plan.update(checkpointing="selective", checkpoint_ops=True)
    out, result = _launch(tmp_path, local_model, "2xA10", 8, **plan)
    reduce_bucket = deepspeed_buckets(resolve_model(str(local_model)))["reduce_bucket_size"]
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    for r in result["ranks"]:
        e = r["engine"]
        assert e["distributed_type"] == "DEEPSPEED" and e["model_class"] == "DeepSpeedEngine"
        assert e["mixed_precision"] == "bf16" and e["bf16"]
        assert (e["zero_stage"], e["train_batch_size"], e["micro_batch"], e["grad_accum"]) == (2, 8, 2, 2)
        assert e["zero_optimizer"] == "DeepSpeedZeroOptimizer" and e["inner_optimizer"] == "AdamW"
        assert e["reduce_bucket_size"] == reduce_bucket
        assert r["checkpointed_layers"] == [0, 1] and any("op-level" in a for a in r["applied"])
    assert result["got"]["world_size"] == 2 and result["got"]["steps"] == 3
    assert (out / "out" / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.ranks("two launched CPU ranks, a core each")
def test_fsdp_export_shards_on_two_cpu_ranks(tmp_path, local_model):
    """accelerate alone would run this config as two unsharded copies on the CPU (FIELD-NOTES);
    train.py's PlanTrainer switches to FSDP2 as the measured runs do, and the run proves it."""
    plan = dict(precision="bf16-mixed", micro_batch=2, grad_accum=2, sharding="fsdp", checkpointing="full")
    _, result = _launch(tmp_path, local_model, "2xA10", 8, attention="sdpa", **plan)
    assert result["got"]["world_size"] == 2
    for r in result["ranks"]:
        e = r["engine"]
        assert e["distributed_type"] == "FSDP" and e["num_processes"] == 2
        assert e["fsdp_applied_by"] == "autofit (accelerate does not select FSDP on the CPU)"
        assert e["fsdp_param_type"] == "DTensor" and e["fsdp_placements"] == ["S(0)"]
        assert e["fsdp_local_numel"] * 2 == e["fsdp_global_numel"]  # each rank holds half
        assert e["checkpoint_wrappers"] == 2  # FSDP's checkpointing of both decoder layers
        assert e["model_class"].startswith("FSDP")


@pytest.mark.slow
@pytest.mark.ranks("two launched CPU ranks, a core each")
def test_a_derived_model_type_exports_and_launches(tmp_path, local_olmo2):
    """OLMo-2 has no registered family: its LoRA targets are the derived Linear names, FSDP wraps
    the class transformers names (``_no_split_modules``), and the exported job runs on two ranks."""
    spec = resolve_model(str(local_olmo2))
    assert spec.model_type == "olmo2" and spec.analytic_gap
    plan = dict(precision="bf16-mixed", micro_batch=2, grad_accum=2, sharding="fsdp", checkpointing="full")
    _, result = _launch(tmp_path, local_olmo2, "2xA10", 8, attention="sdpa", method="lora", lora_rank=8, **plan)
    assert result["got"]["world_size"] == 2 and result["got"]["steps"] == 3
    for r in result["ranks"]:
        e = r["engine"]
        assert e["distributed_type"] == "FSDP" and e["checkpoint_wrappers"] == 2
        assert e["fsdp_param_type"] == "DTensor" and e["model_class"] == "FSDPPeftModelForCausalLM"


@pytest.fixture(scope="module")
def local_llama(tmp_path_factory) -> Path:
    """A tiny Llama (full causal attention, which context parallelism needs), in one folder."""
    return _model_folder(tmp_path_factory.mktemp("llama"), tiny("llama-3.2-1b"))


@pytest.mark.slow
@pytest.mark.ranks("two launched CPU ranks, a core each")
def test_a_context_parallel_export_runs_the_ring_on_two_cpu_ranks(tmp_path, local_llama):
    """The exported parallelism_config, unchanged: the Trainer's own context parallelism (its
    shift_labels, position_ids and maybe_context_parallel) over FSDP2 on both ranks, the ring through
    evaluators/ring.py on the CPU; each rank counts half of every row's tokens."""
    plan = dict(precision="bf16-mixed", micro_batch=1, grad_accum=2, sharding="fsdp", context_parallel=2)
    _, result = _launch(tmp_path, local_llama, "2xA10", 2, attention="sdpa", **plan)
    assert result["got"]["world_size"] == 2
    tokens = [r["tokens"] for r in result["ranks"]]
    for r in result["ranks"]:
        e = r["engine"]
        assert e["distributed_type"] == "FSDP" and e["fsdp_local_numel"] * 2 == e["fsdp_global_numel"]
        assert e["context_parallel"] == {
            "cp_size": 2,
            "dp_shard_size": 1,
            "cp_comm_strategy": "allgather",
            "mesh": ["cp"],
        }
        # every attention call of 3 steps × 2 micro-batches × 2 layers went through the ring, both ways
        assert r["cpu_ring_calls"] == {"forward": 12, "backward": 12}
    assert tokens[0] == tokens[1] > 0  # the same rows on both ranks

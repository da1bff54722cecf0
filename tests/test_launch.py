"""autofit.launch and the exported train.py without a launch: where the model comes from, the
arguments on this machine, and the clear errors (tests/export/test_launch.py launches them)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autofit import launch
from autofit.errors import ExportError
from autofit.evaluators.analytic import AnalyticEvaluator
from autofit.export import export_files, export_plan, plan_record
from autofit.export.trainer import model_reference
from autofit.plan import Plan
from autofit.specs import MODELS, Target, Workload, parse_cluster, resolve_model
from tests.conftest import tiny

PLAN = Plan(precision="bf16-mixed", micro_batch=2, grad_accum=2, sharding="zero2", attention="sdpa")


def _export(tmp_path, spec=None, plan=PLAN, gpus="2xA10"):
    ctx = Target(spec or tiny("mistral-7b"), parse_cluster(gpus), Workload(seq_len=32, global_batch=8))
    out = tmp_path / "export"
    export_plan(plan, ctx, out)
    return out


def test_a_registered_model_exports_its_hub_id():
    assert model_reference(MODELS["mistral-7b"]) == ("mistralai/Mistral-7B-v0.1", {})


def test_a_local_config_exports_its_folder_and_a_loose_file_a_folder_of_its_own(tmp_path, monkeypatch):
    tiny("mistral-7b").to_hf_config().save_pretrained(tmp_path / "m")
    assert model_reference(resolve_model(str(tmp_path / "m"))) == (str((tmp_path / "m").resolve()), {})
    monkeypatch.chdir(tmp_path)  # a relative path is made absolute: the script runs in the export folder
    assert model_reference(resolve_model("m/config.json"))[0] == str((tmp_path / "m").resolve())

    loose = tmp_path / "my-model.json"
    loose.write_text((tmp_path / "m" / "config.json").read_text())
    ref, files = model_reference(resolve_model(str(loose)))
    assert ref == "model" and files == {"model/config.json": loose.read_text()}
    out = _export(tmp_path, resolve_model(str(loose)))
    assert json.loads((out / "trainer_args.json").read_text())["model"] == "model"
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(out / "model").model_type == "mistral"  # a folder from_pretrained reads
    # ... without weights, which train.py refuses with what to do instead
    with pytest.raises(launch.LaunchError, match="holds a model config but no weights.*--model"):
        launch.model_path(launch.load(out))
    assert "pass `--model` with the hub id or the folder of its weights" in (out / "README.md").read_text()


def test_model_path_reads_the_export_and_what_the_user_gives(tmp_path):
    out = _export(tmp_path)  # tiny() keeps the hub id of the architecture
    exp = launch.load(out)
    assert launch.model_path(exp) == "mistralai/Mistral-7B-v0.1"
    assert launch.model_path(exp, "org/other") == "org/other"
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "config.json").write_text("{}")
    with pytest.raises(launch.LaunchError, match="no weights"):
        launch.model_path(exp, str(weights))
    (weights / "model.safetensors").write_bytes(b"")
    assert launch.model_path(exp, str(weights)) == str(weights)
    with pytest.raises(launch.LaunchError, match="not a file"):
        launch.model_path(exp, str(weights / "config.json"))


def test_an_exported_folder_missing_on_this_machine_is_named(tmp_path):
    out = _export(tmp_path)
    args = json.loads((out / "trainer_args.json").read_text())
    args["model"] = str(tmp_path / "gone")
    (out / "trainer_args.json").write_text(json.dumps(args))
    with pytest.raises(launch.LaunchError, match="is not on this machine: pass --model"):
        launch.model_path(launch.load(out))


def test_load_refuses_a_folder_without_the_export_and_a_masked_lm(tmp_path):
    with pytest.raises(launch.LaunchError, match="cannot read plan.json.*autofit export"):
        launch.load(tmp_path)
    bert = Plan(precision="bf16-mixed", micro_batch=2, grad_accum=4, attention="sdpa")
    out = _export(tmp_path, tiny("bert-large-uncased"), plan=bert, gpus="1xA10")
    with pytest.raises(launch.LaunchError, match="trains causal LMs"):
        launch.load(out)


def test_training_arguments_on_this_cpu(tmp_path):
    plan = PLAN.replace(fused_loss=True)
    exp = launch.load(_export(tmp_path, plan=plan))
    ta = launch.training_arguments(exp, output_dir="o", max_steps=3)
    assert ta["use_cpu"] and ta["output_dir"] == "o" and ta["max_steps"] == 3
    assert "use_liger_kernel" not in ta and "liger_kernel_config" not in ta  # PlanTrainer stands in
    assert ta["deepspeed"] == str(exp.directory / "ds_config.json")  # whatever the working directory
    from transformers import TrainingArguments

    TrainingArguments(**ta)  # transformers takes them as they are


def test_plan_json_holds_what_the_plan_was_judged_by(tmp_path):
    ctx = Target(tiny("mistral-7b"), parse_cluster("2xA10"), Workload(seq_len=32, global_batch=8))
    result = AnalyticEvaluator().evaluate(PLAN, ctx)
    record = json.loads(export_files(PLAN, ctx, expected=result)["plan.json"])
    assert Plan.from_dict(record["plan"]) == PLAN and record["plan_id"] == PLAN.plan_id
    assert record["target"] == {
        "model": "tiny-mistral-7b",
        "task": "causal-lm",
        "gpus": "2xA10",
        "world_size": 2,
        "seq_len": 32,
        "global_batch": 8,
    }
    exp = record["expected"]
    assert exp["evaluator"] == "analytic" and exp["gpu"] == "A10"
    assert exp["peak_allocated_bytes"] == result.memory.peak_allocated
    assert exp["tokens_per_sec"] == result.throughput.tokens_per_sec
    assert plan_record(PLAN, ctx)["expected"] is None
    with pytest.raises(ExportError, match="expected figures are of plan"):
        plan_record(PLAN.replace(micro_batch=1, grad_accum=4), ctx, result)


def test_train_py_explains_its_options_and_needs_data(tmp_path):
    out = _export(tmp_path)
    run = [sys.executable, str(out / "train.py")]
    helped = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0
    for option in ("--data", "--text-field", "--output-dir", "--max-steps", "--model"):
        assert option in helped.stdout
    missing = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "--data" in missing.stderr


def test_the_readme_shows_the_script_as_exported():
    from pathlib import Path

    from autofit.export import train_script

    script = train_script()
    main = script[script.index("def main(") : script.index("\n\nif __name__")]
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    launch_section = readme[readme.index("## Launch") :]
    assert "accelerate launch --config_file accelerate_config.yaml train.py --data" in launch_section
    assert main in launch_section, "README's Launch section shows train.py's main() as exported"


def test_a_compiled_checkpointed_plan_lets_dynamo_compile_the_checkpointed_block(tmp_path, monkeypatch):
    """The exported run sets what the measured child sets (runtime.compile_checkpointed_blocks):
    without it dynamo runs a checkpointed block eagerly, and the plan would compile nothing."""
    import torch
    from transformers import TrainingArguments

    from autofit.evaluators import runtime as rt

    spec = tiny("llama-3.2-1b")
    plan = Plan(method="lora", lora_rank=8, precision="32-true", micro_batch=2, grad_accum=4, checkpointing="full")
    plan = plan.replace(torch_compile=True)
    exp = launch.load(_export(tmp_path, spec=spec, plan=plan, gpus="1xA10"))
    ta = launch.training_arguments(exp, output_dir=str(tmp_path / "o"), max_steps=1, report_to=[])
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "True")  # restored after the test
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=False):
        launch.PlanTrainer(model=rt.build_model(spec, plan), args=TrainingArguments(**ta), export=exp)
        assert torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint

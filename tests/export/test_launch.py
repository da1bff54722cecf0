"""An exported DeepSpeed ZeRO-2 plan, launched for real: 2 processes on the CPU.

``accelerate launch --config_file accelerate_config.yaml train.py`` in the export directory,
with the exported ds_config.json and trainer_args.json read by accelerate, DeepSpeed and the
Hugging Face Trainer. The first run on a machine JIT-builds DeepSpeed's shm op (about a
minute). FSDP is not launched: accelerate runs FSDP configs undistributed on the CPU
(FIELD-NOTES), so such a run would prove nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from autofit.export import export_plan
from autofit.plan import Plan
from autofit.specs import Target, Workload, parse_cluster
from autofit.techniques import deepspeed_buckets
from tests.conftest import tiny


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accelerate() -> list[str]:
    exe = Path(sys.executable).parent / "accelerate"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "accelerate.commands.accelerate_cli"]


@pytest.mark.slow
def test_zero2_export_launches_as_a_two_rank_deepspeed_job(tmp_path):
    spec = tiny("mistral-7b")
    ctx = Target(spec, parse_cluster("2xA10"), Workload(seq_len=32, global_batch=8))
    plan = Plan(precision="bf16-mixed", micro_batch=2, grad_accum=2, sharding="zero2", attention="sdpa")
    out = tmp_path / "export"
    export_plan(plan, ctx, out)
    shutil.copy(Path(__file__).with_name("launch_train.py"), out / "train.py")
    spec.to_hf_config().save_pretrained(tmp_path / "model")

    # the exported launch command; only the rendezvous port is chosen here, so that runs
    # sharing this machine do not collide on accelerate's default 29500
    cmd = _accelerate() + [
        "launch",
        "--config_file",
        "accelerate_config.yaml",
        "--main_process_port",
        str(_free_port()),
        "train.py",
        str(tmp_path / "model"),
    ]
    # the script needs only the libraries, not autofit, and nothing another test left in the environment
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "PYTHONPATH"))}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]

    results = [json.loads((out / f"result-{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["rank"] for r in results] == [0, 1]
    reduce_bucket = deepspeed_buckets(spec)["reduce_bucket_size"]
    for r in results:
        assert r["world_size"] == 2 and r["num_processes"] == 2
        assert r["distributed_type"] == "DEEPSPEED"
        assert r["engine"] == "DeepSpeedEngine"
        assert r["mixed_precision"] == "bf16" and r["param_dtype"] == "torch.bfloat16"
        assert (r["zero_stage"], r["train_batch_size"], r["micro_batch"], r["grad_accum"]) == (2, 8, 2, 2)
        assert r["reduce_bucket_size"] == reduce_bucket
        assert r["zero_optimizer"] == "DeepSpeedZeroOptimizer" and r["inner_optimizer"] == "AdamW"
        assert r["steps"] == 2 and r["loss_finite"]

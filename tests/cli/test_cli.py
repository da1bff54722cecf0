import json

import pytest
from click.testing import CliRunner

from autofit.cli import cli


def run(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_estimate_json_schema():
    r = run(
        "estimate",
        "--model",
        "mistral-7b",
        "--gpus",
        "2xA10",
        "--method",
        "qlora",
        "--checkpointing",
        "full",
        "--attention",
        "flash2",
        "--fused-loss",
        "--seq-len",
        "2048",
        "--global-batch",
        "16",
        "--json",
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert set(data["memory"]) >= {
        "weights",
        "gradients",
        "optimizer",
        "activations",
        "temporary",
        "logits",
        "overhead",
        "peak_allocated",
        "peak_reserved",
        "device_total",
    }
    assert (
        sum(
            data["memory"][c]
            for c in ("weights", "gradients", "optimizer", "activations", "temporary", "logits", "overhead")
        )
        == data["memory"]["device_total"]
    )
    assert data["fits"] is True and data["capacity_bytes"] == 23028 * 2**20
    assert data["throughput"]["tokens_per_sec"] > 0 and data["throughput"]["step_time_s"] > 0
    assert data["plan"]["method"] == "qlora" and data["plan"]["grad_accum"] == 8


def test_estimate_table():
    r = run("estimate", "-m", "gpt2", "-g", "1xT4", "--global-batch", "8", "--micro-batch", "8", "--seq-len", "1024")
    assert r.exit_code == 0, r.output
    assert "device_total" in r.output and "tokens/s" in r.output and "fp16-mixed" in r.output


@pytest.mark.parametrize("cmd", ["gpus", "models"])
def test_catalogs_json(cmd):
    r = run(cmd, "--json")
    assert r.exit_code == 0
    assert len(json.loads(r.stdout)) >= 15


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--model", "mistral-7", "--gpus", "2xA10"], "unknown model"),
        (["--model", "mistral-7b", "--gpus", "2xA11"], "unknown GPU"),
        (["--model", "mistral-7b", "--gpus", "0xA10"], "at least 1"),
        (["--model", "mistral-7b", "--gpus", "2xA10x3"], "malformed"),
        (["--model", "mistral-7b", "--gpus", "2xA10", "--micro-batch", "0"], "--micro-batch"),
        (["--model", "mistral-7b", "--gpus", "2xA10", "--global-batch", "3"], "not divisible"),
        (
            ["--model", "mistral-7b", "--gpus", "1xV100-16GB", "--precision", "bf16-mixed", "--attention", "flash2"],
            "use fp16-mixed",
        ),
        (["--model", "mistral-7b", "--gpus", "1xA10", "--seq-len", "0"], "--seq-len"),
    ],
)
def test_bad_input_is_one_clear_line(args, fragment):
    r = CliRunner().invoke(cli, ["estimate", *args])
    assert r.exit_code != 0
    assert fragment in r.output
    assert "Traceback" not in r.output
    assert len([line for line in r.output.strip().splitlines() if line.startswith("Error")]) == 1


def test_the_names_of_other_tools_are_echoed_as_ours():
    """transformers', the Trainer's and accelerate's names for a choice; the plan line says ours."""
    r = run(
        "estimate",
        *("--model", "gpt2", "--gpus", "1xA10", "--seq-len", "1024", "--num-machines", "1"),
        *("--attention", "flash_attention_2", "--optimizer", "adamw_torch", "--precision", "bf16"),
    )
    assert r.exit_code == 0, r.output
    assert "plan: full · bf16-mixed · adamw · mb1×ga16 · flash2" in r.output
    bad = CliRunner().invoke(cli, ["estimate", "--model", "gpt2", "--gpus", "1xA10", "--attention", "flash3"])
    assert bad.exit_code != 0 and "'flash3' is none of eager, sdpa, flash2 (also flash_attention_2)" in bad.output


def test_every_command_has_help():
    for name, cmd in cli.commands.items():
        assert cmd.help and len(cmd.help) > 10, name
        assert run(name, "--help").exit_code == 0
